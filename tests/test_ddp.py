"""END-TO-END DDP TESTS (marker: ddp).

Plain ``DistributedDataParallel(model)`` (no comm hook) over collx: after a
few SGD steps, where each rank trains on its shard of a fixed global batch,
the parameters must equal single-process training on the whole batch (same
initial weights, same optimizer) within 1e-6. Models are float64 so that the
comparison is robust (differences are ~1e-15 when everything is right).

The non-zero ranks deliberately start from DIFFERENT random weights: DDP's
initial broadcast from rank 0 must fix that, so a broken broadcast fails too.
One launch per world size runs every model / variant (startup is expensive).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

torchcollx = pytest.importorskip("torchcollx")

from common import Suite, run_checks  # noqa: E402

pytestmark = pytest.mark.ddp

GLOBAL_BATCH = 24  # divisible by 2, 3 and 4
STEPS = 5
TOL = 1e-6


def _mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))


def _conv():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2), nn.ReLU(),  # 8x8 -> 3x3
        nn.Flatten(), nn.Linear(4 * 3 * 3, 3),
    )


MODELS = {
    "mlp": (_mlp, (10,), "mse"),
    "conv": (_conv, (2, 8, 8), "ce"),
}


def _batch(kind, step):
    """The fixed global batch of ``step``: inputs and targets."""
    _, in_shape, loss = MODELS[kind]
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn((GLOBAL_BATCH,) + in_shape, generator=g, dtype=torch.float64)
    if loss == "mse":
        y = torch.randn(GLOBAL_BATCH, 3, generator=g, dtype=torch.float64)
    else:
        y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)
    return x, y


def _loss(kind, out, y):
    return nn.functional.mse_loss(out, y) if MODELS[kind][2] == "mse" else nn.functional.cross_entropy(out, y)


def _build(kind, seed):
    torch.manual_seed(seed)
    return MODELS[kind][0]().double()


def _reference(kind, momentum):
    model = _build(kind, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(STEPS):
        x, y = _batch(kind, step)
        opt.zero_grad()
        _loss(kind, model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train_ddp(rank, ws, kind, momentum=0.0, no_sync_micro=False, **ddp_kwargs):
    # Rank 0 has the reference init; the others start elsewhere on purpose.
    model = _build(kind, seed=0 if rank == 0 else 100 + rank)
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=momentum)
    shard = GLOBAL_BATCH // ws
    for step in range(STEPS):
        x, y = _batch(kind, step)
        x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
        opt.zero_grad()
        if no_sync_micro:
            # Two micro-batches: the first accumulates locally, the second syncs.
            half = shard // 2
            with ddp.no_sync():
                (_loss(kind, ddp(x[:half]), y[:half]) * half / shard).backward()
            (_loss(kind, ddp(x[half:]), y[half:]) * (shard - half) / shard).backward()
        else:
            _loss(kind, ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _compare(fail, what, got, want):
    worst = max((g - w).abs().max().item() for g, w in zip(got, want))
    if not worst <= TOL:
        fail(f"{what}: parameters differ from single-process training by up to {worst:.3g} (tolerance {TOL})")


def check_mlp(rank, ws, fail):
    _compare(fail, "mlp", _train_ddp(rank, ws, "mlp"), _reference("mlp", 0.0))


def check_mlp_small_buckets_momentum(rank, ws, fail):
    """Many buckets (so many all_reduces in flight at once) and momentum."""
    got = _train_ddp(rank, ws, "mlp", momentum=0.9, bucket_cap_mb=0.002)
    _compare(fail, "mlp, bucket_cap_mb=0.002, momentum", got, _reference("mlp", 0.9))


def check_mlp_gradient_as_bucket_view_no_sync(rank, ws, fail):
    got = _train_ddp(rank, ws, "mlp", no_sync_micro=True, gradient_as_bucket_view=True)
    _compare(fail, "mlp, no_sync micro-batches, gradient_as_bucket_view", got, _reference("mlp", 0.0))


def check_conv(rank, ws, fail):
    _compare(fail, "conv", _train_ddp(rank, ws, "conv"), _reference("conv", 0.0))


def check_ddp_used_collx(rank, ws, fail):
    stats = torchcollx.get_stats()
    labels = stats["algorithms"]
    if not any(k.startswith("all_reduce/") for k in labels) or not any(k.startswith("broadcast/") for k in labels):
        fail(f"DDP did not run all_reduce and broadcast on the collx world group: {labels}")
    if stats["bytes_sent"] <= 0:
        fail(f"no bytes sent: {stats}")


DDP_CHECKS = [
    check_mlp,
    check_mlp_small_buckets_momentum,
    check_mlp_gradient_as_bucket_view_no_sync,
    check_conv,
    check_ddp_used_collx,  # last: reads the counters of the checks above
]


def _ddp_suite(rank, ws):
    torch.set_num_threads(1)
    return run_checks(DDP_CHECKS, rank, ws)


DDP_WS = [2, 4]
SUITES = {ws: Suite(_ddp_suite, ws, timeout=300) for ws in DDP_WS}


@pytest.mark.parametrize("check", [c.__name__ for c in DDP_CHECKS])
@pytest.mark.parametrize("ws", DDP_WS, ids=lambda ws: f"ws{ws}")
def test_ddp_matches_single_process(ws, check):
    SUITES[ws].check(check)
