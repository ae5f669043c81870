// Striped lanes (DeviceOptions::lanes): ranks on two labelled hosts, so that
// their pairs run TCP over loopback with 4 lanes each. Messages below and
// above the striping size, in odd lengths and element sizes, interleaved on
// one pair, arrive whole and in order; collectives across the hosts match
// values computed from every rank's data; the lanes connect on first use,
// in a lazy group, and at creation in an eager one.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>

#include <cstring>
#include <memory>

#include "../../csrc/core/algorithms/algorithms.h"
#include "check.h"
#include "group.h"
#include "memory_store.h"

using namespace collx;

namespace {

int openSockets() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (dirent* e = readdir(d)) {
    char target[64] = {};
    const std::string path = std::string("/proc/self/fd/") + e->d_name;
    if (readlink(path.c_str(), target, sizeof(target) - 1) > 0 && std::strncmp(target, "socket:", 7) == 0) ++n;
  }
  closedir(d);
  return n;
}

// n ranks, rank r on host "h(r % 2)", `lanes` lanes, TCP only.
struct TwoHosts {
  test::MemoryStore store;
  std::vector<std::unique_ptr<tcp::Device>> devices;
  TwoHosts(int n, int lanes, bool lazy) : devices(size_t(n)) {
    test::runRanks(n, [&](int r) {
      tcp::DeviceOptions o = test::over(shm::Mode::kTcp);
      o.hostLabel = str("h", r % 2);
      o.lanes = lanes;
      o.lazy = lazy;
      devices[size_t(r)] = std::make_unique<tcp::Device>(store, r, n, o);
    });
  }
};

Collective make(Transport& t, DataType dtype, uint64_t seq) {
  thread_local Workspace workspace;
  return Collective{t, OpKind::kAllreduce, dtype, seq, Clock::now() + std::chrono::seconds(60), 512 << 10, 2,
                    workspace};
}

// Rank 0 sends rank 1 (another host) messages of every size at once; each
// arrives whole, in the order posted.
void testMessages(bool lazy) {
  TwoHosts g(2, 4, lazy);
  const int before = openSockets();
  const size_t piece = tcp::Device::kMinPieceBytes;
  const std::vector<size_t> sizes = {1, piece, 2 * piece - 1, 2 * piece, 2 * piece + 3, 4 * piece + 7, 3 << 20,
                                     5, (9 << 20) + 13};
  test::runRanks(2, [&](int r) {
    tcp::Device& d = *g.devices[size_t(r)];
    CHECK(d.host(0) != d.host(1), "the labels make two hosts");
    std::vector<std::vector<uint8_t>> bufs;
    for (size_t i = 0; i < sizes.size(); ++i) {
      bufs.emplace_back(sizes[i], uint8_t(0));
      if (r == 0) {
        for (size_t j = 0; j < sizes[i]; ++j) bufs[i][j] = uint8_t(j * 31 + i * 7 + j / 4099);
      }
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      // An odd dtype for some: pieces are cut at element boundaries.
      const DataType dtype = i % 3 == 0 ? DataType::kUInt8 : i % 3 == 1 ? DataType::kFloat32 : DataType::kFloat64;
      const size_t es = elementSize(dtype), bytes = sizes[i] / es * es;
      const Frame f{OpKind::kAllreduce, dtype, 1, uint32_t(i)};
      if (r == 0) d.postSend(1, f, bufs[i].data(), bytes, i);
      else d.postRecv(0, f, bufs[i].data(), bytes, i);
    }
    std::vector<uint64_t> done;
    while (done.size() < sizes.size()) d.waitSome(done, Clock::now() + std::chrono::seconds(60));
    // A peer's messages complete in post order, as on one connection,
    // whatever lane finished first (the ring's scratch slots rely on it).
    for (size_t i = 0; i < sizes.size(); ++i) CHECK(done[i] == i, "completion ", i, " was message ", done[i]);
    CHECK(d.pending() == 0, "nothing pending after every message completed");
    if (r == 1) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        const size_t es = i % 3 == 0 ? 1 : i % 3 == 1 ? 4 : 8, bytes = sizes[i] / es * es;
        for (size_t j = 0; j < bytes; ++j) {
          CHECK(bufs[i][j] == uint8_t(j * 31 + i * 7 + j / 4099), "message ", i, " byte ", j);
        }
      }
    }
  });
  // Lazy: lane 0 and the 3 further lanes connected by the first striped
  // message, both ends in this process. Eager: all of them at creation.
  const int grew = openSockets() - before;
  CHECK(grew == (lazy ? 8 : 0), lazy ? "lazy" : "eager", ": ", grew, " sockets opened by the messages");
  std::printf("lanes: messages (%s) ok\n", lazy ? "lazy" : "eager");
}

// A ring between two hosts whose neighbouring units get 4 and 3 pieces
// (512 KiB and 512 KiB - 4): units complete in order, or a later unit's
// receive would land in a slot whose data is not yet reduced.
void testRingAcrossLanes() {
  TwoHosts g(2, 4, true);
  const size_t count = (1 << 20) - 1;
  for (uint64_t round = 1; round <= 20; ++round) {
    test::runRanks(2, [&](int r) {
      std::vector<float> x(count);
      for (size_t i = 0; i < count; ++i) x[i] = float((r * 7 + i * 3 + round) % 11);
      ringAllreduce(make(*g.devices[size_t(r)], DataType::kFloat32, round), x.data(), count,
                    cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
      for (size_t i = 0; i < count; ++i) {
        const float want = float((i * 3 + round) % 11) + float((7 + i * 3 + round) % 11);
        CHECK(x[i] == want, "round ", round, " rank ", r, " i ", i, " got ", x[i], " want ", want);
      }
    });
  }
  std::printf("lanes: ring across lanes ok\n");
}

// Collectives over 4 ranks on 2 hosts: values from every rank's data.
void testCollectives() {
  TwoHosts g(4, 3, true);
  for (size_t count : {size_t(5), size_t(100003), size_t(1 << 20)}) {
    test::runRanks(4, [&](int r) {
      tcp::Device& d = *g.devices[size_t(r)];
      std::vector<float> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = float((r * 7 + i * 3) % 11);
      for (Algorithm a : {Algorithm::kRing, Algorithm::kDirect, Algorithm::kHierarchical}) {
        std::vector<float> x = buf;
        allreduce(make(d, DataType::kFloat32, uint64_t(a)), a, x.data(), count,
                  cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int q = 0; q < 4; ++q) want += float((q * 7 + i * 3) % 11);
          CHECK(x[i] == want, name(a), " count ", count, " rank ", r, " i ", i);
        }
      }
    });
  }
  std::printf("lanes: collectives ok\n");
}

}  // namespace

int main() {
  testMessages(true);
  testMessages(false);
  testRingAcrossLanes();
  testCollectives();
  return 0;
}
