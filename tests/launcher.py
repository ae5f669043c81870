"""Multi-process launcher for the collx Python tests.

``run_ranks(fn, world_size, ...)`` starts ``world_size`` separate Python
processes, has each call ``dist.init_process_group("collx", ...)`` and then
``fn(rank, world_size, *args)``, and returns the list of what ``fn`` returned,
indexed by rank.

The processes fork from a server that imported torch and torchcollx once
(multiprocessing's forkserver), so a launch does not pay an interpreter's
start and a torch import per rank. Each rank is still its own process, in its
own session, with the test's environment, working directory and output file;
torch's settings read from the environment at import (the debug level, the
thread count) are read again. ``COLLX_TEST_SPAWN=1`` starts each rank as a
fresh interpreter instead.

Failure handling (the point of this module):

* an exception in ``fn`` (or in init) on any rank is re-raised in the pytest
  process as ``RanksFailed`` carrying that rank's formatted traceback;
* once one rank has failed, the others get a short grace period (they are
  usually blocked in a collective with the failed rank) and are then killed;
* HARD TIMEOUT: if ranks are still running after ``timeout`` seconds, every
  process is SIGKILLed and the failure names the ranks that hung;
* a process that exits (crash, signal, ``os._exit``) without reporting fails
  the run with its exit code / signal and the tail of its output, unless its
  rank is in ``may_die`` (fault-injection tests kill or stop ranks on
  purpose): such a rank's entry in the result is ``Died(how)``, and it is
  killed without failing the run once every other rank has finished.

``fn`` must be a module-level function of an importable module (a test
module works: the children put its directory on ``sys.path``); ``args`` and
the return value must be picklable.

Inside a rank, ``launcher.gloo()`` returns a gloo group over the same ranks
when ``with_gloo=True`` was passed (an oracle to compare collx against).
"""
from __future__ import annotations

import datetime
import importlib
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

_GLOO = None  # set in the rank processes when with_gloo=True


class RanksFailed(AssertionError):
    """One or more ranks failed, crashed or hung."""


class Died(str):
    """The result of a ``may_die`` rank that did not report: how it ended
    (e.g. "killed by signal SIGKILL", or "still running" if it was stopped)."""


def gloo():
    """The gloo group of this rank (only when launched with with_gloo=True)."""
    if _GLOO is None:
        raise RuntimeError("launcher: no gloo group; pass with_gloo=True to run_ranks")
    return _GLOO


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path, limit=4000):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return "<no output>"
    text = data[-limit:].decode("utf-8", "replace")
    return ("...\n" if len(data) > limit else "") + text if text else "<no output>"


def _stopped(proc) -> bool:
    """Whether the process is stopped (SIGSTOP), from /proc."""
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _describe_exit(code):
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: see start_new_session
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_ranks(
    fn,
    world_size: int,
    timeout: float = 180,
    backend_init: str = "file",
    env: dict | None = None,
    args: tuple = (),
    with_gloo: bool = False,
    pg_options=None,
    pg_timeout: float | None = None,
    init: bool = True,
    grace: float = 10.0,
    may_die: tuple = (),
):
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` processes.

    backend_init: "file" (fresh file://), "tcp" (tcp://127.0.0.1:free port)
    or "env" (env:// with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE).
    env: extra environment variables for the ranks (value None removes one).
    pg_options: passed to init_process_group (e.g. torchcollx.Options(...)).
    pg_timeout: the process group timeout in seconds (default: a bit under
    ``timeout``, so a collx-side timeout reports an error before the kill).
    may_die: ranks allowed to end without reporting (killed, stopped); the
    run waits for the others only and returns ``Died(...)`` for these.
    init: False leaves init_process_group to ``fn`` itself; the rank then
    finds the rendezvous in ``launcher.rendezvous()`` style env vars
    COLLX_TEST_INIT_METHOD / COLLX_TEST_RANK / COLLX_TEST_WORLD_SIZE.
    Returns the list of return values, indexed by rank.
    """
    if backend_init not in ("file", "tcp", "env"):
        raise ValueError(f"backend_init must be file, tcp or env, got {backend_init!r}")
    workdir = tempfile.mkdtemp(prefix="collx-test-")
    try:
        return _run(fn, world_size, timeout, backend_init, env, args, with_gloo, pg_options,
                    pg_timeout, init, grace, workdir, frozenset(may_die))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(fn, world_size, timeout, backend_init, env, args, with_gloo, pg_options, pg_timeout,
         init, grace, workdir, may_die):
    module = sys.modules[fn.__module__]
    module_file = os.path.abspath(module.__file__)
    if pg_timeout is None:
        pg_timeout = max(10.0, timeout - 15.0)

    child_env = dict(os.environ)
    child_env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores shared by all ranks
    child_env["PYTHONUNBUFFERED"] = "1"
    for k, v in (env or {}).items():
        if v is None:
            child_env.pop(k, None)
        else:
            child_env[k] = str(v)

    port = free_port()
    if backend_init == "file":
        init_method = "file://" + os.path.join(workdir, "rendezvous")
    elif backend_init == "tcp":
        init_method = f"tcp://127.0.0.1:{port}"
    else:
        init_method = "env://"
        child_env["MASTER_ADDR"] = "127.0.0.1"
        child_env["MASTER_PORT"] = str(port)
        child_env["WORLD_SIZE"] = str(world_size)

    spec = {
        "module_file": module_file,
        "module_name": fn.__module__,
        "fn": fn.__qualname__,
        "args": args,
        "world_size": world_size,
        "init_method": init_method,
        "with_gloo": with_gloo,
        "pg_options": pg_options,
        "pg_timeout": pg_timeout,
        "init": init,
    }
    spec_path = os.path.join(workdir, "spec.pkl")
    with open(spec_path, "wb") as f:
        pickle.dump(spec, f)

    procs, logs, results = [], [], []
    try:
        for rank in range(world_size):
            renv = dict(child_env)
            renv["COLLX_TEST_RANK"] = str(rank)
            if backend_init == "env":
                renv["RANK"] = str(rank)
            log = os.path.join(workdir, f"rank{rank}.log")
            res = os.path.join(workdir, f"rank{rank}.result")
            logs.append(log)
            results.append(res)
            procs.append(_start(spec_path, rank, res, renv, log))

        deadline = time.monotonic() + timeout
        first_failure_at = others_done_at = None
        while True:
            done = [p.poll() is not None for p in procs]
            now = time.monotonic()
            if all(d or r in may_die for r, d in enumerate(done)):
                # A may_die rank that still runs (not stopped) may be about to
                # end by itself (still starting up): its end is its result.
                others_done_at = others_done_at or now
                if all(d or _stopped(p) for d, p in zip(done, procs)) or now - others_done_at > grace:
                    break
            if first_failure_at is None and any(
                d and _read_result(res)[0] != "ok" and (r not in may_die or _read_result(res)[0] == "error")
                for r, (d, res) in enumerate(zip(done, results))
            ):
                first_failure_at = now
            if first_failure_at is not None and now - first_failure_at > grace:
                break  # the others are most likely blocked on the failed rank
            if now > deadline:
                break
            time.sleep(0.05)
    finally:
        still = [r for r, p in enumerate(procs) if p.poll() is None]
        exits = [_describe_exit(p.poll()) for p in procs]  # before the kill: a stopped rank is "still running"
        for p in procs:
            _kill(p)

    outcomes = [_read_result(r) for r in results]
    for rank in may_die:
        if outcomes[rank][0] == "missing":
            outcomes[rank] = ("ok", Died(exits[rank]))
    still = [r for r in still if r not in may_die]
    errors = []
    for rank, (status, payload) in enumerate(outcomes):
        if status == "error":
            errors.append(f"--- rank {rank} raised:\n{payload}")
        elif status == "missing" and rank not in still:
            errors.append(
                f"--- rank {rank} died without reporting ({_describe_exit(procs[rank].returncode)}); "
                f"output tail:\n{_tail(logs[rank])}"
            )
    if errors:
        if still:
            errors.append(f"--- ranks {still} were still running after the failure and were killed")
        raise RanksFailed(f"collx test {fn.__qualname__} (world_size={world_size}, {backend_init}):\n"
                          + "\n".join(errors))
    if still:
        tails = "\n".join(f"--- rank {r} output tail:\n{_tail(logs[r])}" for r in still)
        raise RanksFailed(
            f"collx test {fn.__qualname__} (world_size={world_size}, {backend_init}): "
            f"HUNG: ranks {still} did not finish within {timeout:.0f} s and were SIGKILLed\n{tails}"
        )
    return [payload for _, payload in outcomes]


# ------------------------------------------------------------------ starting ranks

_FORKSERVER = None


class _Forked:
    """A rank forked by the server, with the part of Popen's interface that
    _run uses. Its exit code comes from the server (negative: a signal)."""

    def __init__(self, process):
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def kill(self):
        self._process.kill()

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("collx test rank", timeout)
        return self._process.exitcode


def _start(spec_path, rank, result_path, env, log_path):
    global _FORKSERVER
    if env.get("COLLX_TEST_SPAWN") == "1" or not _main_is_a_package():
        with open(log_path, "wb") as out:
            return subprocess.Popen([sys.executable, os.path.abspath(__file__), spec_path, str(rank), result_path],
                                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd=HERE,
                                    start_new_session=True)
    if _FORKSERVER is None:
        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["torch", "torch.distributed", "torchcollx", "launcher"])
    process = _FORKSERVER.Process(target=_forked_main, args=(spec_path, rank, result_path, env, log_path),
                                  name=f"collx-test-rank{rank}", daemon=False)
    process.start()
    return _Forked(process)


def _main_is_a_package():
    """Whether __main__ is a package's (python -m pytest): multiprocessing's
    children then skip importing it. A script as __main__ would be rerun in
    every child, so ranks are spawned instead."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return spec is not None and spec.name.endswith(".__main__")


def _forked_main(spec_path, rank, result_path, env, log_path):
    """A forked rank: its own session, output file, environment and working
    directory, as a fresh interpreter would have them; then _child_main."""
    import io

    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", 0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", 0, closefd=False), write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(HERE)
    import torch
    import torch.distributed as dist

    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    dist.set_debug_level_from_env()
    _child_main(spec_path, rank, result_path)


def _read_result(path):
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return ("missing", None)
    except Exception as e:  # half-written: the process is still writing or died writing
        return ("missing", repr(e))


# ------------------------------------------------------------------ child side

def _child_main(spec_path, rank, result_path):
    global _GLOO
    rank = int(rank)

    def report(status, payload):
        tmp = result_path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                pickle.dump((status, payload), f)
        except Exception:
            with open(tmp, "wb") as f:
                pickle.dump(("error", f"result of rank {rank} is not picklable: {payload!r}\n"
                             + traceback.format_exc()), f)
        os.replace(tmp, result_path)

    try:
        with open(spec_path, "rb") as f:
            spec = pickle.load(f)
        sys.path.insert(0, os.path.dirname(spec["module_file"]))
        # Started as a script, this file runs as __main__; make `import
        # launcher` in test modules resolve to this same module so that
        # launcher.gloo() sees _GLOO.
        sys.modules.setdefault("launcher", sys.modules[__name__])
        import torch.distributed as dist

        import torchcollx  # noqa: F401  registers "collx"

        module = importlib.import_module(spec["module_name"])
        fn = module
        for part in spec["fn"].split("."):
            fn = getattr(fn, part)
        ws = spec["world_size"]
        os.environ["COLLX_TEST_INIT_METHOD"] = spec["init_method"]
        os.environ["COLLX_TEST_WORLD_SIZE"] = str(ws)
        if spec["init"]:
            kwargs = dict(timeout=datetime.timedelta(seconds=spec["pg_timeout"]))
            if spec["pg_options"] is not None:
                kwargs["pg_options"] = spec["pg_options"]
            dist.init_process_group("collx", init_method=spec["init_method"], rank=rank,
                                    world_size=ws, **kwargs)
            if spec["with_gloo"]:
                _GLOO = dist.new_group(backend="gloo")
        value = fn(rank, ws, *spec["args"])
        if spec["init"] and dist.is_initialized():
            dist.destroy_process_group()
        report("ok", value)
    except BaseException:
        report("error", traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # do not block in teardown of a group whose peers are gone
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _child_main(*sys.argv[1:4])
