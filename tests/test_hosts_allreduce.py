"""The hierarchical all-reduce across real namespaces (tests/netns.py), where
from kTwoLevelMinBytes it is the two-level one: every rank of a host
all-reduces its slice with its counterparts on the other hosts.

One torchrun per host runs tests/hosts_allreduce_worker.py: every dtype and
reduce op against gloo, exactly, the same result on every rank, and TCP
bytes from every rank (not one leader per host). Layouts: even (2 + 2),
uneven (3 + 2: six slices), and three hosts of 2 + 1 + 2. The
element count is odd, so no slice, part or segment is even. The same jobs
check the two-level all_gather and reduce_scatter against gloo.

Failure on 3 hosts (2 + 1 + 2), while every rank runs a 4 MiB all_reduce,
all_gather or reduce_scatter (their two-level forms) in a loop: host 2's
link cut, or host 2's processes killed.
Every surviving rank fails with a DistBackendError, for a cut within the
group timeout plus a margin, for a killed host before any timeout could
fire.

Every launch has a hard timeout; the namespaces go whatever happens. Skips
when namespaces cannot be made (not root, no iproute2, EPERM).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest

torchcollx = pytest.importorskip("torchcollx")

from netns import Hosts, NamespacesUnavailable  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "hosts_allreduce_worker.py")
COUNT = 262147      # odd; 1 MiB of float32, 256 KiB of uint8 (kTwoLevelMinBytes)
JOB_LIMIT = 240     # seconds from launch until every torchrun has exited


def _env():
    """The ranks' environment: this tree's torchcollx, one thread, auto unforced."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(torchcollx.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("COLLX_ALGORITHM", None)
    return env


def run_checks(ranks, env, port):
    """One torchrun per host running the worker's checks; asserts rank 0's "ok"."""
    tmp = tempfile.mkdtemp(prefix="collx_hosts_allreduce_")
    try:
        with Hosts(len(ranks)) as hosts:
            result = os.path.join(tmp, "result")
            procs = hosts.torchrun(WORKER, ["--count", str(COUNT), "--result", result], env, port=port,
                                   nproc=ranks, log_dir=tmp)
            deadline = time.monotonic() + JOB_LIMIT
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.2)
            hung = [i for i, p in enumerate(procs) if p.poll() is None]  # killed as the namespaces go
            assert not hung, f"hosts {hung} still ran after {JOB_LIMIT} s\n{hosts.logs(tmp)}"
            assert os.path.exists(result), f"rank 0 wrote no result\n{hosts.logs(tmp)}"
            with open(result) as f:
                text = f.read()
            assert text == "ok", f"{text}\n{hosts.logs(tmp)}"
    except NamespacesUnavailable as e:
        pytest.skip(f"cannot create network namespaces: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("ranks", [[2, 2], [3, 2], [2, 1, 2]], ids=["2+2", "3+2", "2+1+2"])
def test_two_level_allreduce_matches_gloo(ranks):
    run_checks(ranks, _env(), port=29671)


GROUP_TIMEOUT = 20  # seconds: how long a rank waits on a silent peer
LAUNCH_LIMIT = 240  # from launch until every rank loops


def _wait_files(tmp, names, deadline, procs):
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if all(os.path.exists(os.path.join(tmp, n)) for n in names):
            return
        time.sleep(0.1)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("fault", ["cut", "kill"])
def test_three_hosts_fail_every_survivor_promptly(fault, op):
    ranks = [2, 1, 2]
    n = sum(ranks)
    tmp = tempfile.mkdtemp(prefix="collx_hosts_fault_")
    try:
        with Hosts(3) as hosts:
            env = _env()
            procs = hosts.torchrun(WORKER, ["--count", str(1 << 20), "--result", tmp, "--loop", str(GROUP_TIMEOUT),
                                           "--op", op],
                                   env, port=29673, nproc=ranks, log_dir=tmp)
            _wait_files(tmp, [f"loop{r}" for r in range(n)], time.monotonic() + LAUNCH_LIMIT, procs)
            looping = [r for r in range(n) if os.path.exists(os.path.join(tmp, f"loop{r}"))]
            assert len(looping) == n, f"only ranks {looping} reached the loop\n{hosts.logs(tmp)}"
            host_of = {r: int(open(os.path.join(tmp, f"loop{r}")).read()) for r in range(n)}
            time.sleep(1.0)  # some all-reduces into the loop
            if fault == "cut":
                hosts.link_down(2)
            else:
                hosts.kill_all(hosts.ns[2])
            fault_at = time.monotonic()
            watched = [r for r in range(n) if fault == "cut" or host_of[r] != 2]
            limit = GROUP_TIMEOUT + 25 if fault == "cut" else GROUP_TIMEOUT
            _wait_files(tmp, [f"rank{r}.json" for r in watched], fault_at + limit + 10, procs)
            for r in watched:
                path = os.path.join(tmp, f"rank{r}.json")
                assert os.path.exists(path), f"rank {r} (host {host_of[r]}) reported nothing\n{hosts.logs(tmp)}"
                with open(path) as f:
                    got = json.load(f)
                assert got["first_ok"], f"rank {r}: the first all-reduce's values are wrong"
                assert got.get("dist_backend_error"), f"rank {r}: {got}"
                late = got["time"] - fault_at
                print(f"{fault}: rank {r} (host {host_of[r]}) failed {late:.2f} s after: {got['message'][:200]}")
                assert late < limit, f"rank {r} failed {late:.1f} s after the {fault}: {got['message']}"
    except NamespacesUnavailable as e:
        pytest.skip(f"cannot create network namespaces: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
