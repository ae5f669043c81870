// The promise of algorithms.h that the device path builds on: until an
// algorithm's last fn(dst, ...) into some bytes of buf, it writes those bytes
// only through fn. A checking fn keeps a shadow of buf, updated only by fn,
// and fails when dst differs from its shadow: some other write (a receive, a
// copy, a scale) came first. Flat all-reduces and reduce at its root, over
// world sizes, counts (ring reduce from 1 MiB), segments and arities.
#include <cstring>

#include "../../csrc/core/algorithms/algorithms.h"
#include "check.h"
#include "group.h"

using namespace collx;

namespace {

using test::Group;

// fn for buf: checks dst against the shadow, reduces, updates the shadow.
struct CheckedSum {
  const char* base;
  size_t bytes;
  std::vector<char> shadow;
  std::string what;

  CheckedSum(const void* buf, size_t n, std::string w)
      : base(static_cast<const char*>(buf)), bytes(n * sizeof(float)), shadow(base, base + bytes), what(std::move(w)) {}

  ReduceFn fn() {
    return [this](void* dst, const void* src, size_t count) {
      const char* d = static_cast<const char*>(dst);
      const size_t n = count * sizeof(float);
      const bool inBuf = d >= base && d + n <= base + bytes;
      if (inBuf) {
        CHECK(std::memcmp(d, shadow.data() + (d - base), n) == 0, what, ": bytes [", d - base, ", ", d - base + n,
              ") of buf were written by something other than fn before this reduction into them");
      }
      cpuReduceFn(DataType::kFloat32, ReduceOp::kSum)(dst, src, count);
      if (inBuf) std::memcpy(shadow.data() + (d - base), d, n);
    };
  }
};

float valueOf(int r, size_t i) { return float((r * 5 + i * 7) % 13) - 6.0f; }

void testAllreduce(int n) {
  Group g(n);
  uint64_t seq = 0;
  for (Algorithm algo : {Algorithm::kRing, Algorithm::kTree, Algorithm::kStar, Algorithm::kDirect}) {
    for (size_t count : {size_t(1), size_t(7), size_t(1000), size_t(100003), size_t(300001)}) {
      for (size_t seg : {size_t(4096), size_t(512 << 10)}) {
        for (int arity : {2, 3}) {
          ++seq;
          test::runRanks(n, [&](int r) {
            thread_local Workspace ws;
            std::vector<float> buf(count);
            for (size_t i = 0; i < count; ++i) buf[i] = valueOf(r, i);
            CheckedSum check(buf.data(), count,
                             str(name(algo), " n=", n, " count=", count, " seg=", seg, " arity=", arity, " rank=", r));
            Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kFloat32, seq,
                         Clock::now() + std::chrono::seconds(60), seg, arity, ws};
            allreduce(c, algo, buf.data(), count, check.fn());
            for (size_t i = 0; i < count; i += 997) {
              float want = 0;
              for (int q = 0; q < n; ++q) want += valueOf(q, i);
              CHECK(buf[i] == want, check.what, " i=", i, " got ", buf[i], " want ", want);
            }
          });
        }
      }
    }
  }
}

// Only the root's buffer is the op's output (other ranks reduce into copies).
void testReduceAtRoot(int n) {
  Group g(n);
  uint64_t seq = 0;
  for (size_t count : {size_t(7), size_t(100003), size_t(300001)}) {
    for (int root = 0; root < n; ++root) {
      ++seq;
      test::runRanks(n, [&](int r) {
        thread_local Workspace ws;
        std::vector<float> buf(count);
        for (size_t i = 0; i < count; ++i) buf[i] = valueOf(r, i);
        CheckedSum check(buf.data(), count, str("reduce n=", n, " count=", count, " root=", root, " rank=", r));
        Collective c{*g.devices[r], OpKind::kReduce, DataType::kFloat32, seq, Clock::now() + std::chrono::seconds(60),
                     512 << 10, 2, ws};
        reduce(c, buf.data(), count, root,
               r == root ? check.fn() : cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
        if (r != root) return;
        for (size_t i = 0; i < count; i += 997) {
          float want = 0;
          for (int q = 0; q < n; ++q) want += valueOf(q, i);
          CHECK(buf[i] == want, check.what, " i=", i, " got ", buf[i], " want ", want);
        }
      });
    }
  }
}

}  // namespace

int main() {
  for (int n : {2, 3, 4, 5}) {
    testAllreduce(n);
    testReduceAtRoot(n);
    std::printf("reduce writes: n=%d ok\n", n);
  }
  return 0;
}
