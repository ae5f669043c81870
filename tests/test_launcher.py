"""The test harness itself: run_ranks must turn exceptions, crashes and hangs
of rank processes into failures of the pytest process (never a hang)."""
from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("torchcollx")

from launcher import Died, RanksFailed, run_ranks  # noqa: E402


def _ok(rank, ws, extra):
    import torch.distributed as dist

    return (rank, ws, dist.get_rank(), dist.get_world_size(), dist.get_backend(), extra)


def _raises_on_1(rank, ws):
    if rank == 1:
        raise KeyError("deliberate failure on rank 1")
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(3))  # blocks: rank 1 never joins


def _hangs_on_0(rank, ws):
    if rank == 0:
        time.sleep(3600)
    return rank


def _dies_on_1(rank, ws):
    if rank == 1:
        os._exit(7)
    return rank


def test_returns_values_by_rank():
    assert run_ranks(_ok, 2, timeout=60, args=("x",)) == [(0, 2, 0, 2, "collx", "x"), (1, 2, 1, 2, "collx", "x")]


def test_exception_is_propagated_with_traceback():
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raises_on_1, 2, timeout=120, grace=3)
    msg = str(info.value)
    assert "rank 1 raised" in msg and "KeyError" in msg and "deliberate failure on rank 1" in msg, msg
    assert "_raises_on_1" in msg  # the traceback names the function
    assert time.monotonic() - t0 < 60, "the blocked rank was not killed soon after the failure"


def test_hang_is_killed_at_the_timeout_and_named():
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_hangs_on_0, 2, timeout=10)
    took = time.monotonic() - t0
    msg = str(info.value)
    assert "HUNG" in msg and "ranks [0]" in msg, msg
    assert took < 40, f"hard timeout of 10 s took {took:.0f} s"


def test_process_dying_without_report_fails():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_dies_on_1, 2, timeout=60, grace=3)
    msg = str(info.value)
    assert "rank 1 died without reporting" in msg and "exit code 7" in msg, msg


def _stops_on_1(rank, ws):
    if rank == 1:
        os.kill(os.getpid(), __import__("signal").SIGSTOP)
    return rank


def test_may_die_ranks_are_reported_not_failed():
    """A may_die rank that exits or stays stopped does not fail the run; its
    result says how it ended, and a stopped one is killed (nothing left)."""
    res = run_ranks(_dies_on_1, 2, timeout=60, grace=3, may_die=(1,))
    assert res[0] == 0 and isinstance(res[1], Died) and "exit code 7" in res[1], res
    t0 = time.monotonic()
    res = run_ranks(_stops_on_1, 2, timeout=60, may_die=(1,))
    assert res[0] == 0 and isinstance(res[1], Died) and "still running" in res[1], res
    assert time.monotonic() - t0 < 30, "waited for the stopped rank"
    with pytest.raises(RanksFailed, match="rank 1 raised"):
        run_ranks(_raises_on_1, 2, timeout=60, grace=3, may_die=(1,))  # an exception still fails
