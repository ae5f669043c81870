// Core collectives over shared memory and over real loopback TCP: N threads,
// one Device each, an in-memory store. Sweeps world size 1..8, awkward counts, every algorithm,
// segment sizes small enough to force deep pipelining, and checks each result
// against values computed from every rank's deterministic input.
#include <cstring>
#include <memory>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/transport/device.h"
#include "check.h"
#include "group.h"
#include "memory_store.h"

using namespace collx;

namespace {

using test::Group;

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

using BroadcastFn = void (*)(const Collective&, void*, size_t, int);
using AllgatherFn = void (*)(const Collective&, const void*, const std::vector<void*>&, size_t);
using ReduceScatterFn = void (*)(const Collective&, void*, size_t, ReduceFn);

void testBroadcast(Group& g, uint64_t& seq, size_t count, int root, size_t seg, int arity,
                   BroadcastFn run = broadcast) {
  int n = int(g.devices.size());
  ++seq;
  test::runRanks(n, [&](int r) {
    std::vector<int32_t> buf(count, -1);
    if (r == root) for (size_t i = 0; i < count; ++i) buf[i] = int32_t(i * 13 + root);
    auto c = make(*g.devices[r], OpKind::kBroadcast, DataType::kInt32, seq, seg, arity);
    run(c, buf.data(), count, root);
    for (size_t i = 0; i < count; ++i) {
      CHECK(buf[i] == int32_t(i * 13 + root), "bcast n=", n, " root=", root, " rank=", r, " i=", i);
    }
  });
}

// Where the blocks and the input lie: end to end with the input in place,
// each in memory of its own, or end to end with every rank's input in block
// 0 (another rank's block, which the op overwrites, on all but rank 0).
enum class Layout { kInPlace, kApart, kInBlock0 };

void testAllgather(Group& g, uint64_t& seq, size_t block, size_t seg, AllgatherFn run = allgather,
                   Layout layout = Layout::kInPlace) {
  int n = int(g.devices.size());
  ++seq;
  const bool apart = layout == Layout::kApart;
  test::runRanks(n, [&](int r) {
    std::vector<std::vector<uint8_t>> out(apart ? n + 1 : 1, std::vector<uint8_t>(apart ? block : block * n, 0));
    std::vector<void*> blocks = apart ? std::vector<void*>() : blocksAt<void*>(out[0].data(), n, block);
    for (int q = 0; apart && q < n; ++q) blocks.push_back(out[size_t(q)].data());
    uint8_t* const in = static_cast<uint8_t*>(apart ? out[size_t(n)].data()
                                              : layout == Layout::kInBlock0 ? blocks[0] : blocks[size_t(r)]);
    for (size_t i = 0; i < block; ++i) in[i] = uint8_t(r * 37 + i);
    auto c = make(*g.devices[r], OpKind::kAllgather, DataType::kUInt8, seq, seg, 2);
    run(c, in, blocks, block);
    for (int q = 0; q < n; ++q) {
      for (size_t i = 0; i < block; ++i) {
        CHECK(static_cast<uint8_t*>(blocks[size_t(q)])[i] == uint8_t(q * 37 + i), "allgather n=", n, " rank=", r,
              " layout ", int(layout));
      }
    }
  });
}

void testReduce(Group& g, uint64_t& seq, size_t count, int root, size_t seg) {
  int n = int(g.devices.size());
  ++seq;
  test::runRanks(n, [&](int r) {
    std::vector<float> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = valueOf(r, i);
    auto c = make(*g.devices[r], OpKind::kReduce, DataType::kFloat32, seq, seg, 2);
    reduce(c, buf.data(), count, root, cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    if (r != root) return;
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < n; ++q) want += valueOf(q, i);
      CHECK(buf[i] == want, "reduce n=", n, " root=", root, " count=", count, " i=", i);
    }
  });
}

void testReduceScatter(Group& g, uint64_t& seq, size_t block, size_t seg, ReduceScatterFn run = reduceScatter) {
  int n = int(g.devices.size());
  ++seq;
  test::runRanks(n, [&](int r) {
    std::vector<float> buf(block * n);
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = valueOf(r, i);
    auto c = make(*g.devices[r], OpKind::kReduceScatter, DataType::kFloat32, seq, seg, 2);
    run(c, buf.data(), block, cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    for (size_t i = r * block; i < (r + 1) * block; ++i) {
      float want = 0;
      for (int q = 0; q < n; ++q) want += valueOf(q, i);
      CHECK(buf[i] == want, "reduce_scatter n=", n, " block=", block, " rank=", r, " i=", i);
    }
  });
}

// Uneven all-to-all: rank r sends (r + j + 1) * scale bytes to rank j.
void testAllToAll(Group& g, uint64_t& seq, size_t scale) {
  int n = int(g.devices.size());
  ++seq;
  auto bytes = [&](int from, int to) { return size_t(from + to + 1) * scale; };
  test::runRanks(n, [&](int r) {
    std::vector<std::vector<uint8_t>> out(n), in(n);
    std::vector<Transfer> sends, recvs;
    auto c = make(*g.devices[r], OpKind::kAllToAll, DataType::kUInt8, seq, 1 << 20, 2);
    for (int j = 0; j < n; ++j) {
      out[j].assign(bytes(r, j), uint8_t(r * 16 + j));
      in[j].assign(bytes(j, r), 0);
      if (j == r) continue;
      sends.push_back({j, out[j].data(), out[j].size(), c.frame(0)});
      recvs.push_back({j, in[j].data(), in[j].size(), c.frame(0)});
    }
    exchange(c, sends, recvs);
    for (int j = 0; j < n; ++j) {
      if (j == r) continue;
      for (uint8_t v : in[j]) CHECK(v == uint8_t(j * 16 + r), "all_to_all n=", n, " from ", j, " to ", r);
    }
  });
}

void testMismatchIsReported(shm::Mode transport) {
  tcp::DeviceOptions options;
  options.transport = transport;
  Group g(2, options);
  std::string errors[2];
  auto start = Clock::now();
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
  // The root detects the count mismatch at once and aborts; the other rank
  // fails on the abort with the root's reason, well before its deadline.
  CHECK(errors[0].find("mismatched collective with peer 1") != std::string::npos, errors[0]);
  CHECK(errors[0].find("12 x float32") != std::string::npos, errors[0]);
  CHECK(errors[1].find("peer 0 failed and aborted the group") != std::string::npos, errors[1]);
  CHECK(errors[1].find("12 x float32") != std::string::npos, errors[1]);
  CHECK(Clock::now() - start < std::chrono::seconds(1), "rank 1 failed only at its deadline");
}

void testTimeoutNamesPeer(shm::Mode transport) {
  tcp::DeviceOptions options;
  options.transport = transport;
  Group g(2, options);
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

// Every collective at world size n over one transport.
void sweep(int n, shm::Mode transport) {
  const size_t counts[] = {0, 1, 7, 1000, 100003, size_t(1) << 20};
  tcp::DeviceOptions options;
  options.transport = transport;
  Group g(n, options);
  uint64_t seq = 0;
  for (size_t count : counts) {
    std::vector<Algorithm> algos = {Algorithm::kRing, Algorithm::kTree, Algorithm::kStar, Algorithm::kDirect,
                                    Algorithm::kHierarchical, Algorithm::kAuto};
    if (transport == shm::Mode::kShm && n > 1) algos.push_back(Algorithm::kShm);
    for (Algorithm algo : algos) {
      testAllreduce(g, seq, algo, count, 512 << 10, 2);
      if (count <= 100003) testAllreduce(g, seq, algo, count, 4096, 3);  // deep pipelining
    }
    if (count == counts[5]) {  // direct in pieces, the last one short
      testAllreduce(g, seq, Algorithm::kDirect, 3 * (kDirectPieceBytes / sizeof(float)) + 5, 512 << 10, 2);
    }
    testMaxInt64(g, seq, Algorithm::kRing, std::min<size_t>(count, 5000));
    testMaxInt64(g, seq, Algorithm::kTree, std::min<size_t>(count, 5000));
    for (int root = 0; root < n; ++root) testBroadcast(g, seq, std::min<size_t>(count, 30001), root, 1024, 2);
    testAllgather(g, seq, std::min<size_t>(count, 50001), 4096);
    testAllgather(g, seq, std::min<size_t>(count, 50001), 4096, allgather, Layout::kApart);
    testAllgather(g, seq, std::min<size_t>(count, 50001), 4096, allgather, Layout::kInBlock0);
    testReduceScatter(g, seq, std::min<size_t>(count, 30001), 4096);
    for (int root = 0; root < n; ++root) testReduce(g, seq, std::min<size_t>(count, 30001), root, 1024);
    if (count == counts[5]) for (int root = 0; root < n; ++root) testReduce(g, seq, count, root, 1 << 16);
    if (count == counts[5]) {  // the ring over TCP
      testAllgather(g, seq, count, 1 << 16, allgather, Layout::kApart);
      testAllgather(g, seq, count, 1 << 16, allgather, Layout::kInBlock0);
    }
    if (transport == shm::Mode::kShm && n > 1) {
      // The shared-memory forms at every count, below the size where the
      // entry points take them too, and over many chunks of a window.
      for (int root = 0; root < n; ++root) testBroadcast(g, seq, count, root, 0, 0, shmBroadcast);
      testAllgather(g, seq, count == counts[5] ? 3 * count + 5 : count, 0, shmAllgather);
      testAllgather(g, seq, count == counts[5] ? 3 * count + 5 : count, 0, shmAllgather, Layout::kApart);
      testAllgather(g, seq, count == counts[5] ? 3 * count + 5 : count, 0, shmAllgather, Layout::kInBlock0);
      // Out of place too: the inputs stay untouched.
      testReduceScatter(g, seq, std::min<size_t>(count, 300007), 0, [](const Collective& c, void* buf, size_t block,
                                                                       ReduceFn fn) {
        const size_t bytes = block * elementSize(c.dtype);
        const std::vector<char> in(static_cast<char*>(buf), static_cast<char*>(buf) + bytes * size_t(c.size()));
        std::vector<const void*> blocks;
        for (int r = 0; r < c.size(); ++r) blocks.push_back(in.data() + size_t(r) * bytes);
        std::vector<char> out(bytes);
        shmReduceScatter(c, blocks, out.data(), block, fn);
        CHECK(std::memcmp(in.data(), buf, in.size()) == 0, "the inputs changed");
        if (bytes > 0) std::memcpy(static_cast<char*>(buf) + size_t(c.rank()) * bytes, out.data(), bytes);
      });
    }
  }
  testAllgather(g, seq, 300000, 64 << 10);  // large blocks take the ring
  testAllToAll(g, seq, 1);
  testAllToAll(g, seq, 100003);
  std::printf("collectives: world size %d over %s ok\n", n, shm::name(transport));
}

}  // namespace

int main() {
  for (shm::Mode transport : {shm::Mode::kShm, shm::Mode::kTcp}) {
    for (int n = 1; n <= 8; ++n) sweep(n, transport);
    testMismatchIsReported(transport);
    testTimeoutNamesPeer(transport);
    std::printf("collectives: mismatch and timeout over %s ok\n", shm::name(transport));
  }
  return 0;
}
