// Small helpers shared by the op files of the Backend.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <type_traits>

#include "backend.h"
#include "core/algorithms/collective.h"
#include "core/copy.h"
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

// The glue moves bytes between tensors and flat buffers with copyBytes where
// a tensor is contiguous: a small op's time is mostly its calls, and each
// tensor op costs a dispatch (docs/measurements.md). Others go through a
// tensor over the flat bytes. Tensors here are CPU ones (staging mirrors
// device tensors first).
inline at::Tensor overBytes(void* bytes, const at::Tensor& like) {
  return at::from_blob(bytes, like.sizes(), like.options().device(at::kCPU));
}

// Returns run(p) for the memory p of `out`, through a contiguous copy where
// `out` is not contiguous.
template <typename Run>
std::string intoContiguous(const at::Tensor& out, Run&& run) {
  if (out.is_contiguous()) return run(out.data_ptr());
  at::Tensor dst = at::empty_like(out, at::MemoryFormat::Contiguous);
  std::string label = run(dst.data_ptr());
  out.copy_(dst);
  return label;
}

// Copies consecutive slices of `flat` into `outputs`, unless `flat` already
// is the storage of the single output.
inline void scatterBack(const void* flat, const std::vector<at::Tensor>& outputs) {
  if (outputs.size() == 1 && outputs[0].data_ptr() == flat && outputs[0].is_contiguous()) return;
  const char* from = static_cast<const char*>(flat);
  for (const auto& out : outputs) {
    if (out.is_contiguous()) {
      copyBytes(out.data_ptr(), from, out.nbytes());
    } else {
      out.copy_(overBytes(const_cast<char*>(from), out));
    }
    from += out.nbytes();
  }
}

// One flat contiguous copy of `tensors`, in order, in `ws` (inputs stay
// untouched), valid until the next use of `ws`. A private copy of a large
// tensor in fresh memory costs as much as the collective (page faults: 64 MB
// took ~20 ms); the workspace keeps its pages from op to op.
inline char* flatCopy(Workspace& ws, const std::vector<at::Tensor>& tensors) {
  size_t bytes = 0;
  for (const auto& t : tensors) bytes += t.nbytes();
  char* const flat = ws.get(std::max<size_t>(bytes, 1));
  char* to = flat;
  for (const auto& t : tensors) {
    if (t.is_contiguous()) {
      copyBytes(to, t.data_ptr(), t.nbytes());
    } else {
      overBytes(to, t).copy_(t);
    }
    to += t.nbytes();
  }
  return flat;
}

// The elements of `tensors` together.
inline size_t numelOf(const std::vector<at::Tensor>& tensors) {
  size_t n = 0;
  for (const auto& t : tensors) n += size_t(t.numel());
  return n;
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
  std::shared_ptr<Staging> st;
  if constexpr (std::is_same_v<Tensors, std::vector<at::Tensor>>) {
    st = stagingFor(tensors, name);  // no copy of the list
  } else {
    st = stagingFor(allOf(tensors), name);
  }
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
