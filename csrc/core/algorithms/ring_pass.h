// One ring pass as a resumable state machine: it posts its first sends and
// receives at start(), and the next ones as its ops complete. One pass runs
// to its end in ringPass(); the two-level all-reduce drives a pass over the
// ranks of its host and one over its counterparts on other hosts at once,
// from one waitSome loop, because their links are disjoint.
//
// Part i of the ring is elements [bounds[i], bounds[i+1]) of `buf`, and each
// part is cut into m segments. Step s sends part (rank + shift - s) mod n to
// the right and receives part (rank + shift - s - 1) mod n from the left; the
// first `reduceSteps` steps reduce what arrives, later ones store it.
// Segment j of step s+1 leaves once segment j of step s has arrived (and
// been reduced), and up to kWindow segments are received ahead into scratch.
// Messages on a link leave in (step, segment) order on both sides, so the
// FIFO transport matches them.
#pragma once

#include <cstdint>
#include <vector>

#include "collective.h"
#include "../reduce/reduce.h"

namespace collx {

class RingPass {
 public:
  static constexpr size_t kWindow = 4;  // segments received ahead of the reduction

  // `id` tells this pass's ops apart in a shared waitSome loop (cookies
  // carry it above bit 48); `tagBase` is added to every frame's tag.
  RingPass(const Collective& c, char* buf, std::vector<size_t> bounds, int shift, int steps, int reduceSteps,
           ReduceFn fn, uint32_t tagBase = 0, uint64_t id = 0);

  // The scratch start() needs (none without reduce steps).
  size_t scratchBytes() const;
  // Posts the first ops; `scratch` holds scratchBytes().
  void start(char* scratch);
  bool owns(uint64_t cookie) const { return cookie >> 48 == id_; }
  // One of this pass's ops completed: reduce what arrived, post what follows.
  void complete(uint64_t cookie);
  bool done() const { return completed_ == 2 * units_; }

 private:
  size_t span(size_t part, size_t seg, char** ptr) const;
  void sendUnit(size_t u);
  void postRecvs();
  size_t partOf(size_t u, long extra) const;  // the part unit u sends (extra 0) or receives (1)

  const Collective& c_;
  char* buf_;
  std::vector<size_t> bounds_;
  int shift_, reduceSteps_;
  ReduceFn fn_;
  uint32_t tagBase_;
  uint64_t id_;
  int n_, right_, left_;
  size_t es_, m_ = 1, units_ = 0, segBytes_ = 0;
  char* scratch_ = nullptr;
  size_t nextRecv_ = 0, recvsDone_ = 0, completed_ = 0;
};

// Bounds of `count` elements cut into n nearly equal parts (partBegin).
std::vector<size_t> evenBounds(size_t count, int n);

}  // namespace collx
