// collx::Store over the c10d::Store torch gives each group (a PrefixStore).
// It counts the requests it makes: the Store (rank 0's TCPStore under
// torchrun) serves every rank of every group, so its traffic is a cost of
// creating a group.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <thread>

#include "core/error.h"
#include "core/store.h"

namespace collx::torch_glue {

// What a background setup stopped by closeMesh fails with.
inline Error setupInterrupted() { return Error("the group was shut down or aborted while it connected"); }

class StoreAdapter : public Store {
 public:
  // A wait polls (check(), a request each, at most kPoll apart): a c10d
  // wait cannot be interrupted, and one cut into slices (the wait for the
  // table is, rendezvous.cc) logs a warning at each slice. With
  // `interrupted`, it throws Error once that is set: a group shut down while
  // it connects in the background stops at once.
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> store, const std::atomic<bool>* interrupted = nullptr)
      : store_(std::move(store)), interrupted_(interrupted) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    ++requests_;
    store_->set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    wait({key}, timeout);
    ++requests_;
    return store_->get(key);
  }
  std::vector<std::vector<uint8_t>> getMany(const std::vector<std::string>& keys,
                                            std::chrono::milliseconds timeout) override {
    wait(keys, timeout);
    ++requests_;  // one multiGet (a loop of gets where the Store has none)
    return store_->multiGet(keys);
  }
  std::optional<std::vector<uint8_t>> tryGet(const std::string& key) override {
    requests_ += 2;
    if (!store_->check({key})) return std::nullopt;
    return store_->get(key);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    ++requests_;
    return store_->add(key, delta);
  }
  uint64_t requests() const { return requests_; }

 private:
  static constexpr std::chrono::milliseconds kPoll{50};

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
    ++requests_;
    const auto end = std::chrono::steady_clock::now() + timeout;
    for (std::chrono::milliseconds pause(1);; pause = std::min(2 * pause, kPoll)) {
      if (interrupted_ && interrupted_->load()) throw setupInterrupted();
      if (store_->check(keys)) return;
      const auto now = std::chrono::steady_clock::now();
      if (now >= end) {
        throw TimeoutError(str("timed out after ", timeout.count(), " ms waiting in the Store for ", keys.front(),
                               keys.size() > 1 ? str(" and ", keys.size() - 1, " more keys") : std::string(),
                               " (a rank of the group never created it?)"));
      }
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, end - now));
      ++requests_;
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  const std::atomic<bool>* interrupted_;
  std::atomic<uint64_t> requests_{0};
};

}  // namespace collx::torch_glue
