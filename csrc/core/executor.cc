#include "executor.h"

#include "error.h"

namespace collx {

namespace {
// The executor whose task this thread runs, if any.
thread_local const Executor* tRunning = nullptr;

// A job that throws is cancelled with its error: its owner hears of it, and
// the executor goes on (an exception leaving its thread would end the process).
void runTask(const Executor* owner, Executor::Job& job) {
  struct Mark {  // restored however run() ends
    const Executor* outer = tRunning;
    ~Mark() { tRunning = outer; }
  } mark;
  tRunning = owner;
  try {
    job.run();
  } catch (const std::exception& e) {
    job.cancel(e.what());
  } catch (...) {
    job.cancel("the task threw a non-standard exception");
  }
}

class FunctionJob final : public Executor::Job {
 public:
  explicit FunctionJob(Executor::Task task) : task_(std::move(task)) {}
  void run() override { task_.run(); }
  void cancel(const std::string& why) override { task_.cancel(why); }

 private:
  Executor::Task task_;
};
}  // namespace

bool Executor::inTask() const { return tRunning == this; }

Executor::Executor() : thread_([this] { loop(); }) {}

Executor::~Executor() {
  destroying_ = true;
  shutdown("the collx executor was destroyed");
}

uint64_t Executor::submit(Task task, bool wake) { return submit(std::make_unique<FunctionJob>(std::move(task)), wake); }

uint64_t Executor::submit(std::unique_ptr<Job> job, bool wake) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    COLLX_CHECK(!stopping_, "the process group was shut down; no more work is accepted");
    queue_.push_back(std::move(job));
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

std::unique_ptr<Executor::Job> Executor::take(uint64_t limit) {
  if (running_ || queue_.empty() || frontId_ > limit) return nullptr;
  std::unique_ptr<Job> job = std::move(queue_.front());
  queue_.pop_front();
  ++frontId_;
  running_ = true;
  return job;
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
    std::unique_ptr<Job> job;
    {
      std::lock_guard<std::mutex> lock(mu_);
      job = take(id);
    }
    if (!job) return;
    runTask(this, *job);
    finished();
  }
}

void Executor::shutdown(const std::string& why) {
  std::deque<std::unique_ptr<Job>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    dropped.swap(queue_);
    frontId_ = nextId_;
  }
  cv_.notify_all();
  // Cancel outside the lock: cancel callbacks complete futures.
  for (auto& job : dropped) job->cancel(why);
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
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return (stopping_ && !running_) || (!running_ && !queue_.empty()); });
      job = take(UINT64_MAX);
    }
    if (!job) return;  // stopping and drained
    runTask(this, *job);
    finished();
  }
}

}  // namespace collx
