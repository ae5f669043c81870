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

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduceFlat(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                           const c10d::ReduceOp& op, Algorithm algo,
                                                           std::chrono::milliseconds timeout) {
  const DataType dtype = checkTensor(outputs[0], "all_reduce", rank_);
  // A leader of the hierarchical all-reduce writes its buffer before reducing
  // into it, and the shm one reduces in its windows (algorithms.h). On shared
  // memory auto may take shm for any chunk of a pipelined tensor, whatever it
  // takes for the whole.
  size_t bytes = 0;
  for (const auto& t : outputs) bytes += t.nbytes();
  const std::shared_ptr<Staging> staged = Staging::current();
  bool intoTensor = true;
  if (staged) {
    const Algorithm resolved = resolveAllreduce(device(), tuning_, algo, config_.treeArity, bytes);
    const bool mayRunShm = resolved == Algorithm::kShm || (algo == Algorithm::kAuto && device().sharedWindows());
    intoTensor = resolved != Algorithm::kHierarchical && !mayRunShm;
  }
  const ResolvedOp r = asDistError("all_reduce", rank_, [&] {
    return resolveOp(op, dtype, "all_reduce", rank_, intoTensor);
  });
  const int size = size_;
  // An auto all-reduce of one large tensor on one host may run on the device,
  // through the ranks' mapped buffers (peer_allreduce.h): every rank takes
  // part, and each says whether its tensor can (a claimed device tensor).
  // Otherwise a large staged tensor is pipelined: chunk by chunk, overlapping
  // its copies.
  const bool peers = outputs.size() == 1 && algo == Algorithm::kAuto && !r.premul && !r.average && size_ > 1 &&
                     config_.peerBufferBytes != SIZE_MAX && bytes >= config_.peerMinBytes &&
                     device().hostCount() == 1;
  const bool claimed = peers && staged && staged->claim(outputs[0]);
  const bool pipelined = claimed || (staged && outputs.size() == 1 && staged->pipelines(outputs[0]));
  // A rank pipelines only where every rank can: one with a CPU tensor beside
  // device ones runs the op in one piece, so the others must too. The peers
  // path votes on it; elsewhere a vote does, where a tensor may span chunks.
  const bool vote = !peers && outputs.size() == 1 && size_ > 1 && config_.stagingChunkBytes <= bytes / 2;
  auto body = [this, outputs, r, dtype, algo, size, staged, peers, claimed, pipelined, vote](const Collective& c) {
    bool whole = false;
    if (vote) whole = peers_->stagesWhole(c, !staged, pipelined, size_t(outputs[0].numel()));
    if (peers) {
      const at::Tensor tensor = staged ? staged->deviceOf(outputs)[0] : outputs[0];
      switch (peers_->run(staged.get(), claimed, c, tensor, dtype, r.op)) {
        case PeerAllreduce::Outcome::kDone: return std::string("all_reduce/peers");
        case PeerAllreduce::Outcome::kStageWhole: whole = true; break;
        case PeerAllreduce::Outcome::kStage: break;
      }
    }
    Algorithm ran;
    auto run = [&](void* p, size_t n) {
      withScaling(r, dtype, p, n, size, [&] { ran = collx::allreduce(c, algo, p, n, r.fn); });
    };
    if (pipelined) {
      staged->pipeline(outputs[0], run, whole);
      return collx::str("all_reduce/", name(ran));
    }
    // Read the inputs here, when the op runs: a staged op fills them just before.
    const bool inPlace = outputs.size() == 1 && outputs[0].is_contiguous();
    void* const flat = inPlace ? outputs[0].data_ptr() : flatCopy(copies_, outputs);
    run(flat, numelOf(outputs));
    if (!inPlace) scatterBack(flat, outputs);
    return collx::str("all_reduce/", name(ran));
  };
  return enqueue(type, OpKind::kAllreduce, dtype, std::move(outputs), timeout, std::move(body));
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  return validated(OpKind::kAllreduce, !opts.asyncOp, [&]() -> WorkPtr {
    if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) return allreduceSparse(tensors[0], opts);
    if (auto w = onMirror("all_reduce", tensors, true, true, [&](auto& host) { return allreduce(host, opts); })) {
      return w;
    }
    checkSingle(tensors, "all_reduce", rank_);
    checkTensor(tensors[0], "all_reduce", rank_);
    return allreduceFlat(c10d::OpType::ALLREDUCE, tensors, opts.reduceOp, config_.algorithm,
                         opTimeout(opts.timeout, timeout()));
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduceWith(at::Tensor& tensor, const c10d::ReduceOp& op,
                                                           Algorithm algorithm, bool callerWaits) {
  return validated(OpKind::kAllreduce, callerWaits, [&]() -> WorkPtr {
    if (auto w = onMirror("all_reduce", tensor, true, true,
                          [&](at::Tensor& host) { return allreduceWith(host, op, algorithm, callerWaits); })) {
      return w;
    }
    checkTensor(tensor, "all_reduce", rank_);
    return allreduceFlat(c10d::OpType::ALLREDUCE, {tensor}, op, algorithm, timeout());
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceCoalescedOptions& opts) {
  return validated(OpKind::kAllreduce, !opts.asyncOp, [&]() -> WorkPtr {
    if (auto w = onMirror("all_reduce_coalesced", tensors, true, true,
                          [&](auto& host) { return allreduce_coalesced(host, opts); })) {
      return w;
    }
    if (tensors.empty()) fail("all_reduce_coalesced", rank_, "got no tensors");
    for (const auto& t : tensors) {
      checkTensor(t, "all_reduce_coalesced", rank_);
      if (t.scalar_type() != tensors[0].scalar_type()) {
        fail("all_reduce_coalesced", rank_,
             collx::str("all tensors must have one dtype, got ", tensors[0].scalar_type(), " and ", t.scalar_type()));
      }
    }
    return allreduceFlat(c10d::OpType::ALLREDUCE_COALESCED, tensors, opts.reduceOp, config_.algorithm,
                         opTimeout(opts.timeout, timeout()));
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::reduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::ReduceOptions& opts) {
  return validated(OpKind::kReduce, !opts.asyncOp, [&]() -> WorkPtr {
    // Only the root's tensor changes.
    if (auto w = onMirror("reduce", tensors, true, rank_ == opts.rootRank,
                          [&](auto& host) { return reduce(host, opts); })) {
      return w;
    }
    const char* op = "reduce";
    checkSingle(tensors, op, rank_);
    const DataType dtype = checkTensor(tensors[0], op, rank_);
    const int root = int(opts.rootRank);
    if (root < 0 || root >= size_) {
      fail(op, rank_, collx::str("root rank ", opts.rootRank, " is out of range for a group of size ", size_));
    }
    const ResolvedOp r = asDistError(op, rank_, [&] { return resolveOp(opts.reduceOp, dtype, op, rank_); });
    std::vector<at::Tensor> outputs = tensors;
    const bool isRoot = rank_ == root;
    auto body = [this, outputs, r, dtype, root, isRoot](const Collective& c) {
      // Other ranks' tensors stay unchanged (as in NCCL): they reduce a copy.
      const bool inPlace = isRoot && outputs[0].is_contiguous();
      void* const flat = inPlace ? outputs[0].data_ptr() : flatCopy(copies_, outputs);
      const size_t n = size_t(outputs[0].numel()), bytes = outputs[0].nbytes();
      withScaling(r, dtype, flat, n, isRoot ? c.size() : 1, [&] { collx::reduce(c, flat, n, root, r.fn); });
      if (isRoot && !inPlace) scatterBack(flat, outputs);
      return reduceByRing(c.size(), bytes) ? std::string("reduce/ring") : treeLabel("reduce", c, bytes);
    };
    return enqueue(c10d::OpType::REDUCE, OpKind::kReduce, dtype, outputs, opTimeout(opts.timeout, timeout()),
                   std::move(body));
  });
}

// Reduce-scatter of `blocks` (n contiguous blocks of `count` elements) into
// the contiguous `out`, on raw memory (op_helpers.h). In shared memory and
// in two levels it reads the blocks where they lie; the ring, and
// PREMUL_SUM, which scales its input first, need a private copy of them,
// reduced in place.
static std::string reduceScatterInto(Workspace& copies, const Collective& c, const ResolvedOp& r, DataType dtype,
                                     const std::vector<const void*>& blocks, void* out, size_t count) {
  const size_t blockBytes = count * elementSize(dtype);
  if (!r.premul && (movesInShm(c.transport) || twoLevelMoves(c.transport))) {
    const bool shm = movesInShm(c.transport);
    shm ? shmReduceScatter(c, blocks, out, count, r.fn) : twoLevelReduceScatter(c, blocks, out, count, r.fn);
    if (r.average) divideInPlace(dtype, out, count, c.size());
    return shm ? "reduce_scatter/shm" : "reduce_scatter/hier";
  }
  if (c.size() == 1) {  // the one block is the result: one copy, no private one
    moveBytes(out, blocks[0], blockBytes);
    withScaling(r, dtype, out, count, 1, [] {});
    return "reduce_scatter/ring";
  }
  char* work = copies.get(std::max<size_t>(1, blockBytes * size_t(c.size())));
  for (size_t q = 0; q < blocks.size(); ++q) copyBytes(work + q * blockBytes, blocks[q], blockBytes);
  withScaling(r, dtype, work, count * size_t(c.size()), c.size(), [&] { reduceScatter(c, work, count, r.fn); });
  copyBytes(out, work + size_t(c.rank()) * blockBytes, blockBytes);
  if (movesInShm(c.transport)) return "reduce_scatter/shm";
  return twoLevelMoves(c.transport) ? "reduce_scatter/hier" : "reduce_scatter/ring";
}

c10::intrusive_ptr<c10d::Work> CollxBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ReduceScatterOptions& opts) {
  return validated(OpKind::kReduceScatter, !opts.asyncOp, [&]() -> WorkPtr {
    const char* op = "reduce_scatter";
    if (auto w = onMirrors(op, outputs, inputs, [&](auto& out, auto& in) { return reduce_scatter(out, in, opts); })) {
      return w;
    }
    checkSingle(outputs, op, rank_);
    const DataType dtype = checkTensor(outputs[0], op, rank_);
    if (inputs.size() != 1 || int(inputs[0].size()) != size_) {
      fail(op, rank_, collx::str("expects one input list of ", size_, " tensors"));
    }
    checkSameShape(inputs[0], outputs[0], op, rank_, "input");
    const ResolvedOp r = asDistError(op, rank_, [&] { return resolveOp(opts.reduceOp, dtype, op, rank_); });
    auto body = [this, in = inputs[0], out = outputs[0], r, dtype](const Collective& c) {
      std::vector<at::Tensor> blocks;  // read when the op runs
      std::vector<const void*> ptrs;
      for (const auto& b : in) {
        blocks.push_back(contiguousOf(b));
        ptrs.push_back(blocks.back().data_ptr());
      }
      return intoContiguous(out, [&](void* dst) {
        return reduceScatterInto(copies_, c, r, dtype, ptrs, dst, size_t(out.numel()));
      });
    };
    return enqueue(c10d::OpType::REDUCE_SCATTER, OpKind::kReduceScatter, dtype, outputs,
                   opTimeout(opts.timeout, timeout()), std::move(body), true, allOf(inputs));
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outs{output}, ins{input};
  return reduce_scatter_tensor_coalesced(outs, ins, opts);
}

c10::intrusive_ptr<c10d::Work> CollxBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::ReduceScatterOptions& opts) {
  return validated(OpKind::kReduceScatter, !opts.asyncOp, [&]() -> WorkPtr {
    const char* op = "reduce_scatter_tensor";
    if (auto w = onMirrors(op, outputs, inputs, [&](auto& out, auto& in) { return reduce_scatter_tensor_coalesced(out, in, opts); })) {
      return w;
    }
    if (outputs.empty() || outputs.size() != inputs.size()) {
      fail(op, rank_, collx::str("got ", outputs.size(), " outputs for ", inputs.size(), " inputs"));
    }
    const DataType dtype = checkTensor(outputs[0], op, rank_);
    for (size_t i = 0; i < outputs.size(); ++i) {
      checkTensor(inputs[i], op, rank_);
      if (outputs[i].scalar_type() != outputs[0].scalar_type() || inputs[i].scalar_type() != outputs[i].scalar_type() ||
          inputs[i].numel() != outputs[i].numel() * size_) {
        fail(op, rank_, collx::str("input must hold world_size x output = ", outputs[i].numel() * size_, " x ",
                                   outputs[i].scalar_type(), ", got ", inputs[i].numel(), " x ", inputs[i].scalar_type()));
      }
    }
    const ResolvedOp r = asDistError(op, rank_, [&] { return resolveOp(opts.reduceOp, dtype, op, rank_); });
    auto body = [this, ins = inputs, outs = outputs, r, dtype](const Collective& c) {
      std::string label;
      for (size_t i = 0; i < ins.size(); ++i) {
        // The blocks are read when the op runs.
        const size_t count = size_t(outs[i].numel());
        const at::Tensor in = contiguousOf(ins[i]);
        const char* base = static_cast<const char*>(in.data_ptr());
        std::vector<const void*> blocks;
        for (int q = 0; q < c.size(); ++q) blocks.push_back(base + size_t(q) * count * elementSize(dtype));
        label = intoContiguous(outs[i], [&](void* dst) {
          return reduceScatterInto(copies_, c, r, dtype, blocks, dst, count);
        });
      }
      return label;
    };
    return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, OpKind::kReduceScatter, dtype, outputs,
                   opTimeout(opts.timeout, timeout()), std::move(body), true, inputs);
  });
}

}  // namespace collx::torch_glue
