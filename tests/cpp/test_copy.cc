// Byte copies (copy.h): copyBytes and moveBytes give memcpy's and memmove's
// bytes at every page distance and size around the crawl's bounds, and
// streamBytes memcpy's around kStreamMinBytes; the shared-memory
// collectives give the right values where every rank's buffer lies at its
// own page offset, which takes the vector copies and the bounced reads in
// place, and an all-gather whose own block is large enough to stream.
#include <chrono>
#include <cstring>
#include <vector>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/copy.h"
#include "../../csrc/core/reduce/reduce.h"
#include "check.h"
#include "group.h"

using namespace collx;

namespace {

// A buffer of `bytes` at page offset `offset`.
struct AtOffset {
  AtOffset(size_t bytes, size_t offset) : mem(bytes + 8192) {
    const size_t toPage = (4096 - reinterpret_cast<uintptr_t>(mem.data()) % 4096) % 4096;
    at = mem.data() + toPage + offset;
  }
  std::vector<char> mem;
  char* at;
};

void testCopiesMatchLibc() {
  const size_t sizes[] = {0, 1, 31, 33, 2047, 2048, 2049, 4096 + 17, 70001};
  std::vector<char> src(80000 + 8192), want(80000 + 8192), got(80000 + 8192);
  for (size_t i = 0; i < src.size(); ++i) src[i] = char(i * 7 + (i >> 9));
  for (size_t n : sizes) {
    for (size_t so = 0; so < 80; so += 3) {
      for (size_t d = 0; d < 4096 + 80; d += d < 80 ? 1 : 4016) {
        std::fill(want.begin(), want.end(), char(0x5a));
        std::fill(got.begin(), got.end(), char(0x5a));
        std::memcpy(want.data() + d, src.data() + so, n);
        copyBytes(got.data() + d, src.data() + so, n);
        CHECK(want == got, "copyBytes of ", n, " bytes from offset ", so, " to ", d);
      }
    }
  }
  // moveBytes within one buffer, overlapping either way and apart.
  for (size_t n : sizes) {
    for (long shift : {-4100L, -16L, -1L, 1L, 4L, 16L, 40L, 4112L}) {
      std::vector<char> a(src.begin(), src.begin() + 80000 + 8192), b = a;
      const size_t from = 4200, to = size_t(long(from) + shift);
      std::memmove(a.data() + to, a.data() + from, n);
      moveBytes(b.data() + to, b.data() + from, n);
      CHECK(a == b, "moveBytes of ", n, " bytes shifted by ", shift);
    }
  }
}

void testStreamMatchesLibc() {
  const size_t big = kStreamMinBytes + 4096;
  std::vector<char> src(big + 256), want(big + 256), got(big + 256);
  for (size_t i = 0; i < src.size(); ++i) src[i] = char(i * 13 + (i >> 11));
  for (size_t n : {size_t(70001), kStreamMinBytes - 1, kStreamMinBytes, kStreamMinBytes + 33}) {
    for (size_t so : {size_t(0), size_t(5)}) {
      for (size_t d : {size_t(0), size_t(1), size_t(17), size_t(32), size_t(45)}) {
        std::fill(want.begin(), want.end(), char(0x5a));
        std::fill(got.begin(), got.end(), char(0x5a));
        std::memcpy(want.data() + d, src.data() + so, n);
        streamBytes(got.data() + d, src.data() + so, n);
        CHECK(want == got, "streamBytes of ", n, " bytes from offset ", so, " to ", d);
      }
    }
  }
  // A piece of a streamed copy may be shorter than the stores' alignment.
  for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(31), size_t(33), size_t(129), size_t(4004)}) {
    for (size_t d : {size_t(0), size_t(1), size_t(17), size_t(45)}) {
      std::fill(want.begin(), want.end(), char(0x5a));
      std::fill(got.begin(), got.end(), char(0x5a));
      std::memcpy(want.data() + d, src.data() + 5, n);
      streamBytes(got.data() + d, src.data() + 5, n, kStreamMinBytes);
      CHECK(want == got, "streamBytes of a ", n, "-byte piece to ", d);
    }
  }
}

// An all-gather from inputs apart from the output, whose own block is
// streamed into place: every element, and the inputs left as they were.
void testAllgatherStreamsOwnBlock(bool readPeers) {
  const int n = 2;
  const size_t block = kStreamMinBytes / sizeof(int32_t) + 1001;
  test::Group g(n, test::over(shm::Mode::kShm, readPeers));
  test::runRanks(n, [&](int r) {
    Workspace ws;
    AtOffset out(n * block * sizeof(int32_t), 64), in(block * sizeof(int32_t), 64 + size_t(r) * 20);
    auto* got = reinterpret_cast<int32_t*>(out.at);
    auto* mine = reinterpret_cast<int32_t*>(in.at);
    for (size_t i = 0; i < block; ++i) mine[i] = int32_t(i % 1013) + 7 * r;
    Collective c{*g.devices[size_t(r)], OpKind::kAllgather, DataType::kInt32, 1, Clock::now() + std::chrono::seconds(30),
                 1 << 16, 2, ws};
    shmAllgather(c, mine, blocksAt<void*>(got, n, block * sizeof(int32_t)), block);
    for (size_t i = 0; i < n * block; ++i) {
      CHECK(got[i] == int32_t(i % block % 1013) + 7 * int32_t(i / block), "all_gather rank ", r, " element ", i);
    }
    for (size_t i = 0; i < block; ++i) CHECK(mine[i] == int32_t(i % 1013) + 7 * r, "input rank ", r, " element ", i);
  });
}

// Every rank's buffers at offset r * `step` in their pages: the peers'
// tensors, the windows and the receive side lie 1-63 bytes apart for
// steps of 4 to 16. Runs all-reduces (through the windows and read in
// place), all-gathers and reduce-scatters, and checks every element.
void testCollectivesAtOddOffsets(bool readPeers, size_t step) {
  const int n = 3;
  test::Group g(n, test::over(shm::Mode::kShm, readPeers));
  test::runRanks(n, [&](int r) {
    Workspace ws;
    const ReduceFn sum = cpuReduceFn(DataType::kInt32, ReduceOp::kSum);
    uint64_t seq = 0;
    for (size_t block : {size_t(700), size_t(20011), size_t(400000), size_t(1500000)}) {
      AtOffset mem(n * block * sizeof(int32_t), size_t(r) * step), out(block * sizeof(int32_t), size_t(r) * step);
      auto* buf = reinterpret_cast<int32_t*>(mem.at);
      auto* mine = reinterpret_cast<int32_t*>(out.at);
      const size_t count = n * block;
      const OpKind kinds[] = {OpKind::kAllreduce, OpKind::kAllgather, OpKind::kReduceScatter};
      for (OpKind kind : kinds) {
        ++seq;
        for (size_t i = 0; i < count; ++i) buf[i] = int32_t(i % 1009) * (r + 1);
        Collective c{*g.devices[size_t(r)], kind, DataType::kInt32, seq, Clock::now() + std::chrono::seconds(30),
                     1 << 16, 2, ws};
        const auto blocks = blocksAt<void*>(buf, n, block * sizeof(int32_t));
        if (kind == OpKind::kAllreduce) {
          shmAllreduce(c, buf, count, sum);
        } else if (kind == OpKind::kAllgather) {
          shmAllgather(c, blocks[size_t(r)], blocks, block);
        } else {
          shmReduceScatter(c, blocksAt<const void*>(buf, n, block * sizeof(int32_t)), mine, block, sum);
        }
        const int32_t total = n * (n + 1) / 2;
        for (size_t i = 0; i < count; ++i) {
          const int32_t v = int32_t(i % 1009);
          if (kind == OpKind::kAllreduce) {
            CHECK(buf[i] == v * total, "all_reduce of ", count, " rank ", r, " element ", i);
          } else if (kind == OpKind::kAllgather) {
            CHECK(buf[i] == v * int32_t(i / block + 1), "all_gather of ", block, " rank ", r, " element ", i);
          } else if (i / block == size_t(r)) {
            CHECK(mine[i % block] == v * total, "reduce_scatter of ", block, " rank ", r, " element ", i);
          }
        }
      }
    }
  });
}

}  // namespace

int main() {
  testCopiesMatchLibc();
  testStreamMatchesLibc();
  for (bool readPeers : {true, false}) testAllgatherStreamsOwnBlock(readPeers);
  for (bool readPeers : {true, false}) {
    for (size_t step : {size_t(4), size_t(16), size_t(64)}) testCollectivesAtOddOffsets(readPeers, step);
  }
  std::printf("test_copy: ok\n");
}
