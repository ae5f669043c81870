// Every dtype x op of the CPU reduce functions against a scalar reference,
// plus the errors for meaningless combinations.
#include <cmath>
#include <cstring>
#include <algorithm>
#include <random>
#include <vector>

#include "../../csrc/core/error.h"
#include "../../csrc/core/reduce/reduce.h"
#include "check.h"

using namespace collx;

namespace {

template <typename T>
void checkIntegral(DataType dt) {
  const size_t n = 1031;  // not a multiple of any vector width
  std::vector<T> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = T(i * 7 + 3);
    b[i] = T(i * 5 + 1);
  }
  struct Case { ReduceOp op; T (*ref)(T, T); };
  const Case cases[] = {
      {ReduceOp::kSum, [](T x, T y) { return T(x + y); }},
      {ReduceOp::kProduct, [](T x, T y) { return T(x * y); }},
      {ReduceOp::kMin, [](T x, T y) { return std::min(x, y); }},
      {ReduceOp::kMax, [](T x, T y) { return std::max(x, y); }},
      {ReduceOp::kBand, [](T x, T y) { return T(x & y); }},
      {ReduceOp::kBor, [](T x, T y) { return T(x | y); }},
      {ReduceOp::kBxor, [](T x, T y) { return T(x ^ y); }},
  };
  for (const Case& c : cases) {
    std::vector<T> d = a;
    cpuReduceFn(dt, c.op)(d.data(), b.data(), n);
    for (size_t i = 0; i < n; ++i) CHECK(d[i] == c.ref(a[i], b[i]), name(dt), " ", name(c.op), " i=", i);
  }
}

template <typename T>
void checkFloat(DataType dt) {
  const size_t n = 1031;
  std::vector<T> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = T(double(i % 13) - 6);
    b[i] = T(double(i % 7) - 3);
  }
  std::vector<T> d = a;
  cpuReduceFn(dt, ReduceOp::kSum)(d.data(), b.data(), n);
  for (size_t i = 0; i < n; ++i) CHECK(d[i] == a[i] + b[i], name(dt), " sum i=", i);
  d = a;
  cpuReduceFn(dt, ReduceOp::kMin)(d.data(), b.data(), n);
  for (size_t i = 0; i < n; ++i) CHECK(d[i] == std::min(a[i], b[i]), name(dt), " min");
  d = a;
  d[5] = T(NAN);
  cpuReduceFn(dt, ReduceOp::kMax)(d.data(), b.data(), n);
  CHECK(std::isnan(double(d[5])), "max propagates NaN");
  d = a;
  divideInPlace(dt, d.data(), n, 4);
  for (size_t i = 0; i < n; ++i) CHECK(d[i] == a[i] / T(4), name(dt), " divide");
  d = a;
  scaleInPlace(dt, d.data(), n, 0.5);
  for (size_t i = 0; i < n; ++i) CHECK(d[i] == a[i] * T(0.5), name(dt), " scale");
}

// 16-bit floats through their float32 value; inputs chosen exactly representable.
void checkHalf(DataType dt, uint16_t (*enc)(float), float (*dec)(uint16_t)) {
  const size_t n = 517;
  std::vector<uint16_t> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = enc(float(i % 17) - 8);
    b[i] = enc(float(i % 5) * 0.5f);
  }
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax}) {
    std::vector<uint16_t> d = a;
    cpuReduceFn(dt, op)(d.data(), b.data(), n);
    for (size_t i = 0; i < n; ++i) {
      float x = dec(a[i]), y = dec(b[i]);
      float want = op == ReduceOp::kSum ? x + y : op == ReduceOp::kProduct ? x * y
                 : op == ReduceOp::kMin ? std::min(x, y) : std::max(x, y);
      CHECK(dec(d[i]) == want, name(dt), " ", name(op), " i=", i, " got ", dec(d[i]), " want ", want);
    }
  }
}

uint16_t bf16Enc(float f) { uint32_t u; memcpy(&u, &f, 4); return uint16_t(u >> 16); }
float bf16Dec(uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; memcpy(&f, &u, 4); return f; }
uint16_t f16Enc(float f) { _Float16 h = _Float16(f); uint16_t u; memcpy(&u, &h, 2); return u; }
float f16Dec(uint16_t u) { _Float16 h; memcpy(&h, &u, 2); return float(h); }

// bfloat16 rounded to nearest even, NaN made quiet: what the kernels must give.
uint16_t bf16Round(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Every op over random bit patterns (NaN, infinities, subnormals, values
// that round to a tie) at lengths with every tail of the 8- and 16-wide
// kernels: each result is the op in float32, rounded once.
void checkHalfRounding(DataType dt, uint16_t (*round)(float), float (*dec)(uint16_t)) {
  std::mt19937 rng(7);
  for (size_t n : {1, 7, 8, 9, 15, 16, 17, 31, 1003}) {
    std::vector<uint16_t> a(n), b(n);
    for (size_t i = 0; i < n; ++i) a[i] = uint16_t(rng()), b[i] = uint16_t(rng());
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax}) {
      std::vector<uint16_t> d = a;
      cpuReduceFn(dt, op)(d.data(), b.data(), n);
      for (size_t i = 0; i < n; ++i) {
        const float x = dec(a[i]), y = dec(b[i]);
        const float want = op == ReduceOp::kSum       ? x + y
                           : op == ReduceOp::kProduct ? x * y
                           : op == ReduceOp::kMin     ? ((x != x || x < y) ? x : y)
                                                      : ((x != x || x > y) ? x : y);
        const bool same = std::isnan(want) ? std::isnan(dec(d[i])) && (dt != DataType::kBFloat16 || d[i] == round(want))
                                           : d[i] == round(want);
        CHECK(same, name(dt), " ", name(op), " n=", n, " i=", i, ": ", a[i], ", ", b[i], " gave ", d[i], " not ",
              round(want));
      }
    }
  }
}

// Whether x and y hold the same `n` values of dt: the same bits, or for
// floats both a NaN. Of two NaN operands x86 passes on the first one's
// payload, and which is first depends on how the compiler ordered each
// loop's operands; nothing relies on a NaN's payload.
bool sameValues(DataType dt, const std::vector<uint8_t>& x, const std::vector<uint8_t>& y, size_t n) {
  if (x == y) return true;
  if (!isFloating(dt) || x.size() != y.size()) return false;
  const size_t es = elementSize(dt);
  auto isNan = [&](const uint8_t* p) {
    uint64_t u = 0;
    memcpy(&u, p, es);
    switch (dt) {
      case DataType::kFloat64: return (u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
      case DataType::kFloat32: return (u & 0x7fffffffu) > 0x7f800000u;
      case DataType::kBFloat16: return (u & 0x7fffu) > 0x7f80u;
      default: return (u & 0x7fffu) > 0x7c00u;  // float16
    }
  };
  for (size_t i = 0; i < n; ++i) {
    const uint8_t *a = x.data() + i * es, *b = y.data() + i * es;
    if (memcmp(a, b, es) != 0 && !(isNan(a) && isNan(b))) return false;
  }
  return true;
}

// fused() in each of its forms (in place with a copy, apart, apart with a
// copy), by cpuReduceFn's kernel and by the copies around a plain fn, gives
// the values of the plain fn, and leaves the operands apart from out as they were. `large`
// adds a length beyond any core's L2 cache, where the kernels store twice.
void checkFused(DataType dt, ReduceOp op, bool large) {
  const size_t es = elementSize(dt);
  std::mt19937 rng(11);
  const ReduceFn kernel = cpuReduceFn(dt, op);
  const ReduceFn plain = [kernel](void* dst, const void* src, size_t count) { kernel(dst, src, count); };
  std::vector<size_t> lengths = {1, 7, 16, 17, 255, 257, 1003};
  if (large) lengths.push_back((size_t(8) << 20) / es + 3);
  for (size_t n : lengths) {
    std::vector<uint8_t> a(n * es), b(n * es);
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] = uint8_t(dt == DataType::kBool ? rng() % 2 : rng());
      b[i] = uint8_t(dt == DataType::kBool ? rng() % 2 : rng());
    }
    const std::vector<uint8_t> a0 = a, b0 = b;
    std::vector<uint8_t> want = a;
    kernel(want.data(), b.data(), n);
    for (const ReduceFn* fn : {&kernel, &plain}) {
      const char* how = fn == &kernel ? "kernel" : "plain";
      std::vector<uint8_t> out = a, copy(a.size());
      fn->fused(out.data(), out.data(), b.data(), copy.data(), n, es);
      CHECK(sameValues(dt, out, want, n) && sameValues(dt, copy, want, n), name(dt), " ", name(op), " n=", n, " ", how,
            ": in place with a copy");
      std::fill(out.begin(), out.end(), 0);
      fn->fused(out.data(), a.data(), b.data(), nullptr, n, es);
      CHECK(sameValues(dt, out, want, n), name(dt), " ", name(op), " n=", n, " ", how, ": apart");
      std::fill(out.begin(), out.end(), 0);
      std::fill(copy.begin(), copy.end(), 0);
      fn->fused(out.data(), a.data(), b.data(), copy.data(), n, es);
      CHECK(sameValues(dt, out, want, n) && sameValues(dt, copy, want, n), name(dt), " ", name(op), " n=", n, " ", how,
            ": apart with a copy");
    }
    CHECK(a == a0 && b == b0, name(dt), " ", name(op), " n=", n, ": an operand changed");
  }
}

bool throws(const std::function<void()>& fn) {
  try { fn(); } catch (const Error&) { return true; }
  return false;
}

}  // namespace

int main() {
  checkIntegral<int8_t>(DataType::kInt8);
  checkIntegral<uint8_t>(DataType::kUInt8);
  checkIntegral<int32_t>(DataType::kInt32);
  checkIntegral<int64_t>(DataType::kInt64);
  checkFloat<float>(DataType::kFloat32);
  checkFloat<double>(DataType::kFloat64);
  checkHalf(DataType::kBFloat16, bf16Enc, bf16Dec);
  checkHalf(DataType::kFloat16, f16Enc, f16Dec);
  checkHalfRounding(DataType::kBFloat16, bf16Round, bf16Dec);
  checkHalfRounding(DataType::kFloat16, f16Enc, f16Dec);
  for (DataType dt : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16, DataType::kInt8,
                      DataType::kUInt8, DataType::kInt32, DataType::kInt64, DataType::kBool}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kBand,
                        ReduceOp::kBor, ReduceOp::kBxor}) {
      if (!isFloating(dt) || op == ReduceOp::kSum || op == ReduceOp::kProduct || op == ReduceOp::kMin ||
          op == ReduceOp::kMax) {
        checkFused(dt, op, op == ReduceOp::kSum);
      }
    }
  }

  // bool: SUM/MAX are OR, PRODUCT/MIN are AND, results stay 0/1.
  uint8_t x[4] = {0, 0, 1, 1}, y[4] = {0, 1, 0, 1};
  uint8_t d[4];
  memcpy(d, x, 4);
  cpuReduceFn(DataType::kBool, ReduceOp::kSum)(d, y, 4);
  CHECK(d[0] == 0 && d[1] == 1 && d[2] == 1 && d[3] == 1, "bool sum");
  memcpy(d, x, 4);
  cpuReduceFn(DataType::kBool, ReduceOp::kProduct)(d, y, 4);
  CHECK(d[0] == 0 && d[1] == 0 && d[2] == 0 && d[3] == 1, "bool product");

  // Cast-and-scale float32 <-> 16-bit: exact for these values.
  for (DataType half : {DataType::kFloat16, DataType::kBFloat16}) {
    std::vector<float> in(1003), back(1003);
    std::vector<uint16_t> packed(1003);
    for (size_t i = 0; i < in.size(); ++i) in[i] = float(i % 64) - 32.0f;
    castScale(half, packed.data(), DataType::kFloat32, in.data(), in.size(), 0.25);
    castScale(DataType::kFloat32, back.data(), half, packed.data(), in.size(), 8.0);
    for (size_t i = 0; i < in.size(); ++i) CHECK(back[i] == in[i] * 2.0f, name(half), " cast i=", i);
  }
  CHECK(throws([] { int32_t a = 0; float b = 0; castScale(DataType::kInt32, &a, DataType::kFloat32, &b, 1, 1.0); }),
        "cast to int32");

  CHECK(throws([] { cpuReduceFn(DataType::kFloat32, ReduceOp::kBand); }), "bitwise on float");
  CHECK(throws([] { cpuReduceFn(DataType::kBFloat16, ReduceOp::kBxor); }), "bitwise on bf16");
  CHECK(throws([] { int v = 0; scaleInPlace(DataType::kInt32, &v, 1, 2.0); }), "premul on int");
  CHECK(throws([] { uint8_t v = 0; divideInPlace(DataType::kBool, &v, 1, 2); }), "avg on bool");
  std::printf("reduce: all dtypes and ops ok\n");
  return 0;
}
