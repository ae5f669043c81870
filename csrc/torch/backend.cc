// Lifecycle, the op queue, barriers, splitting and stats of CollxBackend.
#include "backend.h"

#include <pybind11/pybind11.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <cstdio>
#include <optional>
#include <random>

#include "core/algorithms/tuning.h"
#include "op_helpers.h"
#include "store_adapter.h"
#include "work.h"

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

std::string millis(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", ms);
  return buf;
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
                           config_.localCongestion};
  const auto start = Clock::now();
  device_ = asDistError("init", rank, [&] { return std::make_unique<tcp::Device>(adapter, rank, size, dopts); });
  if (device_->shmUnavailable()) warnShmOnce(rank, size, device_->transportNote());
  tune();
  if (logs(LogLevel::kInfo)) {
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    const std::vector<int> h = hosts();
    const auto local = std::count(h.begin(), h.end(), h[rank]);
    log(LogLevel::kInfo,
        collx::str("mesh of ", size, " ranks ready in ", millis(ms), " ms, listening on ", device_->address(), "; ",
                   device_->hostCount(), " host(s), ", local, " rank(s) on this one",
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
  refiner_->onKept = [this](const std::string& line) {
    if (logs(LogLevel::kInfo)) log(LogLevel::kInfo, line);
  };
  // A cached tuning that real ops show fitted under load: later groups calibrate again.
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
    log(LogLevel::kInfo, collx::str("shutting down after ", s.ops, " ops (sent ", s.bytesSent, " B, received ",
                                    s.bytesReceived, " B)"));
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

c10::intrusive_ptr<CollxWork> CollxBackend::enqueue(c10d::OpType type, OpKind kind, DataType dtype,
                                                    std::vector<at::Tensor> outputs,
                                                    std::chrono::milliseconds timeout, Body body, bool collective) {
  std::shared_ptr<Staging> staging = Staging::current();
  std::vector<c10::Device> devices;
  if (staging) {
    outputs = staging->deviceOf(outputs);  // the user's tensors, not the mirrors
    devices = staging->devices();
    asDistError(name(kind), rank_, [&] {
      staging->recordCaller();
      return 0;
    });
  }
  // Drawn after the last check that may throw: a rejected op's number goes to its cancel.
  const uint64_t seq = collective ? ++seq_ : seq_.load();
  auto work = c10::make_intrusive<CollxWork>(type, nullptr, std::move(outputs), seq, std::move(devices));
  auto describe = [this, kind, dtype, seq, collective] {
    return collx::str("collx ", name(kind), collective ? collx::str(" #", seq) : std::string(), " (",
                      name(dtype), ") failed on rank ", rank_, ": ");
  };
  Executor::Task task;
  task.run = [this, work, kind, dtype, seq, collective, timeout, body = std::move(body), describe, staging] {
    // A tuning from the table or a file is meant to be fixed: only a calibrated one is refined.
    const bool refines = config_.tuning.mode == TuningPolicy::Mode::kCalibrate;
    Collective c{device(), kind, dtype, seq, Clock::now() + timeout, config_.segmentBytes, config_.treeArity,
                 workspace_, &tuning_, refines ? refiner_.get() : nullptr};
    std::exception_ptr error;
    auto start = Clock::now();
    try {
      if (staging) staging->copyIn();
      std::string label = body(c);
      if (staging) staging->copyOut();
      const double secs = std::chrono::duration<double>(Clock::now() - start).count();
      {
        std::lock_guard<std::mutex> lock(statsMutex_);
        ++stats_.ops;
        if (staging) {
          ++stats_.stagedOps;
          stats_.deviceReductions += staging->deviceReductions();
          stats_.inTensorReductions += staging->inTensorReductions();
        }
        auto& s = stats_.perAlgorithm[label];
        ++s.calls;
        s.seconds += secs;
      }
      if (logs(LogLevel::kTrace)) {
        log(LogLevel::kTrace, collx::str(name(kind), collective ? collx::str(" #", seq) : std::string(), " (",
                                         name(dtype), "): ", label, staging ? " staged" : "", ", ",
                                         millis(secs * 1e3), " ms"));
      }
    } catch (const std::exception& e) {
      error = distError(describe() + e.what());
      if (logs(LogLevel::kWarn)) log(LogLevel::kWarn, describe() + e.what());
      const auto failure = device().failure();
      if (failure != tcp::Device::Failure::kNone && failure != tcp::Device::Failure::kAborted) runAbortHooks();
    }
    work->complete(error);
  };
  task.cancel = [this, work, describe](const std::string& why) {
    if (logs(LogLevel::kWarn)) log(LogLevel::kWarn, describe() + why);
    work->complete(distError(describe() + why));
  };
  if (aborted_) C10_THROW_ERROR(DistBackendError, describe() + abortedMessage());
  asDistError(name(kind), rank_, [&] {
    work->attach(executor_, executor_->submit(std::move(task), /*wake=*/!tCallerWaits));
    return 0;
  });
  return work;
}

std::shared_ptr<Staging> CollxBackend::stagingFor(const std::vector<at::Tensor>& tensors, const char* op) {
  if (Staging::current()) return nullptr;  // already running on the mirrors
  return Staging::create(tensors, config_.stageCpuTensors, config_.deviceReduceMinBytes, config_.stagingChunkBytes,
                         op, rank_);
}

void CollxBackend::cancelRejected(OpKind kind, const std::exception& e) {
  auto* ce = dynamic_cast<const c10::Error*>(&e);
  std::string why = ce ? ce->what_without_backtrace() : e.what();
  const uint64_t seq = ++seq_;
  if (logs(LogLevel::kWarn)) log(LogLevel::kWarn, collx::str(name(kind), " #", seq, " rejected: ", why));
  Executor::Task task;
  // In order with the other ops: peers see the cancel where #seq would be.
  // A failure here is sticky in the device and reported by the next op.
  task.run = [this, seq, kind, why] {
    try {
      device().cancel(seq, kind, why, Clock::now() + timeout());
    } catch (const std::exception&) {
    }
  };
  task.cancel = [](const std::string&) {};
  try {
    executor_->submit(std::move(task));
  } catch (const std::exception&) {  // shut down: no peers to tell
  }
}

c10::intrusive_ptr<c10d::Work> CollxBackend::barrier(const c10d::BarrierOptions& opts) {
  // Queued behind every earlier op, so it also waits for them (as gloo's does).
  auto body = [](const Collective& c) {
    uint8_t token = 0;
    starAllreduce(c, &token, 1, cpuReduceFn(DataType::kUInt8, ReduceOp::kBor));
    return std::string("barrier/star");
  };
  return enqueue(c10d::OpType::BARRIER, OpKind::kBarrier, DataType::kUInt8, {}, opTimeout(opts.timeout, timeout()),
                 std::move(body));
}

c10::intrusive_ptr<c10d::Backend::Options> CollxBackend::getBackendOptions() {
  return c10::make_intrusive<c10d::Backend::Options>("collx", timeout());
}

c10::intrusive_ptr<c10d::Backend> CollxBackend::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                      const std::vector<int>& ranks,
                                                      const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) return nullptr;  // not a member of the new group
  const auto limit = opts && opts->timeout.count() > 0 ? opts->timeout : timeout();
  return c10::make_intrusive<CollxBackend>(store, int(it - ranks.begin()), int(ranks.size()), limit, config_);
}

std::vector<int> CollxBackend::hosts() const {
  std::vector<int> out;
  for (int r = 0; r < size_; ++r) out.push_back(device().host(r));
  return out;
}

Algorithm CollxBackend::autoBeforeRefining(size_t bytes) const {
  return resolveAllreduce(device(), tuning_, Algorithm::kAuto, config_.treeArity, bytes);
}

Algorithm CollxBackend::autoAllreduce(size_t bytes) const { return refiner_->kept(bytes, autoBeforeRefining(bytes)); }

bool CollxBackend::refining(size_t bytes) const { return refiner_->trying(bytes, autoBeforeRefining(bytes)); }

std::string CollxBackend::describeTuning() const {
  const std::string refined = refiner_->describe();
  return tuning_.describe(size_, config_.treeArity) + (refined.empty() ? "" : "; " + refined);
}

Stats CollxBackend::stats() const {
  Stats s;
  {
    std::lock_guard<std::mutex> lock(statsMutex_);
    s = stats_;
  }
  TransportCounters tc = device_ ? device_->counters() : TransportCounters{};
  s.bytesSent = tc.bytesSent;
  s.bytesReceived = tc.bytesReceived;
  return s;
}

}  // namespace collx::torch_glue
