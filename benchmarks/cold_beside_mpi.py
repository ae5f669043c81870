"""The first ops of a size, collx's and MPI's, in the same processes: how much
of a cold start is the machine's and how much is collx's (issue 35, item 3).

cold_start.py compares collx's first ops of a size with its own warm ops. On
this kind of machine the first ops of any size run slower than later ones
whatever runs them (caches, pages, the host's speed modes): MPICH's first
100 all-reduces of a size took 0.8-1.2x its warm ones, job to job. Here
every process of one mpiexec job holds an MPI communicator and a collx group
(auto, as users make it), and for each size runs:

  cold  the first --ops ops of the size on each side, one side right after
        the other (which goes first alternates from size to size, and from
        repeat to repeat), every rank starting each block at an MPI barrier;
  next  as many ops again, right after each side's cold ones: warm ops (on
        a second run auto starts from its saved choice) in the same speed
        mode of the machine as the cold ones, which moves by 1.5-3x within
        a minute;
  warm  after auto settles its choice for the size (at most --settle-s),
        --rounds rounds of one block of each side, in alternating order.

Each repeat makes a fresh calibration cache and runs the job twice against
it: "first" (auto calibrates and runs its trials) and "second" (the same
job again, from the choices the first one saved). The table gives, per run
and size, the medians over repeats of each side's cold mean per op over its
warm median, and of their quotient: collx's cold excess beyond what the
machine charges MPI (target: the second run's collx cold/warm <= 1.1); and
each side's cold over next. A third side, "floor", runs the same ops on a
one-rank collx group of each rank's own, all ranks at once: torch's call
and collx's glue with no peer and no data moved, whose first ops of a size
show what the process charges any torch.distributed call there.
Times are per op, the max over ranks.

    .venv/bin/python benchmarks/cold_beside_mpi.py --ranks 2 --repeats 4

Needs `make bench-setup`.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from bench_common import cache_runs, launch_json, parse_sizes
from mpi_allreduce import make_op, run_aborting
from mpi_beside import init_beside_mpi, refining, torch_call


def worker(args):
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    init_beside_mpi(comm)
    group = dist.new_group(backend="collx")
    line = dist.new_group(backend="collx")
    solo = [dist.new_group(ranks=[r], backend="collx") for r in range(n)][rank]
    sizes = parse_sizes(args.sizes, "1G", 4)
    calls = {}
    for size in sizes:  # every buffer made and zeroed (sums of zeros stay zeros) before any size's cold ops
        mpi, _, _, zero = make_op(comm, "all_reduce", size)
        zero()
        buf, own = torch.zeros(max(1, size // 4)), torch.zeros(max(1, size // 4))
        calls[size] = {"mpi": mpi, "collx": lambda buf=buf: dist.all_reduce(buf, group=group),
                       "floor": lambda own=own: dist.all_reduce(own, group=solo)}
    tiny = torch.zeros(1)
    make_op(comm, "all_reduce", 4)[0]()  # each side's first op of all, apart from any size's
    torch_call(group, "all_reduce", 4, n, rank)[0]()
    dist.all_reduce(tiny, group=solo)
    dist.all_reduce(tiny, group=line)

    def agreed(us):
        return comm.allreduce(us, op=MPI.MAX)

    def timed(size, name, ops, blocks=1):
        """Per-op times of `blocks` back-to-back runs of `ops` of a side's
        calls, max over ranks. The ranks leave an MPI barrier up to
        milliseconds apart (n=4 on 2 cores), which a block's first op would
        wait out: a collx block starts after two small all-reduces on a collx
        group of their own, which line them up."""
        comm.Barrier()
        if name != "mpi":
            for _ in range(2):
                dist.all_reduce(tiny, group=line)
        marks = [time.perf_counter()]
        for _ in range(blocks):
            for _ in range(ops):
                calls[size][name]()
            marks.append(time.perf_counter())
        return [agreed((b - a) / ops * 1e6) for a, b in zip(marks, marks[1:])]

    rows = []
    for i, size in enumerate(sizes):
        order = ["mpi", "floor", "collx"] if (i + args.order) % 2 == 0 else ["collx", "floor", "mpi"]
        # The cold ops, then as many right after them: the next ones run in
        # the same speed mode of the machine, which warm blocks seconds
        # later need not (it moves by 1.5-3x within a minute).
        cold, nxt = {}, {}
        for name in order:
            cold[name], nxt[name] = timed(size, name, args.ops, blocks=2)
        start = time.perf_counter()
        while comm.allreduce(refining(group, size) and time.perf_counter() - start < args.settle_s, op=MPI.LOR):
            for _ in range(20):
                calls[size]["collx"]()
        # Each side's blocks last about 0.1 s: a block of few ops would time
        # the ranks' skew out of the barrier (MPICH's, at n=4, milliseconds).
        ops = {name: max(5, min(args.ops, int(0.1e6 / us))) for name, us in cold.items()}
        warm = {name: [] for name in order}
        for r in range(args.rounds):
            for name in (order if r % 2 else order[::-1]):
                warm[name].append(timed(size, name, ops[name])[0])
        mpi, _, right, _ = make_op(comm, "all_reduce", size)  # the results, from known values
        mpi()
        ok = {"mpi": right(), "collx": torch_call(group, "all_reduce", size, n, rank)[1](),
              "floor": torch_call(solo, "all_reduce", size, 1, 0)[1]()}
        for name, good in ok.items():
            if not comm.allreduce(bool(good), op=MPI.LAND):
                raise SystemExit(f"{name} returned a wrong all_reduce result at {size} B")
        rows.append({"bytes": size, "cold_us": cold, "next_us": nxt,
                     "warm_us": {k: statistics.median(v) for k, v in warm.items()},
                     "settled": not refining(group, size)})
    if rank == 0:
        Path(args.json).write_text(json.dumps({"rows": rows}))
    dist.destroy_process_group()


def run_job(args, cache, order, out):
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(args.ranks), sys.executable,
           str(Path(__file__).resolve()), "--worker", "--sizes", args.sizes, "--ops", str(args.ops),
           "--rounds", str(args.rounds), "--settle-s", str(args.settle_s), "--order", str(order), "--json", out]
    return launch_json(cmd, out, env={"XDG_CACHE_HOME": cache})["rows"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="4K,64K,1M,16M")
    p.add_argument("--ops", type=int, default=100, help="cold ops per size and side, and most ops per warm block")
    p.add_argument("--rounds", type=int, default=7, help="warm rounds")
    p.add_argument("--settle-s", type=float, default=8.0, help="most seconds of ops per size for auto to settle")
    p.add_argument("--repeats", type=int, default=4, help="fresh caches, each run first and second")
    p.add_argument("--order", type=int, default=0, help="(worker) 1: collx goes first at even sizes")
    p.add_argument("--json", help="(worker) where rank 0 writes its rows")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    runs = cache_runs(args.repeats, lambda cache, order, out: run_job(args, cache, order, out))
    print(f"n={args.ranks}, float32 SUM all_reduce in place; first {args.ops} ops per size, cold; medians over "
          f"{args.repeats} repeats; us per op, max over ranks")
    print("| run | bytes | collx cold | collx warm | MPI cold | MPI warm | collx cold/warm | MPI cold/warm | "
          "floor cold/warm | collx / MPI cold/warm | collx cold/next | MPI cold/next | floor cold/next | "
          "collx cold/warm, each repeat | settled |")
    print("|---" * 15 + "|")
    for label, reps in runs.items():
        for j, row in enumerate(reps[0]):
            def ratios(side, of="warm_us"):
                return [r[j]["cold_us"][side] / r[j][of][side] for r in reps]

            def med(f):
                return statistics.median(f(r[j]) for r in reps)
            cx, mx = ratios("collx"), ratios("mpi")
            print(f"| {label} | {row['bytes']} | {med(lambda r: r['cold_us']['collx']):.1f} | "
                  f"{med(lambda r: r['warm_us']['collx']):.1f} | {med(lambda r: r['cold_us']['mpi']):.1f} | "
                  f"{med(lambda r: r['warm_us']['mpi']):.1f} | {statistics.median(cx):.2f} | "
                  f"{statistics.median(mx):.2f} | {statistics.median(ratios('floor')):.2f} | "
                  f"{statistics.median(np.divide(cx, mx)):.2f} | "
                  f"{statistics.median(ratios('collx', 'next_us')):.2f} | "
                  f"{statistics.median(ratios('mpi', 'next_us')):.2f} | "
                  f"{statistics.median(ratios('floor', 'next_us')):.2f} | "
                  f"{', '.join(f'{x:.2f}' for x in cx)} | {sum(r[j]['settled'] for r in reps)}/{len(reps)} |")


if __name__ == "__main__":
    run_aborting(main)
