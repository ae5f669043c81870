#include "tuning.h"

#include <algorithm>
#include <limits>

#include "../error.h"
#include "tree_topology.h"

namespace collx {

namespace {

// Fitted to benchmarks/allreduce.py on the 2-core development machine over
// loopback TCP (n=2 and n=4; the note of the foundation issue has the runs).
// One row per algorithm:
//   latencyUs: cost of one dependent message step (syscalls + wakeup)
//   bandwidth: bytes/us the busiest rank sustains per direction
// Star and direct get half the bandwidth: the root (star) or every rank
// (direct) reduces n-1 buffers after they arrive instead of overlapping the
// reduction with the transfer, which on 2 cores costs as much as the copies.
struct Cost {
  double latencyUs;
  double bandwidth;
};
constexpr Cost kCost[] = {
    /* auto */ {0, 1},
    /* ring */ {30.0, 1000.0},
    /* tree */ {30.0, 1000.0},
    /* star */ {30.0, 500.0},
    /* direct */ {30.0, 500.0},
    /* hier */ {30.0, 1000.0},  // without a host layout: its one-host form, see steps()
};
static_assert(sizeof(kCost) / sizeof(kCost[0]) == size_t(Algorithm::kCount));

// Dependent message steps.
double steps(Algorithm a, int n, int arity) {
  switch (a) {
    case Algorithm::kRing: return 2.0 * (n - 1);
    case Algorithm::kTree: return 2.0 * treeDepth(n, arity);
    case Algorithm::kStar: return 2.0;
    case Algorithm::kDirect: return 1.0;
    // Without hosts to go by, the hierarchical all-reduce is modelled as on
    // one host: a local reduce and broadcast, i.e. the tree's two passes.
    case Algorithm::kHierarchical: return 2.0 * treeDepth(n, arity);
    default: return 0;
  }
}

// Bytes the busiest rank sends per byte of buffer (pipelined, so depth does
// not multiply it): ring 2(n-1)/n; a tree node talks to its parent and up to
// k children; the star root to all n-1 others.
double factor(Algorithm a, int n, int arity) {
  switch (a) {
    case Algorithm::kRing: return 2.0 * (n - 1) / n;
    case Algorithm::kTree: return 1.0 + std::min(arity, n - 1);
    case Algorithm::kStar: return n - 1.0;
    case Algorithm::kDirect: return n - 1.0;
    case Algorithm::kHierarchical: return 1.0 + std::min(arity, n - 1);
    default: return 0;
  }
}

}  // namespace

double predictAllreduceUs(Algorithm a, int n, int arity, size_t bytes) {
  if (n <= 1) return 0;
  const Cost& k = kCost[size_t(a)];
  return k.latencyUs * steps(a, n, arity) + double(bytes) * factor(a, n, arity) / k.bandwidth;
}

Algorithm chooseAllreduce(int n, int arity, size_t bytes) {
  Algorithm best = Algorithm::kRing;
  double bestUs = std::numeric_limits<double>::infinity();
  for (Algorithm a : {Algorithm::kRing, Algorithm::kTree, Algorithm::kStar, Algorithm::kDirect}) {
    double us = predictAllreduceUs(a, n, arity, bytes);
    if (us < bestUs) {
      best = a;
      bestUs = us;
    }
  }
  return best;
}

Algorithm chooseAllreduce(int n, int hosts, int arity, size_t bytes) {
  if (hosts > 1 && hosts < n) return Algorithm::kHierarchical;
  return chooseAllreduce(n, arity, bytes);
}

int chooseTreeArity(int n, int arity, size_t bytes) {
  // One pipelined pass: depth(k) steps; the busiest node sends k copies.
  // Candidates: direct (k = n-1), the configured arity, and a chain (k = 1).
  const Cost& k = kCost[size_t(Algorithm::kTree)];
  auto us = [&](int a) {
    return k.latencyUs * treeDepth(n, a) + double(bytes) * std::min(a, n - 1) / k.bandwidth;
  };
  int best = std::max(1, n - 1);
  for (int a : {arity, 1}) {
    if (us(a) < us(best)) best = a;
  }
  return best;
}

bool reduceByRing(int n, size_t bytes) {
  // Every tree rank reduces the whole buffer; the ring splits that work n
  // ways, which wins once the buffer is large (measured: chain reduce of
  // 64 MB at n=4 ran at 0.7x gloo, the ring beats it).
  constexpr size_t kRingMinBytes = 1 << 20;
  return n >= 3 && bytes >= kRingMinBytes;
}

bool allgatherDirect(int n, size_t blockBytes) {
  // Both send (n-1) blocks per rank; the ring pays n-1 dependent steps, the
  // direct exchange one step but n-1 concurrent streams into every rank,
  // which stops paying once the blocks are large (measured: 256 KiB).
  constexpr size_t kDirectMaxBlockBytes = 256 << 10;
  return n <= 2 || blockBytes <= kDirectMaxBlockBytes;
}

}  // namespace collx
