// The collective algorithms, free functions over the abstract transport.
#pragma once

#include <cstddef>
#include <functional>
#include <type_traits>
#include <vector>

#include "../reduce/reduce.h"
#include "collective.h"

namespace collx {

enum class Algorithm : uint8_t { kAuto = 0, kRing, kTree, kStar, kDirect, kHierarchical, kShm, kCount };
const char* name(Algorithm a);
Algorithm parseAlgorithm(const char* s);  // throws Error on an unknown name

// In-place all-reduce of `count` elements of c.dtype at `buf`.
//
// The flat ones (ring, tree, star, direct) and reduce at its root keep a
// promise that the device path relies on (torch glue, staging.h): until its
// last call of fn(dst, ...) with dst in some bytes of `buf`, an algorithm
// writes those bytes only through fn; receives and copies into buf come
// after (tests/cpp/test_reduce_writes.cc). The hierarchical one does not: a
// leader receives its host's reduced chunks into buf (ring reduce), then the
// leaders' all-reduce reduces into them.
void ringAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn);
void treeAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn);
void starAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn);
void directAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn);
// Direct's buffers over this size move in pieces of it, two in flight.
constexpr size_t kDirectPieceBytes = 1 << 20;
void hierarchicalAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn);
// From this size the hierarchical all-reduce is the two-level one, where the
// layout has it (twoLevelFits: at most 64 slices for its uneven hosts).
constexpr size_t kTwoLevelMinBytes = 256 << 10;
void twoLevelAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn);
// Needs Transport::sharedWindows() (every rank on this host, on shared
// memory); writes buf by copies after reducing in the windows, like hier.
// Up to kShmOneRoundBytes it takes one round, where each rank reads every
// window, instead of three rounds where each reads 1/n of them.
void shmAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn);
// Up to this size one round, where every rank reads every window, costs no
// more than direct over the rings; above it, reading n times the data does.
constexpr size_t kShmOneRoundBytes = 4 << 10;

// Whether auto's all-reduce and broadcast take the shared-memory forms for
// an op of `bytes` (its whole buffer on one rank): where the transport has
// shared windows, from a size where they beat messages over the rings
// (all_gather and reduce_scatter take them at every size: movesInShm).
bool useSharedWindows(const Transport& t, size_t bytes);

// The ranks of a group by host (Transport::host): hosts in order of their
// lowest rank, ranks ascending within a host, so ranks[h][0] is host h's leader.
struct HostLayout {
  std::vector<std::vector<int>> ranks;
  int mine = 0;  // the index of this rank's host
};
HostLayout hostLayout(const Transport& t);
bool twoLevelFits(const HostLayout& layout);

// What `algo` runs for an all-reduce of `bytes` on `t`: itself, or for kAuto
// the shared-memory one up to kShmOneRoundBytes and where useSharedWindows,
// when the transport has shared windows; the hierarchical one when the group
// spans hosts with several ranks on one; else the cost model's.
Algorithm resolveAllreduce(const Transport& t, const Tuning& tuning, Algorithm algo, int treeArity, size_t bytes);
// Runs `algo` (resolved as above) and returns the one that ran.
Algorithm allreduce(const Collective& c, Algorithm algo, void* buf, size_t count, ReduceFn fn);

// Broadcast of `count` elements from `root`: in shared memory where
// useSharedWindows, else direct sends or a pipelined tree, whichever the
// cost model prefers for the size.
void broadcast(const Collective& c, void* buf, size_t count, int root);

// Reduce to `root` (direct or tree, by size). Only the root's buffer holds the
// result; other ranks' buffers are scratch and end up with partial sums.
void reduce(const Collective& c, void* buf, size_t count, int root, ReduceFn fn);

// All-gather of `blockCount` elements per rank into `blocks`, wherever they
// lie: rank r's block, read from its `in` (which may be its blocks[r]),
// ends in blocks[r] on every rank. In shared memory where movesInShm, in two
// levels where twoLevelMoves, else direct exchange for small blocks, ring
// for large ones. Shared memory
// and the direct exchange write the blocks where they lie; the ring runs on
// blocks laid end to end, and copies through the workspace where they are
// not.
void allgather(const Collective& c, const void* in, const std::vector<void*>& blocks, size_t blockCount);
// The same on blocks laid end to end from `out`, this rank's in place.
void allgather(const Collective& c, void* out, size_t blockCount);
// The input of an all-gather as the op may read it: `in`, or this rank's
// block where `in` overlaps a peer's block, which the op overwrites (the
// input is copied there first).
const void* allgatherSource(const void* in, const std::vector<void*>& blocks, int rank, size_t blockBytes);
// Whether the `bytes` at a and the `bytes` at b share a byte.
inline bool overlaps(const void* a, const void* b, size_t bytes) {
  const char *x = static_cast<const char*>(a), *y = static_cast<const char*>(b);
  return x < y + bytes && y < x + bytes;
}
void ringAllgather(const Collective& c, void* out, size_t blockCount);
// Whether all_gather and reduce_scatter run in shared memory: at every size
// wherever the transport has shared windows. Below useSharedWindows' sizes
// too, the op through the windows took 0.44-1.03x the time of the direct
// exchange or the ring (a tie at 4 KiB), at n=2 and 4 (docs/measurements.md).
bool movesInShm(const Transport& t);
// The shared-memory all_gather and reduce_scatter read the peers' data in
// place where the ranks may (SharedWindows::peerReads): all_gather from
// blocks of kReadInPlaceMinBlockBytes or outputs of kReadInPlaceMinOpBytes,
// reduce_scatter from inputs of kReadInPlaceMinOpBytes. One copy per byte
// received, against two through the windows; below, a read's system call
// costs more than it saves (docs/measurements.md).
constexpr size_t kReadInPlaceMinBlockBytes = 8 << 10;
constexpr size_t kReadInPlaceMinOpBytes = 64 << 10;

// Whether all_gather and reduce_scatter take their two-level forms
// (two_level_moves.cc): where the group spans hosts and a host has several
// ranks. Each block then crosses each host's link once.
bool twoLevelMoves(const Transport& t);
void twoLevelAllgather(const Collective& c, const void* in, const std::vector<void*>& blocks, size_t blockCount);
// Reads the n input blocks where they lie, never writing them, and writes
// this rank's result to `out` (which may be blocks[rank]), as
// shmReduceScatter does.
void twoLevelReduceScatter(const Collective& c, const std::vector<const void*>& blocks, void* out, size_t blockCount,
                           ReduceFn fn);

// The n blocks of `blockBytes` laid end to end from `base`.
template <typename Pointer>  // void* or const void*
std::vector<Pointer> blocksAt(Pointer base, int n, size_t blockBytes) {
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Pointer>>, const char, char>;
  std::vector<Pointer> blocks;
  for (int r = 0; r < n; ++r) blocks.push_back(static_cast<Byte*>(base) + size_t(r) * blockBytes);
  return blocks;
}

// Reduce-scatter: `buf` holds n blocks of `blockCount` elements; on return
// block r of rank r holds the reduction of everyone's block r (the other
// blocks are scratch). In shared memory where movesInShm, in two levels
// where twoLevelMoves, else a ring.
void reduceScatter(const Collective& c, void* buf, size_t blockCount, ReduceFn fn);

// The shared-memory forms (shm_collectives.cc), which need
// Transport::sharedWindows(); the entry points above choose them by size.
void shmBroadcast(const Collective& c, void* buf, size_t count, int root);
void shmAllgather(const Collective& c, const void* in, const std::vector<void*>& blocks, size_t blockCount);
// Its reduce-scatter reads the n input blocks where they lie and writes this
// rank's result to `out` (which may be blocks[rank]); the inputs stay as
// they were, so a caller needs no private copy of them. Where the ranks can
// read each other's memory, both read the peers' blocks in place.
void shmReduceScatter(const Collective& c, const std::vector<const void*>& blocks, void* out, size_t blockCount,
                      ReduceFn fn);

// One message of a direct exchange: to or from `peer`, with its own frame.
struct Transfer {
  int peer;
  void* data;
  size_t bytes;
  Frame frame;
};

// Posts every send and receive at once and waits for all of them: the direct
// pattern behind all-to-all, gather, scatter and batched send/recv.
// `meanwhile` runs between posting and waiting (local work that overlaps the
// transfers, like all-to-all's copy of a rank's own block).
void exchange(const Collective& c, const std::vector<Transfer>& sends,
              const std::vector<Transfer>& recvs, const std::function<void()>& meanwhile = {});

// ---- building blocks shared by the entry points above ----

// The ring engine (ring.cc). Chunk i of `buf` is elements
// [partBegin(count, n, i), partEnd(count, n, i)). Step s sends chunk
// (rank + shift - s) mod n to the right and receives chunk
// (rank + shift - s - 1) mod n from the left; the first `reduceSteps` steps
// reduce what arrives, later ones store it.
void ringPass(const Collective& c, char* buf, size_t count, int shift, int steps,
              int reduceSteps, ReduceFn fn);

// Reduce to `root` as a ring reduce-scatter followed by a gather of the
// chunks at the root (ring.cc): less data per rank than any tree.
void ringReduce(const Collective& c, char* buf, size_t count, int root, ReduceFn fn);

// The tree engine (tree.cc): reduce up to `root` (skipped when fn is null),
// then, if `down`, broadcast down; both pipelined by segment.
void treePass(const Collective& c, char* buf, size_t count, int root, int arity, ReduceFn fn,
              bool down);

}  // namespace collx
