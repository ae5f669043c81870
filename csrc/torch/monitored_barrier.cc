// monitored_barrier, as gloo runs it, over the p2p channel (its own tag
// space), so that a rank that never arrives fails the barrier but not the
// group:
//
//   rank r > 0                          rank 0
//   ----------                          ------
//   post recv(0); send(0)  ---------->  post recv(r) for every r; wait until
//                                       all arrived or the timeout
//   wait for rank 0's verdict <-------  send every arrived rank the verdict
//                                       (0: pass; 1: some rank failed);
//                                       raise naming the missing ranks
//
// The wording is gloo's ("Rank 1 failed to pass monitoredBarrier in 2000
// ms", "Rank 2 successfully reached monitoredBarrier, but received errors
// ..."), which log scrapers and torch's tests look for; collx's detail
// follows it. Rank 0 tells the arrived ranks at once, where gloo leaves them
// to their own timeout. A late arrival is left for the next barrier, as in
// gloo.
#include <condition_variable>

#include "backend.h"
#include "op_helpers.h"

namespace collx::torch_glue {

namespace {

// Posted p2p ops waited for together: each one's error text ("" if it passed).
class Waiter {
 public:
  explicit Waiter(PointToPoint& p2p) : p2p_(p2p) {}
  ~Waiter() { wait(); }  // the buffers live on this stack

  size_t add() {
    std::lock_guard<std::mutex> lock(mu_);
    errors_.emplace_back();
    ++pending_;
    return errors_.size() - 1;
  }
  P2PDone done(size_t i) {
    return [this, i](int, std::exception_ptr e) {
      std::string what;
      if (e) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& ex) {
          what = ex.what();
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      errors_[i] = e ? (what.empty() ? "failed" : what) : "";
      --pending_;
      cv_.notify_all();
    };
  }
  // Every op's deadline bounds this wait.
  void wait() {
    p2p_.spin([this] { return settled(); }, std::chrono::microseconds(250));
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return pending_ == 0; });
  }
  const std::string& error(size_t i) const { return errors_[i]; }

 private:
  bool settled() {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_ == 0;
  }
  PointToPoint& p2p_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> errors_;
  size_t pending_ = 0;
};

std::string joined(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += collx::str(s.empty() ? "" : ", ", r);
  return s;
}

}  // namespace

void CollxBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  // 0 is a timeout here (gloo's test passes it), only kUnsetTimeout (-1) is
  // unset. Python passes torch's default (30 min) for timeout=None: after
  // dist.set_timeout, that default means the group's timeout.
  const bool byDefault = opts.timeout.count() < 0 || (timeoutSet_ && opts.timeout == kBackendDefaultTimeout);
  const auto limit = byDefault ? timeout() : opts.timeout;
  const Deadline deadline = Clock::now() + limit;
  const uint64_t tag = kMonitoredBarrierTags;
  PointToPoint& p2p = device().p2p();
  uint8_t arrival = 0;
  if (rank_ != 0) {
    uint8_t verdict = 0xff;
    Waiter w(p2p);
    const size_t recv = w.add(), send = w.add();
    p2p.postRecv(0, tag, {&verdict, 1, DataType::kUInt8}, deadline, w.done(recv));
    p2p.postSend(0, tag, {&arrival, 1, DataType::kUInt8}, deadline, w.done(send));
    w.wait();
    std::string why = !w.error(send).empty() ? w.error(send) : w.error(recv);
    if (why.empty() && verdict != 0) why = "rank 0 reports that some rank failed to pass monitoredBarrier";
    if (why.empty()) return;
    fail("monitored_barrier", rank_,
         collx::str("Rank ", rank_, " successfully reached monitoredBarrier, but received errors while waiting for "
                    "send/recv from rank 0. Please check rank 0 logs for faulty rank. (", why, ")"));
  }
  std::vector<uint8_t> arrivals(size_t(size_), 0);
  std::vector<int> missing, arrived;
  std::string detail;
  bool timedOut = false;
  {
    Waiter w(p2p);
    for (int r = 1; r < size_; ++r) {
      p2p.postRecv(r, tag, {&arrivals[size_t(r)], 1, DataType::kUInt8}, deadline, w.done(w.add()));
    }
    w.wait();
    timedOut = Clock::now() >= deadline;  // also when a peer's failure came first
    for (int r = 1; r < size_; ++r) {
      const std::string& e = w.error(size_t(r - 1));
      (e.empty() ? arrived : missing).push_back(r);
      if (e.find("Timed out") != std::string::npos) {
        timedOut = true;
      } else if (!e.empty()) {
        detail += collx::str("; rank ", r, ": ", e);
      }
    }
  }
  {
    const uint8_t verdict = missing.empty() ? 0 : 1;
    Waiter w(p2p);
    const Deadline until = Clock::now() + timeout();  // the barrier's own may have passed
    for (int r : arrived) {
      p2p.postSend(r, tag, {const_cast<uint8_t*>(&verdict), 1, DataType::kUInt8}, until, w.done(w.add()));
    }
  }
  if (missing.empty()) return;
  const auto ms = limit.count();
  const std::string who = waitAllRanks ? collx::str("Ranks ", joined(missing)) : collx::str("Rank ", missing[0]);
  fail("monitored_barrier", rank_,
       collx::str("[Rank 0]: ", who, " failed to pass monitoredBarrier in ", ms, " ms (",
                  timedOut ? collx::str("Rank 0 timed out in monitoredBarrier after ", ms, " ms; ") : std::string(),
                  "arrived: [", joined(arrived), "], missing: [", joined(missing), "]", detail, ")"));
}

}  // namespace collx::torch_glue
