#include "types.h"

namespace collx {

namespace {
struct TypeInfo {
  const char* name;
  size_t size;
  bool floating;
};
// Indexed by DataType.
constexpr TypeInfo kTypes[] = {
    {"float32", 4, true}, {"float64", 8, true}, {"float16", 2, true},
    {"bfloat16", 2, true}, {"int8", 1, false},  {"uint8", 1, false},
    {"int32", 4, false},  {"int64", 8, false},  {"bool", 1, false},
};
static_assert(sizeof(kTypes) / sizeof(kTypes[0]) == size_t(DataType::kCount));

constexpr const char* kOps[] = {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"};
static_assert(sizeof(kOps) / sizeof(kOps[0]) == size_t(ReduceOp::kCount));

constexpr const char* kKinds[] = {"all_reduce", "broadcast",      "all_gather", "barrier",
                                  "hello",      "reduce",         "reduce_scatter", "all_to_all",
                                  "gather",     "scatter",        "send/recv",
                                  "abort",      "cancel",         "send request", "send clear",
                                  "send data",  "send refusal",   "calibration"};
static_assert(sizeof(kKinds) / sizeof(kKinds[0]) == size_t(OpKind::kCount));

template <typename T>
bool valid(T v) { return size_t(v) < size_t(T::kCount); }
}  // namespace

size_t elementSize(DataType t) { return valid(t) ? kTypes[size_t(t)].size : 0; }
bool isFloating(DataType t) { return valid(t) && kTypes[size_t(t)].floating; }
const char* name(DataType t) { return valid(t) ? kTypes[size_t(t)].name : "invalid-dtype"; }
const char* name(ReduceOp op) { return valid(op) ? kOps[size_t(op)] : "invalid-op"; }
const char* name(OpKind k) { return valid(k) ? kKinds[size_t(k)] : "invalid-kind"; }

}  // namespace collx
