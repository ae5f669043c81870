#include "refine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

#include "../error.h"
#include "../reduce/reduce.h"

namespace collx {

namespace {

// Above the calibration's numbers (calibrate.cc), so the agreements never
// meet its frames nor the group's ops.
constexpr uint64_t kRefineSeq = kInternalSeqs + (uint64_t(1) << 61);

bool isFlat(Algorithm a) {
  for (Algorithm f : kFlatAlgorithms) {
    if (f == a) return true;
  }
  return false;
}

// Whether auto's choice `a` may be replaced: a flat algorithm, or the
// shared-memory all-reduce auto takes by rule (refine.h).
bool refinable(Algorithm a) { return isFlat(a) || a == Algorithm::kShm; }

// Whether auto's choice `a` at `bytes` is the one-round shared-memory
// all-reduce (auto takes it by rule up to kShmOneRoundBytes).
bool oneRound(Algorithm a, size_t bytes) { return a == Algorithm::kShm && bytes <= kShmOneRoundBytes; }

size_t classOf(size_t bytes) { return size_t(1) << (63 - __builtin_clzll(bytes)); }

// A class is tried from one kind of choice: in the 4 KiB class over shared
// memory, auto takes the one-round all-reduce at 4096 B by rule and a flat
// algorithm above it, and each has a trial of its own.
std::pair<size_t, bool> keyOf(size_t bytes, Algorithm choice) { return {classOf(bytes), oneRound(choice, bytes)}; }

std::string tenths(double us) {
  char out[32];
  std::snprintf(out, sizeof out, "%.1f", us);
  return out;
}

std::string sizeName(size_t bytes) {
  if (bytes >= (1 << 20)) return str(bytes >> 20, " MiB");
  if (bytes >= (1 << 10)) return str(bytes >> 10, " KiB");
  return str(bytes, " B");
}

// How many ops of `us` each fit in `budgetUs`: at least 1, at most `most`.
uint64_t opsWithin(double budgetUs, double us, uint64_t most) {
  return us * double(most) <= budgetUs ? most : std::max<uint64_t>(1, uint64_t(budgetUs / us));
}

// The lower median of the typical op times of `n` blocks (those with ops):
// the lowest of two, the second lowest of three or four, and so on.
double lowerMedian(const Refiner::Block* b, int n) {
  std::vector<double> typical;
  for (int j = 0; j < n; ++j) {
    if (const double t = b[j].typical(); t > 0) typical.push_back(t);
  }
  if (typical.empty()) return 0;
  std::sort(typical.begin(), typical.end());
  return typical[(typical.size() - 1) / 2];
}

}  // namespace

double Refiner::Block::typical() const {
  if (us.empty()) return 0;
  std::vector<double> sorted = us;
  const size_t mid = probe ? (sorted.size() - 1) / 2 : sorted.size() / 2;  // a probe's lower median
  std::nth_element(sorted.begin(), sorted.begin() + long(mid), sorted.end());
  if (probe) return sorted[mid];
  const double cap = kOutlierRatio * sorted[mid];
  double sum = 0;
  for (double t : us) sum += std::min(t, cap);
  return sum / double(us.size());
}

Refiner::Class Refiner::fresh(const Collective& c, size_t bytes, Algorithm choice) {
  // The one-round all-reduce and direct alone where auto took the one round
  // (refine.h). Else the shared-memory windows where auto took them, then
  // the model's flat choice, then every other flat algorithm predicted
  // within kCloseRatio of it or cheap to try, nearest first; then the
  // windows where auto took a flat algorithm over shared memory (above the
  // one-round sizes, below kShmMinBytes), where they beat the model's choice
  // at some group sizes and lose at others.
  Class k;
  const Tuning& t = c.costs();
  const bool one = oneRound(choice, bytes);
  if (choice == Algorithm::kShm) {
    k.candidate[k.count++] = choice;
    choice = one ? Algorithm::kDirect : chooseAllreduce(t, c.size(), c.treeArity, bytes);
  }
  const double best = predictAllreduceUs(t, choice, c.size(), c.treeArity, bytes);
  k.predictedUs = best;
  k.block = blockFor(best);
  k.rounds = roundsFor(best * k.block);
  k.candidate[k.count++] = choice;
  if (!one) {
    std::vector<std::pair<double, Algorithm>> close;
    for (Algorithm a : kFlatAlgorithms) {
      const double us = predictAllreduceUs(t, a, c.size(), c.treeArity, bytes);
      const bool cheap = (us - best) * kMinRounds * k.block <= kCheapUs;
      if (a != choice && (us <= kCloseRatio * best || cheap)) close.emplace_back(us, a);
    }
    std::sort(close.begin(), close.end());
    for (const auto& [us, a] : close) k.candidate[k.count++] = a;
    if (k.candidate[0] != Algorithm::kShm && c.transport.sharedWindows() && bytes > kShmOneRoundBytes) {
      k.candidate[k.count++] = Algorithm::kShm;
    }
  }
  for (int i = 0; i < k.count; ++i) k.active[i] = i;
  k.activeCount = k.count;
  return k;
}

int Refiner::roundOps(const Class& k) {
  int ops = 0;
  for (int j = 0; j < k.activeCount; ++j) ops += blockOf(k, j);
  return ops;
}

Algorithm Refiner::choose(const Collective& c, size_t bytes, Algorithm choice) {
  pending_ = nullptr;
  trialOf_ = nullptr;
  filling_ = false;
  if (c.size() < 2 || bytes == 0 || !refinable(choice)) return choice;
  const size_t cls = classOf(bytes);
  std::unique_lock<std::mutex> lock(mu_);
  auto [it, isNew] = classes_.try_emplace(keyOf(bytes, choice));
  Class& k = it->second;
  if (isNew) {
    k = fresh(c, bytes, choice);
    if (auto seed = seeds_.find(it->first); seed != seeds_.end() && k.count >= 2) apply(seed->second, k);
  }
  if (k.count < 2) return choice;
  if (k.kept >= 0 && k.checkOps == 0) {
    if (++k.keptOps <= k.recheckOps) return k.candidate[k.kept];
    Class next = fresh(c, bytes, k.candidate[0]);  // a new trial, among the same candidates
    if (k.doubted) {
      next.second = true;
      std::copy(std::begin(k.agreedUs), std::end(k.agreedUs), next.firstUs);
      for (int i = 0; i < k.count; ++i) next.firstChecked[i] = k.checks[i] > 0;
    }
    k = std::move(next);
  }
  std::string stale;
  for (;;) {  // a check may end in a trial (a saved choice that no longer holds)
    while (k.kept < 0) {
      int i = -1;
      if (k.round == 0) {
        i = firstRoundNext(c, k, lock);
      } else if (k.roundRuns < roundOps(k)) {  // the run-th op of the j-th active candidate's block
        const int j = k.roundRuns / k.block, run = k.roundRuns % k.block;
        i = k.active[j];
        if (run >= skipped(k.block)) pending_ = &k.trial[i][k.round];
      }
      if (i >= 0) {
        ++k.roundRuns;
        ++k.runs;
        trialOf_ = &k;
        return k.candidate[i];
      }
      endRound(c, cls, k, lock, stale);
    }
    if (k.checkOps == 0 || k.checkRuns < k.checkOps) break;
    endCheck(c, bytes, k, lock);
  }
  const Algorithm run = k.candidate[k.kept];
  std::string line;
  if (k.checkOps > 0) {
    const int quarter = 4 * k.checkRuns++ / k.checkOps;
    if (quarter >= 2) pending_ = &k.check[quarter - 2];
  } else {
    k.keptOps = 1;  // this op
    k.recheckOps = k.confirms() ? confirmOpsFor(k.agreedUs[k.kept]) : recheckOpsFor(k.agreedUs[k.kept]);
    line = describe(cls, k);
  }
  lock.unlock();
  if (!stale.empty() && onStale) onStale(stale);
  if (!line.empty() && onKept) onKept(line);
  return run;
}

int Refiner::firstRoundNext(const Collective& c, Class& k, std::unique_lock<std::mutex>& lock) {
  for (;;) {
    if (k.filler > 0) {  // the fastest so far, while the next probe waits
      --k.filler;
      ++k.fillerOps;
      filling_ = true;
      if (k.last == k.lead) {  // the first op after a switch goes uncounted
        // A probed lead's fillers make its probe a block, which a flattering
        // probe must meet; the first candidate's place its probes only, for
        // warm ops of it beside cold probes would keep it.
        pending_ = k.lead == k.active[0] ? &k.firstFill : &k.trial[k.lead][0];
        pending_->probe = false;
      }
      ++k.firstOps[k.lead];
      return k.last = k.lead;
    }
    if (k.probed < k.activeCount) {
      const int i = k.active[k.probed], ops = blockOf(k, k.probed);
      if (k.probeRuns == 0 && k.probed >= 2 && !placed(c, k, lock)) {
        if (k.filler > 0) continue;
        k.activeCount = k.probed;  // a wait over kMaxWait: the round ends with those probed
        return -1;
      }
      if (k.probeRuns < ops) {
        if (k.probeRuns++ >= skipped(ops)) {
          pending_ = &k.trial[i][0];
          pending_->probe = ops < k.block;
        }
        if (k.probed > 0) ++k.firstOps[i];
        return k.last = i;
      }
    }
    k.probeRuns = 0;  // the next block or probe; the second candidate's follows the first block at once
    if (++k.probed == 1) k.blockUs = k.spentUs;
    if (k.probed >= k.activeCount) return -1;
  }
}

bool Refiner::placed(const Collective& c, Class& k, std::unique_lock<std::mutex>& lock) {
  // The probe goes after m ops of the fastest so far (f an op): the ops after
  // the first block (auto's own choice, which an untried job runs too) take
  // d over f, each at its candidate's typical op, so that one preempted op
  // of a probe does not hold back the next ones; with the probe at
  // kProbeRatio f they must come to at most kProbeBudget of the trial's ops
  // at f:
  //   d + (kProbeRatio - 1) P f <= b (runs + m + P) f.
  // A probe's lower median may flatter it, so where a probed candidate leads
  // it runs a block at a time, agreed again after each.
  double sums[kMax] = {};
  for (int j = 0; j < k.probed; ++j) {
    const int i = k.active[j];
    Block seen = k.trial[i][0];  // its first block or probe, and its fillers
    if (j == 0) seen.us.insert(seen.us.end(), k.firstFill.us.begin(), k.firstFill.us.end());
    sums[i] = seen.typical();
  }
  agree(c, sums, k.count, lock);
  k.lead = k.active[0];  // ties: the model's order
  for (int j = 1; j < k.probed; ++j) {
    if (sums[k.active[j]] < sums[k.lead]) k.lead = k.active[j];
  }
  const double fastest = sums[k.lead] / c.size();
  if (!(fastest > 0)) return true;
  const int probe = blockOf(k, k.probed);
  double d = 0;
  for (int j = 0; j < k.probed; ++j) d += k.firstOps[k.active[j]] * (sums[k.active[j]] / c.size() - fastest);
  const double m = (d / fastest + (kProbeRatio - 1) * probe) / kProbeBudget - k.runs - probe;
  if (m <= 0) return true;
  if (m <= double(kMaxWait)) {
    k.filler = k.lead == k.active[0] ? int(std::ceil(m)) : std::min(int(std::ceil(m)), k.block);
  }
  return false;
}

int Refiner::roundLeft(const Class& k) {
  if (k.round > 0) return roundOps(k) - k.roundRuns;
  int left = k.filler;
  for (int j = k.probed; j < k.activeCount; ++j) left += blockOf(k, j) - (j == k.probed ? k.probeRuns : 0);
  return left;
}

void Refiner::endRound(const Collective& c, size_t bytes, Class& k, std::unique_lock<std::mutex>& lock,
                       std::string& stale) {
  double sums[kMax + 1] = {};  // each candidate's time, then the trial's
  for (int j = 0; j < k.activeCount; ++j) sums[k.active[j]] = lowerMedian(k.trial[k.active[j]], k.round + 1);
  sums[k.count] = k.spentUs - k.blockUs - k.fillerUs;  // the fillers pay for the probes only
  agree(c, sums, k.count + 1, lock);
  int best = k.active[0];  // ties: the model's order
  for (int j = 0; j < k.activeCount; ++j) {
    const int i = k.active[j];
    k.agreedUs[i] = sums[i] / c.size();
    if (k.agreedUs[i] < k.agreedUs[best]) best = i;
  }
  // The budget: fastest first, each candidate's next block while the trial,
  // with it, costs at most kTrialBudget of its ops at the fastest's time
  // over that time. Its cost is that of the ops after the first block (auto's
  // own choice, the first ops of a size, which an untried job runs too) and
  // not the fillers.
  int byTime[kMax];
  std::copy(k.active, k.active + k.activeCount, byTime);
  std::stable_sort(byTime, byTime + k.activeCount, [&](int a, int b) { return k.agreedUs[a] < k.agreedUs[b]; });
  const double fastest = k.agreedUs[best];
  double ops = k.runs - k.fillerOps, over = sums[k.count] / c.size() - (ops - k.block) * fastest;
  bool stays[kMax] = {};
  for (int j = 0; j < k.activeCount; ++j) {
    const int i = byTime[j];
    const double more = k.block * (k.agreedUs[i] - fastest);
    if (i != best && over + more > kTrialBudget * (ops + k.block) * fastest) break;
    stays[i] = true;
    over += more;
    ops += k.block;
  }
  // A challenger faster after one round meets the first candidate (auto's
  // own choice) in full blocks once more before it may displace it: one
  // block of it in a slow spell, against a probe, must not decide.
  if (k.round == 0 && best != 0) stays[0] = true;
  int left = 0;
  for (int j = 0; j < k.activeCount; ++j) {
    if (stays[k.active[j]]) k.active[left++] = k.active[j];
  }
  k.activeCount = left;
  k.roundRuns = 0;
  if (++k.round < k.rounds && left > 1) return;
  if (k.second) {  // each candidate's lower time of the two trials
    for (int i = 0; i < k.count; ++i) {
      if (k.firstUs[i] > 0 && k.firstUs[i] < k.agreedUs[i]) k.agreedUs[i] = k.firstUs[i];
      if (k.agreedUs[i] < k.agreedUs[best]) best = i;
    }
  }
  k.doubted = !k.second && k.agreedUs[best] > kSpellRatio * k.predictedUs;
  std::copy(std::begin(k.agreedUs), std::end(k.agreedUs), k.trialUs);
  k.kept = best;
  k.checkOps = checkOpsFor(k.agreedUs[best]);
  const int model = k.candidate[0] == Algorithm::kShm ? 1 : 0;  // the model's choice
  const double predicted = predictAllreduceUs(c.costs(), k.candidate[model], c.size(), c.treeArity, bytes);
  if (!stale_ && predicted > kStaleRatio * k.agreedUs[model]) {
    stale_ = true;
    stale = str("auto's model (", c.costs().source, ") predicts ", tenths(predicted), " us for ",
                name(k.candidate[model]), " at ", sizeName(bytes), ", where the group measured ",
                tenths(k.agreedUs[model]), " us: it was fitted on a busier machine");
  }
}

void Refiner::endCheck(const Collective& c, size_t bytes, Class& k, std::unique_lock<std::mutex>& lock) {
  double sum = lowerMedian(k.check, 2);
  agree(c, &sum, 1, lock);
  const int now = k.kept;
  double us = sum / c.size();
  if (k.seeded && us > kTrustRatio * k.agreedUs[now]) {  // the saved choice no longer holds: a trial
    k = fresh(c, bytes, k.candidate[0]);
    return;
  }
  k.saved = std::exchange(k.seeded, false);
  if (k.firstChecked[now]) us = std::min(us, k.firstUs[now]);  // a spell only slows ops down
  k.agreedUs[now] = k.checks[now]++ > 0 ? std::min(k.agreedUs[now], us) : us;
  k.checkOps = 0;
  k.checkRuns = 0;
  k.check[0].us.clear();
  k.check[1].us.clear();
  if (k.saved) return;  // settled, as the saved choice was (doubted or not)
  const int back = std::exchange(k.lookBack, -1);
  if (back >= 0 && k.checks[back] < 2) {  // a second look at the one this class left
    k.kept = back;
    k.checkOps = checkOpsFor(k.agreedUs[back]);
    return;
  }
  int best = now;
  for (int i = 0; i < k.count; ++i) {
    if (k.agreedUs[i] > 0 && k.agreedUs[i] < k.agreedUs[best]) best = i;
  }
  // Checked times compare as they are; a trial's time, maybe of a burst
  // the link cannot keep up, with kSwitchRatio's margin.
  if (k.agreedUs[now] > (k.checks[best] > 0 ? 1.0 : kSwitchRatio) * k.agreedUs[best]) {
    k.kept = best;  // it did not keep up its trial's pace; this one may
    if (k.checks[best] == 0) {
      k.checkOps = checkOpsFor(k.agreedUs[best]);
      k.lookBack = now;
      return;
    }
  }
  // Settled: on another than auto's own choice, after a second trial only.
  if (!k.second && k.kept != 0) k.doubted = true;
}

void Refiner::agree(const Collective& c, double* values, int n, std::unique_lock<std::mutex>& lock) {
  lock.unlock();  // describe() need not wait for the peers
  Collective agree{c.transport, OpKind::kCalibrate, DataType::kFloat64, kRefineSeq + agreements_++, c.deadline,
                   c.segmentBytes, c.treeArity, scratch_, c.tuning};
  // Direct takes one round, but would connect every pair of a lazy group;
  // the tree connects each rank to its parent and children.
  if (c.transport.connectsOnUse()) {
    treeAllreduce(agree, values, size_t(n), cpuReduceFn(DataType::kFloat64, ReduceOp::kSum));
  } else {
    directAllreduce(agree, values, size_t(n), cpuReduceFn(DataType::kFloat64, ReduceOp::kSum));
  }
  lock.lock();
}

void Refiner::ran(double us) {
  if (!pending_ && !trialOf_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_) pending_->us.push_back(us);
  if (trialOf_) trialOf_->spentUs += us;
  if (trialOf_ && filling_) trialOf_->fillerUs += us;
  pending_ = nullptr;
  trialOf_ = nullptr;
  filling_ = false;
}

Algorithm Refiner::kept(size_t bytes, Algorithm choice) const {
  if (bytes == 0 || !refinable(choice)) return choice;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = classes_.find(keyOf(bytes, choice));
  return it == classes_.end() || it->second.kept < 0 ? choice : it->second.candidate[it->second.kept];
}

bool Refiner::trying(size_t bytes, Algorithm choice) const {
  if (bytes == 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = classes_.find(keyOf(bytes, choice));
  const Class* k = it == classes_.end() ? nullptr : &it->second;
  return k && k->count >= 2 && (k->kept < 0 || k->checkOps > 0 || k->confirms());
}

int Refiner::blockFor(double us) { return us <= 1000 ? kMaxBlock : us <= 4000 ? kMaxBlock / 2 : kMaxBlock / 4; }

int Refiner::roundsFor(double blockUs) {
  return blockUs * kMaxRounds <= kRoundUs ? kMaxRounds : std::max(kMinRounds, int(kRoundUs / blockUs));
}

int Refiner::checkOpsFor(double us) {
  constexpr int kFewest = 8, kMost = 256;
  return us * kMost <= kCheckUs ? kMost : std::max(kFewest, int(kCheckUs / us + 0.5));
}

uint64_t Refiner::recheckOpsFor(double us) { return opsWithin(kRecheckUs, us, kRecheckOps); }

uint64_t Refiner::confirmOpsFor(double us) { return opsWithin(kConfirmUs, us, kConfirmOps); }

std::string Refiner::describe(size_t bytes, const Class& k) {
  const std::string size = sizeName(bytes) + (oneRound(k.candidate[0], bytes) ? " in one round" : "");
  if (k.kept < 0) {
    const int planned = k.runs + roundLeft(k) + k.activeCount * k.block * (k.rounds - k.round - 1);
    return str("refining: ", size, ": ", k.runs, " of ", planned, " ops");
  }
  if (k.checkOps > 0) {
    return str("refining: ", size, ": checking ", name(k.candidate[k.kept]), ", ", k.checkRuns, " of ",
               k.checkOps, " ops");
  }
  auto timed = [&](int i) {
    if (k.agreedUs[i] <= 0) return str(name(k.candidate[i]), " (not probed)");
    if (i == k.kept || k.checks[i] == 0) return str(name(k.candidate[i]), " (", tenths(k.agreedUs[i]), " us)");
    return str(name(k.candidate[i]), " (", tenths(k.agreedUs[i]), " us sustained, ", tenths(k.trialUs[i]), " in the trial)");
  };
  std::string out = str("refined: ", size, ": ", timed(k.kept), " over ");
  for (int i = 0, listed = 0; i < k.count; ++i) {
    if (i != k.kept) out += (listed++ ? ", " : "") + timed(i);
  }
  if (k.doubted) {
    out += k.kept != 0 ? str("; auto's own choice was ", name(k.candidate[0]))
                       : str("; over ", tenths(kSpellRatio), "x the model's ", tenths(k.predictedUs), " us");
    out += str(": tried again after ", k.recheckOps, " ops");
  }
  if (k.saved) {
    out += "; the saved choice, checked";
    if (!k.doubted) out += str("; tried again after ", k.recheckOps, " ops");
  }
  return out;
}

std::string Refiner::describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [key, k] : classes_) {
    if (k.count >= 2) out += (out.empty() ? "" : "; ") + describe(key.first, k);
  }
  return out;
}

}  // namespace collx
