"""Models, data and training helpers of the DDP comm hook tests
(tests/test_ddp_hook.py): reference single-process training, DDP training on
each rank's shard, and the comparisons with their tolerances."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torchcollx.ddp import CommHookState, comm_hook


GLOBAL_BATCH = 24  # divisible by 1, 2, 3 and 4
STEPS = 5
TOL = 1e-6
COMPRESSED_STEPS = 8
# After COMPRESSED_STEPS steps at lr 0.1 on a fixed batch, compressed training
# must stay within ||got - ref|| <= TOL * ||ref - init|| of uncompressed float32
# single-process training (bf16 keeps 8 significant bits, fp16 11; the worst
# seen was 0.011 for bf16 and 0.0017 for fp16, conv+BN),
COMPRESSED_TOL = {"bf16": 0.05, "fp16": 0.01}
# its whole-batch loss must have fallen below LOSS_DROP x the initial loss
# (uncompressed: about 0.66x for the MLP and 0.45x for conv+BN), and lie within
# LOSS_TOL (relative) of the uncompressed final loss.
LOSS_DROP = 0.8
LOSS_TOL = 0.02


# ------------------------------------------------------------------ models and data

def _mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))


def _conv_bn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(),  # 8x8 -> 3x3
        nn.Flatten(), nn.Linear(4 * 3 * 3, 3),
    )


class _TwoHeads(nn.Module):
    """A trunk and two heads; a step uses one head, by the step's parity, so
    the other head's parameters are unused in that step."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 16), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(16, 3), nn.Linear(16, 3)])
        self.head = 0

    def forward(self, x):
        return self.heads[self.head](self.trunk(x))


MODELS = {  # name -> (constructor, input shape, loss, has BatchNorm)
    "mlp": (_mlp, (10,), "mse", False),
    "conv_bn": (_conv_bn, (2, 8, 8), "ce", True),
    "two_heads": (_TwoHeads, (10,), "mse", False),
}


def _batch(kind, step, dtype, fixed=False):
    """The global batch of ``step`` (the same one every step when ``fixed``).
    For a fixed batch the targets are a function of the inputs, so that the
    loss can fall."""
    _, in_shape, loss, _ = MODELS[kind]
    g = torch.Generator().manual_seed(1000 + (0 if fixed else step))
    x = torch.randn((GLOBAL_BATCH,) + in_shape, generator=g, dtype=torch.float64)
    flat = x.reshape(GLOBAL_BATCH, -1)
    if loss == "mse":
        y = torch.randn(GLOBAL_BATCH, 3, generator=g, dtype=torch.float64)
        if fixed:
            y = torch.tanh(flat[:, :3] - flat[:, 3:6])
        return x.to(dtype), y.to(dtype)
    if fixed:
        y = (flat[:, :3] + flat[:, 3:6]).argmax(1)
    else:
        y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)
    return x.to(dtype), y


def _loss(kind, out, y):
    return nn.functional.mse_loss(out, y) if MODELS[kind][2] == "mse" else nn.functional.cross_entropy(out, y)


def _build(kind, seed, dtype):
    torch.manual_seed(seed)
    return MODELS[kind][0]().to(dtype)


def _forward_whole(kind, model, x, ws):
    """The whole batch in one process; BN models normalize it in ``ws`` groups."""
    if MODELS[kind][3] and ws > 1:
        return torch.cat([model(c) for c in x.chunk(ws)])
    return model(x)


def _set_head(model, step):
    if isinstance(model, _TwoHeads):
        model.head = step % 2


def _reference(kind, ws, dtype=torch.float64, momentum=0.0, steps=STEPS, fixed=False):
    """Single-process training on the whole batch; returns (params, initial
    whole-batch loss, final whole-batch loss)."""
    model = _build(kind, 0, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    first = None
    for step in range(steps):
        x, y = _batch(kind, step, dtype, fixed)
        _set_head(model, step)
        opt.zero_grad()
        loss = _loss(kind, _forward_whole(kind, model, x, ws), y)
        first = loss.item() if first is None else first
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], first, _whole_loss(kind, model, ws, dtype, steps, fixed)


def _whole_loss(kind, model, ws, dtype, steps, fixed):
    x, y = _batch(kind, steps - 1, dtype, fixed)
    with torch.no_grad():
        return _loss(kind, _forward_whole(kind, model, x, ws), y).item()


def _train_ddp(rank, ws, kind, *, hook=None, dtype=torch.float64, momentum=0.0, steps=STEPS, fixed=False,
               no_sync_micro=False, group=None, **ddp_kwargs):
    """DDP training; ``hook`` is None (DDP's default) or (algorithm, compression).
    Returns (params, hook state, final whole-batch loss)."""
    model = _build(kind, 0 if rank == 0 else 100 + rank, dtype)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, **ddp_kwargs)
    state = None
    if hook is not None:
        state = CommHookState(process_group=group, algorithm=hook[0], compression=hook[1])
        ddp.register_comm_hook(state, comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=momentum)
    shard = GLOBAL_BATCH // ws
    for step in range(steps):
        x, y = _batch(kind, step, dtype, fixed)
        x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
        _set_head(model, step)
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
    params = [p.detach().clone() for p in model.parameters()]
    return params, state, _whole_loss(kind, model, ws, dtype, steps, fixed)


def _compare(fail, what, got, want, rtol=0.0, atol=TOL):
    worst, where = 0.0, None
    for i, (g, w) in enumerate(zip(got, want)):
        excess = ((g - w).abs() - rtol * w.abs()).max().item()
        if where is None or excess > worst:
            worst, where = excess, i
    if not worst <= atol:
        diff = max((g - w).abs().max().item() for g, w in zip(got, want))
        fail(f"{what}: parameters differ from single-process training by up to {diff:.3g} "
             f"(tolerance atol {atol:g} + rtol {rtol:g}; worst in parameter {where})")
    return worst


def _exact(rank, ws, fail, kind, what, hook=None, momentum=0.0, **kw):
    got, _, _ = _train_ddp(rank, ws, kind, hook=hook, momentum=momentum, **kw)
    ref, _, _ = _reference(kind, ws, momentum=momentum)
    _compare(fail, what, got, ref)


def _relative_deviation(kind, got, ref):
    """||got - ref|| / ||ref - init||: how far compressed training strayed from
    uncompressed training, relative to how far training moved the weights."""
    init = [p.detach() for p in _build(kind, 0, torch.float32).parameters()]
    flat = lambda ts: torch.cat([t.reshape(-1).double() for t in ts])  # noqa: E731
    return ((flat(got) - flat(ref)).norm() / (flat(ref) - flat(init)).norm()).item()


def _compressed(rank, ws, fail, kind, compression, what, **kw):
    got, state, got_loss = _train_ddp(rank, ws, kind, hook=("auto", compression), dtype=torch.float32,
                                      steps=COMPRESSED_STEPS, fixed=True, **kw)
    ref, first, ref_loss = _reference(kind, ws, dtype=torch.float32, steps=COMPRESSED_STEPS, fixed=True)
    _check_compressed(fail, f"{what} ({compression})", kind, compression, got, ref, first, got_loss, ref_loss)
    s = state.stats()
    if s["buckets"] == 0 or s["bytes_in"] != 2 * s["bytes_reduced"]:
        fail(f"{what} ({compression}): the hook did not halve the bytes: {s}")


def _check_compressed(fail, what, kind, compression, got, ref, first, got_loss, ref_loss):
    dev = _relative_deviation(kind, got, ref)
    if os.environ.get("HOOK_DEBUG"):
        with open(os.environ["HOOK_DEBUG"], "a") as f:
            f.write(f"ws{dist.get_world_size()} r{dist.get_rank()} {what}: relative deviation {dev:.3g}, "
                    f"loss {first:.4g} -> {got_loss:.4g} (uncompressed {ref_loss:.4g})\n")
    if not dev <= COMPRESSED_TOL[compression]:
        fail(f"{what}: the weights strayed from uncompressed single-process training by {dev:.3g} of the "
             f"distance training moved them (tolerance {COMPRESSED_TOL[compression]:g})")
    if not (got_loss < LOSS_DROP * first and abs(got_loss - ref_loss) <= LOSS_TOL * ref_loss):
        fail(f"{what}: the loss went from {first:.4g} to {got_loss:.4g} (uncompressed: {ref_loss:.4g}); "
             f"expected below {LOSS_DROP:.2f}x the start and within {LOSS_TOL:.0%} of uncompressed")


# ------------------------------------------------------------------ checks
