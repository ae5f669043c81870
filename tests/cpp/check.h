// A minimal assertion helper for the core tests: no framework to install.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed: %s\n", __FILE__, __LINE__, \
                   #cond, ::collx::str(__VA_ARGS__).c_str());               \
      std::abort();                                                            \
    }                                                                          \
  } while (0)

namespace collx::test {

// Runs fn(rank) on `size` threads and joins them; an exception fails the test.
inline void runRanks(int size, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d threw: %s\n", r, e.what());
        std::abort();
      }
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace collx::test
