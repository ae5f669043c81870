// One thread that runs a group's collectives in issue order. Torch-free, so
// the ordering and shutdown rules are tested by the core tests.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace collx {

class Executor {
 public:
  struct Task {
    std::function<void()> run;
    std::function<void(const std::string& why)> cancel;  // never ran
  };

  Executor();
  ~Executor();  // shutdown("executor destroyed")

  // Throws Error after shutdown.
  void submit(Task task);

  // Stops taking tasks, cancels those not started with `why`, waits for the
  // running one to return (the caller makes sure it can), joins the thread.
  void shutdown(const std::string& why);

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace collx
