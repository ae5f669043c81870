// Online refinement of auto's all-reduce choice, from the timings of the
// group's own ops.
//
// The fitted model (tuning.h) is a line per algorithm through a few
// calibrated sizes, timed in a few rounds. Near a crossover, where it
// predicts flat algorithms close, the line can be off enough to pick a
// slower one; on a machine with more ranks than cores it measured one
// algorithm up to 2.2x off, and a latency fitted at 0 at n=4; calibrated in
// a slow spell (n=4 over TCP), it put ring at 64 KiB 2.9x star, where ring
// ran 0.54x star, and within 2.5x ring was not even tried. So, per size
// class (the power of two at or below an op's bytes), the first op of the
// class picks the candidates: the model's choice, then every flat algorithm
// predicted within kCloseRatio of it or whose first two blocks cost little
// (at most kCheapUs more than the choice's over 2B ops, which at tens of us
// per op tries every algorithm), m of them:
//
//   trial, in R rounds       each round runs the candidates still in, in
//                            turn, a block of B ops each; each rank keeps
//                            its own time of each op, but not of the first
//                            3B/8 of a block: after a switch, the skew and
//                            the connections' state the other algorithm
//                            left last several ops on a machine with more
//                            ranks than cores (at n=4, 256 KiB, blocks of 4
//                            kept tree where ring ran 1.2x faster; blocks of
//                            16 kept ring in every run). B (blockFor) is 16,
//                            or 8 and 4 where the model's choice takes over
//                            1 and 4 ms, so that a 16 MiB class at n=4
//                            tries in ~30 ops, not 130 of ~30 ms. R
//                            (roundsFor) is as many as take kRoundUs of
//                            the model's choice, from 2 to 64: with more
//                            ranks than cores, a machine runs in slow
//                            spells of ~10 ms (n=3, 16 KiB on shared
//                            memory: the same algorithm took 53 and 102 us
//                            an op over 160 ops; in two rounds direct
//                            measured 113 us where it ran 50, 0.9x star),
//                            and an algorithm in modes of 50-200 ms (n=3
//                            over TCP, 1 MiB: tree 0.9-1.6 ms an op, 50 ops
//                            at a time; two rounds kept tree in 2 of 4 runs,
//                            where ring ran 1.1-1.4x faster, eight kept
//                            ring). At n=4 on shared memory, 16 KiB, eight
//                            rounds (6 ms a candidate) kept ring at 49 us
//                            an op, which ran at 98 alone, 1.36x tree: a
//                            trial spans the spells and modes only where it
//                            runs long enough. So R is 64 up to ~150 us an
//                            op, 9 at 1 ms, 2 from ~20 ms
//   after each round         per candidate, each rank takes the typical op
//                            time of each of its blocks so far (Block: the
//                            mean, with a preemption capped), and their
//                            lower median (of two, the lower): a block on
//                            caches cold after other work or in a slow
//                            spell is left out, but not the slow ops of an
//                            algorithm whose ops vary (at n=4 under tc, the
//                            fastest three quarters of direct's ops made it
//                            0.9x star, where its ops took 1.07x star's in
//                            turns of 20); one SUM all-reduce of the m
//                            values (a kCalibrate frame with a sequence
//                            number of its own) gives every rank the same
//                            totals. A candidate over kDropRatio times the
//                            fastest, whose next block would cost over
//                            kCheapUs more than the fastest's, leaves the
//                            trial (at n=4, 64 MiB, direct took 2.2x ring's
//                            120 ms: its second block, 1 s). Where a block
//                            costs little, one noisy block does not drop a
//                            candidate: in turns with four other groups at
//                            16 KiB on shared memory, ring's first block
//                            measured 2.2x star, and ring ran 0.97x star.
//                            After the last round, or with one left, the
//                            class keeps the fastest
//   check, C ops             the kept candidate runs on (checkOpsFor: about
//                            kCheckUs, at least 8 and at most 256 ops), and
//                            each rank takes the lower of the typical op
//                            times of its third and fourth quarter; one
//                            all-reduce agrees it. Where it is over
//                            kSwitchRatio times another candidate's trial
//                            time, or over another's checked time, the
//                            class takes that one, and checks it too unless
//                            it was checked before. A trial of short blocks
//                            can ride a burst the link cannot keep up: under
//                            a 1 Gbit/s token bucket on loopback (256 KiB
//                            of burst), 16 direct all-reduces of 1 KiB at
//                            n=4 took 54 us each, where direct run on took
//                            105 us and star 50; the first half of the
//                            check uses such a burst up. A check can run
//                            in a slow spell too (n=4, 64 B on shared
//                            memory: the one-round all-reduce 22 us an op
//                            in its trial, 38 in its check; direct then 27,
//                            and 1.11x the one round in the benchmark's
//                            rounds), so after the check of the one taken
//                            instead, the one left is checked once more,
//                            and keeps the lower of its two checks
//   later ops                the kept one; after kRecheckOps of them, or
//                            as many as its agreed time puts at kRecheckUs,
//                            the class runs a new trial, so a machine whose
//                            speeds change is followed, and a trial taken
//                            in a slow spell is not kept for long (n=2,
//                            64 MiB on shared memory, 2 cores: a spell
//                            made the windows, ring, tree and star 3-4x
//                            slower through a trial, which kept direct, 3x
//                            the windows' time once it had passed). Rarely:
//                            at 4096, a new trial's slower candidates
//                            showed as up to 1.9x on a benchmark point
//   a second trial           where the class settled on another than
//                            auto's own choice (the windows or one round
//                            auto takes by rule, else the model's), or the
//                            fastest candidate's agreed time was over
//                            kSpellRatio times the model's prediction, the
//                            trial or its checks may have run in a slow
//                            spell of the machine; the kept one runs for
//                            kConfirmUs of its agreed time (at most
//                            kConfirmOps ops), then the same candidates are
//                            tried again, and each keeps the lower of its
//                            two agreed times, and of its checks in both:
//                            a spell only slows ops down.
//                            With more ranks than cores, spells of 50 ms
//                            to seconds outlast a trial of large ops (3
//                            rounds of 4 at 16 MiB) and the checks: n=4,
//                            16 MiB: the windows 12.5 ms an op in their
//                            trial, ring 11.2, where they ran 6.8 in other
//                            runs, and ring kept, 1.45x the windows in the
//                            benchmark's rounds; n=3, 16 MiB: the windows
//                            4.5 ms an op in the trial, 12.9 in both their
//                            checks, tree kept, 1.78x the windows; n=2,
//                            64 MiB: a spell made the windows, ring, tree
//                            and star take 31-38 ms an op, against 8-9
//                            outside it, where the model puts them at 7-8.
//                            A second trial is not doubted again: a class
//                            that leaves auto's own choice costs one more
//                            trial
//
// The agreed times also check the model: where it predicted the model's
// choice kStaleRatio times slower than the group measured, the tuning was
// fitted on a busier machine (a calibration under load, then cached), and
// onStale says so once, so that the cache can be dropped and the next group
// calibrates again. Every rank sees the same totals, so all say it alike.
//
// Every rank sees the group's ops in the same order with the same sizes, so
// every rank runs the same trials, agrees at the same ops and keeps the same
// algorithm: no rank decides on its own clock alone. The hierarchical
// all-reduce, which auto takes by rule, is left as it is. The one-round
// shared-memory all-reduce of small ops (up to kShmOneRoundBytes) is tried
// against direct alone, the same one round over the rings: at n=2, 4096 B,
// it ran 1.16-1.21x direct in some benchmark runs and 1.0x in others, and at
// n=3 and 4 0.91-0.98x. Tried against every flat algorithm, it lost 1.34x
// and 1.45x at n=4 and 3 on 2 cores (1 KiB, 16 B: star kept, fast in its
// trial only), where the rule stayed within 1.06x. Its classes are apart
// from the flat ones (auto takes a flat algorithm above 4096 B in the 4 KiB
// class). Where auto takes the shared-memory windows by rule (from 64 KiB),
// they are the first candidate, before the model's choice: at n=2, 1 MiB,
// ring over the shared-memory rings ran 7-9% faster than the windows, in
// every run. Between the one-round sizes and 64 KiB, where auto takes the
// model's flat choice over shared memory, the windows are the last
// candidate: at n=4, 16 KiB, they ran 1.15-1.46x faster than the model's
// choice.
#pragma once

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
  static constexpr double kDropRatio = 2.0;       // a candidate's agreed time / the fastest's that may drop it
  static constexpr double kCheckUs = 20000;       // how long the check of a kept candidate runs
  static constexpr double kSwitchRatio = 1.15;    // its checked time / another's that switches to that one
  static constexpr uint64_t kRecheckOps = 1 << 16;  // ops of a kept choice before a new trial
  static constexpr double kRecheckUs = 60e6;         // or its agreed time over this many ops
  static constexpr double kStaleRatio = 3.0;      // predicted / measured that marks the model stale
  static constexpr double kSpellRatio = 2.5;      // measured / predicted that calls for a second trial
  static constexpr double kConfirmUs = 5e6;       // of the kept one's ops before that trial
  static constexpr uint64_t kConfirmOps = 4096;   // or this many ops

  // What an auto all-reduce of `bytes` runs, where the model (with the
  // rules before it) chose `choice`. May run an agreement all-reduce on
  // c's transport first; throws what that throws.
  Algorithm choose(const Collective& c, size_t bytes, Algorithm choice);
  // The time the op just chosen took on this rank.
  void ran(double us);
  // What the class of `bytes` runs now, where it was tried from a choice
  // of `choice`'s kind (the one-round all-reduce or not), else `choice` (no
  // ops run).
  Algorithm kept(size_t bytes, Algorithm choice) const;
  // Whether the class of `bytes`, tried from a choice of `choice`'s kind, is
  // in the middle of a trial or its check, or awaits its second trial.
  bool trying(size_t bytes, Algorithm choice) const;
  // B for a class whose model's choice is predicted at `us` per op, and
  // how many ops at the start of a block go uncounted.
  static int blockFor(double us);
  static int skipped(int block) { return 3 * block / 8; }
  // R for that class, whose blocks take `blockUs` each.
  static int roundsFor(double blockUs);
  // C for a candidate the trial agreed at `us` per op.
  static int checkOpsFor(double us);
  // How many ops a choice agreed at `us` per op is kept before a new trial,
  // and before the second trial of a doubted one.
  static uint64_t recheckOpsFor(double us);
  static uint64_t confirmOpsFor(double us);

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
  // preemption (milliseconds) counts as a slow op, while an algorithm whose
  // ops vary pays for its slow ones. With a cap of 2x, at n=4 on 2 cores,
  // 64 KiB, the trial and check kept tree (median op 72 us, mean 101) over
  // the windows (84 and 92), and it ran 1.54x the windows in the rounds.
  // 0 for no ops.
  struct Block {
    std::vector<double> us;
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
  };
  static Class fresh(const Collective& c, size_t bytes, Algorithm choice);
  // Ends a trial round (agrees, drops, maybe keeps) and a check (agrees,
  // maybe switches); both unlock `lock` around the agreement. `stale` gets
  // what shows the model stale, where a trial end shows it.
  void endRound(const Collective& c, size_t bytes, Class& k, std::unique_lock<std::mutex>& lock, std::string& stale);
  void endCheck(const Collective& c, Class& k, std::unique_lock<std::mutex>& lock);
  // SUM of `n` values across the group (every rank calls it at the same op).
  void agree(const Collective& c, double* values, int n, std::unique_lock<std::mutex>& lock);
  static std::string describe(size_t bytes, const Class& k);

  mutable std::mutex mu_;  // describe() may run in another thread than the ops
  std::map<std::pair<size_t, bool>, Class> classes_;  // by keyOf (refine.cc): the class, one round or not
  Block* pending_ = nullptr;  // where ran() puts the time of the running op
  uint64_t agreements_ = 0;
  bool stale_ = false;
  Workspace scratch_;  // the agreement's, apart from the op's
};

}  // namespace collx
