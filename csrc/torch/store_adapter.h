// collx::Store over the c10d::Store torch gives each group (a PrefixStore).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "core/store.h"

namespace collx::torch_glue {

class StoreAdapter : public Store {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    store_->set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    store_->wait({key}, timeout);
    return store_->get(key);
  }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace collx::torch_glue
