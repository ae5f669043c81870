// All-reduce in shared memory, for a group whose ranks all share this host
// (Transport::sharedWindows). No byte goes through a message: each rank
// reduces 1/n of every chunk, reading the peers' data where it lies.
//
//   for each chunk of the buffer (at most half a window), in the chunk
//   protocol of shm_chunks.h:
//     1. copy the peers' slices of my chunk into my half (my own slice
//        only I read); post
//     2. reduce my slice in the buffer itself, in rank order, from the same
//        slice of every peer's half, the last pass writing the result into
//        my half as well; reduced
//     3. copy every peer's reduced slice into the buffer; gathered
//
//   rank 0 window  [ s0 | s1 | s2 ]   rank 1 reduces s1 of its buffer with s1
//   rank 1 window  [ s0 | s1 | s2 ]   of windows 0 and 2 and puts the sum in
//   rank 2 window  [ s0 | s1 | s2 ]   its own s1; everyone copies s0 from
//                                      rank 0, s1 from 1, s2 from 2.
//
// Each rank's own slice goes into shared memory once, reduced, instead of
// in as input and back out as output: a copy of 1/n of the buffer less per
// rank, which the op's time shows (docs/measurements.md).
//
// A small buffer takes one round instead: every rank posts all of it, then
// folds the n windows in rank order, so that every rank computes the
// bit-identical ((b0 + b1) + b2) + ..., as the direct all-reduce does.
//
// One from 4 MiB to 32 MiB / n, where the ranks read the others' memory in
// place of copies (PeerReads::kCopies, ShmChunks::forEachInPlace), moves
// nothing through the windows; for each chunk of it:
//
//     1. post the address of my chunk
//     2. reduce my slice in my chunk from the same slice of every peer's
//        chunk, in rank order (ShmChunks::readReduce); reduced
//     3. read every peer's reduced slice from its chunk into mine; gathered
//   then wait until every rank has gathered the last (my slices stay put)
//
// Each byte crosses between ranks once on the way in and once on the way
// out, with no copy into or out of a window. One rank reduces each slice and
// the others copy it, so every rank has the same bits.
#include <algorithm>

#include "../copy.h"
#include "algorithms.h"
#include "shm_chunks.h"

namespace collx {

namespace {

// From 4 MiB up to 32 MiB / n the reads in place beat the windows (n=2: up
// to 24 MiB, lost by 48; n=4: at 4 and 8 MiB, lost at 16). Below, the
// windows, which copy a rank's own slice once and need no last round, were
// faster; above, the windows' chunks, which stay in cache while each is
// copied in, reduced and copied out, were (docs/measurements.md). The reads
// go a chunk at a time too: 4 MiB took less time than one chunk or 1 MiB ones.
constexpr size_t kReadInPlaceMinBytes = 4 << 20, kReadInPlaceMaxBytesTimesRanks = 32 << 20;
constexpr size_t kReadInPlaceChunkBytes = 4 << 20;

void allreduceInPlace(ShmChunks& chunks, const Collective& c, char* buf, size_t count, ReduceFn fn) {
  const int n = c.size(), me = c.rank();
  const size_t es = elementSize(c.dtype);
  chunks.forEachInPlace(buf, count, std::max<size_t>(1, kReadInPlaceChunkBytes / es), [&](size_t done, size_t len) {
    auto sliceAt = [&](int r) { return len * size_t(r) / size_t(n); };
    const size_t lo = sliceAt(me), hi = sliceAt(me + 1);
    char* const part = buf + done * es;
    // The peers read slice r of this chunk to reduce it, then this slice.
    chunks.exposed((len - (hi - lo) + size_t(n - 1) * (hi - lo)) * es);
    for (int r = 0; r < n; ++r) {
      if (r != me) chunks.readReduce(r, 0, lo * es, part + lo * es, hi - lo, fn, part + lo * es);
    }
    chunks.reduced();
    for (int i = 1; i < n; ++i) {
      const int r = (me + i) % n;  // not every rank reading rank 0 first
      const size_t a = sliceAt(r), b = sliceAt(r + 1);
      if (b > a) chunks.read(r, 0, a * es, part + a * es, (b - a) * es);
    }
  });
}

}  // namespace

void shmAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn) {
  ShmChunks chunks(c, count);
  const int n = c.size(), me = c.rank();
  const size_t es = elementSize(c.dtype);
  char* const out = static_cast<char*>(buf);

  if (count * es <= std::min(kShmOneRoundBytes, chunks.halfElems() * es)) {
    chunks.forEach(count, std::max<size_t>(count, 1), [&](size_t, size_t len) {
      copyBytes(chunks.half(me), out, len * es);
      chunks.post();
      for (int r = 1; r < n; ++r) {  // ((b0 + b1) + b2) + ...
        if (len > 0) fn.fused(out, r == 1 ? chunks.half(0) : out, chunks.half(r), nullptr, len, es);
      }
      chunks.moved(len * es, size_t(n - 1) * len * es);
    });
    return;
  }
  const size_t bytes = count * es;
  if (chunks.readsInPlace(PeerReads::kCopies) && bytes >= kReadInPlaceMinBytes &&
      bytes * size_t(n) <= kReadInPlaceMaxBytesTimesRanks) {
    return allreduceInPlace(chunks, c, out, count, fn);
  }

  chunks.forEach(count, chunks.halfElems(), [&](size_t done, size_t len) {
    auto sliceAt = [&](int r) { return len * size_t(r) / size_t(n); };
    const size_t lo = sliceAt(me), hi = sliceAt(me + 1);
    char* const part = out + done * es;
    char* const half = chunks.half(me);
    copyBytes(half, part, lo * es);
    copyBytes(half + hi * es, part + hi * es, (len - hi) * es);
    chunks.post();
    if (hi > lo) {
      const int last = me == n - 1 ? n - 2 : n - 1;  // the last peer's sum goes into my half too
      char* const slice = part + lo * es;
      for (int r = 0; r < n; ++r) {
        if (r != me) fn.fused(slice, slice, chunks.half(r) + lo * es, r == last ? half + lo * es : nullptr, hi - lo, es);
      }
    }
    chunks.reduced();
    for (int r = 0; r < n; ++r) {
      const size_t a = sliceAt(r), b = sliceAt(r + 1);
      if (r != me) copyBytes(part + a * es, chunks.half(r) + a * es, (b - a) * es);
    }
    chunks.moved(len * es, (size_t(n - 1) * (hi - lo) + len - (hi - lo)) * es);
  });
}

}  // namespace collx
