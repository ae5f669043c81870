#include "cast.h"

#include <c10/util/Exception.h>

#include "core/error.h"
#include "core/reduce/reduce.h"
#include "tensor_checks.h"

#ifdef COLLX_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/kernels.h"
#endif

namespace collx::torch_glue {

void castScale(at::Tensor& dst, const at::Tensor& src, double factor) {
  const char* op = "cast_scale";
  TORCH_CHECK(dst.numel() == src.numel(),
              collx::str("collx cast_scale: dst has ", dst.numel(), " elements, src ", src.numel()));
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "collx cast_scale: tensors must be contiguous");
  TORCH_CHECK(dst.device() == src.device(), "collx cast_scale: tensors on ", dst.device(), " and ",
              src.device());
  const DataType dt = coreDtype(dst, op, -1), st = coreDtype(src, op, -1);
  if (dst.device().is_cpu()) {
    try {
      collx::castScale(dt, dst.data_ptr(), st, src.data_ptr(), size_t(src.numel()), factor);
    } catch (const Error& e) {
      TORCH_CHECK(false, e.what());
    }
    return;
  }
#ifdef COLLX_WITH_CUDA
  TORCH_CHECK(dst.device().is_cuda(), "collx cast_scale: unsupported device ", dst.device());
  c10::cuda::CUDAGuard guard(dst.device());
  auto stream = reinterpret_cast<cuda::Stream>(c10::cuda::getCurrentCUDAStream().stream());
  int err = cuda::castScale(dt, dst.data_ptr(), st, src.data_ptr(), size_t(src.numel()), factor, stream);
  TORCH_CHECK(err == 0, collx::str("collx cast_scale: CUDA launch failed with error ", err, " (",
                                    collx::name(st), " -> ", collx::name(dt), ")"));
#else
  TORCH_CHECK(false, "collx cast_scale: tensor on ", dst.device(), " but this build has no CUDA kernels");
#endif
}

void reduceInto(at::Tensor& dst, const at::Tensor& src, const std::string& opName, double postScale) {
  TORCH_CHECK(dst.numel() == src.numel() && dst.scalar_type() == src.scalar_type(),
              "collx reduce_into: dst and src must match in dtype and size");
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "collx reduce_into: tensors must be contiguous");
  TORCH_CHECK(dst.device() == src.device(), "collx reduce_into: tensors on ", dst.device(), " and ", src.device());
  static const std::pair<const char*, ReduceOp> kOps[] = {
      {"sum", ReduceOp::kSum}, {"product", ReduceOp::kProduct}, {"min", ReduceOp::kMin}, {"max", ReduceOp::kMax},
      {"band", ReduceOp::kBand}, {"bor", ReduceOp::kBor}, {"bxor", ReduceOp::kBxor}};
  const ReduceOp* op = nullptr;
  for (const auto& [n, o] : kOps) {
    if (opName == n) op = &o;
  }
  TORCH_CHECK(op, "collx reduce_into: unknown op '", opName, "'");
  const DataType dt = coreDtype(dst, "reduce_into", -1);
  const size_t n = size_t(dst.numel());
  if (dst.device().is_cpu()) {
    try {
      cpuReduceFn(dt, *op)(dst.data_ptr(), src.data_ptr(), n);
      if (postScale != 1.0) scaleInPlace(dt, dst.data_ptr(), n, postScale);
    } catch (const Error& e) {
      TORCH_CHECK(false, e.what());
    }
    return;
  }
#ifdef COLLX_WITH_CUDA
  c10::cuda::CUDAGuard guard(dst.device());
  auto stream = reinterpret_cast<cuda::Stream>(c10::cuda::getCurrentCUDAStream().stream());
  int err = cuda::reduce(dt, *op, dst.data_ptr(), src.data_ptr(), n, postScale, stream);
  TORCH_CHECK(err == 0, collx::str("collx reduce_into: CUDA error ", err, " (", collx::name(dt), " ", opName, ")"));
#else
  TORCH_CHECK(false, "collx reduce_into: tensor on ", dst.device(), " but this build has no CUDA kernels");
#endif
}

}  // namespace collx::torch_glue
