// torch 2.14's fault-tolerance API on CollxBackend: set_timeout, abort and
// its hooks, getError, and shrink (reconfigure: reconfigure.cc).
//
// Abort, from any thread, with ops queued or in flight:
//
//   interrupt(tellPeers)   the waiting op wakes (its sockets' reads are shut),
//                          fails, and sends its peers an abort frame
//   executor.shutdown      queued ops fail with "aborted"; waits for the op
//                          in flight, which has just failed
//   device.abort           when no op was in flight: the abort frames now
//   p2p.close              pending sends and receives fail with "aborted"
//
// Shrink meets in the group's store, not over its connections: after a
// failure those are closed (their byte streams stopped at unknown places).
// Each survivor publishes the ranks it excludes and checks that every other
// survivor excludes the same, then the survivors build a new mesh.
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <optional>

#include "backend.h"
#include "op_helpers.h"

namespace collx::torch_glue {

using Failure = tcp::Device::Failure;

void CollxBackend::setTimeout(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) {
    C10_THROW_ERROR(ValueError, collx::str("collx set_timeout on rank ", rank_, ": the timeout must be positive, got ",
                                           timeout.count(), " ms"));
  }
  timeout_ = timeout;
  timeoutSet_ = true;
}

void CollxBackend::noteFailure(Failure kind) {
  Failure none = Failure::kNone;
  if (kind != Failure::kNone) p2pFailure_.compare_exchange_strong(none, kind);
}

c10d::ErrorType CollxBackend::getError() {
  // The collectives' failure breaks the group; a p2p op's is its own.
  const tcp::Device* d = published();
  Failure f = d ? d->failure() : Failure::kNone;
  if (f == Failure::kNone) f = p2pFailure_.load();
  switch (f) {
    case Failure::kTimeout:
      return c10d::ErrorType::TIMEOUT;
    case Failure::kRemote:
      return c10d::ErrorType::REMOTE_ERROR;
    case Failure::kLocal:
      return c10d::ErrorType::COMM_ERROR;
    case Failure::kNone:
    case Failure::kAborted:  // by this rank's user: no failure of the group
      break;
  }
  return c10d::ErrorType::SUCCESS;
}

std::string CollxBackend::abortedMessage() const {
  return collx::str("collx rank ", rank_, ": the process group was aborted");
}

void CollxBackend::abort() {
  const std::string why = abortedMessage();
  aborted_ = true;  // later ops fail at once, from here on
  // As in shutdown(): the op in flight may need the GIL to finish, so it is
  // let go before anything here waits.
  std::optional<pybind11::gil_scoped_release> noGil;
  if (Py_IsInitialized() && PyGILState_Check()) noGil.emplace();
  std::unique_lock<std::mutex> lock;
  if (!lockLifecycle(lock) || shutDown_) return;  // torn down, or being torn down by this task's caller
  if (logs(LogLevel::kInfo)) log(LogLevel::kInfo, "aborting");
  closeMesh(why, why, why, /*tellPeers=*/true);
  shutDown_ = true;
}

#ifdef C10D_BACKEND_HAS_HOOKS
void CollxBackend::registerAbortHook(int64_t id, c10d::AbortHook hook) {
  std::lock_guard<std::mutex> lock(hooksMutex_);
  abortHooks_[id] = std::move(hook);
}

void CollxBackend::unregisterAbortHook(int64_t id) {
  std::lock_guard<std::mutex> lock(hooksMutex_);
  abortHooks_.erase(id);
}
#endif

void CollxBackend::runAbortHooks() {
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(hooksMutex_);
    if (hooksRan_) return;
    hooksRan_ = true;
    for (auto& [id, hook] : abortHooks_) hooks.push_back(hook);
  }
  for (auto& hook : hooks) {
    try {
      hook();
    } catch (const std::exception& e) {
      log(LogLevel::kWarn, collx::str("an abort hook raised: ", e.what()));
    }
  }
}

namespace {
std::string listOf(const std::vector<int64_t>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += collx::str(i ? ", " : "", ranks[i]);
  return s + "]";
}
}  // namespace

c10::intrusive_ptr<c10d::Backend> CollxBackend::shrink(const std::vector<int64_t>& exclude, int flags,
                                                       const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  constexpr int kShrinkAbort = 0x01;  // torch.distributed.SHRINK_ABORT
  std::vector<int64_t> excluded(exclude);
  std::sort(excluded.begin(), excluded.end());
  std::vector<int> survivors;
  for (int r = 0; r < size_; ++r) {
    if (!std::binary_search(excluded.begin(), excluded.end(), int64_t(r))) survivors.push_back(r);
  }
  auto fails = [&](const std::string& why) {
    C10_THROW_ERROR(DistBackendError, collx::str("collx shrink on rank ", rank_, ": ", why));
  };
  for (int64_t r : excluded) {
    if (r < 0 || r >= size_) fails(collx::str("rank ", r, " is out of range for a group of size ", size_));
  }
  const auto self = std::find(survivors.begin(), survivors.end(), rank_);
  if (self == survivors.end()) fails("this rank is among the excluded ranks " + listOf(excluded));
  if (flags & kShrinkAbort) abort();
  // The survivors wait on each other: ranks that are threads of one process
  // (torchft's tests) must not wait holding the GIL.
  std::optional<pybind11::gil_scoped_release> noGil;
  if (Py_IsInitialized() && PyGILState_Check()) noGil.emplace();
  const auto limit = opts && opts->timeout.count() > 0 ? opts->timeout : timeout();

  // Every survivor checks that the others exclude the same ranks.
  auto store = c10::make_intrusive<c10d::PrefixStore>(collx::str("collx/shrink/", shrinks_++, "/"), store_);
  const std::string mine = listOf(excluded);
  store->set(collx::str("excluded/", rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
  for (int r : survivors) {
    const std::string key = collx::str("excluded/", r);
    try {
      store->wait({key}, limit);
    } catch (const std::exception&) {
      fails(collx::str("rank ", r, ", which this rank keeps, did not join the shrink within ", limit.count(),
                       " ms (it may have failed too: exclude it as well)"));
    }
    const std::vector<uint8_t> v = store->get(key);
    const std::string theirs(v.begin(), v.end());
    if (theirs != mine) {
      fails(collx::str("the survivors disagree on the ranks to exclude: this rank excludes ", mine, ", rank ", r,
                       " excludes ", theirs));
    }
  }
  // An excluded rank that is shrinking too is alive: the lists cannot all be
  // right (it may also come later, which no rank can tell from a death).
  for (int64_t r : excluded) {
    if (store->check({collx::str("excluded/", r)})) {
      fails(collx::str("rank ", r, ", which this rank excludes, takes part in the shrink"));
    }
  }
  return c10::make_intrusive<CollxBackend>(c10::make_intrusive<c10d::PrefixStore>("group/", store),
                                           int(self - survivors.begin()), int(survivors.size()), limit,
                                           configOf(std::vector<int64_t>(survivors.begin(), survivors.end())));
}

}  // namespace collx::torch_glue
