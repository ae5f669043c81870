"""The venvs the installed-package tests run in (Makefile: test-installed).

Each holds torch and the torchcollx wheel from dist/, installed by pip, and
the tests run its interpreter from a folder outside the source tree, with no
PYTHONPATH, so that only the installed package can be found.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile

import pytest


def venv(variable: str) -> str:
    """The venv folder that `variable` names; fails (never skips) if it is unusable."""
    path = os.environ.get(variable)
    if not path or not os.path.exists(os.path.join(path, "bin", "python")):
        pytest.fail(f"{variable} does not name a venv ({path!r}): run `make test-installed`, which builds the "
                    "wheel and the cached venvs (`make installed-venvs`) and sets it")
    return path


def clean_env(**extra) -> dict:
    """The environment of a user's process: no source tree on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "COLLX_TEST"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run(argv, timeout, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Runs `argv` in a session of its own from a temporary folder; kills the
    whole session at `timeout` and fails the test with what it printed."""
    cwd = cwd or tempfile.mkdtemp(prefix="collx_installed_")
    p = subprocess.Popen(argv, cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{' '.join(argv)} did not finish within {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(argv, p.returncode, out, None)
