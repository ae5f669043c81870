// Device::abort and interrupt(tellPeers), the core of Backend::abort: every
// peer of an aborting rank fails at once with the rank's reason (its abort
// frame), whether the rank was idle or waiting in an op; and the failure
// kinds that Backend::getError reports; an op the aborting rank had
// finished still completes on its peers; and a rank whose frame cannot go
// out leaves its reason in the Store.
#include <atomic>
#include <memory>
#include <thread>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/error.h"
#include "../../csrc/core/transport/device.h"
#include "check.h"
#include "group.h"

using namespace collx;

namespace {

using test::Group;
using Failure = tcp::Device::Failure;

constexpr auto kFast = std::chrono::milliseconds(1000);  // far below the 60 s deadlines

// Rank r's all-reduce #seq over `algo`; returns its error ("" if none).
std::string allreduceError(tcp::Device& d, uint64_t seq, Algorithm algo) {
  Workspace ws;
  Collective c{d, OpKind::kAllreduce, DataType::kFloat32, seq, Clock::now() + std::chrono::seconds(60), 1 << 12, 2,
               ws};
  std::vector<float> buf(100000, 1.0f);
  try {
    allreduce(c, algo, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Rank r's all-reduce #seq: its error ("" if none) and how long it took.
struct Outcome {
  std::string error;
  Clock::duration took{};
};
Outcome timedAllreduce(tcp::Device& d, uint64_t seq, Algorithm algo) {
  const auto t0 = Clock::now();
  std::string error = allreduceError(d, seq, algo);
  return {std::move(error), Clock::now() - t0};
}
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A float32 collective #seq of `kind` on d, with a 60 s deadline.
Collective float32Op(tcp::Device& d, Workspace& ws, uint64_t seq, OpKind kind) {
  return Collective{d, kind, DataType::kFloat32, seq, Clock::now() + std::chrono::seconds(60), 1 << 12, 2, ws};
}

// Waits for `flag`, then 50 ms more, so that the peers have the frames sent before it.
void waitThenSettle(const std::atomic<bool>& flag) {
  while (!flag) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

// An idle rank aborts while the others wait for it in an all-reduce.
void testIdleAbort(int n, shm::Mode mode, Algorithm algo) {
  Group g(n, test::over(mode));
  std::vector<Outcome> out(n);
  test::runRanks(n, [&](int r) {
    tcp::Device& d = *g.devices[r];
    CHECK(allreduceError(d, 1, algo).empty(), "a first all-reduce on rank ", r);
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      d.abort("collx rank 0: the process group was aborted");
      CHECK(d.failure() == Failure::kAborted, "rank 0's failure kind");
      out[0] = timedAllreduce(d, 2, algo);  // later ops fail at once
      return;
    }
    out[r] = timedAllreduce(d, 2, algo);
    CHECK(d.failure() == Failure::kRemote, "rank ", r, " sees a remote failure");
  });
  CHECK(out[0].error.find("aborted") != std::string::npos, "rank 0 got: ", out[0].error);
  for (int r = 1; r < n; ++r) {
    const std::string& e = out[r].error;
    CHECK(e.find("rank 0 failed and aborted the group") != std::string::npos ||
              e.find("peer 0 failed and aborted the group") != std::string::npos ||
              e.find("failed and aborted the group: collx rank 0: the process group was aborted") !=
                  std::string::npos,
          "rank ", r, " got: ", e);
    CHECK(out[r].took < kFast, "rank ", r, " learnt of the abort only after ", seconds(out[r].took), " s");
  }
}

// Every rank but the last waits in an all-reduce that the last never joins;
// rank 0 is interrupted from another thread (Backend::abort with an op in
// flight): it fails at once and its peers hear why.
void testInFlightAbort(int n, shm::Mode mode, Algorithm algo) {
  Group g(n, test::over(mode));
  std::vector<Outcome> out(n);
  test::runRanks(n, [&](int r) {
    tcp::Device& d = *g.devices[r];
    if (r == n - 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
      return;  // never joins #1
    }
    std::thread aborter;
    if (r == 0) {
      aborter = std::thread([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        d.interrupt("collx rank 0: the process group was aborted", true);
      });
    }
    out[r] = timedAllreduce(d, 1, algo);
    if (aborter.joinable()) aborter.join();
  });
  CHECK(g.devices[0]->failure() == Failure::kAborted, "rank 0's failure kind");
  CHECK(out[0].error.find("the process group was aborted") != std::string::npos, "rank 0 got: ", out[0].error);
  for (int r = 0; r < n - 1; ++r) {
    CHECK(!out[r].error.empty(), "rank ", r, " did not fail");
    CHECK(out[r].took < kFast, "rank ", r, " failed only after ", seconds(out[r].took), " s");
  }
  for (int r = 1; r < n - 1; ++r) {
    CHECK(out[r].error.find("aborted") != std::string::npos, "rank ", r, " got: ", out[r].error);
    CHECK(g.devices[r]->failure() == Failure::kRemote, "rank ", r, "'s failure kind");
  }
}

// A rank that finished an op and then aborts, idle, leaves that op to its
// peers: a reduce to rank 0 (a tree of arity 2: ranks 1 and 2 send to 0)
// completes with rank 1's part although rank 1 aborted before rank 2 even
// joined. The next op, which needs rank 1 (its root), fails on every rank.
void testAbortAfterFinishing(shm::Mode mode) {
  Group g(3, test::over(mode));
  std::atomic<bool> aborted{false};
  std::vector<std::string> first(3), second(3);
  std::vector<float> sum;
  test::runRanks(3, [&](int r) {
    tcp::Device& d = *g.devices[r];
    Workspace ws;
    auto collective = [&](uint64_t seq, OpKind kind) { return float32Op(d, ws, seq, kind); };
    if (r == 2) waitThenSettle(aborted);
    std::vector<float> buf(1000, float(r + 1));
    try {
      reduce(collective(1, OpKind::kReduce), buf.data(), buf.size(), 0, cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    } catch (const Error& e) {
      first[r] = e.what();
    }
    if (r == 0) sum = buf;
    if (r == 1) {
      d.abort("collx rank 1: the process group was aborted");
      aborted = true;
    }
    try {
      broadcast(collective(2, OpKind::kBroadcast), buf.data(), buf.size(), 1);
    } catch (const Error& e) {
      second[r] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    CHECK(first[r].empty(), "rank ", r, "'s reduce #1 failed: ", first[r]);
    CHECK(second[r].find("aborted") != std::string::npos, "rank ", r, "'s broadcast #2 got: ", second[r]);
  }
  CHECK(sum == std::vector<float>(1000, 6.0f), "reduce #1's sum on rank 0");
}

// A rank that finished the group's own ops (a new group's calibration) and
// failed in the user's op #1 leaves a slower peer's calibration to finish:
// the peer fails at its own op #1, not in its calibration.
void testFailureAfterCalibration(shm::Mode mode) {
  Group g(3, test::over(mode));
  std::atomic<bool> failed{false};
  std::string rootError;
  std::vector<float> sum(100, 0.0f);
  test::runRanks(3, [&](int r) {
    tcp::Device& d = *g.devices[r];
    Workspace ws;
    auto collective = [&](uint64_t seq, OpKind kind) { return float32Op(d, ws, seq, kind); };
    if (r == 2) waitThenSettle(failed);
    std::vector<float> buf(100, float(r + 1));
    try {  // the group's own op: a reduce to rank 0, which ranks 1 and 2 send to
      reduce(collective(kInternalSeqs, OpKind::kCalibrate), buf.data(), buf.size(), 0,
             cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
      if (r == 0) sum = buf;
    } catch (const Error& e) {
      if (r == 0) rootError = e.what();
    }
    if (r != 1) return;
    // Rank 1 waits in op #1 for rank 2 (its root), and is interrupted there.
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      d.interrupt("collx rank 1: the process group was aborted", true);
    });
    try {
      broadcast(collective(1, OpKind::kBroadcast), buf.data(), buf.size(), 2);
    } catch (const Error&) {
    }
    aborter.join();
    failed = true;
  });
  CHECK(rootError.empty(), "rank 0's calibration failed: ", rootError);
  CHECK(sum == std::vector<float>(100, 6.0f), "the calibration's sum on rank 0");
}

void testTimeoutKind() {
  Group g(2, test::over(shm::Mode::kTcp));
  test::runRanks(2, [&](int r) {
    if (r == 1) return;
    Workspace ws;
    tcp::Device& d = *g.devices[0];
    Collective c{d, OpKind::kAllreduce, DataType::kFloat32, 1, Clock::now() + std::chrono::milliseconds(100), 1 << 12,
                 2, ws};
    std::vector<float> buf(10, 1.0f);
    bool timedOut = false;
    try {
      allreduce(c, Algorithm::kDirect, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    } catch (const TimeoutError&) {
      timedOut = true;
    }
    CHECK(timedOut && d.failure() == Failure::kTimeout, "a timeout is reported as one");
  });
}

// A rank whose abort frame cannot go out leaves its cause in the Store: rank
// 0 times out with half of a large message to rank 1 sent, and rank 1, busy
// sending to rank 0, reads no more than its read-ahead within the grace.
// Rank 0 closes with rank 1's bytes unread, so rank 1's send is reset; its
// error names rank 0's cause, not only that rank 0's connection ended.
void testUnsentAbortFrameLeavesANote() {
  auto store = std::make_shared<test::MemoryStore>();
  tcp::DeviceOptions options = test::over(shm::Mode::kTcp);
  options.notes = store;
  std::vector<std::unique_ptr<tcp::Device>> devices(2);
  test::runRanks(2, [&](int r) { devices[r] = std::make_unique<tcp::Device>(*store, r, 2, options); });
  std::vector<std::string> error(2);
  test::runRanks(2, [&](int r) {
    tcp::Device& d = *devices[r];
    std::vector<char> big(64 << 20, char(r));
    d.postSend(1 - r, Frame{OpKind::kAllToAll, DataType::kUInt8, 1, 0}, big.data(), big.size(), 1);
    const auto deadline = Clock::now() + (r == 0 ? std::chrono::milliseconds(300) : std::chrono::seconds(60));
    try {
      waitAll(d, deadline);
    } catch (const Error& e) {
      error[r] = e.what();
    }
  });
  CHECK(error[0].find("Timed out") != std::string::npos, "rank 0 got: ", error[0]);
  CHECK(error[1].find("peer 0 failed and aborted the group") != std::string::npos &&
            error[1].find("Timed out") != std::string::npos,
        "rank 1 lacks rank 0's cause: ", error[1]);
  CHECK(devices[1]->failure() == Failure::kRemote, "rank 1's failure kind");
}

}  // namespace

int main() {
  for (shm::Mode mode : {shm::Mode::kTcp, shm::Mode::kShm}) {
    for (Algorithm algo : {Algorithm::kRing, Algorithm::kDirect}) {
      for (int n : {2, 3, 4}) {
        testIdleAbort(n, mode, algo);
        testInFlightAbort(n + 1, mode, algo);
      }
    }
  }
  testInFlightAbort(3, shm::Mode::kShm, Algorithm::kShm);
  testIdleAbort(3, shm::Mode::kShm, Algorithm::kShm);
  testAbortAfterFinishing(shm::Mode::kTcp);
  testAbortAfterFinishing(shm::Mode::kShm);
  testFailureAfterCalibration(shm::Mode::kTcp);
  testFailureAfterCalibration(shm::Mode::kShm);
  testTimeoutKind();
  testUnsentAbortFrameLeavesANote();
  std::printf("test_abort: ok\n");
  return 0;
}
