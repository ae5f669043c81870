// How a group's mesh comes and goes: construction, connecting (the mesh and
// its tuning), shutdown, and the teardown that abort and reconfigure share.
#include <pybind11/pybind11.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
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

CollxBackend::CollxBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout, Config config, bool connected)
    : c10d::Backend(rank, size),
      config_(std::move(config)),
      store_(store),
      timeout_(timeout),
      member_(memberId()) {
  if (connected) connect(store, rank, size);
}

void CollxBackend::connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size) {
  StoreAdapter adapter(store);
  tcp::DeviceOptions dopts{config_.ifname, config_.family, timeout(), config_.transport, config_.readPeers,
                           config_.localCongestion, config_.lazy};
  const auto start = Clock::now();
  device_ = asDistError("init", rank, [&] { return std::make_unique<tcp::Device>(adapter, rank, size, dopts); });
  if (device_->shmUnavailable()) warnShmOnce(rank, size, device_->transportNote());
  tune();
  if (logs(LogLevel::kInfo)) {
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    const std::vector<int> h = hosts();
    const auto local = std::count(h.begin(), h.end(), h[rank]);
    log(LogLevel::kInfo,
        collx::str("mesh of ", size, " ranks ready in ", millis(ms), " ms after ", adapter.requests(),
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

tcp::Device& CollxBackend::device() const {
  if (!device_) {
    C10_THROW_ERROR(DistBackendError,
                    collx::str("collx on rank ", rank_, ": the group has no members yet (it was created with "
                               "enable_reconfigure=True): call torch.distributed.distributed_c10d._reconfigure first"));
  }
  return *device_;
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
                                 device_->transportNote());
  }
  Collective c{*device_, OpKind::kCalibrate, DataType::kFloat32, 0, Clock::now() + timeout(), config_.segmentBytes,
               config_.treeArity, workspace_};
  TuningOutcome out = asDistError("init", rank_, [&] { return tuneGroup(c, policy); });
  tuning_ = out.tuning;
  refiner_->seed(out.refined);
  // Settled choices are saved beside the cache, by the first rank of each
  // host (every rank holds the same, agreed choices).
  const std::vector<int> host = hosts();
  const bool saves = std::find(host.begin(), host.end(), host[size_t(rank_)]) - host.begin() == rank_;
  auto stale = std::make_shared<std::atomic<bool>>(false);
  refiner_->onKept = [this, saves, out, stale](const std::string& line) {
    if (logs(LogLevel::kInfo)) log(LogLevel::kInfo, line);
    if (!saves || *stale) return;
    const std::string failed = saveRefined(out, [this](const std::string& before) { return refiner_->save(before); });
    if (!failed.empty() && logs(LogLevel::kWarn)) log(LogLevel::kWarn, "refined choices not saved: " + failed);
  };
  // A cached tuning that real ops show fitted under load: later groups
  // calibrate again, and refine again.
  refiner_->onStale = [this, cache = out.cachePath, refined = out.refinedPath, stale](const std::string& why) {
    *stale = true;
    if (!refined.empty()) std::remove(refined.c_str());
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
  if (device_) device_->interrupt(inFlight, tellPeers);
  executor_->shutdown(queued);  // waits for the op in flight, unless called from it
  if (!device_) return;
  if (tellPeers) device_->abort(inFlight);  // no op was in flight: the abort frames now
  // Pending sends and receives fail now; their callbacks may take the GIL too.
  device_->p2p().close(pending);
  device_->close();
}

}  // namespace collx::torch_glue
