#!/usr/bin/env python3
"""PyTorch's own distributed test suite, run on gloo and on collx standing in for gloo.

    python scripts/torch_suite.py --world-size 2 [--families all_reduce,p2p,...] [-k REGEX] [--all]

The suite is torch's ``DistributedTest._DistTestBase`` (shipped in the wheel), launched as
torch's test/distributed/test_distributed_spawn.py does: one ``MultiProcessTestCase`` per
test. Its ranks are forked from the worker by default (as the former test_distributed_fork.py
did), which spares each rank the import of torch: 0.4 s per test instead of 6 s at n=4 on
2 cores. With --start spawn they are spawned processes that re-import this file. The suite always runs with
BACKEND=gloo, so gloo's own tests and skips apply. For the collx run the environment carries
COLLX_TORCH_SUITE_AS_GLOO=1: every process that imports this file then imports torchcollx
and turns each group the suite creates as "gloo" into a collx group. Without the variable
the same code runs real gloo. Needs the ``expecttest`` package (torch's test utilities).

Prints, per family of tests, pass/fail/skip for each backend, then every test whose result
differs between gloo and collx. Logs and per-test results go to --out.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

AS_GLOO = "COLLX_TORCH_SUITE_AS_GLOO"
WORKER = "COLLX_TORCH_SUITE_WORKER"  # set in a worker and inherited by the ranks it spawns
START = "COLLX_TORCH_SUITE_START"  # fork or spawn: how the worker starts each test's ranks

# (family, regex on the test name); the first match wins, so the broad patterns come last.
FAMILIES = [
    ("ddp", r"DistributedDataParallel|ddp|DDP|SyncBatchNorm|sync_bn|accumulate_gradients|static_graph"
            r"|unused_param|output_unused|model_averager|average_parameters|post_localSGD"
            r"|verify_model_across|across_ranks|bucket_assignment|data_parallel_params"),
    ("barrier", r"barrier"),
    ("p2p", r"send|recv"),
    ("groups", r"new_subgroups|destroy_(full_)?group|get_rank_size|get_backend"),
    ("reduce_scatter", r"reduce_scatter"),
    ("all_reduce", r"all_?reduce|get_future|coalescing_manager"),
    ("reduce", r"(^test_|_)reduce(_|$)"),
    ("all_gather", r"all_?gather"),
    ("all_to_all", r"all_to_all"),
    ("gather_scatter", r"gather|scatter"),
    ("broadcast", r"broadcast"),
]
FAMILY_NAMES = [name for name, _ in FAMILIES]

# Tests that check the backend's name, which differs by design; not counted as regressions.
NAME_ONLY = {
    "test_get_backend": "asserts dist.get_backend() == 'gloo'",
    "test_ddp_logging_data_cpu": "DDP logs ProcessGroup::getBackendName(), which torch makes 'custom' for every "
                                 "plugin backend, and compares it with dist.get_backend()",
}


def family_of(test: str) -> str | None:
    return next((name for name, rx in FAMILIES if re.search(rx, test)), None)


def install_collx_as_gloo() -> None:
    """Create every group asked for as "gloo" on collx instead.

    new_group, new_subgroups*, device meshes and torch's own helper groups all go through
    _new_group_with_tag, so patching it and init_process_group covers every group. The
    groups really are collx groups: dist.get_backend() says "collx".
    """
    import functools
    import inspect

    import torch.distributed as dist
    import torchcollx  # noqa: F401  (registers "collx")

    c10d = dist.distributed_c10d

    def patched(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            backend = bound.arguments.get("backend")
            if isinstance(backend, str):  # also dist.Backend and "cpu:gloo,cuda:gloo"
                bound.arguments["backend"] = re.sub(r"\bgloo\b", "collx", backend.lower())
            return fn(*bound.args, **bound.kwargs)

        return wrapper

    dist.init_process_group = c10d.init_process_group = patched(c10d.init_process_group)
    c10d._new_group_with_tag = patched(c10d._new_group_with_tag)


if os.environ.get(WORKER):
    # As in torch's test/distributed/test_distributed_spawn.py. Runs in the worker and,
    # through the re-import, in every rank it spawns.
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    if os.environ.get(AS_GLOO):
        install_collx_as_gloo()
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            if os.environ.get(START) == "fork":  # torch 2.14 dropped _fork_processes
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def select(names, families, pattern, everything):
    return [n for n in names
            if (everything or family_of(n) in families) and (not pattern or re.search(pattern, n))]


def run_worker(args) -> None:
    """Run the selected tests in this process (env set by run_backend); one JSON line each."""
    from torch.testing._internal import common_distributed

    # The hard per-test limit: torch's join loop kills the ranks after get_timeout() seconds
    # (300 by default, 500 for some DDP tests).
    common_distributed.get_timeout = lambda test_id: args.timeout
    names = select(unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn),
                   args.families, args.k, args.all)
    # Progress goes to stdout; everything else, the ranks' output included, to stderr (the log).
    progress = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    progress.write(f"{args.worker}: {len(names)} tests\n")
    with open(os.path.join(args.out, f"{args.worker}.jsonl"), "w") as out:
        for i, name in enumerate(names, 1):
            result = unittest.TestResult()
            start = time.monotonic()
            TestDistBackendWithSpawn(name).run(result)
            if result.failures or result.errors:
                status, detail = "fail", (result.failures + result.errors)[0][1]
            elif result.skipped:
                status, detail = "skip", result.skipped[0][1]
            else:
                status, detail = "pass", ""
            seconds = time.monotonic() - start
            out.write(json.dumps({"test": name, "status": status, "seconds": round(seconds, 1),
                                  "detail": detail}) + "\n")
            out.flush()
            progress.write(f"  [{args.worker} {i}/{len(names)}] {name}: {status} ({seconds:.0f} s)\n")


def run_backend(backend, args, passthrough) -> dict[str, dict]:
    tmp = os.path.join(args.out, "tmp")  # torch's per-test rendezvous files land here
    os.makedirs(tmp, exist_ok=True)
    env = dict(os.environ, **{WORKER: "1", "BACKEND": "gloo", "WORLD_SIZE": str(args.world_size),
                              "TEMP_DIR": tmp, "TMPDIR": tmp, "CUDA_VISIBLE_DEVICES": "",
                              # The suite's groups always start from a file; with this, so do the
                              # tests that skip unless INIT_METHOD is file:// (as in torch's CI).
                              "INIT_METHOD": "file://" + os.path.join(tmp, "init_file"),
                              "PYTORCH_PRINT_REPRO_ON_FAILURE": "0", START: args.start})
    env.pop(AS_GLOO, None)
    if backend == "collx":
        env[AS_GLOO] = "1"
    path = os.path.join(args.out, f"{backend}.jsonl")
    if os.path.exists(path):  # from an earlier run into the same --out
        os.remove(path)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", backend, "--out", args.out] + passthrough
    # Own session, so that a stuck worker can be killed with every rank it spawned.
    with open(os.path.join(args.out, f"{backend}.log"), "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stderr=log, start_new_session=True)
    try:
        proc.wait(timeout=args.budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"{backend}: killed after --budget {args.budget} s")
    if not os.path.exists(path):
        sys.exit(f"{backend}: the worker wrote no results (exit code {proc.returncode}); "
                 f"see {args.out}/{backend}.log")
    with open(path) as f:
        return {r["test"]: r for r in map(json.loads, f)}


def first_error_line(detail: str) -> str:
    """The exception a rank raised (the first failing rank's last one), else the test's own."""
    sections = re.split(r"Process \d+ exited with error code \d+ and exception:", detail)
    text = sections[1] if len(sections) > 1 else detail
    lines = re.findall(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b:?.*)$", text, re.M)
    return lines[-1].strip() if lines else detail.strip().splitlines()[-1] if detail.strip() else ""


def report(results: dict[str, dict[str, dict]]) -> int:
    """Print the tables; return the number of tests that pass on gloo but not on collx."""
    backends = list(results)
    names = sorted(set().union(*results.values()))

    def counts(tests, backend):
        statuses = [results[backend].get(t, {}).get("status", "missing") for t in tests]
        return "/".join(str(statuses.count(s)) for s in ("pass", "fail", "skip"))

    by_family = {}
    for name in names:
        by_family.setdefault(family_of(name) or "other", []).append(name)
    order = [f for f in FAMILY_NAMES + ["other"] if f in by_family]
    header = f"{'family':<16}{'tests':>6}" + "".join(f"{b + ' pass/fail/skip':>26}" for b in backends)
    print(header)
    print("-" * len(header))
    for fam in order + ["total"]:
        tests = names if fam == "total" else by_family[fam]
        print(f"{fam:<16}{len(tests):>6}" + "".join(f"{counts(tests, b):>26}" for b in backends))

    if len(backends) < 2:
        return 0
    a, b = backends
    diff = [n for n in names
            if results[a].get(n, {}).get("status") != results[b].get(n, {}).get("status")]
    print(f"\n{len(diff)} tests differ between {a} and {b}:")
    for n in diff:
        ra, rb = results[a].get(n, {}), results[b].get(n, {})
        line = f"  {n} [{family_of(n) or 'other'}]: {a} {ra.get('status', 'missing')}, {b} {rb.get('status', 'missing')}"
        if n in NAME_ONLY:
            line += f" (name only: {NAME_ONLY[n]})"
        for backend, r in ((a, ra), (b, rb)):
            if r.get("status") in ("fail", "skip"):
                line += f"\n      {backend}: {first_error_line(r['detail'])[:300]}"
        print(line)
    regressions = [n for n in diff if n not in NAME_ONLY and results[a].get(n, {}).get("status") == "pass"]
    print(f"\n{len(regressions)} tests pass on {a} but not on {b}" + (f": {' '.join(regressions)}" if regressions else ""))
    return len(regressions)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--families", default=",".join(FAMILY_NAMES),
                   help=f"comma-separated, of: {', '.join(FAMILY_NAMES)} (default: all of them)")
    p.add_argument("-k", help="run only tests whose name matches this regex")
    p.add_argument("--all", action="store_true", help="also run the tests outside the families")
    p.add_argument("--backends", default="gloo,collx", help="which of gloo,collx to run (default: both)")
    p.add_argument("--timeout", type=int, default=120, help="per test, in seconds (default: 120)")
    p.add_argument("--budget", type=int, default=4 * 3600,
                   help="per backend, in seconds: a safety net behind --timeout (default: 4 h)")
    p.add_argument("--start", choices=("fork", "spawn"), default="fork",
                   help="how each test's ranks start: fork (default; no re-import of torch per rank) "
                        "or spawn, as torch's test_distributed_spawn.py does")
    p.add_argument("--out", help="directory for logs and results (default: a new temporary one)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.families, args.backends = args.families.split(","), args.backends.split(",")
    unknown = set(args.families) - set(FAMILY_NAMES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILY_NAMES)}")
    if not set(args.backends) <= {"gloo", "collx"}:
        p.error("--backends takes gloo, collx or both")

    if args.worker:
        return run_worker(args)
    if importlib.util.find_spec("expecttest") is None:
        sys.exit("torch's test utilities need expecttest: pip install expecttest")

    args.out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="torch_suite_"))
    # Calibrations made under the suite's load stay with its logs, not in the
    # user's ~/.cache/torchcollx, where later runs would reuse them.
    os.environ["XDG_CACHE_HOME"] = os.path.join(args.out, "cache")
    os.makedirs(args.out, exist_ok=True)
    passthrough = ["--families", ",".join(args.families), "--timeout", str(args.timeout)]
    passthrough += (["-k", args.k] if args.k else []) + (["--all"] if args.all else [])
    start = time.monotonic()
    results = {b: run_backend(b, args, passthrough) for b in args.backends}
    print(f"\ntorch's distributed_test at world size {args.world_size}, "
          f"{time.monotonic() - start:.0f} s; logs and results in {args.out}\n")
    sys.exit(1 if report(results) else 0)


if __name__ == "__main__":
    main()
