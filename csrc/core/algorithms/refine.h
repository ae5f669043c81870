// Online refinement of auto's all-reduce choice, from the timings of the
// group's own ops.
//
// The fitted model (tuning.h) is a line per algorithm through a few
// calibrated sizes, timed in a few rounds. Near a crossover, where it
// predicts flat algorithms close, the line can be off enough to pick a
// slower one; on a machine with more ranks than cores it measured one
// algorithm up to 2.2x off, and a latency fitted at 0 at n=4. So, per size
// class (the power of two at or below an op's bytes), the first op of the
// class picks the candidates: the model's choice, then every flat algorithm
// predicted within kCloseRatio of it or whose trial costs little (at most
// kCheapUs more than the choice's over its 2B ops, which at tens of us per op
// tries every algorithm), m of them:
//
//   ops 1..2mB of the class  the candidates in turn, in blocks of B ops,
//                            two per candidate; each rank keeps its own
//                            time of each op, but not of the first 3B/8
//                            of a block: after a switch, the skew and the
//                            connections' state the other algorithm left
//                            last several ops on a machine with more ranks
//                            than cores (at n=4, 256 KiB, blocks of 4 kept
//                            tree where ring ran 1.2x faster; blocks of 16
//                            kept ring in every run). B (blockFor) is 16,
//                            or 8 and 4 where the model's choice takes
//                            over 1 and 4 ms, so that a 16 MiB class at
//                            n=4 tries in ~30 ops, not 130 of ~30 ms
//   op 2mB+1                 per candidate, each rank sums its times less
//                            the slowest quarter (a preemption; the first
//                            block, on caches cold after other work);
//                            one SUM all-reduce of those m sums (a
//                            kCalibrate frame with a sequence number of
//                            its own) gives every rank the same totals;
//                            the class keeps the fastest candidate, then
//                            runs the op with it
//   later ops                the kept one; after kRecheckOps of them the
//                            class runs a new trial, so a machine whose
//                            speeds change is followed (rarely: at 4096,
//                            a new trial's slower candidates showed as up
//                            to 1.9x on a benchmark point)
//
// The agreed times also check the model: where it predicted the model's
// choice kStaleRatio times slower than the group measured, the tuning was
// fitted on a busier machine (a calibration under load, then cached), and
// onStale says so once, so that the cache can be dropped and the next group
// calibrates again. Every rank sees the same sums, so all say it alike.
//
// Every rank sees the group's ops in the same order with the same sizes, so
// every rank runs the same trials, agrees at the same op and keeps the same
// algorithm: no rank decides on its own clock alone. Shared memory and the
// hierarchical all-reduce, which auto takes by rule, are left as they are.
#pragma once

#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <string>

#include "algorithms.h"
#include "collective.h"
#include "tuning.h"

namespace collx {

class Refiner {
 public:
  static constexpr int kBlocks = 2;               // blocks per candidate
  static constexpr int kMaxBlock = 16;            // B, at most
  static constexpr double kCloseRatio = 2.5;      // a candidate's predicted time / the best's
  static constexpr double kCheapUs = 8000;        // or its trial's predicted cost over the best's
  static constexpr uint64_t kRecheckOps = 1 << 16;  // ops of a kept choice before a new trial
  static constexpr double kStaleRatio = 3.0;      // predicted / measured that marks the model stale

  // What an auto all-reduce of `bytes` runs, where the model (with the
  // rules before it) chose `choice`. May run the agreement all-reduce on
  // c's transport first; throws what that throws.
  Algorithm choose(const Collective& c, size_t bytes, Algorithm choice);
  // The time the op just chosen took on this rank.
  void ran(double us);
  // What the class of `bytes` has kept, else `choice` (no ops run).
  Algorithm kept(size_t bytes, Algorithm choice) const;
  // Whether the class of `bytes` is in the middle of a trial.
  bool trying(size_t bytes) const;
  // B for a class whose model's choice is predicted at `us` per op, and
  // how many ops at the start of a block go uncounted.
  static int blockFor(double us);
  static int skipped(int block) { return 3 * block / 8; }

  // One line per class that has kept a choice, for the log and
  // backend.tuning: "refined: 64 KiB: ring (27.9 us) over direct (35.1 us)",
  // and per class in a trial: "refining: 4 MiB: 9 of 33 ops".
  std::string describe() const;
  // Called with describe()'s line of a class when it keeps a choice, and
  // (once) with what shows the model stale.
  std::function<void(const std::string&)> onKept, onStale;

 private:
  static constexpr int kMax = int(std::size(kFlatAlgorithms));
  struct Class {
    int count = 0;                 // candidates; a trial needs two or more
    int block = 0;                 // B
    Algorithm candidate[kMax]{};   // the model's choice, then by prediction
    int runs = 0;                  // trial ops so far
    double us[kMax][kBlocks * kMaxBlock] = {};  // this rank's counted times per candidate
    int timed[kMax] = {};          // and how many
    double agreedUs[kMax] = {};    // the group's mean per op, once kept
    int kept = -1;                 // the index kept, once agreed
    uint64_t keptOps = 0;
  };
  static std::string describe(size_t bytes, const Class& k);

  mutable std::mutex mu_;  // describe() may run in another thread than the ops
  std::map<size_t, Class> classes_;
  Class* pending_ = nullptr;  // the class whose trial the running op is
  int pendingIndex_ = 0;     // and its candidate
  uint64_t agreements_ = 0;
  bool stale_ = false;
  Workspace scratch_;  // the agreement's, apart from the op's
};

}  // namespace collx
