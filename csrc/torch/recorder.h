// collx's flight recorder: the last ops of every collx group in this
// process, in a ring of TORCH_FR_BUFFER_SIZE entries (default 2000, 0: off),
// dumped in the format of torch's (FlightRecorder.hpp: the same keys, states
// and pickle), so that torch's tools and torchcollx.fr read it.
//
// Why not torch's own: libtorch exports neither its recorder's instance nor
// its members, its template's definitions need a JSON library that torch does
// not ship, and its FlightRecorderHook records at issue only, as
// "c10d:<op>", never started or completed. collx knows when each op starts
// and ends on its thread, and records that.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace torch {
struct CapturedTraceback;
}

namespace collx::torch_glue {

using PgName = std::tuple<std::string, std::string>;  // the group's name and description

// A group's last collectives, for the dump's pg_status (-1: none yet).
struct GroupStatus {
  std::atomic<int64_t> enqueued{-1}, started{-1}, completed{-1};
};

class Recorder {
 public:
  static Recorder& get();
  bool enabled() const { return capacity_ > 0; }

  // The group's members (global ranks) and status, for the dump's pg_config
  // and pg_status; once per group.
  void noteGroup(size_t pgId, const PgName& name, std::vector<uint64_t> ranks, std::shared_ptr<GroupStatus> status);
  // A new entry, "scheduled"; its id, or none when off.
  std::optional<uint64_t> record(size_t pgId, const PgName& pgName, uint64_t collectiveSeq, uint64_t p2pSeq,
                                 std::string name, const std::vector<at::Tensor>& inputs,
                                 const std::vector<at::Tensor>& outputs, std::chrono::milliseconds timeout,
                                 bool isP2P);
  void started(uint64_t id);
  // Out of flight: completed now, or left as it is (failed, or never run).
  void retire(uint64_t id, bool completed);

  // torch's pickled dump (dump_fr_trace's format); `failure`, when given,
  // under "collx_failure": the error that made a rank write it.
  std::string dump(bool includeCollectives, bool includeStackTraces, bool onlyActive,
                   const std::string& failure = "");

 private:
  Recorder();
  // Filled in place in its slot, whose buffers stay from entry to entry:
  // recording allocates nothing once the ring is full.
  struct Entry {
    uint64_t id = UINT64_MAX;
    size_t pgId = 0;
    PgName pgName;
    uint64_t collectiveSeq = 0, p2pSeq = 0;
    std::string name;  // without the "collx:" of the dump
    int64_t created = 0;  // ns since the epoch
    int64_t timeoutMs = 0;
    bool isP2P = false;
    // Every tensor's dims, inputs then outputs; each one's rank and dtype.
    c10::SmallVector<int64_t, 8> dims;
    c10::SmallVector<int64_t, 4> inputRanks, outputRanks;
    c10::SmallVector<c10::ScalarType, 4> inputDtypes, outputDtypes;
    std::optional<int64_t> started, completed;
    bool retired = false;
    std::thread::id thread;
    std::string threadName;
    std::shared_ptr<torch::CapturedTraceback> traceback;
  };
  Entry* find(uint64_t id);  // under mu_

  const size_t capacity_;
  const bool stacks_;  // COLLX_FR_STACK, read as torch reads its boolean variables (1/0, true/false, ...)
  std::mutex mu_;
  std::vector<Entry> entries_;  // entries_[id % capacity_]
  uint64_t nextId_ = 0;
  std::map<PgName, std::vector<uint64_t>> ranks_;
  std::map<size_t, std::shared_ptr<GroupStatus>> status_;
};

}  // namespace collx::torch_glue
