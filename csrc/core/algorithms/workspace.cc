#include "workspace.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

namespace collx {

namespace {
constexpr size_t kHugePage = size_t(2) << 20;
}  // namespace

Workspace::~Workspace() { std::free(data_); }

void Workspace::grow(size_t bytes) {
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

}  // namespace collx
