// Two-level all-reduce: every rank of a host drives the network, none leads.
// Hosts A = {a0, a1} and B = {b0, b1}, the buffer cut into chunks:
//
//   1. reduce-scatter           2. all-reduce slice j        3. all-gather
//      on each host                with rank j of the           on each host
//      (slice j to rank j)         other hosts
//
//      a0 ─┐  ┌─ a1               a0 ◄═══════► b0              a0 ─┐  ┌─ a1
//          ring                    a1 ◄═══════► b1                  ring
//
// Each host's link carries 2(h-1)/h of the buffer each way, as with one
// leader, but in p streams driven by p ranks (and cores) at once; the
// local steps run on the host's own links (shared memory).
//
// Pipeline: the buffer is cut into K chunks. Local steps run in the order
// RS(0), RS(1), AG(0), RS(2), AG(1), ... on the host's links, the network
// step in the order AR(0), AR(1), ... on the links between hosts; AR(k)
// waits for this rank's RS(k), and AG(k) for its AR(k). Both tracks run
// from one waitSome loop (their links are disjoint), so the local steps of
// one chunk overlap the network step of another. Every rank posts each
// track's passes in the same order, which keeps each link's FIFO matching.
//
// Uneven hosts (3 + 2 ranks): each chunk is cut into S = lcm(p_h) slices,
// and local rank i of a host of p ranks owns the S/p slices from i·S/p. The
// owners of slice s, one per host, all-reduce it together; adjacent slices
// with the same owners go as one. A rank takes its slices in order, so any
// two ranks meet their shared slices in the same order.
#include <algorithm>
#include <memory>
#include <numeric>

#include "../error.h"
#include "../transport/subgroup.h"
#include "algorithms.h"
#include "ring_pass.h"

namespace collx {

namespace {

constexpr size_t kMaxSlices = 64;  // beyond this lcm, the leader form
// A chunk's passes cost a few wake-ups per step: below about 2 MiB a chunk
// loses more to them than the overlap wins (docs/measurements.md).
constexpr size_t kChunkBytes = 2 << 20;
constexpr size_t kMaxChunks = 16;

struct Slices {
  size_t count = 1;                    // S: slices per chunk
  std::vector<int> mine;               // the slices this rank owns, in order
  std::vector<std::vector<int>> owners;  // owners[s]: the parent rank owning s, per host
};

// S = lcm of the hosts' rank counts.
size_t sliceCount(const HostLayout& layout) {
  size_t s = 1;
  for (const auto& host : layout.ranks) s = std::lcm(s, host.size());
  return s;
}

Slices slicesOf(const HostLayout& layout, int rank) {
  Slices s;
  s.count = sliceCount(layout);
  s.owners.resize(s.count);
  for (size_t slice = 0; slice < s.count; ++slice) {
    for (const auto& host : layout.ranks) {
      const int owner = host[slice * host.size() / s.count];
      s.owners[slice].push_back(owner);
      if (owner == rank) s.mine.push_back(int(slice));
    }
  }
  return s;
}

}  // namespace

bool twoLevelFits(const HostLayout& layout) { return sliceCount(layout) <= kMaxSlices; }

void twoLevelAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn) {
  const HostLayout layout = hostLayout(c.transport);
  const std::vector<int>& local = layout.ranks[size_t(layout.mine)];
  const int p = int(local.size());
  const Slices slices = slicesOf(layout, c.rank());
  const size_t es = elementSize(c.dtype);
  const size_t chunks = std::clamp<size_t>(count * es / kChunkBytes, 1, kMaxChunks);
  char* base = static_cast<char*>(buf);

  SubgroupTransport localView(c.transport, local);
  const Collective onHost = c.on(localView);
  // Runs of this rank's slices with the same owners: one all-reduce each.
  struct Run {
    size_t first, last;  // slices [first, last]
    std::unique_ptr<SubgroupTransport> view;
    std::unique_ptr<Collective> on;
  };
  std::vector<Run> runs;
  for (int s : slices.mine) {
    if (!runs.empty() && runs.back().last + 1 == size_t(s) &&
        slices.owners[size_t(s)] == slices.owners[runs.back().last]) {
      runs.back().last = size_t(s);
      continue;
    }
    Run r{size_t(s), size_t(s), std::make_unique<SubgroupTransport>(c.transport, slices.owners[size_t(s)]), nullptr};
    r.on = std::make_unique<Collective>(c.on(*r.view));
    runs.push_back(std::move(r));
  }
  const int h = int(layout.ranks.size());

  auto chunkBegin = [&](size_t k) { return partBegin(count, chunks, k); };
  auto chunkLen = [&](size_t k) { return partEnd(count, chunks, k) - chunkBegin(k); };
  auto sliceAt = [&](size_t k, size_t s) { return partBegin(chunkLen(k), slices.count, s); };
  // The local ring's parts: rank i's slices.
  auto localBounds = [&](size_t k) {
    std::vector<size_t> b(size_t(p) + 1);
    for (int i = 0; i <= p; ++i) b[size_t(i)] = sliceAt(k, size_t(i) * slices.count / size_t(p));
    return b;
  };

  // Local track: RS(0), then RS(k+1), AG(k) for each k, then AG(K-1).
  std::vector<std::pair<size_t, bool>> localSteps;  // (chunk, all-gather?)
  localSteps.push_back({0, false});
  for (size_t k = 0; k < chunks; ++k) {
    if (k + 1 < chunks) localSteps.push_back({k + 1, false});
    localSteps.push_back({k, true});
  }
  // Network track: each chunk's runs in order.
  std::vector<std::pair<size_t, size_t>> netSteps;  // (chunk, run)
  for (size_t k = 0; k < chunks; ++k) {
    for (size_t r = 0; r < runs.size(); ++r) netSteps.push_back({k, r});
  }

  constexpr uint64_t kLocalId = 1, kNetId = 2;
  // Tags name a pass by what it moves, alike on every rank that runs it.
  auto tag = [](size_t pass) { return uint32_t((pass + 1) << 20); };
  auto localPassOf = [&](size_t step) {
    const auto [k, gather] = localSteps[step];
    return std::make_unique<RingPass>(onHost, base + chunkBegin(k) * es, localBounds(k), gather ? 0 : -1, p - 1,
                                      gather ? 0 : p - 1, fn, tag(2 * k + gather), kLocalId);
  };
  auto netPassOf = [&](size_t step) {
    const auto [k, r] = netSteps[step];
    const Run& run = runs[r];
    const size_t b = sliceAt(k, run.first), len = sliceAt(k, run.last + 1) - b;
    return std::make_unique<RingPass>(*run.on, base + (chunkBegin(k) + b) * es, evenBounds(len, h), 0, 2 * (h - 1),
                                      h - 1, fn, tag(k * slices.count + run.first), kNetId);
  };
  // Scratch for the two passes that may run at once, the largest of each
  // (a smaller part may take fewer, larger segments).
  size_t localScratch = 0, netScratch = 0;
  for (size_t i = 0; i < localSteps.size(); ++i) localScratch = std::max(localScratch, localPassOf(i)->scratchBytes());
  for (size_t i = 0; i < netSteps.size(); ++i) netScratch = std::max(netScratch, netPassOf(i)->scratchBytes());
  char* scratch = c.workspace.get(localScratch + netScratch);

  std::vector<bool> reduced(chunks, false), allReduced(chunks, false);
  std::vector<size_t> netLeft(chunks, runs.size());
  size_t nextLocal = 0, nextNet = 0;
  std::unique_ptr<RingPass> localPass, netPass;

  // Starts what each idle track may start; returns when both wait on ops.
  auto advance = [&] {
    for (bool moved = true; moved;) {
      moved = false;
      if (localPass && localPass->done()) {
        const auto [k, gather] = localSteps[nextLocal - 1];
        if (!gather) reduced[k] = true;
        localPass.reset();
        moved = true;
      }
      if (netPass && netPass->done()) {
        const size_t k = netSteps[nextNet - 1].first;
        if (--netLeft[k] == 0) allReduced[k] = true;
        netPass.reset();
        moved = true;
      }
      if (!localPass && nextLocal < localSteps.size()) {
        const auto [k, gather] = localSteps[nextLocal];
        if (!gather || allReduced[k]) {
          localPass = localPassOf(nextLocal);
          localPass->start(scratch);
          ++nextLocal;
          moved = true;
        }
      }
      if (!netPass && nextNet < netSteps.size()) {
        if (reduced[netSteps[nextNet].first]) {
          netPass = netPassOf(nextNet);
          netPass->start(scratch + localScratch);
          ++nextNet;
          moved = true;
        }
      }
    }
  };

  advance();
  std::vector<uint64_t> done;
  while (localPass || netPass) {
    done.clear();
    c.transport.waitSome(done, c.deadline);
    for (uint64_t cookie : done) {
      RingPass* pass = localPass && localPass->owns(cookie) ? localPass.get() : netPass.get();
      COLLX_CHECK(pass && pass->owns(cookie), "collx: the two-level all-reduce got an op it did not post");
      pass->complete(cookie);
    }
    advance();
  }
  COLLX_CHECK(nextLocal == localSteps.size() && nextNet == netSteps.size(), "collx rank ", c.rank(),
              ": the two-level all-reduce stopped early (local step ", nextLocal, ", network step ", nextNet, ")");
}

}  // namespace collx
