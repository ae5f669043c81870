// A view of every rank of a parent transport with a host map forced on top:
// the C++ tests' ranks all share one host, and this lets them run the
// algorithms that group ranks by host on any layout.
#pragma once

#include <vector>

#include "../../csrc/core/transport/subgroup.h"

namespace collx::test {

class ForcedHosts : public SubgroupTransport {
 public:
  ForcedHosts(Transport& parent, std::vector<int> hosts)
      : SubgroupTransport(parent, identity(parent.size())), hosts_(std::move(hosts)) {}
  int host(int rank) const override { return hosts_.at(size_t(rank)); }

 private:
  static std::vector<int> identity(int n) {
    std::vector<int> v(size_t(n), 0);
    for (int i = 0; i < n; ++i) v[size_t(i)] = i;
    return v;
  }
  std::vector<int> hosts_;
};

}  // namespace collx::test
