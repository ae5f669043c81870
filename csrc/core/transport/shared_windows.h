// Memory that every rank of a group can read and write in place, for
// algorithms that work on their peers' data where it lies instead of sending
// it (algorithms/shm_chunks.h). A transport offers it only when every
// rank of the group runs on this host and the pairs are linked by shared
// memory; else Transport::sharedWindows() is null.
//
// Each rank owns one window (two halves, so that a chunk can be filled while
// the peers still read the previous one) and a control block whose counters
// only it writes. Waiting on a peer's counter is bounded: a dead or failed
// peer, or the deadline, ends it with an error, never a hang.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "transport.h"

namespace collx {

// What the shared-memory collectives read from the peers' memory in place,
// in rising order: nothing; the reads that stand for a copy into a window and
// one out of it (all_gather's blocks, the all-reduce's slices); or those too
// that stand for one copy in and feed a reduction (reduce_scatter's pieces,
// read into a scratch and reduced from there). Every rank must be able to
// (cross-memory attach, which a ptrace policy may refuse), and unless
// COLLX_SHM_CMA=1 the read must pay as the ranks measured it
// (shm::kMaxCopyReadCost, shm::kMaxReduceReadCost).
enum class PeerReads { kNone, kCopies, kAll };

struct alignas(64) WindowControl {
  std::atomic<uint32_t> bell;      // bumped to wake this rank when it sleeps (a futex word)
  std::atomic<uint32_t> sleeping;  // this rank sleeps on `bell`
  char pad0[56];
  // Chunks this rank has posted (copied in), and the op of the chunk in each
  // half, which every peer checks before any result is written. In one
  // line: the peer that waited for `posted` holds the identity too. Per
  // half: a rank may post its next chunk, in the other half, before a
  // slower peer has checked this one.
  std::atomic<uint64_t> posted;
  struct Op {
    std::atomic<uint64_t> seq;    // the group's sequence number of the op
    std::atomic<uint64_t> count;  // its element count
    std::atomic<uint64_t> shape;  // kind, dtype and a broadcast's root (shapeOf)
  } op[2];
  // Chunks this rank has reduced (its slice) and gathered (copied out).
  alignas(64) std::atomic<uint64_t> reduced;
  alignas(64) std::atomic<uint64_t> gathered;
  // The user's collective this rank last started and last completed, and
  // the kind of the one started, for a peer's timeout report: a peer stopped
  // or stuck elsewhere cannot answer, but its last word stays here.
  alignas(64) std::atomic<uint64_t> started;
  std::atomic<uint64_t> completed;
  // The user's collective this rank last posted a frame of on its
  // connections (rings, sockets). A peer that waits in the windows for an op
  // this rank runs over its connections and posted none of here, while the
  // peer ran none of it there, sees a mismatched collective: neither would
  // ever see the other's data.
  std::atomic<uint64_t> linked;
  std::atomic<uint32_t> startedKind;
  // The core this rank's op thread last ran on, plus one (0: not known),
  // noted as its ops start and where a wait found its core shared
  // (Device::Windows::unstack).
  std::atomic<int32_t> cpu;

  static uint64_t shapeOf(uint32_t kind, uint32_t dtype, uint32_t root) {
    return uint64_t(kind & 0xff) | uint64_t(dtype & 0xff) << 8 | uint64_t(root) << 32;
  }
};
static_assert(offsetof(WindowControl, reduced) - offsetof(WindowControl, posted) == 64,
              "posted and the identity share one cache line");

class SharedWindows {
 public:
  virtual ~SharedWindows() = default;

  // Bytes of each half of a window.
  virtual size_t halfBytes() const = 0;
  virtual char* window(int rank) = 0;
  virtual WindowControl& control(int rank) = 0;

  // Which collectives read the peers' memory in place (readPeer) instead of
  // through the windows (PeerReads). The ranks agreed on it when the group
  // was made, so all choose alike.
  virtual PeerReads peerReads() const = 0;
  // Copies `bytes` from `address` in rank r's memory into dst. Throws Error,
  // breaking the group, if it cannot (the peer died).
  virtual void readPeer(int r, uint64_t address, void* dst, size_t bytes) = 0;
  // Counts bytes that this rank placed for its peers (its window, or its
  // memory for readPeer) and copied from theirs: the algorithms move them,
  // readPeer counts its own reads. counters() may be read from any thread.
  virtual void count(Carrier c, uint64_t sent, uint64_t received) = 0;
  virtual TransportCounters counters() const = 0;

  // Throws the error that broke the group, if one did (a broken rank must
  // not post, or its peers would take its data for this op's), or breaks it
  // if a peer failed, or rejected an op up to #seq that this rank ran: its
  // abort or cancel frame, or a message of an op this rank rejected, waits
  // in the peer's channel.
  virtual void checkGroup(uint64_t seq) = 0;
  // After this rank moved a counter: wakes the peers that sleep.
  virtual void publish() = 0;
  // Spins, then sleeps, until ready(); checks the peers' health meanwhile.
  // Throws Error when a peer failed or died, TimeoutError at the deadline;
  // either breaks the group, naming what(): what this rank waited for.
  virtual void waitFor(const std::function<bool()>& ready, Deadline deadline,
                       const std::function<std::string()>& what) = 0;
  // Breaks the group with `why` (peers waiting on it fail with the reason).
  [[noreturn]] virtual void fail(const std::string& why) = 0;
  // The peers a wait on every peer's counter that failed still waited for
  // (Device::missing).
  virtual void noteMissing(std::vector<int> ranks) = 0;
};

}  // namespace collx
