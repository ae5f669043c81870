// Reduce-scatter, all-gather and broadcast in shared memory, for a group
// whose ranks all share this host (Transport::sharedWindows), in the chunk
// protocol of shm_chunks.h. None sends a message, and none needs the
// reduction round.
//
// Where every rank can read the others' memory (ShmChunks::readInPlace),
// all-gather (of blocks from kReadInPlaceMinBlockBytes, or of outputs from
// kReadInPlaceMinOpBytes) and reduce-scatter (of inputs from that size, and
// blocks up to kReadInPlaceMaxBlockBytes) copy straight from the peers'
// buffers, in one chunk: one copy per byte received instead of two (into a
// window and out), for one more round at the end. Smaller ops take the
// windows, where a read's system call would cost more than the copy it saves.
//
//   reduce-scatter (n blocks in; rank r writes the sum of block r out)
//     1. post the addresses of my n blocks
//     2. for every peer in rank order, out = (my block me, then out) + its
//        block me (ShmChunks::readReduce, a piece at a time): my block goes
//        into the sum in the pass of the first peer's, not in a copy
//
//   all-gather (rank r's block from its `in` into blocks[r] everywhere)
//     1. post the address of my block
//     2. read every peer's block into blocks[peer]
//
// Else they stream through the windows a chunk at a time:
//
//   reduce-scatter
//     1. copy piece j of every block j != me into my half; post
//     2. out's piece = my block's piece + piece me of every peer's half,
//        in rank order, the first sum in one pass over three operands
//
//   all-gather
//     1. copy a piece of my block into my half; post
//     2. copy the piece into my own block of the output, and the same piece
//        of every peer's block from its half
//
// Broadcast always takes the windows: the root's copy-in overlaps the
// readers' copies, and reading in place was slower (docs/measurements.md):
//     1. the root copies a piece of the buffer into its half; post
//     2. every other rank copies it out of the root's half
//
// Both orders of reduce-scatter add the same values in the same order, so
// the result does not depend on which one ran.
#include <algorithm>

#include "../copy.h"
#include "../error.h"
#include "algorithms.h"
#include "shm_chunks.h"

namespace collx {

namespace {

// Larger blocks of a reduce-scatter stream through the windows: there the
// reads in place gained nothing with two ranks and lost with more ranks than
// cores (docs/measurements.md).
constexpr size_t kReadInPlaceMaxBlockBytes = 1 << 20;

// What a reduce-scatter's first reduction reads as this rank's part of the
// sum, written to `dst` with the first peer's in one pass: `own`, or dst
// once own is moved there (where the two overlap, or no peer is there to sum).
const char* firstOperand(char* dst, const char* own, size_t bytes, int n) {
  if (dst == own || (n > 1 && !overlaps(dst, own, bytes))) return own;
  moveBytes(dst, own, bytes);
  return dst;
}

void reduceScatterInPlace(ShmChunks& chunks, const Collective& c, const std::vector<const void*>& blocks, char* out,
                          size_t blockCount, ReduceFn fn) {
  const int n = c.size(), me = c.rank();
  const size_t es = elementSize(c.dtype), bytes = blockCount * es;
  // The peers read this rank's blocks until the op's last round: where `out`
  // overlaps one of them, the sum is made apart and copied out after it.
  bool outApart = true;
  for (int r = 0; r < n; ++r) outApart = outApart && (r == me || !overlaps(out, blocks[size_t(r)], bytes));
  std::vector<char> apart(outApart ? 0 : bytes);
  char* const dst = outApart ? out : apart.data();
  chunks.exposed(bytes * size_t(n - 1));
  chunks.readInPlace(blocks.data(), blocks.size(), [&] {
    const char* sum = firstOperand(dst, static_cast<const char*>(blocks[size_t(me)]), bytes, n);
    for (int r = 0; r < n; ++r) {
      if (r != me) {
        chunks.readReduce(r, size_t(me), 0, dst, blockCount, fn, sum);
        sum = dst;
      }
    }
  }, [] {});
  if (!outApart && bytes > 0) copyBytes(out, dst, bytes);
}

}  // namespace

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
  // Every rank takes the same form: peerReads is the group's, and the
  // block size the same everywhere.
  const size_t bytes = blockCount * es;
  if (chunks.readsInPlace(PeerReads::kAll) && bytes * size_t(n) >= kReadInPlaceMinOpBytes &&
      bytes <= kReadInPlaceMaxBlockBytes) {
    return reduceScatterInPlace(chunks, c, blocks, result, blockCount, fn);
  }

  chunks.forEach(blockCount, pieceElems, [&](size_t done, size_t len) {
    for (int r = 0; r < n; ++r) {
      if (r != me) copyBytes(chunks.half(me) + size_t(r) * len * es, block(r) + done * es, len * es);
    }
    chunks.post();
    char* const dst = result + done * es;
    const char* sum = firstOperand(dst, block(me) + done * es, len * es, n);
    for (int r = 0; r < n; ++r) {
      if (r != me && len > 0) {
        fn.fused(dst, sum, chunks.half(r) + size_t(me) * len * es, nullptr, len, es);
        sum = dst;
      }
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
  const size_t bytes = blockCount * es;
  // No step of the op reads this rank's block of the output again: a large
  // one bypasses the caches (streamBytes).
  auto placeMine = [&] {
    if (bytes == 0 || block(me) == mine) return;
    if (overlaps(block(me), mine, bytes)) return moveBytes(block(me), mine, bytes);
    streamBytes(block(me), mine, bytes);
  };

  if (chunks.readsInPlace(PeerReads::kCopies) &&
      (bytes >= kReadInPlaceMinBlockBytes || bytes * size_t(n) >= kReadInPlaceMinOpBytes)) {
    // This rank's own block is copied while the peers read its input, where
    // that copy leaves the input as they read it.
    const bool apart = !overlaps(mine, block(me), bytes);
    const void* const address = mine;
    chunks.exposed(bytes * size_t(n - 1));
    chunks.readInPlace(
        &address, 1,
        [&] {
          for (int i = 1; i < n; ++i) {
            const int r = (me + i) % n;  // not every rank reading rank 0 first
            if (bytes > 0) chunks.read(r, 0, 0, block(r), bytes);
          }
        },
        [&] {
          if (apart) placeMine();
        });
    if (!apart) placeMine();
    return;
  }
  // Apart from the input, this rank's own block goes in piece by piece, each
  // piece while it is in cache from its copy into the window; after post(),
  // which checks the op: a mismatched op writes nothing.
  const bool inPieces = bytes > 0 && block(me) != mine && !overlaps(block(me), mine, bytes);
  chunks.forEach(blockCount, chunks.halfElems(), [&](size_t done, size_t len) {
    copyBytes(chunks.half(me), mine + done * es, len * es);
    chunks.post();
    if (inPieces) streamBytes(block(me) + done * es, mine + done * es, len * es, bytes);
    for (int r = 0; r < n; ++r) {
      if (r != me) copyBytes(block(r) + done * es, chunks.half(r), len * es);
    }
    chunks.moved(len * es, size_t(n - 1) * len * es);
  });
  if (!inPieces) placeMine();
}

void shmBroadcast(const Collective& c, void* buf, size_t count, int root) {
  COLLX_CHECK(root >= 0 && root < c.size(), "collx rank ", c.rank(), ": broadcast root ", root,
              " is out of range for a group of size ", c.size());
  ShmChunks chunks(c, count, uint32_t(root));
  const bool isRoot = c.rank() == root;
  const size_t es = elementSize(c.dtype);
  char* const data = static_cast<char*>(buf);

  chunks.forEach(count, chunks.halfElems(), [&](size_t done, size_t len) {
    if (isRoot) copyBytes(chunks.half(root), data + done * es, len * es);
    chunks.post();
    if (!isRoot) copyBytes(data + done * es, chunks.half(root), len * es);
    chunks.moved(isRoot ? len * es : 0, isRoot ? 0 : len * es);
  });
}

}  // namespace collx
