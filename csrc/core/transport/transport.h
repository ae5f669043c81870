// The abstract transport: framed, ordered point-to-point messages between the
// ranks of one group. Algorithms see only this interface; device.h implements it.
//
// Every message carries a Frame (op kind, dtype, sequence number, tag) and its
// byte count. The receiver posts what it expects; a peer sending anything else
// is reported as a mismatched collective, before a byte reaches user memory.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../types.h"

namespace collx {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

struct Frame {
  OpKind kind;
  DataType dtype;
  uint64_t seq;  // collective sequence number of the group
  uint32_t tag;  // algorithm-defined, e.g. step and segment
};

// The ways bytes move between ranks. A rank counts what it hands to a peer
// (written to a socket or ring, placed in its window or exposed by address
// for the peers to read) as sent, and what it takes from a peer (read from a
// socket or ring, copied out of a peer's window or memory) as received.
enum class Carrier : uint8_t {
  kTcp,          // sockets
  kShmRing,      // the shared-memory rings that stand in for a socket on one host
  kShmWindow,    // the shared windows of the shm collectives
  kPeerMemory,   // cross-memory attach (process_vm_readv) of a peer's buffer
  kDevicePeers,  // the CUDA peers path (device buffers mapped by every rank)
};
inline constexpr int kCarriers = 5;
inline const char* name(Carrier c) {
  static constexpr const char* kNames[kCarriers] = {"tcp", "shm_ring", "shm_window", "peer_memory", "cuda_peers"};
  return kNames[int(c)];
}

struct TransportCounters {
  uint64_t sent[kCarriers] = {};
  uint64_t received[kCarriers] = {};

  void add(Carrier c, uint64_t bytesSent, uint64_t bytesReceived) {
    sent[int(c)] += bytesSent;
    received[int(c)] += bytesReceived;
  }
  uint64_t bytesSent() const {
    uint64_t s = 0;
    for (uint64_t v : sent) s += v;
    return s;
  }
  uint64_t bytesReceived() const {
    uint64_t s = 0;
    for (uint64_t v : received) s += v;
    return s;
  }
  TransportCounters& operator+=(const TransportCounters& o) {
    for (int i = 0; i < kCarriers; ++i) {
      sent[i] += o.sent[i];
      received[i] += o.received[i];
    }
    return *this;
  }
};

// TransportCounters that one thread adds to while any thread reads them.
class SharedCounters {
 public:
  void add(Carrier c, uint64_t sent, uint64_t received) {
    sent_[int(c)].fetch_add(sent, std::memory_order_relaxed);
    received_[int(c)].fetch_add(received, std::memory_order_relaxed);
  }
  TransportCounters snapshot() const {
    TransportCounters t;
    for (int i = 0; i < kCarriers; ++i) {
      t.sent[i] = sent_[i].load(std::memory_order_relaxed);
      t.received[i] = received_[i].load(std::memory_order_relaxed);
    }
    return t;
  }

 private:
  std::atomic<uint64_t> sent_[kCarriers] = {}, received_[kCarriers] = {};
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Which machine `rank` runs on: ranks with equal indices share a host. A
  // transport that cannot tell puts every rank on host 0.
  virtual int host(int rank) const { return 0; }
  // How many distinct hosts the ranks run on.
  virtual int hostCount() const {
    std::vector<int> seen;
    for (int r = 0; r < size(); ++r) {
      if (std::find(seen.begin(), seen.end(), host(r)) == seen.end()) seen.push_back(host(r));
    }
    return int(seen.size());
  }

  // Queue one message to / from `peer`. Messages to a peer leave in post
  // order; receives from a peer match arriving messages in post order. The
  // buffer must stay valid until waitSome returns the op's cookie, which
  // is below 2^63 (the top bit is the transport's own).
  virtual void postSend(int peer, const Frame& frame, const void* data, size_t bytes,
                        uint64_t cookie) = 0;
  virtual void postRecv(int peer, const Frame& frame, void* data, size_t bytes,
                        uint64_t cookie) = 0;

  // Drives every posted op until at least one completes; appends the cookies
  // of the completed ops to `done`. Throws Error on a dead peer or mismatched
  // frame and TimeoutError at the deadline. After an error the transport is
  // broken: queued ops are dropped and every later call throws the same error.
  virtual void waitSome(std::vector<uint64_t>& done, Deadline deadline) = 0;

  // Above zero while a posted op has not been returned by waitSome (a
  // count of the transport's own units: a striped message counts pieces).
  virtual size_t pending() const = 0;

  virtual TransportCounters counters() const = 0;

  // Whether some pairs connect at their first op (a lazy group): then an
  // all-to-all pattern connects every pair, which a group of many ranks
  // must not do for its own bookkeeping.
  virtual bool connectsOnUse() const { return false; }

  // Every rank's memory, where all ranks share this host (shared_windows.h).
  virtual class SharedWindows* sharedWindows() const { return nullptr; }

  // Closes every connection; later calls throw. Safe to call twice.
  virtual void close() = 0;
};

// Waits until no op is pending.
inline void waitAll(Transport& t, Deadline deadline) {
  std::vector<uint64_t> done;
  while (t.pending() > 0) {
    done.clear();
    t.waitSome(done, deadline);
  }
}

}  // namespace collx
