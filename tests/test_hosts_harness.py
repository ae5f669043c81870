"""The h-host harness (tests/netns.py, benchmarks/hosts.py) on 3 hosts:

* the emulated link: one TCP stream through a NIC shaped to 200 Mbit/s
  (well below the veth's unshaped rate, so it measures the shaper, not the
  CPU) delivers 0.7 to 1.15 of the rate;
* torchrun across 3 namespaces, 1 rank each and uneven (2 + 1 + 1): the
  ranks see the hosts they run on, and collx's all_reduce (auto, ring,
  hier) and all_gather give the values computed from every rank's data
  (benchmarks/hosts_worker.py with --rounds 0: checks, no timing).

Every launch has a hard timeout; the namespaces go whatever happens. Skips
when namespaces cannot be made (not root, no iproute2, EPERM).
"""
from __future__ import annotations

import os
import sys
import time

import pytest

pytest.importorskip("torchcollx")

from link_probe import stream_rate  # noqa: E402
from netns import Hosts, NamespacesUnavailable  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import hosts as hosts_bench  # noqa: E402

RATE = 200e6
JOB_LIMIT = 60   # seconds from launch until every torchrun has exited


@pytest.fixture(scope="module")
def three_hosts():
    try:
        with Hosts(3) as hosts:
            yield hosts
    except NamespacesUnavailable as e:
        pytest.skip(f"cannot create network namespaces: {e}")


def test_shaped_link_carries_its_rate(three_hosts):
    three_hosts.shape(f"{int(RATE)}bit")
    try:
        got = stream_rate(three_hosts, 0, 2, streams=1, seconds=1.5)["bits_per_s"]
    finally:
        three_hosts.unshape()
    print(f"one stream through a {RATE / 1e6:.0f} Mbit/s NIC: {got / 1e6:.1f} Mbit/s ({got / RATE:.3f})")
    assert 0.7 <= got / RATE <= 1.15, f"{got / 1e6:.1f} Mbit/s through a {RATE / 1e6:.0f} Mbit/s shape"


@pytest.mark.parametrize("ranks", ["1", "2,1,1"])
def test_collectives_across_three_hosts(ranks):
    args = hosts_bench.parse_args(["--hosts", "3", "--ranks-per-host", ranks, "--rate", "", "--rounds", "0",
                                   "--ops", "all_reduce,all_gather", "--sizes", "4,4K,1M", "--algos", "auto,ring,hier",
                                   "--timeout", str(JOB_LIMIT), "--group-timeout", "30", "--port", "29661"])
    job = dict(hosts=3, ranks=ranks, rate=None, sizes=args.sizes)
    start = time.monotonic()
    res = hosts_bench.run_job(job, args)
    print(f"3 hosts, ranks {ranks}: {time.monotonic() - start:.1f} s")
    assert not res.get("error"), res["error"]
    counts = hosts_bench.ranks_per_host(ranks, 3)
    want_hosts = [h for h, c in enumerate(counts) for _ in range(c)]
    assert sorted(res["netns_hosts"]) == want_hosts, res["netns_hosts"]
    assert res["collx_hosts"] == res["netns_hosts"], f"collx groups the ranks as {res['collx_hosts']}"
    for row in res["rows"]:
        want = ["gloo", "auto", "ring", "hier"] if row["op"] == "all_reduce" else ["gloo", "auto"]
        assert not row["errors"], f"{row['op']} {row['bytes']} B: {row['errors']}"
        assert row["checked"] == want, f"{row['op']} {row['bytes']} B: checked {row['checked']}"
    assert {r["op"] for r in res["rows"]} == {"all_reduce", "all_gather"}
