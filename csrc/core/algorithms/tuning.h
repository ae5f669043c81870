// Cost model behind Algorithm::kAuto, in the manner of NCCL's tuning.cc:
// a table of per-algorithm constants and one formula,
//   time = latency · steps(algo, n) + bytes · factor(algo, n) / bandwidth,
// and the choice is the argmin.
#pragma once

#include <cstddef>

#include "algorithms.h"

namespace collx {

// Predicted microseconds for an all-reduce of `bytes` on `n` ranks.
double predictAllreduceUs(Algorithm algo, int n, int arity, size_t bytes);

// The argmin of predictAllreduceUs over the flat algorithms (ring, tree,
// star, direct): what auto runs on one host.
Algorithm chooseAllreduce(int n, int arity, size_t bytes);

// What auto runs for n ranks on `hosts` machines: the hierarchical all-reduce
// when the group spans hosts and some host runs several ranks (only its
// leaders' step crosses the network), else the flat choice.
Algorithm chooseAllreduce(int n, int hosts, int arity, size_t bytes);

// For one-way tree collectives (broadcast, reduce): the arity predicted
// fastest for `bytes` among n-1 (direct to/from the root), `arity`, and 1 (a
// pipelined chain, the least data per rank).
int chooseTreeArity(int n, int arity, size_t bytes);

// Whether reduce of `bytes` should go ring reduce-scatter + gather rather
// than down a tree.
bool reduceByRing(int n, size_t bytes);

// Whether all-gather of `blockBytes` per rank should exchange directly (one
// step, every pair at once) rather than go around the ring.
bool allgatherDirect(int n, size_t blockBytes);

}  // namespace collx
