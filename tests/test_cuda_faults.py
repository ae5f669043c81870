"""Fault tolerance on CUDA tensors, ranks sharing cuda:0: abort with a staged
op (1 MiB) and a peers-path op (4 MiB, the ranks' mapped device buffers) in
flight; abort with 64 MiB buffers mapped, which the failed op and the group
must release; shrink_group after a SIGKILL followed by CUDA all-reduces on the
shrunk group; a device rank with no memory left for its peer buffer. The same
cases run on CPU tensors through the emulated CUDA path in
test_fault_tolerance.py and test_staging.py (COLLX_STAGE_CPU_TENSORS). Skips
without a GPU.
"""
from __future__ import annotations

import gc
import os
import signal
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torchcollx._C.cuda_kernels),
    reason="needs a GPU and a CUDA build of collx",
)

from common import expected, gen, mismatch  # noqa: E402
from launcher import Died, run_ranks  # noqa: E402
from test_fault_tolerance import GROUP_TIMEOUT, _abort_in_flight, _attempt, assert_abort_outcome  # noqa: E402


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


def _store_barrier(store, name, ws):
    store.add(name, 1)
    deadline = time.monotonic() + 30
    while int(store.add(name, 0)) < ws:
        assert time.monotonic() < deadline, f"store barrier {name}"
        time.sleep(0.005)


def _settle():
    """This process's device memory is its tensors alone (no cached blocks)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _abort_with_buffers_mapped(rank, ws):
    """Every rank maps the others' 64 MiB buffers (one peers-path all-reduce);
    ranks 0..ws-2 start another that the last rank never joins, and rank 0
    aborts. Returns when each op failed against when rank 0 aborted, and the
    GPU's free memory before the buffers and after the group is gone."""
    dev = torch.device("cuda", 0)
    store = dist.distributed_c10d._get_default_store()
    dist.all_reduce(torch.ones(1 << 16, device=dev))  # staged: contexts and staging ready
    _settle()
    _store_barrier(store, "ready", ws)
    free_before = torch.cuda.mem_get_info()[0]
    _store_barrier(store, "measured", ws)
    t = torch.ones(16 << 20, device=dev)
    dist.all_reduce(t)  # through the peers' buffers: 64 MiB each, mapped by all
    out = {"first_ok": bool(torch.all(t == ws).item())}
    if rank < ws - 1:
        work = dist.all_reduce(t, async_op=True)
        if rank == 0:
            time.sleep(0.3)
            out["abort_at"] = time.monotonic()
            dist.distributed_c10d._abort_process_group()
        out["wait"] = _attempt(work.wait)
        out["failed_at"] = time.monotonic()
        del work
    _store_barrier(store, "failed", ws)
    if rank != 0:
        dist.destroy_process_group()
    del t
    gc.collect()
    _settle()
    _store_barrier(store, "destroyed", ws)
    out["freed"] = torch.cuda.mem_get_info()[0] - free_before
    return out


@pytest.mark.parametrize("ws", [2, 4], ids=lambda ws: f"ws{ws}")
def test_abort_fails_peers_op_fast_and_releases_buffers(ws):
    res = run_ranks(_abort_with_buffers_mapped, ws, timeout=120, pg_timeout=GROUP_TIMEOUT)
    abort_at = res[0]["abort_at"]
    for rank, r in enumerate(res):
        assert r["first_ok"], (rank, r)
        if rank < ws - 1:
            kind, msg, _ = r["wait"]
            assert kind == "DistBackendError" and "abort" in msg, (rank, r)
            assert r["failed_at"] - abort_at < 0.1, f"rank {rank} failed {r['failed_at'] - abort_at:.3f} s after abort"
        # Each rank's own buffer is 64 MiB: one left behind shows.
        assert r["freed"] > -(32 << 20), f"rank {rank}: {-r['freed'] >> 20} MiB of device memory not released"


def _no_buffer_cuda(rank, ws):
    """Rank 0 all-reduces CUDA tensors with almost no device memory left, so
    that it cannot make its peer buffer; the other ranks pass CPU tensors."""
    log = tempfile.TemporaryFile(mode="w+")
    os.dup2(log.fileno(), 2)
    dist.init_process_group("collx", init_method=os.environ["COLLX_TEST_INIT_METHOD"], rank=rank, world_size=ws)
    counts = (16 << 20, 1 << 20, 8 << 20, 1 << 20)  # 64, 4, 32 and 4 MiB: the first buffer is 64 MiB
    dev = torch.device("cuda", 0) if rank == 0 else torch.device("cpu")
    tensors = [gen(rank, torch.float32, "SUM", n, salt=i).to(dev) for i, n in enumerate(counts)]
    dist.all_reduce(torch.ones(1000, device=dev))  # staged: the staging's streams and mirrors exist
    hog = None
    if rank == 0:  # room for small allocations, none for a 64 MiB buffer
        _settle()
        hog = torch.empty(torch.cuda.mem_get_info()[0] - (32 << 20), dtype=torch.uint8, device=dev)
    out = []
    for i, t in enumerate(tensors):
        dist.all_reduce(t)
        if m := mismatch(t.cpu(), expected(ws, torch.float32, "SUM", counts[i], salt=i)):
            out.append(f"op {i}: {m}")
    labels = {k: v["calls"] for k, v in torchcollx.get_stats()["algorithms"].items()}
    del hog
    dist.destroy_process_group()
    log.seek(0)
    return out, labels, [line.strip() for line in log if "through host memory" in line]


@pytest.mark.gpu_alone
@pytest.mark.parametrize("ws", [2, 3], ids=lambda ws: f"ws{ws}")
def test_device_rank_without_memory_for_its_buffer_gives_up_once(ws):
    res = run_ranks(_no_buffer_cuda, ws, timeout=120, init=False, env={"COLLX_DEBUG": "info"})
    for rank, (out, labels, lines) in enumerate(res):
        assert out == [] and "all_reduce/peers" not in labels, (rank, out, labels)
        if rank == 0:
            assert len(lines) == 1 and "memory" in lines[0], lines
        else:
            assert lines == [], (rank, lines)
