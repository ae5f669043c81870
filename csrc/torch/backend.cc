// The op queue, barriers, splitting and stats of CollxBackend.
#include "backend.h"

#include <algorithm>

#include "core/algorithms/tuning.h"
#include "op_helpers.h"
#include "work.h"

namespace collx::torch_glue {

// A queued op, made once per op (its trace in place): the executor runs it,
// or cancels it when the group shuts down first.
struct CollxBackend::Queued final : Executor::Job {
  Queued(CollxBackend& b, OpKind k, DataType d, uint64_t s, bool c, std::chrono::milliseconds t, Body run,
         std::shared_ptr<Staging> st)
      : backend(b), kind(k), dtype(d), seq(s), collective(c), timeout(t), body(std::move(run)), staging(std::move(st)) {}

  void run() override { backend.runQueued(*this); }
  void cancel(const std::string& why) override {
    if (trace) trace->retire();
    if (backend.logs(LogLevel::kWarn)) backend.log(LogLevel::kWarn, failedOn() + why);
    work->complete(distError(failedOn() + why));
  }

  CollxBackend& backend;
  c10::intrusive_ptr<CollxWork> work;
  OpKind kind;
  DataType dtype;
  uint64_t seq;
  bool collective;
  std::chrono::milliseconds timeout;
  Body body;
  std::shared_ptr<Staging> staging;
  std::optional<OpTrace> trace;

  // "all_reduce #3 (float32)".
  std::string what() const {
    return collx::str(name(kind), collective ? collx::str(" #", seq) : std::string(), " (", name(dtype), ")");
  }
  // "collx all_reduce #3 (float32) failed on rank 0: ".
  std::string failedOn() const { return collx::str("collx ", what(), " failed on rank ", backend.rank_, ": "); }
};

c10::intrusive_ptr<CollxWork> CollxBackend::enqueue(c10d::OpType type, OpKind kind, DataType dtype,
                                                    std::vector<at::Tensor> outputs,
                                                    std::chrono::milliseconds timeout, Body body, bool collective,
                                                    std::vector<at::Tensor> inputs) {
  std::shared_ptr<Staging> staging = Staging::current();
  std::vector<c10::Device> devices;
  if (staging) {
    outputs = staging->deviceOf(outputs);  // the user's tensors, not the mirrors
    inputs = staging->deviceOf(inputs);
    devices = staging->devices();
    asDistError(name(kind), rank_, [&] {
      staging->recordCaller();
      return 0;
    });
  }
  // Drawn after the last check that may throw: a rejected op's number goes to its cancel.
  const uint64_t seq = collective ? ++seq_ : seq_.load();
  auto q = std::make_unique<Queued>(*this, kind, dtype, seq, collective, timeout, std::move(body), std::move(staging));
  if (config_.tracing && OpTrace::wanted()) {
    q->trace.emplace(trace_, pgName(), rank_, size_, name(kind), seq, false, inputs.empty() ? outputs : inputs,
                     outputs, timeout);
  }
  auto work = c10::make_intrusive<CollxWork>(type, nullptr, std::move(outputs), seq, std::move(devices));
  q->work = work;
  if (aborted_) C10_THROW_ERROR(DistBackendError, q->failedOn() + abortedMessage());
  asDistError(name(kind), rank_, [&] {
    work->attach(executor_, executor_->submit(std::move(q), /*wake=*/!tCallerWaits));
    return 0;
  });
  return work;
}

void CollxBackend::runQueued(Queued& q) {
  const auto start = Clock::now();
  q.work->markStarted(start);
  // The trace's entry completes (or fails) before the Work does.
  std::optional<OpTrace::Running> running;
  if (q.trace) running.emplace(*q.trace);
  const bool profiling = running && running->profiling();
  const TransportCounters before = profiling ? traffic() : TransportCounters{};
  // A tuning from the table or a file is meant to be fixed: only a calibrated one is refined.
  const bool refines = config_.tuning.mode == TuningPolicy::Mode::kCalibrate;
  const std::shared_ptr<Staging>& staging = q.staging;
  std::exception_ptr error;
  Clock::time_point end;
  // Everything from the first device() on fails the op, not the executor:
  // device() throws when the group's setup failed (a member never came).
  try {
    if (q.collective) device().noteProgress(q.seq, q.kind, false);
    Collective c{device(), q.kind, q.dtype, q.seq, start + q.timeout, config_.segmentBytes, config_.treeArity,
                 workspace_, &tuning_, refines ? refiner_.get() : nullptr};
    if (staging) staging->copyIn();
    std::string label = q.body(c);
    if (staging) staging->copyOut();
    if (running) running->finish(label, before, profiling ? traffic() : TransportCounters{});
    if (q.collective) device().noteProgress(q.seq, q.kind, true);
    end = Clock::now();
    const double secs = std::chrono::duration<double>(end - start).count();
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
      log(LogLevel::kTrace,
          collx::str(q.what(), ": ", label, staging ? " staged" : "", ", ", millis(secs * 1e3), " ms"));
    }
  } catch (const std::exception& e) {
    const tcp::Device* d = published();  // none where the setup failed
    const auto failure = d ? d->failure() : tcp::Device::Failure::kNone;
    const auto* ce = dynamic_cast<const c10::Error*>(&e);
    const std::string why = (failure == tcp::Device::Failure::kTimeout ? whoIsMissing(q.timeout) : "") +
                            (ce ? ce->what_without_backtrace() : e.what());
    error = distError(q.failedOn() + why);
    if (logs(LogLevel::kWarn)) log(LogLevel::kWarn, q.failedOn() + why);
    if (failure != tcp::Device::Failure::kNone && failure != tcp::Device::Failure::kAborted) {
      trace_.dumpOnFailure(why, rank_, size_);
      runAbortHooks();
    }
  }
  running.reset();
  q.work->complete(error, error ? Clock::now() : end);
}

namespace {

// "1-16, 18, 20-63".
std::string rankRanges(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += collx::str(out.empty() ? "" : ", ", ranks[i], j > i ? collx::str("-", ranks[j]) : std::string());
    i = j + 1;
  }
  return out;
}

}  // namespace

std::string CollxBackend::whoIsMissing(std::chrono::milliseconds timeout) const {
  bool ofAll = false;
  const std::vector<int> missing = device().missing(&ofAll);
  if (missing.empty()) return "";
  std::string s = collx::str("timed out after ", timeout.count(), " ms with no data from ");
  for (size_t i = 0; i < missing.size(); ++i) {
    const int r = missing[i];
    s += collx::str(i ? ", " : "", "rank ", r);
    // Its last word, where it can be read without it (peers on this host).
    if (const auto p = device().peerProgress(r)) {
      if (p->started == 0) {
        s += " (it started no op)";
      } else {
        s += collx::str(" (its last op: ", name(p->startedKind), " #", p->started,
                        p->completed == p->started ? ", completed)" : ", in flight)");
      }
    }
  }
  if (ofAll) {
    std::vector<int> sent;
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && std::find(missing.begin(), missing.end(), r) == missing.end()) sent.push_back(r);
    }
    if (!sent.empty()) s += collx::str("; ", sent.size() == 1 ? "rank " : "ranks ", rankRanges(sent), " had sent");
  }
  return s + ". ";
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
  std::vector<int64_t> members(ranks.begin(), ranks.end());
  return c10::make_intrusive<CollxBackend>(store, int(it - ranks.begin()), int(ranks.size()), limit,
                                           configOf(members));
}

Config CollxBackend::configOf(const std::vector<int64_t>& members) const {
  // A group that was not told its global ranks (the default group) is numbered by them.
  const bool known = config_.globalRanks.size() == size_t(size_);
  Config config = config_;
  config.globalRanks.clear();
  for (int64_t r : members) config.globalRanks.push_back(known ? config_.globalRanks.at(size_t(r)) : uint64_t(r));
  return config;
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
  awaitSetup();
  const std::string refined = refiner_->describe();
  return tuning_.describe(size_, config_.treeArity) + (refined.empty() ? "" : "; " + refined);
}

TransportCounters CollxBackend::traffic() const {
  TransportCounters t = peers_->counters();
  if (const tcp::Device* d = published()) t += d->counters();
  return t;
}

Stats CollxBackend::stats() const {
  Stats s;
  {
    std::lock_guard<std::mutex> lock(statsMutex_);
    s = stats_;
  }
  s.traffic = traffic();
  if (const tcp::Device* d = published()) s.coreMoves = d->coreMoves();
  return s;
}

}  // namespace collx::torch_glue
