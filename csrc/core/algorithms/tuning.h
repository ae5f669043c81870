// Cost model behind Algorithm::kAuto, in the manner of NCCL's tuning.cc:
// per-algorithm constants and one formula,
//   time = latency · steps(algo, n) + bytes · factor(algo, n) / bandwidth,
// and the choice is the argmin. The constants come from a static table, or
// are fitted to this group's links at its creation (calibrate.h).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "algorithms.h"

namespace collx {

// The algorithms auto chooses among on one host.
constexpr Algorithm kFlatAlgorithms[] = {Algorithm::kRing, Algorithm::kTree, Algorithm::kStar, Algorithm::kDirect};

struct AlgorithmCost {
  double latencyUs;   // one dependent message step (syscalls + wakeup)
  double bytesPerUs;  // what the busiest rank sustains per direction
};

struct Tuning {
  AlgorithmCost cost[size_t(Algorithm::kCount)];
  std::string source;  // "table", "calibrated in 23.1 ms", "cache <path>", "file <path>"

  // Fitted once on a 2-core development machine over loopback TCP.
  static const Tuning& table();

  // Constants fitted to measured all-reduce times on n ranks: us[a][i] for
  // kFlatAlgorithms[a] at sizes[i]. Per algorithm, time = A + B·bytes by
  // least squares on relative error, then latency = A / steps and
  // bandwidth = factor / B. The hierarchical all-reduce's one-host form
  // takes the tree's constants.
  static Tuning fit(int n, int arity, const std::vector<size_t>& sizes, const std::vector<std::vector<double>>& us,
                    const std::string& source);

  // A text form ("collx-tuning 1" then "<algorithm> <latencyUs> <bytesPerUs>"
  // lines; lines starting with # are comments), written to and read from
  // tuning files; parse throws Error.
  std::string serialize() const;
  static Tuning parse(const std::string& text, const std::string& source);

  // The constants and, for n ranks, the sizes where the flat choice changes.
  std::string describe(int n, int arity) const;
};

// Predicted microseconds for an all-reduce of `bytes` on `n` ranks.
double predictAllreduceUs(const Tuning& t, Algorithm algo, int n, int arity, size_t bytes);

// The argmin of predictAllreduceUs over the flat algorithms (ring, tree,
// star, direct): what auto runs on one host.
Algorithm chooseAllreduce(const Tuning& t, int n, int arity, size_t bytes);

// What auto runs for n ranks on `hosts` machines: the hierarchical all-reduce
// when the group spans hosts and some host runs several ranks, or the buffer
// is large enough for its two-level form (with one rank per host, a ring
// over the hosts: the least each NIC can carry); else the flat choice.
Algorithm chooseAllreduce(const Tuning& t, int n, int hosts, int arity, size_t bytes);

// For one-way tree collectives (broadcast, reduce): the arity predicted
// fastest for `bytes` among n-1 (direct to/from the root), `arity`, and 1 (a
// pipelined chain, the least data per rank), with the tree's constants.
int chooseTreeArity(const Tuning& t, int n, int arity, size_t bytes);

// Whether reduce of `bytes` should go ring reduce-scatter + gather rather
// than down a tree.
bool reduceByRing(int n, size_t bytes);

// Whether all-gather of `blockBytes` per rank should exchange directly (one
// step, every pair at once) rather than go around the ring.
bool allgatherDirect(int n, size_t blockBytes);

}  // namespace collx
