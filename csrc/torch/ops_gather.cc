// The moving (non-reducing) collectives of CollxBackend: broadcast,
// all_gather in its forms, gather, scatter, all_to_all.
#include <algorithm>

#include "backend.h"
#include "core/algorithms/tuning.h"
#include "op_helpers.h"
#include "work.h"

namespace collx::torch_glue {

namespace {

void checkRoot(int64_t root, int size, const char* op, int rank) {
  if (root < 0 || root >= size) {
    fail(op, rank, collx::str("root rank ", root, " is out of range for a group of size ", size));
  }
}

// All-gather of the contiguous `input` into `blocks` (one per rank), on raw
// memory (op_helpers.h). Returns the path's label.
std::string allgatherInto(const Collective& c, const at::Tensor& input, const std::vector<void*>& blocks) {
  const size_t bytes = input.nbytes();
  collx::allgather(c, input.data_ptr(), blocks, size_t(input.numel()));
  if (movesInShm(c.transport)) return "all_gather/shm";
  if (twoLevelMoves(c.transport)) return "all_gather/hier";
  return allgatherDirect(c.size(), bytes) ? "all_gather/direct" : "all_gather/ring";
}

// Which outputs of a list all_gather receive their block where they lie:
// the contiguous ones that overlap no other. The rest go through a slot of
// the workspace each and are copied in rank order, so that where a caller
// passed one tensor twice the later rank's block wins, as in gloo.
std::vector<bool> receivesInPlace(const std::vector<at::Tensor>& outs) {
  std::vector<bool> direct(outs.size());
  std::vector<std::pair<const char*, size_t>> starts;  // (first byte, index)
  for (size_t r = 0; r < outs.size(); ++r) {
    direct[r] = outs[r].is_contiguous() && outs[r].nbytes() > 0;
    if (direct[r]) starts.emplace_back(static_cast<const char*>(outs[r].data_ptr()), r);
  }
  // Blocks of one size overlap only where neighbours in address order do.
  std::sort(starts.begin(), starts.end());
  for (size_t k = 1; k < starts.size(); ++k) {
    if (starts[k].first < starts[k - 1].first + outs[starts[k - 1].second].nbytes()) {
      direct[starts[k].second] = direct[starts[k - 1].second] = false;
    }
  }
  return direct;
}

}  // namespace

std::string treeLabel(const char* op, const Collective& c, size_t bytes) {
  int arity = chooseTreeArity(c.costs(), c.size(), c.treeArity, bytes);
  return collx::str(op, arity == c.size() - 1 ? "/direct" : arity == 1 ? "/chain" : "/tree");
}

c10::intrusive_ptr<c10d::Work> CollxBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  return validated(OpKind::kBroadcast, !opts.asyncOp, [&]() -> WorkPtr {
    const bool isRoot = rank_ == opts.rootRank;
    if (auto w = onMirror("broadcast", tensors, isRoot, !isRoot, [&](auto& host) { return broadcast(host, opts); })) {
      return w;
    }
    const char* op = "broadcast";
    checkSingle(tensors, op, rank_);
    const DataType dtype = checkTensor(tensors[0], op, rank_);
    checkRoot(opts.rootRank, size_, op, rank_);
    if (opts.rootTensor != 0) fail(op, rank_, collx::str("root tensor ", opts.rootTensor, " must be 0"));
    at::Tensor flat = contiguousOf(tensors[0]);
    std::vector<at::Tensor> outputs = tensors;
    const int root = int(opts.rootRank);
    auto body = [flat, outputs, root](const Collective& c) {
      collx::broadcast(c, flat.data_ptr(), size_t(flat.numel()), root);
      if (flat.data_ptr() != outputs[0].data_ptr()) outputs[0].copy_(flat);
      if (useSharedWindows(c.transport, size_t(flat.nbytes()))) return std::string("broadcast/shm");
      return treeLabel("broadcast", c, size_t(flat.nbytes()));
    };
    return enqueue(c10d::OpType::BROADCAST, OpKind::kBroadcast, dtype, outputs, opTimeout(opts.timeout, timeout()),
                   std::move(body));
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) {
  return validated(OpKind::kAllgather, !opts.asyncOp, [&]() -> WorkPtr {
    // torch passes outputs[rank][input] here but outputs[input][rank] to allgather.
    const char* op = "all_gather_coalesced";
    if (int(outputs.size()) != size_) {
      fail(op, rank_, collx::str("got ", outputs.size(), " output lists for a group of size ", size_));
    }
    std::vector<std::vector<at::Tensor>> byInput(inputs.size());
    for (const auto& perRank : outputs) {
      if (perRank.size() != inputs.size()) {
        fail(op, rank_, collx::str("each output list needs ", inputs.size(), " tensors, got ", perRank.size()));
      }
      for (size_t i = 0; i < inputs.size(); ++i) byInput[i].push_back(perRank[i]);
    }
    return allgather(byInput, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllgatherOptions& opts) {
  return validated(OpKind::kAllgather, !opts.asyncOp, [&]() -> WorkPtr {
    const char* op = "all_gather";
    if (auto w = onMirrors(op, outputs, inputs, [&](auto& out, auto& in) { return allgather(out, in, opts); })) {
      return w;
    }
    if (inputs.empty() || outputs.size() != inputs.size()) {
      fail(op, rank_, collx::str("got ", outputs.size(), " output lists for ", inputs.size(), " inputs"));
    }
    const DataType dtype = checkTensor(inputs[0], op, rank_);
    std::vector<at::Tensor> all;
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkTensor(inputs[i], op, rank_);
      if (int(outputs[i].size()) != size_) {
        fail(op, rank_, collx::str("output list has ", outputs[i].size(), " tensors for a group of size ", size_));
      }
      checkSameShape(outputs[i], inputs[i], op, rank_, "output");
      all.insert(all.end(), outputs[i].begin(), outputs[i].end());
    }
    auto body = [this, inputs, outputs](const Collective& c) {
      std::string label;
      for (size_t i = 0; i < inputs.size(); ++i) {
        const std::vector<at::Tensor>& outs = outputs[i];
        const std::vector<bool> direct = receivesInPlace(outs);
        const size_t bytes = inputs[i].nbytes();
        const bool anySlot = std::count(direct.begin(), direct.end(), false) > 0;
        char* const slots = anySlot ? copies_.get(std::max<size_t>(1, bytes * outs.size())) : nullptr;
        std::vector<void*> blocks;
        for (size_t r = 0; r < outs.size(); ++r) blocks.push_back(direct[r] ? outs[r].data_ptr() : slots + r * bytes);
        label = allgatherInto(c, contiguousOf(inputs[i]), blocks);
        for (size_t r = 0; r < outs.size(); ++r) {
          if (!direct[r]) outs[r].copy_(overBytes(blocks[r], outs[r]));  // in rank order: the last of a repeat wins
        }
      }
      return label;
    };
    return enqueue(c10d::OpType::ALLGATHER, OpKind::kAllgather, dtype, all, opTimeout(opts.timeout, timeout()),
                   std::move(body), true, inputs);
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outs{output}, ins{input};
  return allgather_into_tensor_coalesced(outs, ins, opts);
}

c10::intrusive_ptr<c10d::Work> CollxBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::AllgatherOptions& opts) {
  return validated(OpKind::kAllgather, !opts.asyncOp, [&]() -> WorkPtr {
    const char* op = "all_gather_into_tensor";
    if (auto w = onMirrors(op, outputs, inputs, [&](auto& out, auto& in) { return allgather_into_tensor_coalesced(out, in, opts); })) {
      return w;
    }
    if (inputs.empty() || outputs.size() != inputs.size()) {
      fail(op, rank_, collx::str("got ", outputs.size(), " outputs for ", inputs.size(), " inputs"));
    }
    const DataType dtype = checkTensor(inputs[0], op, rank_);
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkTensor(inputs[i], op, rank_);
      checkTensor(outputs[i], op, rank_);
      if (outputs[i].scalar_type() != inputs[i].scalar_type() || outputs[i].numel() != inputs[i].numel() * size_) {
        fail(op, rank_, collx::str("output must hold world_size x input = ", inputs[i].numel() * size_, " x ",
                                   inputs[i].scalar_type(), ", got ", outputs[i].numel(), " x ",
                                   outputs[i].scalar_type()));
      }
    }
    auto body = [inputs, outputs](const Collective& c) {
      std::string label;
      for (size_t i = 0; i < inputs.size(); ++i) {
        const at::Tensor input = contiguousOf(inputs[i]);  // read when the op runs
        label = intoContiguous(outputs[i], [&](void* flat) {
          return allgatherInto(c, input, blocksAt(flat, c.size(), input.nbytes()));
        });
      }
      return label;
    };
    return enqueue(c10d::OpType::_ALLGATHER_BASE, OpKind::kAllgather, dtype, outputs,
                   opTimeout(opts.timeout, timeout()), std::move(body), true, inputs);
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::GatherOptions& opts) {
  return validated(OpKind::kGather, !opts.asyncOp, [&]() -> WorkPtr {
    const char* op = "gather";
    if (auto w = onMirrors(op, outputs, inputs, [&](auto& out, auto& in) { return gather(out, in, opts); })) {
      return w;
    }
    checkSingle(inputs, op, rank_);
    const DataType dtype = checkTensor(inputs[0], op, rank_);
    checkRoot(opts.rootRank, size_, op, rank_);
    const int root = int(opts.rootRank);
    std::vector<at::Tensor> outs;
    if (rank_ == root) {
      if (outputs.size() != 1 || int(outputs[0].size()) != size_) {
        fail(op, rank_, collx::str("the root needs one output list of ", size_, " tensors"));
      }
      checkSameShape(outputs[0], inputs[0], op, rank_, "output");
      outs = outputs[0];
    } else if (!outputs.empty() && !outputs[0].empty()) {
      fail(op, rank_, "only the root may pass output tensors");
    }
    at::Tensor input = contiguousOf(inputs[0]);
    auto body = [input, outs, root](const Collective& c) {
      if (c.rank() != root) {
        exchange(c, {{root, input.data_ptr(), size_t(input.nbytes()), c.frame(0)}}, {});
        return std::string("gather/direct");
      }
      std::vector<at::Tensor> bufs;
      std::vector<Transfer> recvs;
      for (int r = 0; r < c.size(); ++r) {
        bufs.push_back(r == root ? input : contiguousOf(outs[r]));
        if (r != root) recvs.push_back({r, bufs[r].data_ptr(), size_t(bufs[r].nbytes()), c.frame(0)});
      }
      exchange(c, {}, recvs);
      for (int r = 0; r < c.size(); ++r) {
        if (bufs[r].data_ptr() != outs[r].data_ptr()) outs[r].copy_(bufs[r].view(outs[r].sizes()));
      }
      return std::string("gather/direct");
    };
    return enqueue(c10d::OpType::GATHER, OpKind::kGather, dtype, outs, opTimeout(opts.timeout, timeout()),
                   std::move(body), true, inputs);
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::scatter(std::vector<at::Tensor>& outputs,
                                                     std::vector<std::vector<at::Tensor>>& inputs,
                                                     const c10d::ScatterOptions& opts) {
  return validated(OpKind::kScatter, !opts.asyncOp, [&]() -> WorkPtr {
    const char* op = "scatter";
    if (auto w = onMirrors(op, outputs, inputs, [&](auto& out, auto& in) { return scatter(out, in, opts); })) {
      return w;
    }
    checkSingle(outputs, op, rank_);
    const DataType dtype = checkTensor(outputs[0], op, rank_);
    checkRoot(opts.rootRank, size_, op, rank_);
    const int root = int(opts.rootRank);
    std::vector<at::Tensor> ins;
    if (rank_ == root) {
      if (inputs.size() != 1 || int(inputs[0].size()) != size_) {
        fail(op, rank_, collx::str("the root needs one input list of ", size_, " tensors"));
      }
      checkSameShape(inputs[0], outputs[0], op, rank_, "input");
      for (const auto& t : inputs[0]) ins.push_back(contiguousOf(t));
    } else if (!inputs.empty() && !inputs[0].empty()) {
      fail(op, rank_, "only the root may pass input tensors");
    }
    at::Tensor out = outputs[0];
    at::Tensor buf = contiguousOf(out);
    auto body = [ins, out, buf, root](const Collective& c) {
      if (c.rank() != root) {
        exchange(c, {}, {{root, buf.data_ptr(), size_t(buf.nbytes()), c.frame(0)}});
      } else {
        std::vector<Transfer> sends;
        for (int r = 0; r < c.size(); ++r) {
          if (r != root) sends.push_back({r, ins[r].data_ptr(), size_t(ins[r].nbytes()), c.frame(0)});
        }
        exchange(c, sends, {});
        buf.copy_(ins[root].view(buf.sizes()));
      }
      if (buf.data_ptr() != out.data_ptr()) out.copy_(buf);
      return std::string("scatter/direct");
    };
    return enqueue(c10d::OpType::SCATTER, OpKind::kScatter, dtype, outputs, opTimeout(opts.timeout, timeout()),
                   std::move(body), true, allOf(inputs));
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                           std::vector<int64_t>& outputSplits,
                                                           std::vector<int64_t>& inputSplits,
                                                           const c10d::AllToAllOptions& opts) {
  return validated(OpKind::kAllToAll, !opts.asyncOp, [&]() -> WorkPtr {
    const char* op = "all_to_all_single";
    if (auto w = onMirrors(op, output, input,
                           [&](auto& out, auto& in) { return alltoall_base(out, in, outputSplits, inputSplits, opts); })) {
      return w;
    }
    const DataType dtype = checkTensor(input, op, rank_);
    checkTensor(output, op, rank_);
    if (output.scalar_type() != input.scalar_type()) {
      fail(op, rank_, collx::str("output dtype ", output.scalar_type(), " differs from input dtype ", input.scalar_type()));
    }
    // Splits count rows (dim 0); empty means equal splits.
    auto bounds = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
      int64_t rows = t.dim() ? t.size(0) : 1;
      std::vector<int64_t> offsets{0};
      if (splits.empty()) {
        if (rows % size_ != 0) {
          fail(op, rank_, collx::str(what, " has ", rows, " rows, not divisible by world size ", size_));
        }
        for (int r = 0; r < size_; ++r) offsets.push_back(offsets.back() + rows / size_);
      } else {
        if (int(splits.size()) != size_) {
          fail(op, rank_, collx::str(what, " split sizes have ", splits.size(), " entries for world size ", size_));
        }
        for (int64_t s : splits) {
          if (s < 0) fail(op, rank_, collx::str("negative ", what, " split size ", s));
          offsets.push_back(offsets.back() + s);
        }
        if (offsets.back() != rows) {
          fail(op, rank_, collx::str(what, " split sizes sum to ", offsets.back(), " but the tensor has ", rows, " rows"));
        }
      }
      int64_t rowBytes = rows ? int64_t(t.nbytes()) / rows : 0;
      for (auto& o : offsets) o *= rowBytes;
      return offsets;
    };
    const std::vector<int64_t> in = bounds(input, inputSplits, "input"), out = bounds(output, outputSplits, "output");
    if (in[rank_ + 1] - in[rank_] != out[rank_ + 1] - out[rank_]) {
      fail(op, rank_, collx::str("this rank sends itself ", in[rank_ + 1] - in[rank_], " bytes but expects ",
                                 out[rank_ + 1] - out[rank_]));
    }
    at::Tensor src = contiguousOf(input), dst = contiguousOf(output);
    auto body = [src, dst, output, in, out](const Collective& c) {
      auto* s = static_cast<char*>(src.data_ptr());
      auto* d = static_cast<char*>(dst.data_ptr());
      std::vector<Transfer> sends, recvs;
      for (int r = 0; r < c.size(); ++r) {
        if (r == c.rank()) continue;
        sends.push_back({r, s + in[r], size_t(in[r + 1] - in[r]), c.frame(0)});
        recvs.push_back({r, d + out[r], size_t(out[r + 1] - out[r]), c.frame(0)});
      }
      const int me = c.rank();
      exchange(c, sends, recvs, [&] { copyBytes(d + out[me], s + in[me], size_t(in[me + 1] - in[me])); });
      if (dst.data_ptr() != output.data_ptr()) output.copy_(dst);
      return std::string("all_to_all/direct");
    };
    return enqueue(c10d::OpType::ALLTOALL_BASE, OpKind::kAllToAll, dtype, {output}, opTimeout(opts.timeout, timeout()),
                   std::move(body), true, {input});
  });
}

c10::intrusive_ptr<c10d::Work> CollxBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllToAllOptions& opts) {
  return validated(OpKind::kAllToAll, !opts.asyncOp, [&]() -> WorkPtr {
    const char* op = "all_to_all";
    if (auto w = onMirrors(op, outputs, inputs, [&](auto& out, auto& in) { return alltoall(out, in, opts); })) {
      return w;
    }
    if (int(inputs.size()) != size_ || int(outputs.size()) != size_) {
      fail(op, rank_, collx::str("needs ", size_, " input and output tensors, got ", inputs.size(), " and ",
                                 outputs.size()));
    }
    const DataType dtype = checkTensor(inputs[0], op, rank_);
    std::vector<at::Tensor> ins, bufs;
    for (int r = 0; r < size_; ++r) {
      checkTensor(inputs[r], op, rank_);
      checkTensor(outputs[r], op, rank_);
      if (inputs[r].scalar_type() != inputs[0].scalar_type() || outputs[r].scalar_type() != inputs[0].scalar_type()) {
        fail(op, rank_, "all tensors must have one dtype");
      }
      ins.push_back(contiguousOf(inputs[r]));
      bufs.push_back(contiguousOf(outputs[r]));
    }
    if (ins[rank_].numel() != bufs[rank_].numel()) {
      fail(op, rank_, collx::str("this rank sends itself ", ins[rank_].numel(), " elements but its output for itself has ",
                                 bufs[rank_].numel()));
    }
    auto body = [ins, bufs, outputs](const Collective& c) {
      std::vector<Transfer> sends, recvs;
      for (int r = 0; r < c.size(); ++r) {
        if (r == c.rank()) continue;
        sends.push_back({r, ins[r].data_ptr(), size_t(ins[r].nbytes()), c.frame(0)});
        recvs.push_back({r, bufs[r].data_ptr(), size_t(bufs[r].nbytes()), c.frame(0)});
      }
      exchange(c, sends, recvs, [&] { bufs[c.rank()].view(-1).copy_(ins[c.rank()].view(-1)); });
      for (int r = 0; r < c.size(); ++r) {
        if (bufs[r].data_ptr() != outputs[r].data_ptr()) outputs[r].copy_(bufs[r]);
      }
      return std::string("all_to_all/direct");
    };
    return enqueue(c10d::OpType::ALLTOALL, OpKind::kAllToAll, dtype, outputs, opTimeout(opts.timeout, timeout()),
                   std::move(body), true, inputs);
  });
}

}  // namespace collx::torch_glue
