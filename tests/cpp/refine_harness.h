// The harness of the refiner's tests (test_refine.cc, test_refine_probes.cc,
// test_refine_checks.cc): a model where direct and ring are close, one
// rank's refiner, and helpers that run a trial, its checks and the kept ops,
// checking each op's algorithm and giving it the time the test says.
#pragma once

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "../../csrc/core/algorithms/refine.h"
#include "../../csrc/core/algorithms/tuning.h"
#include "check.h"
#include "group.h"

namespace collx::test {

constexpr int kRanks = 3;
constexpr size_t kClose = 256 << 10;  // where the model finds direct and ring close

// A model with direct predicted 0.8x ring at `close` bytes, tree and star far
// off and slow: direct and ring are the two candidates there.
inline Tuning closeModel(size_t close = kClose) {
  Tuning t = Tuning::table();
  t.cost[size_t(Algorithm::kRing)] = {0.1, 1000.0};
  t.cost[size_t(Algorithm::kDirect)] = {0.1, 1000.0};
  t.cost[size_t(Algorithm::kTree)] = {1e6, 1.0};
  t.cost[size_t(Algorithm::kStar)] = {1e6, 1.0};
  auto us = [&](Algorithm a, size_t bytes) { return predictAllreduceUs(t, a, kRanks, 2, bytes); };
  while (us(Algorithm::kDirect, close) > 0.8 * us(Algorithm::kRing, close)) {
    t.cost[size_t(Algorithm::kDirect)].bytesPerUs *= 1.02;
  }
  CHECK(chooseAllreduce(t, kRanks, 2, close) == Algorithm::kDirect, "the model picks direct at ", close, " B");
  return t;
}

inline Collective collective(tcp::Device& d, const Tuning& t, Workspace& ws, uint64_t seq = 1) {
  return Collective{d, OpKind::kAllreduce, DataType::kFloat32, seq, Clock::now() + std::chrono::seconds(60),
                    512 << 10, 2, ws, &t};
}

// The ops of a trial among `candidates` over `rounds` rounds of `block`: the
// first, a block of the first candidate and a probe of each other (at once
// where there are two; firstRound places the probes after the second); the
// others, a block of each of the `later` that stay (all, if 0).
inline int trialOps(int candidates, int block, int rounds, int later = 0) {
  return block + (candidates - 1) * Refiner::probeFor(block) + (rounds - 1) * (later ? later : candidates) * block;
}

// Which candidate runs trial op i: an index of the candidates in the first
// round (of two, or of its block and the second's probe), of the `later`
// ones after it (all, if 0).
inline int inTurn(int i, int candidates, int block, int later = 0) {
  const int probe = Refiner::probeFor(block), first = block + (candidates - 1) * probe;
  if (i < first) return i < block ? 0 : 1 + (i - block) / probe;
  return (i - first) / block % (later ? later : candidates);
}

// The candidate of trial op i between direct (the model's choice) and ring.
inline Algorithm trialAlgorithm(int i, int block) {
  return inTurn(i, 2, block) == 0 ? Algorithm::kDirect : Algorithm::kRing;
}

inline double predictedAt(const Tuning& t, size_t bytes) {
  return predictAllreduceUs(t, chooseAllreduce(t, kRanks, 2, bytes), kRanks, 2, bytes);
}
inline int blockAt(const Tuning& t, size_t bytes) { return Refiner::blockFor(predictedAt(t, bytes)); }
inline int roundsAt(const Tuning& t, size_t bytes) { return Refiner::roundsFor(predictedAt(t, bytes) * blockAt(t, bytes)); }

// Runs the check of what the trial from the model's `choice` kept, and the
// op that settles it, each taking `us`: every op must run `expect`. Returns
// how many ops that took. (A class that settles on another than `choice`
// keeps trying() until its second trial: this stops once none is
// "refining".)
inline int runCheck(Refiner& refiner, const Collective& c, size_t bytes, Algorithm expect, double us,
             Algorithm choice = Algorithm::kDirect) {
  int ops = 0;
  do {
    const Algorithm a = refiner.choose(c, bytes, choice);
    CHECK(a == expect, "check op ", ops, ": ", name(a), ", not ", name(expect));
    refiner.ran(us);
    ++ops;
  } while (refiner.describe().find("refining: ") != std::string::npos);
  return ops;
}

// The first round's ops among `order`, where an op of algorithm a takes
// us(a) on every rank, in blocks of `block`: the first's block, the
// second's probe at once, then each later probe after as many ops of the
// fastest so far as put it within kProbeBudget (refine.h), unless that is
// over kMaxWait; `probed` gets how many were probed.
inline std::vector<Algorithm> firstRound(const std::vector<Algorithm>& order, int block,
                                         const std::function<double(Algorithm)>& us, int* probed = nullptr) {
  std::vector<Algorithm> ops;
  double after = 0;  // the time of the ops after the first block
  auto run = [&](Algorithm a, int n) {
    for (int i = 0; i < n; ++i) ops.push_back(a), after += ops.size() > size_t(block) ? us(a) : 0;
  };
  const int probe = Refiner::probeFor(block);
  size_t j = 0;
  for (Algorithm lead = order[0]; j < order.size(); ++j) {
    if (j >= 2) {
      for (size_t i = 1; i < j; ++i) {
        if (us(order[i]) < us(lead)) lead = order[i];
      }
      const double over = after / us(lead) - double(ops.size() - size_t(block));  // in ops of the fastest
      const double m = (over + (Refiner::kProbeRatio - 1) * probe) / Refiner::kProbeBudget - double(ops.size()) - probe;
      if (m > Refiner::kMaxWait) break;
      if (m > 0) run(lead, int(std::ceil(m)));
    }
    run(order[j], j == 0 ? block : probe);
  }
  if (probed) *probed = int(j);
  return ops;
}

// Runs the trial that the model's `choice` starts, checking that its ops
// take `order` in turn, each op taking us(algorithm): the first round (as
// firstRound places it), then `rounds` - 1 of the `later` ones (all, if
// empty). The caller's next op is the check. Where the candidates are far
// apart, the trial runs one round where the first is the fastest, and two
// where another is (the first meets it again).
inline void runTrialInTurn(Refiner& refiner, const Collective& c, size_t bytes, Algorithm choice,
                           const std::vector<Algorithm>& order, int block, const std::function<double(Algorithm)>& us,
                           int rounds = 1, const std::vector<Algorithm>& later = {}) {
  std::vector<Algorithm> ops = firstRound(order, block, us);
  for (int round = 1; round < rounds; ++round) {
    for (Algorithm a : later.empty() ? order : later) ops.insert(ops.end(), size_t(block), a);
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    const Algorithm a = refiner.choose(c, bytes, choice);
    CHECK(a == ops[i], "trial op ", i, ": ", name(a), ", not ", name(ops[i]));
    refiner.ran(us(a));
  }
}

// The trial between direct (the model's choice) and ring at kClose, each
// op taking `directUs` or `ringUs`, far enough apart to end after the first
// round where direct is the faster, after the second where ring is.
inline void runDirectRingTrial(Refiner& refiner, const Collective& c, double directUs, double ringUs) {
  runTrialInTurn(refiner, c, kClose, Algorithm::kDirect, {Algorithm::kDirect, Algorithm::kRing},
                 blockAt(c.costs(), kClose), [&](Algorithm a) { return a == Algorithm::kDirect ? directUs : ringUs; },
                 ringUs < directUs ? 2 : 1);
}

// Checks in turn at kClose, from the op that ends the trial: each runs
// `ops` ops of `algorithm`, taking `us` each.
struct CheckStep {
  Algorithm algorithm;
  double us;
  int ops;
};
inline void runChecks(Refiner& refiner, const Collective& c, const std::vector<CheckStep>& steps) {
  for (size_t j = 0; j < steps.size(); ++j) {
    for (int i = 0; i < steps[j].ops; ++i) {
      const Algorithm a = refiner.choose(c, kClose, Algorithm::kDirect);
      CHECK(a == steps[j].algorithm, "check ", j, " op ", i, ": ", name(a));
      refiner.ran(steps[j].us);
    }
  }
}

// The kept `expect` runs on at kClose, from the op after the one that settled
// to the `last`-th, taking `us` each.
inline void runKept(Refiner& refiner, const Collective& c, Algorithm expect, double us, uint64_t last) {
  for (uint64_t i = 1; i < last; ++i) {
    CHECK(refiner.choose(c, kClose, Algorithm::kDirect) == expect, "kept op ", i);
    refiner.ran(us);
  }
}

// One rank's refiner over its device, and the line it last settled on.
struct Ranked {
  Ranked(tcp::Device& d, const Tuning& t) : c(collective(d, t, ws)) {
    refiner.onKept = [this](const std::string& s) { line = s; };
  }
  Workspace ws;
  Refiner refiner;
  std::string line;
  const Collective c;
};

// Runs fn(rank, its Ranked) on every rank of a group over TCP with model t.
inline void onEveryRank(const Tuning& t, const std::function<void(int, Ranked&)>& fn) {
  test::Group g(kRanks, test::over(shm::Mode::kTcp));
  test::runRanks(kRanks, [&](int r) {
    Ranked k(*g.devices[r], t);
    fn(r, k);
  });
}

}  // namespace collx::test
