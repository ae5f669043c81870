"""THE COLLX DDP COMM HOOK (marker: ddp): torchcollx.ddp.comm_hook / CommHookState.

Every check trains a small model for a few SGD steps under
``DistributedDataParallel`` (each rank on its shard of a fixed global batch)
and compares the parameters with single-process training on the whole batch,
from the same initial weights with the same optimizer:

* no hook, and the collx hook without compression (every algorithm):
  float64 models, within 1e-6 (differences are ~1e-15 when all is right);
* the hook with bf16 / fp16 compression: float32 models against float32
  single-process training on a fixed batch: the weights within
  COMPRESSED_TOL (relative to how far training moved them) and the loss
  falling, to within LOSS_TOL of the uncompressed loss.

BatchNorm under DDP normalizes each rank's shard with that shard's statistics
(SyncBatchNorm is GPU-only), so the single-process reference of a BN model runs
the whole global batch in one process and one backward pass, but normalizes it
in the same ``world_size`` groups ("ghost" batch norm); that is the same
function of the weights as DDP training, so it must agree just as closely.

The non-zero ranks start from different random weights: DDP's initial
broadcast must fix that. One launch per world size (2 and 4) runs every check;
the 1-rank case runs inside each launch, on per-rank 1-rank collx groups.
HOOK_DEBUG=FILE makes the ranks append the deviations of compressed training
to FILE (to re-derive COMPRESSED_TOL).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

torchcollx = pytest.importorskip("torchcollx")

import torch.distributed as dist  # noqa: E402

import launcher  # noqa: E402
from common import run_checks, suite_test  # noqa: E402
from ddp_hook_common import (  # noqa: E402
    GLOBAL_BATCH,
    STEPS,
    COMPRESSED_STEPS,
    _batch,
    _loss,
    _build,
    _reference,
    _whole_loss,
    _train_ddp,
    _compare,
    _exact,
    _compressed,
    _check_compressed,
)
from torchcollx.ddp import CommHookState, comm_hook  # noqa: E402

pytestmark = pytest.mark.ddp

def check_no_hook_mlp(rank, ws, fail):
    _exact(rank, ws, fail, "mlp", "mlp, no hook")


def check_no_hook_conv_bn(rank, ws, fail):
    _exact(rank, ws, fail, "conv_bn", "conv+BN, no hook")


def check_hook_mlp_each_algorithm(rank, ws, fail):
    for algo in torchcollx.ALGORITHMS:
        _exact(rank, ws, fail, "mlp", f"mlp, hook {algo}", hook=(algo, None))


def check_hook_conv_bn(rank, ws, fail):
    _exact(rank, ws, fail, "conv_bn", "conv+BN, hook auto", hook=("auto", None))


def check_hook_bf16_mlp(rank, ws, fail):
    _compressed(rank, ws, fail, "mlp", "bf16", "mlp")


def check_hook_fp16_mlp(rank, ws, fail):
    _compressed(rank, ws, fail, "mlp", "fp16", "mlp")


def check_hook_bf16_conv_bn(rank, ws, fail):
    _compressed(rank, ws, fail, "conv_bn", "bf16", "conv+BN")


def check_hook_fp16_conv_bn_small_buckets(rank, ws, fail):
    """Many buckets, so many compressed buffers and all-reduces in flight."""
    _compressed(rank, ws, fail, "conv_bn", "fp16", "conv+BN, bucket_cap_mb=0.001", bucket_cap_mb=0.001)


def check_hook_no_sync_gradient_as_bucket_view(rank, ws, fail):
    _exact(rank, ws, fail, "mlp", "mlp, hook auto, no_sync micro-batches, gradient_as_bucket_view",
           hook=("auto", None), no_sync_micro=True, gradient_as_bucket_view=True)
    _compressed(rank, ws, fail, "mlp", "bf16", "mlp, no_sync micro-batches, gradient_as_bucket_view",
                no_sync_micro=True, gradient_as_bucket_view=True)


def check_hook_find_unused_parameters(rank, ws, fail):
    _exact(rank, ws, fail, "two_heads", "two heads (one unused per step), hook auto, find_unused_parameters",
           hook=("auto", None), find_unused_parameters=True)
    _exact(rank, ws, fail, "two_heads", "two heads, hook star, find_unused_parameters, momentum",
           hook=("star", None), momentum=0.9, find_unused_parameters=True)


def check_hook_static_graph(rank, ws, fail):
    _exact(rank, ws, fail, "mlp", "mlp, hook auto, static_graph", hook=("auto", None), static_graph=True)
    _exact(rank, ws, fail, "conv_bn", "conv+BN, hook tree, static_graph, gradient_as_bucket_view",
           hook=("tree", None), static_graph=True, gradient_as_bucket_view=True)


def check_hook_bucket_sizes(rank, ws, fail):
    for cap in (0.0005, 0.002, 1000):
        _exact(rank, ws, fail, "mlp", f"mlp, hook auto, bucket_cap_mb={cap}, momentum", hook=("auto", None),
               momentum=0.9, bucket_cap_mb=cap)


def check_hook_one_rank_group(rank, ws, fail):
    """Each rank alone in a 1-rank collx group: DDP on it is plain training on
    the rank's local batch, which here is the whole batch."""
    groups = [dist.new_group([r], backend="collx") for r in range(ws)]
    mine = groups[rank]
    for hook in (None, ("auto", None), ("ring", None)):
        got, _, _ = _train_ddp(0, 1, "conv_bn", hook=hook, group=mine)
        ref, _, _ = _reference("conv_bn", 1)
        _compare(fail, f"1-rank group, conv+BN, hook {hook}", got, ref)
    got, _, loss = _train_ddp(0, 1, "mlp", hook=("auto", "bf16"), group=mine, dtype=torch.float32,
                              steps=COMPRESSED_STEPS, fixed=True)
    ref, first, ref_loss = _reference("mlp", 1, dtype=torch.float32, steps=COMPRESSED_STEPS, fixed=True)
    _check_compressed(fail, "1-rank group, mlp (bf16)", "mlp", "bf16", got, ref, first, loss, ref_loss)
    # The hook's own future on a 1-rank group: completed, with the bucket itself.
    t = torch.arange(8, dtype=torch.float32)
    v = comm_hook(CommHookState(mine), _Bucket(0, t)).wait()
    if v.data_ptr() != t.data_ptr() or not torch.equal(v, torch.arange(8, dtype=torch.float32)):
        fail(f"1-rank group: the hook's future holds {v}, not the bucket unchanged")


class _Bucket:
    """What comm_hook reads of a dist.GradBucket (which Python cannot construct)."""

    def __init__(self, index, buffer):
        self._index, self._buffer = index, buffer

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer


def check_hook_future_is_bucket_in_place(rank, ws, fail):
    """The future's value is the bucket buffer, averaged in place; the
    compressed path reuses one 16-bit buffer per bucket index."""
    for algo in torchcollx.ALGORITHMS:
        for compression in (None, "bf16", "fp16"):
            state = CommHookState(None, algo, compression)
            ptrs = set()
            for rep in range(2):
                for index, n in enumerate((1, 1000, 70001)):
                    # Small integers: every average below is exact in bf16 and fp16.
                    t = torch.full((n,), float(4 * (rank + 1) + rep), dtype=torch.float32)
                    t[::3] = -8.0 * (rank + 1)
                    want = torch.full((n,), 4 * (ws + 1) / 2 + rep, dtype=torch.float32)
                    want[::3] = -8.0 * (ws + 1) / 2
                    v = comm_hook(state, _Bucket(index, t)).wait()
                    what = f"hook {algo}, compression {compression}, {n} elements, call {rep}"
                    if v.data_ptr() != t.data_ptr():
                        fail(f"{what}: the future's value is not the bucket buffer")
                    if not torch.equal(t, want):
                        fail(f"{what}: got {t[:4].tolist()}..., expected {want[:4].tolist()}...")
                ptrs.update(b.data_ptr() for b in state._buffers.values())
            want_buffers = 0 if compression is None else 3
            if len(state._buffers) != want_buffers or len(ptrs) != want_buffers:
                fail(f"hook {algo}, compression {compression}: {len(state._buffers)} cached buffers, "
                     f"{len(ptrs)} distinct over two steps; expected {want_buffers} (one per bucket)")
    # 16-bit buckets travel as they are (pre-divided); float64 refuses compression.
    h = torch.full((100,), 2.0 * (rank + 1), dtype=torch.bfloat16)
    comm_hook(CommHookState(None, "auto", "fp16"), _Bucket(0, h)).wait()
    if not torch.equal(h, torch.full((100,), float(ws + 1), dtype=torch.bfloat16)):
        fail(f"bf16 bucket with fp16 compression: got {h[:4].tolist()}")
    try:
        comm_hook(CommHookState(None, "auto", "bf16"), _Bucket(0, torch.ones(4, dtype=torch.float64)))
        fail("compression of a float64 bucket did not raise")
    except TypeError as e:
        if "float32" not in str(e):
            fail(f"unclear error for a float64 bucket: {e}")


def check_registration_errors(rank, ws, fail):
    """Every bad state fails when it is created, i.e. before register_comm_hook
    and long before the first backward pass."""
    def expect(exc, needle, fn, what):
        try:
            fn()
        except exc as e:
            if needle not in str(e):
                fail(f"{what}: the {exc.__name__} does not say {needle!r}: {e}")
            return
        except Exception as e:  # noqa: BLE001
            fail(f"{what}: raised {type(e).__name__} instead of {exc.__name__}: {e}")
            return
        fail(f"{what}: no error")

    expect(ValueError, "not 'collx'", lambda: CommHookState(process_group=launcher.gloo()), "a gloo group")
    expect(ValueError, "bogus", lambda: CommHookState(algorithm="bogus"), "an unknown algorithm")
    expect(ValueError, "int8", lambda: CommHookState(compression="int8"), "an unknown compression")
    expect(ValueError, "compression", lambda: CommHookState(compression="BF16"), "a misspelt compression")
    expect(TypeError, "ProcessGroup", lambda: CommHookState(process_group="collx"), "a group that is a string")
    expect(TypeError, "CommHookState", lambda: comm_hook(None, _Bucket(0, torch.ones(2))), "a state of the wrong type")
    # A good state registers on a DDP model (DDP checks the hook's annotations).
    ddp = nn.parallel.DistributedDataParallel(_build("mlp", 0, torch.float64))
    ddp.register_comm_hook(CommHookState(), comm_hook)


def check_auto_matches_backend(rank, ws, fail):
    """The hook labels "auto" buckets with backend.choose_allreduce (the
    group's fitted model, COLLX_TUNING): it must be what the backend runs for
    "auto"."""
    backend = torchcollx.stats.backend_of()
    for nbytes in (4, 4096, 60_000, 100_000, 1 << 20, 25 << 20):
        t = torch.zeros(nbytes // 4)
        before = backend.stats()["algorithms"]
        backend.allreduce_with(t, "auto").wait()
        after = backend.stats()["algorithms"]
        ran = [k for k, v in after.items() if v["calls"] != before.get(k, {"calls": 0})["calls"]]
        mine = "all_reduce/" + backend.choose_allreduce(nbytes)
        if ran != [mine]:
            fail(f"{nbytes} bytes: the backend ran {ran}, backend.choose_allreduce says {mine}")


def check_allreduce_with_blocking(rank, ws, fail):
    """blocking=True returns once the sum is in the tensor, for every
    algorithm (odd counts included), with a completed Work."""
    backend = torchcollx.stats.backend_of()
    for algorithm in ("auto", "ring", "tree", "star", "direct"):
        for count in (1, 7, 1001, 300_000):
            t = torch.full((count,), float(rank + 1))
            work = backend.allreduce_with(t, algorithm, blocking=True)
            if not work.is_completed() or not bool((t == ws * (ws + 1) / 2).all()):
                fail(f"{algorithm}, {count} elements: completed={work.is_completed()}, got {t[:3].tolist()}")


def check_stats(rank, ws, fail):
    """State counters, and the same in torchcollx.get_stats()["ddp_hook"]."""
    before = torchcollx.get_stats()
    _, auto, _ = _train_ddp(rank, ws, "mlp", hook=("auto", None), bucket_cap_mb=0.002)
    _, star, _ = _train_ddp(rank, ws, "mlp", hook=("star", "bf16"), dtype=torch.float32, bucket_cap_mb=0.002)
    after = torchcollx.get_stats()
    a, s = auto.stats(), star.stats()
    if a["buckets"] < STEPS or a["bytes_in"] != a["bytes_reduced"] or a["compression_ratio"] != 1.0:
        fail(f"uncompressed state: {a}")
    if sum(c["buckets"] for c in a["algorithms"].values()) != a["buckets"]:
        fail(f"uncompressed state: per-algorithm buckets do not add up: {a}")
    if s["algorithms"].keys() != {"star"} or s["algorithms"]["star"]["buckets"] != s["buckets"]:
        fail(f"forced star: {s}")
    if s["bytes_in"] != 2 * s["bytes_reduced"] or s["compression_ratio"] != 2.0:
        fail(f"bf16 state does not halve the bytes: {s}")
    hook0, hook1 = before["ddp_hook"], after["ddp_hook"]
    for key in ("buckets", "bytes_in", "bytes_reduced"):
        if hook1[key] - hook0[key] != a[key] + s[key]:
            fail(f"get_stats()['ddp_hook'][{key!r}] grew by {hook1[key] - hook0[key]}, "
                 f"the two states counted {a[key]} + {s[key]}")
    grew = hook1["algorithms"]["star"]["buckets"] - hook0["algorithms"].get("star", {"buckets": 0})["buckets"]
    if grew < s["buckets"]:
        fail(f"get_stats()['ddp_hook'] star buckets grew by {grew}, expected >= {s['buckets']}")
    calls = after["algorithms"].get("all_reduce/star", {"calls": 0})["calls"] - \
        before["algorithms"].get("all_reduce/star", {"calls": 0})["calls"]
    if calls < s["buckets"]:
        fail(f"the backend ran all_reduce/star {calls} times for {s['buckets']} forced-star buckets")
    if "ddp_hook" not in torchcollx.get_stats(dist.new_group(backend="collx")):
        fail("get_stats() of a group without hooks has no 'ddp_hook'")


HOOK_CHECKS = [
    check_registration_errors,
    check_no_hook_mlp,
    check_no_hook_conv_bn,
    check_hook_mlp_each_algorithm,
    check_hook_conv_bn,
    check_hook_bf16_mlp,
    check_hook_fp16_mlp,
    check_hook_bf16_conv_bn,
    check_hook_fp16_conv_bn_small_buckets,
    check_hook_no_sync_gradient_as_bucket_view,
    check_hook_find_unused_parameters,
    check_hook_static_graph,
    check_hook_bucket_sizes,
    check_hook_future_is_bucket_in_place,
    check_auto_matches_backend,
    check_allreduce_with_blocking,
    check_stats,
    check_hook_one_rank_group,
]


test_ddp_comm_hook = suite_test(__name__, "HOOK_CHECKS", [2, 4], timeout=300, with_gloo=True)


# ------------------------------------------------------------------ CUDA (skipped without a GPU)

def _cuda_suite(rank, ws):
    return run_checks([check_hook_cuda], rank, ws)


def check_hook_cuda(rank, ws, fail):
    """CUDA gradients: the hook hands them (or their 16-bit cast, made on the
    GPU) to the backend, which stages them; the future is CUDA-aware. DDP itself would
    broadcast CUDA tensors through collx at construction, so the initial
    weights go through the CPU here and DDP gets init_sync=False."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    for compression in (None, "bf16", "fp16"):
        model = _build("mlp", 0 if rank == 0 else 100 + rank, torch.float32).to(device)
        for p in model.parameters():
            host = p.detach().cpu()
            dist.broadcast(host, 0)
            with torch.no_grad():
                p.copy_(host)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device], init_sync=False,
                                                  broadcast_buffers=False, bucket_cap_mb=0.001)
        ddp.register_comm_hook(CommHookState(None, "auto", compression), comm_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        shard = GLOBAL_BATCH // ws
        for step in range(COMPRESSED_STEPS):
            x, y = _batch("mlp", step, torch.float32, fixed=True)
            x, y = x[rank * shard:(rank + 1) * shard].to(device), y[rank * shard:(rank + 1) * shard].to(device)
            opt.zero_grad()
            _loss("mlp", ddp(x), y).backward()
            opt.step()
        got = [p.detach().cpu() for p in model.parameters()]
        loss = _whole_loss("mlp", model.cpu(), ws, torch.float32, COMPRESSED_STEPS, True)
        ref, first, ref_loss = _reference("mlp", ws, dtype=torch.float32, steps=COMPRESSED_STEPS, fixed=True)
        if compression is None:
            _compare(fail, "cuda, mlp, hook auto", got, ref, rtol=1e-4, atol=1e-5)
        else:
            _check_compressed(fail, f"cuda, mlp ({compression})", "mlp", compression, got, ref, first, loss, ref_loss)
    for compression in (None, "bf16", "fp16", "auto"):  # these values are exact in 16 bits
        state = CommHookState(None, "auto", compression)
        for rep in range(2):
            t = torch.full((70001,), float(4 * (rank + 1) + rep), device=device)
            want = torch.full((70001,), 4 * (ws + 1) / 2 + rep, device=device)
            v = comm_hook(state, _Bucket(0, t)).wait()
            if v.data_ptr() != t.data_ptr() or not torch.equal(t, want):
                fail(f"cuda, compression {compression}: the future's value is not the bucket averaged in place: "
                     f"{t[:3].tolist()} (want {want[:3].tolist()})")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("ws", [2, 4], ids=lambda ws: f"ws{ws}")
def test_ddp_comm_hook_cuda(ws):
    results = launcher.run_ranks(_cuda_suite, ws, timeout=300)
    failures = [f"rank {r}: {m}" for r, res in enumerate(results) for m in res["check_hook_cuda"]]
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ compression="auto"

SLOW_LINK = "collx-tuning 1\nring 30 1\ntree 30 1\nstar 30 1\ndirect 30 1\nhier 30 1\n"  # 1 B/us
FAST_LINK = "collx-tuning 1\nring 30 1e9\ntree 30 1e9\nstar 30 1e9\ndirect 30 1e9\nhier 30 1e9\n"


def _compression_auto(rank, ws):
    """A 4 MiB float32 bucket and a float64 one under compression="auto"."""
    state = CommHookState(None, "auto", "auto")
    t = torch.full((1 << 20,), float(rank + 1))
    d = torch.full((1000,), float(rank + 1), dtype=torch.float64)
    comm_hook(state, _Bucket(0, t)).wait()
    comm_hook(state, _Bucket(1, d)).wait()
    want = (ws + 1) / 2
    return state.stats()["bytes_reduced"], bool((t == want).all()), bool((d == want).all())


@pytest.mark.parametrize("link, compressed", [(SLOW_LINK, True), (FAST_LINK, False)], ids=["slow", "fast"])
def test_compression_auto_follows_the_model(link, compressed, tmp_path):
    """On a slow link (1 B/us) halving the bytes saves far more than the casts
    cost, on an infinitely fast one nothing: the ranks agree either way. A
    float64 bucket is never compressed (the values here are exact in bf16).
    Over TCP: the shm all-reduce, which auto takes on shared memory from 64
    KiB, has no wire time in the model, so there auto never compresses."""
    path = tmp_path / "tuning.txt"
    path.write_text(link)
    results = launcher.run_ranks(_compression_auto, 2, timeout=60,
                                 env={"COLLX_TUNING": str(path), "COLLX_TRANSPORT": "tcp"})
    float_bytes = (1 << 20) * (2 if compressed else 4)
    assert results == [(float_bytes + 8000, True, True)] * 2
