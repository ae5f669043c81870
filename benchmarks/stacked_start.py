"""Where a job's ranks run in its first ops: windows of 4 KiB all-reduces on
an auto collx group right after setup, each window's mean time and the core
each rank ran it on (two ranks on one core, "00" or "11", is a stack).

Each job does what cold_start.py's does before its cold ops: a gloo default
group, an auto collx group and one forced group per algorithm, 20 tiny ops
on each, then --windows windows of --ops all-reduces. Jobs run one after
another through torchrun; the summary counts the windows run stacked and
their mean time beside the others'.

    .venv/bin/python benchmarks/stacked_start.py [--jobs 8] [--windows 15] [--ops 20]
"""
import argparse
import ctypes
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import torchcollx
from bench_common import run_ops, torchrun_json


def worker(args):
    dist.init_process_group("gloo")
    group = dist.new_group(backend="collx")
    groups = [group] + [dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=a))
                        for a in ("ring", "tree", "star", "direct", "shm")]
    tiny = torch.ones(1)
    for g in groups:
        run_ops(g, tiny, 20)
    sched_getcpu = ctypes.CDLL(None).sched_getcpu
    buf = torch.ones(1024)
    cores, us = [], []
    for _ in range(args.windows):
        ts = run_ops(group, buf, args.ops)
        cores.append(sched_getcpu())
        us.append((ts[-1] - ts[0]) / args.ops * 1e6)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"cores": cores, "us": us})
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--windows", type=int, default=15)
    p.add_argument("--ops", type=int, default=20)
    p.add_argument("--json", help="(worker) where rank 0 writes the windows")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    stacked, apart = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for j in range(args.jobs):
            out = Path(tmp) / f"job{j}.json"
            ranks = torchrun_json(Path(__file__).resolve(), 2,
                                  ["--worker", "--windows", str(args.windows), "--ops", str(args.ops)], out,
                                  env={"XDG_CACHE_HOME": tmp})
            cores = ["".join(str(r["cores"][w]) for r in ranks) for w in range(args.windows)]
            us = [max(r["us"][w] for r in ranks) for w in range(args.windows)]
            for c, t in zip(cores, us):
                (stacked if len(set(c)) == 1 else apart).append(t)
            print(f"job {j + 1}: " + " ".join(f"{c}:{t:.0f}" for c, t in zip(cores, us)), flush=True)
            time.sleep(0.5)

    def mean(xs):
        return f"{statistics.mean(xs):.1f}" if xs else "-"
    print(f"windows of {args.ops} 4 KiB all-reduces, n=2: {len(stacked)} of {len(stacked) + len(apart)} stacked "
          f"(mean {mean(stacked)} us an op), apart {mean(apart)} us")


if __name__ == "__main__":
    main()
