// CUDA reduce and cast kernels, callable without torch or CUDA headers:
// raw device pointers, element counts and a cudaStream_t. Each returns the
// launch's cudaError_t as an int (0 = success).
#pragma once

#include <cstddef>

#include "core/types.h"

struct CUstream_st;

namespace collx::cuda {

using Stream = CUstream_st*;

// dst[i] = op(dst[i], src[i]), then (floats only) dst[i] *= postScale when
// postScale != 1: AVG is SUM with postScale = 1/n, fused into the last step.
int reduce(DataType dtype, ReduceOp op, void* dst, const void* src, size_t count, double postScale,
           Stream stream);

// buf[i] *= factor for floating dtypes (PREMUL_SUM, gradient pre-scaling).
int scale(DataType dtype, void* buf, size_t count, double factor, Stream stream);

// dst[i] = DstT(float(src[i]) * factor) between float32 and float16/bfloat16
// (either direction): the fused cast-and-scale of the DDP compression hook.
int castScale(DataType dstType, void* dst, DataType srcType, const void* src, size_t count,
              double factor, Stream stream);

}  // namespace collx::cuda
