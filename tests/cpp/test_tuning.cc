// Auto's cost model: the fit recovers known constants, the text form round
// trips and rejects bad files, and tuneGroup over real loopback TCP gives
// every rank the same tuning, reuses an agreed cache, recalibrates when the
// ranks' caches differ, and refuses a tuning file that differs; refined
// choices saved beside a cache reach every rank of the next group, unless
// the ranks read different ones, and outlive a recalibration.
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>

#include "../../csrc/core/algorithms/calibrate.h"
#include "../../csrc/core/error.h"
#include "check.h"
#include "group.h"

using namespace collx;

namespace {

void testFitRecoversConstants() {
  // Times made from known constants: latency L per step, bandwidth B.
  const int n = 4, arity = 2;
  Tuning truth = Tuning::table();
  truth.cost[size_t(Algorithm::kRing)] = {12.0, 3000.0};
  truth.cost[size_t(Algorithm::kTree)] = {20.0, 800.0};
  truth.cost[size_t(Algorithm::kStar)] = {40.0, 2000.0};
  truth.cost[size_t(Algorithm::kDirect)] = {55.0, 400.0};
  const std::vector<size_t> sizes = {8, 16 << 10, 256 << 10, 1 << 20};
  std::vector<std::vector<double>> us;
  for (Algorithm a : kFlatAlgorithms) {
    us.emplace_back();
    for (size_t s : sizes) us.back().push_back(predictAllreduceUs(truth, a, n, arity, s));
  }
  const Tuning fitted = Tuning::fit(n, arity, sizes, us, "test");
  for (Algorithm a : kFlatAlgorithms) {
    const auto& got = fitted.cost[size_t(a)];
    const auto& want = truth.cost[size_t(a)];
    CHECK(std::fabs(got.latencyUs - want.latencyUs) < 1e-6 * want.latencyUs + 1e-9, name(a), " latency ",
          got.latencyUs, " want ", want.latencyUs);
    CHECK(std::fabs(got.bytesPerUs - want.bytesPerUs) < 1e-6 * want.bytesPerUs, name(a), " bandwidth ",
          got.bytesPerUs, " want ", want.bytesPerUs);
  }
  // Its choices are the truth's.
  for (size_t b = 1; b <= (size_t(1) << 28); b *= 4) {
    CHECK(chooseAllreduce(fitted, n, arity, b) == chooseAllreduce(truth, n, arity, b), "choice at ", b);
  }
  // A slope hidden by noise (times falling with size) still gives a finite,
  // positive bandwidth rather than an algorithm that looks free.
  std::vector<std::vector<double>> noisy = {{50, 40, 30, 20}, us[1], us[2], us[3]};
  const Tuning t = Tuning::fit(n, arity, sizes, noisy, "noisy");
  CHECK(t.cost[size_t(Algorithm::kRing)].bytesPerUs <= 1e5, "ring bandwidth ", t.cost[size_t(Algorithm::kRing)].bytesPerUs);
}

void testTextForm() {
  Tuning t = Tuning::table();
  t.cost[size_t(Algorithm::kStar)] = {7.25, 1234.5};
  const Tuning back = Tuning::parse("# a comment\n" + t.serialize(), "round trip");
  for (size_t i = 1; i < size_t(Algorithm::kCount); ++i) {
    CHECK(back.cost[i].latencyUs == t.cost[i].latencyUs && back.cost[i].bytesPerUs == t.cost[i].bytesPerUs,
          "algorithm ", i);
  }
  for (const char* bad : {"", "collx-tuning 2\n", "hello\n", "collx-tuning 1\nring 1 0\ntree 1 1\nstar 1 1\ndirect 1 1\n",
                          "collx-tuning 1\nring 1 1\n", "collx-tuning 1\nring 1 1\nwheel 1 1\n",
                          "collx-tuning 1\nring -1 5\ntree 1 1\nstar 1 1\ndirect 1 1\n"}) {
    bool threw = false;
    try {
      Tuning::parse(bad, "bad");
    } catch (const Error& e) {
      threw = std::string(e.what()).find("bad") != std::string::npos;
    }
    CHECK(threw, "parse accepted '", bad, "'");
  }
}

// A fit with next to no latency left (0.05 us a step) still broadcasts a
// few hundred bytes straight to every rank, not down a chain; large
// buffers take the chain.
void testTreeArityOfAFitWithoutLatency() {
  Tuning t = Tuning::table();
  t.cost[size_t(Algorithm::kTree)] = {0.05, 2000.0};
  CHECK(chooseTreeArity(t, 3, 2, 400) == 2, "400 B at n=3: arity ", chooseTreeArity(t, 3, 2, 400));
  CHECK(chooseTreeArity(t, 3, 2, 1 << 20) == 1, "1 MiB at n=3: arity ", chooseTreeArity(t, 3, 2, 1 << 20));
}

std::vector<TuningOutcome> tuneAll(test::Group& g, const std::vector<TuningPolicy>& policies) {
  const int n = int(g.devices.size());
  std::vector<TuningOutcome> out(static_cast<size_t>(n));
  test::runRanks(n, [&](int r) {
    thread_local Workspace ws;
    Collective c{*g.devices[r], OpKind::kCalibrate, DataType::kFloat32, 0, Clock::now() + std::chrono::seconds(60),
                 512 << 10, 2, ws};
    out[size_t(r)] = tuneGroup(c, policies[size_t(r)]);
  });
  return out;
}

void checkSame(const std::vector<TuningOutcome>& out, const char* what) {
  for (const auto& o : out) {
    CHECK(o.tuning.serialize() == out[0].tuning.serialize(), what, ": ranks fitted different constants");
    CHECK(o.tuning.source.substr(0, 6) == out[0].tuning.source.substr(0, 6), what, ": ", o.tuning.source, " vs ",
          out[0].tuning.source);
  }
}

void testTuneGroup() {
  char tmpl[] = "/tmp/collx-tuning-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  for (int n : {2, 3}) {
    test::Group g(n);
    TuningPolicy p;
    p.cacheDir = dir + "/cache";  // created on first use
    p.cacheKey = str("test n=", n);
    std::vector<TuningPolicy> policies(size_t(n), p);

    auto first = tuneAll(g, policies);
    checkSame(first, "calibration");
    CHECK(first[0].calibrationMs > 0 && first[0].cacheWarning.empty(), "n=", n, ": ", first[0].tuning.source,
          " warning '", first[0].cacheWarning, "'");
    CHECK(first[0].tuning.source.rfind("calibration in", 0) == 0, first[0].tuning.source);

    auto second = tuneAll(g, policies);  // every rank reads the same cache file
    checkSame(second, "cache");
    CHECK(second[0].calibrationMs == 0 && second[0].tuning.source.rfind("cache ", 0) == 0, second[0].tuning.source);
    CHECK(second[0].tuning.serialize() == first[0].tuning.serialize(), "the cache holds what was fitted");

    // Refined choices saved under that tuning: the next group reads them on
    // every rank; saving again gets what was saved.
    const std::string line = "65536 flat ring 0 ring=1.000\n";
    CHECK(second[0].refined.empty() && second[0].refinedPath == second[0].cachePath.substr(0, second[0].cachePath.size() - 4) + ".refined",
          second[0].refinedPath);
    CHECK(saveRefined(second[0], [&](const std::string& before) { return before + line; }).empty(), "not saved");
    auto refined = tuneAll(g, policies);
    for (const auto& o : refined) CHECK(o.refined == line && o.calibrationMs == 0, "n=", n, ": '", o.refined, "'");
    std::string before;
    saveRefined(refined[0], [&](const std::string& b) { return before = b; });
    CHECK(before == line, "saving again got '", before, "'");

    // One rank reads other refined choices (a folder of its own, with the
    // same tuning): the tuning is used, the choices are not.
    TuningPolicy other = p;
    other.cacheDir = dir + "/other";
    std::filesystem::create_directories(other.cacheDir);
    std::filesystem::copy_file(second[0].cachePath, other.cacheDir + second[0].cachePath.substr(p.cacheDir.size()));
    policies[1] = other;
    auto mixed = tuneAll(g, policies);
    saveRefined(mixed[1], [&](const std::string&) { return "65536 flat direct 0 direct=1.000\n"; });
    mixed = tuneAll(g, policies);
    for (const auto& o : mixed) CHECK(o.refined.empty() && o.calibrationMs == 0, "disagreeing choices were used");
    policies[1] = p;

    // One rank's cache differs (another key): all recalibrate together, and
    // the choices saved under the key, read by one rank only, are not used.
    // They outlive the recalibration: the next group with the key reads them.
    policies[1].cacheKey = "another key";
    auto third = tuneAll(g, policies);
    checkSame(third, "disagreeing caches");
    CHECK(third[0].calibrationMs > 0, "disagreeing caches were used: ", third[0].tuning.source);
    for (const auto& o : third) CHECK(o.refined.empty(), "choices one rank read were used");
    policies[1] = p;
    for (const auto& o : tuneAll(g, policies)) CHECK(o.refined == line, "choices lost to a recalibration: '", o.refined, "'");

    // The table: no exchange at all, on any rank.
    std::vector<TuningPolicy> table{size_t(n), TuningPolicy{}};
    for (auto& t : table) t.mode = TuningPolicy::Mode::kTable;
    auto fourth = tuneAll(g, table);
    CHECK(fourth[0].tuning.source == "table", fourth[0].tuning.source);
  }

  // A tuning file: used when identical everywhere, refused when not.
  test::Group g(2);
  const std::string a = dir + "/a.txt", b = dir + "/b.txt";
  Tuning t = Tuning::table();
  std::ofstream(a) << t.serialize();
  t.cost[size_t(Algorithm::kRing)].latencyUs = 99;
  std::ofstream(b) << t.serialize();
  TuningPolicy fa, fb;
  fa.mode = fb.mode = TuningPolicy::Mode::kFile;
  fa.file = a, fb.file = b;
  auto same = tuneAll(g, {fa, fa});
  CHECK(same[1].tuning.source == "file " + a, same[1].tuning.source);
  std::atomic<int> refused{0};
  test::runRanks(2, [&](int r) {
    thread_local Workspace ws;
    Collective c{*g.devices[r], OpKind::kCalibrate, DataType::kFloat32, 0, Clock::now() + std::chrono::seconds(60),
                 512 << 10, 2, ws};
    try {
      tuneGroup(c, r == 0 ? fa : fb);
    } catch (const Error& e) {
      if (std::string(e.what()).find("differs between ranks") != std::string::npos) ++refused;
    }
  });
  CHECK(refused == 2, "a tuning file that differs was refused on ", refused.load(), " of 2 ranks");
  std::system(str("rm -rf ", dir).c_str());
}

}  // namespace

int main() {
  testFitRecoversConstants();
  testTextForm();
  testTreeArityOfAFitWithoutLatency();
  testTuneGroup();
  std::printf("test_tuning: ok\n");
  return 0;
}
