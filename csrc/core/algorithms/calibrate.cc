#include "calibrate.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>
#include <vector>

#include "../error.h"
#include "algorithms.h"

namespace collx {

namespace {

// Sizes timed per algorithm: the latency end, the crossovers on loopback
// (tens of KiB), and the bandwidth end, where star and direct fall behind the
// pipelined ring only past a few hundred KiB. Each size gets one round of
// every algorithm, then as many more rounds (up to a limit) as its time
// budget allows at the speed the first round measured: a slow link keeps
// calibration short, a fast one buys rounds enough that one of them runs
// undisturbed.
constexpr size_t kCalibrationSizes[] = {8, 16 << 10, 256 << 10, 1 << 20};
// The most ranks of a lazy group that calibrate at creation (tuneGroup).
constexpr int kMaxLazyCalibratedRanks = 8;
constexpr int kMaxRounds[] = {5, 5, 3, 3};
constexpr double kRoundBudgetUs[] = {1000, 2000, 3000, 6000};
constexpr size_t kNumSizes = sizeof(kCalibrationSizes) / sizeof(kCalibrationSizes[0]);
// Sequence numbers of calibration frames: far above any op's.
constexpr uint64_t kCalibrationSeq = kInternalSeqs;

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

bool readFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream s;
  s << in.rdbuf();
  *out = s.str();
  return bool(in) || in.eof();
}

// Writes `text` to `path` through a temporary in the same folder, so that a
// reader never sees half a file. Returns why it failed, or "".
std::string writeFileAtomically(const std::string& dir, const std::string& path, const std::string& text) {
  std::string made;
  for (size_t at = 1; at != std::string::npos; at = dir.find('/', at + 1)) {
    made = dir.substr(0, at);
    ::mkdir(made.c_str(), 0700);
  }
  ::mkdir(dir.c_str(), 0700);
  // Ranks sharing the folder write the same text; each through its own temporary.
  const std::string tmp = str(path, ".", ::getpid(), ".", std::hash<std::thread::id>()(std::this_thread::get_id()), ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) return str("cannot write ", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return str("cannot rename ", tmp, " to ", path);
  }
  return "";
}

class Calibration {
 public:
  // Small all-reduces of the calibration's own: direct takes one round, but
  // a lazy group that runs it connects every pair; the tree connects each
  // rank to its parent and children.
  explicit Calibration(const Collective& c)
      : c_(c), small_(c.transport.connectsOnUse() ? Algorithm::kTree : Algorithm::kDirect) {}

  // A kCalibrate all-reduce of `count` elements with `algo`, under a
  // sequence number of its own.
  void allreduce(Algorithm algo, DataType dtype, ReduceOp op, void* buf, size_t count) {
    Collective op_{c_.transport, OpKind::kCalibrate, dtype, kCalibrationSeq + next_++, c_.deadline,
                   c_.segmentBytes, c_.treeArity, c_.workspace, c_.tuning};
    collx::allreduce(op_, algo, buf, count, cpuReduceFn(dtype, op));
  }

  // Per value, whether every rank passed the same.
  template <size_t N>
  std::array<bool, N> allAgree(const std::array<uint64_t, N>& values) {
    int64_t both[2 * N];  // each value, then its negation: the max of both is the max and -min
    for (size_t i = 0; i < N; ++i) {
      both[i] = int64_t(values[i] >> 2) + 1;  // positive, so that its negation fits
      both[N + i] = -both[i];
    }
    allreduce(small_, DataType::kInt64, ReduceOp::kMax, both, 2 * N);
    std::array<bool, N> out;
    for (size_t i = 0; i < N; ++i) out[i] = both[i] == -both[N + i];
    return out;
  }

  Tuning measure(const std::string& source, double* ms) {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    std::vector<char> buf(kCalibrationSizes[kNumSizes - 1]);
    std::vector<double> fastest(std::size(kFlatAlgorithms) * kNumSizes);  // [algorithm][size], microseconds
    const size_t algos = std::size(kFlatAlgorithms);
    for (size_t k = 0; k < kNumSizes; ++k) {
      const size_t count = kCalibrationSizes[k] / sizeof(float);
      // Rounds interleave the algorithms, so that a drift of the machine hits
      // all alike. Each timed op follows an untimed one of its algorithm:
      // the first op after another algorithm absorbs the skew that one left
      // between the ranks, which the steady state does not have and which
      // would charge an algorithm for its predecessor. The untimed ops also
      // grow the workspace to the size, so a cold first op is never timed
      // and no warm-up of its own precedes the first round.
      std::vector<std::vector<double>> us(algos);
      auto round = [&] {
        for (size_t a = 0; a < algos; ++a) {
          allreduce(kFlatAlgorithms[a], DataType::kFloat32, ReduceOp::kSum, buf.data(), count);
          const auto t0 = Clock::now();
          allreduce(kFlatAlgorithms[a], DataType::kFloat32, ReduceOp::kSum, buf.data(), count);
          us[a].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        }
      };
      round();
      // How many more rounds fit the budget, from the first round's agreed
      // (slowest rank's) time, both ops of each: every rank must run the same number.
      double first = 0;
      for (auto& u : us) first += 2 * u[0];
      allreduce(small_, DataType::kFloat64, ReduceOp::kMax, &first, 1);
      const int more = std::min(kMaxRounds[k] - 1, int(kRoundBudgetUs[k] / std::max(first, 1.0)));
      for (int r = 0; r < more; ++r) round();
      // The fastest round: whatever else the machine runs only adds time to
      // an op, and a group is often created beside the job's own start-up.
      for (size_t a = 0; a < algos; ++a) fastest[a * kNumSizes + k] = *std::min_element(us[a].begin(), us[a].end());
    }
    allreduce(small_, DataType::kFloat64, ReduceOp::kMax, fastest.data(), fastest.size());
    std::vector<std::vector<double>> table;
    for (size_t a = 0; a < fastest.size(); a += kNumSizes) {
      table.emplace_back(fastest.begin() + long(a), fastest.begin() + long(a + kNumSizes));
    }
    *ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    char took[32];
    std::snprintf(took, sizeof(took), " in %.1f ms", *ms);
    return Tuning::fit(c_.size(), c_.treeArity,
                       std::vector<size_t>(kCalibrationSizes, kCalibrationSizes + kNumSizes), table, source + took);
  }

 private:
  const Collective& c_;
  const Algorithm small_;
  uint64_t next_ = 0;
};

// The refined choices' file, named by the cache key as the cache is. They
// are measured times of real ops, not the model's: they outlive a
// recalibration, and a group checks them before it trusts them (refine.h).
constexpr char kRefinedHeader[] = "collx-refined 2\n";

// The choices saved at `path`, or "".
std::string readRefined(const std::string& path) {
  std::string text;
  const std::string header = kRefinedHeader;
  if (path.empty() || !readFile(path, &text) || text.compare(0, header.size(), header) != 0) return "";
  return text.substr(header.size());
}

}  // namespace

std::string saveRefined(const TuningOutcome& out, const std::function<std::string(const std::string&)>& text) {
  if (out.refinedPath.empty()) return "";
  const std::string body = text(readRefined(out.refinedPath));
  const std::string dir = out.refinedPath.substr(0, out.refinedPath.rfind('/'));
  return writeFileAtomically(dir, out.refinedPath, kRefinedHeader + body);
}

Tuning loadTuningFile(const TuningPolicy& policy, std::string* text) {
  std::string own;
  if (!text) text = &own;
  if (!readFile(policy.file, text)) throw Error(str("collx: cannot read the tuning file ", policy.file));
  return Tuning::parse(*text, str("file ", policy.file));
}

TuningOutcome tuneGroup(const Collective& c, const TuningPolicy& policy) {
  TuningOutcome out;
  if (policy.mode == TuningPolicy::Mode::kTable || c.size() <= 1) return out;
  // A lazy group of many ranks is not timed: timing direct and star would
  // connect every pair at its creation, and the time grows with the ranks.
  // It starts from the table, which online refinement fits to its ops.
  if (policy.mode == TuningPolicy::Mode::kCalibrate && c.transport.connectsOnUse() &&
      c.size() > kMaxLazyCalibratedRanks) {
    return out;
  }
  Calibration cal(c);
  std::string text;
  if (policy.mode == TuningPolicy::Mode::kFile) {
    out.tuning = loadTuningFile(policy, &text);
    if (!cal.allAgree(std::array<uint64_t, 1>{fnv1a(text)})[0]) {
      throw Error(str("collx: the tuning file ", policy.file, " differs between ranks (COLLX_TUNING)"));
    }
    return out;
  }
  char name[32];
  std::snprintf(name, sizeof(name), "/tuning-%016llx.txt", static_cast<unsigned long long>(fnv1a(policy.cacheKey)));
  const std::string path = policy.cacheDir.empty() ? "" : policy.cacheDir + name;
  out.cachePath = path;
  uint64_t mine = 0;
  Tuning cached = Tuning::table();
  if (!path.empty() && readFile(path, &text)) {
    try {
      cached = Tuning::parse(text, str("cache ", path));
      mine = fnv1a(text);
    } catch (const Error&) {  // a damaged cache is recalibrated and rewritten
    }
  }
  // The refined choices: "tuning-<key hash>.refined" beside the cache.
  out.refinedPath = path.empty() ? "" : path.substr(0, path.size() - 4) + ".refined";
  std::string refined = readRefined(out.refinedPath);
  const auto agreed = cal.allAgree(std::array<uint64_t, 2>{mine, refined.empty() ? 0 : fnv1a(refined)});
  if (agreed[1]) out.refined = std::move(refined);
  if (agreed[0] && mine != 0) {
    out.tuning = cached;
    return out;
  }
  out.tuning = cal.measure("calibration", &out.calibrationMs);
  if (!path.empty()) {
    text = str("# ", policy.cacheKey, "\n", out.tuning.serialize());
    out.cacheWarning = writeFileAtomically(policy.cacheDir, path, text);
  }
  return out;
}

}  // namespace collx
