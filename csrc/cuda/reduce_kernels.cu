// Element-wise reduce kernels for every collx dtype and op.
//
// Each thread handles 16 bytes per iteration (one uint4 load from each
// input) in a grid-stride loop. Pointers that share their misalignment get a
// scalar head up to the 16-byte boundary, the vector body, then a scalar
// tail; pointers that cannot be aligned together take the scalar loop.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.h"

namespace collx::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

// Arithmetic in float for 16-bit types, native otherwise.
template <typename T> struct Math { using Acc = T; };
template <> struct Math<__half> { using Acc = float; };
template <> struct Math<__nv_bfloat16> { using Acc = float; };

template <typename T> __device__ __forceinline__ typename Math<T>::Acc up(T v) { return typename Math<T>::Acc(v); }
template <> __device__ __forceinline__ float up(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float up(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T down(typename Math<T>::Acc v) { return T(v); }
template <> __device__ __forceinline__ __half down<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 down<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

struct Sum { template <typename A> __device__ static A apply(A a, A b) { return a + b; } };
struct Prod { template <typename A> __device__ static A apply(A a, A b) { return a * b; } };
struct Min {
  template <typename A> __device__ static A apply(A a, A b) { return (a != a || a < b) ? a : b; }
};
struct Max {
  template <typename A> __device__ static A apply(A a, A b) { return (a != a || a > b) ? a : b; }
};
struct Band { template <typename A> __device__ static A apply(A a, A b) { return a & b; } };
struct Bor { template <typename A> __device__ static A apply(A a, A b) { return a | b; } };
struct Bxor { template <typename A> __device__ static A apply(A a, A b) { return a ^ b; } };
// bool bytes stay 0/1.
template <typename Op> struct Bool {
  template <typename A> __device__ static A apply(A a, A b) { return A(Op::apply(a, b) != 0); }
};

template <typename T, typename Op, bool kScale>
__device__ __forceinline__ T combine(T a, T b, float scale) {
  auto r = Op::apply(up(a), up(b));
  if constexpr (kScale) r = r * decltype(r)(scale);
  return down<T>(r);
}

template <typename T, typename Op, bool kScale>
__global__ void reduceScalar(T* dst, const T* src, size_t n, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = combine<T, Op, kScale>(dst[i], src[i], scale);
  }
}

template <typename T, typename Op, bool kScale>
__global__ void reduceVector(T* dst, const T* src, size_t vecs, float scale) {
  constexpr int kPer = 16 / sizeof(T);
  auto* d4 = reinterpret_cast<uint4*>(dst);
  auto* s4 = reinterpret_cast<const uint4*>(src);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vecs; i += size_t(gridDim.x) * blockDim.x) {
    uint4 a = d4[i], b = s4[i];
    T* ta = reinterpret_cast<T*>(&a);
    const T* tb = reinterpret_cast<const T*>(&b);
#pragma unroll
    for (int k = 0; k < kPer; ++k) ta[k] = combine<T, Op, kScale>(ta[k], tb[k], scale);
    d4[i] = a;
  }
}

int blocksFor(size_t work) {
  size_t b = (work + kThreads - 1) / kThreads;
  return int(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

template <typename T, typename Op, bool kScale>
void launch(void* dstv, const void* srcv, size_t n, float scale, cudaStream_t s) {
  auto* dst = static_cast<T*>(dstv);
  auto* src = static_cast<const T*>(srcv);
  const uintptr_t da = uintptr_t(dst) % 16, sa = uintptr_t(src) % 16;
  if (da != sa || da % sizeof(T) != 0) {
    reduceScalar<T, Op, kScale><<<blocksFor(n), kThreads, 0, s>>>(dst, src, n, scale);
    return;
  }
  size_t head = da ? (16 - da) / sizeof(T) : 0;
  if (head > n) head = n;
  if (head) reduceScalar<T, Op, kScale><<<1, kThreads, 0, s>>>(dst, src, head, scale);
  constexpr size_t kPer = 16 / sizeof(T);
  size_t vecs = (n - head) / kPer;
  if (vecs) reduceVector<T, Op, kScale><<<blocksFor(vecs), kThreads, 0, s>>>(dst + head, src + head, vecs, scale);
  size_t done = head + vecs * kPer;
  if (done < n) reduceScalar<T, Op, kScale><<<1, kThreads, 0, s>>>(dst + done, src + done, n - done, scale);
}

template <typename T, typename Op>
void dispatchScale(void* dst, const void* src, size_t n, double scale, cudaStream_t s) {
  if (scale != 1.0) launch<T, Op, true>(dst, src, n, float(scale), s);
  else launch<T, Op, false>(dst, src, n, 1.0f, s);
}

template <typename T>
bool arithmetic(ReduceOp op, void* dst, const void* src, size_t n, double scale, cudaStream_t s) {
  switch (op) {
    case ReduceOp::kSum: dispatchScale<T, Sum>(dst, src, n, scale, s); return true;
    case ReduceOp::kProduct: dispatchScale<T, Prod>(dst, src, n, scale, s); return true;
    case ReduceOp::kMin: dispatchScale<T, Min>(dst, src, n, scale, s); return true;
    case ReduceOp::kMax: dispatchScale<T, Max>(dst, src, n, scale, s); return true;
    default: return false;
  }
}

template <typename T>
bool integral(ReduceOp op, void* dst, const void* src, size_t n, cudaStream_t s) {
  switch (op) {
    case ReduceOp::kBand: launch<T, Band, false>(dst, src, n, 1.0f, s); return true;
    case ReduceOp::kBor: launch<T, Bor, false>(dst, src, n, 1.0f, s); return true;
    case ReduceOp::kBxor: launch<T, Bxor, false>(dst, src, n, 1.0f, s); return true;
    default: return arithmetic<T>(op, dst, src, n, 1.0, s);
  }
}

bool boolean(ReduceOp op, void* dst, const void* src, size_t n, cudaStream_t s) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor: launch<uint8_t, Bool<Bor>, false>(dst, src, n, 1.0f, s); return true;
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand: launch<uint8_t, Bool<Band>, false>(dst, src, n, 1.0f, s); return true;
    case ReduceOp::kBxor: launch<uint8_t, Bool<Bxor>, false>(dst, src, n, 1.0f, s); return true;
    default: return false;
  }
}

}  // namespace

int reduce(DataType dtype, ReduceOp op, void* dst, const void* src, size_t count, double postScale,
           Stream stream) {
  if (count == 0) return cudaSuccess;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  bool ok = false;
  switch (dtype) {
    case DataType::kFloat32: ok = arithmetic<float>(op, dst, src, count, postScale, s); break;
    case DataType::kFloat64: ok = arithmetic<double>(op, dst, src, count, postScale, s); break;
    case DataType::kFloat16: ok = arithmetic<__half>(op, dst, src, count, postScale, s); break;
    case DataType::kBFloat16: ok = arithmetic<__nv_bfloat16>(op, dst, src, count, postScale, s); break;
    case DataType::kInt8: ok = integral<int8_t>(op, dst, src, count, s); break;
    case DataType::kUInt8: ok = integral<uint8_t>(op, dst, src, count, s); break;
    case DataType::kInt32: ok = integral<int32_t>(op, dst, src, count, s); break;
    case DataType::kInt64: ok = integral<int64_t>(op, dst, src, count, s); break;
    case DataType::kBool: ok = boolean(op, dst, src, count, s); break;
    default: break;
  }
  return ok ? int(cudaGetLastError()) : int(cudaErrorInvalidValue);
}

}  // namespace collx::cuda
