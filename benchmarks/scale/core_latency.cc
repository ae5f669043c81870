// A small all-reduce's time in the core alone, without torch: N ranks as
// threads of this process over shared memory (or --transport tcp), each
// running back-to-back all-reduces (or all-gathers or reduce-scatters: shm
// forces the shm form, any other --algorithm takes what allgather() or
// reduceScatter() picks) of --bytes with one algorithm; --read-peers 0 keeps
// the shm forms off the reads in place. It times what collx's own code and
// the waits for the peers cost per op, apart from torch's per-call floor
// (benchmarks/small_op.py times both).
//
//   build/core/core_latency [--ranks 2] [--bytes 4] [--algorithm shm|direct|ring|tree|star] [--ops 300000]
//       [--op all_reduce|all_gather|reduce_scatter] [--read-peers 1|0] [--transport shm|tcp] [--offset 0]
//       [--apart 0|1] [--dtype float32|bfloat16|float16] [--gap-us 0] [--touch-kib 0]
//
// --offset B moves rank r's buffers r * B bytes (modulo 1 KiB) further from their page
// (benchmarks/page_offsets.py does so under torch). --apart 1 gives an
// all-gather its input in a buffer of its own, as all_gather_into_tensor
// does (else it gathers in place, from its own block of the output).
//
// --gap-us U has each rank work U us between its ops, as a torch call does
// around collx's op, writing a line of its own --touch-kib KiB buffer in
// turn (a call's footprint in the caches), and prints the op's own time
// apart (the tight loop reads no clock around its ops).
//
// Prints ns per op, rank 0's, over the last three quarters of the ops.
#include <cstdio>
#include <string>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../tests/cpp/group.h"

using namespace collx;

int main(int argc, char** argv) {
  int ranks = 2, ops = 300000;
  size_t offset = 0;
  size_t bytes = 4;
  bool readPeers = true, apart = false;
  double gapUs = 0;
  size_t touchKiB = 0;
  DataType dtype = DataType::kFloat32;
  std::string algorithm = "shm", transport = "shm", op = "all_reduce";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--ranks") ranks = std::stoi(v);
    else if (k == "--bytes") bytes = std::stoul(v);
    else if (k == "--algorithm") algorithm = v;
    else if (k == "--transport") transport = v;
    else if (k == "--ops") ops = std::stoi(v);
    else if (k == "--op") op = v;
    else if (k == "--read-peers") readPeers = v != "0";
    else if (k == "--offset") offset = std::stoul(v);
    else if (k == "--apart") apart = v != "0";
    else if (k == "--gap-us") gapUs = std::stod(v);
    else if (k == "--touch-kib") touchKiB = std::stoul(v);
    else if (k == "--dtype") {
      CHECK(v == "float32" || v == "bfloat16" || v == "float16", "unknown dtype ", v);
      dtype = v == "bfloat16" ? DataType::kBFloat16 : v == "float16" ? DataType::kFloat16 : DataType::kFloat32;
    }
    else CHECK(false, "unknown argument ", k);
  }
  const Algorithm algo = parseAlgorithm(algorithm.c_str());
  const OpKind kind = op == "all_reduce"       ? OpKind::kAllreduce
                      : op == "all_gather"     ? OpKind::kAllgather
                      : op == "reduce_scatter" ? OpKind::kReduceScatter
                                               : OpKind::kCount;
  CHECK(kind != OpKind::kCount, "unknown op ", op);
  const size_t es = elementSize(dtype);
  const size_t count = std::max<size_t>(1, bytes / es);
  const size_t block = count / size_t(ranks);
  test::Group g(ranks, test::over(transport == "tcp" ? shm::Mode::kTcp : shm::Mode::kShm, readPeers));
  test::runRanks(ranks, [&](int r) {
    // 64 bytes past a page, where torch's allocator puts a large tensor: a
    // std::vector's 16 would put the copies at a crawling distance (copy.h).
    std::vector<float> bufMem(count + 2048, 1.0f), outMem(count + 2048);  // of any dtype: 1.0f is two bfloat16 values
    auto atPagePlus64 = [&](std::vector<float>& v) {
      const size_t past = (4096 - reinterpret_cast<uintptr_t>(v.data()) % 4096) % 4096 + 64 + size_t(r) * offset % 1024;
      return v.data() + past / sizeof(float);
    };
    float *const bufAt = atPagePlus64(bufMem), *const outAt = atPagePlus64(outMem);
    const auto blocks = blocksAt<void*>(bufAt, ranks, block * es);
    const auto inputs = blocksAt<const void*>(bufAt, ranks, block * es);
    Workspace ws;
    const ReduceFn fn = cpuReduceFn(dtype, ReduceOp::kSum);
    const Deadline deadline = Clock::now() + std::chrono::minutes(5);
    std::vector<char> touched(touchKiB * 1024);
    size_t line = 0;
    Clock::duration inOp{};
    Clock::time_point start = Clock::now();
    for (int i = 0; i < ops; ++i) {
      if (i == ops / 4) start = Clock::now(), inOp = {};
      if (gapUs > 0) {
        const auto until = Clock::now() + std::chrono::nanoseconds(int64_t(gapUs * 1e3));
        do {
          for (int k = 0; k < 16 && !touched.empty(); ++k, line = (line + 64) % touched.size()) ++touched[line];
        } while (Clock::now() < until);
      }
      const auto opStart = gapUs > 0 ? Clock::now() : Clock::time_point{};
      Collective c{*g.devices[size_t(r)], kind, dtype, uint64_t(i + 1), deadline, 1 << 16, 2, ws};
      if (kind == OpKind::kAllreduce) {
        allreduce(c, algo, bufAt, count, fn);
      } else if (kind == OpKind::kAllgather) {
        const void* in = apart ? outAt : blocks[size_t(r)];
        if (algo == Algorithm::kShm) shmAllgather(c, in, blocks, block);
        else allgather(c, in, blocks, block);
      } else if (algo == Algorithm::kShm) {
        shmReduceScatter(c, inputs, outAt, block, fn);
      } else {
        reduceScatter(c, bufAt, block, fn);
      }
      if (gapUs > 0) inOp += Clock::now() - opStart;
    }
    const double ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count() / (ops - ops / 4);
    const double opNs = std::chrono::duration<double, std::nano>(inOp).count() / (ops - ops / 4);
    if (r == 0) std::printf("%s, %d ranks over %s, %zu B: %.0f ns per op%s\n", algorithm.c_str(), ranks,
                            transport.c_str(), count * es, ns,
                            gapUs > 0 ? str(", ", int64_t(opNs), " in the op").c_str() : "");
  });
}
