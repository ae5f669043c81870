#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "../../error.h"

namespace collx::shm {

namespace {
char* mapShared(int fd, size_t bytes, const char* what) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw Error(str("cannot map the shared-memory segment ", what, ": ", strerror(errno)));
  return static_cast<char*>(p);
}
}  // namespace

Segment& Segment::operator=(Segment&& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(size_, o.size_);
  std::swap(fd_, o.fd_);
  return *this;
}

Segment::~Segment() {
  if (data_) ::munmap(data_, size_);
  closeFd();
}

void Segment::closeFd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Segment::populate(size_t offset, size_t bytes) const {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;
#endif
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  const size_t from = offset / page * page, to = std::min(size_, offset + bytes);
  if (data_ && from < to) ::madvise(data_ + from, to - from, MADV_POPULATE_WRITE);
}

Segment Segment::create(size_t bytes) {
  Segment s;
  s.fd_ = ::memfd_create("collx", MFD_CLOEXEC);
  if (s.fd_ < 0) throw Error(str("memfd_create failed: ", strerror(errno)));
  if (::fchmod(s.fd_, 0600) != 0 || ::ftruncate(s.fd_, off_t(bytes)) != 0) {
    throw Error(str("cannot size a shared-memory segment of ", bytes, " bytes: ", strerror(errno)));
  }
  s.data_ = mapShared(s.fd_, bytes, "it created");
  s.size_ = bytes;
  return s;
}

Segment Segment::attach(pid_t pid, int fd, size_t bytes) {
  const std::string path = str("/proc/", pid, "/fd/", fd);
  int local = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) throw Error(str("cannot open ", path, ": ", strerror(errno)));
  Segment s;
  s.fd_ = local;
  struct stat st {};
  if (::fstat(local, &st) != 0 || size_t(st.st_size) != bytes) {
    throw Error(str(path, " is not the peer's segment (", st.st_size, " bytes, expected ", bytes, ")"));
  }
  s.data_ = mapShared(local, bytes, path.c_str());
  s.size_ = bytes;
  s.closeFd();  // the mapping keeps the memory
  return s;
}

}  // namespace collx::shm
