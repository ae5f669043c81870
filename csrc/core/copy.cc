#include "copy.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace collx {

namespace {

#if defined(__x86_64__)
const bool kAvx2 = __builtin_cpu_supports("avx2");

// Unaligned loads, aligned stores, 128 bytes a step; the head up to dst's
// 32-byte boundary and the tail go through memcpy, below the crawl's size.
// About as fast as memcpy at a good distance, from 2 KiB to 16 MiB (measured on
// Zen 3: docs/measurements.md). With kStream the stores are non-temporal,
// and ordered before what follows.
template <bool kStream>
__attribute__((target("avx2"))) inline void store(char* at, __m256i v) {
  if constexpr (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(at), v);
  } else {
    _mm256_store_si256(reinterpret_cast<__m256i*>(at), v);
  }
}

template <bool kStream>
__attribute__((target("avx2"))) void copyVectors(char* dst, const char* src, size_t n) {
  const size_t head = std::min(n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 128 <= n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    store<kStream>(dst + i, a);
    store<kStream>(dst + i + 32, b);
    store<kStream>(dst + i + 64, c);
    store<kStream>(dst + i + 96, d);
  }
  if constexpr (kStream) _mm_sfence();
  std::memcpy(dst + i, src + i, n - i);
}
#endif

}  // namespace

void copyBytes(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (kAvx2 && n >= kSlowStringCopyMinBytes &&
      slowStringCopy(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src))) {
    return copyVectors<false>(static_cast<char*>(dst), static_cast<const char*>(src), n);
  }
#endif
  std::memcpy(dst, src, n);
}

void streamBytes(void* dst, const void* src, size_t n, size_t whole) {
#if defined(__x86_64__)
  if (kAvx2 && whole >= kStreamMinBytes) {
    return copyVectors<true>(static_cast<char*>(dst), static_cast<const char*>(src), n);
  }
#endif
  copyBytes(dst, src, n);
}

void moveBytes(void* dst, const void* src, size_t n) {
  const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (d + n <= s || s + n <= d) return copyBytes(dst, src, n);
  std::memmove(dst, src, n);
}

}  // namespace collx
