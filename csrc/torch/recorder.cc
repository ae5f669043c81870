#include "recorder.h"

#include <c10/util/ApproximateClock.h>
#include <c10/util/thread_name.h>
#include <torch/csrc/distributed/c10d/Utils.hpp>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <sstream>

namespace collx::torch_glue {

namespace {

// torch's dump helpers (TraceUtils.h) are inline over fmt, which libtorch
// does not export: the same forms, here.
c10::Dict<c10::IValue, c10::IValue> newDict() {
  return c10::Dict<c10::IValue, c10::IValue>(c10::AnyType::get(), c10::AnyType::get());
}
c10::List<c10::IValue> newList() { return c10::List<c10::IValue>(c10::AnyType::get()); }

std::string pickled(const c10::IValue& v) {
  std::string out;
  torch::jit::Pickler pickler([&](const char* data, size_t size) { out.append(data, size); }, nullptr, nullptr,
                              nullptr, nullptr, false);
  pickler.protocol();
  pickler.pushIValue(v);
  pickler.stop();
  return out;
}

std::string ranksText(const std::vector<uint64_t>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out + "]";
}

void describe(const std::vector<at::Tensor>& ts, c10::SmallVector<int64_t, 8>& dims,
              c10::SmallVector<int64_t, 4>& ranks, c10::SmallVector<c10::ScalarType, 4>& dtypes) {
  ranks.clear();
  dtypes.clear();
  for (const auto& t : ts) {
    dims.append(t.sizes().begin(), t.sizes().end());
    ranks.push_back(t.dim());
    dtypes.push_back(t.scalar_type());
  }
}

// The dims of `ranks.size()` tensors from `at` on, as a list of lists.
c10::List<c10::IValue> sizesList(const int64_t*& at, const c10::SmallVector<int64_t, 4>& ranks) {
  auto out = newList();
  for (int64_t rank : ranks) {
    auto dims = newList();
    for (int64_t i = 0; i < rank; ++i) dims.push_back(*at++);
    out.push_back(dims);
  }
  return out;
}

std::vector<std::string> dtypeNames(const c10::SmallVector<c10::ScalarType, 4>& dtypes) {
  std::vector<std::string> out;
  for (auto t : dtypes) out.emplace_back(c10::toString(t));
  return out;
}

c10::IValue timeOrNone(const std::optional<int64_t>& t) { return t ? c10::IValue(*t) : c10::IValue(); }

}  // namespace

Recorder& Recorder::get() {
  static Recorder* instance = new Recorder();  // never destroyed: ops may record during exit
  return *instance;
}

Recorder::Recorder()
    : capacity_(size_t(std::max(0, c10d::getCvarInt({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000)))),
      stacks_(c10d::getCvarBool({"COLLX_FR_STACK"}, true)) {}

void Recorder::noteGroup(size_t pgId, const PgName& name, std::vector<uint64_t> ranks,
                         std::shared_ptr<GroupStatus> status) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> lock(mu_);
  ranks_[name] = std::move(ranks);
  status_[pgId] = std::move(status);
}

std::optional<uint64_t> Recorder::record(size_t pgId, const PgName& pgName, uint64_t collectiveSeq, uint64_t p2pSeq,
                                         std::string name, const std::vector<at::Tensor>& inputs,
                                         const std::vector<at::Tensor>& outputs, std::chrono::milliseconds timeout,
                                         bool isP2P) {
  if (!enabled()) return std::nullopt;
  auto traceback = stacks_ ? torch::CapturedTraceback::gather(/*python=*/true, /*script=*/true, /*cpp=*/false)
                           : nullptr;
  thread_local const std::string threadName = c10::getThreadName();  // a system call: once per thread
  const int64_t now = c10::getTime();
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = nextId_++;
  if (entries_.size() < capacity_) entries_.emplace_back();
  Entry& e = entries_[id % capacity_];
  e.id = id;
  e.pgId = pgId;
  e.pgName = pgName;
  e.collectiveSeq = collectiveSeq;
  e.p2pSeq = p2pSeq;
  e.name = std::move(name);
  e.created = now;
  e.timeoutMs = timeout.count();
  e.isP2P = isP2P;
  e.dims.clear();
  describe(inputs, e.dims, e.inputRanks, e.inputDtypes);
  describe(outputs, e.dims, e.outputRanks, e.outputDtypes);
  e.started.reset();
  e.completed.reset();
  e.retired = false;
  e.thread = std::this_thread::get_id();
  e.threadName = threadName;
  e.traceback = std::move(traceback);
  return id;
}

Recorder::Entry* Recorder::find(uint64_t id) {
  if (entries_.empty()) return nullptr;
  Entry& e = entries_[id % capacity_];
  return e.id == id ? &e : nullptr;
}

void Recorder::started(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Entry* e = find(id)) e->started = c10::getTime();
}

void Recorder::retire(uint64_t id, bool completed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Entry* e = find(id)) {
    e->retired = true;
    if (completed) e->completed = c10::getTime();
  }
}

std::string Recorder::dump(bool includeCollectives, bool includeStackTraces, bool onlyActive,
                           const std::string& failure) {
  std::vector<Entry> entries;
  auto result = newDict();
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Oldest first: the ring's slots from the next one to write.
    const size_t n = entries_.size(), from = n < capacity_ ? 0 : size_t(nextId_ % capacity_);
    if (includeCollectives) {
      for (size_t i = 0; i < n; ++i) entries.push_back(entries_[(from + i) % n]);
    }
    auto config = newDict();
    for (const auto& [name, ranks] : ranks_) {
      auto info = newDict();
      info.insert("name", std::get<0>(name));
      info.insert("desc", std::get<1>(name));
      info.insert("ranks", ranksText(ranks));
      config.insert(std::get<0>(name), info);
    }
    auto status = newDict();
    for (const auto& [id, s] : status_) {
      auto d = newDict();
      d.insert("last_enqueued_collective", s->enqueued.load());
      d.insert("last_started_collective", s->started.load());
      d.insert("last_completed_collective", s->completed.load());
      status.insert(std::to_string(id), d);
    }
    result.insert("version", "2.10");
    result.insert("pg_config", config);
    result.insert("comm_lib_version", "collx");
    result.insert("pg_status", status);
    if (!failure.empty()) result.insert("collx_failure", failure);
  }
  if (!includeCollectives) return pickled(result);

  // Entries recorded without a stack (COLLX_FR_STACK=0) have no traceback to
  // symbolize: frames.tracebacks holds those of the others, in order.
  torch::SymbolizedTracebacks frames;
  std::vector<c10::IValue> allFrames;
  if (includeStackTraces) {
    std::vector<torch::CapturedTraceback*> tracebacks;
    for (auto& e : entries) {
      if (e.traceback) tracebacks.push_back(e.traceback.get());
    }
    frames = torch::symbolize(tracebacks);
    for (const auto& f : frames.all_frames) {
      auto d = newDict();
      d.insert("name", f.funcname);
      d.insert("filename", f.filename);
      d.insert("line", int64_t(f.lineno));
      allFrames.emplace_back(std::move(d));
    }
  }
  auto list = newList();
  size_t traced = 0;  // entries with a traceback so far
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    const bool stacked = includeStackTraces && e.traceback;
    if (stacked) ++traced;
    if (onlyActive && e.completed) continue;
    auto d = newDict();
    if (includeStackTraces) {
      auto stack = newList();
      if (stacked) {
        for (auto f : frames.tracebacks.at(traced - 1)) stack.push_back(allFrames.at(f));
      }
      d.insert("frames", stack);
    }
    std::ostringstream thread;
    thread << e.thread;
    d.insert("record_id", int64_t(e.id));
    d.insert("pg_id", int64_t(e.pgId));
    d.insert("process_group", e.pgName);
    d.insert("thread_name", e.threadName);
    d.insert("thread_id", thread.str());
    d.insert("collective_seq_id", int64_t(e.collectiveSeq));
    d.insert("p2p_seq_id", int64_t(e.p2pSeq));
    d.insert("op_id", int64_t(e.isP2P ? e.p2pSeq : e.collectiveSeq));
    d.insert("profiling_name", "collx:" + e.name);
    d.insert("time_created_ns", e.created);
    if (e.started && e.completed) d.insert("duration_ms", double(*e.completed - *e.started) / 1e6);
    const int64_t* dims = e.dims.data();
    d.insert("input_sizes", sizesList(dims, e.inputRanks));
    d.insert("input_dtypes", dtypeNames(e.inputDtypes));
    d.insert("output_sizes", sizesList(dims, e.outputRanks));
    d.insert("output_dtypes", dtypeNames(e.outputDtypes));
    d.insert("state", e.completed ? "completed" : e.started ? "started" : "scheduled");
    d.insert("time_discovered_started_ns", timeOrNone(e.started));
    d.insert("time_discovered_completed_ns", timeOrNone(e.completed));
    d.insert("retired", e.retired);
    d.insert("timeout_ms", e.timeoutMs);
    d.insert("is_p2p", e.isP2P);
    list.push_back(d);
  }
  result.insert("entries", list);
  return pickled(result);
}

}  // namespace collx::torch_glue
