// Two-level all-gather and reduce-scatter: each block crosses each host's
// link once, moved by a rank of its own, and spreads inside a host on the
// host's own links (shared memory). Hosts A = {a0, a1}, B = {b0, b1}:
//
//   all-gather                          reduce-scatter (the mirror)
//   1. a0 ═► b0, a1 ═► b1, b0 ═► a0 ... 1. on each host, every rank sends its
//      each rank sends its block to        contribution to block g to the
//      its counterpart on every            rank that handles g there, which
//      other host                          sums them
//   2. on each host, every rank         2. the handler sends the host's sum
//      forwards what it holds (its         to g's owner, which adds the
//      own block and those it got)         other hosts' sums to its own
//      to the host's other ranks
//
// The handler of block g on host H is H's local rank (g's local index mod
// H's rank count): g itself on g's host, and with uneven hosts (3 + 2) a
// rank of the smaller host handles more blocks. Each host's link carries
// (h-1)/h of the gathered bytes each way, the bound, in p streams at once.
//
// Pipeline: blocks move in segments, a unit being one segment of a handled
// block. A unit goes on as soon as it is complete: forwarded when it arrives
// (all-gather), folded when every contribution arrived, in a fixed order, so
// results do not depend on timing (reduce-scatter). The all-gather sends
// across hosts in stages, stage t to the host t after this one, and takes
// its units in the order they arrive: by stage, then segment. The
// reduce-scatter takes them by segment, so every host's blocks move at once.
// Each link's messages are posted in one order on both sides, which keeps
// FIFO matching.
#include <algorithm>

#include "../copy.h"
#include "../error.h"
#include "algorithms.h"

namespace collx {

namespace {

// Segments of at least this size, at most kMaxSegments per block: enough to
// overlap the two steps, few enough that a segment's wake-ups stay cheap.
constexpr size_t kSegmentBytes = 256 << 10;
constexpr size_t kMaxSegments = 64;
constexpr uint32_t kLocalTag = 1u << 30;  // frames of the host step; others cross hosts
// What a completed op was, above bit 48 of its cookie; its unit below.
enum : uint64_t { kSent = 0, kFromHost = 1, kFromNet = 2, kToNet = 3 };

struct Routes {
  HostLayout layout;
  std::vector<int> hostOf, localOf;  // per rank
  std::vector<int> local;            // this rank's host, ascending, itself included
  std::vector<int> handled;          // the blocks this rank handles, ascending

  explicit Routes(const Transport& t) : layout(hostLayout(t)) {
    hostOf.resize(size_t(t.size()));
    localOf.resize(size_t(t.size()));
    for (size_t h = 0; h < layout.ranks.size(); ++h) {
      for (size_t i = 0; i < layout.ranks[h].size(); ++i) {
        hostOf[size_t(layout.ranks[h][i])] = int(h);
        localOf[size_t(layout.ranks[h][i])] = int(i);
      }
    }
    local = layout.ranks[size_t(layout.mine)];
    handled = handledBy(t.rank());
  }
  // The rank of host h that handles block g.
  int handler(int g, int h) const {
    const auto& ranks = layout.ranks[size_t(h)];
    return ranks[size_t(localOf[size_t(g)]) % ranks.size()];
  }
  std::vector<int> handledBy(int x) const {
    std::vector<int> blocks;
    for (int g = 0; g < int(hostOf.size()); ++g) {
      if (handler(g, hostOf[size_t(x)]) == x) blocks.push_back(g);
    }
    return blocks;
  }
};

struct Segments {
  size_t m, count, es;
  Segments(size_t blockCount, size_t es_)
      : m(std::clamp<size_t>(blockCount * es_ / kSegmentBytes, 1, kMaxSegments)), count(blockCount), es(es_) {}
  size_t offset(size_t s) const { return partBegin(count, m, s) * es; }
  size_t bytes(size_t s) const { return (partEnd(count, m, s) - partBegin(count, m, s)) * es; }
  size_t maxBytes() const { return ((count + m - 1) / m) * es; }
};

struct Unit {
  int block;
  size_t seg;
};
// The reduce-scatter's unit u of a rank handling `handled`: segment
// u / |handled| of block handled[u % |handled|].
Unit unitOf(const std::vector<int>& handled, size_t u) {
  return {handled[u % handled.size()], u / handled.size()};
}

uint32_t tagOf(int block, size_t seg, const Segments& segs, bool local) {
  return (local ? kLocalTag : 0) | uint32_t(size_t(block) * segs.m + seg);
}

uint64_t cookie(uint64_t kind, size_t unit) { return kind << 48 | unit; }

}  // namespace

bool twoLevelMoves(const Transport& t) {
  const int hosts = t.hostCount();
  return hosts > 1 && hosts < t.size();
}

void twoLevelAllgather(const Collective& c, const void* in, const std::vector<void*>& blocks, size_t blockCount) {
  const int rank = c.rank();
  const Segments segs(blockCount, elementSize(c.dtype));
  const size_t blockBytes = blockCount * segs.es;
  if (blockBytes == 0) return;
  const Routes routes(c.transport);
  const int hosts = int(routes.layout.ranks.size()), here = routes.layout.mine;
  const void* const source = allgatherSource(in, blocks, rank, blockBytes);
  auto at = [&](int g, size_t s) {
    return (g == rank ? static_cast<char*>(const_cast<void*>(source)) : static_cast<char*>(blocks[size_t(g)])) +
           segs.offset(s);
  };
  // Stage t: every host sends to the host t after it, so each link carries
  // one host's blocks at a time rather than h - 1 hosts' at once (an incast
  // that cost 4 hosts 1.6x). A rank takes its units by stage, then segment.
  auto stageOf = [&](int g) { return (here - routes.hostOf[size_t(g)] + hosts) % hosts; };
  auto unitsOf = [&](const std::vector<int>& handled) {
    std::vector<Unit> units;
    for (int t = 0; t < hosts; ++t) {
      for (size_t seg = 0; seg < segs.m; ++seg) {
        for (int g : handled) {
          if (stageOf(g) == t) units.push_back({g, seg});
        }
      }
    }
    return units;
  };
  const std::vector<Unit> mine = unitsOf(routes.handled);
  std::vector<bool> arrived(mine.size());
  size_t posted = 0, completed = 0;

  // Across hosts: the blocks this rank handles, from their owners; and its
  // own block to its handler on every other host, a stage at a time.
  for (size_t u = 0; u < mine.size(); ++u) {
    const Unit x = mine[u];
    arrived[u] = x.block == rank;
    if (x.block == rank) continue;
    c.transport.postRecv(x.block, c.frame(tagOf(x.block, x.seg, segs, false)), at(x.block, x.seg),
                         segs.bytes(x.seg), cookie(kFromNet, u));
    ++posted;
  }
  int stage = 0;
  size_t stageLeft = 0;  // the current stage's sends not yet done
  auto sendStage = [&] {
    for (; stageLeft == 0 && stage + 1 < hosts; ++stage) {
      const int to = routes.handler(rank, (here + stage + 1) % hosts);
      for (size_t seg = 0; seg < segs.m; ++seg) {
        c.transport.postSend(to, c.frame(tagOf(rank, seg, segs, false)), at(rank, seg), segs.bytes(seg),
                             cookie(kToNet, 0));
        ++posted;
        ++stageLeft;
      }
    }
  };
  sendStage();
  // On this host: what every other rank handles, in its unit order.
  for (int peer : routes.local) {
    if (peer == rank) continue;
    for (const Unit& x : unitsOf(routes.handledBy(peer))) {
      c.transport.postRecv(peer, c.frame(tagOf(x.block, x.seg, segs, true)), at(x.block, x.seg), segs.bytes(x.seg),
                           cookie(kFromHost, 0));
      ++posted;
    }
  }
  // Forwards the units that arrived, in unit order.
  size_t forwarded = 0;
  auto forward = [&] {
    for (; forwarded < mine.size() && arrived[forwarded]; ++forwarded) {
      const Unit x = mine[forwarded];
      for (int peer : routes.local) {
        if (peer == rank) continue;
        c.transport.postSend(peer, c.frame(tagOf(x.block, x.seg, segs, true)), at(x.block, x.seg),
                             segs.bytes(x.seg), cookie(kSent, 0));
        ++posted;
      }
    }
  };
  forward();
  std::vector<uint64_t> done;
  while (completed < posted || forwarded < mine.size() || stage + 1 < hosts) {
    done.clear();
    c.transport.waitSome(done, c.deadline);
    for (uint64_t k : done) {
      ++completed;
      if (k >> 48 == kFromNet) arrived[k & ((uint64_t(1) << 48) - 1)] = true;
      if (k >> 48 == kToNet) --stageLeft;
    }
    sendStage();
    forward();
  }
  if (blocks[size_t(rank)] != source) moveBytes(blocks[size_t(rank)], source, blockBytes);
}

void twoLevelReduceScatter(const Collective& c, const std::vector<const void*>& blocks, void* out, size_t blockCount,
                           ReduceFn fn) {
  const int rank = c.rank();
  const Segments segs(blockCount, elementSize(c.dtype));
  const size_t blockBytes = blockCount * segs.es;
  if (blockBytes == 0) return;
  const Routes routes(c.transport);
  const std::vector<int>& mine = routes.handled;
  const size_t units = mine.size() * segs.m;
  const int hosts = int(routes.layout.ranks.size());
  auto input = [&](int g, size_t s) { return static_cast<const char*>(blocks[size_t(g)]) + segs.offset(s); };
  // Each handled block's contributions, in the order they are folded: this
  // host's other ranks, then (for this rank's own block) the other hosts' sums.
  std::vector<std::vector<int>> sources(mine.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    for (int peer : routes.local) {
      if (peer != rank) sources[i].push_back(peer);
    }
    for (int h = 0; h < hosts && mine[i] == rank; ++h) {
      if (h != routes.layout.mine) sources[i].push_back(routes.handler(rank, h));
    }
  }
  // Receives run up to two rows of units (a segment of every handled block)
  // ahead of the folds, into slots: a row holds each unit's contributions.
  std::vector<size_t> firstSlot(mine.size() + 1, 0);
  for (size_t i = 0; i < mine.size(); ++i) firstSlot[i + 1] = firstSlot[i] + sources[i].size();
  const size_t rows = std::min<size_t>(2, segs.m), window = rows * mine.size();
  const size_t slotsBytes = rows * firstSlot.back() * segs.maxBytes();
  // The sums: this rank's own in `out` (unless it overlaps an input block
  // the op still reads, other than as that block itself), the others' in
  // the workspace after the slots.
  bool ownInOut = true;
  for (int g = 0; g < c.size(); ++g) {
    const bool self = g == rank && out == blocks[size_t(g)];
    ownInOut = ownInOut && (self || !overlaps(out, blocks[size_t(g)], blockBytes));
  }
  char* const scratch = c.workspace.get(slotsBytes + mine.size() * blockBytes);
  auto slot = [&](size_t u, size_t j) {
    const size_t row = (u / mine.size()) % rows;
    return scratch + (row * firstSlot.back() + firstSlot[u % mine.size()] + j) * segs.maxBytes();
  };
  auto sum = [&](size_t index, size_t s) {  // of mine[index]
    char* acc = mine[index] == rank && ownInOut ? static_cast<char*>(out) : scratch + slotsBytes + index * blockBytes;
    return acc + segs.offset(s);
  };

  size_t posted = 0, completed = 0;
  // This rank's contribution to the units every other rank of its host handles.
  for (int peer : routes.local) {
    if (peer == rank) continue;
    const std::vector<int> theirs = routes.handledBy(peer);
    for (size_t u = 0; u < theirs.size() * segs.m; ++u) {
      const Unit x = unitOf(theirs, u);
      c.transport.postSend(peer, c.frame(tagOf(x.block, x.seg, segs, true)), input(x.block, x.seg),
                           segs.bytes(x.seg), cookie(kSent, u));
      ++posted;
    }
  }

  std::vector<size_t> arrivedOf(units, 0);
  std::vector<bool> folded(units);
  size_t nextRecv = 0, foldedCount = 0;
  // The next unit of each block this rank sends to the block's owner.
  std::vector<size_t> nextSend(mine.size(), 0);
  auto sendSums = [&](size_t index) {  // mine[index], a block of another host
    const int g = mine[index];
    for (size_t& s = nextSend[index]; s < segs.m && folded[s * mine.size() + index]; ++s) {
      c.transport.postSend(g, c.frame(tagOf(g, s, segs, false)), sum(index, s), segs.bytes(s), cookie(kSent, 0));
      ++posted;
    }
  };
  auto fold = [&](size_t u) {
    const Unit x = unitOf(mine, u);
    const std::vector<int>& from = sources[u % mine.size()];
    if (arrivedOf[u] < from.size() || folded[u]) return;
    char* const dst = sum(u % mine.size(), x.seg);
    if (dst != input(x.block, x.seg)) moveBytes(dst, input(x.block, x.seg), segs.bytes(x.seg));
    for (size_t j = 0; j < from.size(); ++j) fn(dst, slot(u, j), segs.bytes(x.seg) / segs.es);
    folded[u] = true;
    ++foldedCount;
    if (x.block != rank) sendSums(u % mine.size());
  };
  auto postRecvs = [&] {
    for (; nextRecv < units && (nextRecv < window || folded[nextRecv - window]); ++nextRecv) {
      const size_t u = nextRecv;
      const Unit x = unitOf(mine, u);
      const std::vector<int>& from = sources[u % mine.size()];
      for (size_t j = 0; j < from.size(); ++j) {
        const bool local = routes.hostOf[size_t(from[j])] == routes.layout.mine;
        c.transport.postRecv(from[j], c.frame(tagOf(x.block, x.seg, segs, local)), slot(u, j), segs.bytes(x.seg),
                             cookie(local ? kFromHost : kFromNet, u));
        ++posted;
      }
      fold(u);  // a unit with no contributions (a host of one rank)
    }
  };
  postRecvs();
  std::vector<uint64_t> done;
  while (completed < posted || foldedCount < units) {
    done.clear();
    c.transport.waitSome(done, c.deadline);
    for (uint64_t k : done) {
      ++completed;
      if (k >> 48 == kSent) continue;
      const size_t u = k & ((uint64_t(1) << 48) - 1);
      ++arrivedOf[u];
      fold(u);
    }
    postRecvs();
  }
  if (!ownInOut) {
    const size_t index = size_t(std::find(mine.begin(), mine.end(), rank) - mine.begin());
    moveBytes(out, sum(index, 0), blockBytes);
  }
}

}  // namespace collx
