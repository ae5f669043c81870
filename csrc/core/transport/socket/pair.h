// One connection to one peer, as a non-blocking state machine: a queue of
// sends (header + payload, batched into sendmsg) and a queue of receives that
// match arriving frames in order, over a Stream (a socket, or shared-memory
// rings for a peer on this host). The Device's poll loop drives it.
#pragma once

#include <cstdint>

#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "outgoing.h"
#include "rx_buffer.h"
#include "stream.h"
#include "wire.h"

namespace collx::tcp {

class Pair {
 public:
  // `cancelled`: the collectives this rank cancelled (owned by the Device);
  // a peer's cancel frame for one of them is skipped, any other fails the op.
  // `shm`: the rings to a peer on this host, or null for TCP. An invalid
  // `socket`: ops queue until connect() (a lazy group's first use).
  Pair(int rank, int peer, Socket socket, const std::set<uint64_t>* cancelled,
       std::unique_ptr<shm::Link> shm = nullptr);
  bool connected() const { return connected_; }
  void connect(Socket socket) {
    stream_.attach(std::move(socket));
    connected_ = true;
  }

  int fd() const { return stream_.fd(); }
  int peer() const { return peer_; }
  bool wantsWrite() const { return !sends_.empty(); }
  bool wantsRead() const { return !recvs_.empty(); }
  bool usesShm() const { return stream_.usesShm(); }

  // Rings only (Stream): before the Device sleeps in poll(). `read`: for
  // bytes arriving too (a pair waiting only to send still listens for an
  // abort or cancel frame).
  bool prepareSleep(bool read) { return stream_.prepareSleep(read, !sends_.empty()); }
  void afterSleep(short revents) { stream_.afterSleep(revents); }

  void postSend(const Frame& frame, const void* data, size_t bytes, uint64_t cookie);
  void postRecv(const Frame& frame, void* data, size_t bytes, uint64_t cookie);

  // Move as many bytes as the socket takes without blocking; append cookies of
  // completed ops. Throw Error when the peer is gone or sent a wrong frame.
  void progressSend(std::vector<uint64_t>& done);
  void progressRecv(std::vector<uint64_t>& done);

  // For a pair this rank only sends to, or waits on in shared memory: reads
  // what the peer sent meanwhile and throws if it is an abort, a cancel of an
  // op not cancelled here, a message of an op this rank rejected (which no
  // receive will ever take), or the end of the connection, so that a rank
  // blocked on a peer that will not come fails now with the peer's reason.
  // Anything else is left for the receive that will check it, and so is a
  // cancel of an op after `upTo`, which this rank may yet reject too.
  // `endIsError` false: the end of the connection is no error either. An
  // abort frame throws only as checkAbort(abortsUpTo) says.
  void checkControl(uint64_t upTo = UINT64_MAX, bool endIsError = true, uint64_t abortsUpTo = UINT64_MAX);
  // Only an abort frame (or a ring's note) of a peer that will not finish a
  // collective up to `upTo` throws: a frame carries the first collective its
  // rank did not finish, so a peer that finished this op, or failed in a
  // later one, leaves this one to finish. The end of the connection does
  // not throw.
  void checkAbort(uint64_t upTo);
  bool hasBufferedHeader() const { return rx_.size() >= sizeof(FrameHeader); }
  // The peer's end of the connection has been read (it may have finished
  // and left).
  bool ended() const { return ended_; }

  // A short description of what this pair still waits for, for timeouts.
  std::string describePending() const;

  uint64_t bytesSent() const { return bytesSent_; }
  uint64_t bytesReceived() const { return bytesReceived_; }

  void close() { stream_.close(); }

  // Best effort: tells the peer why this rank gives up. A message half sent
  // is finished first if the peer takes it by `deadline`, so the abort frame
  // starts at a frame boundary; else the peer just sees the connection close.
  // `seq`: the first collective this rank will not finish (checkAbort).
  void sendAbort(const std::string& reason, Deadline deadline, uint64_t seq);
  // Throws the peer's abort note (a ring's), left where its frame did not fit.
  void throwIfAbortNoted() const;

 private:
  struct RecvOp {
    Frame expect;
    char* data;
    size_t bytes;
    size_t got;
    bool headerDone;
    uint64_t cookie;
  };

  // Ensures at least `want` bytes sit in the receive buffer; false if the
  // socket has no more right now.
  bool fill(size_t want, bool endIsError = true);
  void checkHeader(const FrameHeader& h, const RecvOp& op);
  // At a cancel frame: false if it is not complete yet; true once a frame for
  // a collective this rank cancelled too is consumed; throws for any other.
  bool skipCancel(const FrameHeader& h);
  // Throws if `h` belongs to a collective this rank cancelled.
  void throwIfRejectedHere(const FrameHeader& h) const;
  // Throws the reason carried by a peer's abort frame.
  [[noreturn]] void throwAbort(const FrameHeader& h);
  // After a send failed because the peer closed: its abort frame may still sit
  // unread behind data of the current op; throws its reason if found.
  void throwSalvagedAbort();
  // At the peer's end of the stream: throws the abort note it left, if any.
  [[noreturn]] void failClosed() const;  // the note, or "closed by the peer"
  [[noreturn]] void fail(const std::string& what, int err) const;
  // Sends the rest of the half-sent front message; false if not by `deadline`.
  bool finishPartialSend(Deadline deadline);

  int rank_;
  int peer_;
  Stream stream_;
  bool connected_;
  const std::set<uint64_t>* cancelled_;
  std::deque<OutFrame> sends_;
  std::deque<RecvOp> recvs_;

  // Small frames arrive several per recv(); large payloads bypass this buffer.
  RxBuffer rx_;
  bool ended_ = false;

  uint64_t bytesSent_ = 0;
  uint64_t bytesReceived_ = 0;
};

}  // namespace collx::tcp
