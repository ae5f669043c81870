"""Two hosts for real: two network namespaces, each with a veth on one bridge
(tests/netns.py), a torchrun with 2 ranks in each, collx bound to the veth
(COLLX_SOCKET_IFNAME). One launch (tests/two_hosts_worker.py) checks, on 4
ranks over 2 hosts:

* host grouping: the ranks see hosts [0, 0, 1, 1] and "auto" picks "hier";
* all-reduce results of ring, hier and auto against local values, and DDP
  (with and without the collx hook) against the same steps computed locally;
* the bytes through the veth: hier's leaders-only ring crosses clearly less
  than a flat ring (2 vs 3 buffers per op here);
* cutting the link in the middle of a loop of all-reduces fails every rank
  with a DistBackendError within the group timeout plus a margin: no hang.

Skips when namespaces cannot be made (not root, no iproute2, EPERM).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest

torchcollx = pytest.importorskip("torchcollx")

from netns import NamespacesUnavailable, TwoHosts  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "two_hosts_worker.py")
WS = 4
GROUP_TIMEOUT = 20   # seconds: how long a rank waits on a dead link
LAUNCH_LIMIT = 300   # hard limit from launch until every rank loops
CUT_LIMIT = GROUP_TIMEOUT + 25  # hard limit from the cut until every rank has failed
SIZE_MB, ITERS = 16, 3


def _ranks_done(tmp, prefix):
    return [r for r in range(WS) if os.path.exists(os.path.join(tmp, f"{prefix}{r}" + (".json" if prefix == "rank" else "")))]


def _wait(tmp, deadline, procs, want):
    """Until every rank has written a `want` marker or its result, all torchruns
    have exited, or the deadline: whichever comes first."""
    while time.monotonic() < deadline:
        done = set(_ranks_done(tmp, want)) | set(_ranks_done(tmp, "rank"))
        if len(done) == WS or all(p.poll() is not None for p in procs):
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def run():
    tmp = tempfile.mkdtemp(prefix="collx_two_hosts_")
    hosts = TwoHosts()
    try:
        hosts.__enter__()
    except NamespacesUnavailable as e:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"cannot create network namespaces: {e}")
    procs = []
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(torchcollx.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1")
        env.pop("COLLX_ALGORITHM", None)
        args = ["--mode", "test", "--results", tmp, "--timeout", str(GROUP_TIMEOUT),
                "--size-mb", str(SIZE_MB), "--iters", str(ITERS)]
        procs = hosts.torchrun(WORKER, args, env, port=29611, log_dir=tmp)
        _wait(tmp, time.monotonic() + LAUNCH_LIMIT, procs, "loop")
        cut_time = None
        if len(_ranks_done(tmp, "loop")) == WS:
            time.sleep(1.0)  # a few hundred all-reduces into the loop
            hosts.link_down(0)
            cut_time = time.monotonic()
            _wait(tmp, time.monotonic() + CUT_LIMIT, procs, "rank")
        results = {}
        for r in _ranks_done(tmp, "rank"):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                results[r] = json.load(f)
        yield {"results": results, "cut_time": cut_time, "logs": hosts.logs(tmp)}
    finally:
        hosts.close()  # SIGKILLs whatever still runs in the namespaces
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


def _results(run):
    res = run["results"]
    missing = [r for r in range(WS) if r not in res]
    assert not missing, f"ranks {missing} reported nothing (hung or crashed)\n{run['logs']}"
    for r, v in res.items():
        assert "exception" not in v, f"rank {r} raised:\n{v['exception']}\n{run['logs']}"
    return res


def test_ranks_are_grouped_by_host(run):
    for r, v in _results(run).items():
        assert v["hosts"] == [0, 0, 1, 1], f"rank {r} on {v['ifname']}"
        assert set(v["auto_choice"].values()) == {"hier"}, f"rank {r}: auto picks {v['auto_choice']}"


def test_allreduce_ring_hier_auto(run):
    for r, v in _results(run).items():
        fails = [f for f in v["fails"] if not f.startswith("DDP")]
        assert not fails, f"rank {r}: {fails}"


def test_ddp_across_hosts(run):
    for r, v in _results(run).items():
        fails = [f for f in v["fails"] if f.startswith("DDP")]
        assert not fails, f"rank {r}: {fails}"


def test_hier_moves_fewer_bytes_across_hosts(run):
    m = _results(run)[0]["measure"]
    size = m["ring"]["buffer_bytes"]
    ring, hier = m["ring"]["veth_bytes_per_op"], m["hier"]["veth_bytes_per_op"]
    print(f"veth bytes per {size >> 20} MiB all-reduce: ring {ring:,.0f} ({ring / size:.3f} buffers), "
          f"hier {hier:,.0f} ({hier / size:.3f})")
    # Flat ring 0>1>2>3>0: links 1>2 and 3>0 cross, each 2(n-1)/n = 1.5 buffers.
    # Hier: the two leaders' ring, 2(h-1)/h = 1 buffer each way. Plus TCP/IP headers.
    assert 3.0 * size <= ring <= 3.3 * size, f"ring: {ring / size:.3f} buffers across the veth per op"
    assert 2.0 * size <= hier <= 2.2 * size, f"hier: {hier / size:.3f} buffers across the veth per op"
    assert hier < 0.75 * ring, f"hier {hier:.0f} B vs ring {ring:.0f} B per op"


def test_link_cut_fails_every_rank_promptly(run):
    res = _results(run)
    assert run["cut_time"] is not None, "the ranks never reached the all-reduce loop"
    for r, v in res.items():
        cut = v["cut"]
        assert cut["type"] is not None, f"rank {r}: {cut['message']}"
        assert cut["dist_backend_error"], f"rank {r}: {cut['type']}: {cut['message']}"
        late = cut["time"] - run["cut_time"]
        print(f"rank {r}: {cut['type']} {late:.1f} s after the cut: {cut['message'][:300]}")
        assert late < CUT_LIMIT, f"rank {r} failed {late:.1f} s after the cut: {cut['message']}"
