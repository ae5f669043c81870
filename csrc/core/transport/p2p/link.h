// The byte level of one p2p connection: a queue of outgoing frames (header
// plus optional payload, batched into sendmsg) and a reader that hands out
// incoming headers and then their payloads. What the frames mean, and where
// payloads go, is the P2PEngine's business. Not thread-safe: the engine
// calls it under its lock.
#pragma once

#include <deque>
#include <string>
#include <vector>

#include "../socket/outgoing.h"
#include "../socket/rx_buffer.h"
#include "../socket/stream.h"
#include "../socket/wire.h"

namespace collx::tcp {

class P2PLink {
 public:
  // `rings`: shared memory to a peer on this host, or null for the socket.
  P2PLink(int rank, int peer, Socket socket, std::unique_ptr<shm::Link> rings);

  int fd() const { return stream_.fd(); }
  bool alive() const { return stream_.valid(); }
  // The progress thread's sleep, for rings (stream.h).
  bool usesShm() const { return stream_.usesShm(); }
  bool prepareSleep() { return stream_.prepareSleep(true, wantsWrite()); }
  void afterSleep(short revents) { stream_.afterSleep(revents); }
  bool wantsWrite() const { return !frames_.empty(); }

  // Queues a frame; `payload` (header.bytes of it, or none if null) must stay
  // valid until write() reports `id` as written.
  void queue(const FrameHeader& header, const void* payload, uint64_t id);
  // Drops a queued frame whose first byte has not left yet; false otherwise.
  bool unqueue(uint64_t id);
  // Whether frame `id` is queued with some of it written (it must finish).
  bool writing(uint64_t id) const;

  // Writes what the socket takes without blocking; appends the ids of the
  // frames written completely. Throws Error when the connection fails.
  void write(std::vector<uint64_t>& written);

  // The next header, once it has fully arrived. Throws like write().
  bool readHeader(FrameHeader& header);
  // Reads up to `want` payload bytes of the current frame into `dst` (null:
  // discards them); returns how many arrived (0: none now).
  size_t readPayload(char* dst, size_t want);

  // Closes the connection; the peer sees it closed.
  void close() { stream_.close(); }

 private:
  // Ensures `want` bytes sit in the receive buffer; false if not yet.
  bool fill(size_t want);
  // Whether a receive moved bytes: false if none can move now; throws
  // where the peer closed or the receive failed.
  bool received(Received r) const;
  [[noreturn]] void fail(const std::string& what, int err) const;

  int rank_;
  int peer_;
  Stream stream_;
  std::deque<OutFrame> frames_;
  RxBuffer rx_;
};

}  // namespace collx::tcp
