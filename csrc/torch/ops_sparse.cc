// All-reduce of a sparse COO tensor (SUM), as gloo runs it, so that DDP on
// models with sparse gradients (nn.Embedding(sparse=True)) moves over:
//
//   1. coalesce the input;
//   2. all-gather each rank's (sparse_dim, dense_dim, nnz, sizes...): the
//      ranks must agree on everything but nnz;
//   3. all-gather the indices and the values, each rank's padded to the
//      largest nnz;
//   4. on every rank, sum the ranks' tensors in rank order and coalesce, the
//      way gloo does, so that both give the same bits; copy it into the input.
#include "backend.h"
#include "op_helpers.h"
#include "work.h"

namespace collx::torch_glue {

namespace {

Collective as(const Collective& c, DataType dtype) {
  return Collective{c.transport, c.kind, dtype, c.seq, c.deadline, c.segmentBytes, c.treeArity, c.workspace, c.tuning};
}

std::string sizesOf(const int64_t* meta, size_t n) {
  std::string s;
  for (size_t i = 3; i < n; ++i) s += collx::str(i > 3 ? ", " : "", meta[i]);
  return collx::str("sparse_dim ", meta[0], ", dense_dim ", meta[1], ", sizes [", s, "]");
}

}  // namespace

c10::intrusive_ptr<c10d::Work> CollxBackend::allreduceSparse(const at::Tensor& tensor,
                                                             const c10d::AllreduceOptions& opts) {
  if (opts.reduceOp != c10d::ReduceOp::SUM) {
    fail("all_reduce", rank_, "sparse tensors support ReduceOp.SUM only (as with gloo)");
  }
  if (!tensor.device().is_cpu()) fail("all_reduce", rank_, "sparse tensors must be on the CPU");
  if (tensor.layout() != at::kSparse) fail("all_reduce", rank_, "sparse tensors must be in the COO layout");
  const DataType dtype = coreDtype(tensor, "all_reduce", rank_);
  auto body = [tensor](const Collective& c) {
    const at::Tensor input = tensor.coalesce();
    const int n = c.size();
    // 2. Shapes and nnz.
    const size_t metaLen = 3 + size_t(input.dim());
    std::vector<int64_t> meta(metaLen * size_t(n));
    int64_t* mine = meta.data() + metaLen * size_t(c.rank());
    mine[0] = input.sparse_dim();
    mine[1] = input.dense_dim();
    mine[2] = input._nnz();
    for (int64_t d = 0; d < input.dim(); ++d) mine[3 + d] = input.size(d);
    collx::allgather(as(c, DataType::kInt64), meta.data(), metaLen);
    int64_t maxNnz = 0;
    for (int r = 0; r < n; ++r) {
      const int64_t* theirs = meta.data() + metaLen * size_t(r);
      if (!std::equal(theirs + 3, theirs + metaLen, mine + 3) || theirs[0] != mine[0] || theirs[1] != mine[1]) {
        throw Error(collx::str("sparse all_reduce: rank ", r, " has ", sizesOf(theirs, metaLen), ", rank ", c.rank(),
                               " has ", sizesOf(mine, metaLen)));
      }
      maxNnz = std::max(maxNnz, theirs[2]);
    }
    // 3. Indices and values, padded to maxNnz.
    const int64_t sparseDim = input.sparse_dim();
    at::Tensor indices = at::zeros({n, sparseDim, maxNnz}, at::kLong);
    indices[c.rank()].narrow(1, 0, input._nnz()).copy_(input.indices());
    collx::allgather(as(c, DataType::kInt64), indices.data_ptr(), size_t(sparseDim * maxNnz));
    std::vector<int64_t> valueShape = input.values().sizes().vec();
    valueShape[0] = maxNnz;
    valueShape.insert(valueShape.begin(), n);
    at::Tensor values = at::zeros(valueShape, input.values().options());
    values[c.rank()].narrow(0, 0, input._nnz()).copy_(input.values());
    collx::allgather(as(c, DataType::kUInt8), values.data_ptr(), size_t(values[0].nbytes()));
    // 4. Sum in rank order, as gloo does.
    at::Tensor output;
    for (int r = 0; r < n; ++r) {
      const int64_t nnz = meta[metaLen * size_t(r) + 2];
      at::Tensor part = at::sparse_coo_tensor(indices[r].narrow(1, 0, nnz), values[r].narrow(0, 0, nnz),
                                              input.sizes(), input.options());
      output = r == 0 ? part : output + part;
    }
    tensor.copy_(output.coalesce());
    return std::string("all_reduce/sparse");
  };
  return enqueue(c10d::OpType::ALLREDUCE, OpKind::kAllreduce, dtype, {tensor}, opTimeout(opts.timeout, timeout()),
                 std::move(body));
}

}  // namespace collx::torch_glue
