"""DDP training step time: gloo against collx, with and without the collx comm hook.

    torchrun --nproc_per_node=2 benchmarks/ddp_step.py [--steps 20] [--rounds 5] [--batch 32] [--fp16]

One job, the same model (by default an MLP 1024-2048 with 3 blocks: 10.5 M
float32 parameters, 42 MB of gradients per step, so that communication
matters), the same initial weights and the same per-rank batch for every
configuration:

  gloo                     DDP on a gloo group, DDP's default hook
  collx                    DDP on the collx world group, DDP's default hook (shared memory
                           between the local ranks: COLLX_TRANSPORT=auto)
  collx (tcp)              the same on a collx group forced onto TCP (transport="tcp")
  collx + hook auto        torchcollx.ddp.comm_hook, algorithm="auto"
  collx + hook bf16        comm_hook with compression="bf16"
  collx + hook cauto       comm_hook with compression="auto" (bf16 where the fitted model says it pays)
  (collx + hook fp16 with --fp16)
  no DDP (compute)         the same step without DDP: the floor of the others

A step is zero_grad + forward + backward + SGD step, timed on every rank from a
common start (a gloo barrier); a step's time is the slowest rank's. The
configurations take turns step by step (each round: --warmup untimed steps of
each, then --steps timed steps of each in turn), so that a disturbance of the
machine hits them alike. The table gives the median and mean step time and the
ratio of medians to gloo; the footer says whether the targets (hook auto <=
1.00x gloo, hook bf16 <= 0.85x gloo) are met.
Torch's own bf16_compress_hook accepts only NCCL, so gloo has no compressed row.
"""
import argparse
import copy
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchcollx  # registers the "collx" backend
from torchcollx.ddp import CommHookState, comm_hook

LOCAL = "no DDP (compute)"
TARGETS = {"collx + hook auto": 1.00, "collx + hook bf16": 0.85}


def build_model(dim, hidden, blocks, classes):
    layers = [nn.Linear(dim, hidden), nn.ReLU()]
    for _ in range(blocks - 1):
        layers += [nn.Linear(hidden, dim), nn.ReLU(), nn.Linear(dim, hidden), nn.ReLU()]
    layers += [nn.Linear(hidden, classes)]
    return nn.Sequential(*layers)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--fp16", action="store_true", help="also time the hook with fp16 compression")
    p.add_argument("--json", default=None, help="also write the results to this file (rank 0)")
    args = p.parse_args()

    dist.init_process_group("collx")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    collx = dist.group.WORLD
    collx_tcp = dist.new_group(backend="collx", pg_options=torchcollx.Options(transport="tcp"))
    torch.manual_seed(0)
    base = build_model(args.dim, args.hidden, args.blocks, 10)
    nparams = sum(q.numel() for q in base.parameters())
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch, args.dim, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    loss_fn = nn.CrossEntropyLoss()

    configs = {}  # name -> (model, optimizer, hook state or None)

    def add(name, group, state=None):
        model = copy.deepcopy(base)
        if group is not None:
            model = DDP(model, process_group=group)
        if state is not None:
            model.register_comm_hook(state, comm_hook)
        configs[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01), state)

    add("gloo", gloo)
    add("collx", collx)
    add("collx (tcp)", collx_tcp)
    add("collx + hook auto", collx, CommHookState(collx, "auto"))
    add("collx + hook bf16", collx, CommHookState(collx, "auto", compression="bf16"))
    add("collx + hook cauto", collx, CommHookState(collx, "auto", compression="auto"))
    if args.fp16:
        add("collx + hook fp16", collx, CommHookState(collx, "auto", compression="fp16"))
    add(LOCAL, None)  # the compute floor: the same step without DDP

    if rank == 0:
        print(f"DDP step time, {world} ranks, {torch.get_num_threads()} thread(s) per rank: MLP "
              f"{args.dim}-{args.hidden}x{args.blocks}, {nparams / 1e6:.2f} M params = "
              f"{nparams * 4 / 1e6:.1f} MB of float32 gradients; batch {args.batch} per rank; "
              f"{args.rounds} rounds x {args.steps} steps (+{args.warmup} warm-up) per configuration",
              flush=True)

    def step(ddp, opt):
        opt.zero_grad(set_to_none=False)
        loss_fn(ddp(x), y).backward()
        opt.step()

    times = {name: [] for name in configs}
    for rnd in range(args.rounds):
        for ddp, opt, _ in configs.values():
            for _ in range(args.warmup):
                step(ddp, opt)
        # Step by step in turn, so that a disturbance of the machine hits every
        # configuration alike; the ranks start each timed step together.
        for _ in range(args.steps):
            for name, (ddp, opt, _) in configs.items():
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                step(ddp, opt)
                times[name].append(time.perf_counter() - t0)
        if rank == 0:
            print(f"  round {rnd + 1}/{args.rounds} done", flush=True)

    # A step's time is its slowest rank's.
    names = list(configs)
    local = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=gloo)
    results = {}
    for i, name in enumerate(names):
        ts = sorted(local[i].tolist())
        results[name] = {"median_ms": 1e3 * statistics.median(ts), "mean_ms": 1e3 * statistics.fmean(ts),
                         "p10_ms": 1e3 * ts[len(ts) // 10], "p90_ms": 1e3 * ts[(9 * len(ts)) // 10]}
    ref = results["gloo"]["median_ms"]
    for r in results.values():
        r["vs_gloo"] = r["median_ms"] / ref

    hook_stats = {name: st.stats() for name, (_, _, st) in configs.items() if st is not None}
    if rank == 0:
        print(f"\n{'configuration':<20} {'median ms':>10} {'mean ms':>9} {'p10 ms':>8} {'p90 ms':>8} "
              f"{'vs gloo':>8}  samples/s")
        for name, r in results.items():
            rate = args.batch * world / (r["median_ms"] / 1e3)
            print(f"{name:<20} {r['median_ms']:>10.1f} {r['mean_ms']:>9.1f} {r['p10_ms']:>8.1f} "
                  f"{r['p90_ms']:>8.1f} {r['vs_gloo']:>7.2f}x  {rate:>9,.0f}")
        print()
        for name, s in hook_stats.items():
            algos = ", ".join(f"{a} x{c['buckets']}" for a, c in s["algorithms"].items())
            print(f"{name}: {s['buckets']} buckets, {s['bytes_in'] / 1e6:.0f} MB of gradients -> "
                  f"{s['bytes_reduced'] / 1e6:.0f} MB all-reduced ({algos})")
        verdicts = []
        for name, limit in TARGETS.items():
            got = results[name]["vs_gloo"]
            verdicts.append(f"{name} {got:.2f}x gloo (target <= {limit:.2f}x): "
                            f"{'MET' if got <= limit else 'MISSED'}")
        # compression="auto" must be at least as fast as the better of none and bf16.
        better = min(results["collx + hook auto"]["median_ms"], results["collx + hook bf16"]["median_ms"])
        got = results["collx + hook cauto"]["median_ms"] / better
        verdicts.append(f"hook cauto {got:.2f}x the better of hook auto and bf16 (target <= 1.00x): "
                        f"{'MET' if got <= 1.0 else 'MISSED'}")
        print("targets: " + "; ".join(verdicts))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": world, "params": nparams, "batch": args.batch,
                           "args": vars(args), "results": results, "hook_stats": hook_stats}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
