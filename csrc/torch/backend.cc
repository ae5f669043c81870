#include "backend.h"

#include <ATen/ATen.h>

#include "store_adapter.h"
#include "tensor_checks.h"
#include "work.h"

namespace collx::torch_glue {

namespace {

std::exception_ptr distError(const std::string& msg) {
  try {
    C10_THROW_ERROR(DistBackendError, msg);
  } catch (...) {
    return std::current_exception();
  }
}

// Runs fn, turning core errors raised in the caller thread into DistBackendError.
template <typename Fn>
auto asDistError(const char* op, int rank, Fn&& fn) {
  try {
    return fn();
  } catch (const Error& e) {
    fail(op, rank, e.what());
  }
}

std::chrono::milliseconds opTimeout(std::chrono::milliseconds opt, std::chrono::milliseconds group) {
  return opt.count() > 0 ? opt : group;  // kUnsetTimeout (-1 ms) means the group's
}

// Contiguous tensors run in place; others through a contiguous copy.
at::Tensor contiguousOf(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// Copies `flat` back into `outputs` unless it already is their storage.
void scatterBack(const at::Tensor& flat, const std::vector<at::Tensor>& outputs) {
  if (outputs.size() == 1 && outputs[0].data_ptr() == flat.data_ptr() && outputs[0].is_contiguous()) return;
  int64_t offset = 0;
  for (const auto& out : outputs) {
    out.copy_(flat.narrow(0, offset, out.numel()).view(out.sizes()));
    offset += out.numel();
  }
}


}  // namespace

CollxBackend::CollxBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout, Config config)
    : c10d::Backend(rank, size), config_(std::move(config)), timeout_(timeout) {
  StoreAdapter adapter(store);
  tcp::DeviceOptions dopts{config_.ifname, timeout};
  device_ = asDistError("init", rank, [&] { return std::make_unique<tcp::Device>(adapter, rank, size, dopts); });
}

CollxBackend::~CollxBackend() { shutdown(); }

void CollxBackend::shutdown() {
  // An op still in flight is failed, not waited for: its peers may be gone.
  device_->interrupt();
  executor_->shutdown(collx::str("collx on rank ", rank_, ": the process group was destroyed before this op ran"));
  device_->close();
}

c10::intrusive_ptr<c10d::Work> CollxBackend::enqueue(c10d::OpType type, OpKind kind, DataType dtype,
                                                     std::vector<at::Tensor> outputs,
                                                     std::chrono::milliseconds timeout, Body body) {
  const uint64_t seq = ++seq_;
  auto work = c10::make_intrusive<CollxWork>(type, nullptr, std::move(outputs), seq);
  auto describe = [this, kind, dtype, seq] {
    return collx::str("collx ", name(kind), " #", seq, " (", name(dtype), ") failed on rank ", rank_, ": ");
  };
  Executor::Task task;
  task.run = [this, work, kind, dtype, seq, timeout, body = std::move(body), describe] {
    Collective c{*device_, kind, dtype, seq, Clock::now() + timeout, config_.segmentBytes, config_.treeArity,
                 workspace_};
    std::exception_ptr error;
    auto start = Clock::now();
    try {
      std::string label = body(c);
      double secs = std::chrono::duration<double>(Clock::now() - start).count();
      std::lock_guard<std::mutex> lock(statsMutex_);
      ++stats_.ops;
      auto& s = stats_.perAlgorithm[label];
      ++s.calls;
      s.seconds += secs;
    } catch (const std::exception& e) {
      error = distError(describe() + e.what());
    }
    work->complete(error);
  };
  task.cancel = [work, describe](const std::string& why) { work->complete(distError(describe() + why)); };
  asDistError(name(kind), rank_, [&] {
    work->attach(executor_, executor_->submit(std::move(task)));
    return 0;
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduceFlat(c10d::OpType type, at::Tensor flat,
                                                           std::vector<at::Tensor> outputs,
                                                           const c10d::ReduceOp& op, Algorithm algo,
                                                           std::chrono::milliseconds timeout) {
  const DataType dtype = checkTensor(flat, "all_reduce", rank_);
  const ResolvedOp r = asDistError("all_reduce", rank_, [&] { return resolveOp(op, dtype, "all_reduce", rank_); });
  const int size = size_;
  auto body = [flat, outputs, r, dtype, algo, size](const Collective& c) {
    void* p = flat.data_ptr();
    size_t n = size_t(flat.numel());
    if (r.premul) scaleInPlace(dtype, p, n, r.premulFactor);
    Algorithm ran = collx::allreduce(c, algo, p, n, r.fn);
    if (r.average) divideInPlace(dtype, p, n, size);
    scatterBack(flat, outputs);
    return collx::str("all_reduce/", name(ran));
  };
  return enqueue(type, OpKind::kAllreduce, dtype, outputs, timeout, std::move(body));
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  checkSingle(tensors, "all_reduce", rank_);
  checkTensor(tensors[0], "all_reduce", rank_);
  return allreduceFlat(c10d::OpType::ALLREDUCE, contiguousOf(tensors[0]).view(-1), tensors,
                       opts.reduceOp, config_.algorithm, opTimeout(opts.timeout, timeout_));
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduceWith(at::Tensor& tensor, const c10d::ReduceOp& op,
                                                           Algorithm algorithm) {
  checkTensor(tensor, "all_reduce", rank_);
  return allreduceFlat(c10d::OpType::ALLREDUCE, contiguousOf(tensor).view(-1), {tensor}, op, algorithm,
                       timeout_);
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  if (tensors.empty()) fail("all_reduce_coalesced", rank_, "got no tensors");
  std::vector<at::Tensor> flats;
  for (const auto& t : tensors) {
    checkTensor(t, "all_reduce_coalesced", rank_);
    if (t.scalar_type() != tensors[0].scalar_type()) {
      fail("all_reduce_coalesced", rank_, collx::str("all tensors must have one dtype, got ",
                                              tensors[0].scalar_type(), " and ", t.scalar_type()));
    }
    flats.push_back(t.reshape(-1));
  }
  return allreduceFlat(c10d::OpType::ALLREDUCE_COALESCED, at::cat(flats), tensors, opts.reduceOp,
                       config_.algorithm, opTimeout(opts.timeout, timeout_));
}

c10::intrusive_ptr<c10d::Work> CollxBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  checkSingle(tensors, "broadcast", rank_);
  const DataType dtype = checkTensor(tensors[0], "broadcast", rank_);
  const int root = int(opts.rootRank);
  if (root < 0 || root >= size_) {
    fail("broadcast", rank_, collx::str("root rank ", opts.rootRank, " is out of range for a group of size ", size_));
  }
  if (opts.rootTensor != 0) fail("broadcast", rank_, collx::str("root tensor ", opts.rootTensor, " must be 0"));
  at::Tensor flat = contiguousOf(tensors[0]);
  std::vector<at::Tensor> outputs = tensors;
  auto body = [flat, outputs, root](const Collective& c) {
    collx::broadcast(c, flat.data_ptr(), size_t(flat.nbytes()), root);
    if (flat.data_ptr() != outputs[0].data_ptr()) outputs[0].copy_(flat);
    return std::string("broadcast/tree");
  };
  return enqueue(c10d::OpType::BROADCAST, OpKind::kBroadcast, dtype, outputs,
                 opTimeout(opts.timeout, timeout_), std::move(body));
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather";
  checkSingle(inputs, op, rank_);
  if (outputs.size() != 1) fail(op, rank_, collx::str("expects one output list, got ", outputs.size()));
  const at::Tensor input = inputs[0];
  const DataType dtype = checkTensor(input, op, rank_);
  const std::vector<at::Tensor> outs = outputs[0];
  if (int(outs.size()) != size_) {
    fail(op, rank_, collx::str("output list has ", outs.size(), " tensors for a group of size ", size_));
  }
  for (const auto& o : outs) {
    checkTensor(o, op, rank_);
    if (o.numel() != input.numel() || o.scalar_type() != input.scalar_type()) {
      fail(op, rank_, collx::str("every output must match the input (", input.numel(), " x ", input.scalar_type(),
                          "), got ", o.numel(), " x ", o.scalar_type()));
    }
  }
  const int rank = rank_;
  auto body = [input, outs, rank](const Collective& c) {
    const int64_t n = input.numel();
    at::Tensor flat = at::empty({n * c.size()}, input.options());
    flat.narrow(0, rank * n, n).copy_(input.reshape(-1));
    collx::allgather(c, flat.data_ptr(), size_t(n));
    scatterBack(flat, outs);
    return std::string("all_gather/ring");
  };
  return enqueue(c10d::OpType::ALLGATHER, OpKind::kAllgather, dtype, outs,
                 opTimeout(opts.timeout, timeout_), std::move(body));
}

c10::intrusive_ptr<c10d::Work> CollxBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_into_tensor";
  const DataType dtype = checkTensor(input, op, rank_);
  checkTensor(output, op, rank_);
  if (output.scalar_type() != input.scalar_type() || output.numel() != input.numel() * size_) {
    fail(op, rank_, collx::str("output must hold world_size x input = ", input.numel() * size_, " x ",
                        input.scalar_type(), ", got ", output.numel(), " x ", output.scalar_type()));
  }
  at::Tensor flat = contiguousOf(output).view(-1);
  const int rank = rank_;
  auto body = [input, output, flat, rank](const Collective& c) {
    const int64_t n = input.numel();
    flat.narrow(0, rank * n, n).copy_(input.reshape(-1));
    collx::allgather(c, flat.data_ptr(), size_t(n));
    if (flat.data_ptr() != output.data_ptr()) output.copy_(flat.view(output.sizes()));
    return std::string("all_gather/ring");
  };
  return enqueue(c10d::OpType::_ALLGATHER_BASE, OpKind::kAllgather, dtype, {output},
                 opTimeout(opts.timeout, timeout_), std::move(body));
}

c10::intrusive_ptr<c10d::Work> CollxBackend::barrier(const c10d::BarrierOptions& opts) {
  // Queued behind every earlier op, so it also waits for them (as gloo's does).
  auto body = [](const Collective& c) {
    uint8_t token = 0;
    starAllreduce(c, &token, 1, cpuReduceFn(DataType::kUInt8, ReduceOp::kBor));
    return std::string("barrier/star");
  };
  return enqueue(c10d::OpType::BARRIER, OpKind::kBarrier, DataType::kUInt8, {},
                 opTimeout(opts.timeout, timeout_), std::move(body));
}

Stats CollxBackend::stats() const {
  Stats s;
  {
    std::lock_guard<std::mutex> lock(statsMutex_);
    s = stats_;
  }
  TransportCounters tc = device_->counters();
  s.bytesSent = tc.bytesSent;
  s.bytesReceived = tc.bytesReceived;
  return s;
}

}  // namespace collx::torch_glue
