"""Group creation at the largest sizes this machine holds, with real torch
processes: init_process_group's time and the first and steady all-reduce
(256 KiB) for gloo eager, gloo with TORCH_GLOO_LAZY_INIT=1, collx eager and
collx lazy (COLLX_CONNECT), in one run. collx runs over TCP
(COLLX_TRANSPORT=tcp), as ranks on other hosts do; on one host its ranks
would share memory, which connects them all at creation either way.

    python benchmarks/connect_init.py --ranks 16,32 [--json out.json]

Ranks start at different moments (each imports torch), so "init" is counted
from the last rank's arrival to the last rank's return; "first" is the
slowest rank's first all-reduce, which for a group that meets its peers on
its first op (gloo lazy, collx) includes waiting for the last rank to
arrive; "init+first" counts from the last rank's arrival to the end of the
last first all-reduce, the same span for every config; "steady" the median
of 10 after it, on the slowest rank; sockets are per rank, the Store's
connection included.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "gloo eager": ("gloo", {}),
    "gloo lazy": ("gloo", {"TORCH_GLOO_LAZY_INIT": "1"}),
    "collx eager": ("collx", {"COLLX_CONNECT": "eager", "COLLX_TRANSPORT": "tcp"}),
    "collx lazy": ("collx", {"COLLX_CONNECT": "lazy", "COLLX_TRANSPORT": "tcp"}),
}
BYTES = 256 << 10


def sockets():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def worker(backend, out):
    import torch
    import torch.distributed as dist
    if backend == "collx":
        import torchcollx  # noqa: F401
    from datetime import timedelta
    arrived = time.time()
    t0 = time.perf_counter()
    dist.init_process_group(backend, timeout=timedelta(seconds=600))
    t1 = time.perf_counter()
    x = torch.ones(BYTES // 4)
    dist.all_reduce(x)
    t2 = time.perf_counter()
    steady = []
    for _ in range(10):
        s = time.perf_counter()
        dist.all_reduce(x)
        steady.append(time.perf_counter() - s)
    rank = dist.get_rank()
    Path(out, f"{rank}.json").write_text(json.dumps(
        {"arrived": arrived, "ready": arrived + (t1 - t0), "first": t2 - t1, "first_done": arrived + (t2 - t0),
         "steady": statistics.median(steady),
         "sockets": sockets()}))
    dist.destroy_process_group()


def run(name, n):
    backend, env = CONFIGS[name]
    with tempfile.TemporaryDirectory() as out:
        cmd = [str(Path(sys.executable).parent / "torchrun"), f"--nproc_per_node={n}", __file__, "--worker", backend,
               "--out", out]
        done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", **env), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=1800)
        if done.returncode != 0:
            sys.exit(f"{name} at n={n} failed:\n{done.stderr[-3000:]}")
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(n)]
    return {
        "config": name, "ranks": n,
        "init_ms": 1e3 * (max(r["ready"] for r in ranks) - max(r["arrived"] for r in ranks)),
        "first_ms": 1e3 * max(r["first"] for r in ranks),
        "init_first_ms": 1e3 * (max(r["first_done"] for r in ranks) - max(r["arrived"] for r in ranks)),
        "steady_ms": 1e3 * max(r["steady"] for r in ranks),
        "sockets_per_rank": max(r["sockets"] for r in ranks),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="16,32")
    p.add_argument("--json")
    p.add_argument("--worker")
    p.add_argument("--out")
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.out)
    rows = []
    print(f"{'config':<12} {'n':>4} {'init ms':>9} {'first ms':>9} {'init+first':>11} {'steady ms':>10} {'sockets':>8}")
    for n in [int(x) for x in a.ranks.split(",")]:
        for name in CONFIGS:
            row = run(name, n)
            rows.append(row)
            print(f"{name:<12} {n:>4} {row['init_ms']:>9.0f} {row['first_ms']:>9.1f} {row['init_first_ms']:>11.1f} "
                  f"{row['steady_ms']:>10.2f} "
                  f"{row['sockets_per_rank']:>8}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
