// Reduce-scatter, all-gather and broadcast in shared memory, for a group
// whose ranks all share this host (Transport::sharedWindows), in the chunk
// protocol of shm_chunks.h. Each moves a chunk at a time through the
// windows; none sends a message, and none needs the reduction round.
//
//   reduce-scatter (n blocks in; rank r writes the sum of block r out)
//     1. copy piece j of every block j != me into my half; post
//     2. out's piece = my block's piece + piece me of every peer's half,
//        in rank order
//
//   all-gather (rank r's block from its `in` into blocks[r] everywhere)
//     1. copy a piece of my block into my half; post
//     2. copy the same piece of every peer's block from its half
//
//   broadcast
//     1. the root copies a piece of the buffer into its half; post
//     2. every other rank copies it out of the root's half
//
// An all-gather of blocks larger than a half (more than one chunk) copies
// straight from the peers' buffers instead, in one round, where every rank
// can read the others' memory (ShmChunks::readInPlace): one copy per byte
// received, not two, for one more round at the end, which only pays once
// the blocks are large. Broadcast keeps the windows: there the root's
// copy-in overlaps the readers' copies, and reading in place was slower.
#include <algorithm>
#include <cstring>

#include "../error.h"
#include "algorithms.h"
#include "shm_chunks.h"

namespace collx {

void shmReduceScatter(const Collective& c, const std::vector<const void*>& blocks, void* out, size_t blockCount,
                      ReduceFn fn) {
  ShmChunks chunks(c, blockCount);
  const int n = c.size(), me = c.rank();
  COLLX_CHECK(int(blocks.size()) == n, "collx rank ", me, ": reduce_scatter needs ", n, " blocks, got ",
              blocks.size());
  const size_t es = elementSize(c.dtype);
  const size_t pieceElems = chunks.halfElems() / size_t(n);  // a half holds one piece of every block
  COLLX_CHECK(pieceElems > 0, "collx rank ", me, ": a shared window is too small for ", n, " ranks");
  auto block = [&](int r) { return static_cast<const char*>(blocks[size_t(r)]); };
  char* const result = static_cast<char*>(out);

  chunks.forEach(blockCount, pieceElems, [&](size_t done, size_t len) {
    for (int r = 0; r < n; ++r) {
      if (r != me) std::memcpy(chunks.half(me) + size_t(r) * len * es, block(r) + done * es, len * es);
    }
    chunks.post();
    char* dst = result + done * es;
    if (dst != block(me) + done * es) std::memcpy(dst, block(me) + done * es, len * es);
    for (int r = 0; r < n; ++r) {
      if (r != me && len > 0) fn(dst, chunks.half(r) + size_t(me) * len * es, len);
    }
    chunks.moved(size_t(n - 1) * len * es, size_t(n - 1) * len * es);
  });
}

void shmAllgather(const Collective& c, const void* in, const std::vector<void*>& blocks, size_t blockCount) {
  ShmChunks chunks(c, blockCount);
  const int n = c.size(), me = c.rank();
  const size_t es = elementSize(c.dtype);
  auto block = [&](int r) { return static_cast<char*>(blocks[size_t(r)]); };
  const char* const mine = static_cast<const char*>(allgatherSource(in, blocks, me, blockCount * es));

  if (chunks.canReadPeers() && blockCount > chunks.halfElems()) {
    chunks.exposed(blockCount * es, n - 1);
    chunks.readInPlace(mine, [&] {
      for (int i = 1; i < n; ++i) {
        const int r = (me + i) % n;  // not every rank reading rank 0 first
        chunks.read(r, block(r), blockCount * es);
      }
    });
  } else {
    chunks.forEach(blockCount, chunks.halfElems(), [&](size_t done, size_t len) {
      std::memcpy(chunks.half(me), mine + done * es, len * es);
      chunks.post();
      for (int r = 0; r < n; ++r) {
        if (r != me) std::memcpy(block(r) + done * es, chunks.half(r), len * es);
      }
      chunks.moved(len * es, size_t(n - 1) * len * es);
    });
  }
  if (blockCount > 0 && block(me) != mine) std::memmove(block(me), mine, blockCount * es);
}

void shmBroadcast(const Collective& c, void* buf, size_t count, int root) {
  COLLX_CHECK(root >= 0 && root < c.size(), "collx rank ", c.rank(), ": broadcast root ", root,
              " is out of range for a group of size ", c.size());
  ShmChunks chunks(c, count, uint32_t(root));
  const bool isRoot = c.rank() == root;
  const size_t es = elementSize(c.dtype);
  char* const data = static_cast<char*>(buf);

  chunks.forEach(count, chunks.halfElems(), [&](size_t done, size_t len) {
    if (isRoot) std::memcpy(chunks.half(root), data + done * es, len * es);
    chunks.post();
    if (!isRoot) std::memcpy(data + done * es, chunks.half(root), len * es);
    chunks.moved(isRoot ? len * es : 0, isRoot ? 0 : len * es);
  });
}

}  // namespace collx
