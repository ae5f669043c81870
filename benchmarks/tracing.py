"""What collx's tracing costs an all-reduce (issue 32): 4 B and 1 MiB,
float32, warm, n=2 by default.

Four collx groups live in one launch of the ranks: two made with
COLLX_TRACING=0 (no flight-recorder entry, no profiler check: the
baseline) and two as users make them. Their ops take turns in shuffled rounds
(bench_common.interleaved_medians), so the ratio compares them under the
same machine state; two launches of the same build differ by up to ±10%
here. Each setting of the process is its own launch:

  fr-off     TORCH_FR_BUFFER_SIZE=0 and no profiler: the hooks, idle
  no-stack   the flight recorder on, without the callers' Python stacks
             (COLLX_FR_STACK=0)
  default    the flight recorder on (2000 entries, as torch's and gloo's)
  (A/A)      fr-off's launch, the second baseline group against the
             first: the noise of the method

Usage: python benchmarks/tracing.py [--launches 3] [--rounds 15] [--ranks 2]
"""
import argparse
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_common import interleaved_medians

SETTINGS = {
    "fr-off": {"TORCH_FR_BUFFER_SIZE": "0"},
    "no-stack": {"COLLX_FR_STACK": "0"},
    "default": {},
}
SIZES = {"4 B": (1, 2000), "1 MiB": (1 << 18, 40)}  # float32 elements, ops per turn
KNOBS = ("COLLX_TRACING", "TORCH_FR_BUFFER_SIZE", "COLLX_FR_STACK")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(tracing):
    os.environ["COLLX_TRACING"] = "1" if tracing else "0"  # read when the group is made
    try:
        return dist.new_group(backend="collx")
    finally:
        os.environ.pop("COLLX_TRACING", None)


def _rank(rank, ws, port, rounds, queue):
    import torchcollx  # noqa: F401  (registers collx, in the spawned child)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    # Made in the order B T T B: a group's place in the process (its memory,
    # its shared segments) moves its time by up to 2%, alike for both kinds.
    groups = {"baseline": _group(False), "traced": _group(True), "traced again": _group(True),
              "baseline again": _group(False)}
    out = {}
    for label, (numel, k) in SIZES.items():
        buf = torch.ones(numel)
        for g in groups.values():  # warm: calibration and refinement behind us
            for _ in range(max(k, 200)):
                dist.all_reduce(buf, group=g)
        out[label] = interleaved_medians(groups, buf, rounds, k)
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def launch(setting, ws, rounds):
    saved = {k: os.environ.pop(k, None) for k in KNOBS}
    os.environ.update(SETTINGS[setting])
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, ws, port, rounds, queue)) for r in range(ws)]
        for p in procs:
            p.start()
        result = queue.get(timeout=600)
        for p in procs:
            p.join(60)
        return result
    finally:
        for k in KNOBS:
            os.environ.pop(k, None)
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    rows = {s: {label: [] for label in SIZES} for s in list(SETTINGS) + ["(A/A)"]}
    base = {label: [] for label in SIZES}
    for i in range(args.launches):
        for s in SETTINGS:
            res = launch(s, args.ranks, args.rounds)
            for label, t in res.items():
                baseline = t["baseline"] + t["baseline again"]
                rows[s][label].append((t["traced"] + t["traced again"]) / baseline)
                base[label].append(baseline / 2 * 1e6)
                if s == "fr-off":
                    rows["(A/A)"][label].append(t["baseline again"] / t["baseline"])
        print(f"launch {i + 1}/{args.launches} done", file=sys.stderr)
    print(f"n={args.ranks}, {args.launches} launches per setting, {args.rounds} shuffled rounds each; baseline "
          + ", ".join(f"{label} {statistics.median(base[label]):.1f} us" for label in SIZES))
    print(f"| setting | {' | '.join(f'time vs baseline, {label}' for label in SIZES)} |")
    print("|---" * (1 + len(SIZES)) + "|")
    for s, by in rows.items():
        cells = [f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})" for r in by.values()]
        print(f"| {s} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
