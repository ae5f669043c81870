#include "subgroup.h"

#include <algorithm>

#include "../error.h"

namespace collx {

SubgroupTransport::SubgroupTransport(Transport& parent, std::vector<int> ranks)
    : parent_(parent), ranks_(std::move(ranks)) {
  std::vector<int> sorted = ranks_;
  std::sort(sorted.begin(), sorted.end());
  COLLX_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
              "collx: a sub-group lists a rank twice");
  for (size_t i = 0; i < ranks_.size(); ++i) {
    COLLX_CHECK(ranks_[i] >= 0 && ranks_[i] < parent.size(), "collx: sub-group rank ", ranks_[i],
                " is out of range for a group of size ", parent.size());
    if (ranks_[i] == parent.rank()) rank_ = int(i);
  }
  COLLX_CHECK(rank_ >= 0, "collx rank ", parent.rank(), ": not a member of its own sub-group");
}

int SubgroupTransport::parentRank(int rank) const {
  COLLX_CHECK(rank >= 0 && rank < size(), "collx: invalid peer ", rank, " for a sub-group of size ", size());
  return ranks_[size_t(rank)];
}

}  // namespace collx
