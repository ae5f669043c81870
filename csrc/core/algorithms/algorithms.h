// The collective algorithms, free functions over the abstract transport.
#pragma once

#include <cstddef>

#include "../reduce/reduce.h"
#include "collective.h"

namespace collx {

enum class Algorithm : uint8_t { kAuto = 0, kRing, kTree, kStar, kCount };
const char* name(Algorithm a);
Algorithm parseAlgorithm(const char* s);  // throws Error on an unknown name

// In-place all-reduce of `count` elements of c.dtype at `buf`.
void ringAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn);
void treeAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn);
void starAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn);

// Runs `algo` (kAuto picks by the cost model) and returns the one that ran.
Algorithm allreduce(const Collective& c, Algorithm algo, void* buf, size_t count, ReduceFn fn);

// Pipelined tree broadcast of `bytes` at `buf` from `root`.
void broadcast(const Collective& c, void* buf, size_t bytes, int root);

// Ring all-gather of `blockCount` elements per rank: rank r's block sits at
// out + r·blockCount elements on entry;
// on return every block is everywhere.
void allgather(const Collective& c, void* out, size_t blockCount);

// ---- building blocks shared by the entry points above ----

// The ring engine (ring.cc). Chunk i of `buf` is elements
// [partBegin(count, n, i), partEnd(count, n, i)). Step s sends chunk
// (rank + shift - s) mod n to the right and receives chunk
// (rank + shift - s - 1) mod n from the left; the first `reduceSteps` steps
// reduce what arrives, later ones store it.
void ringPass(const Collective& c, char* buf, size_t count, int shift, int steps,
              int reduceSteps, ReduceFn fn);

// The tree engine (tree.cc): reduce up to `root` (skipped when fn is null),
// then broadcast down, both pipelined by segment.
void treePass(const Collective& c, char* buf, size_t count, int root, int arity, ReduceFn fn);

}  // namespace collx
