"""The hierarchical all-reduce across real namespaces (tests/netns.py), where
from kTwoLevelMinBytes it is the two-level one: every rank of a host
all-reduces its slice with its counterparts on the other hosts.

One torchrun per host runs tests/hosts_allreduce_worker.py: every dtype and
reduce op against gloo, exactly, the same result on every rank, and TCP
bytes from every rank (not one leader per host). Layouts: even (2 + 2),
uneven (3 + 2: six slices), and three hosts of 2 + 1 + 2. The
element count is odd, so no slice, part or segment is even.

Every launch has a hard timeout; the namespaces go whatever happens. Skips
when namespaces cannot be made (not root, no iproute2, EPERM).
"""
from __future__ import annotations

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


@pytest.mark.parametrize("ranks", [[2, 2], [3, 2], [2, 1, 2]], ids=["2+2", "3+2", "2+1+2"])
def test_two_level_allreduce_matches_gloo(ranks):
    tmp = tempfile.mkdtemp(prefix="collx_hosts_allreduce_")
    try:
        with Hosts(len(ranks)) as hosts:
            root = os.path.dirname(os.path.dirname(os.path.abspath(torchcollx.__file__)))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
                       OMP_NUM_THREADS="1")
            env.pop("COLLX_ALGORITHM", None)
            result = os.path.join(tmp, "result")
            procs = hosts.torchrun(WORKER, ["--count", str(COUNT), "--result", result], env, port=29671,
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
