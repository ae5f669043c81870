"""Lazy and eager connections over TCP (docs/design.md, COLLX_CONNECT).

A lazy group (the default) connects a pair of ranks when an op first talks
between them: after a ring all-reduce each rank holds its two neighbours'
connections and its listener; an eager one holds two connections per peer
from the start. The user code that makes two ranks dial each other at the
same moment (a ring shift of isend/irecv), and a receive from any source
posted before anyone connected, work; a rank SIGKILLed during a ring
all-reduce fails every other rank promptly, though each holds sockets to
its neighbours only; and a straggler whose neighbours failed and left before
it came still learns the cause.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("torchcollx")

from common import socket_inodes  # noqa: E402
from launcher import Died, run_ranks  # noqa: E402

TCP = {"COLLX_TRANSPORT": "tcp", "COLLX_TUNING": "table"}


def _sockets():
    """This process's sockets: under file:// init, all collx's."""
    return len(socket_inodes())


def _barrier(name, ws):
    """Every rank got here: a barrier through the Store, a file, which opens
    no connection."""
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    store.add(name, 1)
    while store.add(name, 0) < ws:
        time.sleep(0.01)


def _settled(name, ws):
    """This process's sockets once every rank finished the phase and its
    connections settled, before any rank goes on to the next op. Settled:
    unchanged for 0.2 s, since a dial refused as a duplicate holds a socket
    here until the acceptor answers, and a group meets its peers in the
    background after its creation returned."""
    _barrier(name + " done", ws)
    n, since = _sockets(), time.monotonic()
    while time.monotonic() - since < 0.2:
        time.sleep(0.02)
        if _sockets() != n:
            n, since = _sockets(), time.monotonic()
    _barrier(name + " counted", ws)
    return n


def _connections(rank, ws):
    import torch
    import torch.distributed as dist
    created = _settled("created", ws)
    t = torch.full((1 << 16,), float(rank))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full_like(t, ws * (ws - 1) / 2)), t[:4]
    after_ring = _settled("ring", ws)
    # p2p: a ring shift, isend and irecv posted together; each pair dials both ways at once
    out, got = torch.full((100,), float(rank)), torch.empty(100)
    reqs = [dist.irecv(got, (rank - 1) % ws), dist.isend(out, (rank + 1) % ws)]
    for r in reqs:
        r.wait()
    assert torch.equal(got, torch.full_like(got, float((rank - 1) % ws)))
    after_shift = _settled("shift", ws)
    # a receive from any source, posted by rank 0 before any other rank sent to it
    if rank == 0:
        sources = set()
        for _ in range(ws - 1):
            buf = torch.empty(10)
            src = dist.recv(buf)
            assert torch.equal(buf, torch.full_like(buf, float(src))), (src, buf)
            sources.add(src)
        assert sources == set(range(1, ws)), sources
    else:
        time.sleep(0.2 * rank)
        dist.send(torch.full((10,), float(rank)), 0)
    return created, after_ring, after_shift, _settled("any", ws)


def test_lazy_connects_what_the_ops_use():
    ws = 5
    results = run_ranks(_connections, ws, timeout=120, env=dict(TCP, COLLX_ALGORITHM="ring"))
    for rank, (created, after_ring, after_shift, after_any) in enumerate(results):
        assert created == 1, f"rank {rank}: {created} sockets after init (want the listener only)"
        assert after_ring == 3, f"rank {rank}: {after_ring} sockets after a ring all-reduce (want listener + 2)"
        assert after_shift == 5, f"rank {rank}: {after_shift} after the p2p ring shift (want 2 more)"
        # ranks 2 .. ws-2 had no p2p connection with rank 0 yet
        want = 5 + ws - 3 if rank == 0 else 6 if 2 <= rank <= ws - 2 else 5
        assert after_any == want, f"rank {rank}: {after_any} sockets after the sends to rank 0 (want {want})"


def test_eager_connects_every_peer():
    ws = 4
    results = run_ranks(_connections, ws, timeout=120, env=dict(TCP, COLLX_ALGORITHM="ring", COLLX_CONNECT="eager"))
    for rank, counts in enumerate(results):
        assert set(counts) == {2 * (ws - 1)}, (rank, counts)


def _killed_mid_ring(rank, ws, victim):
    import torch
    import torch.distributed as dist
    t = torch.ones(1 << 10)
    dist.all_reduce(t)  # the ring's connections are made
    if rank == victim:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        return time.monotonic() - start, str(e)
    return None


def test_a_killed_rank_fails_every_ring_rank_promptly():
    ws, victim = 6, 2
    results = run_ranks(_killed_mid_ring, ws, timeout=120, args=(victim,), may_die={victim},
                        env=dict(TCP, COLLX_ALGORITHM="ring"))
    assert isinstance(results[victim], Died)
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        assert r is not None, f"rank {rank} finished an all-reduce with a killed rank"
        seconds, why = r
        # the victim sleeps 0.5 s first; each of the others learns within a few seconds
        assert seconds < 5.0, f"rank {rank} failed after {seconds:.1f} s: {why}"
        assert "peer" in why, why


def _wait_dead(pid):
    """Until `pid` has exited (a zombie, or reaped)."""
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between it and the read
            return
        time.sleep(0.01)


def _late_rank(rank, ws, victim, late):
    import torch
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    _barrier("created", ws)
    if rank == victim:
        store.set("victim", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    # Dead before any op: its neighbours fail at their dial to it (a rank dials in
    # peer order) and never dial the straggler, which no abort frame can reach.
    _wait_dead(int(store.get("victim")))
    if rank == late:  # a straggler: its ring neighbours failed and left before it came
        while store.add("left", 0) < ws - 2:
            time.sleep(0.01)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 10))
        why = None
    except Exception as e:  # noqa: BLE001
        why = str(e)
    took = time.monotonic() - start
    if rank != late:
        dist.destroy_process_group()
        store.add("left", 1)
    return took, why


def test_a_late_rank_learns_why_its_peers_left():
    """A rank of a lazy group meets its peers on its first op: when they
    failed and closed the group before it came, it holds no connection that
    could carry their abort frames, and its dials are refused. Their reason,
    left in the Store, still names the dead rank."""
    ws, victim, late = 4, 1, 3
    results = run_ranks(_late_rank, ws, timeout=120, args=(victim, late), may_die={victim},
                        env=dict(TCP, COLLX_ALGORITHM="ring"))
    assert isinstance(results[victim], Died)
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        took, why = r
        assert why is not None, f"rank {rank} finished an all-reduce with a killed rank"
        assert f"rank {rank}" in why and f"peer {victim}" in why, f"rank {rank}: {why}"
        assert took < 5.0, f"rank {rank} failed after {took:.1f} s: {why}"
    assert "had failed" in results[late][1], results[late][1]
