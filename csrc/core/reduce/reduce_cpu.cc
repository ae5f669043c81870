// CPU reduce kernels. Each is one flat loop over __restrict pointers that the
// compiler vectorises (-O3); 16-bit floats are reduced through float32, by
// the fused kernels of half_x86.h where the CPU has AVX2 and F16C, else in
// float32 blocks.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "../copy.h"
#include "../error.h"
#include "half_x86.h"
#include "reduce.h"

namespace collx {

namespace {

// bfloat16 and float16 as storage types with float conversions.
struct BF16 {
  uint16_t bits;
};
inline float toFloat(BF16 v) {
  uint32_t u = uint32_t(v.bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline BF16 fromFloat(float f, BF16) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return BF16{uint16_t(u >> 16)};
}
inline float toFloat(_Float16 v) { return float(v); }
inline _Float16 fromFloat(float f, _Float16) { return _Float16(f); }

template <typename T>
constexpr bool kHalf = std::is_same_v<T, BF16> || std::is_same_v<T, _Float16>;

// Integer arithmetic wraps like torch's, without signed-overflow UB.
template <typename T>
inline T wrapAdd(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return T(U(a) + U(b));
}
template <typename T>
inline T wrapMul(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return T(U(a) * U(b));
}

// NaN-propagating min / max, like torch.minimum / torch.maximum.
template <typename T>
inline T minOf(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    return (a != a || a < b) ? a : b;
  } else {
    return a < b ? a : b;
  }
}
template <typename T>
inline T maxOf(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    return (a != a || a > b) ? a : b;
  } else {
    return a > b ? a : b;
  }
}

struct Sum {
  static constexpr ReduceOp kOp = ReduceOp::kSum;
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return wrapAdd(a, b);
    else return a + b;
  }
};
struct Prod {
  static constexpr ReduceOp kOp = ReduceOp::kProduct;
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return wrapMul(a, b);
    else return a * b;
  }
};
struct Min {
  static constexpr ReduceOp kOp = ReduceOp::kMin;
  template <typename T>
  static T apply(T a, T b) { return minOf(a, b); }
};
struct Max {
  static constexpr ReduceOp kOp = ReduceOp::kMax;
  template <typename T>
  static T apply(T a, T b) { return maxOf(a, b); }
};
struct Band {
  template <typename T>
  static T apply(T a, T b) { return a & b; }
};
struct Bor {
  template <typename T>
  static T apply(T a, T b) { return a | b; }
};
struct Bxor {
  template <typename T>
  static T apply(T a, T b) { return a ^ b; }
};

// 16-bit floats go through float32 in blocks: convert, reduce, convert
// back. The converters use F16C/AVX2 where the CPU has them (checked once at
// load); the bfloat16 ones are also built for x86-64-v3 and picked at load.
constexpr size_t kBlock = 256;

// Not under ThreadSanitizer: the ifunc resolvers of target_clones run before
// its runtime is up and crash the process at load.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define COLLX_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define COLLX_MULTIVERSION
#endif

#if defined(__x86_64__)
// F16C converts 8 halves per instruction; without it GCC calls libgcc per element.
__attribute__((target("avx2,f16c"))) void widenF16C(const _Float16* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = float(in[i]);
}
__attribute__((target("avx2,f16c"))) void narrowF16C(const float* in, _Float16* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = _Float16(in[i]);
}
const bool kHasF16C = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
#endif

void widen(const _Float16* __restrict in, float* __restrict out, size_t n) {
#if defined(__x86_64__)
  if (kHasF16C) return widenF16C(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = float(in[i]);
}
void narrow(const float* __restrict in, _Float16* __restrict out, size_t n) {
#if defined(__x86_64__)
  if (kHasF16C) return narrowF16C(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = _Float16(in[i]);
}
COLLX_MULTIVERSION void widen(const BF16* __restrict in, float* __restrict out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = toFloat(in[i]);
}
COLLX_MULTIVERSION void narrow(const float* __restrict in, BF16* __restrict out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = fromFloat(in[i], BF16{});
}

// out[i] = op(a[i], b[i]): flat loops over __restrict pointers that the
// compiler vectorises. out == a takes a loop of its own, since __restrict
// pointers may not alias.
template <typename T, typename Op>
void inPlaceLoop(T* __restrict dst, const T* __restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Op::apply(dst[i], b[i]);
}
template <typename T, typename Op>
void apartLoop(T* __restrict out, const T* __restrict a, const T* __restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = Op::apply(a[i], b[i]);
}
template <typename T, typename Op>
void twoStoresLoop(T* __restrict dst, const T* __restrict b, T* __restrict copy, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const T v = Op::apply(dst[i], b[i]);
    dst[i] = v;
    copy[i] = v;
  }
}

// A core's L2 cache, as the system reports it (512 KiB on AMD Zen 3).
const size_t kL2Bytes = [] {
  const long bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return bytes > 0 ? size_t(bytes) : size_t(512) << 10;
}();

// A ReduceFn::Kernel. Where there is a copy, the bfloat16 kernel, bound by
// its conversions, stores each result twice. The others store twice only
// from a core's L2 size, which the copy after the loop would read back from
// further out; below, the second store of each vector, into a line a peer
// has read, cost more than that copy (docs/measurements.md).
template <typename T, typename Op>
void reduceKernel(void* outv, const void* av, const void* bv, void* copyv, size_t n) {
  auto* out = static_cast<T*>(outv);
  const auto* a = static_cast<const T*>(av);
  const auto* b = static_cast<const T*>(bv);
  auto* copy = static_cast<T*>(copyv);
  const bool twice = copy && (std::is_same_v<T, BF16> || n * sizeof(T) >= kL2Bytes);
  size_t done = 0, copied = 0;
  if constexpr (kHalf<T>) {
    // The fused kernels where the CPU has them, the rest in float32 blocks.
    if (half_x86::available()) {
      auto u16 = [](const T* p) { return reinterpret_cast<uint16_t*>(const_cast<T*>(p)); };
      const auto kernel = std::is_same_v<T, BF16> ? half_x86::reduceBf16 : half_x86::reduceF16;
      done = kernel(u16(out), u16(a), u16(b), twice ? u16(copy) : nullptr, n, Op::kOp);
      if (twice) copied = done;
    }
    float x[kBlock], y[kBlock];
    for (size_t base = done; base < n; base += kBlock) {
      size_t k = std::min(kBlock, n - base);
      widen(a + base, x, k);
      widen(b + base, y, k);
      for (size_t i = 0; i < k; ++i) x[i] = Op::apply(x[i], y[i]);
      narrow(x, out + base, k);
    }
  } else if (out == a && twice) {
    twoStoresLoop<T, Op>(out, b, copy, n);
    copied = n;
  } else if (out == a) {
    inPlaceLoop<T, Op>(out, b, n);
  } else {
    apartLoop<T, Op>(out, a, b, n);
  }
  if (copy && copied < n) copyBytes(copy + copied, out + copied, (n - copied) * sizeof(T));
}

// bool is stored as one byte 0/1: SUM and MAX are OR, PRODUCT and MIN are AND.
template <typename Op>
struct BoolOf {
  static uint8_t apply(uint8_t a, uint8_t b) { return uint8_t(Op::apply(a, b) != 0); }
};

template <typename T>
ReduceFn::Kernel arithmeticKernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return reduceKernel<T, Sum>;
    case ReduceOp::kProduct: return reduceKernel<T, Prod>;
    case ReduceOp::kMin: return reduceKernel<T, Min>;
    case ReduceOp::kMax: return reduceKernel<T, Max>;
    default: break;
  }
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case ReduceOp::kBand: return reduceKernel<T, Band>;
      case ReduceOp::kBor: return reduceKernel<T, Bor>;
      case ReduceOp::kBxor: return reduceKernel<T, Bxor>;
      default: break;
    }
  }
  return nullptr;
}

ReduceFn::Kernel boolKernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor: return reduceKernel<uint8_t, BoolOf<Bor>>;
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand: return reduceKernel<uint8_t, BoolOf<Band>>;
    case ReduceOp::kBxor: return reduceKernel<uint8_t, BoolOf<Bxor>>;
    default: return nullptr;
  }
}

// buf[i] = fn(buf[i]) for 16-bit floats, through float32 blocks.
template <typename T, typename Fn>
void mapHalf(T* buf, size_t n, Fn fn) {
  float a[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    size_t k = std::min(kBlock, n - base);
    widen(buf + base, a, k);
    for (size_t i = 0; i < k; ++i) a[i] = fn(a[i]);
    narrow(a, buf + base, k);
  }
}

template <typename T>
void scaleLoop(void* bufv, size_t n, double factor) {
  auto* buf = static_cast<T*>(bufv);
  if constexpr (kHalf<T>) {
    float f = float(factor);
    mapHalf(buf, n, [f](float v) { return v * f; });
  } else {
    T f = T(factor);
    for (size_t i = 0; i < n; ++i) buf[i] *= f;
  }
}

template <typename T>
void divideLoop(void* bufv, size_t n, int64_t d) {
  auto* buf = static_cast<T*>(bufv);
  if constexpr (kHalf<T>) {
    float f = float(d);
    mapHalf(buf, n, [f](float v) { return v / f; });
  } else {
    T f = T(d);
    for (size_t i = 0; i < n; ++i) buf[i] = buf[i] / f;
  }
}

template <typename Half>
void castScaleHalf(void* dstv, DataType dstType, const void* srcv, size_t n, float f) {
  float a[kBlock];
  if (dstType == DataType::kFloat32) {  // half -> float
    auto* src = static_cast<const Half*>(srcv);
    auto* dst = static_cast<float*>(dstv);
    for (size_t base = 0; base < n; base += kBlock) {
      size_t k = std::min(kBlock, n - base);
      widen(src + base, dst + base, k);
      for (size_t i = 0; i < k; ++i) dst[base + i] *= f;
    }
  } else {  // float -> half
    auto* src = static_cast<const float*>(srcv);
    auto* dst = static_cast<Half*>(dstv);
    for (size_t base = 0; base < n; base += kBlock) {
      size_t k = std::min(kBlock, n - base);
      for (size_t i = 0; i < k; ++i) a[i] = src[base + i] * f;
      narrow(a, dst + base, k);
    }
  }
}

}  // namespace

void castScale(DataType dstType, void* dst, DataType srcType, const void* src, size_t count,
               double factor) {
  const float f = float(factor);
  auto is16 = [](DataType t) { return t == DataType::kFloat16 || t == DataType::kBFloat16; };
  if (srcType == DataType::kFloat32 && is16(dstType)) {
    if (dstType == DataType::kFloat16) return castScaleHalf<_Float16>(dst, dstType, src, count, f);
    return castScaleHalf<BF16>(dst, dstType, src, count, f);
  }
  if (dstType == DataType::kFloat32 && is16(srcType)) {
    if (srcType == DataType::kFloat16) return castScaleHalf<_Float16>(dst, dstType, src, count, f);
    return castScaleHalf<BF16>(dst, dstType, src, count, f);
  }
  throw Error(str("collx: cast-and-scale supports float32 <-> float16/bfloat16, not ", name(srcType),
                  " -> ", name(dstType)));
}

ReduceFn::ReduceFn(Kernel kernel)
    : fn_([kernel](void* dst, const void* src, size_t count) { kernel(dst, dst, src, nullptr, count); }),
      kernel_(kernel) {}

void ReduceFn::fused(void* out, const void* a, const void* b, void* copy, size_t count, size_t elementSize) const {
  if (kernel_) return kernel_(out, a, b, copy, count);
  if (out != a) copyBytes(out, a, count * elementSize);
  fn_(out, b, count);
  if (copy) copyBytes(copy, out, count * elementSize);
}

ReduceFn cpuReduceFn(DataType dtype, ReduceOp op) {
  ReduceFn::Kernel kernel = nullptr;
  switch (dtype) {
    case DataType::kFloat32: kernel = arithmeticKernel<float>(op); break;
    case DataType::kFloat64: kernel = arithmeticKernel<double>(op); break;
    case DataType::kFloat16: kernel = arithmeticKernel<_Float16>(op); break;
    case DataType::kBFloat16: kernel = arithmeticKernel<BF16>(op); break;
    case DataType::kInt8: kernel = arithmeticKernel<int8_t>(op); break;
    case DataType::kUInt8: kernel = arithmeticKernel<uint8_t>(op); break;
    case DataType::kInt32: kernel = arithmeticKernel<int32_t>(op); break;
    case DataType::kInt64: kernel = arithmeticKernel<int64_t>(op); break;
    case DataType::kBool: kernel = boolKernel(op); break;
    default: break;
  }
  COLLX_CHECK(kernel, "collx: reduce op ", name(op), " is not supported for dtype ", name(dtype),
              isFloating(dtype) ? " (bitwise ops need integer or bool tensors)" : "");
  return ReduceFn(kernel);
}

void scaleInPlace(DataType dtype, void* buf, size_t count, double factor) {
  switch (dtype) {
    case DataType::kFloat32: return scaleLoop<float>(buf, count, factor);
    case DataType::kFloat64: return scaleLoop<double>(buf, count, factor);
    case DataType::kFloat16: return scaleLoop<_Float16>(buf, count, factor);
    case DataType::kBFloat16: return scaleLoop<BF16>(buf, count, factor);
    default: throw Error(str("collx: PREMUL_SUM needs a floating dtype, got ", name(dtype)));
  }
}

void divideInPlace(DataType dtype, void* buf, size_t count, int64_t divisor) {
  switch (dtype) {
    case DataType::kFloat32: return divideLoop<float>(buf, count, divisor);
    case DataType::kFloat64: return divideLoop<double>(buf, count, divisor);
    case DataType::kFloat16: return divideLoop<_Float16>(buf, count, divisor);
    case DataType::kBFloat16: return divideLoop<BF16>(buf, count, divisor);
    case DataType::kInt8: return divideLoop<int8_t>(buf, count, divisor);
    case DataType::kUInt8: return divideLoop<uint8_t>(buf, count, divisor);
    case DataType::kInt32: return divideLoop<int32_t>(buf, count, divisor);
    case DataType::kInt64: return divideLoop<int64_t>(buf, count, divisor);
    default: throw Error(str("collx: AVG is not supported for dtype ", name(dtype)));
  }
}

}  // namespace collx
