#include "refine.h"

#include <algorithm>
#include <cstdio>
#include <utility>
#include <vector>

#include "../error.h"
#include "../reduce/reduce.h"

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
    // The model's choice, then every other flat algorithm predicted within
    // kCloseRatio of it or cheap to try, nearest first.
    const Tuning& t = c.costs();
    const double best = predictAllreduceUs(t, choice, c.size(), c.treeArity, bytes);
    k.block = blockFor(best);
    std::vector<std::pair<double, Algorithm>> close;
    for (Algorithm a : kFlatAlgorithms) {
      const double us = predictAllreduceUs(t, a, c.size(), c.treeArity, bytes);
      const bool cheap = (us - best) * kBlocks * k.block <= kCheapUs;
      if (a != choice && (us <= kCloseRatio * best || cheap)) close.emplace_back(us, a);
    }
    std::sort(close.begin(), close.end());
    k.candidate[k.count++] = choice;
    for (const auto& [us, a] : close) k.candidate[k.count++] = a;
  }
  if (k.count < 2) return choice;
  const int m = k.count;
  if (k.kept >= 0) {
    if (++k.keptOps <= kRecheckOps) return k.candidate[k.kept];
    Class again;  // a new trial
    again.count = m;
    again.block = k.block;
    std::copy(k.candidate, k.candidate + m, again.candidate);
    k = again;
  }
  if (k.runs < m * kBlocks * k.block) {
    const int run = k.runs++;
    pendingIndex_ = run / k.block % m;
    if (run % k.block >= skipped(k.block)) pending_ = &k;
    return k.candidate[pendingIndex_];
  }
  // Each candidate's times less the slowest quarter: as many on every rank.
  const int counted = kBlocks * (k.block - skipped(k.block)), summed = counted - (counted + 3) / 4;
  double sums[kMax] = {};
  for (int i = 0; i < m; ++i) {
    std::sort(k.us[i], k.us[i] + k.timed[i]);
    for (int j = 0; j < summed && j < k.timed[i]; ++j) sums[i] += k.us[i][j];
  }
  lock.unlock();  // describe() need not wait for the peers
  Collective agree{c.transport, OpKind::kCalibrate, DataType::kFloat64, kRefineSeq + agreements_++, c.deadline,
                   c.segmentBytes, c.treeArity, scratch_, c.tuning};
  directAllreduce(agree, sums, size_t(m), cpuReduceFn(DataType::kFloat64, ReduceOp::kSum));
  lock.lock();
  k.kept = int(std::min_element(sums, sums + m) - sums);  // ties: the model's order
  k.keptOps = 1;  // this op
  for (int i = 0; i < m; ++i) k.agreedUs[i] = sums[i] / (double(c.size()) * summed);
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
  int& timed = pending_->timed[pendingIndex_];
  if (timed < kBlocks * kMaxBlock) pending_->us[pendingIndex_][timed++] = us;
  pending_ = nullptr;
}

Algorithm Refiner::kept(size_t bytes, Algorithm choice) const {
  if (bytes == 0 || !isFlat(choice)) return choice;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = classes_.find(classOf(bytes));
  return it != classes_.end() && it->second.kept >= 0 ? it->second.candidate[it->second.kept] : choice;
}

bool Refiner::trying(size_t bytes) const {
  if (bytes == 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = classes_.find(classOf(bytes));
  return it != classes_.end() && it->second.count >= 2 && it->second.kept < 0;
}

int Refiner::blockFor(double us) { return us <= 1000 ? kMaxBlock : us <= 4000 ? kMaxBlock / 2 : kMaxBlock / 4; }

std::string Refiner::describe(size_t bytes, const Class& k) {
  if (k.kept < 0) return str("refining: ", sizeName(bytes), ": ", k.runs, " of ", k.count * kBlocks * k.block, " ops");
  auto timed = [&](int i) { return str(name(k.candidate[i]), " (", tenths(k.agreedUs[i]), " us)"); };
  std::string out = str("refined: ", sizeName(bytes), ": ", timed(k.kept), " over ");
  for (int i = 0, listed = 0; i < k.count; ++i) {
    if (i != k.kept) out += (listed++ ? ", " : "") + timed(i);
  }
  return out;
}

std::string Refiner::describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [bytes, k] : classes_) {
    if (k.count >= 2) out += (out.empty() ? "" : "; ") + describe(bytes, k);
  }
  return out;
}

}  // namespace collx
