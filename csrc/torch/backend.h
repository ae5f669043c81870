// The c10d::Backend of collx. Thin on purpose: it validates tensors, maps
// dtypes and reduce ops onto the core, and queues each collective on the
// group's Executor; the core does the communication.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>

#include "core/algorithms/algorithms.h"
#include "core/executor.h"
#include "core/transport/tcp/device.h"

namespace collx::torch_glue {

struct Config {
  Algorithm algorithm = Algorithm::kAuto;
  int treeArity = 2;
  size_t segmentBytes = 512 << 10;
  std::string ifname;
};

struct OpStats {
  uint64_t calls = 0;
  double seconds = 0;
};

struct Stats {
  uint64_t ops = 0;
  uint64_t bytesSent = 0;
  uint64_t bytesReceived = 0;
  std::map<std::string, OpStats> perAlgorithm;  // "all_reduce/ring", "broadcast/tree", ...
};

class CollxBackend : public c10d::Backend {
 public:
  CollxBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
               std::chrono::milliseconds timeout, Config config);
  ~CollxBackend() override;

  const std::string getBackendName() const override { return "collx"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }
  void setSequenceNumberForGroup() override {}  // sequence numbers start at 0 on every rank

  void shutdown() override;

  // all_reduce with the algorithm chosen per call (the DDP comm hook's
  // entry); `algorithm` kAuto defers to the cost model.
  c10::intrusive_ptr<c10d::Work> allreduceWith(at::Tensor& tensor, const c10d::ReduceOp& op,
                                               Algorithm algorithm);

  Stats stats() const;
  const Config& config() const { return config_; }

 private:
  // Runs on the executor thread; returns the stats label of what ran.
  using Body = std::function<std::string(const Collective&)>;

  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, OpKind kind, DataType dtype,
                                         std::vector<at::Tensor> outputs,
                                         std::chrono::milliseconds timeout, Body body);
  c10::intrusive_ptr<c10d::Work> allreduceFlat(c10d::OpType type, at::Tensor flat,
                                               std::vector<at::Tensor> outputs,
                                               const c10d::ReduceOp& op, Algorithm algorithm,
                                               std::chrono::milliseconds timeout);

  const Config config_;
  const std::chrono::milliseconds timeout_;
  std::unique_ptr<tcp::Device> device_;
  std::atomic<uint64_t> seq_{0};
  Workspace workspace_;  // used by the one op running at a time
  mutable std::mutex statsMutex_;
  Stats stats_;
  // Shared with the Works, which may run their op inline (see Executor).
  std::shared_ptr<Executor> executor_ = std::make_shared<Executor>();
};

}  // namespace collx::torch_glue
