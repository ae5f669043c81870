#include "workspace.h"

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>

namespace collx {

namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kPage = 4096;
#ifndef MADV_POPULATE_WRITE
constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14
#endif

std::atomic<double> faultNs{0};

// Faults in [p, p + bytes) for writing: in one call where the kernel can,
// else a write per page.
void faultIn(char* p, size_t bytes) {
  if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return;
  for (size_t i = 0; i < bytes; i += kPage) p[i] = 0;
}

}  // namespace

Workspace::~Workspace() { std::free(data_); }

double Workspace::faultNsPerByte() { return faultNs.load(std::memory_order_relaxed); }

void Workspace::grow(size_t bytes) {
  const size_t align = bytes >= kHugePage ? kHugePage : 64;
  const size_t size = (bytes + align - 1) / align * align;
  void* p = nullptr;
  if (posix_memalign(&p, align, size) != 0) throw std::bad_alloc();
  char* const fresh = static_cast<char*>(p);
  if (align == kHugePage) madvise(fresh, size, MADV_HUGEPAGE);  // a hint; without it, 4 KiB pages
  const auto start = std::chrono::steady_clock::now();
  faultIn(fresh, size);
  if (size >= kTimedBytes) {
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    double seen = faultNs.load(std::memory_order_relaxed);
    while (ns / double(size) > seen && !faultNs.compare_exchange_weak(seen, ns / double(size))) {
    }
  }
  if (size_ > 0) std::memcpy(fresh, data_, size_);
  std::free(data_);
  data_ = fresh;
  size_ = size;
}

}  // namespace collx
