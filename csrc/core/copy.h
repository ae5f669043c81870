// Byte copies for the collectives' data paths: memcpy, except where glibc's
// memcpy would crawl, and large copies that the op does not read again.
//
// glibc copies from about 2 KiB up with `rep movsb`. On AMD Zen 3 (glibc
// 2.36) `rep movsb` runs 15-35x slower when the destination lies 1 to 31
// bytes past the source, counted modulo a page, and up to a third slower
// from 32 to 63 (docs/measurements.md). A tensor lies at such a distance
// from a window, a peer's tensor or a receive buffer when it is a view at an
// odd offset, or a block of all_gather_into_tensor whose size is no multiple
// of 64 bytes. The kernel's cross-memory reads take `rep movsb` too.
#pragma once

#include <cstddef>
#include <cstdint>

namespace collx {

// Whether a copy from src to dst lands in the distance above. The test is
// the same on every CPU: the loop taken there is what memcpy itself runs
// below `rep movsb`'s threshold, so a CPU without the crawl loses little.
inline bool slowStringCopy(uintptr_t dst, uintptr_t src) {
  const uintptr_t ahead = (dst - src) % 4096;
  return ahead != 0 && ahead < 64;
}
// Where the crawl begins; below, `rep movsb` is not taken.
constexpr size_t kSlowStringCopyMinBytes = 2048;

// memcpy(dst, src, n) for buffers that do not overlap; at a slow distance,
// where the CPU has AVX2, a vector loop that stores aligned instead.
void copyBytes(void* dst, const void* src, size_t n);

// memmove(dst, src, n), as copyBytes where the buffers do not overlap.
void moveBytes(void* dst, const void* src, size_t n);

// From this size a copy whose destination the op does not read again (an
// all-gather's own block) bypasses the caches: its destination would not
// stay in them, and a non-temporal store saves reading each line before
// writing it. 8 MiB is beyond a core's share of the last-level cache on
// current x86 servers; an n=2 all-gather that streamed blocks of 2 MiB took
// 2-7% longer, of 8 MiB mostly 15-29% less, of 32 MiB 7-25% less
// (docs/measurements.md).
constexpr size_t kStreamMinBytes = size_t(8) << 20;

// copyBytes, with non-temporal stores where the CPU has AVX2 and `whole`,
// the bytes of the copy these n bytes are a piece of, reaches
// kStreamMinBytes; for buffers that do not overlap.
void streamBytes(void* dst, const void* src, size_t n, size_t whole);
inline void streamBytes(void* dst, const void* src, size_t n) { streamBytes(dst, src, n, n); }

}  // namespace collx
