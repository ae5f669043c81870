"""Striped streams across real namespaces (tests/netns.py): with
COLLX_SOCKETS_PER_PEER=4 every pair of ranks on different hosts stripes
its large messages over 4 TCP connections.

- Values: tests/hosts_allreduce_worker.py's checks (the two-level
  all-reduce, all_gather and reduce_scatter, every dtype and op, against
  gloo) on 2 + 2 and 3 + 2 hosts.
- One stream reset: while every rank all-reduces 4 MiB in a loop, one TCP
  connection between the hosts (picked at random among the collectives'
  ones, so most often a lane other than the first) is destroyed with
  `ss -K`. Every rank must fail with a DistBackendError within seconds,
  not at the group timeout, and destroy its group promptly.

Every launch has a hard timeout; the namespaces go whatever happens. Skips
when namespaces cannot be made (not root, no iproute2, EPERM).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
import time

import pytest

torchcollx = pytest.importorskip("torchcollx")

from netns import Hosts, NamespacesUnavailable  # noqa: E402
from test_hosts_allreduce import JOB_LIMIT, WORKER, _env, _wait_files, run_checks  # noqa: E402

LANES = 4
GROUP_TIMEOUT = 30


def _lanes_env():
    env = _env()
    env["COLLX_SOCKETS_PER_PEER"] = str(LANES)
    return env


@pytest.mark.parametrize("ranks", [[2, 2], [3, 2]], ids=["2+2", "3+2"])
def test_striped_values_match_gloo(ranks):
    run_checks(ranks, _lanes_env(), port=29675)


def _connections(hosts, port):
    """(local, peer) "addr:port" of host 0's TCP connections to host 1 that
    are not the rendezvous Store's."""
    out = subprocess.run(["ip", "netns", "exec", hosts.ns[0], "ss", "-tnH", "state", "established"],
                         capture_output=True, text=True, timeout=20).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        local, peer = fields[-2], fields[-1]
        if peer.rsplit(":", 1)[0] == hosts.addrs[1] and str(port) not in (local.rsplit(":", 1)[1],
                                                                          peer.rsplit(":", 1)[1]):
            found.append((local, peer))
    return found


def test_one_stream_reset_fails_every_rank():
    ranks, port = [2, 2], 29677
    n = sum(ranks)
    tmp = tempfile.mkdtemp(prefix="collx_striped_reset_")
    try:
        with Hosts(2) as hosts:
            procs = hosts.torchrun(WORKER, ["--count", str(1 << 20), "--result", tmp, "--loop", str(GROUP_TIMEOUT)],
                                   _lanes_env(), port=port, nproc=ranks, log_dir=tmp)
            _wait_files(tmp, [f"loop{r}" for r in range(n)], time.monotonic() + JOB_LIMIT, procs)
            looping = [r for r in range(n) if os.path.exists(os.path.join(tmp, f"loop{r}"))]
            assert len(looping) == n, f"only ranks {looping} reached the loop\n{hosts.logs(tmp)}"
            time.sleep(1.0)
            conns = _connections(hosts, port)
            # Two-level: each rank of host 0 all-reduces with its counterpart,
            # over LANES connections each.
            assert len(conns) >= 2 * LANES, f"{len(conns)} connections between the hosts: {conns}"
            local, peer = random.choice(conns)
            killed = subprocess.run(["ip", "netns", "exec", hosts.ns[0], "ss", "-K", "src", local.rsplit(":", 1)[0],
                                     "sport", "=", ":" + local.rsplit(":", 1)[1], "dst", peer.rsplit(":", 1)[0],
                                     "dport", "=", ":" + peer.rsplit(":", 1)[1]],
                                    capture_output=True, text=True, timeout=20)
            fault_at = time.monotonic()
            assert local in killed.stdout, f"ss -K did not destroy {local} -> {peer}: {killed}"
            limit = 10.0
            _wait_files(tmp, [f"rank{r}.json" for r in range(n)], fault_at + limit + 10, procs)
            for r in range(n):
                path = os.path.join(tmp, f"rank{r}.json")
                assert os.path.exists(path), f"rank {r} reported nothing\n{hosts.logs(tmp)}"
                with open(path) as f:
                    got = json.load(f)
                assert got["first_ok"], f"rank {r}: the first all-reduce's values are wrong"
                assert got.get("dist_backend_error"), f"rank {r}: {got}"
                late = got["time"] - fault_at
                print(f"reset {local}->{peer}: rank {r} failed {late:.2f} s after, destroyed in "
                      f"{got.get('destroyed_in', -1):.2f} s: {got['message'][:160]}")
                assert late < limit, f"rank {r} failed {late:.1f} s after the reset: {got['message']}"
                assert got.get("destroyed_in", 99) < 5, f"rank {r}: destroy after the failure: {got}"
    except NamespacesUnavailable as e:
        pytest.skip(f"cannot create network namespaces: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
