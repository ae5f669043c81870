// Fused cast-and-scale between float32 and float16/bfloat16 tensors, on the
// CPU or (in a CUDA build) on the current CUDA stream.
#pragma once

#include <ATen/core/Tensor.h>

namespace collx::torch_glue {

// dst = dst.dtype(src * factor), element-wise, without a temporary.
void castScale(at::Tensor& dst, const at::Tensor& src, double factor);

}  // namespace collx::torch_glue
