// The CUDA side of Staging (staging.h): pinned host mirrors from torch's
// caching host allocator, copies on a stream of collx's own, and reductions
// by collx's kernels (csrc/cuda) in device scratch.
#ifdef COLLX_WITH_CUDA

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstring>

#include "core/error.h"
#include "cuda/kernels.h"
#include "staging.h"

namespace collx::torch_glue {

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw Error(collx::str("CUDA ", what, " failed: ", cudaGetErrorString(err)));
}

// Peer buffers in device memory: cudaMalloc'd (IPC needs its own
// allocation, not a block of torch's caching allocator), mapped by the other
// ranks through CUDA IPC. Only ranks on one GPU take part: the blob carries
// the GPU's UUID.
class CudaPeerBuffers final : public PeerBuffers {
 public:
  CudaPeerBuffers(c10::Device device, size_t bytes, int rank, int size)
      : PeerBuffers(bytes, rank, size), device_(device) {
    c10::cuda::CUDAGuard guard(device_);
    cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, device_.index()), "device properties");
    std::memcpy(uuid_, &prop.uuid, sizeof uuid_);
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "malloc of the peer buffer");
    ptrs_[size_t(rank)] = static_cast<char*>(p);
  }
  ~CudaPeerBuffers() override {
    c10::cuda::CUDAGuard guard(device_);
    for (size_t r = 0; r < ptrs_.size(); ++r) {
      if (!ptrs_[r]) continue;
      if (int(r) == rank_) cudaFree(ptrs_[r]);
      else cudaIpcCloseMemHandle(ptrs_[r]);
    }
  }

  Blob exported() const override {
    c10::cuda::CUDAGuard guard(device_);
    cudaIpcMemHandle_t handle;
    check(cudaIpcGetMemHandle(&handle, mine()), "IPC handle of the peer buffer");
    static_assert(sizeof uuid_ + sizeof handle <= kBlobBytes);
    Blob b{};
    std::memcpy(b.data(), uuid_, sizeof uuid_);
    std::memcpy(b.data() + sizeof uuid_, &handle, sizeof handle);
    return b;
  }

  std::string attach(const std::vector<Blob>& blobs) override {
    c10::cuda::CUDAGuard guard(device_);
    for (size_t r = 0; r < blobs.size(); ++r) {
      if (int(r) != rank_ && std::memcmp(blobs[r].data(), uuid_, sizeof uuid_) != 0) {
        return collx::str("rank ", r, "'s tensor is on another GPU (the ranks' buffers are mapped on one GPU only)");
      }
    }
    for (size_t r = 0; r < blobs.size(); ++r) {
      if (int(r) == rank_) continue;
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, blobs[r].data() + sizeof uuid_, sizeof handle);
      void* p = nullptr;
      if (cudaError_t err = cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess); err != cudaSuccess) {
        cudaGetLastError();  // not sticky: clear it for the staged ops that follow
        return collx::str("cannot map rank ", r, "'s device buffer (CUDA IPC): ", cudaGetErrorString(err));
      }
      ptrs_[r] = static_cast<char*>(p);
    }
    return "";
  }

 private:
  c10::Device device_;
  char uuid_[16];
};

class CudaStaging final : public Staging {
 public:
  CudaStaging(c10::Device device, size_t deviceReduceMinBytes, size_t chunkBytes)
      : Staging(deviceReduceMinBytes, chunkBytes),
        device_(device),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())),
        reduceStream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {
    c10::cuda::CUDAGuard guard(device_);
    check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "event create");
  }
  ~CudaStaging() override {
    c10::cuda::CUDAGuard guard(device_);
    cudaEventDestroy(ready_);
    for (cudaEvent_t e : marks_) cudaEventDestroy(e);
  }

  bool owns(c10::Device device) const override { return device == device_; }
  std::vector<c10::Device> devices() const override { return {device_}; }
  c10::Device device() const override { return device_; }

  void recordCaller() override {
    c10::cuda::CUDAGuard guard(device_);
    check(cudaEventRecord(ready_, c10::cuda::getCurrentCUDAStream(device_.index()).stream()), "event record");
  }

  void synchronize() override { stream_.synchronize(); }

  void deviceCopy(void* dst, const void* src, size_t bytes) override {
    c10::cuda::CUDAGuard guard(device_);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_.stream()), "device copy");
  }

  void deviceReduce(DataType dtype, ReduceOp op, void* dst, const void* src, size_t count) override {
    c10::cuda::CUDAGuard guard(device_);
    check(cudaError_t(cuda::reduce(dtype, op, dst, src, count, 1.0, reinterpret_cast<cuda::Stream>(stream_.stream()))),
          "reduce kernel launch");
  }

  std::unique_ptr<PeerBuffers> newPeerBuffers(size_t bytes, int rank, int size) override {
    return std::make_unique<CudaPeerBuffers>(device_, bytes, rank, size);
  }

 protected:
  at::Tensor hostLike(const at::Tensor& device) override {
    return at::empty(device.sizes(), device.options().device(at::kCPU).pinned_memory(true));
  }

  void waitCaller() override {
    c10::cuda::CUDAGuard guard(device_);
    check(cudaStreamWaitEvent(stream_.stream(), ready_, 0), "stream wait");
  }

  void copyAll(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) override {
    // Nothing to copy (claimed mirrors): no sync, which on a GPU that ranks
    // time-share costs a turn. Later work on the stream still waits for the
    // caller's event.
    if (dst.empty()) return;
    c10::cuda::CUDAStreamGuard guard(stream_);
    for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i], /*non_blocking=*/true);
    stream_.synchronize();
  }

  size_t copyAndMark(const at::Tensor& dst, const at::Tensor& src) override {
    c10::cuda::CUDAStreamGuard guard(stream_);
    dst.copy_(src, /*non_blocking=*/true);
    cudaEvent_t e;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event create");
    marks_.push_back(e);
    check(cudaEventRecord(e, stream_.stream()), "event record");
    return marks_.size() - 1;
  }

  void waitFor(size_t mark) override { check(cudaEventSynchronize(marks_.at(mark)), "event synchronize"); }

  // On a stream of its own: a pipelined op's copy stream holds queued chunk
  // copies that a reduction must not wait behind.
  void reduceOnDevice(DataType dtype, ReduceOp op, void* dst, const void* src, size_t count) override {
    c10::cuda::CUDAStreamGuard guard(reduceStream_);
    const size_t bytes = count * elementSize(dtype);
    char* a = scratch(2 * bytes);
    char* b = a + bytes;
    cudaStream_t s = reduceStream_.stream();
    check(cudaMemcpyAsync(a, dst, bytes, cudaMemcpyHostToDevice, s), "copy to device");
    check(cudaMemcpyAsync(b, src, bytes, cudaMemcpyHostToDevice, s), "copy to device");
    check(cudaError_t(cuda::reduce(dtype, op, a, b, count, 1.0, reinterpret_cast<cuda::Stream>(s))),
          "reduce kernel launch");
    check(cudaMemcpyAsync(dst, a, bytes, cudaMemcpyDeviceToHost, s), "copy to host");
    check(cudaStreamSynchronize(s), "stream synchronize");
  }

  void reduceIntoTensor(DataType dtype, ReduceOp op, void* tensor, void* dst, const void* src,
                        size_t count) override {
    c10::cuda::CUDAStreamGuard guard(reduceStream_);
    const size_t bytes = count * elementSize(dtype);
    // src lands at the tensor's offset mod 16, so the kernel's 16-byte loads
    // line up for both operands.
    const size_t shift = reinterpret_cast<uintptr_t>(tensor) % 16;
    char* b = scratch(bytes + shift) + shift;
    cudaStream_t s = reduceStream_.stream();
    check(cudaMemcpyAsync(b, src, bytes, cudaMemcpyHostToDevice, s), "copy to device");
    check(cudaError_t(cuda::reduce(dtype, op, tensor, b, count, 1.0, reinterpret_cast<cuda::Stream>(s))),
          "reduce kernel launch");
    check(cudaMemcpyAsync(dst, tensor, bytes, cudaMemcpyDeviceToHost, s), "copy to host");
    check(cudaStreamSynchronize(s), "stream synchronize");
  }

 private:
  c10::Device device_;
  c10::cuda::CUDAStream stream_;         // waits for the caller; copies in and out
  c10::cuda::CUDAStream reduceStream_;   // reductions
  cudaEvent_t ready_ = nullptr;  // recorded on the caller's stream at enqueue
  std::vector<cudaEvent_t> marks_;  // of copyAndMark
  at::Tensor scratch_;  // allocated on reduceStream_, reused for the op's reductions

  char* scratch(size_t bytes) {
    if (!scratch_.defined() || size_t(scratch_.nbytes()) < bytes) {
      scratch_ = at::empty({int64_t(bytes)}, at::TensorOptions().dtype(at::kByte).device(device_));
    }
    return static_cast<char*>(scratch_.data_ptr());
  }
};

}  // namespace

std::shared_ptr<Staging> makeCudaStaging(c10::Device device, size_t deviceReduceMinBytes, size_t chunkBytes) {
  return std::make_shared<CudaStaging>(device, deviceReduceMinBytes, chunkBytes);
}

}  // namespace collx::torch_glue

#endif  // COLLX_WITH_CUDA
