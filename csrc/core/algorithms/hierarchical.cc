// Hierarchical all-reduce: ranks grouped by host (Transport::host). From
// kTwoLevelMinBytes it is the two-level all-reduce (two_level.cc), where
// every rank of a host drives the network; below, the leader form here,
// whose steps across hosts are the fewest: each host's lowest rank leads.
// Hosts A = {0, 1, 2} and B = {3, 4}:
//
//   1. reduce to the leader     2. leaders all-reduce     3. broadcast from
//      on each host                across hosts              the leader
//
//      1 ─┐                                                     ┌─► 1
//         ├─► 0    4 ─► 3          0 ◄═════════► 3           0 ─┤      3 ─► 4
//      2 ─┘                        (A's sum)  (B's sum)         └─► 2
//
// Only step 2 crosses the network, and only the leaders take part: with h
// hosts each host's link carries 2(h-1)/h of the buffer each way, whatever
// number of ranks the hosts run; a flat ring over n ranks puts 2(n-1)/n on
// each link it has between hosts (and has at least two).
//
// Each step is an existing algorithm run on a sub-group view of the group's
// transport (SubgroupTransport): steps 1 and 3 are reduce and broadcast over
// the ranks of this host (pipelined tree or ring reduce-scatter + gather, by
// size), step 2 is the flat all-reduce the cost model picks for the leaders
// (the pipelined ring for large buffers). The steps run one after another,
// each pipelined by segment. They use distinct links (a host's ranks among
// themselves, then leaders across hosts), and on a link the FIFO order keeps
// the reduce's messages ahead of the broadcast's.
//
// On one host it degenerates to steps 1 and 3 (a local reduce + broadcast);
// with one rank per host, to step 2 alone. Every rank ends with the leaders'
// result, so the results are bit-identical everywhere.
#include <algorithm>

#include "../transport/subgroup.h"
#include "algorithms.h"
#include "tuning.h"

namespace collx {

HostLayout hostLayout(const Transport& t) {
  HostLayout layout;
  std::vector<int> ids;  // Transport::host of each layout host
  for (int r = 0; r < t.size(); ++r) {
    const int id = t.host(r);
    size_t h = size_t(std::find(ids.begin(), ids.end(), id) - ids.begin());
    if (h == ids.size()) {
      ids.push_back(id);
      layout.ranks.emplace_back();
    }
    layout.ranks[h].push_back(r);
    if (r == t.rank()) layout.mine = int(h);
  }
  return layout;
}

void hierarchicalAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn) {
  const HostLayout layout = hostLayout(c.transport);
  if (count * elementSize(c.dtype) >= kTwoLevelMinBytes && twoLevelFits(layout)) {
    return twoLevelAllreduce(c, buf, count, fn);
  }
  const std::vector<int>& local = layout.ranks[size_t(layout.mine)];

  SubgroupTransport localView(c.transport, local);
  const Collective onHost = c.on(localView);
  reduce(onHost, buf, count, 0, fn);

  if (c.rank() == local[0] && layout.ranks.size() > 1) {
    std::vector<int> leaders;
    for (const auto& host : layout.ranks) leaders.push_back(host[0]);
    SubgroupTransport leaderView(c.transport, std::move(leaders));
    const Collective across = c.on(leaderView);
    const int h = leaderView.size();
    Algorithm a = chooseAllreduce(c.costs(), h, c.treeArity, count * elementSize(c.dtype));
    allreduce(across, a, buf, count, fn);
  }

  broadcast(onHost, buf, count, 0);
}

}  // namespace collx
