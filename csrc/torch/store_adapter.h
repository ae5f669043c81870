// collx::Store over the c10d::Store torch gives each group (a PrefixStore).
// It counts the requests it makes: the Store (rank 0's TCPStore under
// torchrun) serves every rank of every group, so its traffic is a cost of
// creating a group.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "core/store.h"

namespace collx::torch_glue {

class StoreAdapter : public Store {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    ++requests_;
    store_->set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    requests_ += 2;  // a wait, then the get
    store_->wait({key}, timeout);
    return store_->get(key);
  }
  std::vector<std::vector<uint8_t>> getMany(const std::vector<std::string>& keys,
                                            std::chrono::milliseconds timeout) override {
    requests_ += 2;  // one wait for all, one multiGet (a loop of gets where the Store has none)
    store_->wait(keys, timeout);
    return store_->multiGet(keys);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    ++requests_;
    return store_->add(key, delta);
  }
  uint64_t requests() const { return requests_; }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  uint64_t requests_ = 0;
};

}  // namespace collx::torch_glue
