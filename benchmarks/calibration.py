"""What auto's calibration (COLLX_TUNING=calibrate) adds to creating a group.

    .venv/bin/torchrun --nproc_per_node=4 benchmarks/calibration.py [--trials 7]

Each trial creates, on every rank at once (after a barrier), a gloo group, a
collx group with COLLX_TUNING=table and a collx group that calibrates (a
fresh XDG_CACHE_HOME, so no cached tuning), in a new order each trial. A
group's time runs from new_group to the end of its first 4-byte all_reduce
(the group is up on every rank); the max over ranks. "calibration" is the
time the collx group reports for its own calibration (backend.tuning).
"""
import argparse
import os
import random
import re
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import torchcollx  # noqa: F401  (registers the collx backend)
from bench_common import agreed_max


def make(kind):
    """Creates one group of `kind`; returns (seconds until it is up, its calibration ms)."""
    if kind != "gloo":
        os.environ["COLLX_TUNING"] = "table" if kind == "collx table" else "calibrate"
        os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="collx-calibration-")
    dist.barrier()
    start = time.perf_counter()
    group = dist.new_group(backend="gloo" if kind == "gloo" else "collx")
    dist.all_reduce(torch.zeros(1), group=group)
    took = time.perf_counter() - start
    calibrated = 0.0
    if kind == "collx calibrate":
        m = re.search(r"calibration in ([\d.]+) ms", group._get_backend(torch.device("cpu")).tuning)
        calibrated = float(m.group(1)) if m else float("nan")
    return took, calibrated


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=7)
    args = p.parse_args()
    dist.init_process_group("gloo")
    kinds = ["gloo", "collx table", "collx calibrate"]
    times = {k: [] for k in kinds}
    calibration = []
    for trial in range(args.trials):
        order = list(kinds)
        random.Random(trial).shuffle(order)  # alike on every rank
        for kind in order:
            took, ms = make(kind)
            took, ms = agreed_max(took, ms)
            times[kind].append(took * 1e3)
            if kind == "collx calibrate":
                calibration.append(ms)
    if dist.get_rank() == 0:
        n = dist.get_world_size()
        print(f"# group creation until its first all_reduce, n={n}, {args.trials} trials (ms, max over ranks)")
        for kind in kinds:
            t = times[kind]
            print(f"{kind:<16s} median {statistics.median(t):7.1f}  min {min(t):7.1f}  max {max(t):7.1f}")
        added = [c - t for c, t in zip(times["collx calibrate"], times["collx table"])]
        print(f"calibration (reported by the group): median {statistics.median(calibration):.1f} ms, "
              f"{min(calibration):.1f}-{max(calibration):.1f}; calibrate minus table per trial: "
              f"median {statistics.median(added):.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
