"""Group creation waits for nobody (docs/design.md, "Creating a group").

init_process_group and new_group return once this rank has announced
itself in the Store; the group meets its peers on its first op, as gloo's
lazy init and NCCL's communicators do. So a rank that arrives late holds up
the others' first op, not their creation; a member that never comes fails
the first op with a clear error at the group's timeout, and one killed
right after creation fails it at once, naming the rank; and a group
destroyed or aborted before its peers came goes at once, leaving no thread
or descriptor behind.
"""
from __future__ import annotations

import datetime
import os
import time

import pytest

pytest.importorskip("torchcollx")

from common import settled_resources  # noqa: E402
from launcher import run_ranks  # noqa: E402


def _late_rank(rank, ws, late):
    import torch
    import torch.distributed as dist
    if rank == late:
        time.sleep(1.5)
    arrived = time.monotonic()
    dist.init_process_group("collx", init_method=os.environ["COLLX_TEST_INIT_METHOD"], rank=rank, world_size=ws)
    created = time.monotonic()
    t = torch.full((1000,), float(rank))
    dist.all_reduce(t)
    ok = torch.equal(t, torch.full_like(t, ws * (ws - 1) / 2))
    dist.destroy_process_group()
    return arrived, created, ok


def test_creation_returns_before_the_last_rank_arrives():
    # file:// (torchrun's agent Store behaves alike): under tcp:// or a plain
    # env://, torch's TCPStore waits for every rank before any backend exists.
    ws, late = 3, 2
    results = run_ranks(_late_rank, ws, timeout=120, init=False, args=(late,))
    late_arrival = results[late][0]
    for rank, (arrived, created, ok) in enumerate(results):
        assert ok, f"rank {rank}: wrong all-reduce result"
        if rank != late:
            assert created < late_arrival, (
                f"rank {rank}'s init returned {created - late_arrival:.3f} s after rank {late} arrived")


def _member_never_comes(rank, ws, op):
    import torch
    import torch.distributed as dist
    if rank == ws - 1:
        return None  # never creates the group
    g = dist.new_group(list(range(ws)), timeout=datetime.timedelta(seconds=2))
    start = time.monotonic()
    try:
        if op == "all_reduce":
            dist.all_reduce(torch.ones(4), group=g)
        elif op == "broadcast":
            dist.broadcast(torch.ones(4), src=0, group=g)
        elif op == "all_gather":
            dist.all_gather([torch.zeros(4) for _ in range(ws)], torch.ones(4), group=g)
        else:
            dist.barrier(group=g)
    except dist.DistBackendError as e:
        return time.monotonic() - start, str(e)
    return None


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "barrier"])
def test_a_member_that_never_comes_fails_the_first_op_at_the_timeout(op):
    results = run_ranks(_member_never_comes, 3, timeout=120, args=(op,))
    for rank, result in enumerate(results[:-1]):
        assert result is not None, f"rank {rank}: the first op succeeded without rank 2"
        took, message = result
        assert f"collx init failed on rank {rank} of 3" in message, message
        assert "never created it" in message, message
        assert 1.9 < took < 30, f"rank {rank}: failed after {took:.1f} s (timeout 2 s)"


def _ends_before_peers_come(rank, ws, how):
    import torch
    import torch.distributed as dist
    dist.all_reduce(torch.ones(1))  # the default group is set up
    if rank == ws - 1:  # never creates the group; joins the default group's op below
        t = torch.ones(4)
        dist.all_reduce(t)
        return None
    before = settled_resources()
    g = dist.new_group(list(range(ws)), timeout=datetime.timedelta(seconds=60))
    time.sleep(0.3)  # the setup is waiting in the Store for rank 2
    start = time.monotonic()
    if how == "abort":
        dist.distributed_c10d._abort_process_group(g)
    else:
        dist.destroy_process_group(g)
    took = time.monotonic() - start
    # The default group still works.
    t = torch.ones(4)
    dist.all_reduce(t)
    return took, before, settled_resources(), t.tolist()


@pytest.mark.parametrize("how", ["destroy", "abort"])
def test_a_group_ended_before_its_peers_came_goes_at_once(how):
    results = run_ranks(_ends_before_peers_come, 3, timeout=120, args=(how,))
    for rank, (took, before, after, t) in enumerate(results[:-1]):
        assert took < 5, f"rank {rank}: {how} took {took:.1f} s (the group's timeout is 60 s)"
        assert after == before, f"rank {rank}: (fds, segments, threads) {before} before the group, {after} after"
        assert t == [3.0] * 4, t


def _killed_after_creation(rank, ws, victim, delay):
    import signal

    import torch
    import torch.distributed as dist
    if rank == victim:
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGKILL)  # init returned; its group meets its peers in the background
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000))
    except dist.DistBackendError as e:
        return time.monotonic() - start, str(e)
    return None


# The victim dies at once, or 20 ms in: while its group connects in the
# background (setting up shared memory, where the ranks share a host), or
# just after.
@pytest.mark.parametrize("delay", [0.0, 0.02])
@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("victim", [0, 2])
def test_a_rank_killed_after_creation_fails_the_first_op_fast(victim, transport, delay):
    ws = 3
    results = run_ranks(_killed_after_creation, ws, timeout=120, pg_timeout=60, args=(victim, delay), may_die={victim},
                        env={"COLLX_TRANSPORT": transport})
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        assert result is not None, f"rank {rank}: the first op succeeded without rank {victim}"
        took, message = result
        # The victim dies in the setup or after it: once wrapped as init's failure, or as the op's.
        assert f"peer {victim}" in message and message.count("collx init") <= 1, f"rank {rank}: {message}"
        assert took < 5.0, f"rank {rank}: failed after {took:.1f} s (group timeout 60 s): {message}"


def _member_leaves_at_once(rank, ws, how):
    import signal

    import torch
    import torch.distributed as dist
    g = dist.new_group(list(range(ws)), timeout=datetime.timedelta(seconds=60))
    if rank == ws - 1:  # leaves right after creation, while the others set the group up
        if how == "destroy":
            dist.destroy_process_group(g)
            return None
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.full((1000,), 7.0) if rank == 0 else torch.zeros(1000)
    if rank == 0:
        dist.send(t, 1, group=g)
    else:
        dist.recv(t, 0, group=g)
    received = bool(t.eq(7.0).all())
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=g)
        error = None
    except dist.DistBackendError as e:
        error = str(e)
    return received, error, time.monotonic() - start


# torchft's resiliency tests shut a member's group down right after creating
# it. That fails only the ops that need the member: its peers finish setting
# the group up without it, send and receive among themselves, and a
# collective fails at once, naming it.
@pytest.mark.parametrize("how", ["destroy", "kill"])
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_member_that_leaves_at_once_fails_only_the_ops_that_need_it(how, transport):
    ws = 3
    results = run_ranks(_member_leaves_at_once, ws, timeout=120, args=(how,), may_die={ws - 1},
                        env={"COLLX_TRANSPORT": transport})
    for rank, (received, error, took) in enumerate(results[:-1]):
        assert received, f"rank {rank}: the send between the other ranks did not arrive"
        assert error is not None, f"rank {rank}: an all-reduce without rank 2 succeeded"
        assert "peer 2" in error, f"rank {rank}: {error}"
        if how == "destroy":
            assert "closed its group" in error, f"rank {rank}: {error}"
        assert took < 5.0, f"rank {rank}: failed after {took:.1f} s (group timeout 60 s): {error}"
