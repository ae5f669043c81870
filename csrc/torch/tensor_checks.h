// Mapping of torch dtypes and c10d reduce ops onto the core, and the checks
// every collective runs on its tensors before queueing anything. Errors are
// DistBackendError naming the op, the rank and the reason.
#pragma once

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "core/error.h"
#include "core/reduce/reduce.h"
#include "core/types.h"
#include "staging.h"

namespace collx::torch_glue {

[[noreturn]] inline void fail(const char* op, int rank, const std::string& why) {
  C10_THROW_ERROR(DistBackendError, collx::str("collx ", op, " on rank ", rank, ": ", why));
}

inline DataType coreDtype(const at::Tensor& t, const char* op, int rank) {
  switch (t.scalar_type()) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kBool: return DataType::kBool;
    default: fail(op, rank, collx::str("unsupported dtype ", t.scalar_type()));
  }
}

// Checks layout and device; returns the core dtype.
inline DataType checkTensor(const at::Tensor& t, const char* op, int rank) {
  if (!t.defined()) fail(op, rank, "got an undefined tensor");
  if (t.is_sparse()) fail(op, rank, "sparse tensors are not supported");
  if (!t.device().is_cpu()) {  // CUDA tensors reach the ops as host mirrors (staging.h)
    fail(op, rank, collx::str("tensor is on ", t.device(), "; collx supports CPU and CUDA tensors"));
  }
  return coreDtype(t, op, rank);
}

inline void checkSingle(const std::vector<at::Tensor>& ts, const char* op, int rank) {
  if (ts.size() != 1) {
    fail(op, rank, collx::str("expects exactly one tensor per process, got ", ts.size()));
  }
}

// A c10d::ReduceOp resolved for the core: the reduce function, plus the
// pre-scale (PREMUL_SUM) and post-divide (AVG) it implies.
struct ResolvedOp {
  ReduceFn fn;
  ReduceOp op = ReduceOp::kSum;  // fn's op (SUM for AVG and PREMUL_SUM)
  double premulFactor = 1.0;
  bool premul = false;
  bool average = false;
};

// `intoTensor`: see Staging::reduceFn (false for an op that writes its buffer
// before reducing into it).
inline ResolvedOp resolveOp(const c10d::ReduceOp& op, DataType dtype, const char* name, int rank,
                            bool intoTensor = true) {
  ResolvedOp r{};
  ReduceOp core = ReduceOp::kSum;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: core = ReduceOp::kSum; break;
    case c10d::ReduceOp::AVG:
      if (dtype == DataType::kBool) fail(name, rank, "AVG is not defined for bool tensors");
      r.average = true;
      break;
    case c10d::ReduceOp::PRODUCT: core = ReduceOp::kProduct; break;
    case c10d::ReduceOp::MIN: core = ReduceOp::kMin; break;
    case c10d::ReduceOp::MAX: core = ReduceOp::kMax; break;
    case c10d::ReduceOp::BAND: core = ReduceOp::kBand; break;
    case c10d::ReduceOp::BOR: core = ReduceOp::kBor; break;
    case c10d::ReduceOp::BXOR: core = ReduceOp::kBxor; break;
    case c10d::ReduceOp::PREMUL_SUM: {
      if (!isFloating(dtype)) fail(name, rank, collx::str("PREMUL_SUM needs a floating dtype, got ", collx::name(dtype)));
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      if (!sup) fail(name, rank, "PREMUL_SUM without a factor");
      r.premul = true;
      r.premulFactor = sup->tensor_factor.defined() ? sup->tensor_factor.item<double>() : sup->double_factor;
      break;
    }
    default: fail(name, rank, collx::str("unsupported reduce op ", int(op.op_)));
  }
  if (isFloating(dtype) && (core == ReduceOp::kBand || core == ReduceOp::kBor || core == ReduceOp::kBxor)) {
    fail(name, rank, collx::str("bitwise reduce op ", collx::name(core), " needs an integer or bool tensor, got ",
                         collx::name(dtype)));
  }
  r.op = core;
  // Under a device staging, large reductions run on the device; the
  // pre-scale writes the buffer before them (staging.h).
  r.fn = Staging::current() ? Staging::current()->reduceFn(dtype, core, intoTensor && !r.premul)
                            : cpuReduceFn(dtype, core);
  return r;
}

}  // namespace collx::torch_glue
