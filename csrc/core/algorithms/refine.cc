#include "refine.h"

#include <algorithm>
#include <cstdio>
#include <limits>

#include "../error.h"
#include "../reduce/reduce.h"
#include "tuning.h"

namespace collx {

namespace {

// Above the calibration's numbers (calibrate.cc), so the agreements never
// meet its frames nor the group's ops.
constexpr uint64_t kRefineSeq = (uint64_t(1) << 62) + (uint64_t(1) << 61);

bool isFlat(Algorithm a) {
  for (Algorithm f : kFlatAlgorithms) {
    if (f == a) return true;
  }
  return false;
}

size_t classOf(size_t bytes) { return size_t(1) << (63 - __builtin_clzll(bytes)); }

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

}  // namespace

Algorithm Refiner::choose(const Collective& c, size_t bytes, Algorithm choice) {
  pending_ = nullptr;
  if (c.size() < 2 || bytes == 0 || !isFlat(choice)) return choice;
  const size_t cls = classOf(bytes);
  std::unique_lock<std::mutex> lock(mu_);
  auto [it, fresh] = classes_.try_emplace(cls);
  Class& k = it->second;
  if (fresh) {
    const Tuning& t = c.costs();
    const double best = predictAllreduceUs(t, choice, c.size(), c.treeArity, bytes);
    double runnerUp = std::numeric_limits<double>::infinity();
    for (Algorithm a : kFlatAlgorithms) {
      const double us = predictAllreduceUs(t, a, c.size(), c.treeArity, bytes);
      if (a != choice && us < runnerUp) runnerUp = us, k.candidate[1] = a;
    }
    k.candidate[0] = choice;
    k.trial = runnerUp <= kCloseRatio * best;
  }
  if (!k.trial) return choice;
  if (k.kept >= 0) {
    if (++k.keptOps <= kRecheckOps) return k.candidate[k.kept];
    k = Class{true, {k.candidate[0], k.candidate[1]}};  // a new trial
  }
  if (k.runs < 2 * kTrials) {
    const int run = k.runs++;
    pendingIndex_ = run / kBlock % 2;
    if (run % kBlock != 0) pending_ = &k;  // the block's first op is not counted
    return k.candidate[run / kBlock % 2];
  }
  double sums[2] = {k.us[0] - k.slowest[0], k.us[1] - k.slowest[1]};
  lock.unlock();  // describe() need not wait for the peers
  Collective agree{c.transport, OpKind::kCalibrate, DataType::kFloat64, kRefineSeq + agreements_++, c.deadline,
                   c.segmentBytes, c.treeArity, scratch_, c.tuning};
  directAllreduce(agree, sums, 2, cpuReduceFn(DataType::kFloat64, ReduceOp::kSum));
  lock.lock();
  k.kept = sums[1] < sums[0] ? 1 : 0;
  k.keptOps = 1;  // this op
  constexpr int kCounted = kTrials - kTrials / kBlock - 1;  // less first ops, less the slowest
  for (int i = 0; i < 2; ++i) k.agreedUs[i] = sums[i] / (double(c.size()) * kCounted);
  const std::string line = describe(cls, k);
  const double predicted = predictAllreduceUs(c.costs(), k.candidate[0], c.size(), c.treeArity, bytes);
  std::string stale;
  if (!stale_ && predicted > kStaleRatio * k.agreedUs[0]) {
    stale_ = true;
    stale = str("auto's model (", c.costs().source, ") predicts ", tenths(predicted), " us for ", name(k.candidate[0]),
                " at ", sizeName(bytes), ", where the group measured ", tenths(k.agreedUs[0]),
                " us: it was fitted on a busier machine");
  }
  lock.unlock();
  if (onKept) onKept(line);
  if (!stale.empty() && onStale) onStale(stale);
  return k.candidate[k.kept];
}

void Refiner::ran(double us) {
  if (!pending_) return;
  std::lock_guard<std::mutex> lock(mu_);
  pending_->us[pendingIndex_] += us;
  pending_->slowest[pendingIndex_] = std::max(pending_->slowest[pendingIndex_], us);
  pending_ = nullptr;
}

Algorithm Refiner::kept(size_t bytes, Algorithm choice) const {
  if (bytes == 0 || !isFlat(choice)) return choice;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = classes_.find(classOf(bytes));
  return it != classes_.end() && it->second.kept >= 0 ? it->second.candidate[it->second.kept] : choice;
}

std::string Refiner::describe(size_t bytes, const Class& k) {
  const int other = 1 - k.kept;
  return str("refined: ", sizeName(bytes), ": ", name(k.candidate[k.kept]), " (", tenths(k.agreedUs[k.kept]),
             " us) over ", name(k.candidate[other]), " (", tenths(k.agreedUs[other]), " us)");
}

std::string Refiner::describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [bytes, k] : classes_) {
    if (k.kept >= 0) out += (out.empty() ? "" : "; ") + describe(bytes, k);
  }
  return out;
}

}  // namespace collx
