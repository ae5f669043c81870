// The c10d::Backend of collx. Thin on purpose: it validates tensors, maps
// dtypes and reduce ops onto the core, and queues each op on the group's
// Executor; the core does the communication. The ops live in ops_*.cc, the
// mesh's coming and going in lifecycle.cc.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "core/algorithms/algorithms.h"
#include "core/algorithms/calibrate.h"
#include "core/algorithms/refine.h"
#include "core/executor.h"
#include "core/transport/device.h"
#include "log.h"
#include "peer_allreduce.h"
#include "staging.h"
#include "tracing.h"

namespace collx::torch_glue {

class CollxWork;
class StoreAdapter;
class TuningTurns;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

struct Config {
  Algorithm algorithm = Algorithm::kAuto;
  int treeArity = 2;
  size_t segmentBytes = 512 << 10;
  std::string ifname;
  int family = AF_UNSPEC;
  shm::Mode transport = shm::Mode::kAuto;  // COLLX_TRANSPORT (core/transport/shm/links.h)
  shm::ReadPeers readPeers = shm::ReadPeers::kWherePays;  // COLLX_SHM_CMA: cross-memory attach
  std::string localCongestion = "reno";    // COLLX_TCP_CONGESTION within a host; "": the system's
  bool lazy = true;                        // COLLX_CONNECT: lazy or eager (core/transport/device.h)
  int lanes = 1;                           // COLLX_SOCKETS_PER_PEER (core/transport/device.h)
  bool stageCpuTensors = false;  // COLLX_STAGE_CPU_TENSORS: CPU tensors take the device path (tests)
  size_t deviceReduceMinBytes = kDeviceReduceMinBytes;  // COLLX_DEVICE_REDUCE_MIN_BYTES (staging.h)
  size_t stagingChunkBytes = kPipelineChunkBytes;       // COLLX_STAGING_CHUNK_BYTES (staging.h)
  size_t peerBufferBytes = kPeerBufferBytes;            // COLLX_PEER_BUFFER_BYTES (peer_allreduce.h)
  size_t peerMinBytes = kPeerMinBytes;                  // COLLX_PEER_MIN_BYTES (staging.h)
  LogLevel logLevel = LogLevel::kOff;                    // COLLX_DEBUG (log.h)
  std::vector<uint64_t> globalRanks;  // of each rank of the group, for traces (tracing.h)
  bool tracing = true;  // COLLX_TRACING: profiler spans and flight-recorder entries (tracing.h)
  TuningPolicy tuning;  // COLLX_TUNING: calibrate (default), table, or a file (core/algorithms/calibrate.h)
};

struct OpStats {
  uint64_t calls = 0;
  double seconds = 0;
};

struct Stats {
  uint64_t ops = 0;
  TransportCounters traffic;  // bytes to and from the peers, by carrier
  uint64_t stagedOps = 0;         // ops on device tensors, run through host mirrors
  uint64_t deviceReductions = 0;  // reductions of those ops that ran on the device
  uint64_t inTensorReductions = 0;  // those of them that reduced into the user's tensor
  uint64_t coreMoves = 0;  // times a wait moved this rank's thread off a core a local peer ran on
  std::map<std::string, OpStats> perAlgorithm;  // "all_reduce/ring", "broadcast/tree", ...
};

class CollxBackend : public c10d::Backend {
 public:
  // How a new group connects: before the constructor returns (kNow); in the
  // background, the constructor returning once this rank is announced in the
  // Store (kLater: torch's group creation, see lifecycle.cc); or not until
  // reconfigure() (kNone: enable_reconfigure).
  enum class Connect { kNow, kLater, kNone };
  CollxBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
               std::chrono::milliseconds timeout, Config config, Connect connect = Connect::kNow);
  ~CollxBackend() override;

  const std::string getBackendName() const override { return "collx"; }

  // ops_reduce.cc
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  // ops_sparse.cc: a COO tensor, SUM (gloo's algorithm and results).
  c10::intrusive_ptr<c10d::Work> allreduceSparse(const at::Tensor& tensor, const c10d::AllreduceOptions& opts);
  // all_reduce with the algorithm chosen per call (the DDP comm hook's
  // entry); `algorithm` kAuto defers to the cost model. `callerWaits`: the
  // caller waits on the Work at once, which then runs in its thread, as a
  // synchronous all_reduce does.
  c10::intrusive_ptr<c10d::Work> allreduceWith(at::Tensor& tensor, const c10d::ReduceOp& op,
                                               Algorithm algorithm, bool callerWaits = false);

  // ops_gather.cc
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;

  // ops_p2p.cc: send/recv progress on their own, as gloo's do;
  // batch_isend_irecv posts a batch under one Work.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // backend.cc
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;  // monitored_barrier.cc
  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }
  void setSequenceNumberForGroup() override {}  // sequence numbers start at 0 on every rank
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<c10d::Backend::Options>& opts) override;
  void shutdown() override;  // lifecycle.cc

  // Fault tolerance (fault_tolerance.cc): torch 2.14's virtuals. Those that
  // older torch lacks carry no `override`, so the glue builds against both.
  void setTimeout(std::chrono::milliseconds timeout);
  c10d::ErrorType getError() override;
  // Fails every queued and in-flight op now, tells the peers, releases the
  // connections. Idempotent, from any thread, before or after shutdown().
  void abort() override;
#ifdef C10D_BACKEND_HAS_HOOKS
  void registerAbortHook(int64_t id, c10d::AbortHook hook) override;
  void unregisterAbortHook(int64_t id) override;
#endif
  bool supportsShrinking() const { return true; }
  // Reconfigure (reconfigure.cc), as gloo has it: a handle names this
  // process in this group; reconfigure(uuid, handles) forms a new mesh of
  // the handles' processes in the group's store, failing what the old one
  // had in flight.
  bool supportsReconfigure() const { return true; }
  std::string get_reconfigure_handle() const;
#ifdef C10D_BACKEND_HAS_RECONFIGURE
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override;
#endif
  // A new group of the ranks not in `exclude`, renumbered in order; every
  // survivor calls it with the same list, which they check.
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& exclude, int flags = 0,
                                           const c10::intrusive_ptr<c10d::Backend::Options>& opts = nullptr);

  Stats stats() const;
  TransportCounters traffic() const;  // bytes to and from the peers, by carrier
  const std::string& transportNote() const { return device().transportNote(); }
  const Config& config() const { return config_; }
  // Host index of every rank, from the addresses the ranks published
  // (rendezvous.h), and what "auto" runs for an all-reduce of `bytes` here.
  std::vector<int> hosts() const;
  Algorithm autoAllreduce(size_t bytes) const;
  // Whether online refinement is still trying algorithms for `bytes`.
  bool refining(size_t bytes) const;
  const Tuning& tuning() const {
    awaitSetup();
    return tuning_;
  }
  // The model's constants and crossovers, then what online refinement kept.
  std::string describeTuning() const;

 private:
  // This group's settings for a new group of `members` (ranks of this one):
  // the same, with the members' global ranks.
  Config configOf(const std::vector<int64_t>& members) const;
  // What auto takes for `bytes` by its rules and model, before refinement.
  Algorithm autoBeforeRefining(size_t bytes) const;
  // Runs on the executor (or inline in a waiting caller); returns the stats
  // label of what ran.
  using Body = std::function<std::string(const Collective&)>;

  // Runs a collective's entry point. If it rejects its input (throws before
  // queueing), the op still takes its sequence number and the peers hear why
  // (Device::cancel): a peer running the op fails now, not at its timeout.
  template <typename Fn>
  c10::intrusive_ptr<c10d::Work> validated(OpKind kind, bool callerWaits, Fn&& fn);
  void cancelRejected(OpKind kind, const std::exception& e);
  // After a timeout broke the group: "timed out after N ms with no data
  // from rank r (its last op: ...). ", naming the peers its wait lacked.
  std::string whoIsMissing(std::chrono::milliseconds timeout) const;

  bool logs(LogLevel level) const { return config_.logLevel >= level; }
  void log(LogLevel level, const std::string& message) const { logLine(level, rank_, size_, message); }

  // Queues a collective (numbered in the group's sequence) or a p2p op.
  // `inputs`, for traces: the op's inputs where they are not its outputs.
  c10::intrusive_ptr<CollxWork> enqueue(c10d::OpType type, OpKind kind, DataType dtype,
                                        std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout,
                                        Body body, bool collective = true, std::vector<at::Tensor> inputs = {});
  struct Queued;
  // Runs a queued op (on the executor, or inline in its waiting caller) and completes its Work.
  void runQueued(Queued& q);
  // The group's name and description, as torch set them.
  PgName pgName() const { return {getGroupUid(), getGroupDesc()}; }
  // Device tensors (and CPU ones under stageCpuTensors) get a Staging; the
  // op then reruns itself on host mirrors inside runStaged. Null: run as is.
  std::shared_ptr<Staging> stagingFor(const std::vector<at::Tensor>& tensors, const char* op);
  template <typename Fn>
  c10::intrusive_ptr<c10d::Work> runStaged(std::shared_ptr<Staging> staging, Fn&& op) {
    Staging::Scope scope(std::move(staging));
    return op();
  }
  // An op on `tensors` (a tensor or a list), which it reads if `copyIn` and
  // writes if `copyOut`: when they need staging, reruns it as op(hostTensors)
  // on their mirrors; null otherwise. onMirrors: the same for an op that
  // writes `outputs` from `inputs`, as op(hostOutputs, hostInputs). Both are
  // defined in op_helpers.h.
  template <typename Tensors, typename Op>
  WorkPtr onMirror(const char* name, Tensors& tensors, bool copyIn, bool copyOut, Op&& op);
  template <typename Outs, typename Ins, typename Op>
  WorkPtr onMirrors(const char* name, Outs& outputs, Ins& inputs, Op&& op);
  // All-reduce of `tensors` (in place) as one flat buffer.
  c10::intrusive_ptr<c10d::Work> allreduceFlat(c10d::OpType type, std::vector<at::Tensor> tensors,
                                               const c10d::ReduceOp& op, Algorithm algorithm,
                                               std::chrono::milliseconds timeout);

  struct P2POp {
    bool isSend;
    int peer;  // kAnySource for a receive from any source
    int tag;
    at::Tensor tensor;
  };
  // Posts the ops on the p2p channel under one Work.
  c10::intrusive_ptr<c10d::Work> postP2P(std::vector<P2POp> ops, c10d::OpType type);
  // Runs one send or receive, or records it while coalescing.
  c10::intrusive_ptr<c10d::Work> addP2P(P2POp op, c10d::OpType type);

  // lifecycle.cc. Takes lifecycleMutex_ (abort, shutdown); false, not
  // taken, when called from inside an op's task while a teardown holds it.
  bool lockLifecycle(std::unique_lock<std::mutex>& lock);
  // Fails the ops in flight (`inFlight`), queued (`queued`) and pending on
  // p2p (`pending`), waits for the one in flight, closes the connections.
  // `tellPeers`: the peers hear it as this rank's abort.
  void closeMesh(const std::string& inFlight, const std::string& queued, const std::string& pending, bool tellPeers);
  // Builds the mesh of `size` ranks in `store` (this one is `rank`), then tunes.
  void connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size);
  // The same, returning once this rank is announced: the rest runs as the
  // executor's first task, on its own client of the Store where it has one.
  void connectLater(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size);
  // This rank's record in the Store (rendezvous.h's steps 1 and 2).
  tcp::Directory announce(StoreAdapter& adapter, int rank, int size) const;
  // The rest: the table, the Device, the tuning (in `ticket`'s turn among
  // this rank's groups), the log line.
  void build(StoreAdapter& adapter, tcp::Directory announced, Clock::time_point start, uint64_t requestsBefore,
             TuningTurns& turns, uint64_t ticket);
  // The turns of this rank's groups (lifecycle.cc), by its global rank.
  TuningTurns& tuningTurns() const;
  // The transport, once connected (awaitSetup()); a clear error before the
  // first reconfigure().
  tcp::Device& device() const;
  // Outside the executor, waits for a background setup; throws why it failed.
  void awaitSetup() const;
  // device_ as another thread may read it while a setup runs (null before).
  tcp::Device* published() const;

  // Fits auto's cost model to this group (or takes the table, a file, the
  // cache): the group's first exchange, before any op.
  void tune();
  // tune(), or the table where a member left during setup (lifecycle.cc).
  void tuneOrTable();

  // The group's timeout now: dist.set_timeout changes it for later ops.
  std::chrono::milliseconds timeout() const { return timeout_.load(); }
  // The first failure of an op or of the group, kept for getError (p2p ops
  // report theirs here; the collectives' is the device's).
  void noteFailure(tcp::Device::Failure kind);
  // Runs the abort hooks once, before the first failure breaking the group
  // reaches its ops' Works.
  void runAbortHooks();
  std::string abortedMessage() const;

  const Config config_;
  GroupTrace trace_{config_.globalRanks};  // its identity in torch's profiler and flight recorder
  std::atomic<uint64_t> p2pSeq_{0};        // p2p ops posted, for the flight recorder
  const c10::intrusive_ptr<c10d::Store> store_;  // the group's; shrink meets in it
  std::atomic<std::chrono::milliseconds> timeout_;
  std::atomic<bool> timeoutSet_{false};  // by dist.set_timeout
  std::atomic<bool> aborted_{false};
  std::atomic<bool> destroyed_{false};  // by shutdown(): reconfigure() refuses
  std::mutex lifecycleMutex_;  // abort() and shutdown() run one at a time
  std::atomic<tcp::Device::Failure> p2pFailure_{tcp::Device::Failure::kNone};
  mutable std::mutex hooksMutex_;  // also guards groupToken_
  std::map<int64_t, std::function<void()>> abortHooks_;
  bool hooksRan_ = false;  // under hooksMutex_
  uint64_t shrinks_ = 0;   // shrinks of this group so far: the same on every survivor
  // Reconfigure: this process's id in the group (host, pid, a random
  // number), the group's token (agreed in the store), the uuids used.
  const std::string member_;
  mutable std::string groupToken_;  // under hooksMutex_, made on first use
  int64_t uuid_ = -1;
  std::set<int64_t> usedUuids_;
  std::unique_ptr<tcp::Device> device_;  // null until connected (set under setupMutex_)
  // A background setup (Connect::kLater): settingUp_ until it ends, then
  // setupFailed_ and setupError_ say whether and why it failed;
  // setupInterrupted_ stops its Store waits and setupWakeFd_ its connects
  // (closeMesh).
  mutable std::mutex setupMutex_;
  mutable std::condition_variable setupEnded_;
  std::atomic<bool> settingUp_{false};
  std::atomic<bool> setupFailed_{false};
  std::string setupError_;
  std::atomic<bool> setupInterrupted_{false};
  int setupWakeFd_ = -1;  // an eventfd closeMesh signals, then closes: the setup's connects stop
  std::atomic<bool> shutDown_{false};
  std::atomic<uint64_t> seq_{0};
  Workspace workspace_;  // the algorithms' scratch; one op runs at a time
  Tuning tuning_ = Tuning::table();  // auto's cost model, fitted at creation
  std::unique_ptr<Refiner> refiner_ = std::make_unique<Refiner>();  // its online refinement (calibrate)
  Workspace copies_;     // the glue's private copies of inputs (flatCopy)
  std::unique_ptr<PeerAllreduce> peers_ =
      std::make_unique<PeerAllreduce>(config_.peerBufferBytes, config_.logLevel);  // executor thread only
  std::mutex coalesceMutex_;
  bool coalescing_ = false;
  std::vector<P2POp> coalesced_;
  std::shared_ptr<Staging> coalescedStaging_;  // the batch's mirrors, when it has device tensors
  mutable std::mutex statsMutex_;
  Stats stats_;
  // Shared with the Works, which may run their op inline (see Executor).
  std::shared_ptr<Executor> executor_ = std::make_shared<Executor>();
};

// Entry points nest (allgather_coalesced calls allgather): only the outermost
// one in this thread cancels, and says whether its caller waits at once
// (the op's asyncOp is false: torch waits on the Work before returning).
inline thread_local int tEntryDepth = 0;
inline thread_local bool tCallerWaits = false;

template <typename Fn>
c10::intrusive_ptr<c10d::Work> CollxBackend::validated(OpKind kind, bool callerWaits, Fn&& fn) {
  if (tEntryDepth++ == 0) tCallerWaits = callerWaits;
  try {
    auto work = fn();
    if (--tEntryDepth == 0) tCallerWaits = false;
    return work;
  } catch (const std::exception& e) {
    if (--tEntryDepth == 0) {
      tCallerWaits = false;
      cancelRejected(kind, e);
    }
    throw;
  }
}

}  // namespace collx::torch_glue
