"""Peers that die or stall, with real processes: a rank SIGKILLed before or
during a 64 MB all_reduce (or, over shared memory, an 8 MB all_reduce, a 64 MB
all_gather or a reduce_scatter of 1 MiB blocks, whose ranks read each
other's buffers in place, COLLX_SHM_CMA=1, whatever a read costs on this
host), and a rank stopped with SIGSTOP. The survivors must
raise DistBackendError naming the op, their rank and the peer: a dead peer
within 5 s (the group timeout is 60 s, so it is not the timeout that fires), a
stalled one at the per-op timeout, else at the group timeout. A later op on
the broken group fails at once with the same cause; destroy_process_group
still works. The victim is in the launcher's ``may_die``. Each runs over shared
memory and over TCP; a killed rank leaves nothing in /dev/shm.
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

from launcher import Died, run_ranks  # noqa: E402

BIG = 16 << 20  # float32 elements: 64 MB
TRANSPORTS = ["shm", "tcp"]  # the ranks share a host: rings, or forced sockets
GROUP_TIMEOUT = 60.0


def _attempt(fn):
    """(exception name or "ok", message, time.monotonic() when it ended: one clock for every process)."""
    try:
        fn()
        return ("ok", "", time.monotonic())
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic())


# ------------------------------------------------------------------ dead peer

def _dead_peer(rank, ws, victim, when, stamp, op, count):
    """The victim SIGKILLs itself, `when` = "before" the survivors' `op`
    or "during" a loop of them; it writes the kill time to `stamp` first."""
    x = torch.ones(1000)
    dist.all_reduce(x)  # the group works
    if op == "all_reduce":
        big = torch.ones(count)
        run = lambda: dist.all_reduce(big)  # noqa: E731
    elif op == "all_gather":
        out, block = torch.empty(count // ws * ws), torch.ones(count // ws)
        run = lambda: dist.all_gather_into_tensor(out, block)  # noqa: E731
    else:
        blocks, out = torch.ones(ws * count), torch.empty(count)
        run = lambda: dist.reduce_scatter_tensor(out, blocks)  # noqa: E731

    def die():
        with open(stamp, "w") as f:
            f.write(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == victim:
        if when == "before":
            die()
        threading.Timer(0.3, die).start()
        while True:
            run()
    if when == "before":
        time.sleep(0.5)
    first = None
    until = time.monotonic() + 20
    while time.monotonic() < until:  # "during": back-to-back ops until the kill lands
        first = _attempt(run)
        if first[0] != "ok":
            break
    with open(stamp) as f:
        killed_at = float(f.read())
    t0 = time.monotonic()
    later = _attempt(lambda: dist.all_reduce(torch.ones(10)))
    later_took = later[2] - t0
    t0 = time.monotonic()
    dist.destroy_process_group()
    destroy_took = time.monotonic() - t0
    return {"first": first, "killed_at": killed_at, "later": later, "later_took": later_took,
            "destroy_took": destroy_took, "initialized": dist.is_initialized()}


@pytest.mark.parametrize("transport,op,count", [("shm", "all_reduce", BIG), ("shm", "all_reduce", 2 << 20),
                                                ("tcp", "all_reduce", BIG), ("shm", "all_gather", BIG),
                                                # 1 MiB blocks, read in place; 4 KiB ones, through the windows
                                                ("shm", "reduce_scatter", 1 << 18), ("shm", "all_gather", 1000),
                                                ("shm", "reduce_scatter", 1000)])
@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("ws", [3, 4], ids=lambda ws: f"ws{ws}")
def test_dead_peer_fails_every_survivor_fast(ws, when, transport, op, count, tmp_path):
    victim = 1
    dev_shm = set(os.listdir("/dev/shm"))
    res = run_ranks(_dead_peer, ws, timeout=120, pg_timeout=GROUP_TIMEOUT, may_die=(victim,),
                    args=(victim, when, str(tmp_path / "killed_at"), op, count),
                    env={"COLLX_TRANSPORT": transport, "COLLX_SHM_CMA": "1"})
    assert set(os.listdir("/dev/shm")) == dev_shm, "a killed rank left something in /dev/shm"
    assert isinstance(res[victim], Died) and "SIGKILL" in res[victim], res[victim]
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        kind, msg, at = r["first"]
        took = at - r["killed_at"]
        report = f"rank {rank} ({when}, ws={ws}): {kind} {took:.2f} s after the kill: {msg}"
        print(report)
        assert kind == "DistBackendError", report
        assert op in msg and f"rank {rank}" in msg, report
        assert f"peer {victim}" in msg or "aborted the group" in msg, report
        assert took <= 5.0, report
        kind2, msg2, _ = r["later"]
        assert kind2 == "DistBackendError", f"rank {rank}: the op after the failure: {kind2} {msg2}"
        reason = msg.split("failed on rank", 1)[1].split(": ", 1)[1]
        assert reason in msg2, f"rank {rank}: later op's error lacks the first cause:\n{msg}\n{msg2}"
        assert r["later_took"] < 1.0, f"rank {rank}: the op after the failure took {r['later_took']:.2f} s"
        assert r["destroy_took"] < 5.0 and not r["initialized"], r


# ------------------------------------------------------------------ stalled peer

def _stalled_peer(rank, ws, victim, op_timeout, group_timeout):
    """The victim stops itself (SIGSTOP). The survivors time out on a per-op
    timeout (the default group, 60 s group timeout, direct all-reduce: every
    rank waits on the victim itself) and on a group timeout (a second group;
    its small broadcast from the victim goes straight to every rank), then
    kill the victim. With a star or a tree, a rank names the peer it waited
    for, which may be a healthy one waiting on the victim."""
    g2 = dist.new_group(backend="collx", timeout=datetime.timedelta(seconds=group_timeout))
    pids = [None] * ws
    dist.all_gather_object(pids, os.getpid())
    dist.all_reduce(torch.ones(10), group=g2)  # both groups work
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
        return "continued"  # only if someone sends SIGCONT
    time.sleep(0.3)  # the victim stops
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    opts = dist.AllreduceOptions()
    opts.timeout = datetime.timedelta(seconds=op_timeout)
    t0 = time.monotonic()
    per_op = _attempt(lambda: backend.allreduce([torch.ones(100)], opts).wait())
    per_op = per_op[:2] + (per_op[2] - t0,)
    t0 = time.monotonic()
    grp = _attempt(lambda: dist.broadcast(torch.ones(100), src=victim, group=g2))
    grp = grp[:2] + (grp[2] - t0,)
    if rank == min(r for r in range(ws) if r != victim):
        os.kill(pids[victim], signal.SIGKILL)  # SIGKILL ends a stopped process too
    return {"per_op": per_op, "group": grp}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("ws", [3], ids=lambda ws: f"ws{ws}")
def test_stalled_peer_times_out_naming_it(ws, transport):
    victim, op_timeout, group_timeout = ws - 1, 2.0, 3.0
    res = run_ranks(_stalled_peer, ws, timeout=120, pg_timeout=GROUP_TIMEOUT, may_die=(victim,),
                    args=(victim, op_timeout, group_timeout),
                    pg_options=torchcollx.Options(algorithm="direct", transport=transport))
    assert isinstance(res[victim], Died), f"the stopped rank ended as {res[victim]!r}"
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        for key, op, limit in (("per_op", "all_reduce", op_timeout), ("group", "broadcast", group_timeout)):
            kind, msg, took = r[key]
            report = f"rank {rank} {key} timeout {limit} s: {kind} after {took:.2f} s: {msg}"
            print(report)
            assert kind == "DistBackendError", report
            assert op in msg and f"rank {rank}" in msg and f"peer {victim}" in msg, report
            assert " Timed out " in msg, report  # gloo's wording, which torch's tests match
            assert limit - 0.5 <= took <= limit + 3.0, report
