"""Train a small classifier with DistributedDataParallel over collx.

    torchrun --nproc_per_node=4 examples/train_ddp.py [--steps 60] [--hook auto|none]

The data is a synthetic, learnable task generated from a fixed seed (points
from 10 Gaussian clusters in 64-D), so every run is reproducible and needs no
download. Rank 0 shows a progress line with loss, accuracy and throughput.
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchcollx  # noqa: F401  registers the "collx" backend


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
    args = p.parse_args()

    dist.init_process_group("collx")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
        nn.Linear(args.width, 10),
    )
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    points, labels = make_data(args.batch * args.steps)
    per_rank = args.batch // world
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"DDP over collx: {world} ranks, {params / 1e6:.2f} M parameters, "
              f"global batch {per_rank * world}, {args.steps} steps")

    start = time.perf_counter()
    for step in range(args.steps):
        lo = step * args.batch + rank * per_rank
        x, y = points[lo:lo + per_rank], labels[lo:lo + per_rank]
        opt.zero_grad()
        out = ddp(x)
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        stats = torch.tensor([loss.item(), (out.argmax(1) == y).float().mean().item()])
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
