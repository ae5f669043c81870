// Scale and fused cast-and-scale kernels (PREMUL_SUM, DDP compression).
// Grid-stride loops; the compiler widens the loads of these streaming loops.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels.h"

namespace collx::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

int blocksFor(size_t n) {
  size_t b = (n + kThreads - 1) / kThreads;
  return int(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

__device__ __forceinline__ float toF(float v) { return v; }
__device__ __forceinline__ float toF(__half v) { return __half2float(v); }
__device__ __forceinline__ float toF(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T fromF(float v);
template <> __device__ __forceinline__ float fromF<float>(float v) { return v; }
template <> __device__ __forceinline__ __half fromF<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 fromF<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename D, typename S>
__global__ void castScaleKernel(D* __restrict__ dst, const S* __restrict__ src, size_t n, float f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = fromF<D>(toF(src[i]) * f);
  }
}

__global__ void scaleDouble(double* buf, size_t n, double f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    buf[i] *= f;
  }
}

template <typename D, typename S>
void launchCast(void* dst, const void* src, size_t n, double f, cudaStream_t s) {
  castScaleKernel<D, S><<<blocksFor(n), kThreads, 0, s>>>(static_cast<D*>(dst), static_cast<const S*>(src), n, float(f));
}

}  // namespace

int scale(DataType dtype, void* buf, size_t count, double factor, Stream stream) {
  if (count == 0) return cudaSuccess;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DataType::kFloat32: launchCast<float, float>(buf, buf, count, factor, s); break;
    case DataType::kFloat16: launchCast<__half, __half>(buf, buf, count, factor, s); break;
    case DataType::kBFloat16: launchCast<__nv_bfloat16, __nv_bfloat16>(buf, buf, count, factor, s); break;
    case DataType::kFloat64:
      scaleDouble<<<blocksFor(count), kThreads, 0, s>>>(static_cast<double*>(buf), count, factor);
      break;
    default: return int(cudaErrorInvalidValue);
  }
  return int(cudaGetLastError());
}

int castScale(DataType dstType, void* dst, DataType srcType, const void* src, size_t count, double factor,
              Stream stream) {
  if (count == 0) return cudaSuccess;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (srcType == DataType::kFloat32 && dstType == DataType::kFloat16) launchCast<__half, float>(dst, src, count, factor, s);
  else if (srcType == DataType::kFloat32 && dstType == DataType::kBFloat16) launchCast<__nv_bfloat16, float>(dst, src, count, factor, s);
  else if (srcType == DataType::kFloat16 && dstType == DataType::kFloat32) launchCast<float, __half>(dst, src, count, factor, s);
  else if (srcType == DataType::kBFloat16 && dstType == DataType::kFloat32) launchCast<float, __nv_bfloat16>(dst, src, count, factor, s);
  else return int(cudaErrorInvalidValue);
  return int(cudaGetLastError());
}

}  // namespace collx::cuda
