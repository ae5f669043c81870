// All-reduce in shared memory, for a group whose ranks all share this host
// (Transport::sharedWindows). No byte goes through a message: each rank
// reduces 1/n of every chunk, reading the peers' data where it lies.
//
//   for each chunk of the buffer (at most half a window), in the chunk
//   protocol of shm_chunks.h:
//     1. copy the peers' slices of my chunk into my half (my own slice
//        only I read); post
//     2. reduce my slice in the buffer itself, in rank order, from the same
//        slice of every peer's half; copy the result into my half; reduced
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
#include <algorithm>
#include <cstring>

#include "algorithms.h"
#include "shm_chunks.h"

namespace collx {

void shmAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn) {
  ShmChunks chunks(c, count);
  const int n = c.size(), me = c.rank();
  const size_t es = elementSize(c.dtype);
  char* const out = static_cast<char*>(buf);

  if (count * es <= std::min(kShmOneRoundBytes, chunks.halfElems() * es)) {
    chunks.forEach(count, std::max<size_t>(count, 1), [&](size_t, size_t len) {
      std::memcpy(chunks.half(me), out, len * es);
      chunks.post();
      std::memcpy(out, chunks.half(0), len * es);
      for (int r = 1; r < n; ++r) {
        if (len > 0) fn(out, chunks.half(r), len);
      }
      chunks.moved(len * es, size_t(n - 1) * len * es);
    });
    return;
  }

  chunks.forEach(count, chunks.halfElems(), [&](size_t done, size_t len) {
    auto sliceAt = [&](int r) { return len * size_t(r) / size_t(n); };
    const size_t lo = sliceAt(me), hi = sliceAt(me + 1);
    char* const part = out + done * es;
    char* const half = chunks.half(me);
    std::memcpy(half, part, lo * es);
    std::memcpy(half + hi * es, part + hi * es, (len - hi) * es);
    chunks.post();
    if (hi > lo) {
      for (int r = 0; r < n; ++r) {
        if (r != me) fn(part + lo * es, chunks.half(r) + lo * es, hi - lo);
      }
      std::memcpy(half + lo * es, part + lo * es, (hi - lo) * es);
    }
    chunks.reduced();
    for (int r = 0; r < n; ++r) {
      const size_t a = sliceAt(r), b = sliceAt(r + 1);
      if (r != me) std::memcpy(part + a * es, chunks.half(r) + a * es, (b - a) * es);
    }
    chunks.moved(len * es, (size_t(n - 1) * (hi - lo) + len - (hi - lo)) * es);
  });
}

}  // namespace collx
