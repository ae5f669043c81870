// Collectives on device (CUDA) tensors. The core moves host bytes, so an op
// on device tensors runs the CPU op on host mirrors of them:
//
//   caller thread                     executor thread, collx's own stream
//   ------------------------------    --------------------------------------
//   mirror each tensor (pinned host)
//   record an event on the caller's   wait for that event
//   current stream                    D2H the inputs into their mirrors, sync
//                                     run the CPU op on the mirrors; every
//                                     reduction of >= kDeviceReduceMinBytes
//                                     runs on the GPU: H2D dst and src into
//                                     device scratch, kernel, D2H dst
//                                     H2D the outputs into the user's tensors,
//                                     sync; complete the Work and the Future
//
// The Work finishes only after the op stream has synchronized, so wait() and
// the Future's callbacks see finished data on any stream.
//
// A large all-reduce of one tensor is pipelined by chunk instead: every
// chunk's D2H is queued at once, and chunk i's collective starts when its
// D2H is done, while later chunks are still copying down and earlier ones
// copying back up:
//
//   copy stream   D2H 0 | D2H 1 | D2H 2 |        H2D 0 |  H2D 1 |  H2D 2
//   host                  [ all-reduce 0 ][ all-reduce 1 ][ all-reduce 2 ]
//
// COLLX_STAGE_CPU_TENSORS=1 sends CPU tensors down this same path, with plain
// copies and CPU kernels for the "device" reductions: the CPU test suite then
// exercises the staging logic that CUDA tensors use.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <memory>
#include <vector>

#include "core/reduce/reduce.h"

namespace collx::torch_glue {

// Smaller reductions stay on the CPU: three PCIe copies and a stream sync
// cost more than reducing a few KiB on the host.
constexpr size_t kDeviceReduceMinBytes = 64 << 10;
// Pipelined all-reduce: chunks of this many bytes, for tensors of >= 2 chunks.
constexpr size_t kPipelineChunkBytes = 4 << 20;

class Staging {
 public:
  // A staging for the device of `tensors` (all on one device), or null when
  // they are CPU tensors and `stageCpu` is off. Raises DistBackendError for
  // mixed devices, an unsupported device, or CUDA tensors in a build without
  // CUDA.
  static std::shared_ptr<Staging> create(const std::vector<at::Tensor>& tensors, bool stageCpu, const char* op,
                                         int rank);
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

  // Caller thread: whether the mirror `host` (in and out, of a contiguous
  // device tensor, >= 2 chunks) will be pipelined; if so, copyIn and copyOut
  // leave it to pipeline().
  bool pipelines(const at::Tensor& host);
  // Executor thread: runs `run(ptr, count)` chunk by chunk on `host`,
  // overlapping the chunks' copies with the runs (see above).
  void pipeline(const at::Tensor& host, const std::function<void(void*, size_t)>& run);

  // A reduction that runs large calls on the device (see above).
  ReduceFn reduceFn(DataType dtype, ReduceOp op);
  uint64_t deviceReductions() const { return deviceReductions_.load(); }

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
  virtual void synchronize() = 0;
  // dst = op(dst, src) for host dst and src, computed on the device.
  virtual void reduceOnDevice(DataType dtype, ReduceOp op, void* dst, const void* src, size_t count) = 0;

 private:
  struct Mirror {
    at::Tensor device, host;
    bool in, out;
    bool pipelined = false;
  };
  std::vector<Mirror> mirrors_;
  std::atomic<uint64_t> deviceReductions_{0};
};

}  // namespace collx::torch_glue
