#include "executor.h"

#include "error.h"

namespace collx {

Executor::Executor() : thread_([this] { loop(); }) {}

Executor::~Executor() { shutdown("the collx executor was destroyed"); }

void Executor::submit(Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    COLLX_CHECK(!stopping_, "collx: the process group was shut down; no more work is accepted");
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void Executor::shutdown(const std::string& why) {
  std::deque<Task> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    dropped.swap(queue_);
  }
  cv_.notify_one();
  // Cancel outside the lock: cancel callbacks complete futures.
  for (auto& t : dropped) t.cancel(why);
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void Executor::loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task.run();
  }
}

}  // namespace collx
