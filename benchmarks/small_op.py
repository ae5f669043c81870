"""Where a small collective's time goes: torch's per-call floor, collx's op,
and the wait for the peers (issue 35, item 2).

For each setting it runs three torchrun jobs, each timing back-to-back calls of each
op (dist.all_reduce by default; --ops adds all_gather_single,
reduce_scatter_single and broadcast) and size on a collx group (auto):

  torch      one rank on a one-rank group of torch's fake backend, which
             completes all_reduce and broadcast at once and moves nothing:
             torch's own cost of the call (Python, dispatcher, Work), the
             part no backend saves (not shown for all_gather and
             reduce_scatter, whose fake ops copy the data with tensor ops)
  n=1        one rank on a one-rank group: the floor, every layer but the peers
  n=1 x2     two ranks at once, each on its own one-rank group: the floor with
             both cores busy, as they are at n=2 (two busy vCPUs slow each
             other's every layer, torch's included)
  n=2        two ranks on one group

and prints:

  per call   wall time per call, max over ranks
  in op      the op's own run (get_stats' seconds per call of its algorithm:
             the algorithm, its waits for the peers, from the op's start on
             collx's side to its end), rank 0
  glue       the n=1 call minus torch's: collx's own cost of a call
  beyond     the n=2 call minus the n=1 call, and minus the n=1 x2 call:
             what the peer adds

Settings: as users run (the flight recorder on, torch's default), and with
TORCH_FR_BUFFER_SIZE=0 (no recorder entries).

    .venv/bin/python benchmarks/small_op.py [--sizes 4,4K,64K] [--seconds 2]
    .venv/bin/python benchmarks/small_op.py --ops all_gather,reduce_scatter --settings default

The size is the larger buffer's bytes (all_gather's output, reduce_scatter's
input), rounded down to whole blocks of the group's size.
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import torchcollx
from torch.testing._internal.distributed import fake_pg  # noqa: F401  (registers the "fake" backend)
from bench_common import agreed_max, parse_size, stats_gained, torchrun_json


OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def call_of(op, nbytes, n, group):
    """The call that times `op` on a buffer of `nbytes` (the larger one)."""
    count = max(n, nbytes // 4 // n * n)
    if op == "all_reduce":
        t = torch.ones(count)
        return lambda: dist.all_reduce(t, group=group)
    if op == "all_gather":
        inp, out = torch.ones(count // n), torch.empty(count)
        return lambda: dist.all_gather_single(out, inp, group=group)
    if op == "reduce_scatter":
        inp, out = torch.ones(count), torch.empty(count // n)
        return lambda: dist.reduce_scatter_single(out, inp, group=group)
    t = torch.ones(count)
    return lambda: dist.broadcast(t, group=group, group_src=0)


def worker(args):
    dist.init_process_group("gloo")
    fake = args.backend == "fake"
    if args.alone:  # every rank on a one-rank group of its own
        groups = [dist.new_group([r], backend=args.backend) for r in range(dist.get_world_size())]
        group = groups[dist.get_rank()]
    else:
        group = dist.new_group(backend=args.backend)
    backend = group._get_backend(torch.device("cpu"))
    n = dist.get_world_size(group)
    rows = []
    for op in args.ops.split(","):
        for nbytes in (parse_size(s) for s in args.sizes.split(",")):
            call = call_of(op, nbytes, n, group)
            for _ in range(100):  # past auto's trials of this size, alike on every rank
                for _ in range(500):
                    call()
                if fake or op != "all_reduce" or not agreed_max(float(backend.refining(nbytes))):
                    break
            # One timed run of a count of calls agreed beforehand: an agreement
            # (a gloo op) inside it would cost the timed calls more than the
            # agreement itself, since it leaves gloo's threads busy for a while.
            start = time.perf_counter()
            for _ in range(2000):
                call()
            ops = int(agreed_max(args.seconds / ((time.perf_counter() - start) / 2000)))
            before = {} if fake else torchcollx.get_stats(group)["algorithms"]
            start = time.perf_counter()
            for _ in range(ops):
                call()
            per_call = agreed_max((time.perf_counter() - start) / ops * 1e6)
            ran = {} if fake else stats_gained(before, torchcollx.get_stats(group)["algorithms"])
            calls = sum(v["calls"] for v in ran.values())
            secs = sum(v["seconds"] for v in ran.values())
            rows.append({"op": op, "bytes": nbytes, "per_call_us": per_call,
                         "in_op_us": secs / calls * 1e6 if calls else float("nan"),
                         "algorithms": sorted(k.split("/")[-1] for k in ran)})
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run(n, env, args, out, alone=False, backend="collx"):
    return torchrun_json(Path(__file__).resolve(), n, ["--worker", "--ops", args.ops, "--sizes", args.sizes,
                                                       "--seconds", str(args.seconds), "--backend", backend]
                         + ["--alone"] * alone, out, env=env)


SETTINGS = {"default": ("recorder on (default)", {}),
            "no-recorder": ("TORCH_FR_BUFFER_SIZE=0", {"TORCH_FR_BUFFER_SIZE": "0"})}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="all_reduce", help=f"comma-separated, of {','.join(OPS)}")
    p.add_argument("--sizes", default="4,4K,64K")
    p.add_argument("--seconds", type=float, default=2.0, help="timed seconds per size")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {','.join(SETTINGS)}")
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="collx", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    print("us per call; 'in op': the op's run on collx's side (get_stats), rank 0")
    print("| setting | op | bytes | torch per call | n=1 per call | glue | n=1 in op | n=1 x2 per call "
          "| n=2 per call | n=2 in op | n=2 algorithm | beyond n=1 | beyond n=1 x2 |")
    print("|---" * 13 + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, env in (SETTINGS[s] for s in args.settings.split(",")):
            torch_floor = run(1, env, args, f"{tmp}/fake.json", backend="fake")
            one = run(1, env, args, f"{tmp}/one.json")
            loaded = run(2, env, args, f"{tmp}/loaded.json", alone=True)
            two = run(2, env, args, f"{tmp}/two.json")
            for f, a, l, b in zip(torch_floor, one, loaded, two):
                pure = b["op"] in ("all_reduce", "broadcast")  # the fake ops that move nothing
                floor, glue = (f"{f['per_call_us']:.2f}", f"{a['per_call_us'] - f['per_call_us']:.2f}") if pure \
                    else ("-", "-")
                print(f"| {label} | {b['op']} | {a['bytes']} | {floor} | {a['per_call_us']:.2f} | {glue} | "
                      f"{a['in_op_us']:.2f} | "
                      f"{l['per_call_us']:.2f} | {b['per_call_us']:.2f} | {b['in_op_us']:.2f} | "
                      f"{'/'.join(b['algorithms'])} | {b['per_call_us'] - a['per_call_us']:.2f} | "
                      f"{b['per_call_us'] - l['per_call_us']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
