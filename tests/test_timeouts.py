"""Timeouts reach the backend: the one given to init_process_group fails an op
whose peer never comes at that time (not at a default), and Work.wait(timeout)
behaves as it does on gloo (checked side by side in the same processes).
"""
from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchcollx")

import launcher  # noqa: E402
from common import attempt  # noqa: E402
from launcher import run_ranks  # noqa: E402


def _absent_peer(rank, ws, stay_away):
    if rank != 0:
        time.sleep(stay_away)
        return None
    return attempt(lambda: dist.all_reduce(torch.ones(10)))


@pytest.mark.parametrize("pg_timeout", [2.0, 4.0])
def test_init_process_group_timeout_reaches_the_backend(pg_timeout):
    kind, msg, took = run_ranks(_absent_peer, 2, timeout=60, pg_timeout=pg_timeout,
                                args=(pg_timeout + 4,))[0]
    print(f"pg_timeout {pg_timeout} s: {kind} after {took:.2f} s: {msg}")
    assert kind == "DistBackendError" and "all_reduce" in msg and " Timed out " in msg, (kind, msg)
    assert pg_timeout - 0.2 <= took <= pg_timeout + 2.0, f"timeout {pg_timeout} s fired after {took:.2f} s: {msg}"


def _wait_with_timeout(rank, ws, late):
    """Rank 1 joins each all_reduce `late` seconds after rank 0, who waits
    with a short timeout first and then without one; on gloo and on collx."""
    out = {}
    for name, group in (("gloo", launcher.gloo()), ("collx", None)):
        dist.barrier(group=launcher.gloo())
        t = torch.full((1000,), float(rank + 1))
        if rank == 1:
            time.sleep(late)
            dist.all_reduce(t, group=group)
            continue
        w = dist.all_reduce(t, group=group, async_op=True)
        short = attempt(lambda: w.wait(timeout=datetime.timedelta(seconds=0.5)))
        completed_after_short = w.is_completed()
        full = attempt(lambda: w.wait())
        out[name] = {"short": short, "completed_after_short": completed_after_short, "full": full,
                     "result_ok": torch.equal(t, torch.full((1000,), 3.0))}
    return out


def test_work_wait_timeout_behaves_like_gloo():
    """wait(timeout) raises at the timeout while the peer is late and leaves
    the op running; a later wait() returns once it completes, with the right
    result. Same exception type as gloo's."""
    res = run_ranks(_wait_with_timeout, 2, timeout=90, with_gloo=True, args=(2.5,))[0]
    print(res)
    gloo, collx = res["gloo"], res["collx"]
    assert gloo["short"][0] != "ok", f"gloo's wait(timeout) did not raise: {gloo}"
    kind, msg, took = collx["short"]
    assert kind == gloo["short"][0], f"collx raised {kind} ({msg}), gloo {gloo['short'][0]} ({gloo['short'][1]})"
    assert 0.4 <= took <= 1.5, f"wait(timeout=0.5 s) returned after {took:.2f} s: {msg}"
    assert collx["completed_after_short"] is False, collx
    assert collx["full"][0] == "ok" and collx["result_ok"], collx
