// Device::cancel, the core of "rejected input does not leave the others
// waiting": (a) every rank cancels the same collectives, many in a row, and
// the group goes on working; (b) one rank cancels a collective the others
// run: they fail at once with its reason, not at their 60 s deadline.
#include <memory>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/error.h"
#include "../../csrc/core/transport/device.h"
#include "check.h"
#include "group.h"
#include "memory_store.h"

using namespace collx;

namespace {

using test::Group;

Deadline in(int seconds) { return Clock::now() + std::chrono::seconds(seconds); }

// A direct all-reduce of #seq (every pair exchanges), checked.
void allreduceChecked(tcp::Device& d, uint64_t seq, Algorithm algo) {
  Workspace ws;
  Collective c{d, OpKind::kAllreduce, DataType::kInt32, seq, in(60), 1 << 10, 2, ws};
  std::vector<int32_t> buf(5000, d.rank() + 1);
  allreduce(c, algo, buf.data(), buf.size(), cpuReduceFn(DataType::kInt32, ReduceOp::kSum));
  int32_t want = d.size() * (d.size() + 1) / 2;
  for (int32_t v : buf) CHECK(v == want, "rank ", d.rank(), " #", seq, " got ", v);
}

void testEveryRankCancels(int n) {
  Group g(n);
  test::runRanks(n, [&](int r) {
    tcp::Device& d = *g.devices[r];
    uint64_t seq = 0;
    allreduceChecked(d, ++seq, Algorithm::kDirect);
    for (int i = 0; i < 100; ++i) d.cancel(++seq, OpKind::kBroadcast, "bad root on every rank", in(60));
    allreduceChecked(d, ++seq, Algorithm::kDirect);
    d.cancel(++seq, OpKind::kAllreduce, "bad op", in(60));
    allreduceChecked(d, ++seq, Algorithm::kRing);
    allreduceChecked(d, ++seq, Algorithm::kTree);
  });
}

void testOneRankCancels(int n, int bad) {
  Group g(n);
  std::vector<std::string> errors(n);
  std::vector<double> seconds(n);
  test::runRanks(n, [&](int r) {
    tcp::Device& d = *g.devices[r];
    allreduceChecked(d, 1, Algorithm::kDirect);
    auto t0 = Clock::now();
    try {
      if (r == bad) {
        d.cancel(2, OpKind::kAllreduce, "collx all_reduce on rank 1: sparse tensors are not supported", in(60));
        allreduceChecked(d, 3, Algorithm::kDirect);  // the others have failed: so does this
      } else {
        allreduceChecked(d, 2, Algorithm::kDirect);
      }
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    seconds[r] = std::chrono::duration<double>(Clock::now() - t0).count();
  });
  for (int r = 0; r < n; ++r) {
    std::printf("n=%d rank %d: %.3f s: %s\n", n, r, seconds[r], errors[r].c_str());
    CHECK(!errors[r].empty(), "rank ", r, " did not fail");
    CHECK(seconds[r] < 5, "rank ", r, " took ", seconds[r], " s");
    if (r != bad) {
      CHECK(errors[r].find("sparse tensors are not supported") != std::string::npos, "rank ", r, ": ", errors[r]);
    } else {  // its next op meets the peers' data of the op it rejected (or their abort)
      CHECK(errors[r].find("which this rank rejected") != std::string::npos ||
                errors[r].find("aborted the group") != std::string::npos,
            "rank ", r, ": ", errors[r]);
    }
  }
}

}  // namespace

int main() {
  for (int n : {2, 3, 4}) testEveryRankCancels(n);
  testOneRankCancels(2, 1);
  testOneRankCancels(3, 1);
  std::printf("test_cancel: ok\n");
  return 0;
}
