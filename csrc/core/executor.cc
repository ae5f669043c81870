#include "executor.h"

#include "error.h"

namespace collx {

namespace {
// The executor whose task this thread runs, if any.
thread_local const Executor* tRunning = nullptr;

void runTask(const Executor* owner, std::function<void()>& run) {
  struct Mark {  // restored however run() ends
    const Executor* outer = tRunning;
    ~Mark() { tRunning = outer; }
  } mark;
  tRunning = owner;
  run();
}
}  // namespace

bool Executor::inTask() const { return tRunning == this; }

Executor::Executor() : thread_([this] { loop(); }) {}

Executor::~Executor() {
  destroying_ = true;
  shutdown("the collx executor was destroyed");
}

uint64_t Executor::submit(Task task, bool wake) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    COLLX_CHECK(!stopping_, "the process group was shut down; no more work is accepted");
    queue_.push_back(std::move(task));
    id = nextId_++;
  }
  if (wake) cv_.notify_all();
  return id;
}

void Executor::kick() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.empty()) return;
  }
  cv_.notify_all();
}

bool Executor::take(std::unique_lock<std::mutex>&, uint64_t limit, Task& task) {
  if (running_ || queue_.empty() || frontId_ > limit) return false;
  task = std::move(queue_.front());
  queue_.pop_front();
  ++frontId_;
  running_ = true;
  return true;
}

void Executor::finished() {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    // Only a queued task or a shutdown waits for this one to end; waking an
    // idle thread for nothing costs a synchronous op a few microseconds.
    wake = !queue_.empty() || stopping_;
  }
  if (wake) cv_.notify_all();
}

void Executor::runUntil(uint64_t id) {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!take(lock, id, task)) return;
    }
    runTask(this, task.run);
    finished();
  }
}

void Executor::shutdown(const std::string& why) {
  std::deque<Task> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    dropped.swap(queue_);
    frontId_ = nextId_;
  }
  cv_.notify_all();
  // Cancel outside the lock: cancel callbacks complete futures.
  for (auto& t : dropped) t.cancel(why);
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    if (destroying_) thread_.detach();  // the last owner let go from inside a task
    return;  // else the thread ends after this task, and the destructor joins it
  }
  if (inTask() && !destroying_) return;  // a task run inline by this thread: the same
  thread_.join();
}

void Executor::loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return (stopping_ && !running_) || (!running_ && !queue_.empty()); });
      if (!take(lock, UINT64_MAX, task)) return;  // stopping and drained
    }
    runTask(this, task.run);
    finished();
  }
}

}  // namespace collx
