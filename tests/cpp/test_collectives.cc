// Core collectives over real loopback TCP: N threads, one Device each, an
// in-memory store. Sweeps world size 1..8, awkward counts, every algorithm,
// segment sizes small enough to force deep pipelining, and checks each result
// against values computed from every rank's deterministic input.
#include <cstring>
#include <memory>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/transport/tcp/device.h"
#include "check.h"
#include "memory_store.h"

using namespace collx;

namespace {

struct Group {
  test::MemoryStore store;
  std::vector<std::unique_ptr<tcp::Device>> devices;
  explicit Group(int size) : devices(size) {
    test::runRanks(size, [&](int r) {
      devices[r] = std::make_unique<tcp::Device>(store, r, size, tcp::DeviceOptions{});
    });
  }
};

Collective make(tcp::Device& d, OpKind kind, DataType dtype, uint64_t seq, size_t seg, int arity) {
  thread_local Workspace workspace;
  return Collective{d, kind, dtype, seq, Clock::now() + std::chrono::seconds(60), seg, arity, workspace};
}

// Rank r's element i: small integers, so float sums are exact.
float valueOf(int r, size_t i) { return float((r * 7 + i * 3) % 11) - 5.0f; }

void testAllreduce(Group& g, uint64_t& seq, Algorithm algo, size_t count, size_t seg, int arity) {
  int n = int(g.devices.size());
  ++seq;
  test::runRanks(n, [&](int r) {
    std::vector<float> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = valueOf(r, i);
    auto c = make(*g.devices[r], OpKind::kAllreduce, DataType::kFloat32, seq, seg, arity);
    allreduce(c, algo, buf.data(), count, cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < n; ++q) want += valueOf(q, i);
      CHECK(buf[i] == want, "n=", n, " algo=", name(algo), " count=", count, " seg=", seg,
            " rank=", r, " i=", i, " got ", buf[i], " want ", want);
    }
  });
}

void testMaxInt64(Group& g, uint64_t& seq, Algorithm algo, size_t count) {
  int n = int(g.devices.size());
  ++seq;
  test::runRanks(n, [&](int r) {
    std::vector<int64_t> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = int64_t((r * 31 + i * 17) % 101) << 33;
    auto c = make(*g.devices[r], OpKind::kAllreduce, DataType::kInt64, seq, 256, 2);
    allreduce(c, algo, buf.data(), count, cpuReduceFn(DataType::kInt64, ReduceOp::kMax));
    for (size_t i = 0; i < count; ++i) {
      int64_t want = 0;
      for (int q = 0; q < n; ++q) want = std::max(want, int64_t((q * 31 + i * 17) % 101) << 33);
      CHECK(buf[i] == want, "max n=", n, " algo=", name(algo), " i=", i);
    }
  });
}

void testBroadcast(Group& g, uint64_t& seq, size_t count, int root, size_t seg, int arity) {
  int n = int(g.devices.size());
  ++seq;
  test::runRanks(n, [&](int r) {
    std::vector<int32_t> buf(count, -1);
    if (r == root) for (size_t i = 0; i < count; ++i) buf[i] = int32_t(i * 13 + root);
    auto c = make(*g.devices[r], OpKind::kBroadcast, DataType::kInt32, seq, seg, arity);
    broadcast(c, buf.data(), count * 4, root);
    for (size_t i = 0; i < count; ++i) {
      CHECK(buf[i] == int32_t(i * 13 + root), "bcast n=", n, " root=", root, " rank=", r, " i=", i);
    }
  });
}

void testAllgather(Group& g, uint64_t& seq, size_t block, size_t seg) {
  int n = int(g.devices.size());
  ++seq;
  test::runRanks(n, [&](int r) {
    std::vector<uint8_t> out(block * n, 0);
    for (size_t i = 0; i < block; ++i) out[r * block + i] = uint8_t(r * 37 + i);
    auto c = make(*g.devices[r], OpKind::kAllgather, DataType::kUInt8, seq, seg, 2);
    allgather(c, out.data(), block);
    for (int q = 0; q < n; ++q) {
      for (size_t i = 0; i < block; ++i) {
        CHECK(out[q * block + i] == uint8_t(q * 37 + i), "allgather n=", n, " rank=", r);
      }
    }
  });
}

void testMismatchIsReported() {
  Group g(2);
  std::string errors[2];
  test::runRanks(2, [&](int r) {
    std::vector<float> buf(r == 0 ? 10 : 12);
    auto c = make(*g.devices[r], OpKind::kAllreduce, DataType::kFloat32, 1, 1 << 20, 2);
    c.deadline = Clock::now() + std::chrono::seconds(2);
    try {
      starAllreduce(c, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    } catch (const Error& e) {
      errors[r] = e.what();
    }
  });
  // The root detects the count mismatch at once; the other rank times out.
  CHECK(errors[0].find("mismatched collective with peer 1") != std::string::npos, errors[0]);
  CHECK(errors[0].find("12 x float32") != std::string::npos, errors[0]);
  CHECK(!errors[1].empty(), "rank 1 must fail too");
}

void testTimeoutNamesPeer() {
  Group g(2);
  std::vector<float> buf(4);
  auto c = make(*g.devices[0], OpKind::kAllreduce, DataType::kFloat32, 1, 1 << 20, 2);
  c.deadline = Clock::now() + std::chrono::milliseconds(200);
  bool timedOut = false;
  try {
    ringAllreduce(c, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
  } catch (const TimeoutError& e) {
    timedOut = std::string(e.what()).find("peer 1") != std::string::npos;
  }
  CHECK(timedOut, "a silent peer must give a TimeoutError naming it");
  // The transport stays broken with the same cause.
  bool sticky = false;
  try {
    ringAllreduce(c, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
  } catch (const TimeoutError&) {
    sticky = true;
  }
  CHECK(sticky, "later ops must fail with the first error");
}

}  // namespace

int main() {
  const size_t counts[] = {0, 1, 7, 1000, 100003, size_t(1) << 20};
  for (int n = 1; n <= 8; ++n) {
    Group g(n);
    uint64_t seq = 0;
    for (size_t count : counts) {
      for (Algorithm algo : {Algorithm::kRing, Algorithm::kTree, Algorithm::kStar, Algorithm::kAuto}) {
        testAllreduce(g, seq, algo, count, 512 << 10, 2);
        if (count <= 100003) testAllreduce(g, seq, algo, count, 4096, 3);  // deep pipelining
      }
      testMaxInt64(g, seq, Algorithm::kRing, std::min<size_t>(count, 5000));
      testMaxInt64(g, seq, Algorithm::kTree, std::min<size_t>(count, 5000));
      for (int root = 0; root < n; ++root) testBroadcast(g, seq, std::min<size_t>(count, 30001), root, 1024, 2);
      testAllgather(g, seq, std::min<size_t>(count, 50001), 4096);
    }
    std::printf("collectives: world size %d ok\n", n);
  }
  testMismatchIsReported();
  testTimeoutNamesPeer();
  std::printf("collectives: mismatch and timeout ok\n");
  return 0;
}
