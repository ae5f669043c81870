// Mismatched collectives in the shared windows (algorithms/shm_chunks.h):
// the collectives other than the all-reduce check the op's identity, a
// broadcast's root included; a rank in the windows that sees a peer run its
// op over the connections raises the mismatch at once; an op that uses both
// transports alike on every rank is no mismatch.
#include <algorithm>
#include <thread>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/error.h"
#include "../../csrc/core/reduce/reduce.h"
#include "check.h"
#include "group.h"

using namespace collx;

namespace {

using test::Group;
using test::over;
using test::shmAllgatherFlat;

// The other collectives in shared windows check the op's identity too, the
// root of a broadcast included: ranks that disagree fail before any of them
// writes a byte of its buffer; through the windows, or reading the peers'
// memory; the all-gather in place, or from an input apart from its output.
void testWindowsMismatch(bool readPeers, bool inputApart) {
  Group g(3, over(shm::Mode::kShm, readPeers));
  std::vector<std::string> errors(3);
  std::vector<char> untouched(3, 0);
  test::runRanks(3, [&](int r) {
    const size_t block = 5000;
    std::vector<int32_t> buf(3 * block, r + 1);
    Workspace ws;
    Collective c{*g.devices[r], r == 2 ? OpKind::kAllgather : OpKind::kBroadcast, DataType::kInt32, 1,
                 Clock::now() + std::chrono::seconds(20), 1 << 16, 2, ws};
    try {
      if (r == 2 && inputApart) {
        const std::vector<int32_t> input(block, 7);
        shmAllgather(c, input.data(), blocksAt<void*>(buf.data(), 3, block * sizeof(int32_t)), block);
      } else if (r == 2) {
        shmAllgatherFlat(c, buf.data(), block);
      } else {
        shmBroadcast(c, buf.data(), buf.size(), r);  // each thinks itself the root
      }
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    untouched[r] = std::all_of(buf.begin(), buf.end(), [&](int32_t v) { return v == r + 1; });
  });
  for (int r = 0; r < 3; ++r) {
    CHECK(errors[r].find("mismatched collective") != std::string::npos ||
              errors[r].find("aborted the group") != std::string::npos,
          "rank ", r, ": ", errors[r]);
    CHECK(untouched[r], "rank ", r, ": its buffer was written despite the mismatch");
  }
  CHECK(errors[0].find("root 1") != std::string::npos || errors[0].find("all_gather") != std::string::npos,
        "rank 0 names what the peer runs: ", errors[0]);
}

// Ranks whose sizes differ, so that one runs the op over its connections
// (direct) and the others in the windows: neither side would ever see the
// other's data, so a rank in the windows that sees a peer run its op over
// the connections raises the mismatch at once, not at the deadline, and the
// peer hears of it from its abort. Either rank may be the one on direct.
void testMismatchAcrossTransports() {
  const int n = 3;
  for (int linked = 0; linked < n; ++linked) {
    Group g(n, over(shm::Mode::kAuto));
    std::vector<std::string> errors(n);
    const auto start = Clock::now();
    test::runRanks(n, [&](int r) {
      const size_t count = r == linked ? 1024 : 16384;
      std::vector<int32_t> buf(count, 1);
      Workspace ws;
      Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kInt32, 5, Clock::now() + std::chrono::seconds(30),
                   1 << 12, 2, ws};
      try {
        allreduce(c, r == linked ? Algorithm::kDirect : Algorithm::kShm, buf.data(), count,
                  cpuReduceFn(DataType::kInt32, ReduceOp::kSum));
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    CHECK(ms < 5000, "the mismatch took ", ms, " ms to fail");
    for (int r = 0; r < n; ++r) {
      CHECK(errors[r].find("mismatched collective") != std::string::npos, "rank ", r, " (rank ", linked,
            " on direct): '", errors[r], "'");
    }
  }
}

// One op that runs a part in the windows and then a part over the
// connections on every rank alike (a coalesced op's tensors), and the
// reverse, is no mismatch, however the ranks lag one another.
void testBothTransportsInOneOp() {
  const int n = 3;
  Group g(n, over(shm::Mode::kAuto));
  test::runRanks(n, [&](int r) {
    Workspace ws;
    std::vector<int32_t> big(16384), small(1024);
    for (uint64_t seq = 1; seq <= 60; ++seq) {
      if ((seq + uint64_t(r)) % 5 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200 * (r + 1)));
      Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kInt32, seq, Clock::now() + std::chrono::seconds(30),
                   1 << 12, 2, ws};
      std::fill(big.begin(), big.end(), r + 1);
      std::fill(small.begin(), small.end(), r + 1);
      const auto sum = cpuReduceFn(DataType::kInt32, ReduceOp::kSum);
      const bool windowsFirst = seq % 2 == 0;
      allreduce(c, windowsFirst ? Algorithm::kShm : Algorithm::kDirect, windowsFirst ? big.data() : small.data(),
                windowsFirst ? big.size() : small.size(), sum);
      allreduce(c, windowsFirst ? Algorithm::kDirect : Algorithm::kShm, windowsFirst ? small.data() : big.data(),
                windowsFirst ? small.size() : big.size(), sum);
      CHECK(big[0] == n * (n + 1) / 2 && big.back() == n * (n + 1) / 2 && small[0] == n * (n + 1) / 2,
            "rank ", r, " op ", seq, ": wrong sums");
    }
  });
}

}  // namespace

int main() {
  for (bool readPeers : {false, true}) {
    for (bool inputApart : {false, true}) testWindowsMismatch(readPeers, inputApart);
  }
  testMismatchAcrossTransports();
  testBothTransportsInOneOp();
  std::printf("shm mismatch: identities, across transports, both transports in one op ok\n");
  return 0;
}
