"""torchrun across two "hosts" on the installed wheel: two network namespaces
joined by a veth (tests/netns.py), the wheel venv's torchrun in each
(COLLX_WHEEL_VENV, made by `make installed-venvs`), c10d rendezvous, 2 ranks
per host, run from a temporary folder with no PYTHONPATH. Each rank runs
tests/installed/hosts_script.py, which never imports torchcollx, and reports
its backend, where collx was loaded from, its host grouping, its collectives'
results and its DDP weights against gloo's.

Needs root for the namespaces; fails with the reason when they cannot be made.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest

from installed import MAKE_IT, clean_env, venv
from netns import NamespacesUnavailable, TwoHosts

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hosts_script.py")
WS = 4
LIMIT = 240  # hard limit, seconds, from launch until both torchruns have exited
def _wheel_venv():
    path = venv("COLLX_WHEEL_VENV")
    torchrun = os.path.join(path, "bin", "torchrun")
    if not os.access(torchrun, os.X_OK):
        pytest.fail(f"COLLX_WHEEL_VENV={path} has no bin/torchrun: {MAKE_IT}")
    return path, torchrun


@pytest.fixture(scope="module")
def run():
    wheel_venv, torchrun = _wheel_venv()
    tmp = tempfile.mkdtemp(prefix="collx_installed_hosts_")
    hosts = TwoHosts()
    try:
        hosts.__enter__()
    except NamespacesUnavailable as e:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.fail(f"cannot create the two hosts' network namespaces: {e}")
    procs = []
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(tmp)  # the torchruns start here, away from the source tree
            procs = hosts.torchrun(SCRIPT, ["--results", tmp], clean_env(), port=29631, log_dir=tmp, torchrun=torchrun)
        start = time.monotonic()
        while time.monotonic() - start < LIMIT and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        seconds = time.monotonic() - start
        results = {}
        for r in range(WS):
            result = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(result):
                with open(result) as f:
                    results[r] = json.load(f)
        yield {"venv": wheel_venv, "results": results, "exits": [p.poll() for p in procs], "seconds": seconds,
               "logs": hosts.logs(tmp)}
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
    assert not missing, (f"ranks {missing} reported nothing; torchrun exits {run['exits']} after "
                         f"{run['seconds']:.0f} s (limit {LIMIT})\n{run['logs']}")
    for r, v in res.items():
        assert "exception" not in v, f"rank {r} raised:\n{v['exception']}\n{run['logs']}"
    return res


def test_ranks_run_collx_from_the_wheel_on_two_hosts(run):
    print(f"4 ranks on 2 hosts: {run['seconds']:.1f} s from launch to exit")
    for r, v in _results(run).items():
        assert v["backend"] == "collx" and v["world_size"] == WS, f"rank {r}: {v['backend']} over {v['world_size']}"
        assert os.path.realpath(v["torchcollx_file"]).startswith(os.path.realpath(run["venv"]) + os.sep), \
            f"rank {r} loaded collx from {v['torchcollx_file']}, not from the wheel in {run['venv']}"
        assert v["hosts"] == [0, 0, 1, 1], f"rank {r} sees hosts {v['hosts']}"
    assert run["exits"] == [0, 0], f"torchrun exits {run['exits']}\n{run['logs']}"


def test_collectives(run):
    for r, v in _results(run).items():
        fails = [f for f in v["fails"] if not f.startswith("DDP")]
        assert not fails, f"rank {r}: {fails}"


def test_ddp_matches_gloo(run):
    for r, v in _results(run).items():
        fails = [f for f in v["fails"] if f.startswith("DDP")]
        assert not fails, f"rank {r}: {fails}"
        print(f"rank {r}: DDP weights within {v['ddp_max_diff']:.3g} of gloo's")
