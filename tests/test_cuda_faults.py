"""Fault tolerance on CUDA tensors, ranks sharing cuda:0: abort with a staged
op (1 MiB) and a peers-path op (4 MiB, the ranks' mapped device buffers) in
flight, and shrink_group after a SIGKILL followed by CUDA all-reduces on the
shrunk group. The same cases run on CPU tensors through the emulated CUDA
path in test_fault_tolerance.py (COLLX_STAGE_CPU_TENSORS). Skips without a GPU.
"""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torchcollx._C.cuda_kernels),
    reason="needs a GPU and a CUDA build of collx",
)

from launcher import Died, run_ranks  # noqa: E402
from test_fault_tolerance import GROUP_TIMEOUT, _abort_in_flight, assert_abort_outcome  # noqa: E402


@pytest.mark.parametrize("numel", [1 << 18, 1 << 20], ids=["staged", "peers"])
@pytest.mark.parametrize("ws", [3, 4], ids=lambda ws: f"ws{ws}")
def test_abort_cuda_ops_in_flight(ws, numel):
    res = run_ranks(_abort_in_flight, ws, timeout=120, pg_timeout=GROUP_TIMEOUT, args=(numel, "cuda:0"))
    assert_abort_outcome(res, ws)


def _shrink_cuda(rank, ws, victim):
    dev = torch.device("cuda", 0)
    dist.all_reduce(torch.ones(1000, device=dev))
    if rank == victim:
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    failed = None
    for _ in range(100000):
        try:
            dist.all_reduce(torch.ones(1 << 20, device=dev))
        except Exception as e:  # noqa: BLE001
            failed = str(e)
            break
    group = dist.shrink_group([victim])
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ok = []
    for numel in (7, 1 << 18, 1 << 20, 4 << 20):  # host staging, pipelined, peers path
        t = torch.full((numel,), float(r + 1), device=dev)
        dist.all_reduce(t, group=group)
        ok.append(bool(torch.all(t == n * (n + 1) / 2).item()))
    torch.cuda.synchronize()
    return {"failed": failed, "ok": ok, "size": n}


@pytest.mark.parametrize("ws", [3, 4], ids=lambda ws: f"ws{ws}")
def test_shrink_then_cuda_all_reduce(ws):
    victim = 1
    res = run_ranks(_shrink_cuda, ws, timeout=120, pg_timeout=GROUP_TIMEOUT, may_die=(victim,), args=(victim,))
    assert isinstance(res[victim], Died)
    for rank in range(ws):
        if rank != victim:
            r = res[rank]
            assert r["failed"] and r["size"] == ws - 1 and all(r["ok"]), (rank, r)
