// The byte stream of one connection to one peer: the TCP socket, or, for a
// peer on the same host, a pair of shared-memory rings (shm/links.h). With
// rings, the socket stays open beside them for two things only: the doorbell
// of a side that sleeps in poll() (one byte, see shm/ring.h) and the peer's
// death, which the kernel reports by closing it. Pair and P2PLink frame
// their messages on top and never see which one it is.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <memory>
#include <string>

#include "../shm/links.h"
#include "socket.h"

namespace collx::tcp {

class Stream {
 public:
  // An invalid `socket`: a stream not connected yet (attach()).
  Stream(Socket socket, std::unique_ptr<shm::Link> rings);
  void attach(Socket socket);

  int fd() const { return socket_.fd(); }
  bool valid() const { return socket_.valid(); }
  bool usesShm() const { return rings_ != nullptr; }
  void close() { socket_.reset(); }

  // As sendmsg / recv with MSG_DONTWAIT: bytes moved, 0 at the peer's end
  // (recv), -1 with errno (EAGAIN: nothing can move now). A ring's peer end
  // is reported only once the bytes it sent before are read.
  ssize_t sendv(const iovec* iov, int n);
  ssize_t recvSome(void* data, size_t bytes);
  size_t writableNow() const;  // rings: free bytes; sockets: unknown, SIZE_MAX

  // Rings only (sockets: nothing, ""): an abort reason that does not wait for
  // space in the stream (shm/ring.h), and the peer's.
  void leaveAbortNote(const std::string& why);
  std::string peerAbortNote() const;

  // Rings only. Before sleeping in poll() on fd() for POLLIN: asks the peer
  // to ring when it moves, for `read` (bytes arriving) and `write` (space
  // freed); false if it already moved (then do not sleep).
  bool prepareSleep(bool read, bool write);
  // After poll(): takes the requests back and drains the doorbell; a socket
  // at its end marks the peer gone.
  void afterSleep(short revents);

 private:
  void ringDoorbell();

  Socket socket_;
  std::unique_ptr<shm::Link> rings_;
  bool peerClosed_ = false;
};

}  // namespace collx::tcp
