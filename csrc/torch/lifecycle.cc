// How a group's mesh comes and goes: construction, connecting (the mesh and
// its tuning), shutdown, and the teardown that abort and reconfigure share.
#include <pybind11/pybind11.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <optional>
#include <random>

#include "backend.h"
#include "core/algorithms/tuning.h"
#include "op_helpers.h"
#include "store_adapter.h"

namespace collx::torch_glue {

namespace {
// Falling back from shared memory to TCP costs speed, not correctness: one
// line per process, whatever COLLX_DEBUG says.
void warnShmOnce(int rank, int size, const std::string& note) {
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) logLine(LogLevel::kWarn, rank, size, note);
}

// This process, unique among every process that ever joins the group.
std::string memberId() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::random_device rd;
  return collx::str(host, "/", ::getpid(), "/", rd());
}
}  // namespace

// A rank's groups tune one at a time, in the order they were created. A
// group set up in the background would otherwise time its calibration
// against the one before it, and miss the cache that one is about to
// write. The order is the same on every rank (torch creates groups in one
// order everywhere), so no two groups wait for each other across ranks.
// Turns are per global rank, not per process: ranks run as threads of one
// process (torchft's tests) must not wait for each other's turns.
class TuningTurns {
 public:
  static TuningTurns& of(uint64_t globalRank) {
    static std::mutex mu;
    static std::map<uint64_t, TuningTurns> turns;
    std::lock_guard<std::mutex> lock(mu);
    return turns[globalRank];  // never erased: a node's address stays valid
  }
  uint64_t take() {
    std::lock_guard<std::mutex> lock(mu_);
    return issued_++;
  }
  // Waits until every earlier ticket passed; false if `interrupted` first.
  bool await(uint64_t ticket, const std::atomic<bool>& interrupted) {
    std::unique_lock<std::mutex> lock(mu_);
    while (serving_ != ticket) {
      if (interrupted) return false;
      cv_.wait_for(lock, std::chrono::milliseconds(20));
    }
    return true;
  }
  void pass(uint64_t ticket) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      passed_.insert(ticket);
      while (passed_.erase(serving_)) ++serving_;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t issued_ = 0;
  uint64_t serving_ = 0;
  std::set<uint64_t> passed_;
};

CollxBackend::CollxBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout, Config config, Connect connect)
    : c10d::Backend(rank, size),
      config_(std::move(config)),
      store_(store),
      timeout_(timeout),
      member_(memberId()) {
  if (connect == Connect::kNow) this->connect(store, rank, size);
  if (connect == Connect::kLater) connectLater(store, rank, size);
}

TuningTurns& CollxBackend::tuningTurns() const {
  const bool known = config_.globalRanks.size() == size_t(size_);
  return TuningTurns::of(known ? config_.globalRanks[size_t(rank_)] : uint64_t(rank_));
}

tcp::Directory CollxBackend::announce(StoreAdapter& adapter, int rank, int size) const {
  return asDistError("init", rank, [&] {
    return tcp::announce(adapter, rank, size, config_.ifname, config_.family, "", config_.lazy ? "lazy" : "eager");
  });
}

void CollxBackend::connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size) {
  const auto start = Clock::now();
  StoreAdapter adapter(store);
  tcp::Directory dir = announce(adapter, rank, size);
  TuningTurns& turns = tuningTurns();
  const uint64_t ticket = turns.take();
  asDistError("init", rank, [&] {
    build(adapter, std::move(dir), start, 0, turns, ticket);
    return 0;
  });
}

// Creation waits for nobody: like gloo's lazy init and NCCL's communicators,
// a group announces itself and meets its peers on its first op, so that a
// new_group costs two Store requests, and no rank waits at creation for the
// last to arrive. The meeting runs meanwhile on the
// executor, which every op queues behind; callers that need the transport
// outside the executor wait for it in device(). Its own client of the Store
// keeps its waits from holding up the caller's Store requests (a c10d
// TCPStore client serves one request at a time).
void CollxBackend::connectLater(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size) {
  const auto start = Clock::now();
  uint64_t requests = 0;
  auto dir = [&] {
    StoreAdapter adapter(store);
    auto d = std::make_shared<tcp::Directory>(announce(adapter, rank, size));
    requests = adapter.requests();
    return d;
  }();
  TuningTurns* turns = &tuningTurns();
  const uint64_t ticket = turns->take();
  setupWakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);  // -1: its connects run to their deadline
  settingUp_ = true;
  auto ended = [this](const std::string& error) {
    {
      std::lock_guard<std::mutex> lock(setupMutex_);
      setupError_ = error;
      setupFailed_ = !error.empty();
      settingUp_ = false;
    }
    setupEnded_.notify_all();
  };
  Executor::Task task;
  task.run = [this, store, rank, size, dir, start, requests, turns, ticket, ended] {
    std::string error;
    try {
      c10::intrusive_ptr<c10d::Store> own = store;
      try {
        own = store->clone();
      } catch (const std::exception&) {  // a Store without clients of its own: share the caller's
      }
      StoreAdapter adapter(own, &setupInterrupted_);
      build(adapter, std::move(*dir), start, requests, *turns, ticket);
    } catch (const c10::Error& e) {
      error = collx::str("collx init failed on rank ", rank, " of ", size, ": ", e.what_without_backtrace());
    } catch (const std::exception& e) {
      error = collx::str("collx init failed on rank ", rank, " of ", size, ": ", e.what());
    }
    if (!error.empty() && logs(LogLevel::kWarn)) log(LogLevel::kWarn, error);
    ended(error);
  };
  task.cancel = [turns, ticket, ended](const std::string& why) {
    turns->pass(ticket);
    ended(why);
  };
  executor_->submit(std::move(task));
}

void CollxBackend::build(StoreAdapter& adapter, tcp::Directory announced, Clock::time_point start,
                         uint64_t requestsBefore, TuningTurns& turns, uint64_t ticket) {
  struct Pass {  // however this ends
    TuningTurns& turns;
    uint64_t ticket;
    ~Pass() { turns.pass(ticket); }
  } pass{turns, ticket};
  const int rank = announced.rank;
  const int size = announced.size;
  tcp::DeviceOptions dopts{config_.ifname, config_.family, timeout(), config_.transport, config_.readPeers,
                           config_.localCongestion, config_.lazy};
  dopts.lanes = config_.lanes;
  dopts.wakeFd = setupWakeFd_;
  dopts.notes = std::make_shared<StoreAdapter>(store_);
  auto device = std::make_unique<tcp::Device>(adapter, std::move(announced), dopts);
  {
    std::lock_guard<std::mutex> lock(setupMutex_);
    device_ = std::move(device);
  }
  // closeMesh interrupts device_ once published; one that came before sees this.
  if (setupInterrupted_) throw setupInterrupted();
  if (device_->shmUnavailable()) warnShmOnce(rank, size, device_->transportNote());
  if (!turns.await(ticket, setupInterrupted_)) throw setupInterrupted();
  tuneOrTable();
  if (logs(LogLevel::kInfo)) {
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    const std::vector<int> h = hosts();
    const auto local = std::count(h.begin(), h.end(), h[rank]);
    log(LogLevel::kInfo,
        collx::str("mesh of ", size, " ranks ready in ", millis(ms), " ms after ", requestsBefore + adapter.requests(),
                   " store requests, listening on ", device_->address(), "; ",
                   device_->hostCount(), " host(s), ", local, " rank(s) on this one; connections ",
                   config_.lazy ? "lazy" : "eager", " (", device_->connectedPeers(), " of ", size - 1, " peers now)",
                   device_->transportNote().empty() ? "" : "; ", device_->transportNote(), "; algorithm ",
                   name(config_.algorithm), ", tree arity ", config_.treeArity, ", segment ", config_.segmentBytes,
                   " B, device reductions ",
                   config_.deviceReduceMinBytes == SIZE_MAX ? std::string("off")
                                                            : collx::str("from ", config_.deviceReduceMinBytes, " B")));
  }
}

void CollxBackend::awaitSetup() const {
  // Tasks on the executor run after the setup (or are it): no wait there.
  if (settingUp_ && !executor_->inTask()) {
    std::optional<pybind11::gil_scoped_release> noGil;  // the setup may need it (a Store written in Python)
    if (Py_IsInitialized() && PyGILState_Check()) noGil.emplace();
    std::unique_lock<std::mutex> lock(setupMutex_);
    setupEnded_.wait(lock, [this] { return !settingUp_; });
  }
  if (setupFailed_) {
    std::lock_guard<std::mutex> lock(setupMutex_);
    C10_THROW_ERROR(DistBackendError, setupError_);
  }
}

tcp::Device& CollxBackend::device() const {
  awaitSetup();
  if (!device_) {
    C10_THROW_ERROR(DistBackendError,
                    collx::str("collx on rank ", rank_, ": the group has no members yet (it was created with "
                               "enable_reconfigure=True): call torch.distributed.distributed_c10d._reconfigure first"));
  }
  return *device_;
}

tcp::Device* CollxBackend::published() const {
  std::lock_guard<std::mutex> lock(setupMutex_);
  return device_.get();
}

// A member that left during setup fails the ops that need it, not the
// group's setup: send and recv among the others go on. So with a departed
// member the group is not timed (the timing is collective) and starts from
// the table; and a calibration that broke on a member that left (a rank that
// saw it go only then) leaves the group's collectives failing with why,
// where the ops between the others still run.
void CollxBackend::tuneOrTable() {
  if (device_->departedPeers() > 0) {
    if (logs(LogLevel::kWarn)) log(LogLevel::kWarn, "a member left while the group was set up; not calibrated");
    tuning_ = Tuning::table();
    return;
  }
  try {
    tune();
  } catch (const std::exception& e) {
    if (device_->failure() == tcp::Device::Failure::kNone) throw;
    if (logs(LogLevel::kWarn)) log(LogLevel::kWarn, collx::str("the calibration failed: ", e.what()));
    tuning_ = Tuning::table();
  }
}

void CollxBackend::tune() {
  TuningPolicy policy = config_.tuning;
  if (policy.mode == TuningPolicy::Mode::kCalibrate) {
    // The cache is per machine, group shape and settings; ranks on other
    // hosts hold their own copies, and tuneGroup checks that all agree.
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    std::string layout;
    for (int h : hosts()) layout += collx::str(h, ",");
    policy.cacheKey = collx::str("collx tuning v1; host ", host, "; ", size_, " ranks on hosts ", layout,
                                 " interface '", config_.ifname, "' family ", config_.family, "; segment ",
                                 config_.segmentBytes, " B, tree arity ", config_.treeArity, "; ",
                                 device_->transportKey());
  }
  Collective c{*device_, OpKind::kCalibrate, DataType::kFloat32, 0, Clock::now() + timeout(), config_.segmentBytes,
               config_.treeArity, workspace_};
  TuningOutcome out = tuneGroup(c, policy);  // the callers of build() report its errors
  tuning_ = out.tuning;
  refiner_->seed(out.refined);
  // Settled choices are saved beside the cache, by the first rank of each
  // host (every rank holds the same, agreed choices).
  const std::vector<int> host = hosts();
  const bool saves = std::find(host.begin(), host.end(), host[size_t(rank_)]) - host.begin() == rank_;
  refiner_->onKept = [this, saves, out](const std::string& line) {
    if (logs(LogLevel::kInfo)) log(LogLevel::kInfo, line);
    if (!saves) return;
    const std::string failed = saveRefined(out, [this](const std::string& before) { return refiner_->save(before); });
    if (!failed.empty() && logs(LogLevel::kWarn)) log(LogLevel::kWarn, "refined choices not saved: " + failed);
  };
  // A cached tuning that real ops show fitted under load: later groups
  // calibrate again. The refined choices stay: they are the ops' own times.
  refiner_->onStale = [this, cache = out.cachePath](const std::string& why) {
    const bool dropped = !cache.empty() && std::remove(cache.c_str()) == 0;
    if (logs(LogLevel::kWarn)) {
      log(LogLevel::kWarn, why + (dropped ? "; dropped its cache " + cache + ", the next group calibrates again" : ""));
    }
  };
  if (!out.cacheWarning.empty() && logs(LogLevel::kWarn)) {
    log(LogLevel::kWarn, "tuning not cached: " + out.cacheWarning);
  }
  if (logs(LogLevel::kInfo)) log(LogLevel::kInfo, tuning_.describe(size_, config_.treeArity));
}

CollxBackend::~CollxBackend() { shutdown(); }

void CollxBackend::shutdown() {
  // The executor thread may need the GIL to drop the last reference to a
  // tensor of its last op. Waiting for it with the GIL held (this destructor
  // runs from Python's GC) would deadlock, so let go of the GIL first.
  std::optional<pybind11::gil_scoped_release> noGil;
  if (Py_IsInitialized() && PyGILState_Check()) noGil.emplace();
  std::unique_lock<std::mutex> lock;
  if (!lockLifecycle(lock)) return;
  if (!shutDown_.exchange(true) && logs(LogLevel::kInfo)) {
    const Stats s = stats();
    log(LogLevel::kInfo, collx::str("shutting down after ", s.ops, " ops (sent ", s.traffic.bytesSent(), " B, received ",
                                    s.traffic.bytesReceived(), " B)"));
  }
  destroyed_ = true;
  // An op still in flight is failed, not waited for: its peers may be gone.
  closeMesh(collx::str("collx rank ", rank_, ": the process group was shut down while this op was in flight"),
            collx::str("collx on rank ", rank_, ": the process group was destroyed before this op ran"),
            collx::str("collx rank ", rank_, ": the process group was shut down"), /*tellPeers=*/false);
}

bool CollxBackend::lockLifecycle(std::unique_lock<std::mutex>& lock) {
  lock = std::unique_lock<std::mutex>(lifecycleMutex_, std::defer_lock);
  // From inside an op's task (an abort hook, a Future callback), waiting for
  // a teardown that waits for this task would deadlock.
  if (executor_->inTask()) return lock.try_lock();
  lock.lock();
  return true;
}

void CollxBackend::closeMesh(const std::string& inFlight, const std::string& queued, const std::string& pending,
                             bool tellPeers) {
  setupInterrupted_ = true;  // a background setup's Store waits and connects stop
  if (setupWakeFd_ >= 0) ::eventfd_write(setupWakeFd_, 1);
  if (tcp::Device* d = published()) d->interrupt(inFlight, tellPeers);
  executor_->shutdown(queued);  // waits for the op in flight (or the setup), unless called from it
  if (setupWakeFd_ >= 0) ::close(setupWakeFd_);  // the setup ended
  setupWakeFd_ = -1;
  if (!device_) return;
  if (tellPeers) device_->abort(inFlight);  // no op was in flight: the abort frames now
  // Pending sends and receives fail now; their callbacks may take the GIL too.
  device_->p2p().close(pending);
  device_->close();
}

}  // namespace collx::torch_glue
