// Runs a group's collectives one at a time, in issue order. A background
// thread runs them so that async ops overlap the caller; a caller about to
// block on an op may instead run it (and whatever is queued before it) in its
// own thread when the background thread is idle. That saves two thread
// wakeups per synchronous op, which is most of a small all-reduce's latency.
// Torch-free, so the ordering and shutdown rules are tested by the core tests.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace collx {

class Executor {
 public:
  // A unit of work: run() once, or cancel(why) if it never runs or run()
  // throws. The queue owns it, and destroys it after either.
  class Job {
   public:
    virtual ~Job() = default;
    virtual void run() = 0;
    virtual void cancel(const std::string& why) = 0;
  };
  // A job of two functions, for callers without a type of their own.
  struct Task {
    std::function<void()> run;
    std::function<void(const std::string& why)> cancel;  // for a task that never ran
  };

  Executor();
  ~Executor();  // shutdown("the collx executor was destroyed")

  // Queues a task and returns its id (ids increase from 1). Throws Error
  // after shutdown. `wake`: false when the caller is about to runUntil(id)
  // (a synchronous op), so that the background thread is not woken for a
  // task this thread takes anyway; a later submit, kick or runUntil starts it.
  uint64_t submit(std::unique_ptr<Job> job, bool wake = true);
  uint64_t submit(Task task, bool wake = true);

  // Wakes the background thread for whatever is queued (a caller that will
  // not run its task inline after all, e.g. a wait with a timeout).
  void kick();

  // Runs queued tasks in the calling thread, up to and including task `id`,
  // while no other thread is running one. Returns once `id` has started
  // somewhere (here or on the executor thread) or another thread is busy.
  void runUntil(uint64_t id);

  // Stops taking tasks, cancels those not started with `why`, waits for the
  // running one to return (the caller makes sure it can), joins the thread.
  // Called from inside a task (a hook or a Future callback), it does not
  // wait for that task: the thread ends after it, and the destructor joins.
  void shutdown(const std::string& why);
  // Whether the calling thread is running one of this executor's tasks.
  bool inTask() const;

 private:
  void loop();
  // Pops the next task if it may start now (id <= limit, nobody running).
  std::unique_ptr<Job> take(uint64_t limit);  // under mu_
  void finished();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Job>> queue_;
  uint64_t nextId_ = 1;     // id the next submitted task gets
  uint64_t frontId_ = 1;    // id of queue_.front()
  bool running_ = false;    // a task is running, in any thread
  bool stopping_ = false;
  bool destroying_ = false;  // in the destructor: the thread must end or be detached
  std::thread thread_;
};

}  // namespace collx
