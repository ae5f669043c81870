#include "half_x86.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace collx::half_x86 {

#if defined(__x86_64__)

namespace {

#define COLLX_AVX2 __attribute__((target("avx2,f16c")))

// As reduce_cpu.cc's minOf / maxOf: a NaN in either operand wins.
template <ReduceOp Op>
COLLX_AVX2 inline __m256 apply(__m256 a, __m256 b) {
  if constexpr (Op == ReduceOp::kSum) return _mm256_add_ps(a, b);
  if constexpr (Op == ReduceOp::kProduct) return _mm256_mul_ps(a, b);
  const __m256 aNan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
  const __m256 aWins = _mm256_cmp_ps(a, b, Op == ReduceOp::kMin ? _CMP_LT_OQ : _CMP_GT_OQ);
  return _mm256_blendv_ps(b, a, _mm256_or_ps(aNan, aWins));
}

// bfloat16 is the top half of a float32: a 256-bit load of 16 holds the
// odd elements as floats once the low halves are masked off, and the even
// ones once shifted up. Reduced apart and put back, no element crosses a
// lane, so no shuffle is needed.
struct Bf16 {
  static constexpr int kWidth = 16;
  COLLX_AVX2 static __m256i high(__m256i x) { return _mm256_and_si256(x, _mm256_set1_epi32(int(0xffff0000u))); }
  // f rounded to bfloat16 (to nearest even; a NaN made quiet), in the high
  // half. A sum or product of bfloat16 values that is a NaN is a quiet one
  // with a zero low half (x86 quiets a NaN operand and keeps its payload, or
  // gives the default NaN), which the rounding add leaves as it is: only a
  // min or max, which passes an operand through, needs the NaN test.
  template <ReduceOp Op>
  COLLX_AVX2 static __m256i round(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    // The kept part's lowest bit, 0 or 1, without a shift (the shifts share
    // fewer execution ports than the other integer ops).
    const __m256i lsb = _mm256_min_epu32(_mm256_and_si256(u, _mm256_set1_epi32(0x10000)), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    if constexpr (Op == ReduceOp::kSum || Op == ReduceOp::kProduct) return rounded;
    const __m256i nan =
        _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  }
  template <ReduceOp Op>
  COLLX_AVX2 static __m256i reduce(const uint16_t* x, const uint16_t* y) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y));
    const __m256 even =
        apply<Op>(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)));
    const __m256 odd = apply<Op>(_mm256_castsi256_ps(high(a)), _mm256_castsi256_ps(high(b)));
    // The even results' high halves shifted down, beside the odd results'
    // high halves: one blend of 16-bit lanes.
    return _mm256_blend_epi16(_mm256_srli_epi32(round<Op>(even), 16), round<Op>(odd), 0xaa);
  }
  COLLX_AVX2 static void store(uint16_t* at, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), v); }
};

struct F16 {
  static constexpr int kWidth = 8;
  template <ReduceOp Op>
  COLLX_AVX2 static __m128i reduce(const uint16_t* x, const uint16_t* y) {
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y)));
    return _mm256_cvtps_ph(apply<Op>(a, b), _MM_FROUND_TO_NEAREST_INT);
  }
  COLLX_AVX2 static void store(uint16_t* at, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(at), v); }
};

// Each vector is loaded before it is stored, so out may be a.
template <typename Format, ReduceOp Op, bool kCopy>
COLLX_AVX2 size_t reduceLoop(uint16_t* out, const uint16_t* a, const uint16_t* b, uint16_t* copy, size_t n) {
  size_t i = 0;
  for (; i + Format::kWidth <= n; i += Format::kWidth) {
    const auto v = Format::template reduce<Op>(a + i, b + i);
    Format::store(out + i, v);
    if constexpr (kCopy) Format::store(copy + i, v);
  }
  return i;
}

template <typename Format, bool kCopy>
size_t reduce(uint16_t* out, const uint16_t* a, const uint16_t* b, uint16_t* copy, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return reduceLoop<Format, ReduceOp::kSum, kCopy>(out, a, b, copy, n);
    case ReduceOp::kProduct: return reduceLoop<Format, ReduceOp::kProduct, kCopy>(out, a, b, copy, n);
    case ReduceOp::kMin: return reduceLoop<Format, ReduceOp::kMin, kCopy>(out, a, b, copy, n);
    case ReduceOp::kMax: return reduceLoop<Format, ReduceOp::kMax, kCopy>(out, a, b, copy, n);
    default: return 0;
  }
}

const bool kAvailable = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");

template <typename Format>
size_t reduceAny(uint16_t* out, const uint16_t* a, const uint16_t* b, uint16_t* copy, size_t n, ReduceOp op) {
  return copy ? reduce<Format, true>(out, a, b, copy, n, op) : reduce<Format, false>(out, a, b, nullptr, n, op);
}

}  // namespace

bool available() { return kAvailable; }
size_t reduceBf16(uint16_t* out, const uint16_t* a, const uint16_t* b, uint16_t* copy, size_t n, ReduceOp op) {
  return reduceAny<Bf16>(out, a, b, copy, n, op);
}
size_t reduceF16(uint16_t* out, const uint16_t* a, const uint16_t* b, uint16_t* copy, size_t n, ReduceOp op) {
  return reduceAny<F16>(out, a, b, copy, n, op);
}

#else

bool available() { return false; }
size_t reduceBf16(uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, size_t, ReduceOp) { return 0; }
size_t reduceF16(uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, size_t, ReduceOp) { return 0; }

#endif

}  // namespace collx::half_x86
