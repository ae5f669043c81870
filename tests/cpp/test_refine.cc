// Auto's online refinement (refine.h), over real loopback TCP, its trials:
// the ranks keep the algorithm the group's summed times favour, even where one
// rank's own clock says otherwise; trials take turns in blocks alike on every
// rank, a first round of probes, and a candidate stays only while the trial
// keeps within its budget; classes the model finds
// clear-cut run no trial; a settled choice is re-tried after kRecheckOps, or a
// minute of its ops; algorithms far off but cheap to try are tried; a class of
// slow ops runs shorter blocks and fewer rounds, one of cheap ops the most
// rounds, judged by each candidate's lower median block; the shared-memory
// windows are a candidate where auto takes them, and below them over shared
// memory; the one-round shared-memory all-reduce is tried against direct
// alone; a model far slower than the measured times is said stale, once; and
// the real all-reduce path stays correct through it. The checks after a trial
// and the second trials: test_refine_checks.cc.
#include <cstdio>
#include <vector>

#include "../../csrc/core/reduce/reduce.h"
#include "refine_harness.h"

using namespace collx;
using namespace collx::test;

namespace {

// Rank 0 times direct faster (10 us against 20), ranks 1 and 2 ring (15
// against 30): summed, ring wins (50 against 70 per trial pair), and every
// rank keeps ring, rank 0 included. Direct's 1.4x is far behind: the trial
// ends after its second round (direct's block and ring's probe, then a block
// of each, as ring challenges auto's own choice). The first ops of the first
// round's block, and the first of ring's probe, slow after the switch, are
// left out of the times (uncounted, and above the probe's lower median).
void testAgreementOverrulesOneClock() {
  const Tuning t = closeModel();
  const int block = blockAt(t, kClose), skip = Refiner::skipped(block), rounds = roundsAt(t, kClose);
  CHECK(block == Refiner::kMaxBlock && rounds > Refiner::kMinRounds, "blocks of ", block, ", ", rounds,
        " rounds at 256 KiB");
  test::Group g(kRanks, test::over(shm::Mode::kTcp));
  test::runRanks(kRanks, [&](int r) {
    Workspace ws;
    Refiner refiner;
    std::string line, stale;
    int staleCalls = 0;
    refiner.onKept = [&](const std::string& s) { line = s; };
    refiner.onStale = [&](const std::string& s) { stale = s, ++staleCalls; };
    const Collective c = collective(*g.devices[r], t, ws);
    for (int i = 0; i < trialOps(2, block, 2); ++i) {
      const Algorithm a = refiner.choose(c, kClose, Algorithm::kDirect);
      CHECK(a == trialAlgorithm(i, block), "rank ", r, " trial ", i, ": ", name(a));
      const bool direct = a == Algorithm::kDirect;
      const bool first = direct ? i < skip : i == block;
      refiner.ran((first ? 500.0 : 0.0) + (r == 0 ? (direct ? 10.0 : 20.0) : (direct ? 30.0 : 15.0)));
      CHECK(refiner.kept(kClose, Algorithm::kDirect) == Algorithm::kDirect, "nothing kept during the trial");
    }
    // Its check: ring runs on at its trial's pace on every rank, and holds.
    CHECK(line.empty() && refiner.trying(kClose, Algorithm::kDirect), "settled before the check");
    CHECK(runCheck(refiner, c, kClose, Algorithm::kRing, r == 0 ? 20.0 : 15.0) == Refiner::checkOpsFor(16.7) + 1,
          "rank ", r, ": not one check of ring");
    CHECK(refiner.kept(kClose + 1000, Algorithm::kDirect) == Algorithm::kRing, "the class keeps ring");
    CHECK(line == "refined: 256 KiB: ring (16.7 us) over direct (23.3 us); auto's own choice was direct: tried again "
                  "after 4096 ops",
          "rank ", r, ": ", line);
    CHECK(refiner.describe() == line, refiner.describe());
    // The model predicted direct at 256 KiB over 3x slower than the 23.3 us
    // measured: it is stale, said once, on every rank.
    CHECK(staleCalls == 1 && stale.find("where the group measured 23.3 us") != std::string::npos, stale);
    // Not auto's own choice: kept for confirmOpsFor ops (the settling op was
    // the first), then tried a second time, where ring holds.
    CHECK(Refiner::confirmOpsFor(16.7) == 4096, "confirmOpsFor(16.7): ", Refiner::confirmOpsFor(16.7));
    runKept(refiner, c, Algorithm::kRing, 1.0, Refiner::confirmOpsFor(16.7));
    for (int i = 0; i < trialOps(2, block, 2); ++i) {
      const bool direct = trialAlgorithm(i, block) == Algorithm::kDirect;
      CHECK(refiner.choose(c, kClose, Algorithm::kDirect) == trialAlgorithm(i, block), "the second trial, op ", i);
      refiner.ran(r == 0 ? (direct ? 10.0 : 20.0) : (direct ? 30.0 : 15.0));
    }
    runCheck(refiner, c, kClose, Algorithm::kRing, r == 0 ? 20.0 : 15.0);
    CHECK(line == "refined: 256 KiB: ring (16.7 us) over direct (23.3 us)", "rank ", r, ": ", line);
    // Kept for kRecheckOps ops in all (the settling op was the first), then
    // tried again; alike now, both stay for every round of the trial.
    runKept(refiner, c, Algorithm::kRing, 1.0, Refiner::kRecheckOps);
    for (int i = 0; i < trialOps(2, block, rounds); ++i) {
      CHECK(refiner.choose(c, kClose, Algorithm::kDirect) == trialAlgorithm(i, block), "a new trial, op ", i);
      refiner.ran(r == 0 ? 10.0 : 30.0);
    }
    runCheck(refiner, c, kClose, Algorithm::kDirect, r == 0 ? 10.0 : 30.0);
    CHECK(refiner.choose(c, kClose, Algorithm::kDirect) == Algorithm::kDirect, "the new trial keeps direct");
    CHECK(staleCalls == 1, "stale said again");
    // Clear-cut (the others predicted far off and slow), and a choice auto
    // takes by rule: no trial.
    Tuning far = t;
    far.cost[size_t(Algorithm::kRing)] = {1e6, 1.0};
    const Collective cFar = collective(*g.devices[r], far, ws);
    for (int i = 0; i < 200; ++i) {
      CHECK(refiner.choose(cFar, 8, Algorithm::kDirect) == Algorithm::kDirect, "a trial at 8 B");
      CHECK(refiner.choose(c, kClose, Algorithm::kHierarchical) == Algorithm::kHierarchical, "hier refined");
    }
    // Far off but cheap: with a step of 1 us, at 64 B ring's four steps are
    // predicted ~20x direct's one, a few us, so ring is tried too.
    Tuning slowRing = t;
    slowRing.cost[size_t(Algorithm::kRing)].latencyUs = 1.0;
    const Collective cSlow = collective(*g.devices[r], slowRing, ws);
    CHECK(predictAllreduceUs(slowRing, Algorithm::kRing, kRanks, 2, 64) >
              Refiner::kCloseRatio * predictAllreduceUs(slowRing, Algorithm::kDirect, kRanks, 2, 64),
          "ring is within kCloseRatio at 64 B");
    for (int i = 0; i < 2 * blockAt(slowRing, 64); ++i) {
      CHECK(refiner.choose(cSlow, 64, Algorithm::kDirect) == trialAlgorithm(i, blockAt(slowRing, 64)), "64 B trial op ",
            i);
      refiner.ran(1.0);
    }
  });
}

// A class whose ops take ~20 ms runs the shortest blocks and the shortest
// probes, and says where its trial stands in describe() meanwhile. Ring,
// 2.5x direct in its one-op probe (a block of it 120 ms more), leaves the
// trial there: direct is kept after 5 ops, not 13, and checked over the
// fewest ops, 8.
void testSlowClassesTryLess() {
  CHECK(Refiner::blockFor(10) == 16 && Refiner::blockFor(2000) == 8 && Refiner::blockFor(1e5) == 4, "blockFor: ",
        Refiner::blockFor(10), ", ", Refiner::blockFor(2000), ", ", Refiner::blockFor(1e5));
  CHECK(Refiner::checkOpsFor(1) == 256 && Refiner::checkOpsFor(200) == 100 && Refiner::checkOpsFor(2e4) == 8,
        "checkOpsFor: ", Refiner::checkOpsFor(1), ", ", Refiner::checkOpsFor(200), ", ", Refiner::checkOpsFor(2e4));
  constexpr size_t kBig = 16 << 20;
  const Tuning t = closeModel(kBig);
  const int block = blockAt(t, kBig);
  CHECK(block == 4 && Refiner::probeFor(block) == 1 && Refiner::probeFor(8) == 1 && Refiner::probeFor(16) == 2,
        "blocks of ", block, " at 16 MiB; probes of ", Refiner::probeFor(block));
  test::Group g(kRanks, test::over(shm::Mode::kTcp));
  test::runRanks(kRanks, [&](int r) {
    Ranked k(*g.devices[r], t);
    auto& [ws, refiner, line, c] = k;
    for (int i = 0; i < trialOps(2, block, 1); ++i) {
      CHECK(refiner.choose(c, kBig, Algorithm::kDirect) == trialAlgorithm(i, block), "rank ", r, " trial ", i);
      refiner.ran(trialAlgorithm(i, block) == Algorithm::kDirect ? 20000.0 : 50000.0);
      if (i == 3) CHECK(refiner.describe() == "refining: 16 MiB: 4 of 13 ops", refiner.describe());
      CHECK(refiner.trying(kBig, Algorithm::kDirect), "op ", i, " is in the trial");
    }
    CHECK(refiner.choose(c, kBig, Algorithm::kDirect) == Algorithm::kDirect, "rank ", r, " did not keep direct");
    refiner.ran(20000.0);
    CHECK(refiner.describe() == "refining: 16 MiB: checking direct, 1 of 8 ops", refiner.describe());
    CHECK(runCheck(refiner, c, kBig, Algorithm::kDirect, 20000.0) == 8, "rank ", r, ": not 8 check ops");
    CHECK(line == "refined: 16 MiB: direct (20000.0 us) over ring (50000.0 us)", line);
    CHECK(!refiner.trying(kBig, Algorithm::kDirect) && !refiner.trying(8, Algorithm::kDirect), "no trial after settling, nor at 8 B");
    // Kept for a minute of its agreed time, 3000 ops of 20 ms, not for
    // kRecheckOps: then a new trial.
    const uint64_t recheck = Refiner::recheckOpsFor(20000.0);
    CHECK(recheck == 3000 && Refiner::recheckOpsFor(16.7) == Refiner::kRecheckOps, "recheckOpsFor: ", recheck);
    for (uint64_t i = 1; i < recheck; ++i) {
      CHECK(refiner.choose(c, kBig, Algorithm::kDirect) == Algorithm::kDirect, "kept op ", i);
    }
    CHECK(refiner.choose(c, kBig, Algorithm::kDirect) == Algorithm::kDirect && refiner.trying(kBig, Algorithm::kDirect),
          "rank ", r, ": no new trial after ", recheck, " ops");
  });
}

// Three algorithms predicted close: the trial runs direct's block, then a
// probe of ring and of star. Star is the fastest; ring, at 1.6x, is too far
// behind to run another block, and direct (5x), auto's own choice, meets
// star once more in a block of each before star is kept.
void testThreeCandidates() {
  Tuning t = closeModel();
  t.cost[size_t(Algorithm::kStar)] = t.cost[size_t(Algorithm::kRing)];
  auto us = [&](Algorithm a) { return predictAllreduceUs(t, a, kRanks, 2, kClose); };
  CHECK(us(Algorithm::kStar) <= Refiner::kCloseRatio * us(Algorithm::kDirect) && us(Algorithm::kStar) > us(Algorithm::kRing),
        "star is the third candidate: ", us(Algorithm::kStar), " us, ring ", us(Algorithm::kRing));
  test::Group g(kRanks, test::over(shm::Mode::kTcp));
  test::runRanks(kRanks, [&](int r) {
    Ranked k(*g.devices[r], t);
    auto& [ws, refiner, line, c] = k;
    runTrialInTurn(refiner, c, kClose, Algorithm::kDirect, {Algorithm::kDirect, Algorithm::kRing, Algorithm::kStar},
                   blockAt(t, kClose),
                   [](Algorithm a) { return a == Algorithm::kStar ? 5.0 : a == Algorithm::kRing ? 8.0 : 25.0; }, 2,
                   {Algorithm::kDirect, Algorithm::kStar});
    runCheck(refiner, c, kClose, Algorithm::kStar, 5.0);
    CHECK(line == "refined: 256 KiB: star (5.0 us) over direct (25.0 us), ring (8.0 us); auto's own choice was direct: "
                  "tried again after 4096 ops",
          line);
  });
}

// Direct's ops take 5 us, but every fourth 30 (6x the median; 12.5 on
// average over a block's counted ops), ring's take 10: ring is kept, though
// most of direct's ops are faster. A preemption (one op of 5 ms) in ring's
// probe leaves its lower median; in a block it counts as kOutlierRatio times
// the median.
void testVaryingOpsPayForTheirSlowOnes() {
  const Tuning t = closeModel();
  const int block = blockAt(t, kClose);
  test::Group g(kRanks, test::over(shm::Mode::kTcp));
  test::runRanks(kRanks, [&](int r) {
    Ranked k(*g.devices[r], t);
    auto& [ws, refiner, line, c] = k;
    for (int i = 0, direct = 0; i < trialOps(2, block, 2); ++i) {
      const Algorithm a = refiner.choose(c, kClose, Algorithm::kDirect);
      CHECK(a == trialAlgorithm(i, block), "rank ", r, " trial ", i, ": ", name(a));
      refiner.ran(a == Algorithm::kDirect ? (direct++ % 4 == 3 ? 30.0 : 5.0) : i == block + 1 ? 5000.0 : 10.0);
      if (i == block + 1) {
        const int planned = trialOps(2, block, roundsAt(t, kClose));
        CHECK(refiner.describe() == str("refining: 256 KiB: 18 of ", planned, " ops"), refiner.describe());
      }
    }
    runCheck(refiner, c, kClose, Algorithm::kRing, 10.0);
    CHECK(line == "refined: 256 KiB: ring (10.0 us) over direct (12.5 us); auto's own choice was direct: tried again "
                  "after 4096 ops",
          line);
    Refiner::Block preempted{{10, 10, 10, 10, 5000}};
    CHECK(preempted.typical() == (4 * 10 + Refiner::kOutlierRatio * 10) / 5, "a preemption: ", preempted.typical());
    preempted.probe = true;
    CHECK(preempted.typical() == 10, "a preempted probe: ", preempted.typical());
    // The probes of slow classes count two ops, or one: the lower of two.
    Refiner::Block two{{5000, 10}, true}, one{{10}, true};
    CHECK(two.typical() == 10 && one.typical() == 10, "probes of two and one: ", two.typical(), ", ", one.typical());
  });
}

// The budget: direct takes 10 us; ring, 5% slower, costs a trial 2.5% a
// round and stays for every round; ring 25% slower would take the trial
// past kTrialBudget in its third round, so the trial ends after two. Either
// trial costs at most kTrialBudget over direct's time for its ops. The first
// block is not the trial's cost: where the first op of the size takes 1 ms
// (as the first ops of a size do), ring 5% slower still stays for every round.
void testTrialStaysWithinItsBudget() {
  const Tuning t = closeModel();
  const int block = blockAt(t, kClose), rounds = roundsAt(t, kClose);
  struct Case {
    double ringUs;
    int trialRounds;
    double firstUs;
  };
  for (const Case& x : {Case{10.5, rounds, 10.0}, Case{12.5, 2, 10.0}, Case{10.5, rounds, 1000.0}}) {
    onEveryRank(t, [&, ringUs = x.ringUs, trialRounds = x.trialRounds, firstUs = x.firstUs](int r, Ranked& k) {
      auto& [ws, refiner, line, c] = k;
      double spent = 0;
      int ops = 0;
      for (;; ++ops) {
        const Algorithm a = refiner.choose(c, kClose, Algorithm::kDirect);
        if (refiner.describe().find("checking") != std::string::npos) break;  // the trial's end
        CHECK(a == trialAlgorithm(ops, block), "rank ", r, " trial op ", ops, ": ", name(a));
        const double us = a == Algorithm::kDirect ? (ops == 0 ? firstUs : 10.0) : ringUs;
        refiner.ran(us);
        spent += ops == 0 ? 10.0 : us;  // the first op's cold cost is not the trial's
      }
      CHECK(ops == trialOps(2, block, trialRounds), "rank ", r, ", ring at ", ringUs, " us: ", ops, " trial ops, not ",
            trialOps(2, block, trialRounds));
      CHECK(spent <= (1 + Refiner::kTrialBudget) * 10.0 * ops, "the trial cost ", spent / (10.0 * ops), "x direct's");
    });
  }
}

// Direct's first block runs in a slow spell (40 us an op) and ring's probe
// does not (30): ring, faster after one round, meets direct in a block of
// each once more, where direct takes 21 and ring 34; the lower of each
// one's two keeps direct, auto's own choice, and the trial ends there.
void testOneSlowBlockDoesNotDisplaceTheFirst() {
  const Tuning t = closeModel();
  const int block = blockAt(t, kClose), first = trialOps(2, block, 1);
  onEveryRank(t, [&](int r, Ranked& k) {
    auto& [ws, refiner, line, c] = k;
    for (int i = 0; i < trialOps(2, block, 2); ++i) {
      const Algorithm a = refiner.choose(c, kClose, Algorithm::kDirect);
      CHECK(a == trialAlgorithm(i, block), "rank ", r, " trial op ", i, ": ", name(a));
      refiner.ran(a == Algorithm::kDirect ? (i < first ? 40.0 : 21.0) : i < first ? 30.0 : 34.0);
    }
    runCheck(refiner, c, kClose, Algorithm::kDirect, 21.0);
    CHECK(line == "refined: 256 KiB: direct (21.0 us) over ring (30.0 us)", "rank ", r, ": ", line);
  });
}

// A class of ops of tens of us runs the most rounds, and each candidate
// counts its lower median block: direct's first two blocks fall in a slow
// spell of the machine (24 us an op), its others take 20; ring steadily
// takes 22. Close, both stay within the budget for every round, and direct
// is kept, where two rounds (the lowest of two) kept ring. (The model
// predicts 9 us: within kSpellRatio, no second trial.)
void testCheapClassesTryInMoreRounds() {
  CHECK(Refiner::roundsFor(16 * 10.0) == 64 && Refiner::roundsFor(16 * 1000.0) == 9 &&
            Refiner::roundsFor(8 * 4000.0) == 4 && Refiner::roundsFor(4 * 20000.0) == 2 && Refiner::roundsFor(0) == 64,
        "roundsFor: ", Refiner::roundsFor(16 * 10.0), ", ", Refiner::roundsFor(16 * 1000.0), ", ",
        Refiner::roundsFor(8 * 4000.0), ", ", Refiner::roundsFor(4 * 20000.0));
  constexpr size_t kCheap = 8 << 10;
  const Tuning t = closeModel(kCheap);
  const int block = blockAt(t, kCheap), rounds = roundsAt(t, kCheap);
  CHECK(rounds == Refiner::kMaxRounds, rounds, " rounds at 8 KiB (", predictedAt(t, kCheap), " us predicted)");
  test::Group g(kRanks, test::over(shm::Mode::kTcp));
  test::runRanks(kRanks, [&](int r) {
    Ranked k(*g.devices[r], t);
    auto& [ws, refiner, line, c] = k;
    for (int i = 0; i < trialOps(2, block, rounds); ++i) {
      const Algorithm a = refiner.choose(c, kCheap, Algorithm::kDirect);
      CHECK(a == trialAlgorithm(i, block), "rank ", r, " trial ", i, ": ", name(a));
      refiner.ran(a == Algorithm::kRing ? 22.0 : i < trialOps(2, block, 2) ? 24.0 : 20.0);
      CHECK(refiner.trying(kCheap, Algorithm::kDirect), "op ", i, " is in the trial");
    }
    runCheck(refiner, c, kCheap, Algorithm::kDirect, 20.0);
    CHECK(line == "refined: 8 KiB: direct (20.0 us) over ring (22.0 us)", line);
  });
}

// Over shared memory, from 64 KiB, auto takes the windows by rule: the
// trial runs them first, then the model's choice (direct) and ring. Ring,
// the fastest, is kept.
void testSharedWindowsAreACandidate() {
  const Tuning t = closeModel();
  const int block = blockAt(t, kClose);
  test::Group g(kRanks, test::over(shm::Mode::kShm));
  test::runRanks(kRanks, [&](int r) {
    Ranked k(*g.devices[r], t);
    auto& [ws, refiner, line, c] = k;
    CHECK(useSharedWindows(c.transport, kClose), "rank ", r, ": no shared windows");
    runTrialInTurn(refiner, c, kClose, Algorithm::kShm, {Algorithm::kShm, Algorithm::kDirect, Algorithm::kRing}, block,
                   [](Algorithm a) { return a == Algorithm::kRing ? 10.0 : a == Algorithm::kShm ? 12.0 : 25.0; }, 2,
                   {Algorithm::kShm, Algorithm::kRing});
    runCheck(refiner, c, kClose, Algorithm::kRing, 10.0, Algorithm::kShm);
    CHECK(line == "refined: 256 KiB: ring (10.0 us) over shm (12.0 us), direct (25.0 us); auto's own choice was shm: "
                  "tried again after 4096 ops",
          line);
    CHECK(refiner.kept(kClose, Algorithm::kShm) == Algorithm::kRing, "rank ", r, ": ring not kept");
  });
}

// Up to 4096 B over shared memory, where auto takes the one-round
// all-reduce by rule, it is tried against direct alone (ring, the fastest
// here, is no candidate), and direct kept where it is faster. The 4 KiB
// class holds two apart: at 4096 B the one round's, above it the flat
// choice's, each with its own trial and kept choice.
void testOneRoundIsTriedAgainstDirect() {
  const Tuning t = closeModel();
  test::Group g(kRanks, test::over(shm::Mode::kShm));
  test::runRanks(kRanks, [&](int r) {
    Ranked k(*g.devices[r], t);
    auto& [ws, refiner, line, c] = k;
    // Below kSpellRatio times the model's time, so that no second trial follows.
    const double direct = 2.0 * predictAllreduceUs(t, Algorithm::kDirect, kRanks, 2, 1024);
    auto us = [&](Algorithm a) { return a == Algorithm::kDirect ? direct : a == Algorithm::kShm ? 1.3 * direct : 0.1; };
    const int block = Refiner::blockFor(direct / 2);
    // shm at 1.3x: far enough behind to end it after two rounds (at 1.2x, a
    // round of both costs the 10% the budget allows).
    for (int i = 0; i < trialOps(2, block, 2); ++i) {
      const Algorithm a = refiner.choose(c, 1024, Algorithm::kShm);
      CHECK(a == (inTurn(i, 2, block) == 0 ? Algorithm::kShm : Algorithm::kDirect), "rank ", r, " trial op ", i, ": ",
            name(a));
      refiner.ran(us(a));
    }
    runCheck(refiner, c, 1024, Algorithm::kDirect, direct, Algorithm::kShm);
    CHECK(line.rfind("refined: 1 KiB in one round: direct (", 0) == 0 && line.find("over shm (") != std::string::npos,
          line);
    CHECK(refiner.kept(1024, Algorithm::kShm) == Algorithm::kDirect, "rank ", r, ": direct not kept at 1 KiB");

    // Above 4096 B auto's flat choice is tried and ring kept; 4096 B then
    // starts a trial of its own, from the one round.
    int ops = 0;
    do {
      refiner.ran(refiner.choose(c, 5000, Algorithm::kDirect) == Algorithm::kRing ? 1.0 : 9.0);
    } while (refiner.trying(5000, Algorithm::kDirect) && ++ops < 20000);
    CHECK(refiner.kept(5000, Algorithm::kDirect) == Algorithm::kRing, "rank ", r, ": ring not kept at 5000 B");
    CHECK(refiner.kept(4096, Algorithm::kShm) == Algorithm::kShm && !refiner.trying(4096, Algorithm::kShm), "rank ", r,
          ": the one round's 4 KiB class has run before its first op");
    CHECK(refiner.choose(c, 4096, Algorithm::kShm) == Algorithm::kShm && refiner.trying(4096, Algorithm::kShm), "rank ",
          r, ": 4096 B did not start the one round's trial");
    refiner.ran(1.0);
    CHECK(refiner.kept(5000, Algorithm::kDirect) == Algorithm::kRing && !refiner.trying(5000, Algorithm::kDirect),
          "rank ", r, ": the flat 4 KiB class was disturbed");
  });
}

// Over shared memory below 64 KiB, where auto takes the model's flat choice,
// the windows are tried last and kept where they are the fastest; over TCP
// they are no candidate. (Ring, 1.3x the windows, is too far behind for a
// second block; at 1.2x it would have one.)
void testSharedWindowsJoinBelowTheirRule() {
  constexpr size_t kSmall = 16 << 10;
  const Tuning t = closeModel(kSmall);
  const int block = blockAt(t, kSmall);
  for (shm::Mode mode : {shm::Mode::kShm, shm::Mode::kTcp}) {
    test::Group g(kRanks, test::over(mode));
    test::runRanks(kRanks, [&](int r) {
      Ranked k(*g.devices[r], t);
      auto& [ws, refiner, line, c] = k;
      std::vector<Algorithm> order = {Algorithm::kDirect, Algorithm::kRing};
      if (mode == shm::Mode::kShm) order.push_back(Algorithm::kShm);
      const Algorithm fastest = mode == shm::Mode::kShm ? Algorithm::kShm : Algorithm::kRing;
      runTrialInTurn(refiner, c, kSmall, Algorithm::kDirect, order, block,
                     [](Algorithm a) { return a == Algorithm::kShm ? 10.0 : a == Algorithm::kRing ? 13.0 : 25.0; }, 2,
                     {Algorithm::kDirect, fastest});
      runCheck(refiner, c, kSmall, fastest, 10.0);
      CHECK(refiner.kept(kSmall, Algorithm::kDirect) == fastest, "rank ", r, ": kept ",
            name(refiner.kept(kSmall, Algorithm::kDirect)));
    });
  }
}

// The real path: auto all-reduces of sizes within one class, with the
// refiner set, each checked against the locally computed sum; every rank
// must run the same algorithm at every op, take turns in the trial's first
// round, and settle on one after the trial and its checks, whatever its
// clock said.
void testAllreduceThroughTheRefiner(shm::Mode mode, size_t close) {
  const Tuning t = closeModel(close);
  test::Group g(kRanks, test::over(mode));
  const int block = blockAt(t, close);
  std::vector<std::vector<Algorithm>> ran(kRanks);
  std::vector<int> settledAt(kRanks);
  test::runRanks(kRanks, [&](int r) {
    Workspace ws;
    Refiner refiner;
    const ReduceFn sum = cpuReduceFn(DataType::kFloat32, ReduceOp::kSum);
    auto op = [&](int i) {
      const size_t count = close / 4 + size_t(i % 100) * 10;  // all in one class
      std::vector<float> buf(count);
      for (size_t j = 0; j < count; ++j) buf[j] = float((j % 97) * (r + 1));
      Collective c = collective(*g.devices[r], t, ws, uint64_t(i + 1));
      c.refiner = &refiner;
      ran[r].push_back(allreduce(c, Algorithm::kAuto, buf.data(), count, sum));
      for (size_t j = 0; j < count; ++j) {
        CHECK(buf[j] == float((j % 97) * 6), "op ", i, " rank ", r, " element ", j, ": ", buf[j]);
      }
    };
    int i = 0;
    // R rounds of a block per candidate at most (the windows too over shared
    // memory below them), and as many of the fastest before a third's probe,
    // two checks of each at most, then six settled ops.
    const int candidates = mode == shm::Mode::kShm && close < (64 << 10) ? 3 : 2;
    const int most = trialOps(candidates + 1, block, roundsAt(t, close)) + 2 * candidates * Refiner::checkOpsFor(0);
    while ((i == 0 || refiner.trying(close, Algorithm::kDirect)) && i < most) op(i++);
    settledAt[r] = i;
    for (int more = 0; more < 6; ++more) op(i++);
  });
  for (int r = 1; r < kRanks; ++r) CHECK(ran[r] == ran[0], "rank ", r, " ran other algorithms than rank 0");
  std::vector<Algorithm> order = {Algorithm::kDirect, Algorithm::kRing};
  if (mode == shm::Mode::kShm && close < (64 << 10)) order.push_back(Algorithm::kShm);
  const int first = trialOps(2, block, 1);  // the first's block, the second's probe; a third's waits on the times
  for (int i = 0; i < first; ++i) {
    CHECK(ran[0][i] == order[size_t(inTurn(i, 2, block))], "trial op ", i, ": ", name(ran[0][i]));
  }
  const size_t at = size_t(settledAt[0]);
  CHECK(at > size_t(first), "settled after ", at, " ops");
  for (size_t i = at - 1; i < ran[0].size(); ++i) CHECK(ran[0][i] == ran[0][at - 1], "settled op ", i);
}

}  // namespace

int main() {
  testAgreementOverrulesOneClock();
  testThreeCandidates();
  testSlowClassesTryLess();
  testVaryingOpsPayForTheirSlowOnes();
  testCheapClassesTryInMoreRounds();
  testTrialStaysWithinItsBudget();
  testOneSlowBlockDoesNotDisplaceTheFirst();
  testSharedWindowsAreACandidate();
  testOneRoundIsTriedAgainstDirect();
  testSharedWindowsJoinBelowTheirRule();
  testAllreduceThroughTheRefiner(shm::Mode::kTcp, kClose);
  // Over the rings, between the sizes auto gives the windows.
  testAllreduceThroughTheRefiner(shm::Mode::kShm, 16 << 10);
  std::printf("refine: agreement, trials, recheck, all-reduce ok\n");
  return 0;
}
