// All-reduce entry point: resolves auto (shared memory, host layout, then the
// cost model) and runs one of ring, tree, star, direct, hierarchical or shm.
#include <chrono>
#include <cstring>

#include "../error.h"
#include "../transport/shared_windows.h"
#include "algorithms.h"
#include "refine.h"
#include "tuning.h"

namespace collx {

namespace {
constexpr const char* kNames[] = {"auto", "ring", "tree", "star", "direct", "hier", "shm"};
// From this size auto's all-reduce and broadcast take the shared-memory
// forms where they can; below it (down to kShmOneRoundBytes for the
// all-reduce) the cost model's choice (a single exchange, or a tree) is as
// fast or faster than three rounds of counters; from it, the windows win or
// tie (docs/measurements.md).
constexpr size_t kShmMinBytes = 64 << 10;
static_assert(sizeof(kNames) / sizeof(kNames[0]) == size_t(Algorithm::kCount));
}  // namespace

const char* name(Algorithm a) {
  return size_t(a) < size_t(Algorithm::kCount) ? kNames[size_t(a)] : "invalid";
}

Algorithm parseAlgorithm(const char* s) {
  for (size_t i = 0; i < size_t(Algorithm::kCount); ++i) {
    if (strcmp(s, kNames[i]) == 0) return Algorithm(i);
  }
  throw Error(str("collx: unknown algorithm '", s, "' (expected auto, ring, tree, star, direct, hier or shm)"));
}

bool useSharedWindows(const Transport& t, size_t bytes) { return bytes >= kShmMinBytes && t.sharedWindows(); }

bool movesInShm(const Transport& t) { return t.sharedWindows() != nullptr; }

Algorithm resolveAllreduce(const Transport& t, const Tuning& tuning, Algorithm algo, int treeArity, size_t bytes) {
  if (algo != Algorithm::kAuto) return algo;
  if (useSharedWindows(t, bytes) || (bytes <= kShmOneRoundBytes && t.sharedWindows())) return Algorithm::kShm;
  return chooseAllreduce(tuning, t.size(), t.hostCount(), treeArity, bytes);
}

Algorithm allreduce(const Collective& c, Algorithm algo, void* buf, size_t count, ReduceFn fn) {
  const size_t bytes = count * elementSize(c.dtype);
  Refiner* refiner = algo == Algorithm::kAuto ? c.refiner : nullptr;
  algo = resolveAllreduce(c.transport, c.costs(), algo, c.treeArity, bytes);
  const auto start = std::chrono::steady_clock::now();  // a trial's agreements count as its ops' time
  if (refiner) algo = refiner->choose(c, bytes, algo);
  switch (algo) {
    case Algorithm::kRing: ringAllreduce(c, buf, count, fn); break;
    case Algorithm::kTree: treeAllreduce(c, buf, count, fn); break;
    case Algorithm::kStar: starAllreduce(c, buf, count, fn); break;
    case Algorithm::kDirect: directAllreduce(c, buf, count, fn); break;
    case Algorithm::kHierarchical: hierarchicalAllreduce(c, buf, count, fn); break;
    case Algorithm::kShm: shmAllreduce(c, buf, count, fn); break;
    default: throw Error(str("collx: invalid all-reduce algorithm ", int(algo)));
  }
  if (refiner) refiner->ran(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  return algo;
}

}  // namespace collx
