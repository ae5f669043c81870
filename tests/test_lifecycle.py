"""The life cycle of collx process groups: init methods (tcp, file, env),
destroy and re-init, op timeouts, mismatched collectives, destroy with ops in
flight, and a peer that destroys its group.
"""
from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

import launcher  # noqa: E402
from collectives_common import _data  # noqa: E402
from common import expected, gen, mismatch  # noqa: E402
from launcher import run_ranks  # noqa: E402


# ------------------------------------------------------------------ init methods, re-init

def _basic(rank, ws):
    assert dist.get_backend() == "collx", dist.get_backend()
    assert (dist.get_rank(), dist.get_world_size()) == (rank, ws)
    x = gen(rank, torch.float32, "SUM", 10007)
    dist.all_reduce(x)
    assert mismatch(x, expected(ws, torch.float32, "SUM", 10007)) is None, "all_reduce"
    b = _data(rank, torch.int64, 100, 5)
    dist.broadcast(b, src=ws - 1)
    assert mismatch(b, _data(ws - 1, torch.int64, 100, 5)) is None, "broadcast"
    outs = [torch.empty(3) for _ in range(ws)]
    dist.all_gather(outs, torch.full((3,), float(rank)))
    assert all(torch.equal(o, torch.full((3,), float(r))) for r, o in enumerate(outs)), outs
    dist.barrier()
    return torchcollx.get_stats()["ops"]


@pytest.mark.parametrize("init", ["tcp", "file", "env"])
def test_init_methods(init):
    assert run_ranks(_basic, 3, timeout=120, backend_init=init) == [4, 4, 4]


def _reinit(rank, ws, ports):
    base = os.environ["COLLX_TEST_INIT_METHOD"]
    methods = [f"{base}.0", f"tcp://127.0.0.1:{ports[0]}", f"{base}.2", f"tcp://127.0.0.1:{ports[1]}"]
    for cycle, method in enumerate(methods):
        dist.init_process_group("collx", init_method=method, rank=rank, world_size=ws)
        s = torchcollx.get_stats()
        assert s["ops"] == 0, f"cycle {cycle}: a fresh world group starts with ops={s['ops']}"
        g = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm="ring"))
        for group in (None, g):
            x = gen(rank, torch.float64, "SUM", 3001, salt=cycle)
            dist.all_reduce(x, group=group)
            m = mismatch(x, expected(ws, torch.float64, "SUM", 3001, salt=cycle))
            assert m is None, f"cycle {cycle}, group {group}: {m}"
        w = dist.all_reduce(torch.ones(10), async_op=True)
        w.wait()
        dist.destroy_process_group()
        assert not dist.is_initialized(), f"cycle {cycle}: still initialized after destroy"
    return True


def test_destroy_and_reinit_several_times():
    """init / use / destroy four times in the same processes (file:// and tcp://)."""
    ports = (launcher.free_port(), launcher.free_port())
    while ports[1] == ports[0]:
        ports = (ports[0], launcher.free_port())
    assert run_ranks(_reinit, 3, timeout=120, init=False, args=(ports,)) == [True] * 3


def _timeout(rank, ws):
    """Rank 1 never joins the ops of a group with a 2 s timeout."""
    g = dist.new_group(backend="collx", timeout=datetime.timedelta(seconds=2))
    g2 = dist.new_group(backend="collx", timeout=datetime.timedelta(seconds=2))
    if rank != 0:
        time.sleep(8)  # well past rank 0's timeouts
        return None
    out = {}
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10), group=g)
        out["sync"] = "no error"
    except Exception as e:
        out["sync"] = (type(e).__name__, str(e), time.monotonic() - t0)
    # The same through async_op: wait() and the future raise, the work is completed.
    t0 = time.monotonic()
    w = dist.broadcast(torch.ones(10), src=1, group=g2, async_op=True)  # a receiver waits
    try:
        w.wait()
        out["async"] = "no error"
    except Exception as e:
        out["async"] = (type(e).__name__, str(e), time.monotonic() - t0)
    out["completed"] = w.is_completed()
    try:
        w.get_future().wait()
        out["future"] = "no error"
    except Exception as e:
        out["future"] = type(e).__name__
    return out


def test_op_timeout_raises_instead_of_hanging():
    res = run_ranks(_timeout, 2, timeout=90)[0]
    for key, op in (("sync", "all_reduce"), ("async", "broadcast")):
        assert res[key] != "no error", f"{op} with an absent peer returned normally"
        name, msg, took = res[key]
        assert name == "DistBackendError", (key, name, msg)
        assert op in msg and "rank 0" in msg, msg
        assert 1.0 <= took <= 20.0, f"the 2 s op timeout of {op} fired after {took:.1f} s"
    assert res["completed"] is True, "a failed work is not is_completed()"
    assert res["future"] != "no error", "the future of a failed work did not raise"


def _mismatched(rank, ws):
    """Ranks disagree on the size of an all_reduce: an error, not a hang."""
    g = dist.new_group(backend="collx", timeout=datetime.timedelta(seconds=30),
                       pg_options=torchcollx.Options(algorithm="ring"))
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000 + rank), group=g)
        return ("no error", "", time.monotonic() - t0)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)


def test_mismatched_collective_fails_fast():
    results = run_ranks(_mismatched, 2, timeout=90)
    for rank, (name, msg, took) in enumerate(results):
        assert name == "DistBackendError", f"rank {rank}: {name}: {msg}"
        assert "all_reduce" in msg and f"rank {rank}" in msg, f"rank {rank}: {msg}"
        assert took < 20, f"rank {rank}: the size mismatch took {took:.1f} s to surface (group timeout 30 s)"
    assert any("mismatch" in msg for _, msg, _ in results), [m for _, m, _ in results]


def _destroy_in_flight(rank, ws):
    """destroy_process_group with async ops not waited for: no hang, no
    crash; each work either succeeded or fails with DistBackendError; a new
    group afterwards works."""
    base = os.environ["COLLX_TEST_INIT_METHOD"]
    out = []
    for cycle in range(2):
        dist.init_process_group("collx", init_method=f"{base}.{cycle}", rank=rank, world_size=ws)
        ts = [torch.ones(1 << 18) for _ in range(6)]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        dist.destroy_process_group()
        for i, (w, t) in enumerate(zip(works, ts)):
            try:
                w.wait()
                if not torch.equal(t, torch.full_like(t, float(ws))):
                    out.append(f"cycle {cycle}: work {i} succeeded with a wrong result")
            except dist.DistBackendError:
                pass
            except Exception as e:
                out.append(f"cycle {cycle}: work {i} failed with {type(e).__name__}: {e}")
    dist.init_process_group("collx", init_method=f"{base}.final", rank=rank, world_size=ws)
    x = gen(rank, torch.float32, "SUM", 4099)
    dist.all_reduce(x)
    if m := mismatch(x, expected(ws, torch.float32, "SUM", 4099)):
        out.append(f"all_reduce after the destroys: {m}")
    dist.destroy_process_group()
    return out


def test_destroy_with_ops_in_flight_then_reinit():
    results = run_ranks(_destroy_in_flight, 3, timeout=120, init=False)
    problems = [f"rank {r}: {m}" for r, ms in enumerate(results) for m in ms]
    assert not problems, "\n".join(problems)


def _peer_leaves(rank, ws):
    """The last rank destroys a collx group; the others then use it."""
    g = dist.new_group(backend="collx", timeout=datetime.timedelta(seconds=60))
    x = torch.ones(1000)
    dist.all_reduce(x, group=g)  # the group worked
    if rank == ws - 1:
        dist.destroy_process_group(g)
        dist.barrier(group=launcher.gloo())
        return None
    dist.barrier(group=launcher.gloo())
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 20), group=g)
        return ("no error", "", time.monotonic() - t0)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)


def test_peer_destroying_its_group_fails_fast():
    """Ops on a group whose peer is gone: DistBackendError naming op and
    rank, long before the 60 s group timeout."""
    results = run_ranks(_peer_leaves, 3, timeout=120, with_gloo=True)
    for rank, res in enumerate(results[:-1]):
        name, msg, took = res
        assert name == "DistBackendError", f"rank {rank}: {name}: {msg}"
        assert "all_reduce" in msg and f"rank {rank}" in msg, f"rank {rank}: {msg}"
        assert took < 20, f"rank {rank}: took {took:.1f} s to notice"
