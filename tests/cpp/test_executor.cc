// Executor: tasks run once each, in submission order, whether they run on
// its thread or inline through runUntil; shutdown cancels what never ran,
// and so does a task that throws.
#include <atomic>
#include <chrono>
#include <string>

#include "../../csrc/core/error.h"
#include "../../csrc/core/executor.h"
#include "check.h"

using namespace collx;

int main() {
  // Order and exactly-once under a mix of background and inline execution.
  for (int round = 0; round < 50; ++round) {
    Executor ex;
    std::vector<int> order;
    std::mutex mu;
    std::vector<uint64_t> ids;
    for (int i = 0; i < 200; ++i) {
      ids.push_back(ex.submit({[&, i] {
                                 std::lock_guard<std::mutex> lock(mu);
                                 order.push_back(i);
                               },
                               [](const std::string&) {}}));
      if (i % 7 == 0) ex.runUntil(ids.back());
    }
    // runUntil returns early while the executor thread is busy; wait for the rest.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (;;) {
      ex.runUntil(ids.back());
      std::lock_guard<std::mutex> lock(mu);
      if (order.size() == 200 || std::chrono::steady_clock::now() > deadline) break;
    }
    ex.shutdown("done");
    CHECK(order.size() == 200, "every task ran once: ", order.size());
    for (int i = 0; i < 200; ++i) CHECK(order[i] == i, "in order at ", i);
  }

  // Ids increase from 1; runUntil returns at once for a task already started.
  {
    Executor ex;
    std::atomic<int> ran{0};
    uint64_t a = ex.submit({[&] { ++ran; }, [](const std::string&) {}});
    uint64_t b = ex.submit({[&] { ++ran; }, [](const std::string&) {}});
    CHECK(a == 1 && b == 2, "ids ", a, " ", b);
    ex.runUntil(b);
    ex.runUntil(b);
    ex.shutdown("done");
    CHECK(ran == 2, "ran ", ran.load());
  }

  // Shutdown cancels queued tasks with the reason, and refuses new ones.
  {
    Executor ex;
    std::atomic<bool> release{false};
    std::atomic<int> cancelled{0};
    std::string why;
    ex.submit({[&] { while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1)); },
               [](const std::string&) {}});
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the blocker start
    for (int i = 0; i < 5; ++i) {
      ex.submit({[] { CHECK(false, "a cancelled task must not run"); },
                 [&](const std::string& w) { ++cancelled; why = w; }});
    }
    std::thread stopper([&] { ex.shutdown("group destroyed"); });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    release = true;
    stopper.join();
    CHECK(cancelled == 5, "cancelled ", cancelled.load());
    CHECK(why == "group destroyed", why);
    bool refused = false;
    try {
      ex.submit({[] {}, [](const std::string&) {}});
    } catch (const Error&) {
      refused = true;
    }
    CHECK(refused, "submit after shutdown throws");
  }
  // A task queued without waking the thread (a synchronous op's) runs when
  // its caller runs it inline, when kicked, or when a later task wakes the
  // thread: it is never left behind, and order holds.
  {
    Executor ex;
    std::vector<int> order;
    std::mutex mu;
    auto task = [&](int i) {
      return Executor::Task{[&, i] {
                              std::lock_guard<std::mutex> lock(mu);
                              order.push_back(i);
                            },
                            [](const std::string&) {}};
    };
    auto ran = [&](size_t n) {
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (std::chrono::steady_clock::now() < deadline) {
        {
          std::lock_guard<std::mutex> lock(mu);
          if (order.size() >= n) return true;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return false;
    };
    ex.runUntil(ex.submit(task(0), /*wake=*/false));
    CHECK(ran(1), "the caller ran its task inline");
    ex.submit(task(1), false);
    ex.kick();
    CHECK(ran(2), "a kick starts a deferred task");
    ex.submit(task(2), false);
    ex.submit(task(3));
    CHECK(ran(4), "a later task takes the deferred one with it");
    ex.shutdown("done");
    for (int i = 0; i < 4; ++i) CHECK(order[size_t(i)] == i, "in order at ", i);
  }
  // A task that throws, on the executor's thread or inline, is cancelled
  // with its error, and the tasks after it still run.
  {
    Executor ex;
    std::mutex mu;
    std::vector<std::string> cancelled;
    std::atomic<int> ran{0};
    auto throwing = [&] {
      return Executor::Task{[] { throw Error("setup failed"); },
                            [&](const std::string& why) {
                              std::lock_guard<std::mutex> lock(mu);
                              cancelled.push_back(why);
                            }};
    };
    ex.submit(throwing());
    ex.runUntil(ex.submit(throwing(), /*wake=*/false));
    const uint64_t last = ex.submit({[&] { ++ran; }, [](const std::string&) {}}, false);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (ran == 0 && std::chrono::steady_clock::now() < deadline) ex.runUntil(last);
    ex.shutdown("done");
    CHECK(ran == 1, "the task after two throwing ones ran: ", ran.load());
    CHECK(cancelled.size() == 2, "both throwing tasks were cancelled: ", cancelled.size());
    for (const auto& why : cancelled) CHECK(why == "setup failed", why);
  }
  std::printf("executor: order, inline runs, deferred wakes, throwing tasks and shutdown ok\n");
  return 0;
}
