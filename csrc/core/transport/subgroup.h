// A Transport over a subset of another transport's ranks: rank i of the view
// is rank ranks[i] of the parent. Any algorithm runs on it unchanged, which is
// how the hierarchical all-reduce reuses the ring and the tree for "the ranks
// of my host" and "one leader per host".
//
// The view owns nothing: it renumbers peers and forwards to the parent, whose
// connections, frames, deadline handling and errors (which name the parent's
// ranks) it shares. The parent's pending ops are the view's, so while a
// view's ops are in flight nobody else may post on the parent; the phases of
// one collective run one after another, which satisfies this.
#pragma once

#include <vector>

#include "transport.h"

namespace collx {

class SubgroupTransport : public Transport {
 public:
  // `ranks`: distinct parent ranks, including parent.rank().
  SubgroupTransport(Transport& parent, std::vector<int> ranks);

  int rank() const override { return rank_; }
  int size() const override { return int(ranks_.size()); }
  int host(int rank) const override { return parent_.host(parentRank(rank)); }
  int parentRank(int rank) const;

  void postSend(int peer, const Frame& frame, const void* data, size_t bytes, uint64_t cookie) override {
    parent_.postSend(parentRank(peer), frame, data, bytes, cookie);
  }
  void postRecv(int peer, const Frame& frame, void* data, size_t bytes, uint64_t cookie) override {
    parent_.postRecv(parentRank(peer), frame, data, bytes, cookie);
  }
  void waitSome(std::vector<uint64_t>& done, Deadline deadline) override { parent_.waitSome(done, deadline); }
  size_t pending() const override { return parent_.pending(); }
  TransportCounters counters() const override { return parent_.counters(); }
  void close() override {}  // the parent's connections are not the view's to close

 private:
  Transport& parent_;
  std::vector<int> ranks_;
  int rank_ = -1;
};

}  // namespace collx
