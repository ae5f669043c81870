// The k-ary tree over virtual ranks (vrank = (rank - root) mod size; the root
// is vrank 0). Node v has parent (v-1)/k and children k·v+1 .. k·v+k.
#pragma once

#include <vector>

namespace collx {

struct TreeNode {
  int parent;                 // real rank; -1 at the root
  std::vector<int> children;  // real ranks, in ascending virtual order
};

inline TreeNode treeNode(int rank, int size, int root, int arity) {
  auto real = [&](int v) { return (v + root) % size; };
  int v = (rank - root + size) % size;
  TreeNode node{v == 0 ? -1 : real((v - 1) / arity), {}};
  for (long c = long(arity) * v + 1; c <= long(arity) * v + arity && c < size; ++c) {
    node.children.push_back(real(int(c)));
  }
  return node;
}

// Levels below the root: 0 for one rank, 1 for a star.
inline int treeDepth(int size, int arity) {
  int depth = 0;
  for (long last = 0; last < size - 1; last = last * arity + arity) ++depth;
  return depth;
}

}  // namespace collx
