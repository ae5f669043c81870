// Star all-reduce: every rank sends its buffer to rank 0, which reduces them
// in rank order and sends the result back.
//
//        1   2   3             1   2   3
//         \  |  /      ->       \  |  /
//            0   (reduce)          0   (result)
//
// Two message latencies whatever the group size, at the cost of the root
// moving (n-1)x the data: the choice for small messages. It is the k-ary
// tree with k = n-1, so it shares the tree's pipelined engine.
#include <algorithm>

#include "algorithms.h"

namespace collx {

void starAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn) {
  treePass(c, static_cast<char*>(buf), count, 0, std::max(1, c.size() - 1), fn, true);
}

}  // namespace collx
