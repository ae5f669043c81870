#include "tracing.h"

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include <cstdlib>

#include "core/error.h"
#include "core/types.h"

namespace collx::torch_glue {

namespace {

// TORCH_FR_BUFFER_SIZE (or NCCL's name for it) set above 0: failures write dumps.
bool dumpsOnFailure() {
  for (const char* var : {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}) {
    if (const char* v = std::getenv(var)) return std::atoi(v) > 0;
  }
  return false;
}

std::atomic<size_t> nextGroupId{0};

}  // namespace

GroupTrace::GroupTrace(std::vector<uint64_t> globalRanks) : id(nextGroupId++), globalRanks(std::move(globalRanks)) {}

std::vector<uint64_t> GroupTrace::ranks(int size) const {
  if (globalRanks.size() == size_t(size)) return globalRanks;
  std::vector<uint64_t> out;
  for (int r = 0; r < size; ++r) out.push_back(uint64_t(r));
  return out;
}

void GroupTrace::dumpOnFailure(const std::string& why, int rank, int size) {
  if (!Recorder::get().enabled() || !dumpsOnFailure() || dumped.exchange(true)) return;
  try {
    // Without stack traces: symbolizing Python frames takes the GIL, which
    // the thread waiting on this op may hold. torch's writer: the file
    // $TORCH_FR_DUMP_TEMP_FILE<global rank>.
    c10d::DebugInfoWriter::getWriter(int(ranks(size).at(size_t(rank)))).write(Recorder::get().dump(true, false, false, why));
  } catch (const std::exception& e) {
    LOG(WARNING) << "collx: could not write the flight recorder's dump after '" << why << "': " << e.what();
  }
}

OpTrace::OpTrace(GroupTrace& group, const PgName& pgName, int rank, int size, std::string name, uint64_t seq,
                 bool isP2P, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                 std::chrono::milliseconds timeout)
    : group_(group), pgName_(pgName), rank_(rank), size_(size), name_(std::move(name)), seq_(seq), isP2P_(isP2P) {
  if (!isP2P) group.status->enqueued = int64_t(seq);
  Recorder& recorder = Recorder::get();
  if (recorder.enabled()) {
    if (!group.noted.exchange(true)) recorder.noteGroup(group.id, pgName_, group.ranks(size), group.status);
    id_ = recorder.record(group.id, pgName_, isP2P ? 0 : seq, isP2P ? seq : 0, name_, inputs, outputs, timeout,
                          isP2P);
  }
  if (profiling()) {
    tls_.emplace();
    for (const auto& t : inputs) inElems_ += t.numel();
    for (const auto& t : outputs) outElems_ += t.numel();
    if (!inputs.empty()) dtype_ = inputs[0].scalar_type();
  }
}

void OpTrace::posted() {
  if (id_) Recorder::get().started(*id_);
}

void OpTrace::retire(bool completed) {
  if (retired_.exchange(true)) return;
  if (id_) Recorder::get().retire(*id_, completed);
}

OpTrace::Running::Running(OpTrace& trace) : trace_(trace) {
  if (!trace.isP2P_) trace.group_.status->started = int64_t(trace.seq_);
  if (trace.id_) Recorder::get().started(*trace.id_);
  if (!trace.tls_) return;
  tls_.emplace(*trace.tls_);
  auto span = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (!span->isActive()) return;
  span->before("collx:" + trace.name_);
  span_ = std::move(span);
  // NCCL's form: the group's global ranks as a start and a stride.
  const auto ranks = trace.group_.ranks(trace.size_);
  const int start = int(ranks[0]), stride = ranks.size() > 1 ? int(ranks[1]) - int(ranks[0]) : 1;
  auto info = std::make_shared<torch::ParamCommsDebugInfo>(
      trace.pgName_, trace.rank_, std::string(trace.name_), trace.inElems_, trace.outElems_, trace.dtype_,
      std::vector<int64_t>{}, std::vector<int64_t>{}, start, stride, trace.size_);
  info->setSequenceInfo(int64_t(trace.seq_), trace.isP2P_);
  c10::DebugInfoGuard commsInfo(c10::DebugInfoKind::PARAM_COMMS_INFO, info);
  const std::vector<c10::IValue> args{int64_t(trace.seq_), trace.pgName_, trace.rank_, trace.name_, trace.inElems_,
                                      trace.outElems_};
  const c10::ArrayRef<const c10::IValue> params(args.data(), args.size());
  RECORD_FUNCTION(at::kParamCommsCallName, params);
}

void OpTrace::Running::finish(const std::string& label, const TransportCounters& before,
                              const TransportCounters& after) {
  finished_ = true;
  if (!trace_.isP2P_) trace_.group_.status->completed = int64_t(trace_.seq_);
  if (!span_) return;
  std::string via;
  for (int i = 0; i < kCarriers; ++i) {
    if (after.sent[i] == before.sent[i] && after.received[i] == before.received[i]) continue;
    via += collx::str(via.empty() ? "" : ",", name(Carrier(i)));
  }
  if (via.empty()) via = "none";
  at::RecordFunction mark(at::RecordScope::USER_SCOPE);
  if (mark.isActive()) {
    const std::unordered_map<std::string, c10::IValue> kwargs{{"algorithm", label}, {"carriers", via}};
    mark.before(collx::str("collx:", label, " via ", via), &kwargs);
    mark.end();
  }
}

OpTrace::Running::~Running() {
  if (span_) span_->end();
  span_.reset();
  tls_.reset();
  trace_.retire(finished_);
}

}  // namespace collx::torch_glue
