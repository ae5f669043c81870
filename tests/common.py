"""Shared helpers of the collx Python tests: deterministic per-rank data,
locally computed expected reductions, tensor comparison, and a tiny
"suite" mechanism that runs many named checks inside ONE multi-process launch
(process startup costs seconds) while still reporting each check as its own
pytest test.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from launcher import RanksFailed, run_ranks

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64]
DTYPES = FLOAT_DTYPES + INT_DTYPES + [torch.bool]

FLOAT_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
INT_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
BOOL_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
BITWISE_OPS = ["BAND", "BOR", "BXOR"]
# hier: one host here, a local reduce + broadcast; shm: these ranks share a host
# (over COLLX_TRANSPORT=tcp it is an error, and test_transports.py leaves it out)
ALGORITHMS = ["ring", "tree", "star", "direct", "hier", "shm", "auto"]
# From this size (the op's whole buffer on one rank) auto's all-reduce and
# broadcast run in shared memory when every rank of the group is on this host
# with shared memory (algorithms/allreduce.cc); all_gather and reduce_scatter
# do so at every size.
SHM_MIN_BYTES = 64 << 10


def labels_delta(group, before):
    """{label: calls} of the collx group's stats that grew since ``before``
    (an earlier ``torchcollx.get_stats(group)["algorithms"]``)."""
    import torchcollx
    now = torchcollx.get_stats(group)["algorithms"]
    return {k: v["calls"] - before.get(k, {"calls": 0})["calls"] for k, v in now.items()
            if v["calls"] > before.get(k, {"calls": 0})["calls"]}


def on_shm(group=None) -> bool:
    """Whether a collx group's ranks share memory (COLLX_TRANSPORT auto or shm)."""
    backend = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
    return backend.transport.startswith("shared memory")


def process_resources():
    """(fds, collx shared-memory mappings, threads) of this process."""
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as f:
        segments = sum("memfd:collx" in line for line in f)
    return fds, segments, len(os.listdir("/proc/self/task"))


def settled_resources(interval=0.05, limit=5.0):
    """process_resources() once two reads ``interval`` apart agree (at most
    ``limit`` s). A joined thread leaves /proc/self/task a moment after its
    join returns, since the kernel wakes the joiner before it reaps the
    thread; a leaked thread, descriptor or mapping stays and is counted."""
    last = process_resources()
    end = time.monotonic() + limit
    while time.monotonic() < end:
        time.sleep(interval)
        now = process_resources()
        if now == last:
            return now
        last = now
    return last


PREMUL_FACTOR = 0.5  # exact in every float dtype


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def ops_for(dtype):
    if dtype == torch.bool:
        return BOOL_OPS
    return FLOAT_OPS if dtype.is_floating_point else INT_OPS


def reduce_op(name, factor=PREMUL_FACTOR):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(dist.ReduceOp, name)


def gloo_supports(dtype, op) -> bool:
    """Whether the gloo oracle implements ``op`` for ``dtype`` (checked on torch 2.14)."""
    if op == "PREMUL_SUM":
        return False
    if op == "AVG":
        return dtype.is_floating_point
    return True


def _seed(*parts) -> int:
    s = 0x9E3779B9
    for p in parts:
        s = (s * 1000003 + int(p) + 12345) % (1 << 61)
    return s


def gen(rank, dtype, op, count, salt=0) -> torch.Tensor:
    """Deterministic data of ``rank`` for an all_reduce of ``op`` on ``count``
    elements. Values are chosen so that every reduction is exact in ``dtype``
    (small integers for sums, powers of two for products) except integer
    SUM/PRODUCT, which use wide ranges on purpose to exercise wrap-around."""
    g = torch.Generator().manual_seed(_seed(rank, DTYPES.index(dtype), ALL_OPS.index(op), count, salt))
    shape = (count,)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        if op in ("SUM", "AVG", "PREMUL_SUM"):
            return torch.randint(-8, 9, shape, generator=g).to(dtype)
        if op == "PRODUCT":
            choices = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], dtype=torch.float64)
            return choices[torch.randint(0, 6, shape, generator=g)].to(dtype)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)  # MIN / MAX
    info = torch.iinfo(dtype)
    if op == "AVG":  # no overflow, non-negative: floor == trunc, unambiguous
        return torch.randint(0, 31, shape, generator=g).to(dtype)
    if op == "PRODUCT" and dtype in (torch.int8, torch.uint8):
        lo = 0 if dtype == torch.uint8 else -5
        return torch.randint(lo, 6, shape, generator=g).to(dtype)  # wraps with 3-4 ranks
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


ALL_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]

_COMBINE = {
    "SUM": torch.add,
    "PRODUCT": torch.mul,
    "MIN": torch.minimum,
    "MAX": torch.maximum,
    "BAND": torch.bitwise_and,
    "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}


def expected(world_size, dtype, op, count, salt=0, factor=PREMUL_FACTOR) -> torch.Tensor:
    """The all_reduce result, computed locally from every rank's gen() data."""
    xs = [gen(r, dtype, op, count, salt) for r in range(world_size)]
    if op == "AVG":
        if dtype.is_floating_point:
            return (sum(x.double() for x in xs) / world_size).to(dtype)
        return (sum(x.long() for x in xs) // world_size).to(dtype)
    if op == "PREMUL_SUM":
        return sum(x.double() * factor for x in xs).to(dtype)
    # Exact in dtype (integer ops wrap like torch's; float data is exact).
    return functools.reduce(_COMBINE[op], xs)


def tolerance(dtype, op):
    """(rtol, atol): exact unless the op ends in a division (AVG)."""
    if op == "AVG" and dtype.is_floating_point:
        return torch.finfo(dtype).eps, 0.0
    return 0.0, 0.0


def mismatch(got: torch.Tensor, want: torch.Tensor, rtol=0.0, atol=0.0):
    """None when equal (within tolerance), else a short description."""
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != expected {want.dtype}"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    if got.numel() == 0:
        return None
    if rtol == 0 and atol == 0:
        bad = got != want
        if got.is_floating_point():
            bad &= ~(torch.isnan(got) & torch.isnan(want))
    else:
        g, w = got.double(), want.double()
        bad = (g - w).abs() > atol + rtol * w.abs()
    if not bad.any():
        return None
    idx = bad.reshape(-1).nonzero()[0].item()
    gf, wf = got.reshape(-1), want.reshape(-1)
    return (f"{int(bad.sum())}/{got.numel()} elements differ; first at flat index {idx}: "
            f"got {gf[idx].item()!r}, expected {wf[idx].item()!r}")


# ------------------------------------------------------------------ suites

def run_checks(checks, rank, world_size, *args):
    """Child side: runs each ``check(rank, world_size, fail, *args)`` and
    returns {name: [failure messages]}. ``fail(msg)`` records a failure; an
    exception is recorded with its traceback and the next check runs."""
    results = {}
    for check in checks:
        failures = []

        def fail(msg, _f=failures, _name=check.__name__):
            _f.append(msg)
            if len(_f) <= 5:
                print(f"[rank {rank}] {_name}: {msg}", flush=True)

        try:
            check(rank, world_size, fail, *args)
        except Exception:
            fail("raised:\n" + traceback.format_exc())
        results[check.__name__] = failures
    return results


class Suite:
    """Parent side: one lazy launch of ``fn`` (which returns run_checks'
    dict), shared by the tests that read their check's failures from it."""

    def __init__(self, fn, world_size, **launch_kwargs):
        self.fn, self.world_size, self.kwargs = fn, world_size, launch_kwargs
        self._done = False
        self._results = None
        self._error = None

    def results(self):
        if not self._done:
            self._done = True
            try:
                self._results = run_ranks(self.fn, self.world_size, **self.kwargs)
            except RanksFailed as e:
                self._error = e
        if self._error is not None:
            raise RanksFailed(f"the shared launch of this suite failed:\n{self._error}")
        return self._results

    def failures(self, name, limit=30):
        out = []
        for rank, res in enumerate(self.results()):
            if name not in res:
                out.append(f"rank {rank}: check {name} did not run")
                continue
            out.extend(f"rank {rank}: {m}" for m in res[name])
        if len(out) > limit:
            out = out[:limit] + [f"... and {len(out) - limit} more"]
        return out

    def check(self, name):
        failures = self.failures(name)
        assert not failures, f"{name} (world_size={self.world_size}) failed:\n" + "\n".join(failures)


def run_listed_checks(rank, ws, module, checks, setup):
    """Child side of suite_test: calls `module`'s function named `setup` (if
    any), then runs its check list named `checks`. By name, not by object:
    unpickling a function would import its module before the launcher has set
    up the rank (its gloo group)."""
    mod = importlib.import_module(module)
    if setup:
        getattr(mod, setup)()
    return run_checks(getattr(mod, checks), rank, ws)


def suite_test(module, checks, world_sizes, setup=None, **launch_kwargs):
    """A test over the check list named `checks` of `module`, parametrized by
    world size and check, whose cases share one lazy launch per world size;
    `setup` names a function of `module` each rank calls first. Assign it to a
    test_* name of that module."""
    names = [c.__name__ for c in getattr(sys.modules[module], checks)]
    suites = {ws: Suite(run_listed_checks, ws, args=(module, checks, setup), **launch_kwargs)
              for ws in world_sizes}

    @pytest.mark.parametrize("check", names)
    @pytest.mark.parametrize("ws", world_sizes, ids=lambda ws: f"ws{ws}")
    def test(ws, check):
        suites[ws].check(check)

    return test


def attempt(fn):
    """Runs ``fn()``: ("ok" or the exception's type name, its message without
    torch's C++ backtrace, seconds it took)."""
    t0 = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - t0)
    except Exception as e:
        return (type(e).__name__, str(e).split("\nException raised from")[0], time.monotonic() - t0)


def socket_inodes():
    """Inodes of this process's open sockets (to match /proc/self/net/tcp{,6} rows)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes
