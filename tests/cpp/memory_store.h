// An in-memory Store shared by the threads of one C++ test.
#pragma once

#include <condition_variable>
#include <map>
#include <mutex>

#include "../../csrc/core/error.h"
#include "../../csrc/core/store.h"

namespace collx::test {

class MemoryStore : public Store {
 public:
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    data_[key] = value;
    cv_.notify_all();
  }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return data_.count(key) > 0; })) {
      throw TimeoutError("memory store: timed out waiting for " + key);
    }
    return data_[key];
  }
  std::optional<std::vector<uint8_t>> tryGet(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = data_.find(key);
    if (it == data_.end()) return std::nullopt;
    return it->second;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto& v = data_[key];
    int64_t cur = v.empty() ? 0 : std::stoll(std::string(v.begin(), v.end()));
    std::string s = std::to_string(cur + delta);
    v.assign(s.begin(), s.end());
    cv_.notify_all();
    return cur + delta;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<uint8_t>> data_;
};

}  // namespace collx::test
