// Online refinement of auto's all-reduce choice, from the timings of the
// group's own ops.
//
// The fitted model (tuning.h) is a line per algorithm through a few
// calibrated sizes, timed in a few rounds. Near a crossover, where it
// predicts flat algorithms close, the line can be off enough to pick a
// slower one; on a machine with more ranks than cores it measured one
// algorithm up to 2.2x off. So, per size class (the power of two at or below
// an op's bytes) whose first op the model finds close, the candidates are
// the model's choice and every flat algorithm predicted within kCloseRatio
// of it (m of them):
//
//   ops 1..mK of the class   the candidates in turn, in blocks of kBlock
//                            ops; each rank adds up its own time of each,
//                            leaving out the first op of every block (it
//                            absorbs the peers' skew from the op before,
//                            which the steady state does not have) and its
//                            slowest run (a one-off preemption)
//   op mK+1                  one SUM all-reduce of every rank's m totals
//                            (a kCalibrate frame with a sequence number of
//                            its own) gives every rank the same sums; the
//                            class keeps the fastest candidate, then runs
//                            the op with it
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
  static constexpr int kTrials = 16;              // K: trial ops per candidate
  static constexpr int kBlock = 4;                // consecutive ops of one candidate
  static constexpr double kCloseRatio = 2.5;      // a candidate's predicted time / the best's
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

  // One line per class that has kept a choice, for the log and
  // backend.tuning: "refined: 64 KiB: ring (27.9 us) over direct (35.1 us)".
  std::string describe() const;
  // Called with describe()'s line of a class when it keeps a choice, and
  // (once) with what shows the model stale.
  std::function<void(const std::string&)> onKept, onStale;

 private:
  static constexpr int kMax = int(std::size(kFlatAlgorithms));
  struct Class {
    int count = 0;                 // candidates; a trial needs two or more
    Algorithm candidate[kMax]{};   // the model's choice, then by prediction
    int runs = 0;                  // trial ops so far
    double us[kMax] = {};          // this rank's total per candidate
    double slowest[kMax] = {};     // and its slowest run
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
