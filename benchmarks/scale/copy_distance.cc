// memcpy and collx's copyBytes (csrc/core/copy.h) by the distance from the
// source to the destination, modulo a page, and by size: GB/s of each, one
// thread, buffers in cache up to L2's size. Shows the distances where
// glibc's `rep movsb` crawls on this CPU, and what copyBytes does there.
//
//   build/core/copy_distance [--distances 0,4,16,32,48,64] [--sizes 1K,8K,64K,256K,1M,16M]
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../../csrc/core/copy.h"
#include "../../csrc/core/error.h"
#include "../../tests/cpp/check.h"

using namespace collx;

namespace {

std::vector<size_t> parseList(const std::string& s) {
  std::vector<size_t> out;
  for (size_t at = 0; at < s.size();) {
    size_t end = s.find(',', at);
    if (end == std::string::npos) end = s.size();
    std::string item = s.substr(at, end - at);
    size_t scale = 1;
    if (!item.empty() && (item.back() == 'K' || item.back() == 'M')) {
      scale = item.back() == 'K' ? 1 << 10 : 1 << 20;
      item.pop_back();
    }
    out.push_back(std::stoul(item) * scale);
    at = end + 1;
  }
  return out;
}

template <class Copy>
double gbPerSecond(Copy&& copy, char* dst, const char* src, size_t n) {
  const int reps = int(std::max<size_t>(4, (512u << 20) / n));
  copy(dst, src, n);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) {
    copy(dst, src, n);
    asm volatile("" ::: "memory");
  }
  return double(n) * reps / std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> distances = parseList("0,4,16,32,48,64"), sizes = parseList("1K,8K,64K,256K,1M,16M");
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--distances") distances = parseList(argv[i + 1]);
    else if (k == "--sizes") sizes = parseList(argv[i + 1]);
    else CHECK(false, "unknown argument ", k);
  }
  const size_t span = *std::max_element(sizes.begin(), sizes.end()) + 8192;
  auto map = [&] {
    void* p = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED, "mmap of ", span, " bytes failed");
    std::memset(p, 1, span);
    return static_cast<char*>(p);
  };
  char *const src = map() + 1024, *const dst = map() + 1024;
  std::printf("GB/s, memcpy / copyBytes, by destination - source (mod 4096) and size\n%9s", "distance");
  for (size_t n : sizes) std::printf("%16zu", n);
  std::printf("\n");
  for (size_t d : distances) {
    std::printf("%9zu", d);
    for (size_t n : sizes) {
      const double libc = gbPerSecond([](char* a, const char* b, size_t m) { std::memcpy(a, b, m); }, dst + d, src, n);
      const double ours = gbPerSecond([](char* a, const char* b, size_t m) { copyBytes(a, b, m); }, dst + d, src, n);
      std::printf("%9.1f /%5.1f", libc, ours);
    }
    std::printf("\n");
  }
}
