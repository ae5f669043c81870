// k-ary tree all-reduce; without the reduce half it is broadcast, without the
// broadcast half it is reduce.
//
//            0               reduce up:   each node adds its children's
//          /   \                          segment j to its own, in child
//         1     2                         order, and sends the sum up
//        / \   / \           broadcast:   the root's result flows down;
//       3   4 5   6                       each node forwards segment j to
//                                         its children as it arrives
//
// Both halves are pipelined by segment: segment j travels up while j+1 is
// still being received from the children, and the root starts sending j
// down before j+1 is reduced. Up to kWindow segments per child are received
// ahead into scratch. Tags: up j = j, down j = kDown | j.
#include <vector>

#include "../error.h"
#include "algorithms.h"
#include "tree_topology.h"
#include "tuning.h"

namespace collx {

namespace {
constexpr size_t kWindow = 4;
constexpr uint32_t kDown = 1u << 31;

// Cookies: kind in the low 2 bits, child index, then segment.
enum : uint64_t { kUpRecv = 0, kDownRecv = 1, kSend = 2 };
inline uint64_t cookie(uint64_t kind, size_t seg, size_t child = 0) {
  return kind | (uint64_t(child) << 2) | (uint64_t(seg) << 18);
}
}  // namespace

void treePass(const Collective& c, char* buf, size_t count, int root, int arity, ReduceFn fn, bool down) {
  const int n = c.size();
  if (n == 1) return;
  COLLX_CHECK(arity >= 1, "collx: tree arity must be >= 1, got ", arity);
  const TreeNode node = treeNode(c.rank(), n, root, arity);
  const size_t kids = node.children.size();
  COLLX_CHECK(kids < (1u << 16), "collx: tree arity too large");
  const size_t es = elementSize(c.dtype);
  const size_t m = segmentsFor(count * es, c.segmentBytes);
  const size_t segBytes = ((count + m - 1) / m) * es;
  auto seg = [&](size_t j, char** ptr) {
    size_t b = partBegin(count, m, j), e = partEnd(count, m, j);
    *ptr = buf + b * es;
    return (e - b) * es;
  };
  Transport& t = c.transport;
  auto sendDown = [&](size_t j) {
    char* p;
    size_t bytes = seg(j, &p);
    for (int child : node.children) t.postSend(child, c.frame(kDown | uint32_t(j)), p, bytes, cookie(kSend, j));
  };

  const bool up = bool(fn);
  char* scratch = up ? c.workspace.get(kWindow * kids * segBytes) : nullptr;
  auto slot = [&](size_t j, size_t k) { return scratch + ((j % kWindow) * kids + k) * segBytes; };
  std::vector<size_t> arrived(up ? m : 0);  // children whose segment j is in scratch
  size_t nextUp = 0;                        // next segment to post up-receives for
  size_t reduced = 0;                       // segments reduced so far
  auto postUpRecvs = [&] {
    for (; nextUp < m && nextUp < reduced + kWindow; ++nextUp) {
      char* p;
      size_t bytes = seg(nextUp, &p);
      for (size_t k = 0; k < kids; ++k) {
        t.postRecv(node.children[k], c.frame(uint32_t(nextUp)), slot(nextUp, k), bytes, cookie(kUpRecv, nextUp, k));
      }
    }
  };
  // A segment whose children have all arrived (or a leaf's) is complete here:
  // send it up, or, at the root, start it down.
  auto finishSegment = [&](size_t j) {
    char* p;
    size_t bytes = seg(j, &p);
    for (size_t k = 0; k < kids; ++k) fn(p, slot(j, k), bytes / es);
    if (node.parent >= 0) {
      t.postSend(node.parent, c.frame(uint32_t(j)), p, bytes, cookie(kSend, j));
      if (down) t.postRecv(node.parent, c.frame(kDown | uint32_t(j)), p, bytes, cookie(kDownRecv, j));
    } else if (down) {
      sendDown(j);
    }
  };
  auto advance = [&] {
    while (reduced < m && arrived[reduced] == kids) finishSegment(reduced++);
    postUpRecvs();
  };

  if (up) {
    advance();
  } else if (node.parent < 0) {
    for (size_t j = 0; j < m; ++j) sendDown(j);
  } else {
    for (size_t j = 0; j < m; ++j) {
      char* p;
      size_t bytes = seg(j, &p);
      t.postRecv(node.parent, c.frame(kDown | uint32_t(j)), p, bytes, cookie(kDownRecv, j));
    }
  }

  std::vector<uint64_t> done;
  while (t.pending() > 0) {
    done.clear();
    t.waitSome(done, c.deadline);
    bool progressed = false;
    for (uint64_t ck : done) {
      size_t j = ck >> 18;
      switch (ck & 3) {
        case kUpRecv: ++arrived[j]; progressed = true; break;
        case kDownRecv: sendDown(j); break;
        default: break;
      }
    }
    if (progressed) advance();
  }
}

void treeAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn) {
  treePass(c, static_cast<char*>(buf), count, 0, c.treeArity, fn, true);
}

void broadcast(const Collective& c, void* buf, size_t count, int root) {
  COLLX_CHECK(root >= 0 && root < c.size(), "collx rank ", c.rank(), ": broadcast root ", root,
              " is out of range for a group of size ", c.size());
  const size_t bytes = count * elementSize(c.dtype);
  if (useSharedWindows(c.transport, bytes)) return shmBroadcast(c, buf, count, root);
  int arity = chooseTreeArity(c.costs(), c.size(), c.treeArity, bytes);
  treePass(c, static_cast<char*>(buf), count, root, arity, nullptr, true);
}

void reduce(const Collective& c, void* buf, size_t count, int root, ReduceFn fn) {
  COLLX_CHECK(root >= 0 && root < c.size(), "collx rank ", c.rank(), ": reduce root ", root,
              " is out of range for a group of size ", c.size());
  const size_t bytes = count * elementSize(c.dtype);
  if (reduceByRing(c.size(), bytes)) return ringReduce(c, static_cast<char*>(buf), count, root, fn);
  treePass(c, static_cast<char*>(buf), count, root, chooseTreeArity(c.costs(), c.size(), c.treeArity, bytes), fn, false);
}

}  // namespace collx
