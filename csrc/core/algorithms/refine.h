// Online refinement of auto's all-reduce choice, from the timings of the
// group's own ops. The rules, their reasons and the runs behind the
// constants: docs/algorithms.md ("Online refinement") and
// docs/measurements.md ("Evidence behind auto's rules").
//
// Rule: per size class (the power of two at or below an op's bytes), the
// candidates are auto's choice and every flat algorithm the model predicts
// within kCloseRatio of it or cheap to try (at most kCheapUs more over two
// blocks). The class then runs:
//
//   trial    R rounds (roundsFor) of a block of B ops (blockFor) per
//            candidate, the first 3B/8 ops of a block uncounted; in the
//            first round the first candidate runs B ops and each other a
//            probe of P (probeFor); a probe after the second waits until
//            the ops after the first block, each at its candidate's typical
//            op and the probe at kProbeRatio times the fastest so far, cost
//            at most kProbeBudget of the trial's ops at the fastest's time,
//            the fastest running meanwhile (agreed before each such probe,
//            and after each block of a probed candidate that leads; where
//            the wait would outlast kMaxWait ops, the probes left are not
//            run).
//            After each round one all-reduce agrees each candidate's lower
//            median block time (Block::typical; a probed lead's fillers
//            make its probe a block, the first candidate's place probes
//            only, since its warm ops beside cold probes would keep it)
//            and what the trial's ops
//            took, the first block (auto's own choice, the size's first
//            ops) and those fillers left out; fastest first, a candidate
//            stays for the next round only while those ops, its next block
//            included, cost at most kTrialBudget of the trial's ops at the
//            fastest's time over it; where the first round's fastest is not the
//            first candidate, the first stays for one more round whatever it
//            costs. The class keeps the fastest
//   check    C ops (checkOpsFor) of the kept one; over kSwitchRatio times
//            another's trial time, or over another's checked time, it gives
//            way to that one, which is checked too, and the one left is
//            checked once more
//   run on   the kept one, for kRecheckOps ops or kRecheckUs of them, then a
//            new trial
//   again    where the class left auto's own choice, or its fastest ran over
//            kSpellRatio times the model, a second trial follows after
//            kConfirmUs (at most kConfirmOps ops); each candidate keeps the
//            lower of its two times
//
// Reason: the model is a line through a few calibrated sizes, which can pick
// a slower algorithm near a crossover or after a calibration in a slow spell
// of the machine. With more ranks than cores, times come in spells and
// modes, so a trial must run long enough to span them, and since a spell
// only slows ops down, the lower of two looks is the truer one. A close
// candidate needs the most rounds to be told apart and costs the least per
// round; a far one is told apart by its probe: the budget keeps the first
// and ends the second, so that a job pays for its trials at most about
// kTrialBudget of its ops' time. Probes cost most of a first trial and come
// at its start, where a short job pays for them all: spread out by the
// budget, they cost a job's first ops as much as its later ones, and the
// rounds after them keep the other half of kTrialBudget.
//
// Every rank sees the group's ops in the same order and sizes and agrees
// the times by all-reduce, so every rank keeps the same algorithm: none
// decides on its own clock. hier is not refined. The one-round
// shared-memory all-reduce (up to kShmOneRoundBytes) is tried against
// direct alone, the same one round over the rings. The windows, which auto
// takes from 64 KiB, are the first candidate there, and the last between
// the one-round sizes and 64 KiB.
// Where the model predicted its choice kStaleRatio times slower than the
// group measured, it was fitted on a busier machine: onStale says so once,
// so that the cache is dropped and the next group calibrates again.
//
// Saved choices: save() gives the settled classes (the kept one, every
// candidate's agreed time), which the glue keeps beside the calibration
// cache; the next group with that cache key seeds them. A seeded class
// whose saved choice is among its candidates skips its trial and starts at
// the check of that choice: within kTrustRatio
// of its saved time, it settles there (the next run of a job pays no trial
// in its first ops); over it, the machine is not what it was, and a trial
// follows. A check times the saved choice only, while the others' times are
// another run's, which a slow spell there may have left high: a saved choice
// meets them again in a trial after kConfirmUs of its ops, as a doubted one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "algorithms.h"
#include "collective.h"
#include "tuning.h"

namespace collx {

class Refiner {
 public:
  static constexpr int kMinRounds = 2;            // trial rounds (blocks per candidate), R
  static constexpr int kMaxRounds = 64;           // R, at most, for cheap blocks
  static constexpr double kRoundUs = 150000;      // R blocks of the model's choice take about this
  static constexpr int kMaxBlock = 16;            // B, at most
  static constexpr double kCloseRatio = 4.0;      // a candidate's predicted time / the best's
  static constexpr double kCheapUs = 8000;        // or its first two blocks' predicted cost over the best's
  static constexpr double kTrialBudget = 0.10;    // a trial's time over the fastest's for its ops, at most
  static constexpr double kProbeBudget = 0.05;    // the first round's ops after its first block, with a probe
                                                  // after the second, over the fastest's, at most
  static constexpr double kProbeRatio = 2.0;      // such a probe's op, taken as this many of the fastest's
  static constexpr int kMaxWait = kMaxRounds * kMaxBlock;  // ops such a probe may wait, at most
  static constexpr double kCheckUs = 20000;       // how long the check of a kept candidate runs
  static constexpr double kSwitchRatio = 1.15;    // its checked time / another's that switches to that one
  static constexpr uint64_t kRecheckOps = 1 << 16;  // ops of a kept choice before a new trial
  static constexpr double kRecheckUs = 60e6;         // or its agreed time over this many ops
  static constexpr double kStaleRatio = 3.0;      // predicted / measured that marks the model stale
  static constexpr double kSpellRatio = 2.5;      // measured / predicted that calls for a second trial
  static constexpr double kConfirmUs = 5e6;       // of the kept one's ops before that trial
  static constexpr uint64_t kConfirmOps = 4096;   // or this many ops
  static constexpr double kTrustRatio = 1.25;     // a saved choice's checked time / its saved time that it may keep

  // What an auto all-reduce of `bytes` runs, where the model (with the
  // rules before it) chose `choice`. May run an agreement all-reduce on
  // c's transport first; throws what that throws.
  Algorithm choose(const Collective& c, size_t bytes, Algorithm choice);
  // The time the op just chosen took on this rank, from before choose().
  void ran(double us);
  // What the class of `bytes` runs now, where it was tried from a choice
  // of `choice`'s kind (the one-round all-reduce or not), else `choice` (no
  // ops run).
  Algorithm kept(size_t bytes, Algorithm choice) const;
  // Whether the class of `bytes`, tried from a choice of `choice`'s kind, is
  // in the middle of a trial or its check, or awaits its second trial (or,
  // for a saved choice, the trial after its check).
  bool trying(size_t bytes, Algorithm choice) const;
  // B for a class whose model's choice is predicted at `us` per op, and
  // how many ops at the start of a block go uncounted.
  static int blockFor(double us);
  static int skipped(int block) { return 3 * block / 8; }
  // P: the first round's ops of a candidate after the first, an eighth of a
  // block: two ops, whose lower (the probe's lower median) outlasts one slow
  // op, or one for slow classes.
  static int probeFor(int block) { return std::max(1, block / 8); }
  // R for that class, whose blocks take `blockUs` each.
  static int roundsFor(double blockUs);
  // C for a candidate the trial agreed at `us` per op.
  static int checkOpsFor(double us);
  // How many ops a choice agreed at `us` per op is kept before a new trial,
  // and before the second trial of a doubted one.
  static uint64_t recheckOpsFor(double us);
  static uint64_t confirmOpsFor(double us);

  // The settled classes, one line each: "<class bytes> <one|flat> <kept>
  // <doubted 0|1> <algorithm>=<agreed us> ...". With `previous` (an
  // earlier save()'s text), its lines of classes not settled here are kept.
  std::string save(const std::string& previous = "") const;
  // Classes to start from, from save()'s text; call before the first op.
  // Lines that do not parse are ignored.
  void seed(const std::string& text);

  // One line per class that has settled on a choice, for the log and
  // backend.tuning: "refined: 64 KiB: ring (27.9 us) over direct (35.1 us)",
  // and per class still trying: "refining: 4 MiB: 9 of 32 ops" or
  // "refining: 1 KiB: checking star, 20 of 256 ops".
  std::string describe() const;
  // Called with describe()'s line of a class when it settles on a choice,
  // and (once) with what shows the model stale.
  std::function<void(const std::string&)> onKept, onStale;

  // The times of a block of ops on this rank, and its typical op: the mean
  // with each time capped at kOutlierRatio times the median, so that a
  // preemption (milliseconds) counts as one slow op, while an algorithm
  // whose ops vary still pays for its slow ones (a tighter cap let such an
  // algorithm win trials it then lost). A probe's typical op is its lower
  // median: one preempted op of its few must not end a candidate. 0 for no ops.
  struct Block {
    std::vector<double> us;
    bool probe = false;
    double typical() const;
  };
  static constexpr double kOutlierRatio = 8.0;

 private:
  static constexpr int kMax = int(std::size(kFlatAlgorithms)) + 1;  // and shm
  struct Class {
    int count = 0;                 // candidates; a trial needs two or more
    int block = 0;                 // B
    double predictedUs = 0;        // by the model, for its flat choice (direct beside the one round)
    int rounds = 0;                // R
    Algorithm candidate[kMax]{};   // shm where auto took it, the model's choice, by prediction, shm below 64 KiB
    int active[kMax]{};            // indices of those still in the trial
    int activeCount = 0;
    int round = 0;                 // of the trial
    int runs = 0;                  // trial ops so far
    int roundRuns = 0;             // and in this round
    int probed = 0;                // in the first round: the position in active of the block or probe running
    int probeRuns = 0;             // and its ops so far
    int filler = 0;                // ops of `lead` to run before that probe
    int lead = 0;                  // the fastest candidate by the last agreement of the first round
    int last = -1;                 // the candidate of the first round's last op
    int firstOps[kMax] = {};       // each candidate's ops in the first round after the first block
    Block firstFill;               // this rank's times of the first one's fillers: they place probes only
    double blockUs = 0;            // spentUs at the end of the first block
    int fillerOps = 0;             // the ops of `lead` run while probes waited
    double fillerUs = 0;           // and this rank's time of them
    double spentUs = 0;            // this rank's time of the trial's ops (their agreements included)
    Block trial[kMax][kMaxRounds];  // this rank's counted times per candidate and round
    double agreedUs[kMax] = {};    // the group's mean per op: from the trial, then its check
    int checks[kMax] = {};         // agreedUs[i] is the lowest of this many checks (or the trial's: 0)
    int lookBack = -1;             // the one left for the candidate in its check, to look at again
    double trialUs[kMax] = {};     // the trial's agreed times, for the log
    int kept = -1;                 // the index kept, once the trial agreed
    int checkOps = 0;              // C while the kept one is being checked, else 0
    int checkRuns = 0;
    Block check[2];                // and in the check's last two quarters
    uint64_t keptOps = 0;          // since the class settled
    uint64_t recheckOps = 0;       // before the next trial
    bool doubted = false;          // the trial ran far slower than the model, or the class settled on another than auto's own choice: a second one follows
    bool second = false;           // this is that second trial
    double firstUs[kMax] = {};     // and the first one's agreed times
    bool firstChecked[kMax] = {};  // firstUs[i] is from a check
    bool seeded = false;           // the kept one is a saved choice, in its check
    bool saved = false;            // it was, and its check kept it
    // Its choice meets the others again after kConfirmUs of its ops: it was
    // doubted, or saved (the others' times are another run's).
    bool confirms() const { return doubted || saved; }
  };
  struct Seed {
    Algorithm kept;
    bool doubted;
    std::vector<std::pair<Algorithm, double>> us;  // agreed times
  };
  static Class fresh(const Collective& c, size_t bytes, Algorithm choice);
  // The ops of the j-th active candidate in k's round, and of the round.
  static int blockOf(const Class& k, int j) { return k.round == 0 && j > 0 ? probeFor(k.block) : k.block; }
  static int roundOps(const Class& k);
  // The ops of k's round not run yet.
  static int roundLeft(const Class& k);
  // The candidate index of the first round's next op, counting it, or -1
  // where the round is over; agrees (unlocking `lock`) before a probe after
  // the second, to place it within kProbeBudget.
  int firstRoundNext(const Collective& c, Class& k, std::unique_lock<std::mutex>& lock);
  // Whether the probe at k.probed may run now; else k.filler gets the ops of
  // k.lead to run first (none: the trial cannot pay for it).
  bool placed(const Collective& c, Class& k, std::unique_lock<std::mutex>& lock);
  // Starts k (fresh) at the check of the seed's kept choice, where k has it among its candidates.
  static void apply(const Seed& s, Class& k);
  // Ends a trial round (agrees, drops, maybe keeps) and a check (agrees,
  // maybe switches); both unlock `lock` around the agreement. `stale` gets
  // what shows the model stale, where a trial end shows it.
  void endRound(const Collective& c, size_t bytes, Class& k, std::unique_lock<std::mutex>& lock, std::string& stale);
  void endCheck(const Collective& c, size_t bytes, Class& k, std::unique_lock<std::mutex>& lock);
  // SUM of `n` values across the group (every rank calls it at the same op).
  void agree(const Collective& c, double* values, int n, std::unique_lock<std::mutex>& lock);
  static std::string describe(size_t bytes, const Class& k);

  mutable std::mutex mu_;  // describe() may run in another thread than the ops
  std::map<std::pair<size_t, bool>, Class> classes_;  // by keyOf (refine.cc): the class, one round or not
  std::map<std::pair<size_t, bool>, Seed> seeds_;     // saved choices, by the same key
  Block* pending_ = nullptr;  // where ran() puts the time of the running op
  Class* trialOf_ = nullptr;  // the class whose trial the running op belongs to
  bool filling_ = false;      // the running op is one of the first round's fillers
  uint64_t agreements_ = 0;
  bool stale_ = false;
  Workspace scratch_;  // the agreement's, apart from the op's
};

}  // namespace collx
