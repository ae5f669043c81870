// Ring all-reduce, all-gather, reduce-scatter and reduce on the ring engine
// (ring_pass.h). The buffer is cut into n parts; with n = 3 (part a owned by
// rank 0 at the end, etc.):
//
//   reduce-scatter (n-1 steps)          all-gather (n-1 steps)
//   step 0: r sends part r              step n-1+k: r forwards the fully
//           r+1 adds it to its own      reduced part it received last
//   step 1: r sends the partial sum
//           it received at step 0
//
//   rank 0:  [a0 b0 c0] -> ... -> [a  b  c ]      (a = a0+a1+a2, ...)
#include <vector>

#include "../error.h"
#include "algorithms.h"
#include "ring_pass.h"

namespace collx {

namespace {
constexpr uint32_t kGatherTag = 1u << 30;  // ringReduce's final gather
}  // namespace

void ringPass(const Collective& c, char* buf, size_t count, int shift, int steps,
              int reduceSteps, ReduceFn fn) {
  RingPass pass(c, buf, evenBounds(count, c.size()), shift, steps, reduceSteps, std::move(fn));
  pass.start(c.workspace.get(pass.scratchBytes()));
  std::vector<uint64_t> done;
  while (!pass.done()) {
    done.clear();
    c.transport.waitSome(done, c.deadline);
    for (uint64_t cookie : done) pass.complete(cookie);
  }
}

void ringAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn) {
  ringPass(c, static_cast<char*>(buf), count, 0, 2 * (c.size() - 1), c.size() - 1, fn);
}

void ringAllgather(const Collective& c, void* out, size_t blockCount) {
  ringPass(c, static_cast<char*>(out), blockCount * size_t(c.size()), 0, c.size() - 1, 0, nullptr);
}

void ringReduce(const Collective& c, char* buf, size_t count, int root, ReduceFn fn) {
  // Reduce-scatter around the ring (rank r ends with the sum of chunk r),
  // then every rank sends its chunk straight to the root.
  const int n = c.size(), rank = c.rank();
  ringPass(c, buf, count, -1, n - 1, n - 1, fn);
  const size_t es = elementSize(c.dtype);
  auto chunk = [&](int r) {
    size_t b = partBegin(count, n, r);
    return Transfer{r, buf + b * es, (partEnd(count, n, r) - b) * es, c.frame(kGatherTag)};
  };
  std::vector<Transfer> sends, recvs;
  if (rank == root) {
    for (int r = 0; r < n; ++r) {
      if (r != root) recvs.push_back(chunk(r));
    }
  } else {
    Transfer t = chunk(rank);
    t.peer = root;
    sends.push_back(t);
  }
  exchange(c, sends, recvs);
}

void reduceScatter(const Collective& c, void* buf, size_t blockCount, ReduceFn fn) {
  const size_t blockBytes = blockCount * elementSize(c.dtype);
  if (movesInShm(c.transport)) {
    return shmReduceScatter(c, blocksAt<const void*>(buf, c.size(), blockBytes),
                            static_cast<char*>(buf) + size_t(c.rank()) * blockBytes, blockCount, fn);
  }
  if (twoLevelMoves(c.transport)) {
    return twoLevelReduceScatter(c, blocksAt<const void*>(buf, c.size(), blockBytes),
                                 static_cast<char*>(buf) + size_t(c.rank()) * blockBytes, blockCount, fn);
  }
  // shift -1: after n-1 steps rank r holds the full sum of chunk r.
  ringPass(c, static_cast<char*>(buf), blockCount * size_t(c.size()), -1, c.size() - 1, c.size() - 1, fn);
}

}  // namespace collx
