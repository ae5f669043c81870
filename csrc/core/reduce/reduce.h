// Type-erased CPU reductions. Algorithms take a ReduceFn and never template
// on the element type, so they compile once.
#pragma once

#include <cstddef>
#include <functional>

#include "../types.h"

namespace collx {

// dst[i] = op(dst[i], src[i]) for i < count. dst and src do not overlap.
// A std::function so the glue can hand in a reduction that runs elsewhere
// (the CUDA staging path offloads large ones to the GPU).
using ReduceFn = std::function<void(void* dst, const void* src, size_t count)>;

// Throws Error for combinations that have no meaning (bitwise op on floats).
ReduceFn cpuReduceFn(DataType dtype, ReduceOp op);

// buf[i] *= factor, computed in float64 for float types (PREMUL_SUM).
// Throws Error for non-floating types.
void scaleInPlace(DataType dtype, void* buf, size_t count, double factor);

// buf[i] /= divisor (AVG after SUM). Floats divide exactly; integers use C
// truncating division, as NCCL does. Throws Error for bool.
void divideInPlace(DataType dtype, void* buf, size_t count, int64_t divisor);

}  // namespace collx

namespace collx {

// dst[i] = DstT(float(src[i]) * factor) between float32 and float16 /
// bfloat16, either way: the fused cast-and-scale of gradient compression.
// Throws Error for other pairs.
void castScale(DataType dstType, void* dst, DataType srcType, const void* src, size_t count,
               double factor);

}  // namespace collx
