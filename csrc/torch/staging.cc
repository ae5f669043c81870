#include "staging.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/transport/shm/segment.h"
#include "tensor_checks.h"

namespace collx::torch_glue {

#ifdef COLLX_WITH_CUDA
std::shared_ptr<Staging> makeCudaStaging(c10::Device device, size_t deviceReduceMinBytes,
                                         size_t chunkBytes);  // staging_cuda.cc
#endif

namespace {

thread_local std::shared_ptr<Staging> tlsCurrent;

// The CPU emulation's peer buffers: a memfd segment per rank, which the
// others map by the creator's pid and descriptor (shm/segment.h).
class HostPeerBuffers final : public PeerBuffers {
 public:
  HostPeerBuffers(size_t bytes, int rank, int size)
      : PeerBuffers(bytes, rank, size), own_(shm::Segment::create(bytes)) {
    ptrs_[size_t(rank)] = own_.data();
  }
  Blob exported() const override {
    Blob b{};
    const int32_t ids[2] = {int32_t(getpid()), int32_t(own_.fd())};
    std::memcpy(b.data(), ids, sizeof ids);
    return b;
  }
  std::string attach(const std::vector<Blob>& blobs) override {
    for (size_t r = 0; r < blobs.size(); ++r) {
      if (int(r) == rank_) continue;
      int32_t ids[2];
      std::memcpy(ids, blobs[r].data(), sizeof ids);
      peers_.push_back(shm::Segment::attach(pid_t(ids[0]), ids[1], bytes_));
      ptrs_[r] = peers_.back().data();
    }
    return "";
  }
  void attached() override { own_.closeFd(); }

 private:
  shm::Segment own_;
  std::vector<shm::Segment> peers_;
};

// CPU tensors through the staging path (COLLX_STAGE_CPU_TENSORS=1): plain
// copies, and "device" reductions on scratch copies of dst and src, the way
// the CUDA staging moves them.
class HostStaging final : public Staging {
 public:
  using Staging::Staging;
  bool owns(c10::Device device) const override { return device.is_cpu(); }
  std::vector<c10::Device> devices() const override { return {}; }
  void recordCaller() override {}
  c10::Device device() const override { return c10::Device(at::kCPU); }
  void deviceCopy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void deviceReduce(DataType dtype, ReduceOp op, void* dst, const void* src, size_t count) override {
    cpuReduceFn(dtype, op)(dst, src, count);
  }
  void synchronize() override {}
  std::unique_ptr<PeerBuffers> newPeerBuffers(size_t bytes, int rank, int size) override {
    return std::make_unique<HostPeerBuffers>(bytes, rank, size);
  }

 protected:
  at::Tensor hostLike(const at::Tensor& device) override { return at::empty(device.sizes(), device.options()); }
  void waitCaller() override {}
  void copyAll(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) override {
    for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
  }
  size_t copyAndMark(const at::Tensor& dst, const at::Tensor& src) override {
    dst.copy_(src);
    return 0;
  }
  void waitFor(size_t) override {}
  void reduceOnDevice(DataType dtype, ReduceOp op, void* dst, const void* src, size_t count) override {
    const size_t bytes = count * elementSize(dtype);
    scratch_.resize(2 * bytes);
    std::memcpy(scratch_.data(), dst, bytes);
    std::memcpy(scratch_.data() + bytes, src, bytes);
    cpuReduceFn(dtype, op)(scratch_.data(), scratch_.data() + bytes, count);
    std::memcpy(dst, scratch_.data(), bytes);
  }
  // The "device" tensor is the user's own CPU tensor, apart from the mirror:
  // had the mirror's dst drifted from it, the result would be wrong.
  void reduceIntoTensor(DataType dtype, ReduceOp op, void* tensor, void* dst, const void* src,
                        size_t count) override {
    const size_t bytes = count * elementSize(dtype);
    scratch_.resize(bytes);
    std::memcpy(scratch_.data(), src, bytes);
    cpuReduceFn(dtype, op)(tensor, scratch_.data(), count);
    std::memcpy(dst, tensor, bytes);
  }

 private:
  std::vector<char> scratch_;
};

}  // namespace

std::shared_ptr<Staging> Staging::create(const std::vector<at::Tensor>& tensors, bool stageCpu,
                                         size_t deviceReduceMinBytes, size_t chunkBytes, const char* op,
                                         int rank) {
  const at::Tensor* first = nullptr;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    if (!first) first = &t;
    if (t.device() != first->device()) {
      fail(op, rank, collx::str("all tensors must be on one device, got ", first->device(), " and ", t.device()));
    }
  }
  if (!first) return nullptr;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_sparse()) fail(op, rank, "sparse tensors are not supported");
  }
  const c10::Device device = first->device();
  if (device.is_cpu()) return stageCpu ? std::make_shared<HostStaging>(deviceReduceMinBytes, chunkBytes) : nullptr;
  if (!device.is_cuda()) return nullptr;  // checkTensor names the unsupported device
#ifdef COLLX_WITH_CUDA
  try {
    return makeCudaStaging(device, deviceReduceMinBytes, chunkBytes);
  } catch (const Error& e) {
    fail(op, rank, e.what());
  }
#else
  fail(op, rank, collx::str("tensor is on ", device, " but this build of collx has no CUDA support (torch without "
                            "CUDA, or no CUDA toolkit when it was built)"));
#endif
}

at::Tensor Staging::mirror(const at::Tensor& device, bool copyIn, bool copyOut) {
  if (!device.defined()) return device;
  at::Tensor host = hostLike(device);
  mirrors_.push_back({device, host, copyIn, copyOut});
  return host;
}

std::vector<at::Tensor> Staging::mirror(const std::vector<at::Tensor>& device, bool copyIn, bool copyOut) {
  std::vector<at::Tensor> hosts;
  hosts.reserve(device.size());
  for (const auto& t : device) hosts.push_back(mirror(t, copyIn, copyOut));
  return hosts;
}

std::vector<std::vector<at::Tensor>> Staging::mirror(const std::vector<std::vector<at::Tensor>>& device,
                                                    bool copyIn, bool copyOut) {
  std::vector<std::vector<at::Tensor>> hosts;
  hosts.reserve(device.size());
  for (const auto& list : device) hosts.push_back(mirror(list, copyIn, copyOut));
  return hosts;
}

std::vector<at::Tensor> Staging::deviceOf(const std::vector<at::Tensor>& hosts) const {
  std::vector<at::Tensor> out;
  out.reserve(hosts.size());
  for (const auto& h : hosts) {
    const Mirror* m = nullptr;
    for (const auto& candidate : mirrors_) {
      if (candidate.host.is_same(h)) m = &candidate;
    }
    out.push_back(m ? m->device : h);
  }
  return out;
}

void Staging::copyIn() {
  waitCaller();
  std::vector<at::Tensor> dst, src;
  for (const auto& m : mirrors_) {
    if (m.in && !m.claimed) dst.push_back(m.host), src.push_back(m.device);
  }
  copyAll(dst, src);
}

void Staging::copyOut() {
  std::vector<at::Tensor> dst, src;
  for (const auto& m : mirrors_) {
    if (m.out && !m.claimed) dst.push_back(m.device), src.push_back(m.host);
  }
  copyAll(dst, src);
}

bool Staging::claim(const at::Tensor& host) {
  for (auto& m : mirrors_) {
    if (!m.host.is_same(host)) continue;
    m.claimed = m.claimed || (m.in && m.out && m.device.is_contiguous());
    return m.claimed;
  }
  return false;
}

bool Staging::pipelines(const at::Tensor& host) { return spansChunks(host) && claim(host); }

void Staging::pipeline(const at::Tensor& host, const std::function<void(void*, size_t)>& run, bool whole) {
  const Mirror* m = nullptr;
  for (const auto& candidate : mirrors_) {
    if (candidate.host.is_same(host) && candidate.claimed) m = &candidate;
  }
  TORCH_INTERNAL_ASSERT(m, "collx: pipeline() on a tensor that was not claimed");
  const at::Tensor h = m->host.view(-1), d = m->device.view(-1);
  const int64_t n = h.numel();
  const int64_t step = !whole && spansChunks(h) ? std::max<int64_t>(1, int64_t(chunkBytes_ / size_t(h.element_size())))
                                                : std::max<int64_t>(1, n);
  waitCaller();
  std::vector<size_t> down;
  for (int64_t at = 0; at < n; at += step) {
    const int64_t len = std::min(step, n - at);
    down.push_back(copyAndMark(h.narrow(0, at, len), d.narrow(0, at, len)));
  }
  for (size_t i = 0; i * step < size_t(n); ++i) {
    const int64_t at = int64_t(i) * step, len = std::min(step, n - at);
    waitFor(down[i]);
    at::Tensor chunk = h.narrow(0, at, len);
    run(chunk.data_ptr(), size_t(len));
    copyAndMark(d.narrow(0, at, len), chunk);
  }
  synchronize();
}

ReduceFn Staging::reduceFn(DataType dtype, ReduceOp op, bool intoTensor) {
  ReduceFn host = cpuReduceFn(dtype, op);  // also rejects meaningless pairs up front
  const size_t esize = elementSize(dtype);
  return [this, host, dtype, op, esize, intoTensor](void* dst, const void* src, size_t count) {
    const size_t bytes = count * esize;
    if (bytes == 0 || bytes < deviceReduceMinBytes_) return host(dst, src, count);
    if (void* tensor = intoTensor ? tensorAddressOf(dst, bytes) : nullptr) {
      reduceIntoTensor(dtype, op, tensor, dst, src, count);
      ++inTensorReductions_;
    } else {
      reduceOnDevice(dtype, op, dst, src, count);
    }
    ++deviceReductions_;
  };
}

void* Staging::tensorAddressOf(const void* host, size_t bytes) const {
  const char* p = static_cast<const char*>(host);
  for (const auto& m : mirrors_) {
    if (!m.in || !m.out || !m.device.is_contiguous()) continue;
    const char* base = static_cast<const char*>(m.host.data_ptr());
    if (p >= base && p + bytes <= base + m.host.nbytes()) {
      return static_cast<char*>(m.device.data_ptr()) + (p - base);
    }
  }
  return nullptr;
}

const std::shared_ptr<Staging>& Staging::current() { return tlsCurrent; }

Staging::Scope::Scope(std::shared_ptr<Staging> s) : previous_(std::move(tlsCurrent)) { tlsCurrent = std::move(s); }
Staging::Scope::~Scope() { tlsCurrent = std::move(previous_); }

}  // namespace collx::torch_glue
