// The chunk protocol of the shared-memory collectives (shm_allreduce.cc,
// shm_collectives.cc): a large buffer streams through every rank's window in
// chunks, the two halves of each window alternating, with three counter
// rounds that every rank's control block publishes:
//
// forEach() runs a chunk at a time between begin() and gathered():
//
//   begin()     this half is free in every window: every rank has gathered
//               chunk k-2, since it posted chunk k-1, which my post of it
//               waited for (a rank may fill chunk k while the peers still
//               read chunk k-1 in the other half)
//   ... fill my half ...
//   post()      post chunk k with the op's identity, wait until every rank
//               has posted it, check that every rank runs this very op and
//               that no peer rejected an earlier one (its cancel frame);
//               nothing of the result is written before this returns
//   ... reduce my share in the windows (all-reduce only) ...
//   reduced()   wait until every rank has reduced chunk k
//   ... read the peers' halves ...
//   gathered()  this rank is done reading chunk k
//
// The counters grow across ops, whatever op ran before, so every rank's
// chunk k is in the same half.
//
// Where the ranks read the others' memory (cross-memory attach,
// SharedWindows::peerReads), readInPlace() runs an op as one chunk that
// moves nothing through the windows: each rank posts where its data lies (a
// table of addresses at the head of its half), the peers copy it straight
// from there (read()), and a last round keeps every rank's data in place
// until all have read it:
//
//   begin(); my addresses into my half; post(); ... read() the peers' data
//   ...; gathered(); ... meanwhile() ...; wait until every rank has gathered
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "../reduce/reduce.h"
#include "../transport/shared_windows.h"
#include "collective.h"

namespace collx {

class ShmChunks {
 public:
  // `count` and `root` (broadcast's) join the op's identity.
  ShmChunks(const Collective& c, uint64_t count, uint32_t root = 0);

  // Elements of the op's dtype that half a window holds (at least one).
  size_t halfElems() const { return std::max<size_t>(1, w_.halfBytes() / elementSize(c_.dtype)); }
  // This chunk's half of rank r's window.
  char* half(int r) const { return w_.window(r) + size_t(k_ % 2) * w_.halfBytes(); }

  // Runs body(done, len) for elements [done, done + len) of `count`, in
  // chunks of at most `chunkElems`, each between begin() and gathered(); the
  // body posts (and reduces). An empty op still runs one empty chunk, so
  // that its identity is checked too.
  template <class Body>
  void forEach(size_t count, size_t chunkElems, Body&& body) {
    for (size_t done = 0; done < count || done == 0;) {
      const size_t len = std::min(chunkElems, count - done);
      begin();
      body(done, len);
      gathered();
      done += std::max<size_t>(len, 1);
    }
  }

  void post();
  void reduced();
  // Bytes this rank wrote into its window for the peers, and copied from theirs.
  void moved(size_t sent, size_t received) { w_.count(Carrier::kShmWindow, sent, received); }

  // Whether the group reads in place the peers' memory that `use` reads.
  bool readsInPlace(PeerReads use) const { return w_.peerReads() >= use; }
  // Runs read() as above, with the `count` addresses (where this rank's data
  // lies) posted; then meanwhile(), local work that must not touch the posted
  // data, while the peers may still read it.
  template <class Read, class Meanwhile>
  void readInPlace(const void* const* addresses, size_t count, Read&& read, Meanwhile&& meanwhile) {
    begin();
    postAddresses(addresses, count);
    post();
    read();
    gathered();
    meanwhile();
    waitAll(&WindowControl::gathered, k_ + 1, "read");
  }
  // The same over a buffer at `base`, in chunks of at most chunkElems: each
  // chunk posts where it lies and runs body(done, len) between post() and
  // gathered(); the last round comes after the last chunk. A peer may go on
  // to the next chunk while others still read this one, which it no longer
  // writes.
  template <class Body>
  void forEachInPlace(char* base, size_t count, size_t chunkElems, Body&& body) {
    const size_t es = elementSize(c_.dtype);
    forEach(count, chunkElems, [&](size_t done, size_t len) {
      const void* const address = base + done * es;
      postAddresses(&address, 1);
      post();
      body(done, len);
    });
    waitAll(&WindowControl::gathered, k_ + 1, "read");
  }
  // This rank's data that peers copy from its memory (readInPlace), in bytes
  // summed over the readers.
  void exposed(size_t bytes) { w_.count(Carrier::kPeerMemory, bytes, 0); }
  // Copies `bytes` from `offset` bytes past the i-th address rank r posted into dst.
  void read(int r, size_t i, size_t offset, void* dst, size_t bytes) {
    w_.readPeer(r, reinterpret_cast<const uint64_t*>(half(r))[i] + offset, dst, bytes);
  }
  // dst[0, count) = op(from[0, count), the `count` elements from `offset`
  // bytes past rank r's i-th address), read kReadPieceBytes at a time into a
  // scratch of this thread's, which stays in cache while it is reduced.
  // `from` is dst, or apart from it.
  void readReduce(int r, size_t i, size_t offset, char* dst, size_t count, const ReduceFn& fn, const char* from);
  static constexpr size_t kReadPieceBytes = 128 << 10;

 private:
  void begin();
  void gathered();
  using Counter = std::atomic<uint64_t> WindowControl::*;
  // Waits until every rank's `which` has reached `k`.
  void waitAll(Counter which, uint64_t k, const char* step);
  void checkIdentity();
  void postAddresses(const void* const* addresses, size_t count);

  const Collective& c_;
  SharedWindows& w_;
  WindowControl& mine_;
  const uint64_t count_;
  const uint64_t shape_;  // the op's kind, dtype and root (WindowControl::shapeOf)
  uint64_t k_ = 0;  // this chunk's number, counted across the group's ops
};

}  // namespace collx
