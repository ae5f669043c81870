// Auto's online refinement (refine.h), over real loopback TCP, the first
// round's probes: after the first block and the second candidate's probe,
// each probe waits until the trial can pay for it within kProbeBudget, the
// fastest so far running meanwhile (a probed one a block at a time); a probe
// dearer than kProbeRatio pushes the next one later; where the wait would
// outlast kMaxWait ops, the probes left are not run; and those ops of the
// fastest do not fund later rounds. So a short job's first ops pay for the
// probes as its later ones do. The rest of the trials: test_refine.cc.
#include <cstdio>
#include <functional>
#include <vector>

#include "refine_harness.h"

using namespace collx;
using namespace collx::test;

namespace {

// A model with direct first, then ring, star and tree predicted close: four
// candidates at `close` bytes.
Tuning fourModel(size_t close = kClose) {
  Tuning t = closeModel(close);
  t.cost[size_t(Algorithm::kStar)] = t.cost[size_t(Algorithm::kRing)];
  t.cost[size_t(Algorithm::kTree)] = t.cost[size_t(Algorithm::kRing)];
  return t;
}

struct Op {
  Algorithm a;
  double us;
};

// Runs the trial at `bytes` on one rank until its check starts, op i of
// algorithm a taking us(a, i); returns the ops.
std::vector<Op> runTrial(Ranked& k, const std::function<double(Algorithm, int)>& us, size_t bytes = kClose) {
  std::vector<Op> ops;
  for (;;) {
    const Algorithm a = k.refiner.choose(k.c, bytes, Algorithm::kDirect);
    if (k.refiner.describe().find("checking") != std::string::npos) return ops;
    ops.push_back({a, us(a, int(ops.size()))});
    k.refiner.ran(ops.back().us);
    CHECK(ops.size() < 20000, "the trial does not end");
  }
}

// Runs the trial at kClose with direct's ops taking `directUs`, those of
// the second candidate (the first probed, which `second` gets) secondUs(i)
// at op i, and every other's `othersUs`; returns the ops.
std::vector<Op> runTrialWithSecond(Ranked& k, double directUs, const std::function<double(int)>& secondUs,
                                   double othersUs, Algorithm& second) {
  const int block = blockAt(k.c.costs(), kClose);
  second = Algorithm::kAuto;
  return runTrial(k, [&](Algorithm a, int i) {
    if (i == block) second = a;
    return a == Algorithm::kDirect ? directUs : a == second ? secondUs(i) : othersUs;
  });
}

// The ops' time over `fastest` each, in ops of it, from op `from` to `to`.
double excess(const std::vector<Op>& ops, size_t from, size_t to, double fastest) {
  double over = 0;
  for (size_t i = from; i < to; ++i) over += ops[i].us / fastest - 1;
  return over;
}

// Where each probe of the first round starts: the first op of each
// candidate after the first.
std::vector<size_t> probeStarts(const std::vector<Op>& ops) {
  std::vector<size_t> starts;
  std::vector<Algorithm> seen = {ops[0].a};
  for (size_t i = 0; i < ops.size(); ++i) {
    bool known = false;
    for (Algorithm a : seen) known = known || a == ops[i].a;
    if (!known) seen.push_back(ops[i].a), starts.push_back(i);
  }
  return starts;
}

// Direct, the first, takes 10 us; the third and fourth candidates 20
// (kProbeRatio), the second 40. The second's probe follows the first block
// at once; each later one starts at the first op where the ops after the
// first block, with it at kProbeRatio, stay within kProbeBudget of the
// trial's ops at 10 us, so the second's dear probe puts the third's later;
// direct runs meanwhile. The first 100 ops cost under kTrialBudget over
// direct's, and direct is kept.
void testProbesWaitForTheirBudget() {
  const Tuning t = fourModel();
  const int block = blockAt(t, kClose), probe = Refiner::probeFor(block);
  onEveryRank(t, [&](int r, Ranked& k) {
    Algorithm second;
    const std::vector<Op> ops = runTrialWithSecond(k, 10.0, [](int) { return 40.0; }, 20.0, second);
    const std::vector<size_t> starts = probeStarts(ops);
    CHECK(starts.size() == 3 && starts[0] == size_t(block), "rank ", r, ": probes at ", starts.size() ? starts[0] : 0);
    for (size_t i = 0; i < size_t(block); ++i) CHECK(ops[i].a == Algorithm::kDirect, "op ", i, " of the first block");
    for (size_t j = 1; j < starts.size(); ++j) {
      const size_t at = starts[j];
      const double room = Refiner::kProbeBudget * double(at + size_t(probe));
      const double due = excess(ops, size_t(block), at, 10.0) + (Refiner::kProbeRatio - 1) * probe;
      CHECK(due <= room && due > room - Refiner::kProbeBudget - 1e-9, "rank ", r, ": probe ", j, " at op ", at,
            ": due ", due, ", room ", room);
      for (size_t i = starts[j - 1] + size_t(probe); i < at; ++i) {
        CHECK(ops[i].a == Algorithm::kDirect, "filler op ", i);
      }
    }
    CHECK(starts[1] > size_t(block + probe) && starts[2] > starts[1] + size_t(probe), "rank ", r, ": probes at ",
          starts[1], ", ", starts[2]);
    CHECK(excess(ops, 0, 100, 10.0) <= Refiner::kTrialBudget * 100, "rank ", r, ": the first 100 ops cost ",
          excess(ops, 0, 100, 10.0), " ops over direct's");
    CHECK(runCheck(k.refiner, k.c, kClose, Algorithm::kDirect, 10.0) > 0, "rank ", r);
    CHECK(k.line.find("refined: 256 KiB: direct (10.0 us) over ") == 0 &&
              k.line.find("not probed") == std::string::npos,
          "rank ", r, ": ", k.line);
  });
}

// A probe faster than the first: the second candidate (5 us against
// direct's 20; the others 15) runs while the third and fourth wait, and is
// kept.
void testTheFastestFillsTheWait() {
  const Tuning t = fourModel();
  const int block = blockAt(t, kClose), probe = Refiner::probeFor(block);
  onEveryRank(t, [&](int r, Ranked& k) {
    Algorithm second;
    const std::vector<Op> ops = runTrialWithSecond(k, 20.0, [](int) { return 5.0; }, 15.0, second);
    const std::vector<size_t> starts = probeStarts(ops);
    CHECK(starts.size() == 3, "rank ", r, ": ", starts.size(), " probes");
    for (size_t i = starts[0]; i < starts[2]; ++i) {
      const bool third = i >= starts[1] && i < starts[1] + size_t(probe);
      CHECK(ops[i].a == second || third, "rank ", r, ": op ", i, " is ", name(ops[i].a), " between the probes");
    }
    CHECK(starts[1] > starts[0] + size_t(probe), "rank ", r, ": no wait before the third probe");
    runCheck(k.refiner, k.c, kClose, second, 5.0);
    CHECK(k.line.find(str("refined: 256 KiB: ", name(second), " (5.0 us) over ")) == 0, "rank ", r, ": ", k.line);
  });
}

// A probe that flatters: the second's probe ops take 5 us (direct's 10), its
// later ones 14. It leads for one block of fillers only: agreed again after
// it, direct is the fastest and runs until the third's probe; direct is kept.
void testAFlatteringProbeLeadsForOneBlock() {
  const Tuning t = fourModel();
  const int block = blockAt(t, kClose), probe = Refiner::probeFor(block);
  onEveryRank(t, [&](int r, Ranked& k) {
    Algorithm second;
    const std::vector<Op> ops =
        runTrialWithSecond(k, 10.0, [&](int i) { return i < block + probe ? 5.0 : 14.0; }, 20.0, second);
    const std::vector<size_t> starts = probeStarts(ops);
    CHECK(starts.size() == 3, "rank ", r, ": ", starts.size(), " probes");
    const size_t fill = size_t(block + probe);
    for (size_t i = fill; i < starts[1]; ++i) {
      CHECK(ops[i].a == (i < fill + size_t(block) ? second : Algorithm::kDirect), "rank ", r, ": op ", i);
    }
    CHECK(starts[1] > fill + size_t(block), "rank ", r, ": the third's probe at ", starts[1]);
    runCheck(k.refiner, k.c, kClose, Algorithm::kDirect, 10.0);
  });
}

// The second's probe is so dear (1000x direct) that paying it back within
// kProbeBudget would take over kMaxWait ops: the probes left are
// not run, and the trial ends with the two it has. One preempted op of its
// two (5 ms, the other 20 us) does not: the next probe comes where two ops
// of 20 would put it.
void testProbesLeftEndEarly() {
  const Tuning t = fourModel();
  const int block = blockAt(t, kClose), probe = Refiner::probeFor(block);
  onEveryRank(t, [&](int r, Ranked& k) {
    const std::vector<Op> ops = runTrial(k, [&](Algorithm a, int i) {
      return a == Algorithm::kDirect ? 10.0 : i == block ? 5000.0 : 20.0;
    });
    const std::vector<size_t> starts = probeStarts(ops);
    CHECK(starts.size() == 3, "rank ", r, ": ", starts.size(), " probes after a preempted one");
    const double room = Refiner::kProbeBudget * double(starts[1] + size_t(probe));
    const double due = 2 * (20.0 / 10 - 1) + (Refiner::kProbeRatio - 1) * probe;
    CHECK(due <= room && due > room - Refiner::kProbeBudget - 1e-9, "rank ", r, ": the third's probe at ", starts[1]);
  });
  onEveryRank(t, [&](int r, Ranked& k) {
    const std::vector<Op> ops =
        runTrial(k, [](Algorithm a, int) { return a == Algorithm::kDirect ? 10.0 : 10000.0; });
    CHECK(ops.size() == size_t(block + probe) && probeStarts(ops).size() == 1, "rank ", r, ": ", ops.size(),
          " trial ops");
    runCheck(k.refiner, k.c, kClose, Algorithm::kDirect, 10.0);
    CHECK(k.line.find("refined: 256 KiB: direct (10.0 us) over ") == 0 &&
              k.line.find("(not probed)") != std::string::npos,
          "rank ", r, ": ", k.line);
  });
}

// The fillers pay for the probes only: with every other candidate 1.3x
// direct, the next round's budget (kTrialBudget over the fastest's time for
// the trial's ops, fillers left out) buys none of them a block, where the
// fillers' 42 ops would buy one; the trial ends with its first round.
void testFillersDoNotFundLaterRounds() {
  const Tuning t = fourModel();
  const int block = blockAt(t, kClose), probe = Refiner::probeFor(block);
  onEveryRank(t, [&](int r, Ranked& k) {
    const std::vector<Op> ops = runTrial(k, [](Algorithm a, int) { return a == Algorithm::kDirect ? 10.0 : 13.0; });
    const std::vector<size_t> starts = probeStarts(ops);
    CHECK(starts.size() == 3 && starts[2] > starts[1] + size_t(probe) + 1, "rank ", r, ": no fillers");
    int blocks = 0;
    for (size_t j = 0; j < starts.size(); ++j) {
      int n = 0;
      for (const Op& op : ops) n += op.a == ops[starts[j]].a;
      blocks += n > probe;
    }
    CHECK(blocks == 0, "rank ", r, ": ", blocks, " candidates ran a block after their probe");
    CHECK(starts[2] + size_t(probe) == ops.size(), "rank ", r, ": ", ops.size() - starts[2],
          " ops after the last probe");
  });
}

// A class of slow ops (16 MiB, blocks of 4, two rounds, so R blocks are 8
// ops) still probes every candidate: the wait is bounded in ops, not by the
// class's trial.
void testSlowClassesProbeEveryCandidate() {
  constexpr size_t kBig = 16 << 20;
  const Tuning t = fourModel(kBig);
  CHECK(blockAt(t, kBig) * roundsAt(t, kBig) < 20, "R blocks of ", blockAt(t, kBig) * roundsAt(t, kBig), " ops");
  onEveryRank(t, [&](int r, Ranked& k) {
    const std::vector<Op> ops =
        runTrial(k, [](Algorithm a, int) { return a == Algorithm::kDirect ? 20000.0 : 40000.0; }, kBig);
    CHECK(probeStarts(ops).size() == 3, "rank ", r, ": ", probeStarts(ops).size(), " probes at 16 MiB");
  });
}

}  // namespace

int main() {
  testProbesWaitForTheirBudget();
  testTheFastestFillsTheWait();
  testAFlatteringProbeLeadsForOneBlock();
  testProbesLeftEndEarly();
  testFillersDoNotFundLaterRounds();
  testSlowClassesProbeEveryCandidate();
  std::printf("refine: probes within their budget ok\n");
  return 0;
}
