// Element-wise kernels exposed on tensors: the fused cast-and-scale between
// float32 and float16/bfloat16, and reduce, on the CPU or (in a CUDA build)
// on the current CUDA stream.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace collx::torch_glue {

// dst = dst.dtype(src * factor), element-wise, without a temporary.
void castScale(at::Tensor& dst, const at::Tensor& src, double factor);

// dst = op(dst, src) element-wise with collx's own kernels (CPU, or CUDA on
// the current stream); postScale != 1 multiplies after (floats only). For
// tests and the kernel benchmark.
void reduceInto(at::Tensor& dst, const at::Tensor& src, const std::string& op, double postScale);

}  // namespace collx::torch_glue
