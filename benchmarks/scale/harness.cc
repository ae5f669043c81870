// A group of N ranks as N threads of this process, over loopback TCP and an
// in-memory Store that counts requests as a TCPStore serves them (a get is a
// wait and a get). Ranks are put on simulated hosts of --per-host ranks
// (DeviceOptions::hostLabel), so hier has host leaders to work with. For
// eager and for lazy connections it reports: the time to create the group,
// TCP sockets and threads per rank, Store requests, memory per rank, the
// first and a steady all-reduce (ring, tree, hier), and how long every rank
// waiting in a ring all-reduce takes to see one rank's death.
//
//   build/core/scale_harness --ranks 1024 --connect lazy [--bytes 4096] [--per-host 8]
//
// Sockets and memory are the process's, divided by N: every connection has
// both ends here, one per rank, so the division counts a rank's own.
#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <map>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../tests/cpp/check.h"
#include "../../tests/cpp/memory_store.h"
#include "../../csrc/core/transport/device.h"

using namespace collx;
using namespace std::chrono_literals;

namespace {

class CountingStore : public test::MemoryStore {
 public:
  void set(const std::string& k, const std::vector<uint8_t>& v) override {
    ++requests;
    MemoryStore::set(k, v);
  }
  std::vector<uint8_t> get(const std::string& k, std::chrono::milliseconds t) override {
    requests += 2;
    return MemoryStore::get(k, t);
  }
  std::vector<std::vector<uint8_t>> getMany(const std::vector<std::string>& keys,
                                            std::chrono::milliseconds t) override {
    requests += 2;  // one wait for all, one multi-get
    std::vector<std::vector<uint8_t>> out;
    for (const auto& k : keys) out.push_back(MemoryStore::get(k, t));
    return out;
  }
  int64_t add(const std::string& k, int64_t d) override {
    ++requests;
    return MemoryStore::add(k, d);
  }
  std::atomic<int64_t> requests{0};
};

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The process's TCP sockets (and listeners), and its threads.
int countSockets() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  char target[64];
  while (dirent* e = d ? readdir(d) : nullptr) {
    const std::string path = std::string("/proc/self/fd/") + e->d_name;
    ssize_t len = readlink(path.c_str(), target, sizeof(target) - 1);
    if (len > 0 && std::strncmp(target, "socket:", 7) == 0) ++n;
  }
  if (d) closedir(d);
  return n;
}

long statusField(const char* name) {
  std::ifstream in("/proc/self/status");
  std::string key;
  long value = 0;
  while (in >> key) {
    if (key == name) {
      in >> value;
      return value;
    }
    in.ignore(1 << 10, '\n');
  }
  return 0;
}

// Runs fn(rank) on every rank; returns the slowest rank's seconds.
double onRanks(int n, const std::function<void(int)>& fn) {
  std::vector<double> took(static_cast<size_t>(n));
  test::runRanks(n, [&](int r) {
    const auto t0 = Clock::now();
    fn(r);
    took[size_t(r)] = secondsSince(t0);
  });
  return *std::max_element(took.begin(), took.end());
}

struct Args {
  int ranks = 64;
  bool lazy = true;
  size_t bytes = 4096;
  int perHost = 8;
  int victim = -1;  // -1: n / 2
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--ranks") a.ranks = std::stoi(v);
    else if (k == "--connect") a.lazy = v == "lazy";
    else if (k == "--bytes") a.bytes = std::stoul(v);
    else if (k == "--per-host") a.perHost = std::stoi(v);
    else if (k == "--victim") a.victim = std::stoi(v);
    else CHECK(false, "unknown argument ", k);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  const int n = args.ranks;
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;  // all N ranks' descriptors live in this one process
  setrlimit(RLIMIT_NOFILE, &lim);

  CountingStore store;
  std::vector<std::unique_ptr<tcp::Device>> devices(static_cast<size_t>(n));
  const int socketsBefore = countSockets();
  const long threadsBefore = statusField("Threads:"), rssBefore = statusField("VmRSS:");
  const auto t0 = Clock::now();
  onRanks(n, [&](int r) {
    tcp::DeviceOptions o;
    o.transport = shm::Mode::kTcp;
    o.lazy = args.lazy;
    o.timeout = 120s;
    o.hostLabel = "host" + std::to_string(r / args.perHost);
    devices[size_t(r)] = std::make_unique<tcp::Device>(store, r, n, o);
  });
  const double createS = secondsSince(t0);
  const int64_t storeRequests = store.requests;
  std::printf("{\"connect\": \"%s\", \"ranks\": %d, \"per_host\": %d, \"create_s\": %.3f, \"store_requests\": %lld, "
              "\"store_requests_per_rank\": %.2f, \"sockets_per_rank_created\": %.2f, \"threads_per_rank\": %.2f",
              args.lazy ? "lazy" : "eager", n, args.perHost, createS, (long long)storeRequests,
              double(storeRequests) / n, double(countSockets() - socketsBefore) / n,
              double(statusField("Threads:") - threadsBefore) / n);
  std::fflush(stdout);

  std::vector<Workspace> ws(static_cast<size_t>(n));
  uint64_t seq = 0;
  const size_t count = std::max<size_t>(1, args.bytes / sizeof(float));
  auto run = [&](Algorithm algo) {
    ++seq;
    return onRanks(n, [&](int r) {
      Collective c{*devices[size_t(r)], OpKind::kAllreduce, DataType::kFloat32, seq, Clock::now() + 300s, 512 << 10, 2,
                   ws[size_t(r)]};
      std::vector<float> buf(count, float(r));
      allreduce(c, algo, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
      const float want = float(n) * float(n - 1) / 2;
      CHECK(buf[0] == want && buf[count - 1] == want, "rank ", r, " got ", buf[0]);
    });
  };
  for (auto [algo, label] : {std::pair{Algorithm::kRing, "ring"}, std::pair{Algorithm::kTree, "tree"},
                             std::pair{Algorithm::kHierarchical, "hier"}}) {
    const double first = run(algo);
    double best = 1e9;
    for (int i = 0; i < 3; ++i) best = std::min(best, run(algo));
    std::printf(", \"%s_first_ms\": %.2f, \"%s_steady_ms\": %.2f, \"sockets_per_rank_after_%s\": %.2f", label,
                first * 1e3, label, best * 1e3, label, double(countSockets() - socketsBefore) / n);
    std::fflush(stdout);
  }
  std::printf(", \"rss_mib_per_rank\": %.3f", double(statusField("VmRSS:") - rssBefore) / 1024 / n);

  // One rank's connections close (a killed process's do) while every other
  // rank waits in a ring all-reduce; the slowest to fail sets the figure.
  const int victim = args.victim >= 0 ? args.victim : n / 2;
  std::vector<double> failedAfter(static_cast<size_t>(n), -1);
  std::atomic<int> waiting{0};
  std::atomic<Clock::rep> killedAt{0};  // ticks of the close
  ++seq;
  test::runRanks(n, [&](int r) {
    if (r == victim) {
      while (waiting.load() < n - 1) std::this_thread::sleep_for(1ms);
      std::this_thread::sleep_for(100ms);  // every other rank is inside the op by now
      killedAt = Clock::now().time_since_epoch().count();
      devices[size_t(r)]->close();
      return;
    }
    Collective c{*devices[size_t(r)], OpKind::kAllreduce, DataType::kFloat32, seq, Clock::now() + 300s, 512 << 10, 2,
                 ws[size_t(r)]};
    std::vector<float> buf(count, 1.0f);
    ++waiting;
    try {
      allreduce(c, Algorithm::kRing, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    } catch (const Error&) {
      failedAfter[size_t(r)] =
          std::chrono::duration<double>(Clock::now() - Clock::time_point(Clock::duration(killedAt.load()))).count();
    }
  });
  double worst = 0;
  int missed = 0;
  for (int r = 0; r < n; ++r) {
    if (r == victim) continue;
    if (failedAfter[size_t(r)] < 0) ++missed;
    worst = std::max(worst, failedAfter[size_t(r)]);
  }
  std::printf(", \"death_seen_by_all_s\": %.3f, \"ranks_that_missed_it\": %d}\n", worst, missed);
  const auto t1 = Clock::now();
  for (auto& d : devices) d->close();
  devices.clear();
  std::fprintf(stderr, "closed in %.2f s\n", secondsSince(t1));
  return missed == 0 ? 0 : 1;
}
