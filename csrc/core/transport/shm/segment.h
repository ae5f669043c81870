// A shared-memory segment with no name: a memfd, created mode 0600, which a
// peer on the same host maps by opening /proc/<pid>/fd/<fd> of its creator.
// That open needs the same rights as ptrace-reading the creator, so only the
// user's own processes can attach; and since the segment has no name in
// /dev/shm, nothing is left behind when a rank is killed at any point: the
// memory goes when the last mapping does.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>

namespace collx::shm {

class Segment {
 public:
  // Throws Error if the segment cannot be made (no memfd, no memory).
  static Segment create(size_t bytes);
  // Maps the creator's segment; throws Error with the reason if it cannot.
  static Segment attach(pid_t pid, int fd, size_t bytes);

  Segment() = default;
  Segment(Segment&& o) noexcept { *this = std::move(o); }
  Segment& operator=(Segment&& o) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  char* data() const { return data_; }
  size_t size() const { return size_; }
  // Maps the pages of [offset, offset + bytes) now, writable, where the
  // kernel can (Linux 5.14+), so that the first ops do not fault them in
  // one by one. Best effort: the pages fault in on first use otherwise.
  void populate(size_t offset, size_t bytes) const;
  // The creator's descriptor, open until every peer has attached.
  int fd() const { return fd_; }
  void closeFd();

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

}  // namespace collx::shm
