// Auto's saved choices (refine.h), over real loopback TCP: save() writes each
// settled class with every candidate's agreed time and keeps the other
// classes of an earlier save; a refiner seeded with them runs no trial, only
// the check of the saved choice, and settles there where the check holds
// within kTrustRatio, until a trial after kConfirmUs of its ops; where it
// does not hold, a trial follows at once; lines that do not
// parse, or that name a choice the class does not have, leave the class to
// its trial.
#include <cstdio>
#include <string>

#include "refine_harness.h"

using namespace collx;
using namespace collx::test;

namespace {

constexpr char kSavedDirect[] = "262144 flat direct 0 direct=10.000 ring=20.000\n";

// A trial where direct (10 us) beats ring (20): save() gives its line, and
// keeps an earlier save's line of another class while replacing its own.
void testSaveWritesSettledClasses() {
  onEveryRank(closeModel(), [](int r, Ranked& k) {
    auto& [ws, refiner, line, c] = k;
    CHECK(refiner.save().empty(), "saved before any op: ", refiner.save());
    runDirectRingTrial(refiner, c, 10.0, 20.0);
    CHECK(refiner.save().empty(), "saved in the check: ", refiner.save());
    runCheck(refiner, c, kClose, Algorithm::kDirect, 10.0);
    CHECK(refiner.save() == kSavedDirect, "rank ", r, ": ", refiner.save());
    const std::string earlier = "4096 one shm 0 shm=2.000 direct=3.000\n262144 flat ring 0 ring=5.000 direct=9.000\n";
    CHECK(refiner.save(earlier) == std::string(kSavedDirect) + "4096 one shm 0 shm=2.000 direct=3.000\n",
          "rank ", r, ": ", refiner.save(earlier));
  });
}

// Seeded, the class runs the saved direct from its first op, through the
// check (11 us, within kTrustRatio of 10), and settles there: no ring op.
void testSavedChoiceSettlesAfterItsCheck() {
  onEveryRank(closeModel(), [](int r, Ranked& k) {
    auto& [ws, refiner, line, c] = k;
    refiner.seed(kSavedDirect);
    const int ops = runCheck(refiner, c, kClose, Algorithm::kDirect, 11.0);
    CHECK(ops == Refiner::checkOpsFor(10.0) + 1, "rank ", r, ": ", ops, " ops to settle");
    CHECK(line == collx::str("refined: 256 KiB: direct (11.0 us) over ring (20.0 us); the saved choice, checked; "
                             "tried again after ",
                             Refiner::confirmOpsFor(11.0), " ops"),
          "rank ", r, ": ", line);
    CHECK(refiner.trying(kClose, Algorithm::kDirect), "rank ", r, ": settled before the trial after its check");
    runKept(refiner, c, Algorithm::kDirect, 11.0, 100);
  });
}

// Seeded, but direct now takes 20 us (2x its saved 10): the check does not
// trust it, and a trial follows, which finds ring (12 us) the faster.
void testSavedChoiceThatNoLongerHoldsIsTried() {
  onEveryRank(closeModel(), [](int r, Ranked& k) {
    auto& [ws, refiner, line, c] = k;
    refiner.seed(kSavedDirect);
    runChecks(refiner, c, {{Algorithm::kDirect, 20.0, Refiner::checkOpsFor(10.0)}});
    CHECK(refiner.trying(kClose, Algorithm::kDirect) && line.empty(), "rank ", r, ": settled on the saved choice");
    runDirectRingTrial(refiner, c, 20.0, 12.0);
    runCheck(refiner, c, kClose, Algorithm::kRing, 12.0);
    CHECK(line.rfind("refined: 256 KiB: ring (12.0 us) over direct (20.0 us)", 0) == 0 &&
              line.find("saved") == std::string::npos,
          "rank ", r, ": ", line);
  });
}

// The saved times of the other candidates are another run's: ring's 20 us
// was measured there, and ring now takes 5. The saved direct settles after
// its check, runs on for kConfirmUs of its ops (capped at kConfirmOps), and
// then meets ring in a trial, which ring wins.
void testSavedChoiceMeetsTheOthersAgain() {
  onEveryRank(closeModel(), [](int r, Ranked& k) {
    auto& [ws, refiner, line, c] = k;
    refiner.seed(kSavedDirect);
    runCheck(refiner, c, kClose, Algorithm::kDirect, 10.0);
    runKept(refiner, c, Algorithm::kDirect, 10.0, Refiner::confirmOpsFor(10.0));
    CHECK(refiner.trying(kClose, Algorithm::kDirect) && refiner.describe().find("refining: ") == std::string::npos,
          "rank ", r, ": ", refiner.describe());
    runDirectRingTrial(refiner, c, 10.0, 5.0);
    runCheck(refiner, c, kClose, Algorithm::kRing, 5.0);
    CHECK(line.rfind("refined: 256 KiB: ring (5.0 us) over direct (10.0 us)", 0) == 0 &&
              line.find("saved") == std::string::npos,
          "rank ", r, ": ", line);
    CHECK(refiner.save().rfind("262144 flat ring ", 0) == 0, "rank ", r, ": ", refiner.save());
  });
}

// Damaged lines, and a saved tree the class does not try at 256 KiB: the
// class runs its trial as if nothing was saved.
void testUnusableSeedsAreIgnored() {
  onEveryRank(closeModel(), [](int r, Ranked& k) {
    auto& [ws, refiner, line, c] = k;
    refiner.seed("262144 flat tree 0 tree=1.000 direct=10.000\n262144 flat\nx y z\n262144 flat ring 0 ring=-1\n"
                 "262144 flat ring 0 ring=1 nonsense=2\n");
    runDirectRingTrial(refiner, c, 10.0, 20.0);
    runCheck(refiner, c, kClose, Algorithm::kDirect, 10.0);
    CHECK(line == "refined: 256 KiB: direct (10.0 us) over ring (20.0 us)", "rank ", r, ": ", line);
  });
}

}  // namespace

int main() {
  testSaveWritesSettledClasses();
  testSavedChoiceSettlesAfterItsCheck();
  testSavedChoiceThatNoLongerHoldsIsTried();
  testSavedChoiceMeetsTheOthersAgain();
  testUnusableSeedsAreIgnored();
  std::puts("test_refine_saved: ok");
  return 0;
}
