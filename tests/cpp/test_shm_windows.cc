// The collectives in shared windows (algorithms/shm_chunks.h): the
// all-reduce's failures (a mismatch before any byte is written, a timeout
// naming the missing peer, a peer that leaves), hundreds of mixed ops back to back with a lagging rank, with
// and without reading the peers' buffers in place, buffers refilled at once
// after an op read in place, a reduce-scatter's two orders giving the same
// bits, a peer's cancel seen by a windows op, which receives no message, and
// the bytes each carrier moved. The other mismatches: test_shm_mismatch.cc.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/error.h"
#include "../../csrc/core/reduce/reduce.h"
#include "check.h"
#include "group.h"

using namespace collx;

namespace {

using test::Group;
using test::errorWhenPeerLeaves;
using test::over;
using test::shmAllgatherFlat;

// The all-reduce in shared windows: a count mismatch fails every rank before
// a byte of its buffer is written; a peer that never comes is a timeout that
// names it; one that goes away fails the waiter at once.
void testWindowsAllreduceFailures() {
  Group g(3, over(shm::Mode::kShm));
  std::vector<std::string> errors(3);
  std::vector<char> untouched(3, 0);  // not vector<bool>: each rank writes its own element
  test::runRanks(3, [&](int r) {
    CHECK(g.devices[r]->sharedWindows() != nullptr, "a group on one host has shared windows");
    std::vector<float> buf(r == 2 ? 1000 : 1001, float(r + 1));
    Workspace ws;
    Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kFloat32, 1, Clock::now() + std::chrono::seconds(20),
                 1 << 16, 2, ws};
    try {
      shmAllreduce(c, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    untouched[r] = std::all_of(buf.begin(), buf.end(), [&](float v) { return v == float(r + 1); });
  });
  for (int r = 0; r < 3; ++r) {
    CHECK(errors[r].find("mismatched collective") != std::string::npos ||
              errors[r].find("aborted the group") != std::string::npos,
          "rank ", r, ": ", errors[r]);
    CHECK(untouched[r], "rank ", r, ": its buffer was written despite the mismatch");
  }

  Group lone(2, over(shm::Mode::kShm));
  std::vector<float> buf(10, 1.0f);
  Workspace ws;
  Collective c{*lone.devices[0], OpKind::kAllreduce, DataType::kFloat32, 1,
               Clock::now() + std::chrono::milliseconds(300), 1 << 16, 2, ws};
  std::string error;
  try {
    shmAllreduce(c, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
  } catch (const TimeoutError& e) {
    error = e.what();
  }
  CHECK(error.find("Timed out waiting for peer(s) 1 to have posted") != std::string::npos, "got: ", error);

  auto start = Clock::now();
  error = errorWhenPeerLeaves(shmAllreduce, 10);
  CHECK(error.find("Connection closed by peer") != std::string::npos, "got: ", error);
  CHECK(Clock::now() - start < std::chrono::seconds(5), "the departed peer was noticed only at the deadline");

  // Shut down (Backend::shutdown calls interrupt) while waiting on a peer
  // that never comes: the op fails at once, not at its deadline.
  Group down(2, over(shm::Mode::kShm));
  start = Clock::now();
  error.clear();
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    down.devices[0]->interrupt("collx rank 0: the process group was shut down while this op was in flight", false);
  });
  Collective c1{*down.devices[0], OpKind::kAllreduce, DataType::kFloat32, 1, Clock::now() + std::chrono::seconds(20),
                1 << 16, 2, ws};
  try {
    shmAllreduce(c1, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
  } catch (const Error& e) {
    error = e.what();
  }
  stopper.join();
  CHECK(error.find("shut down") != std::string::npos, "got: ", error);
  CHECK(Clock::now() - start < std::chrono::seconds(5), "a shutdown was noticed only at the deadline");
}

// The shared-memory collectives back to back, each rank running on without
// waiting for the others between ops, one of them lagging now and then: a
// rank may post its next op's first chunk before a slower peer has checked
// this one's identity (which once read as a mismatch), and every value must
// still come out right. All-gather and reduce-scatter run through the
// windows or, with readPeers, straight from the peers' buffers, whose owners
// must not move on (and overwrite them) before every peer has read.
void testWindowsBackToBack(bool readPeers) {
  const int n = 3;
  Group g(n, over(shm::Mode::kShm, readPeers));
  test::runRanks(n, [&](int r) {
    Workspace ws;
    const ReduceFn sum = cpuReduceFn(DataType::kInt32, ReduceOp::kSum);
    for (uint64_t seq = 1; seq <= 600; ++seq) {
      if (r == int(seq % n) && seq % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      // Some blocks are over a half (several chunks of the windows), some
      // span several pieces of a reduce-scatter read in place.
      // An all-reduce of the largest reads in place.
      const size_t block = seq % 10 == 9 ? 400000 : seq % 12 == 8 ? 200000 : 1 + seq % 5 * 1000;
      const OpKind kinds[] = {OpKind::kReduceScatter, OpKind::kAllgather, OpKind::kBroadcast, OpKind::kAllreduce};
      const OpKind kind = kinds[seq % 4];
      Collective c{*g.devices[r], kind, DataType::kInt32, seq, Clock::now() + std::chrono::seconds(20), 1 << 16, 2,
                   ws};
      std::vector<int32_t> buf(n * block);
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = int32_t(i % 101) * (r + 1);
      const int root = int(seq % n);
      auto want = [&](size_t i) {  // element i of the result, where this rank has one
        const int32_t v = int32_t(i % 101);
        switch (kind) {
          case OpKind::kBroadcast: return v * (root + 1);
          case OpKind::kAllgather: return v * int32_t(i / block + 1);
          default: return v * (n * (n + 1) / 2);
        }
      };
      size_t lo = 0, hi = buf.size();
      switch (kind) {
        case OpKind::kReduceScatter: {
          shmReduceScatter(c, blocksAt<const void*>(buf.data(), n, block * sizeof(int32_t)),
                           buf.data() + size_t(r) * block, block, sum);
          lo = r * block, hi = lo + block;
          break;
        }
        case OpKind::kAllgather: shmAllgatherFlat(c, buf.data(), block); break;
        case OpKind::kBroadcast: shmBroadcast(c, buf.data(), buf.size(), root); break;
        default: shmAllreduce(c, buf.data(), buf.size(), sum);
      }
      for (size_t i = lo; i < hi; ++i) {
        CHECK(buf[i] == want(i), name(kind), " #", seq, " rank ", r, " element ", i, ": ", buf[i], " != ", want(i));
      }
    }
  });
}

// All-gathers, reduce-scatters and all-reduces that read the peers' buffers
// in place, each rank refilling its buffer for the next op as soon as one
// returns (as a training loop does): no rank may return while a peer still
// reads its buffer, or that peer copies some of the next op's values.
void testReadInPlaceKeepsBuffers() {
  const int n = 3;
  const size_t block = 200000;  // several pieces of a reduce-scatter's reads in place
  Group g(n, over(shm::Mode::kShm));
  test::runRanks(n, [&](int r) {
    Workspace ws;
    const ReduceFn sum = cpuReduceFn(DataType::kInt32, ReduceOp::kSum);
    std::vector<int32_t> buf(n * block), out(block), big(5 << 18);  // big: 5 MiB, an all-reduce read in place
    for (uint64_t seq = 1; seq <= 150; ++seq) {
      std::fill(buf.begin(), buf.end(), int32_t(seq * 10 + r));
      std::fill(big.begin(), big.end(), int32_t(seq * 10 + r));
      const OpKind kinds[] = {OpKind::kAllgather, OpKind::kReduceScatter, OpKind::kAllreduce};
      const OpKind kind = kinds[seq % 3];
      const bool gather = kind == OpKind::kAllgather;
      Collective c{*g.devices[r], kind, DataType::kInt32, seq, Clock::now() + std::chrono::seconds(20), 1 << 16, 2,
                   ws};
      if (kind == OpKind::kAllreduce) {
        shmAllreduce(c, big.data(), big.size(), sum);
        const int32_t want = int32_t(seq * 10 * n + n * (n - 1) / 2);
        CHECK(std::all_of(big.begin(), big.end(), [&](int32_t v) { return v == want; }), "all_reduce #", seq,
              " rank ", r, ": a sum took another op's values");
      } else if (gather) {
        shmAllgatherFlat(c, buf.data(), block);
        for (int q = 0; q < n; ++q) {
          const auto from = buf.begin() + q * block;
          CHECK(std::all_of(from, from + block, [&](int32_t v) { return v == int32_t(seq * 10 + q); }),
                "all_gather #", seq, " rank ", r, ": block ", q, " holds another op's values");
        }
      } else {
        shmReduceScatter(c, blocksAt<const void*>(buf.data(), n, block * sizeof(int32_t)), out.data(), block, sum);
        const int32_t want = int32_t(seq * 10 * n + n * (n - 1) / 2);
        CHECK(std::all_of(out.begin(), out.end(), [&](int32_t v) { return v == want; }), "reduce_scatter #", seq,
              " rank ", r, ": a sum took another op's values");
      }
    }
  });
}

// A float reduce-scatter gives the same bits read in place as through the
// windows (both add a rank's own block first, then the peers' in rank
// order), on blocks that lie apart; the values are such that another order
// gives other bits (rank 2: (x2 + 1e8) - 1e8 = 0, (1e8 - 1e8) + x2 = x2). An
// all-reduce read in place gives the same bits on every rank. A
// reduce-scatter's output that overlaps a block the
// peers read (here every rank's output is its input block 0, which only rank
// 0 reduces) still gets the right sum: the peers must not read what this
// rank already wrote, and every rank must take the same form.
float valueOf(int r, size_t i) {
  const float big = 1e8f * float(1 + i % 3);
  return r == 0 ? big : r == 1 ? -big : 0.7f + float(i % 5);
}

void testReduceScatterOrders() {
  const int n = 3;
  const size_t block = 70000;      // several pieces of the reads in place
  const size_t count = 1300000;    // floats: an all-reduce read in place
  std::vector<std::vector<float>> results[2], sums[2];
  for (bool readPeers : {false, true}) {
    Group g(n, over(shm::Mode::kShm, readPeers));
    results[readPeers].resize(n);
    sums[readPeers].resize(n);
    test::runRanks(n, [&](int r) {
      Workspace ws;
      const ReduceFn sum = cpuReduceFn(DataType::kFloat32, ReduceOp::kSum);
      std::vector<std::vector<float>> in(n, std::vector<float>(block));
      for (int q = 0; q < n; ++q) {
        for (size_t i = 0; i < block; ++i) in[q][i] = valueOf(r, i);
      }
      std::vector<const void*> blocks;
      for (auto& b : in) blocks.push_back(b.data());
      std::vector<float> out(block);
      Collective c{*g.devices[r], OpKind::kReduceScatter, DataType::kFloat32, 1,
                   Clock::now() + std::chrono::seconds(20), 1 << 16, 2, ws};
      shmReduceScatter(c, blocks, out.data(), block, sum);
      results[readPeers][r] = out;
      std::vector<float> all(count);
      for (size_t i = 0; i < count; ++i) all[i] = valueOf(r, i);
      Collective c3{*g.devices[r], OpKind::kAllreduce, DataType::kFloat32, 3,
                    Clock::now() + std::chrono::seconds(20), 1 << 16, 2, ws};
      shmAllreduce(c3, all.data(), count, sum);
      sums[readPeers][r] = all;

      std::vector<int32_t> flat(n * block);
      for (size_t i = 0; i < flat.size(); ++i) flat[i] = int32_t(i) * (r + 1);
      Collective c2{*g.devices[r], OpKind::kReduceScatter, DataType::kInt32, 2,
                    Clock::now() + std::chrono::seconds(20), 1 << 16, 2, ws};
      shmReduceScatter(c2, blocksAt<const void*>(flat.data(), n, block * sizeof(int32_t)), flat.data(), block,
                       cpuReduceFn(DataType::kInt32, ReduceOp::kSum));
      for (size_t i = 0; i < block; ++i) {
        const int32_t want = int32_t(size_t(r) * block + i) * (n * (n + 1) / 2);
        CHECK(flat[i] == want, "rank ", r, " (output over block 0) element ", i, ": ", flat[i], " != ", want);
      }
    });
  }
  for (int r = 0; r < n; ++r) {
    CHECK(std::memcmp(results[0][r].data(), results[1][r].data(), block * sizeof(float)) == 0, "rank ", r,
          ": the reduce-scatter read in place gave other bits than through the windows");
    CHECK(std::memcmp(sums[1][r].data(), sums[1][0].data(), count * sizeof(float)) == 0, "rank ", r,
          ": the all-reduce read in place gave other bits than on rank 0");
  }
}

// Rank 1 rejects op #1 (cancels it) while rank 0, its root, sends and so
// finishes it; both then run a one-round shm all-reduce #2, which needs no
// message. Both must fail it, as they would over TCP, with the cause:
// rank 0 with rank 1's reason, rank 1 because rank 0 ran what it rejected.
void testCancelBeforeWindowsOp() {
  Group g(2, over(shm::Mode::kShm));
  std::vector<std::string> errors(2);
  test::runRanks(2, [&](int r) {
    tcp::Device& d = *g.devices[r];
    Workspace ws;
    const Deadline deadline = Clock::now() + std::chrono::seconds(20);
    std::vector<float> buf(8, 1.0f);
    try {
      if (r == 1) {
        d.cancel(1, OpKind::kBroadcast, "the root was out of range here", deadline);
      } else {
        Collective c{d, OpKind::kBroadcast, DataType::kFloat32, 1, deadline, 1 << 16, 2, ws};
        broadcast(c, buf.data(), buf.size(), 0);
      }
    } catch (const Error& e) {
      errors[r] = str("#1: ", e.what());
      return;
    }
    Collective c{d, OpKind::kAllreduce, DataType::kFloat32, 2, deadline, 1 << 16, 2, ws};
    try {
      shmAllreduce(c, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    } catch (const Error& e) {
      errors[r] = e.what();
    }
  });
  CHECK(errors[0].find("peer 1 did not run broadcast #1, which failed there: the root was out of range here") !=
            std::string::npos,
        "rank 0: ", errors[0]);
  CHECK(errors[1].find("which this rank rejected") != std::string::npos ||
            errors[1].find("aborted the group") != std::string::npos,
        "rank 1: ", errors[1]);
}

}  // namespace

// The counters name the carrier: an all-reduce in the windows moves every
// rank's bytes once in (sent: the peers' slices of its input, and its own
// slice reduced) and its share out twice (received, reduce and
// gather): 2(n-1) x bytes received over the group, nothing over the rings;
// read in place it moves 2(n-1) x bytes both ways by peer memory. An
// all-gather or reduce-scatter moves (n-1) blocks per rank, by peer memory
// where it reads in place.
void testCountersByCarrier(bool readPeers) {
  const int n = 3;
  const size_t count = 5 << 19;  // floats, 10 MiB: several chunks, of the windows or read in place
  Group g(n, over(shm::Mode::kShm, readPeers));
  const bool inPlace = g.devices[0]->sharedWindows()->peerReads() == PeerReads::kAll;
  CHECK(inPlace == readPeers, "threads of one process can read each other's memory");
  const int carrier = int(inPlace ? Carrier::kPeerMemory : Carrier::kShmWindow);
  std::vector<TransportCounters> before(n), after(n);
  test::runRanks(n, [&](int r) {
    Workspace ws;
    std::vector<float> buf(count, 1.0f);
    before[r] = g.devices[r]->counters();
    Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kFloat32, 1, Clock::now() + std::chrono::seconds(20),
                 1 << 16, 2, ws};
    shmAllreduce(c, buf.data(), count, cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    after[r] = g.devices[r]->counters();
  });
  const uint64_t bytes = count * sizeof(float);
  uint64_t sent = 0, received = 0;
  for (int r = 0; r < n; ++r) {
    sent += after[r].sent[carrier] - before[r].sent[carrier];
    received += after[r].received[carrier] - before[r].received[carrier];
    CHECK(after[r].bytesSent() - before[r].bytesSent() == after[r].sent[carrier] - before[r].sent[carrier],
          "rank ", r, ": an all-reduce in shared memory moved bytes by another carrier");
  }
  // Read in place, each rank's slice of every peer's buffer comes in, and
  // every peer's reduced slice: 2(n-1)/n of the buffer per rank, both ways.
  const uint64_t wantSent = inPlace ? uint64_t(2 * (n - 1)) * bytes : uint64_t(n) * bytes;
  CHECK(sent == wantSent, name(Carrier(carrier)), " sent ", sent, ", expected ", wantSent);
  CHECK(received == uint64_t(2 * (n - 1)) * bytes, name(Carrier(carrier)), " received ", received, ", expected ",
        2 * (n - 1) * bytes);

  const size_t block = 300000;  // read in place where peers' memory can be read
  test::runRanks(n, [&](int r) {
    Workspace ws;
    std::vector<int32_t> buf(n * block, r);
    before[r] = g.devices[r]->counters();
    Collective c{*g.devices[r], OpKind::kAllgather, DataType::kInt32, 2, Clock::now() + std::chrono::seconds(20),
                 1 << 16, 2, ws};
    shmAllgatherFlat(c, buf.data(), block);
    after[r] = g.devices[r]->counters();
  });
  for (int r = 0; r < n; ++r) {
    const uint64_t got = after[r].received[carrier] - before[r].received[carrier];
    CHECK(got == (n - 1) * block * sizeof(int32_t), "rank ", r, ": all_gather received ", got, " by ",
          name(Carrier(carrier)));
  }

  test::runRanks(n, [&](int r) {
    Workspace ws;
    const size_t rsBlock = 200000;  // read in place (up to 1 MiB blocks)
    std::vector<int32_t> buf(n * rsBlock, r), out(rsBlock);
    before[r] = g.devices[r]->counters();
    Collective c{*g.devices[r], OpKind::kReduceScatter, DataType::kInt32, 3, Clock::now() + std::chrono::seconds(20),
                 1 << 16, 2, ws};
    shmReduceScatter(c, blocksAt<const void*>(buf.data(), n, rsBlock * sizeof(int32_t)), out.data(), rsBlock,
                     cpuReduceFn(DataType::kInt32, ReduceOp::kSum));
    after[r] = g.devices[r]->counters();
  });
  for (int r = 0; r < n; ++r) {
    const uint64_t got = after[r].received[carrier] - before[r].received[carrier];
    const uint64_t sent = after[r].sent[carrier] - before[r].sent[carrier];
    CHECK(got == (n - 1) * 200000 * sizeof(int32_t) && sent == got, "rank ", r, ": reduce_scatter received ", got,
          " and sent ", sent, " by ", name(Carrier(carrier)));
  }
}

// Two ranks stacked on one core, as processes can start while another core
// idles: a waiter that finds the core shared sleeps instead of yielding
// (Device::spinPause), and the peer's post must wake it, on the windows'
// counters and on the rings alike. Every op's values come out right.
void testStackedOnOneCore() {
  const int n = 2;
  Group g(n, over(shm::Mode::kShm));
  const int core = sched_getcpu();
  test::runRanks(n, [&](int r) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(core, &one);
    CHECK(pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0, "pin rank ", r, " to core ", core);
    Workspace ws;
    const ReduceFn sum = cpuReduceFn(DataType::kInt32, ReduceOp::kSum);
    for (uint64_t seq = 1; seq <= 400; ++seq) {
      const size_t count = seq % 3 == 0 ? 20000 : 1000;  // 80 KB: the windows' chunks; 4 KB: one round
      std::vector<int32_t> buf(count, int32_t(seq + r));
      Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kInt32, seq, Clock::now() + std::chrono::seconds(20),
                   1 << 16, 2, ws};
      (seq % 2 ? shmAllreduce : directAllreduce)(c, buf.data(), count, sum);
      for (size_t i = 0; i < count; ++i) {
        CHECK(buf[i] == int32_t(2 * seq + 1), "#", seq, " rank ", r, " element ", i, ": ", buf[i]);
      }
    }
    CHECK(sched_getcpu() == core, "rank ", r, " left the core it was pinned to");
  });
  for (const auto& d : g.devices) CHECK(d->coreMoves() == 0, "a pinned thread was moved");
}

// Two ranks that start stacked on one core, free to run anywhere, as
// processes launched together often do: every op's values come out right,
// and where a wait moved a rank (Windows::unstack) its mask ends as it
// began. Whether they part depends on the machine's other load (ctest runs
// tests side by side); tests/test_shm.py checks that on an idle machine.
void testStackedThenFree() {
  const int n = 2;
  cpu_set_t all;
  CHECK(sched_getaffinity(0, sizeof all, &all) == 0, "sched_getaffinity");
  if (CPU_COUNT(&all) < 2) {
    std::printf("stacked then free: skipped, one core\n");
    return;
  }
  Group g(n, over(shm::Mode::kShm));
  const int core = sched_getcpu();
  constexpr int kOps = 400;
  std::vector<int> cpus[n];
  test::runRanks(n, [&](int r) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(core, &one);
    CHECK(pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0, "pin rank ", r);
    CHECK(pthread_setaffinity_np(pthread_self(), sizeof all, &all) == 0, "free rank ", r);
    Workspace ws;
    const ReduceFn sum = cpuReduceFn(DataType::kInt32, ReduceOp::kSum);
    std::vector<int32_t> buf(1024);
    for (uint64_t seq = 1; seq <= kOps; ++seq) {
      std::fill(buf.begin(), buf.end(), int32_t(seq + r));
      Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kInt32, seq, Clock::now() + std::chrono::seconds(20),
                   1 << 16, 2, ws};
      g.devices[r]->noteProgress(seq, OpKind::kAllreduce, false);
      shmAllreduce(c, buf.data(), buf.size(), sum);
      CHECK(buf[0] == int32_t(2 * seq + 1) && buf.back() == buf[0], "#", seq, " rank ", r, ": ", buf[0]);
      cpus[r].push_back(sched_getcpu());
    }
    cpu_set_t now;
    CHECK(pthread_getaffinity_np(pthread_self(), sizeof now, &now) == 0 && CPU_EQUAL(&now, &all),
          "rank ", r, "'s mask changed");
  });
  int apart = kOps;  // the first op from which the two ran on different cores
  while (apart > 0 && cpus[0][size_t(apart - 1)] != cpus[1][size_t(apart - 1)]) --apart;
  std::printf("stacked then free: apart from op %d of %d, %llu move(s)\n", apart, kOps,
              static_cast<unsigned long long>(g.devices[0]->coreMoves() + g.devices[1]->coreMoves()));
}

int main() {
  testWindowsAllreduceFailures();
  for (bool readPeers : {false, true}) {
    testCountersByCarrier(readPeers);
    testWindowsBackToBack(readPeers);
  }
  testReadInPlaceKeepsBuffers();
  testReduceScatterOrders();
  testCancelBeforeWindowsOp();
  testStackedOnOneCore();
  testStackedThenFree();
  std::printf("shm windows: failures, back to back, read in place, reduce-scatter orders, cancel, "
              "counters, stacked on one core, stacked then free ok\n");
  return 0;
}
