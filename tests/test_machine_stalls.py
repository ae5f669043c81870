"""The harness's rerun after a machine stall (conftest.py, machine_stalls.py):
only a test that failed while the machine stood still runs again, once, and
the stall is named. The stall is made by stopping the watcher process, which
is what a stopped machine looks like from it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

INNER = '''
import os, signal, time

RUNS = {"once": 0, "plain": 0, "twice": 0}

def _stall(request, seconds):
    pid = request.config._collx_stalls._proc.pid
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(pid, signal.SIGCONT)

def test_fails_once_in_a_stall(request):
    RUNS["once"] += 1
    if RUNS["once"] == 1:
        _stall(request, 1.5)
        assert False, "the first run fails"

def test_fails_with_no_stall():
    RUNS["plain"] += 1
    assert False, f"plain failure, run {RUNS['plain']}"

def test_fails_twice_in_stalls(request):
    RUNS["twice"] += 1
    _stall(request, 1.5)
    assert False, f"stalled failure, run {RUNS['twice']}"
'''


def test_only_a_failure_during_a_stall_runs_again_once(tmp_path):
    for name in ("conftest.py", "machine_stalls.py"):
        shutil.copy(os.path.join(HERE, name), tmp_path)
    (tmp_path / "test_inner.py").write_text(INNER)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path).stdout
    assert "1 passed" in out and "2 failed" in out, out
    assert re.search(r"RERUN test_inner.py::test_fails_once_in_a_stall: the machine stopped for 1\.\d s", out), out
    assert "which failed: AssertionError: the first run fails" in out, out
    assert "plain failure, run 1" in out and "plain failure, run 2" not in out, out
    assert "RERUN test_inner.py::test_fails_with_no_stall" not in out, out
    assert "stalled failure, run 2" in out and "run 3" not in out, out
