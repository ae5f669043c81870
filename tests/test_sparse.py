"""Sparse (COO) all-reduce at world sizes 2, 3 and 4, against gloo in the
same processes: 1-D, 2-D and hybrid (embedding-gradient shaped) tensors,
uncoalesced input, overlapping indices, an empty tensor on some ranks,
float32 / float64 / int64; then DDP on a model with nn.Embedding(sparse=True)
trained on collx and on gloo from the same weights and data, which must end
equal (float64, within 1e-12: the dense gradients' all-reduce sums in another
order than gloo's ring at n >= 3; the sparse all-reduce itself matches gloo
bit for bit, checked above).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

import launcher  # noqa: E402
from common import suite_test  # noqa: E402


def _sparse(rank, shape, sparse_dim, nnz, dtype, seed):
    """Deterministic uncoalesced COO data of `rank` (duplicate indices included)."""
    g = torch.Generator().manual_seed(seed * 101 + rank)
    idx = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g) for d in range(sparse_dim)])
    vals = torch.randint(-50, 50, (nnz, *shape[sparse_dim:]), generator=g).to(dtype)
    if dtype.is_floating_point:
        vals = vals / 7
    return torch.sparse_coo_tensor(idx, vals, shape)


def check_sparse_all_reduce(rank, ws, fail):
    cases = [((100,), 1), ((12, 9), 2), ((50, 8), 1)]
    for dtype in (torch.float32, torch.float64, torch.int64):
        for shape, sparse_dim in cases:
            for nnz in (0, 1, 17, 300):
                # Rank 1 varies its nnz, so the ranks' nnz differ.
                mine = nnz + 5 * rank if nnz else (3 if rank == 1 else 0)
                x = _sparse(rank, shape, sparse_dim, mine, dtype, nnz)
                ref = x.clone()
                dist.all_reduce(ref, group=launcher.gloo())
                work = dist.all_reduce(x, async_op=True)
                work.wait()
                where = f"{dtype} shape={shape} sparse_dim={sparse_dim} nnz={mine}"
                if not x.is_sparse or not x.is_coalesced():
                    fail(f"sparse all_reduce {where}: result is not a coalesced sparse tensor")
                elif not (torch.equal(x.indices(), ref.indices()) and torch.equal(x.values(), ref.values())):
                    fail(f"sparse all_reduce {where}: differs from gloo by "
                         f"{(x.to_dense() - ref.to_dense()).abs().max().item()}")
                value = work.get_future().value()
                if len(value) != 1 or not torch.equal(value[0].to_dense(), ref.to_dense()):
                    fail(f"sparse all_reduce {where}: the future's value is not the result")
    # Ranks that disagree on the shape get a clear error, not garbage.
    g = dist.new_group(backend="collx")
    try:
        dist.all_reduce(_sparse(rank, (10 + (rank == 0),), 1, 4, torch.float32, 1), group=g)
        fail("sparse all_reduce with different sizes per rank did not raise")
    except dist.DistBackendError as e:
        if "sizes" not in str(e):
            fail(f"sparse all_reduce with different sizes: unclear error: {e}")


class _EmbeddingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(200, 16, sparse=True)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def check_sparse_ddp_equals_gloo(rank, ws, fail):
    """DDP over a model with sparse embedding gradients: collx == gloo."""
    torch.manual_seed(0)
    init = _EmbeddingModel().double().state_dict()
    trained = {}
    for name, group in (("gloo", launcher.gloo()), ("collx", None)):
        model = _EmbeddingModel().double()
        model.load_state_dict(init)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(1000 + rank)
        for _ in range(5):
            ids = torch.randint(0, 200, (8, 6), generator=g)
            target = torch.randn(8, 4, generator=g, dtype=torch.float64)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(ids), target).backward()
            opt.step()
        trained[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in trained["gloo"].items():
        if not torch.allclose(v, trained["collx"][k], rtol=0, atol=1e-12):
            fail(f"sparse DDP: {k} differs from gloo by {(v - trained['collx'][k]).abs().max().item()}")
    if torch.equal(trained["collx"]["emb.weight"], init["emb.weight"]):
        fail("sparse DDP: the embedding did not train")
    labels = torchcollx.get_stats()["algorithms"]
    if "all_reduce/sparse" not in labels:
        fail(f"DDP did not all-reduce sparse gradients on collx: {sorted(labels)}")


SPARSE_CHECKS = [check_sparse_all_reduce, check_sparse_ddp_equals_gloo]

test_sparse = suite_test(__name__, "SPARSE_CHECKS", [2, 3, 4], with_gloo=True, timeout=240)
