// The two-level all-gather and reduce-scatter on forced host maps (even,
// uneven, interleaved, a host of one rank): values against sums computed
// from every rank's data, through the entry points and the two-level
// functions themselves, and the bytes each host sends across hosts, which
// must be the bound: every block crosses each host's link once.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "../../csrc/core/algorithms/algorithms.h"
#include "check.h"
#include "forced_hosts.h"
#include "group.h"

using namespace collx;

namespace {

using test::Group;

// ForcedHosts that counts the bytes this rank posts to ranks of other hosts.
class CountingHosts : public test::ForcedHosts {
 public:
  using ForcedHosts::ForcedHosts;
  void postSend(int peer, const Frame& frame, const void* data, size_t bytes, uint64_t cookie) override {
    if (host(peer) != host(rank())) acrossHosts += bytes;
    ForcedHosts::postSend(peer, frame, data, bytes, cookie);
  }
  size_t acrossHosts = 0;
};

Collective make(Transport& t, OpKind kind, DataType dtype, uint64_t seq) {
  thread_local Workspace workspace;
  return Collective{t, kind, dtype, seq, Clock::now() + std::chrono::seconds(60), 64 << 10, 2, workspace};
}

float valueOf(int r, size_t i) { return float((r * 7 + i * 3) % 11) - 5.0f; }
int64_t bigOf(int r, size_t i) { return int64_t((r * 31 + i * 17) % 101) << 33; }

int countOf(const std::vector<int>& hosts, int h) { return int(std::count(hosts.begin(), hosts.end(), h)); }

void testLayout(const std::vector<int>& hosts, size_t block, uint64_t& seq) {
  const int n = int(hosts.size());
  Group g(n);
  std::vector<int> distinct = hosts;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  const int h = int(distinct.size());
  const bool twoLevel = h > 1 && h < n;
  seq += 5;
  test::runRanks(n, [&](int r) {
    CountingHosts view(*g.devices[r], hosts);
    CHECK(twoLevelMoves(view) == twoLevel, "twoLevelMoves, rank ", r);
    // all_gather through the entry point, blocks end to end, this rank's in place.
    std::vector<float> out(block * size_t(n), -99.0f);
    for (size_t i = 0; i < block; ++i) out[size_t(r) * block + i] = valueOf(r, i);
    allgather(make(view, OpKind::kAllgather, DataType::kFloat32, seq - 3), out.data(), block);
    for (int q = 0; q < n; ++q) {
      for (size_t i = 0; i < block; ++i) {
        CHECK(out[size_t(q) * block + i] == valueOf(q, i), "all_gather rank ", r, " block ", q, " i ", i);
      }
    }
    const size_t gathered = view.acrossHosts;
    // The two-level one itself, on scattered blocks from a separate input.
    std::vector<std::vector<int64_t>> outs(size_t(n), std::vector<int64_t>(block, -1));
    std::vector<void*> blocks;
    for (auto& o : outs) blocks.push_back(o.data());
    std::vector<int64_t> in(block);
    for (size_t i = 0; i < block; ++i) in[i] = bigOf(r, i);
    twoLevelAllgather(make(view, OpKind::kAllgather, DataType::kInt64, seq - 2), in.data(), blocks, block);
    for (int q = 0; q < n; ++q) {
      for (size_t i = 0; i < block; ++i) CHECK(outs[size_t(q)][i] == bigOf(q, i), "two-level all_gather rank ", r);
    }
    // reduce_scatter: float SUM (exact on these small integers) and int64 MAX.
    view.acrossHosts = 0;
    std::vector<float> f(block * size_t(n));
    for (size_t i = 0; i < f.size(); ++i) f[i] = valueOf(r, i);
    reduceScatter(make(view, OpKind::kReduceScatter, DataType::kFloat32, seq - 1), f.data(), block,
                  cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    const size_t scattered = view.acrossHosts;
    std::vector<int64_t> m(block * size_t(n));
    for (size_t i = 0; i < m.size(); ++i) m[i] = bigOf(r, i);
    // The two-level one reading its input in place, into a separate output.
    const std::vector<int64_t> input = m;
    std::vector<int64_t> result(block, -1);
    twoLevelReduceScatter(make(view, OpKind::kReduceScatter, DataType::kInt64, seq),
                          blocksAt<const void*>(m.data(), n, block * sizeof(int64_t)), result.data(), block,
                          cpuReduceFn(DataType::kInt64, ReduceOp::kMax));
    CHECK(m == input, "two-level reduce_scatter wrote its input, rank ", r);
    // An output over another rank's input block: written only at the end.
    std::vector<int64_t> aliased = input;
    int64_t* const over = aliased.data() + size_t((r + 1) % n) * block;
    twoLevelReduceScatter(make(view, OpKind::kReduceScatter, DataType::kInt64, seq + 1),
                          blocksAt<const void*>(aliased.data(), n, block * sizeof(int64_t)), over, block,
                          cpuReduceFn(DataType::kInt64, ReduceOp::kMax));
    CHECK(std::equal(over, over + block, result.begin()), "reduce_scatter into an input block, rank ", r);
    for (size_t i = 0; i < block; ++i) {
      const size_t at = size_t(r) * block + i;
      float want = 0;
      int64_t wantMax = 0;
      for (int q = 0; q < n; ++q) {
        want += valueOf(q, at);
        wantMax = std::max(wantMax, bigOf(q, at));
      }
      CHECK(f[at] == want, "reduce_scatter sum rank ", r, " i ", i, " got ", f[at], " want ", want);
      CHECK(result[i] == wantMax, "two-level reduce_scatter max rank ", r, " i ", i);
    }
    if (!twoLevel) return;
    // The bound, per rank: its block to each other host (all_gather); one
    // host sum per block it handles of another host (reduce_scatter).
    const size_t blockBytes = block * sizeof(float);
    const int mine = countOf(hosts, hosts[size_t(r)]);
    CHECK(gathered == size_t(h - 1) * blockBytes, "all_gather rank ", r, " sent ", gathered, " across hosts");
    size_t handledRemote = 0;  // blocks of other hosts this rank handles
    auto localIndex = [&](int q) { return int(std::count(hosts.begin(), hosts.begin() + q, hosts[size_t(q)])); };
    for (int q = 0; q < n; ++q) {
      if (hosts[size_t(q)] != hosts[size_t(r)] && localIndex(q) % mine == localIndex(r)) ++handledRemote;
    }
    CHECK(scattered == handledRemote * blockBytes, "reduce_scatter rank ", r, " sent ", scattered,
          " across hosts, want ", handledRemote, " blocks");
  });
}

}  // namespace

int main() {
  const std::vector<std::vector<int>> layouts = {
      {0, 1},                    // one rank per host: the flat forms
      {0, 0},                    // one host
      {0, 0, 1},                 // {2,1}
      {0, 1, 1, 1},              // {1,3}
      {0, 0, 1, 1},              // {2,2}, the two-namespace layout
      {0, 1, 0, 1},              // interleaved
      {0, 0, 1, 2, 2},           // {2,1,2}
      {2, 2, 0, 0, 1, 1},        // three hosts of two, ids not in rank order
      {0, 0, 0, 1, 1},           // {3,2}
      {0, 0, 0, 0, 1, 1, 1, 1},  // {4,4}
      {0, 1, 2, 0, 1, 2, 0, 1},  // {3,3,2} interleaved
  };
  uint64_t seq = 0;
  for (const auto& hosts : layouts) {
    // Blocks of 1 element, odd sizes, and several segments (256 KiB each).
    for (size_t block : {size_t(0), size_t(1), size_t(7), size_t(100003), size_t(300007)}) testLayout(hosts, block, seq);
    std::printf("two-level moves: hosts of %zu ranks ok\n", hosts.size());
  }
  return 0;
}
