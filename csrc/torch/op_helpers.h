// Small helpers shared by the op files of the Backend.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <exception>

#include "backend.h"
#include "core/algorithms/collective.h"
#include "tensor_checks.h"

namespace collx::torch_glue {

inline std::exception_ptr distError(const std::string& msg) {
  try {
    C10_THROW_ERROR(DistBackendError, msg);
  } catch (...) {
    return std::current_exception();
  }
}

// Runs fn, turning core errors raised in the caller thread into DistBackendError.
template <typename Fn>
auto asDistError(const char* op, int rank, Fn&& fn) {
  try {
    return fn();
  } catch (const Error& e) {
    fail(op, rank, e.what());
  }
}

inline std::chrono::milliseconds opTimeout(std::chrono::milliseconds opt, std::chrono::milliseconds group) {
  return opt.count() > 0 ? opt : group;  // kUnsetTimeout (-1 ms) means the group's
}

// Contiguous tensors run in place; others through a contiguous copy.
inline at::Tensor contiguousOf(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// Copies consecutive slices of `flat` into `outputs`, unless `flat` already
// is the storage of the single output.
inline void scatterBack(const at::Tensor& flat, const std::vector<at::Tensor>& outputs) {
  if (outputs.size() == 1 && outputs[0].data_ptr() == flat.data_ptr() && outputs[0].is_contiguous()) return;
  int64_t offset = 0;
  for (const auto& out : outputs) {
    out.copy_(flat.narrow(0, offset, out.numel()).view(out.sizes()));
    offset += out.numel();
  }
}

// A flat tensor of `numel` elements over `ws`'s memory, valid until the next
// use of `ws`. A private copy of a large tensor in fresh memory costs as much
// as the collective (page faults: 64 MB took ~20 ms); the workspace keeps its
// pages from op to op.
inline at::Tensor scratchTensor(Workspace& ws, int64_t numel, const at::TensorOptions& options) {
  const size_t bytes = size_t(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  return at::from_blob(ws.get(std::max<size_t>(bytes, 1)), {numel}, options.device(at::kCPU));
}

// One flat contiguous copy of `tensors`, in order, in `ws` (inputs stay untouched).
inline at::Tensor flatCopy(Workspace& ws, const std::vector<at::Tensor>& tensors) {
  int64_t numel = 0;
  for (const auto& t : tensors) numel += t.numel();
  at::Tensor flat = scratchTensor(ws, numel, tensors[0].options());
  int64_t offset = 0;
  for (const auto& t : tensors) {
    flat.narrow(0, offset, t.numel()).copy_(t.reshape(-1));
    offset += t.numel();
  }
  return flat;
}

// Every tensor of `ts` matches `like` in dtype and element count.
inline void checkSameShape(const std::vector<at::Tensor>& ts, const at::Tensor& like, const char* op, int rank,
                           const char* what) {
  for (const auto& t : ts) {
    checkTensor(t, op, rank);
    if (t.numel() != like.numel() || t.scalar_type() != like.scalar_type()) {
      fail(op, rank, collx::str("every ", what, " must match ", like.numel(), " x ", like.scalar_type(),
                                ", got ", t.numel(), " x ", t.scalar_type()));
    }
  }
}

// Every tensor of the lists, in one vector (to check their devices at once).
inline void appendAll(std::vector<at::Tensor>& out, const at::Tensor& t) { out.push_back(t); }
inline void appendAll(std::vector<at::Tensor>& out, const std::vector<at::Tensor>& ts) {
  out.insert(out.end(), ts.begin(), ts.end());
}
inline void appendAll(std::vector<at::Tensor>& out, const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& ts : lists) appendAll(out, ts);
}
template <typename... Lists>
std::vector<at::Tensor> allOf(const Lists&... lists) {
  std::vector<at::Tensor> out;
  (appendAll(out, lists), ...);
  return out;
}

template <typename Tensors, typename Op>
WorkPtr CollxBackend::onMirror(const char* name, Tensors& tensors, bool copyIn, bool copyOut, Op&& op) {
  std::shared_ptr<Staging> st = stagingFor(allOf(tensors), name);
  if (!st) return nullptr;
  auto host = st->mirror(tensors, copyIn, copyOut);
  return runStaged(st, [&] { return op(host); });
}

template <typename Outs, typename Ins, typename Op>
WorkPtr CollxBackend::onMirrors(const char* name, Outs& outputs, Ins& inputs, Op&& op) {
  std::shared_ptr<Staging> st = stagingFor(allOf(outputs, inputs), name);
  if (!st) return nullptr;
  auto hostOut = st->mirror(outputs, /*copyIn=*/false, /*copyOut=*/true);
  auto hostIn = st->mirror(inputs, /*copyIn=*/true, /*copyOut=*/false);
  return runStaged(st, [&] { return op(hostOut, hostIn); });
}

// "op/direct" or "op/tree": which shape a one-way tree collective took.
std::string treeLabel(const char* op, const Collective& c, size_t bytes);

}  // namespace collx::torch_glue
