// The hierarchical all-reduce and the sub-group view it runs on: N threads,
// one loopback Device each, an in-memory store. All ranks really share one
// host, so a test view forces a host map on top of the Device; layouts cover
// even, uneven ({3,1}), single-host, one-rank-per-host and interleaved maps.
#include <cstring>
#include <memory>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/algorithms/tuning.h"
#include "../../csrc/core/transport/subgroup.h"
#include "../../csrc/core/transport/device.h"
#include "check.h"
#include "forced_hosts.h"
#include "group.h"
#include "memory_store.h"

using namespace collx;

namespace {

using test::Group;

using test::ForcedHosts;

Collective make(Transport& t, DataType dtype, uint64_t seq, size_t seg) {
  thread_local Workspace workspace;
  return Collective{t, OpKind::kAllreduce, dtype, seq, Clock::now() + std::chrono::seconds(60), seg, 2, workspace};
}

std::string show(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += str(s.empty() ? "" : ",", x);
  return "[" + s + "]";
}

float valueOf(int r, size_t i) { return float((r * 7 + i * 3) % 11) - 5.0f; }
int64_t bigOf(int r, size_t i) { return int64_t((r * 31 + i * 17) % 101) << 33; }

// Float SUM and int64 MAX through `algo` on the host map, against local values;
// also checks what ran.
void testLayout(Group& g, uint64_t& seq, const std::vector<int>& hosts, Algorithm algo, Algorithm wantRan,
                size_t count, size_t seg) {
  const int n = int(hosts.size());
  seq += 2;
  test::runRanks(n, [&](int r) {
    ForcedHosts view(*g.devices[r], hosts);
    std::vector<float> f(count);
    for (size_t i = 0; i < count; ++i) f[i] = valueOf(r, i);
    Algorithm ran = allreduce(make(view, DataType::kFloat32, seq - 1, seg), algo, f.data(), count,
                              cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    CHECK(ran == wantRan, "hosts=", show(hosts), " ", name(algo), " ran ", name(ran), ", want ", name(wantRan));
    std::vector<int64_t> m(count);
    for (size_t i = 0; i < count; ++i) m[i] = bigOf(r, i);
    allreduce(make(view, DataType::kInt64, seq, seg), algo, m.data(), count,
              cpuReduceFn(DataType::kInt64, ReduceOp::kMax));
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      int64_t wantMax = 0;
      for (int q = 0; q < n; ++q) {
        want += valueOf(q, i);
        wantMax = std::max(wantMax, bigOf(q, i));
      }
      CHECK(f[i] == want, "sum hosts=", show(hosts), " count=", count, " seg=", seg, " rank=", r, " i=", i,
            " got ", f[i], " want ", want);
      CHECK(m[i] == wantMax, "max hosts=", show(hosts), " count=", count, " rank=", r, " i=", i);
    }
  });
}

void testHostLayout() {
  // hostLayout numbers hosts by their lowest rank, whatever ids the transport uses.
  Group g(6);
  test::runRanks(6, [&](int r) {
    ForcedHosts view(*g.devices[r], {7, 3, 7, 3, 9, 3});
    HostLayout l = hostLayout(view);
    CHECK(l.ranks.size() == 3, "hosts");
    CHECK(l.ranks[0] == std::vector<int>({0, 2}) && l.ranks[1] == std::vector<int>({1, 3, 5}) &&
              l.ranks[2] == std::vector<int>({4}),
          "layout of rank ", r);
    const int want[] = {0, 1, 0, 1, 2, 1};
    CHECK(l.mine == want[r], "rank ", r, " mine=", l.mine);
    // A real loopback mesh: every rank publishes the same address, one host.
    CHECK(hostLayout(*g.devices[r]).ranks.size() == 1, "loopback ranks must be one host");
  });
}

void testAutoChoice() {
  CHECK(chooseAllreduce(Tuning::table(), 4, 2, 2, 16 << 20) == Algorithm::kHierarchical, "2 hosts x 2 ranks");
  CHECK(chooseAllreduce(Tuning::table(), 4, 2, 2, 4) == Algorithm::kHierarchical, "small buffers too");
  CHECK(chooseAllreduce(Tuning::table(), 4, 1, 2, 16 << 20) == chooseAllreduce(Tuning::table(), 4, 2, 16 << 20), "one host: flat choice");
  CHECK(chooseAllreduce(Tuning::table(), 4, 4, 2, 4096) == chooseAllreduce(Tuning::table(), 4, 2, 4096),
        "one rank per host, small: flat");
  CHECK(chooseAllreduce(Tuning::table(), 4, 4, 2, kTwoLevelMinBytes) == Algorithm::kHierarchical,
        "one rank per host, large: a ring over the hosts");
}

// The view renumbers ranks: view {5, 1, 3} of 6 runs ring and broadcast as a
// group of 3, where the view's rank i is parent rank ranks[i].
void testSubgroupView() {
  Group g(6);
  const std::vector<int> members = {5, 1, 3};
  for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(100003)}) {
    test::runRanks(6, [&](int r) {
      auto it = std::find(members.begin(), members.end(), r);
      if (it == members.end()) return;  // not in the view: must not be needed
      const int vr = int(it - members.begin());
      SubgroupTransport view(*g.devices[r], members);
      CHECK(view.rank() == vr && view.size() == 3 && view.parentRank(vr) == r, "view of rank ", r);
      CHECK(view.host(vr) == g.devices[r]->host(r), "host through the view");
      std::vector<float> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = valueOf(vr, i);
      ringAllreduce(make(view, DataType::kFloat32, 1, 4096), buf.data(), count,
                    cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
      for (size_t i = 0; i < count; ++i) {
        float want = valueOf(0, i) + valueOf(1, i) + valueOf(2, i);
        CHECK(buf[i] == want, "view ring count=", count, " rank=", r, " i=", i);
      }
      std::vector<int32_t> b(count, vr == 2 ? 0 : -1);
      if (vr == 2) for (size_t i = 0; i < count; ++i) b[i] = int32_t(i * 5);
      broadcast(make(view, DataType::kInt32, 2, 1024), b.data(), count, 2);
      for (size_t i = 0; i < count; ++i) CHECK(b[i] == int32_t(i * 5), "view broadcast rank=", r, " i=", i);
    });
  }
  // A bad member list is an error, not a silent misrouting.
  auto throws = [&](std::vector<int> ranks) {
    try {
      SubgroupTransport v(*g.devices[0], std::move(ranks));
    } catch (const Error&) {
      return true;
    }
    return false;
  };
  CHECK(throws({1, 2}), "a view without the calling rank must throw");
  CHECK(throws({0, 1, 1}), "a rank listed twice must throw");
  CHECK(throws({0, 6}), "an out-of-range rank must throw");
  std::printf("hierarchical: sub-group view ok\n");
}

}  // namespace

int main() {
  testAutoChoice();
  testHostLayout();
  testSubgroupView();
  const std::vector<std::vector<int>> layouts = {
      {0, 1},                    // one rank per host: the leaders' step alone
      {0, 0},                    // one host: local reduce + broadcast
      {0, 0, 1},                 // {2,1}
      {0, 0, 0, 1},              // {3,1}
      {0, 1, 1, 1},              // {1,3}
      {0, 0, 1, 1},              // {2,2}, the two-namespace layout
      {0, 1, 0, 1},              // interleaved: leaders 0 and 1
      {0, 0, 1, 2, 2},           // {2,1,2}
      {2, 2, 0, 0, 1, 1},        // three hosts of two, ids not in rank order
      {0, 0, 0, 0, 0, 1, 1},     // {5,2}
      {0, 0, 0, 0, 1, 1, 1, 1},  // {4,4}
      {0, 1, 2, 0, 1, 2, 0, 1},  // {3,3,2} interleaved
  };
  for (const auto& hosts : layouts) {
    const int n = int(hosts.size());
    Group g(n);
    uint64_t seq = 0;
    int distinct = 0;
    for (int i = 0; i < n; ++i) distinct += std::find(hosts.begin(), hosts.begin() + i, hosts[i]) == hosts.begin() + i;
    // 262147 floats (1 MiB + 12 B): a host of 3+ ranks reduces by ring + gather.
    for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(100003), size_t(262147)}) {
      testLayout(g, seq, hosts, Algorithm::kHierarchical, Algorithm::kHierarchical, count, 512 << 10);
      testLayout(g, seq, hosts, Algorithm::kHierarchical, Algorithm::kHierarchical, count, 4096);
      // auto: hierarchical when hosts are several and one has several ranks,
      // or the buffer takes the two-level form.
      const size_t bytes = count * sizeof(float);
      Algorithm wantAuto = distinct > 1 && (distinct < n || bytes >= kTwoLevelMinBytes)
                               ? Algorithm::kHierarchical
                               : chooseAllreduce(Tuning::table(), n, 2, bytes);
      testLayout(g, seq, hosts, Algorithm::kAuto, wantAuto, count, 4096);
    }
    std::printf("hierarchical: hosts %s ok\n", show(hosts).c_str());
  }
  return 0;
}
