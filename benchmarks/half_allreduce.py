"""16-bit float all-reduce beside float32 at equal bytes (issue 35: bf16 and
fp16 at the float32 byte rate), on one collx group (auto), in place, SUM.

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/half_allreduce.py [--sizes 64K,1M,16M] [--rounds 7]

Each size is checked first (rank r contributes r+1; the sum n(n+1)/2 is
exact in every dtype here), then float32, bfloat16 and float16 buffers of
the same bytes take turns in shuffled rounds (bench_common.interleaved_turns);
the table gives each dtype's median turn, max over ranks, and its time over
float32's (target <= 1.1); "paired", the median over rounds of its turn over
float32's turn of the same round, which the machine's speed modes (1.5-3x,
for seconds at a time) move less; "in op", the same pairing of the op's own
run on rank 0 (get_stats' seconds per call over the turn: the call less
torch's part and collx's glue). Before the turns, float32 ops run until
auto has settled its choice for the size (at most --settle-s).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import torchcollx
from bench_common import interleaved_turns, paired_ratio, parse_size, run_ops, stats_gained

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64K,1M,16M")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--time-per-turn", type=float, default=0.1, help="seconds of ops per turn")
    p.add_argument("--settle-s", type=float, default=10.0, help="most seconds of warm-up for auto to settle")
    args = p.parse_args()
    dist.init_process_group("gloo")
    group = dist.new_group(backend="collx")
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"n={n}, SUM in place, equal bytes per dtype; median of {args.rounds} interleaved turns, max over ranks")
        print("| bytes | float32 us | bfloat16 us | float16 us | bf16/fp32 | fp16/fp32 | bf16/fp32 paired | "
              "fp16/fp32 paired | bf16/fp32 in op | fp16/fp32 in op |")
        print("|---" * 10 + "|")
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        bufs = {}
        for name, dt in DTYPES.items():
            t = torch.full((nbytes // t_size(dt),), float(rank + 1), dtype=dt)
            dist.all_reduce(t, group=group)
            assert bool((t == n * (n + 1) / 2).all()), f"{name} at {nbytes} B: wrong sum"
            bufs[name] = t
        # auto settles its choice for the size (shared by the dtypes: it is keyed by bytes) before the turns.
        backend = group._get_backend(torch.device("cpu"))
        start = time.perf_counter()
        while time.perf_counter() - start < args.settle_s:
            run_ops(group, bufs["float32"], 20)
            settling = torch.tensor([float(backend.refining(nbytes))])
            dist.all_reduce(settling, op=dist.ReduceOp.MAX)
            if not settling.item():
                break
        # Ops per turn from float32's pace, alike on every rank.
        ts = run_ops(group, bufs["float32"], 5)
        per_op = torch.tensor([(ts[-1] - ts[0]) / 5])
        dist.all_reduce(per_op, op=dist.ReduceOp.MAX)
        k = max(5, min(2000, int(args.time_per_turn / per_op.item())))

        in_op = {name: [] for name in bufs}  # this rank's, per turn

        def turn(name):
            run_ops(group, bufs[name], 1)
            before = torchcollx.get_stats(group)["algorithms"]
            ts = run_ops(group, bufs[name], k)
            ran = stats_gained(before, torchcollx.get_stats(group)["algorithms"]).values()
            in_op[name].append(sum(v["seconds"] for v in ran) / k)
            return (ts[-1] - ts[0]) / k
        turns = interleaved_turns({name: (lambda name=name: turn(name)) for name in bufs}, args.rounds)
        if rank == 0:
            f32, bf, fp = (statistics.median(turns[d]) * 1e6 for d in DTYPES)
            print(f"| {nbytes} | {f32:.1f} | {bf:.1f} | {fp:.1f} | {bf / f32:.2f} | {fp / f32:.2f} | "
                  f"{paired_ratio(turns, 'bfloat16', 'float32'):.2f} | {paired_ratio(turns, 'float16', 'float32'):.2f} | "
                  f"{paired_ratio(in_op, 'bfloat16', 'float32'):.2f} | {paired_ratio(in_op, 'float16', 'float32'):.2f} |")
    dist.destroy_process_group()


def t_size(dtype):
    return torch.tensor([], dtype=dtype).element_size()


if __name__ == "__main__":
    main()
