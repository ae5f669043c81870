// Type-erased CPU reductions. Algorithms take a ReduceFn and never template
// on the element type, so they compile once.
#pragma once

#include <cstddef>
#include <functional>
#include <type_traits>

#include "../types.h"

namespace collx {

// A reduction: fn(dst, src, count) sets dst[i] = op(dst[i], src[i]) for
// i < count; dst and src do not overlap. It holds a std::function so that the
// glue can hand in one that runs elsewhere (the CUDA staging path offloads
// large ones to the GPU). cpuReduceFn's also have a kernel over three
// operands (fused()), which saves the shared-memory collectives a pass over
// the data: the copy of a reduce-scatter's own block or of a small
// all-reduce's first operand, and for bfloat16 the copy of an all-reduce's
// sums into the window.
class ReduceFn {
 public:
  using Fn = std::function<void(void* dst, const void* src, size_t count)>;
  // out[i] = op(a[i], b[i]), and copy[i] = out[i] where copy is not null.
  using Kernel = void (*)(void* out, const void* a, const void* b, void* copy, size_t count);

  ReduceFn() = default;
  ReduceFn(std::nullptr_t) {}
  template <class F, class = std::enable_if_t<std::is_invocable_v<F&, void*, const void*, size_t> &&
                                              !std::is_same_v<std::decay_t<F>, ReduceFn>>>
  ReduceFn(F fn) : fn_(std::move(fn)) {}
  explicit ReduceFn(Kernel kernel);

  void operator()(void* dst, const void* src, size_t count) const { fn_(dst, src, count); }
  explicit operator bool() const { return bool(fn_); }

  // out = op(a, b), then copy = out where copy is not null, for `count`
  // elements of `elementSize` bytes. out is a, or apart from it; nothing
  // else overlaps. In one pass where this reduction has a kernel, else by
  // copies around fn.
  void fused(void* out, const void* a, const void* b, void* copy, size_t count, size_t elementSize) const;

 private:
  Fn fn_;
  Kernel kernel_ = nullptr;
};

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
