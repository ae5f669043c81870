"""Train a small classifier with DistributedDataParallel over collx.

    torchrun --nproc_per_node=4 examples/train_ddp.py [--steps 60] [--hook none|auto|bf16|fp16]

The data is a synthetic, learnable task generated from a fixed seed (points
from 10 Gaussian clusters in 64-D), so every run is reproducible and needs no
download. Rank 0 shows a progress line with loss, accuracy and throughput.

--hook picks how DDP averages the gradients:
  auto (default)  torchcollx.ddp.comm_hook: the all-reduce algorithm chosen per bucket by size
  bf16, fp16      the same hook, with the gradients compressed to 16 bits on the wire
  none            DDP's built-in all-reduce on the collx group
--algorithm forces ring, tree, star or direct for the hook instead of auto.

Runs on CPU, or on the GPUs when there are (--device auto); several ranks may
share one GPU.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchcollx  # noqa: F401  registers the "collx" backend
from torchcollx.ddp import CommHookState, comm_hook


def make_data(n, dim=64, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 0.35
    labels = torch.randint(0, classes, (n,), generator=g)
    points = centers[labels] + torch.randn(n, dim, generator=g)
    return points, labels


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hook", choices=["none", "auto", "bf16", "fp16"], default="auto",
                   help="gradient averaging: the collx comm hook (auto, or compressed bf16/fp16) "
                        "or none (DDP's built-in all-reduce)")
    p.add_argument("--algorithm", choices=list(torchcollx.ALGORITHMS), default="auto",
                   help="all-reduce algorithm of the hook (auto: per bucket by size)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args()

    dist.init_process_group("collx")
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
        nn.Linear(args.width, 10),
    ).to(device)
    ddp = DDP(model, device_ids=[device] if cuda else None)
    state = None
    if args.hook != "none":
        state = CommHookState(process_group=None, algorithm=args.algorithm,
                              compression=None if args.hook == "auto" else args.hook)
        ddp.register_comm_hook(state, comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    points, labels = make_data(args.batch * args.steps)
    points, labels = points.to(device), labels.to(device)
    per_rank = args.batch // world
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        how = "DDP's built-in all-reduce" if state is None else \
            f"collx comm hook (algorithm {args.algorithm}, compression {state.compression or 'none'})"
        print(f"DDP over collx on {device.type}: {world} ranks, {params / 1e6:.2f} M parameters, "
              f"global batch {per_rank * world}, {args.steps} steps; gradients: {how}")

    start = time.perf_counter()
    for step in range(args.steps):
        lo = step * args.batch + rank * per_rank
        x, y = points[lo:lo + per_rank], labels[lo:lo + per_rank]
        opt.zero_grad()
        out = ddp(x)
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        stats = torch.tensor([loss.item(), (out.argmax(1) == y).float().mean().item()])  # on the CPU
        dist.all_reduce(stats, op=dist.ReduceOp.AVG)
        if rank == 0:
            done = step + 1
            rate = done * per_rank * world / (time.perf_counter() - start)
            bar = "#" * (30 * done // args.steps)
            sys.stdout.write(f"\r[{bar:<30}] step {done:3d}/{args.steps}  loss {stats[0]:.4f}  "
                             f"acc {stats[1]:.3f}  {rate:,.0f} samples/s")
            sys.stdout.flush()
    if rank == 0:
        s = torchcollx.get_stats()
        print(f"\ncollx: {s['ops']} collectives, {s['bytes_sent'] / 1e6:.1f} MB sent by rank 0; "
              + ", ".join(f"{k} x{v['calls']}" for k, v in sorted(s["algorithms"].items())))
        if state is not None:
            h = state.stats()
            print(f"comm hook: {h['buckets']} buckets, {h['bytes_in'] / 1e6:.1f} MB of gradients -> "
                  f"{h['bytes_reduced'] / 1e6:.1f} MB all-reduced; "
                  + ", ".join(f"{a} x{c['buckets']}" for a, c in h["algorithms"].items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
