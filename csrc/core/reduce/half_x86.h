// Fused reductions of 16-bit floats for x86-64 with AVX2 and F16C: a
// vector at a time (16 bfloat16, 8 float16), each element widened to
// float32, reduced, and rounded back (to nearest even), with no trip
// through a float buffer. The results are
// those of reduce_cpu.cc's scalar path, bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../types.h"

namespace collx::half_x86 {

// Whether this CPU runs them (checked once).
bool available();

// out[i] = op(a[i], b[i]) for op SUM, PRODUCT, MIN or MAX, over the whole
// vectors of the first n elements; returns how many it did (0 for other
// ops), and stores each result in copy[i] too where copy is not null. out
// is a, or apart from it; nothing else overlaps.
size_t reduceBf16(uint16_t* out, const uint16_t* a, const uint16_t* b, uint16_t* copy, size_t n, ReduceOp op);
size_t reduceF16(uint16_t* out, const uint16_t* a, const uint16_t* b, uint16_t* copy, size_t n, ReduceOp op);

}  // namespace collx::half_x86
