#include "work.h"

namespace collx::torch_glue {

CollxWork::CollxWork(c10d::OpType type, const char* profilingTitle, std::vector<at::Tensor> outputs, uint64_t seq,
                     std::vector<c10::Device> devices)
    : c10d::Work(-1, type, profilingTitle),
      outputs_(std::move(outputs)),
      devices_(std::move(devices)),
      seq_(seq) {
  if (!devices_.empty()) future_ = newFuture();
}

c10::intrusive_ptr<c10::ivalue::Future> CollxWork::newFuture() const {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(), devices_);
}

void CollxWork::settle(c10::ivalue::Future& future, const std::exception_ptr& error) {
  if (error) {
    future.setError(error);
  } else {
    future.markCompleted(c10::IValue(outputs_));
  }
}

c10::intrusive_ptr<c10::ivalue::Future> CollxWork::getFuture() {
  std::lock_guard<std::mutex> lock(futureMu_);
  if (!future_) {
    future_ = newFuture();
    if (done_) settle(*future_, error_);  // no callback can be on a Future nobody has seen
  }
  return future_;
}

void CollxWork::attach(std::shared_ptr<Executor> executor, uint64_t taskId) {
  executor_ = std::move(executor);
  taskId_ = taskId;
}

int CollxWork::sourceRank() const {
  TORCH_CHECK(source_, "collx: sourceRank() is only defined for a receive from any source");
  return source_->load();
}

bool CollxWork::wait(std::chrono::milliseconds timeout) {
  // Only an unbounded wait may run the op inline: one bounded by `timeout`
  // must return at that time (as gloo's does) while the op goes on.
  if (executor_ && timeout == ::kNoTimeout) {
    executor_->runUntil(taskId_);
  } else if (executor_) {
    executor_->kick();  // a synchronous op's task was queued without waking the thread
  }
  // A reply that comes within a loopback round trip or two is picked up here,
  // without the progress thread's wakeup and then this thread's.
  if (p2p_ && timeout == ::kNoTimeout) p2p_->spin([this] { return isCompleted(); }, std::chrono::microseconds(250));
  return c10d::Work::wait(timeout);
}

void CollxWork::complete(std::exception_ptr error, std::chrono::steady_clock::time_point end) {
  durationMs_ = std::chrono::duration<double, std::milli>(end - started_).count();
  // The Future first: once wait() returns, get_future() must be done too.
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(futureMu_);
    done_ = true;
    error_ = error;
    future = future_;
  }
  if (future) settle(*future, error);  // outside the lock: its callbacks may ask for the Future
  finish(error);  // takes and releases c10d::Work's own mutex
}

float CollxWork::getDuration() const {
  TORCH_CHECK(durationMs_ >= 0, "collx: getDuration can only be called after the work completed");
  return float(durationMs_.load());
}

}  // namespace collx::torch_glue
