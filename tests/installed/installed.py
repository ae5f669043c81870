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


MAKE_IT = "run `make test-installed` (it makes the venvs with `make installed-venvs` and installs the wheel)"


def venv(variable: str, packages=()) -> str:
    """The venv folder that `variable` names, once it is known to hold
    `packages` and torchcollx as an installed wheel (not a source tree);
    fails (never skips) otherwise, saying what to run."""
    path = os.environ.get(variable)
    if not path or not os.path.exists(os.path.join(path, "bin", "python")):
        pytest.fail(f"{variable} does not name a venv ({path!r}): {MAKE_IT}")
    probe = ("import importlib.metadata as m, importlib.util as u, sys\n"
             "for p in sys.argv[1:]:\n"
             "    try: m.version(p)\n"
             "    except m.PackageNotFoundError: print('missing', p)\n"
             "s = u.find_spec('torchcollx')\n"
             "print('torchcollx', s.origin if s else None)\n")
    with tempfile.TemporaryDirectory() as cwd:
        p = subprocess.run([os.path.join(path, "bin", "python"), "-c", probe, *packages], cwd=cwd, env=clean_env(),
                           capture_output=True, text=True, timeout=60)
    missing = [line.split()[1] for line in p.stdout.splitlines() if line.startswith("missing ")]
    if p.returncode != 0 or missing:
        pytest.fail(f"{path} lacks {' '.join(missing) or 'a working python'}: {MAKE_IT}\n{p.stderr[-2000:]}")
    origin = p.stdout.rsplit("torchcollx ", 1)[1].strip()
    if not os.path.realpath(origin).startswith(os.path.realpath(path) + os.sep):
        pytest.fail(f"{path} imports torchcollx from {origin}, not from an installed wheel: {MAKE_IT}")
    return path


def clean_env(**extra) -> dict:
    """The environment of a user's process: no source tree on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "COLLX_TEST"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def kill_tree(root):
    """SIGKILLs the session that `root` leads (start_new_session made it), the
    descendants of its members and their sessions: torchrun starts each worker
    in a session of its own. A reaped `root`'s pid is not reused while its
    session has members."""
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid, _, sid = f.read().rsplit(")", 1)[1].split()[1:4]
            procs[int(pid)] = (int(ppid), int(sid))
        except (OSError, ValueError):
            pass
    doomed = {pid for pid, (_, sid) in procs.items() if sid == root}
    grown = True
    while grown:
        more = {pid for pid, (ppid, sid) in procs.items() if ppid in doomed or sid in doomed} - doomed
        doomed |= more
        grown = bool(more)
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run(argv, timeout, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Runs `argv` in a session of its own from `cwd` (else a new temporary
    folder), its output to a file (a daemon left behind cannot hold a file
    open as it holds a pipe); at the end, or at `timeout`, kills whatever of
    its process tree is left, and fails the test on the timeout."""
    cwd = cwd or tempfile.mkdtemp(prefix="collx_installed_")
    with tempfile.TemporaryFile() as log:
        p = subprocess.Popen(argv, cwd=cwd, env=env or clean_env(), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            p.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_tree(p.pid)
            p.wait()
        log.seek(0)
        out = log.read().decode("utf-8", "replace")
    if timed_out:
        pytest.fail(f"{' '.join(argv)} did not finish within {timeout} s; killed:\n{out[-4000:]}")
    return subprocess.CompletedProcess(argv, p.returncode, out, None)
