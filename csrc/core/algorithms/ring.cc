// Ring all-reduce and the ring engine it shares with all-gather.
//
// The buffer is cut into n chunks, and each chunk into m segments. Ranks form
// a ring r -> r+1. With n = 3 (chunk a owned by rank 0 at the end, etc.):
//
//   reduce-scatter (n-1 steps)          all-gather (n-1 steps)
//   step 0: r sends chunk r             step n-1+k: r forwards the fully
//           r+1 adds it to its own      reduced chunk it received last
//   step 1: r sends the partial sum
//           it received at step 0
//
//   rank 0:  [a0 b0 c0] -> ... -> [a  b  c ]      (a = a0+a1+a2, ...)
//
// Pipelining: segment j of step s+1 is sent as soon as segment j of step s
// has arrived (and been reduced), so a step never waits for a whole chunk.
// Up to kWindow segments are received ahead into scratch slots while the
// previous ones are reduced. Messages on a link leave in (step, segment)
// order on both sides, so the FIFO transport matches them.
#include <vector>

#include "../error.h"
#include "algorithms.h"

namespace collx {

namespace {
constexpr size_t kWindow = 4;  // segments received ahead of the reduction
constexpr uint32_t kGatherTag = 1u << 30;  // ringReduce's final gather

inline size_t mod(long a, long n) { return size_t(((a % n) + n) % n); }
}  // namespace

void ringPass(const Collective& c, char* buf, size_t count, int shift, int steps,
              int reduceSteps, ReduceFn fn) {
  const int n = c.size(), rank = c.rank();
  if (n == 1 || steps == 0) return;
  const size_t es = elementSize(c.dtype);
  const int right = (rank + 1) % n, left = (rank + n - 1) % n;

  // Chunk i is elements [partBegin(count, n, i), ...); segment j of a chunk is
  // part j of m of it.
  const size_t maxChunk = partEnd(count, n, 0) - partBegin(count, n, 0);
  const size_t m = segmentsFor(maxChunk * es, c.segmentBytes);
  const size_t units = size_t(steps) * m;  // unit u = (step u / m, segment u % m)
  auto span = [&](size_t chunk, size_t seg, char** ptr) {
    size_t cb = partBegin(count, n, chunk), ce = partEnd(count, n, chunk);
    size_t b = cb + partBegin(ce - cb, m, seg), e = cb + partEnd(ce - cb, m, seg);
    *ptr = buf + b * es;
    return (e - b) * es;
  };
  auto sendUnit = [&](size_t u) {
    char* p;
    size_t bytes = span(mod(rank + shift - long(u / m), n), u % m, &p);
    c.transport.postSend(right, c.frame(uint32_t(u)), p, bytes, 2 * u + 1);
  };

  const size_t segBytes = ((maxChunk + m - 1) / m) * es;
  char* scratch = reduceSteps > 0 ? c.workspace.get(kWindow * segBytes) : nullptr;
  size_t nextRecv = 0;
  auto postRecvs = [&](size_t doneRecvs) {
    for (; nextRecv < units && nextRecv < doneRecvs + kWindow; ++nextRecv) {
      size_t u = nextRecv;
      char* p;
      size_t bytes = span(mod(rank + shift - long(u / m) - 1, n), u % m, &p);
      if (long(u / m) < reduceSteps) p = scratch + (u % kWindow) * segBytes;
      c.transport.postRecv(left, c.frame(uint32_t(u)), p, bytes, 2 * u);
    }
  };

  for (size_t j = 0; j < m; ++j) sendUnit(j);
  size_t recvsDone = 0;
  postRecvs(0);
  std::vector<uint64_t> done;
  while (c.transport.pending() > 0) {
    done.clear();
    c.transport.waitSome(done, c.deadline);
    for (uint64_t cookie : done) {
      if (cookie & 1) continue;  // a send finished; nothing waits on it
      size_t u = cookie / 2;
      if (long(u / m) < reduceSteps) {
        char* dst;
        size_t bytes = span(mod(rank + shift - long(u / m) - 1, n), u % m, &dst);
        fn(dst, scratch + (u % kWindow) * segBytes, bytes / es);
      }
      if (u + m < units) sendUnit(u + m);
      ++recvsDone;
    }
    postRecvs(recvsDone);
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
  // shift -1: after n-1 steps rank r holds the full sum of chunk r.
  ringPass(c, static_cast<char*>(buf), blockCount * size_t(c.size()), -1, c.size() - 1, c.size() - 1, fn);
}

}  // namespace collx
