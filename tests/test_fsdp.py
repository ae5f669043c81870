"""FSDP2 (fully_shard) over collx on CPU: the parameters after a few steps.

FSDP shards every parameter across the ranks and trains with
all_gather_into_tensor (parameters, uneven shards padded) and
reduce_scatter_tensor (gradients). In float32 the result must match one
process training on all the data; with bfloat16 parameters and float32
gradient reduction (MixedPrecisionPolicy) it must match the same FSDP run
over gloo in the same processes.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")
fsdp = pytest.importorskip("torch.distributed.fsdp")

from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

from common import mismatch  # noqa: E402
from launcher import gloo, run_ranks  # noqa: E402

STEPS = 4


def _model():
    torch.manual_seed(0)  # 33 rows: uneven shards at every world size here
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 33), torch.nn.ReLU(),
                               torch.nn.Linear(33, 1))


def _batch(step, r):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + r))
    return x, x.sum(1, keepdim=True)


def _train_fsdp(rank, ws, group, mp_policy):
    model = _model()
    mesh = DeviceMesh.from_group(group, "cpu")
    kwargs = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fsdp.fully_shard(layer, **kwargs)
    fsdp.fully_shard(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
    return [p.full_tensor().detach() for p in model.parameters()]


def _train_reference(ws):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        xs, ys = zip(*(_batch(step, r) for r in range(ws)))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _fsdp(rank, ws):
    fails = []
    collx = dist.new_group(backend="collx")
    fp32 = _train_fsdp(rank, ws, collx, None)
    for i, (p, q) in enumerate(zip(fp32, _train_reference(ws))):
        if m := mismatch(p, q, 1e-5, 1e-6):
            fails.append(f"float32: parameter {i} vs one process: {m}")
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mixed = _train_fsdp(rank, ws, collx, policy)
    for i, (p, q) in enumerate(zip(mixed, _train_fsdp(rank, ws, gloo(), policy))):
        if m := mismatch(p, q, 1e-5, 1e-6):
            fails.append(f"bf16 params, fp32 reduce: parameter {i} vs gloo: {m}")
    # The policy took effect: bfloat16 forward passes end elsewhere than float32 ones.
    if max((p - q).abs().max().item() for p, q in zip(mixed, fp32)) < 1e-4:
        fails.append("the bf16 run matches the float32 run: was the mixed-precision policy applied?")
    ran = set(torchcollx.get_stats(collx)["algorithms"])
    if not {label.split("/")[0] for label in ran} >= {"all_gather", "reduce_scatter"}:
        fails.append(f"collx ran {sorted(ran)}; expected all_gather and reduce_scatter")
    return fails


@pytest.mark.parametrize("ws", [2, 3])
def test_fsdp_matches_one_process_and_gloo(ws):
    for rank, fails in enumerate(run_ranks(_fsdp, ws, timeout=180, with_gloo=True)):
        assert not fails, f"rank {rank}: " + "\n".join(fails)
