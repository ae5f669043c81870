"""How fast auto's all-reduce is from the first op: a job's first run and its
second run on the same machine (issue 35, item 3).

Each repeat makes a fresh calibration cache and runs the same torchrun job
twice against it. In each run, one collx group (auto, as users make it) does:

  first   the group's first all-reduce (4 B), timed apart: it carries the
          ranks' skew after creation and the process's first call, not a size's;
  cold    at each size in turn, the first --ops all-reduces (dist.all_reduce),
          timed as a whole: what a short job or a user's benchmark pays;
          and as many on each of the forced groups (one per algorithm,
          torchcollx.Options(algorithm=...), set up with the auto group),
          after auto's at every other size and before it at the others
          (which alternates from repeat to repeat): what runs a size first
          pays the machine's first ops of it (caches, pages);
  settle  more ops of each size until auto stops refining (or --settle-s);
  warm    interleaved rounds of --ops ops each (fewer at large sizes): the
          auto group and the forced ones.

The table gives, per size and run, the medians over repeats of the cold
mean per op over the warm one (target: the second run <= 1.1), of the
cold mean over the best forced algorithm's warm time, and over its cold
time (target <= 1.10): beside auto's cold ops of a size, each forced
group runs as many ops of that size, in the same phase of the job, so that
the job's own warming up (the machine's, the process's) weighs on both;
"cold/kept cold" compares with the forced group of the algorithm auto kept,
where the best of five groups' cold times would favour the luckiest.
Times are per op, the max over ranks.

This machine's speed comes in modes that a job can enter and leave at any
time (an all-reduce of 1 MiB in 140 us or in 470 us, for seconds at a time,
MPI's alike), so the cold and warm phases of one run may differ by the mode
alone. What auto's trials cost is measured apart, within the cold ops:
"trial excess" sums, over the cold ops of the algorithms the class did not
keep, their time over the kept algorithm's mean in the same ops (rank 0's
in-op times, from get_stats), in ops of the kept algorithm; "x" is the
cold ops' time over what they would have taken at that mean. A job's x
moves with the machine's spells, so each repeat's is listed too, and
--first-only runs first runs alone, for more of them in the time.

    .venv/bin/python benchmarks/cold_start.py --ranks 2 --repeats 3
    .venv/bin/python benchmarks/cold_start.py --ranks 2 --repeats 12 --first-only
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import torchcollx
from bench_common import (agreed_max, cache_runs, interleaved_medians, parse_size, run_ops, stats_gained,
                          torchrun_json)


def worker(args):
    dist.init_process_group("gloo")
    group = dist.new_group(backend="collx")
    line = dist.new_group(backend="collx")
    backend = group._get_backend(torch.device("cpu"))
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    bufs = {b: torch.ones(b // 4) for b in sizes}
    ts = run_ops(group, torch.ones(1), 1)
    group_first_us = agreed_max((ts[1] - ts[0]) * 1e6)
    forced = ["ring", "tree", "star", "direct"] + (["shm"] if "shared memory" in backend.transport else [])
    groups = {"auto": group, **{a: dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=a))
                                for a in forced}}
    rows = []
    tiny = torch.ones(1)
    for g in groups.values():  # every group set up before any size's cold ops
        run_ops(g, tiny, 20)

    def cold(g, b):
        # The ranks leave gloo's agreement and get_stats up to hundreds of us
        # apart. Two small all-reduces on a group of their own line them up
        # (a broadcast would not: its root does not wait), so that the size's
        # first op does not wait out the benchmark's own skew, and the
        # group's stats hold the size's ops only.
        for _ in range(2):
            dist.all_reduce(tiny, group=line)
        return run_ops(g, bufs[b], args.ops)

    def mean_us(ts):
        return agreed_max((ts[-1] - ts[0]) / args.ops * 1e6)

    for i, b in enumerate(sizes):  # cold: the first ops of each size, auto's and each forced algorithm's
        # Whatever runs a size first pays the machine's first ops of it
        # (caches, pages): auto goes first at every other size, by --order,
        # and the forced groups first at the others.
        auto_first = (i + args.order) % 2 == 0
        forced_cold = {} if auto_first else {a: mean_us(cold(groups[a], b)) for a in forced}
        before = torchcollx.get_stats(group)["algorithms"]
        ts = cold(group, b)
        gained = stats_gained(before, torchcollx.get_stats(group)["algorithms"])
        if auto_first:
            forced_cold = {a: mean_us(cold(groups[a], b)) for a in forced}
        rows.append({"bytes": b, "cold_us": mean_us(ts), "first_op_us": agreed_max((ts[1] - ts[0]) * 1e6),
                     "auto_first": auto_first,
                     "cold_ops": {k: v for k, v in gained.items() if k.startswith("all_reduce/")},
                     "forced_cold_us": forced_cold})
    for row in rows:  # settle: every rank stops at the same op, by the agreed flags
        b, start = row["bytes"], time.perf_counter()
        while True:
            run_ops(group, bufs[b], 20)
            still, late = agreed_max(float(backend.refining(b)), float(time.perf_counter() - start > args.settle_s))
            if not still or late:
                row["settled"] = not still
                break
        row["trial_excess_ops"] = trial_excess(row["cold_ops"], backend.choose_allreduce(b))
    for row in rows:
        b = row["bytes"]
        k = max(10, min(args.ops, int(0.15e6 / row["cold_us"])))
        warm = interleaved_medians(groups, bufs[b], args.rounds, k)
        row["warm_us"] = warm["auto"] * 1e6
        row["forced_us"] = {a: warm[a] * 1e6 for a in forced}
        row["chose"] = backend.choose_allreduce(b)
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps({"rows": rows, "tuning": backend.tuning,
                                               "group_first_us": group_first_us}))
    dist.destroy_process_group()


def trial_excess(ops, kept):
    """The time the ops of algorithms other than `kept` took over as many of
    kept's mean op among `ops` (stats_gained's), in ops of kept; 0 where kept did
    not run among them."""
    k = ops.get(f"all_reduce/{kept}")
    if not k:
        return 0.0
    kept_s = k["seconds"] / k["calls"]
    return sum(v["seconds"] - v["calls"] * kept_s for a, v in ops.items() if a != f"all_reduce/{kept}") / kept_s


def run_job(args, cache, order, out):
    return torchrun_json(Path(__file__).resolve(), args.ranks,
                         ["--worker", "--sizes", args.sizes, "--ops", str(args.ops), "--settle-s", str(args.settle_s),
                          "--rounds", str(args.rounds), "--order", str(order)], out, env={"XDG_CACHE_HOME": cache})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="4K,64K,1M,16M")
    p.add_argument("--ops", type=int, default=100, help="cold ops per size, and most ops per warm turn")
    p.add_argument("--settle-s", type=float, default=8.0, help="most seconds of ops per size to settle")
    p.add_argument("--rounds", type=int, default=5, help="interleaved warm rounds")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--first-only", action="store_true", help="run no second runs: only what the trials cost")
    p.add_argument("--order", type=int, default=0, help="(worker) 1: the forced groups go first at even sizes")
    p.add_argument("--json", help="(worker) where rank 0 writes its rows")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    runs = cache_runs(args.repeats, lambda cache, order, out: run_job(args, cache, order, out),
                      ("first",) if args.first_only else ("first", "second"))
    last = list(runs.values())[-1][-1]["tuning"]
    print(f"n={args.ranks}, float32 SUM; first {args.ops} ops per size, cold; medians over {args.repeats} repeats; "
          "us per op, max over ranks")
    print("| run | bytes | cold mean | first op | warm auto | best forced (warm) | best forced (cold) | cold/warm | "
          "cold/best | cold/best cold | cold/kept cold | warm/best | trial excess (ops) | x | settled |")
    print("|---" * 15 + "|")
    for label, reps in runs.items():
        for j, row in enumerate(reps[0]["rows"]):
            def med(f):
                return statistics.median(f(r["rows"][j]) for r in reps)
            best = med(lambda r: min(r["forced_us"].values()))
            names = sorted({min(r["rows"][j]["forced_us"], key=r["rows"][j]["forced_us"].get) for r in reps})
            best_cold = med(lambda r: min(r["forced_cold_us"].values()))
            cold_names = sorted({min(r["rows"][j]["forced_cold_us"], key=r["rows"][j]["forced_cold_us"].get)
                                 for r in reps})
            print(f"| {label} | {row['bytes']} | {med(lambda r: r['cold_us']):.1f} | "
                  f"{med(lambda r: r['first_op_us']):.1f} | {med(lambda r: r['warm_us']):.1f} | "
                  f"{best:.1f} ({'/'.join(names)}) | {best_cold:.1f} ({'/'.join(cold_names)}) | "
                  f"{med(lambda r: r['cold_us'] / r['warm_us']):.2f} | "
                  f"{med(lambda r: r['cold_us'] / min(r['forced_us'].values())):.2f} | "
                  f"{med(lambda r: r['cold_us'] / min(r['forced_cold_us'].values())):.2f} | "
                  f"{med(lambda r: r['cold_us'] / r['forced_cold_us'].get(r['chose'], float('nan'))):.2f} | "
                  f"{med(lambda r: r['warm_us'] / min(r['forced_us'].values())):.2f} | "
                  f"{med(lambda r: r['trial_excess_ops']):.1f} | "
                  f"{med(lambda r: 1 + r['trial_excess_ops'] / args.ops):.3f} | "
                  f"{sum(r['rows'][j].get('settled', False) for r in reps)}/{len(reps)} |")
    for j, row in enumerate(runs["first"][0]["rows"]):
        xs = sorted(1 + r["rows"][j]["trial_excess_ops"] / args.ops for r in runs["first"])
        print(f"first run, {row['bytes']} B: x of each repeat " + ", ".join(f"{x:.3f}" for x in xs))
    for label, reps in runs.items():  # the order's own effect: auto's ratio where it ran a size first, and after
        for j, row in enumerate(reps[0]["rows"]):
            by = {True: [], False: []}
            for r in reps:
                x = r["rows"][j]
                by[x["auto_first"]].append(x["cold_us"] / x["forced_cold_us"].get(x["chose"], float("nan")))
            print(f"{label} run, {row['bytes']} B: cold/kept cold with auto first "
                  + ", ".join(f"{v:.2f}" for v in sorted(by[True])) + "; after the forced groups "
                  + ", ".join(f"{v:.2f}" for v in sorted(by[False])))
    for label, reps in runs.items():
        print(f"{label} run: the group's first 4-byte all-reduce took "
              f"{statistics.median(r['group_first_us'] for r in reps):.0f} us (median)")
    print(f"\n{list(runs)[-1]} run's last tuning: {last}")


if __name__ == "__main__":
    main()
