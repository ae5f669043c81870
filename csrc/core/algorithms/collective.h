// What every algorithm gets: the transport, the frame identity of this
// collective, its deadline, and the tunables from Options.
#pragma once

#include <cstdint>

#include "../transport/transport.h"
#include "workspace.h"

namespace collx {

struct Tuning;
class Refiner;

struct Collective {
  Transport& transport;
  OpKind kind;
  DataType dtype;
  uint64_t seq;
  Deadline deadline;
  size_t segmentBytes;  // pipelining unit of ring and tree
  int treeArity;
  Workspace& workspace;
  const Tuning* tuning = nullptr;  // auto's cost model (tuning.h); null: the static table
  Refiner* refiner = nullptr;      // auto's online refinement (refine.h); null: the model alone

  // The same collective (identity, deadline, tunables) on another transport,
  // e.g. a sub-group view of this one; without the refiner, which learns
  // the whole group's ops.
  Collective on(Transport& t) const {
    return Collective{t, kind, dtype, seq, deadline, segmentBytes, treeArity, workspace, tuning};
  }
  const Tuning& costs() const;  // tuning.cc

  int rank() const { return transport.rank(); }
  int size() const { return transport.size(); }
  Frame frame(uint32_t tag) const { return Frame{kind, dtype, seq, tag}; }
};

// Elements [begin, end) of part `i` when `count` elements are split into
// `parts` nearly equal parts (the first count % parts get one more).
inline size_t partBegin(size_t count, size_t parts, size_t i) {
  size_t base = count / parts, extra = count % parts;
  return i * base + (i < extra ? i : extra);
}
inline size_t partEnd(size_t count, size_t parts, size_t i) {
  return partBegin(count, parts, i + 1);
}

// Segments needed so none exceeds segmentBytes (at least one).
inline size_t segmentsFor(size_t bytes, size_t segmentBytes) {
  size_t s = segmentBytes ? (bytes + segmentBytes - 1) / segmentBytes : 1;
  return s ? s : 1;
}

}  // namespace collx
