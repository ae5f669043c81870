// Property test of the k-ary tree: for every size, arity and root, each
// rank's parent lists it as a child, every non-root has exactly one parent,
// the edges form one tree reaching every rank, and treeDepth is its depth.
#include <queue>

#include "../../csrc/core/algorithms/tree_topology.h"
#include "../../csrc/core/error.h"
#include "check.h"

using namespace collx;

int main() {
  for (int size = 1; size <= 64; ++size) {
    for (int arity = 2; arity <= 8; ++arity) {
      for (int root : {0, size / 2, size - 1}) {
        std::vector<TreeNode> nodes;
        for (int r = 0; r < size; ++r) nodes.push_back(treeNode(r, size, root, arity));
        std::vector<int> parentCount(size, 0);
        for (int r = 0; r < size; ++r) {
          CHECK(int(nodes[r].children.size()) <= arity, "size=", size, " arity=", arity);
          CHECK((nodes[r].parent < 0) == (r == root), "only the root lacks a parent");
          if (nodes[r].parent >= 0) {
            const auto& sib = nodes[nodes[r].parent].children;
            CHECK(std::count(sib.begin(), sib.end(), r) == 1, "parent lists child once");
          }
          for (int c : nodes[r].children) {
            CHECK(c >= 0 && c < size && c != r, "child in range");
            CHECK(nodes[c].parent == r, "child's parent is r");
            ++parentCount[c];
          }
        }
        // Breadth-first from the root reaches every rank once; record depth.
        std::vector<int> depth(size, -1);
        std::queue<int> q;
        q.push(root);
        depth[root] = 0;
        int maxDepth = 0, seen = 0;
        while (!q.empty()) {
          int r = q.front();
          q.pop();
          ++seen;
          maxDepth = std::max(maxDepth, depth[r]);
          for (int c : nodes[r].children) {
            CHECK(depth[c] < 0, "no rank is reached twice");
            depth[c] = depth[r] + 1;
            q.push(c);
          }
        }
        CHECK(seen == size, "tree spans the group: size=", size, " arity=", arity);
        CHECK(maxDepth == treeDepth(size, arity), "depth size=", size, " arity=", arity,
              " bfs=", maxDepth, " formula=", treeDepth(size, arity));
        for (int r = 0; r < size; ++r) CHECK(parentCount[r] == (r == root ? 0 : 1), "one parent");
      }
    }
  }
  std::printf("tree topology: sizes 1..64, arity 2..8 ok\n");
  return 0;
}
