// Point-to-point messages with gloo's semantics, beside the ordered
// collective channel (transport.h):
//
//   - postSend / postRecv return at once; every posted op progresses on its
//     own, concurrently with the other p2p ops and with the group's
//     collectives, so `irecv(prev); isend(next); wait()` completes;
//   - messages between one pair with one tag match in posting order;
//     different tags match independently;
//   - a receive from any source takes the first message with its tag from
//     any peer;
//   - a size or dtype mismatch fails the op(s) before user memory is written;
//   - a dead peer fails its pending ops at once; each op has its own deadline.
//
// p2p/engine.h implements it.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <string>

#include "transport.h"

namespace collx {

constexpr int kAnySource = -1;

// Tags are 64-bit: the user's 32-bit tag below, a space above, so that
// collx's own messages (the monitored barrier) never meet the user's.
constexpr uint64_t kMonitoredBarrierTags = 1ull << 32;

// Called once per op, when it completes or fails (error set), from whichever
// thread finished it, never under a lock of the channel. `source`: the peer
// the message came from (useful for a receive from any source).
using P2PDone = std::function<void(int source, std::exception_ptr error)>;

struct P2PBuffer {
  void* data;
  size_t bytes;
  DataType dtype;
};

class PointToPoint {
 public:
  virtual ~PointToPoint() = default;

  // The buffer must stay valid until `done` is called. A send completes when
  // its bytes are handed to the transport (the buffer may be reused then).
  virtual void postSend(int peer, uint64_t tag, P2PBuffer buffer, Deadline deadline, P2PDone done) = 0;
  // `peer` may be kAnySource.
  virtual void postRecv(int peer, uint64_t tag, P2PBuffer buffer, Deadline deadline, P2PDone done) = 0;

  // A waiter about to block: drive progress in this thread until `finished`
  // returns true or `budget` has passed, which saves the wakeups of a
  // handoff from the background progress thread for a quick reply.
  virtual void spin(const std::function<bool()>& finished, std::chrono::microseconds budget) = 0;

  // Payload bytes of the completed ops (thread-safe).
  virtual TransportCounters counters() const = 0;

  // Fails every pending op with `why` and stops; later posts fail at once.
  virtual void close(const std::string& why) = 0;
};

}  // namespace collx
