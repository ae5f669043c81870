// What torch's tools see of collx's ops: a torch.profiler span per op, and
// an entry per op in collx's flight recorder (recorder.h).
//
// Profiler: when a profiler (any RecordFunction callback) is on at enqueue,
// the op's run on collx's thread is a span "collx:<op>" under the caller's
// profiler state; in it, "record_param_comms" carries NCCL's metadata
// (counts, dtype, group, ranks, sequence number) and, at its end,
// "collx:<op>/<algorithm> via <carriers>" names what collx chose.
#pragma once

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/transport/transport.h"
#include "recorder.h"

namespace collx::torch_glue {

// One group's identity in traces.
struct GroupTrace {
  explicit GroupTrace(std::vector<uint64_t> globalRanks);
  const size_t id;  // process-wide, in creation order
  // Of each group rank; where unknown or of another size, ranks are their own.
  const std::vector<uint64_t> globalRanks;
  const std::shared_ptr<GroupStatus> status = std::make_shared<GroupStatus>();
  std::atomic<bool> noted{false};   // in the recorder's pg_config
  std::atomic<bool> dumped{false};  // a failure wrote this rank's dump
  std::vector<uint64_t> ranks(int size) const;
  // Writes the recorder's dump for this rank's failure, once per group,
  // where TORCH_FR_DUMP_TEMP_FILE says, if TORCH_FR_BUFFER_SIZE is set > 0.
  void dumpOnFailure(const std::string& why, int rank, int size);
};

// One op's trace, made at enqueue on the caller's thread.
class OpTrace {
 public:
  // Whether an op made now has anything to trace: the recorder is on, or a
  // profiler (some RecordFunction callback) is.
  static bool wanted() {
    static const bool recording = Recorder::get().enabled();
    return recording || profiling();
  }
  // A profiler (some RecordFunction callback) is on: the caller's thread's
  // first, the cheaper check.
  static bool profiling() { return at::hasThreadLocalCallbacks() || at::hasGlobalCallbacks(); }

  // `name`: the op ("all_reduce", or "send 0->1"); `seq`: its collective
  // sequence number, or for a p2p op the group's p2p count.
  OpTrace(GroupTrace& group, const PgName& pgName, int rank, int size, std::string name, uint64_t seq, bool isP2P,
          const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
          std::chrono::milliseconds timeout);
  ~OpTrace() { retire(); }

  // The op's run, on the thread that runs it: the span and the recorder's
  // "started" from construction; finish() completes the entry; the
  // destructor ends the span and retires the entry, which stays "started"
  // without finish() (the op failed), as a timed-out op does in NCCL's.
  class Running {
   public:
    explicit Running(OpTrace& trace);
    ~Running();
    // `label`: what ran ("all_reduce/ring"); the carriers' counters before
    // and after it, for the span's "via".
    void finish(const std::string& label, const TransportCounters& before, const TransportCounters& after);
    bool profiling() const { return span_ != nullptr; }

   private:
    OpTrace& trace_;
    bool finished_ = false;
    std::optional<at::ThreadLocalStateGuard> tls_;
    std::unique_ptr<at::RecordFunction> span_;
  };

  // A p2p op, which progresses on its own: posted, so "started" (no span).
  void posted();
  // Takes the entry out of flight: `completed`, or failed (or never run,
  // cancelled at abort) and left in its state. Idempotent.
  void retire(bool completed = false);

 private:
  GroupTrace& group_;
  const PgName pgName_;
  const int rank_, size_;
  const std::string name_;
  const uint64_t seq_;
  const bool isP2P_;
  std::optional<uint64_t> id_;  // in the recorder
  std::atomic<bool> retired_{false};
  // For the span, when a profiler is on: the caller's state, and what NCCL's
  // record_param_comms carries.
  std::optional<at::ThreadLocalState> tls_;
  int64_t inElems_ = 0, outElems_ = 0;
  at::ScalarType dtype_ = at::kByte;
};

}  // namespace collx::torch_glue
