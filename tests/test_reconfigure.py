"""Reconfigure (torch 2.14's API, as gloo has it) on collx, with real
processes: a group created with enable_reconfigure=True grows and shrinks
through _reconfigure, refuses stale uuids and foreign handles, and leaks
nothing over 100 reconfigures; and ranks as threads of one process (as
torchft's tests run them) abort, shrink and reconfigure.
"""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

from launcher import run_ranks  # noqa: E402
from test_fault_tolerance import GROUP_TIMEOUT, TRANSPORTS, _attempt, _check_collectives, _train_ddp  # noqa: E402


# ------------------------------------------------------------------ reconfigure

def _handles(tag, members):
    """Every member's reconfigure handle, through the test's store (out of band)."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"reconf/{tag}/{os.getpid()}", dist.distributed_c10d._get_reconfigure_handle())
    return [store.get(f"reconf/{tag}/{pid}").decode() for pid in members]


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _reconfigure(rank, ws, victim):
    dist.init_process_group("collx", init_method=os.environ["COLLX_TEST_INIT_METHOD"], rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT), enable_reconfigure=True)
    store = dist.distributed_c10d._get_default_store()
    out = {"unconfigured": _attempt(lambda: dist.all_reduce(torch.ones(2)))}
    store.set(f"pid/{rank}", str(os.getpid()))
    pids = [int(store.get(f"pid/{r}")) for r in range(ws)]
    # First a group of all but the last rank, then all of them (grow), then
    # without the victim after it dies (shrink), by a set of handles.
    if rank != ws - 1:
        dist.distributed_c10d._reconfigure(1, _handles(1, pids[:-1])).wait()
        _check_collectives(dist.group.WORLD, "first")
    dist.distributed_c10d._reconfigure(2, _handles(2, pids)).wait()
    out["grown"] = (dist.get_rank(), dist.get_world_size())
    _check_collectives(dist.group.WORLD, "grown")
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    out["failed"] = _attempt(lambda: dist.all_reduce(torch.ones(1 << 16)))
    alive = [p for r, p in enumerate(pids) if r != victim]
    given = _handles(3, alive)
    own = dist.distributed_c10d._get_reconfigure_handle()
    t0 = time.monotonic()
    dist.distributed_c10d._reconfigure(3, set(given)).wait()
    out["reconfigure_took"] = time.monotonic() - t0
    # A set ranks the handles in sorted order.
    out["shrunk"] = (dist.get_rank(), dist.get_world_size(), sorted(given).index(own))
    own = dist.distributed_c10d._get_reconfigure_handle()
    _check_collectives(dist.group.WORLD, "shrunk")
    out["ddp_identical"] = _train_ddp(dist.group.WORLD)
    out["stale uuid"] = _attempt(lambda: dist.distributed_c10d._reconfigure(3, _handles(4, alive)).wait())
    foreign = own.split(":")
    foreign[1] = "1234"
    out["foreign"] = _attempt(lambda: dist.distributed_c10d._reconfigure(5, [own, ":".join(foreign)]).wait())
    out["not a member"] = _attempt(lambda: dist.distributed_c10d._reconfigure(6, [h for h in _handles(6, alive)
                                                                                   if h != own]).wait())
    # Leaks: 100 more reconfigures of the survivors leave fds, threads and /dev/shm flat.
    # (The first ones warm up what stays for good: calibration caches, thread pools.)
    dist.distributed_c10d._reconfigure(7, _handles(7, alive)).wait()
    before = (_open_fds(), threading.active_count(), len(os.listdir("/dev/shm")))
    for i in range(100):
        dist.distributed_c10d._reconfigure(100 + i, _handles(100 + i, alive)).wait()
        dist.all_reduce(torch.ones(1 << 15))
    out["leaks"] = (before, (_open_fds(), threading.active_count(), len(os.listdir("/dev/shm"))))
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reconfigure_grow_shrink_and_reject(transport):
    ws, victim = 3, 1
    dev_shm = set(os.listdir("/dev/shm"))
    res = run_ranks(_reconfigure, ws, timeout=240, pg_timeout=GROUP_TIMEOUT, may_die=(victim,), init=False,
                    args=(victim,), env={"COLLX_TRANSPORT": transport})
    for rank in (0, 2):
        r = res[rank]
        kind, msg, _ = r["unconfigured"]
        assert kind == "DistBackendError" and "_reconfigure first" in msg, msg
        assert r["grown"] == (rank, ws), r["grown"]
        assert r["failed"][0] == "DistBackendError", r["failed"]
        new_rank, size, by_handle = r["shrunk"]
        assert size == ws - 1 and new_rank == by_handle, r["shrunk"]
        assert r["ddp_identical"]
        assert r["reconfigure_took"] < 5.0, r["reconfigure_took"]
        for key, words in (("stale uuid", "was used before"), ("foreign", "another group"),
                           ("not a member", "not among the handles")):
            kind, msg, _ = r[key]
            assert kind == "DistBackendError" and words in msg, (key, kind, msg)
        before, after = r["leaks"]
        assert after == before, f"rank {rank}: (fds, threads, /dev/shm) {before} -> {after} after 100 reconfigures"
    assert set(os.listdir("/dev/shm")) == dev_shm


# ------------------------------------------------------------------ ranks as threads

def test_ranks_as_threads_abort_shrink_reconfigure():
    """torchft's tests run ranks as threads of one process: every blocking
    call must let go of the GIL. Three backends on one store; the last one
    aborts; the others see it, shrink, and then reconfigure."""
    ws = 3
    store = dist.HashStore()
    results, errors = [None] * ws, []

    def rank_main(rank):
        try:
            prefix = dist.PrefixStore("threads/", store)
            b = torchcollx._C.create_backend(prefix, rank, ws, 30.0, "auto", 2, 1 << 19, "", "", "auto")
            x = torch.full((8,), float(rank + 1))
            b.allreduce([x], dist.AllreduceOptions()).wait()
            assert torch.equal(x, torch.full((8,), 6.0)), x
            store.set(f"first/{rank}", "done")
            if rank == ws - 1:
                store.wait([f"first/{r}" for r in range(ws)])  # else a slow rank's first op fails too
                b.abort()
                return
            failed = _attempt(lambda: b.allreduce([torch.ones(1 << 12)], dist.AllreduceOptions()).wait())
            shrunk = b.shrink([ws - 1])
            y = torch.ones(4)
            shrunk.allreduce([y], dist.AllreduceOptions()).wait()
            handle = shrunk.get_reconfigure_handle()
            store.set(f"handle/{rank}", handle)
            handles = [store.get(f"handle/{r}").decode() for r in range(ws - 1)]
            opts = dist.distributed_c10d.ReconfigureOptions()
            opts.uuid = 1
            opts.handles = handles[::-1]  # the ranks swap
            shrunk.reconfigure(opts).wait()
            z = torch.full((4,), float(rank))
            shrunk.allreduce([z], dist.AllreduceOptions()).wait()
            results[rank] = (failed[0], "abort" in failed[1], shrunk.size(), y.tolist(), shrunk.rank(), z.tolist())
            shrunk.shutdown()
            b.shutdown()
        except Exception as e:  # noqa: BLE001
            errors.append(f"rank {rank}: {type(e).__name__}: {e}")

    # Daemons: a hung rank fails the test below instead of keeping pytest alive.
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(ws)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    assert not errors, errors
    for rank in range(ws - 1):
        assert results[rank] == ("DistBackendError", True, 2, [2.0] * 4, 1 - rank, [1.0] * 4), results[rank]
