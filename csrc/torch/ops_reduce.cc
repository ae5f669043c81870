// The reducing ops of CollxBackend: all_reduce (and its coalesced and
// per-call-algorithm forms), reduce, reduce_scatter.
#include "backend.h"
#include "core/algorithms/tuning.h"
#include "op_helpers.h"
#include "work.h"

namespace collx::torch_glue {

namespace {

// Runs fn on `buf` with PREMUL_SUM's pre-scale and AVG's post-divide around it.
template <typename Fn>
void withScaling(const ResolvedOp& r, DataType dtype, void* buf, size_t n, int size, Fn&& fn) {
  if (r.premul) scaleInPlace(dtype, buf, n, r.premulFactor);
  fn();
  if (r.average) divideInPlace(dtype, buf, n, size);
}

}  // namespace

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
    Algorithm ran;
    withScaling(r, dtype, p, n, size, [&] { ran = collx::allreduce(c, algo, p, n, r.fn); });
    scatterBack(flat, outputs);
    return collx::str("all_reduce/", name(ran));
  };
  return enqueue(type, OpKind::kAllreduce, dtype, outputs, timeout, std::move(body));
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  return validated(OpKind::kAllreduce, [&] {
    checkSingle(tensors, "all_reduce", rank_);
    checkTensor(tensors[0], "all_reduce", rank_);
    return allreduceFlat(c10d::OpType::ALLREDUCE, contiguousOf(tensors[0]).view(-1), tensors, opts.reduceOp,
                         config_.algorithm, opTimeout(opts.timeout, timeout_));
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduceWith(at::Tensor& tensor, const c10d::ReduceOp& op,
                                                           Algorithm algorithm) {
  return validated(OpKind::kAllreduce, [&] {
    checkTensor(tensor, "all_reduce", rank_);
    return allreduceFlat(c10d::OpType::ALLREDUCE, contiguousOf(tensor).view(-1), {tensor}, op, algorithm, timeout_);
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceCoalescedOptions& opts) {
  return validated(OpKind::kAllreduce, [&] {
    if (tensors.empty()) fail("all_reduce_coalesced", rank_, "got no tensors");
    for (const auto& t : tensors) {
      checkTensor(t, "all_reduce_coalesced", rank_);
      if (t.scalar_type() != tensors[0].scalar_type()) {
        fail("all_reduce_coalesced", rank_,
             collx::str("all tensors must have one dtype, got ", tensors[0].scalar_type(), " and ", t.scalar_type()));
      }
    }
    return allreduceFlat(c10d::OpType::ALLREDUCE_COALESCED, flatCopy(tensors), tensors, opts.reduceOp,
                         config_.algorithm, opTimeout(opts.timeout, timeout_));
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::reduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::ReduceOptions& opts) {
  return validated(OpKind::kReduce, [&] {
    const char* op = "reduce";
    checkSingle(tensors, op, rank_);
    const DataType dtype = checkTensor(tensors[0], op, rank_);
    const int root = int(opts.rootRank);
    if (root < 0 || root >= size_) {
      fail(op, rank_, collx::str("root rank ", opts.rootRank, " is out of range for a group of size ", size_));
    }
    const ResolvedOp r = asDistError(op, rank_, [&] { return resolveOp(opts.reduceOp, dtype, op, rank_); });
    // Other ranks' tensors stay unchanged (as in NCCL): they reduce a copy.
    at::Tensor flat = rank_ == root ? contiguousOf(tensors[0]).view(-1) : tensors[0].reshape(-1).clone();
    std::vector<at::Tensor> outputs = tensors;
    const bool isRoot = rank_ == root;
    auto body = [flat, outputs, r, dtype, root, isRoot](const Collective& c) {
      size_t n = size_t(flat.numel());
      withScaling(r, dtype, flat.data_ptr(), n, isRoot ? c.size() : 1,
                  [&] { collx::reduce(c, flat.data_ptr(), n, root, r.fn); });
      if (isRoot) scatterBack(flat, outputs);
      return reduceByRing(c.size(), size_t(flat.nbytes())) ? std::string("reduce/ring")
                                                            : treeLabel("reduce", c, size_t(flat.nbytes()));
    };
    return enqueue(c10d::OpType::REDUCE, OpKind::kReduce, dtype, outputs, opTimeout(opts.timeout, timeout_),
                   std::move(body));
  });
}

// Reduce-scatter of `work` (n blocks of `out`'s size, a private copy) into `out`.
static std::string reduceScatterInto(const Collective& c, const ResolvedOp& r, DataType dtype, at::Tensor& work,
                                     const at::Tensor& out) {
  size_t block = size_t(out.numel());
  withScaling(r, dtype, work.data_ptr(), block * c.size(), c.size(),
              [&] { reduceScatter(c, work.data_ptr(), block, r.fn); });
  out.copy_(work.narrow(0, int64_t(block) * c.rank(), int64_t(block)).view(out.sizes()));
  return "reduce_scatter/ring";
}

c10::intrusive_ptr<c10d::Work> CollxBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ReduceScatterOptions& opts) {
  return validated(OpKind::kReduceScatter, [&] {
    const char* op = "reduce_scatter";
    checkSingle(outputs, op, rank_);
    const DataType dtype = checkTensor(outputs[0], op, rank_);
    if (inputs.size() != 1 || int(inputs[0].size()) != size_) {
      fail(op, rank_, collx::str("expects one input list of ", size_, " tensors"));
    }
    checkSameShape(inputs[0], outputs[0], op, rank_, "input");
    const ResolvedOp r = asDistError(op, rank_, [&] { return resolveOp(opts.reduceOp, dtype, op, rank_); });
    at::Tensor work = flatCopy(inputs[0]);
    at::Tensor out = outputs[0];
    auto body = [work, out, r, dtype](const Collective& c) mutable { return reduceScatterInto(c, r, dtype, work, out); };
    return enqueue(c10d::OpType::REDUCE_SCATTER, OpKind::kReduceScatter, dtype, outputs,
                   opTimeout(opts.timeout, timeout_), std::move(body));
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::ReduceScatterOptions& opts) {
  return validated(OpKind::kReduceScatter, [&] {
    std::vector<at::Tensor> outs{output}, ins{input};
    return reduce_scatter_tensor_coalesced(outs, ins, opts);
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::ReduceScatterOptions& opts) {
  return validated(OpKind::kReduceScatter, [&] {
    const char* op = "reduce_scatter_tensor";
    if (outputs.empty() || outputs.size() != inputs.size()) {
      fail(op, rank_, collx::str("got ", outputs.size(), " outputs for ", inputs.size(), " inputs"));
    }
    const DataType dtype = checkTensor(outputs[0], op, rank_);
    std::vector<at::Tensor> works;
    for (size_t i = 0; i < outputs.size(); ++i) {
      checkTensor(inputs[i], op, rank_);
      if (outputs[i].scalar_type() != outputs[0].scalar_type() || inputs[i].scalar_type() != outputs[i].scalar_type() ||
          inputs[i].numel() != outputs[i].numel() * size_) {
        fail(op, rank_, collx::str("input must hold world_size x output = ", outputs[i].numel() * size_, " x ",
                                   outputs[i].scalar_type(), ", got ", inputs[i].numel(), " x ", inputs[i].scalar_type()));
      }
      works.push_back(inputs[i].reshape(-1).clone());
    }
    const ResolvedOp r = asDistError(op, rank_, [&] { return resolveOp(opts.reduceOp, dtype, op, rank_); });
    auto body = [works, outs = outputs, r, dtype](const Collective& c) mutable {
      std::string label;
      for (size_t i = 0; i < works.size(); ++i) label = reduceScatterInto(c, r, dtype, works[i], outs[i]);
      return label;
    };
    return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, OpKind::kReduceScatter, dtype, outputs,
                   opTimeout(opts.timeout, timeout_), std::move(body));
  });
}

}  // namespace collx::torch_glue
