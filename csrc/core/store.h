// The key-value store the mesh rendezvous runs over. The glue adapts
// c10d::Store to it; the C++ tests use an in-memory one.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace collx {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until the key exists or the timeout passes (then throws).
  virtual std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // get() of every key, where a Store can in fewer requests.
  virtual std::vector<std::vector<uint8_t>> getMany(const std::vector<std::string>& keys,
                                                    std::chrono::milliseconds timeout) {
    std::vector<std::vector<uint8_t>> values;
    for (const auto& k : keys) values.push_back(get(k, timeout));
    return values;
  }
  // The key's value if it exists now, without waiting for it.
  virtual std::optional<std::vector<uint8_t>> tryGet(const std::string& key) = 0;
  // Atomically adds to a counter and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

}  // namespace collx
