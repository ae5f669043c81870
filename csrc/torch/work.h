// The Work handed back for every collective. c10d::Work already holds the
// completion state (mutex, cv, exception) and implements wait(); this adds the
// Future DDP needs, completed outside every lock of ours, because .then()
// callbacks run on the completing thread and take the GIL. A CPU op's Future
// is made on the first getFuture() (most synchronous callers never ask for
// one), completed at once where the op already has; a device op's is made
// with the Work, so that its completion records events on the streams of the
// thread that completes the op.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>

#include "core/executor.h"
#include "core/transport/p2p.h"

namespace collx::torch_glue {

class CollxWork : public c10d::Work {
 public:
  // `devices`: the CUDA devices of the outputs, so the Future completes
  // stream-correctly for its callbacks (empty for CPU tensors).
  CollxWork(c10d::OpType type, const char* profilingTitle, std::vector<at::Tensor> outputs, uint64_t seq,
            std::vector<c10::Device> devices = {});

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override { return seq_; }
  // For a receive from any source: the rank it came from, once done.
  int sourceRank() const override;
  void setSourceSlot(std::shared_ptr<std::atomic<int>> slot) { source_ = std::move(slot); }

  // A caller about to block without a timeout runs the op itself when the
  // group is idle.
  bool wait(std::chrono::milliseconds timeout) override;

  // Which executor task this is, for wait() to run it inline.
  void attach(std::shared_ptr<Executor> executor, uint64_t taskId);
  // A p2p op: wait() drives the channel itself for a moment before it blocks.
  void spinOn(std::shared_ptr<PointToPoint> p2p) { p2p_ = std::move(p2p); }

  // The op starts running now (by default it started when the Work was made).
  void markStarted(std::chrono::steady_clock::time_point at) { started_ = at; }
  // Completes the Future, then marks the work done (or failed); `end`: when
  // the op ended, for getDuration().
  void complete(std::exception_ptr error,
                std::chrono::steady_clock::time_point end = std::chrono::steady_clock::now());
  // Milliseconds from the op's start to its completion (or failure), as
  // NCCL's with timing on; only once it completed.
  float getDuration() const override;

 private:
  c10::intrusive_ptr<c10::ivalue::Future> newFuture() const;
  void settle(c10::ivalue::Future& future, const std::exception_ptr& error);

  std::shared_ptr<Executor> executor_;
  uint64_t taskId_ = 0;
  std::shared_ptr<PointToPoint> p2p_;
  std::shared_ptr<std::atomic<int>> source_;
  std::vector<at::Tensor> outputs_;
  const std::vector<c10::Device> devices_;
  std::mutex futureMu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // under futureMu_
  bool done_ = false;                                // complete() ran, with error_; under futureMu_
  std::exception_ptr error_;
  uint64_t seq_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::atomic<double> durationMs_{-1};
};

}  // namespace collx::torch_glue
