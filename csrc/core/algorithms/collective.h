// What every algorithm gets: the transport, the frame identity of this
// collective, its deadline, and the tunables from Options.
#pragma once

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "../transport/transport.h"

namespace collx {

// Scratch memory kept across the collectives of a group (one runs at a
// time), so a large op does not fault in fresh pages every call. From 2 MiB
// it asks for transparent huge pages (where the kernel grants them on
// madvise): the first op of a size faults in 2 MiB at a time, not 4 KiB,
// and a page fault costs microseconds on a VM (docs/measurements.md,
// "huge pages for the workspace"). Growing keeps the contents.
class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace() { std::free(data_); }

  char* get(size_t bytes) {
    if (bytes > size_) grow(bytes);
    return data_;
  }

 private:
  static constexpr size_t kHugePage = size_t(2) << 20;

  void grow(size_t bytes) {
    const size_t align = bytes >= kHugePage ? kHugePage : 64;
    const size_t size = (bytes + align - 1) / align * align;
    void* p = nullptr;
    if (posix_memalign(&p, align, size) != 0) throw std::bad_alloc();
    if (align == kHugePage) madvise(p, size, MADV_HUGEPAGE);  // a hint; without it, 4 KiB pages
    if (size_ > 0) std::memcpy(p, data_, size_);
    std::free(data_);
    data_ = static_cast<char*>(p);
    size_ = size;
  }

  char* data_ = nullptr;
  size_t size_ = 0;
};

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
