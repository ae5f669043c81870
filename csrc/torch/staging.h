// Collectives on device (CUDA) tensors. The core moves host bytes, so an op
// on device tensors runs the CPU op on host mirrors of them:
//
//   caller thread                     executor thread, collx's own stream
//   ------------------------------    --------------------------------------
//   mirror each tensor (pinned host)
//   record an event on the caller's   wait for that event
//   current stream                    D2H the inputs into their mirrors, sync
//                                     run the CPU op on the mirrors; every
//                                     reduction of >= deviceReduceMinBytes
//                                     runs on the GPU (below)
//                                     H2D the outputs into the user's tensors,
//                                     sync; complete the Work and the Future
//
// A reduction on the GPU, dst = op(dst, src) for host dst and src:
//   - dst in the mirror of a tensor that is the op's input and output (an
//     all-reduce, a reduce's root): H2D src into device scratch, the kernel
//     reduces into the tensor itself, D2H the result into dst: one copy
//     less. The tensor holds dst's values: it was copied in, and until its
//     last reduction into those bytes an op writes them only by reductions
//     (the algorithms' receives into their buffer, as in a ring's
//     all-gather, come after: core/algorithms/algorithms.h). PREMUL_SUM's
//     pre-scale and the hierarchical all-reduce write the mirror first, so
//     those ops ask for reduceFn(..., intoTensor=false).
//   - otherwise: H2D dst and src into device scratch, kernel, D2H dst.
//
// The Work finishes only after the op stream has synchronized, so wait() and
// the Future's callbacks see finished data on any stream. wait() blocks the
// host until then, as gloo's does: letting the caller's stream wait instead
// would need a GPU-side wait on a host flag (cuStreamWaitValue32), which
// CUDA warns may deadlock when the scheduler serializes the streams, since
// the op's own copies are ordered behind it only through the host.
//
// A large all-reduce of one tensor is pipelined by chunk instead: every
// chunk's D2H is queued at once, and chunk i's collective starts when its
// D2H is done, while later chunks are still copying down and earlier ones
// copying back up:
//
//   copy stream   D2H 0 | D2H 1 | D2H 2 |        H2D 0 |  H2D 1 |  H2D 2
//   host                  [ all-reduce 0 ][ all-reduce 1 ][ all-reduce 2 ]
//
// An auto group on one host whose ranks share one GPU all-reduces a large
// tensor without the host instead: peer_allreduce.h. It claims the tensor's
// mirror, as the pipeline does, and stages it when the group cannot.
//
// COLLX_STAGE_CPU_TENSORS=1 sends CPU tensors down this same path, with plain
// copies and CPU kernels for the "device" reductions and memfd segments for
// the peers' buffers: the CPU test suite then exercises the staging logic
// that CUDA tensors use.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/reduce/reduce.h"
#include "peer_buffers.h"

namespace collx::torch_glue {

// Default of COLLX_DEVICE_REDUCE_MIN_BYTES: off. The operands of a staged
// reduction lie in host memory, and reducing them on the GPU moves two
// buffers over PCIe and syncs a stream where the host moves none, which made
// large all-reduces slower (docs/measurements.md).
constexpr size_t kDeviceReduceMinBytes = SIZE_MAX;
// Default of COLLX_STAGING_CHUNK_BYTES: a pipelined all-reduce runs in chunks
// of this many bytes, for tensors of >= 2 chunks. Each chunk's wait for its
// copy costs a turn on a GPU that ranks time-share, and with shared memory
// the CPU op is fast enough for that to show, so chunks are few and large;
// 8 MiB measured best of 4, 8, 16 MiB and none (docs/measurements.md).
constexpr size_t kPipelineChunkBytes = 8 << 20;
// Default of COLLX_PEER_BUFFER_BYTES: the largest device buffer each rank
// maps for the all-reduce through peers' buffers (peer_allreduce.h); larger
// tensors run in chunks of it.
constexpr size_t kPeerBufferBytes = 64 << 20;
constexpr size_t kPeerBufferMinBytes = 4096;  // the least COLLX_PEER_BUFFER_BYTES accepted
// Default of COLLX_PEER_MIN_BYTES: smaller tensors are staged on the host
// instead. With ranks time-sharing one GPU, each of the peers path's two GPU
// phases waits for every rank's turn, so its time is flat at small sizes,
// where staging is faster; the two cross near 2 MiB (docs/measurements.md).
constexpr size_t kPeerMinBytes = 2 << 20;

class Staging {
 public:
  // A staging for the device of `tensors` (all on one device), or null when
  // they are CPU tensors and `stageCpu` is off. Raises DistBackendError for
  // mixed devices, an unsupported device, or CUDA tensors in a build without
  // CUDA.
  // Reductions of >= `deviceReduceMinBytes` run on the device; an all-reduce
  // pipelines in chunks of `chunkBytes`.
  static std::shared_ptr<Staging> create(const std::vector<at::Tensor>& tensors, bool stageCpu,
                                         size_t deviceReduceMinBytes, size_t chunkBytes, const char* op, int rank);

  Staging(size_t deviceReduceMinBytes, size_t chunkBytes)
      : deviceReduceMinBytes_(deviceReduceMinBytes), chunkBytes_(chunkBytes) {}
  virtual ~Staging() = default;

  // A host tensor standing in for `device`: filled from it before the op
  // (copyIn) and/or written back to it after the op (copyOut).
  at::Tensor mirror(const at::Tensor& device, bool copyIn, bool copyOut);
  std::vector<at::Tensor> mirror(const std::vector<at::Tensor>& device, bool copyIn, bool copyOut);
  std::vector<std::vector<at::Tensor>> mirror(const std::vector<std::vector<at::Tensor>>& device, bool copyIn,
                                              bool copyOut);

  // The user's tensors behind mirrors (for Work::result); others unchanged.
  std::vector<at::Tensor> deviceOf(const std::vector<at::Tensor>& hosts) const;
  // Whether tensors on `device` belong to this staging.
  virtual bool owns(c10::Device device) const = 0;
  // Devices the op's Future is bound to (none when staging CPU tensors).
  virtual std::vector<c10::Device> devices() const = 0;

  // Caller thread, when the op is queued.
  virtual void recordCaller() = 0;
  // Executor thread, around the CPU op.
  void copyIn();
  void copyOut();

  // Caller thread: leaves the mirror `host` (in and out, of a contiguous
  // device tensor) to the op, which moves its bytes itself: copyIn and
  // copyOut skip it. False, and nothing changes, if it is not such a mirror.
  bool claim(const at::Tensor& host);
  // Caller thread: whether the mirror `host` has >= 2 chunks and is claimed
  // for pipeline().
  bool pipelines(const at::Tensor& host);
  // Executor thread: runs `run(ptr, count)` chunk by chunk on the claimed
  // `host`, overlapping the chunks' copies with the runs (see above); in one
  // piece if it has < 2 chunks or `whole` (the peers must run the same ops).
  void pipeline(const at::Tensor& host, const std::function<void(void*, size_t)>& run, bool whole = false);

  // The steps of the all-reduce through peers' device buffers
  // (peer_allreduce.h), queued on the op stream. synchronize() waits for
  // everything queued there.
  virtual c10::Device device() const = 0;
  virtual void deviceCopy(void* dst, const void* src, size_t bytes) = 0;
  virtual void deviceReduce(DataType dtype, ReduceOp op, void* dst, const void* src, size_t count) = 0;
  virtual void synchronize() = 0;
  virtual std::unique_ptr<PeerBuffers> newPeerBuffers(size_t bytes, int rank, int size) = 0;

  // A reduction that runs large calls on the device (see above).
  // `intoTensor`: the op writes no bytes of its in-out mirrors other than by
  // this reduction before it last reduces into them, so a reduction into
  // one may reduce into the tensor itself.
  ReduceFn reduceFn(DataType dtype, ReduceOp op, bool intoTensor);
  uint64_t deviceReductions() const { return deviceReductions_; }
  uint64_t inTensorReductions() const { return inTensorReductions_; }

  // The staging of the op being built in this thread, set by Scope around
  // the CPU op: resolveOp takes its reduceFn, enqueue wraps the op with it.
  static const std::shared_ptr<Staging>& current();
  class Scope {
   public:
    explicit Scope(std::shared_ptr<Staging> s);
    ~Scope();

   private:
    std::shared_ptr<Staging> previous_;
  };

 protected:
  virtual at::Tensor hostLike(const at::Tensor& device) = 0;
  virtual void waitCaller() = 0;
  // Runs dst[i].copy_(src[i]) for all i on the op stream and waits for it.
  virtual void copyAll(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) = 0;
  // Queues dst.copy_(src) on the op stream, then marks that point: waitFor
  // returns once everything queued before the mark is done.
  virtual size_t copyAndMark(const at::Tensor& dst, const at::Tensor& src) = 0;
  virtual void waitFor(size_t mark) = 0;
  // dst = op(dst, src) for host dst and src, computed on the device.
  virtual void reduceOnDevice(DataType dtype, ReduceOp op, void* dst, const void* src, size_t count) = 0;
  // tensor = op(tensor, src) on the device for a device `tensor` and host
  // `src`, then dst = tensor for host dst.
  virtual void reduceIntoTensor(DataType dtype, ReduceOp op, void* tensor, void* dst, const void* src,
                                size_t count) = 0;

 private:
  struct Mirror {
    at::Tensor device, host;
    bool in, out;
    bool claimed = false;  // by the op (claim)
  };
  // Whether `host` has >= 2 pipeline chunks.
  bool spansChunks(const at::Tensor& host) const { return chunkBytes_ <= size_t(host.nbytes()) / 2; }
  // Where [host, host + bytes) of an in-out mirror lies in its device
  // tensor, or null.
  void* tensorAddressOf(const void* host, size_t bytes) const;

  const size_t deviceReduceMinBytes_;
  const size_t chunkBytes_;
  std::vector<Mirror> mirrors_;
  uint64_t deviceReductions_ = 0;  // executor thread only
  uint64_t inTensorReductions_ = 0;
};

}  // namespace collx::torch_glue
