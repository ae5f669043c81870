// Scratch memory kept across the collectives of a group (one runs at a
// time), so a large op does not fault in fresh pages every call. From 2 MiB
// it asks for transparent huge pages (where the kernel grants them on
// madvise): the first op of a size faults in 2 MiB at a time, not 4 KiB,
// and a page fault costs microseconds on a VM (docs/measurements.md,
// "huge pages for the workspace"). Growing keeps the contents.
#pragma once

#include <cstddef>

namespace collx {

class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace();

  char* get(size_t bytes) {
    if (bytes > size_) grow(bytes);
    return data_;
  }

 private:
  void grow(size_t bytes);

  char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace collx
