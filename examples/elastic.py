"""Keep training when a rank dies: DDP over collx, a SIGKILL, shrink_group, go on.

    python examples/elastic.py [--ranks 4] [--steps 40] [--kill-step 15] [--victim 2]

This script is its own launcher (torchrun's agent would stop every rank when
one dies, which is what this example avoids). It hosts the job's TCPStore,
starts the ranks, and acts as their supervisor: when a rank dies it tells the
survivors which one, as an elastic agent or torchft's lighthouse would.

Each rank trains a small MLP with DDP. At --kill-step the victim SIGKILLs
itself in the middle of a step. The survivors' step fails with a
DistBackendError; each waits for the supervisor's word on who died, calls
dist.shrink_group([victim]), rebuilds DDP on the shrunk default group and
goes on from the weights of the last completed step. At the end, rank 0
prints the time from the kill to the next completed step, and the ranks
check that every survivor holds the same weights.
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchcollx  # noqa: F401  registers the "collx" backend


def batch(step, rank, n=64, dim=32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, dim, generator=g)
    return x, (x.sum(1, keepdim=True) > 0).float()


def worker(rank, world, port, args):
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("collx", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.BCEWithLogitsLoss()
    step, recovered_in = 0, None
    while step < args.steps:
        me = dist.get_rank()
        x, y = batch(step, me)
        try:
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            if rank == args.victim and step == args.kill_step:
                store.set("killed_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)  # dies inside the step, before its all-reduce
            loss.backward()  # DDP's all-reduces: a dead peer fails them here
            opt.step()
        except dist.DistBackendError as e:
            print(f"rank {rank}: step {step} failed: {str(e).splitlines()[0][:140]}", flush=True)
            store.wait(["dead"])  # the supervisor names the rank that died
            dead = int(store.get("dead"))
            old_rank = dist.get_rank()
            dist.shrink_group([dead])  # the shrunk group becomes the default group
            ddp = DDP(model)  # rebuilt on it; broadcasts rank 0's weights, which are everyone's
            print(f"rank {rank}: group shrunk without rank {dead}: rank {old_rank} -> {dist.get_rank()} "
                  f"of {dist.get_world_size()}", flush=True)
            recovered_in = step
            continue  # redo the failed step on the new group
        if recovered_in == step:
            took = time.time() - float(store.get("killed_at"))
            if dist.get_rank() == 0:
                print(f"kill -> next completed step: {took * 1e3:.0f} ms", flush=True)
        step += 1
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    same = all(torch.equal(copies[0], c) for c in copies)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} survivors finished {args.steps} steps; weights identical on all: {same}",
              flush=True)
    dist.destroy_process_group()
    sys.exit(0 if same else 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-step", type=int, default=15)
    p.add_argument("--victim", type=int, default=2)
    args = p.parse_args()
    if not 0 <= args.victim < args.ranks or args.ranks < 2:
        p.error("need at least 2 ranks and a victim among them")
    store = dist.TCPStore("127.0.0.1", 0, args.ranks + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, args.ranks, store.port, args)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    ok, deadline = True, time.time() + 120
    while any(proc.is_alive() for proc in procs) and time.time() < deadline:
        for r, proc in enumerate(procs):
            if proc.exitcode == -signal.SIGKILL and not store.check(["dead"]):
                store.set("dead", str(r))
        time.sleep(0.002)
    for r, proc in enumerate(procs):
        if proc.is_alive():
            proc.kill()
            ok = False
            print(f"rank {r} did not finish", file=sys.stderr)
        elif r != args.victim and proc.exitcode != 0:
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
