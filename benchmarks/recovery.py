"""Time from a rank's SIGKILL to the next completed training step, by recovery path.

    python benchmarks/recovery.py [--ranks 4] [--trials 3]

One run measures, on the same machine:
  collx shrink      survivors catch the error, dist.shrink_group([dead]), rebuild DDP, redo the step
  collx reconfigure collx created with enable_reconfigure; survivors catch the error, exchange fresh
                    handles in the store, dist._reconfigure, rebuild DDP, redo the step
  gloo reconfigure  gloo created with enable_reconfigure; survivors catch the error, exchange fresh
                    handles in the store, dist._reconfigure, rebuild DDP, redo the step
  restart           what torchrun --max-restarts does: the supervisor kills the survivors, starts
                    ranks-1 new processes, which init_process_group (collx), load the checkpoint
                    of the last step and run the next step

Each rank trains the MLP of examples/elastic.py with DDP; the victim kills
itself inside step --kill-step. A supervisor (this process) hosts the
TCPStore, watches the ranks and names the dead one in the store, as an
elastic agent would. The time runs from the victim's kill to the end of the
first step completed after it on every survivor (the slowest survivor).
"""
import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchcollx  # noqa: F401

GROUP_TIMEOUT = 20  # seconds; a failure that only a timeout reveals shows as ~this
KILL_STEP = 5
STEPS = 8


def batch(step, rank, n=64, dim=32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, dim, generator=g)
    return x, (x.sum(1, keepdim=True) > 0).float()


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def exchange_handles(store, gen, rank, members):
    """gloo's reconfigure handles of `members` (old ranks), through the store."""
    store.set(f"handle/{gen}/{rank}", dist.distributed_c10d._get_reconfigure_handle())
    return [store.get(f"handle/{gen}/{r}").decode() for r in members]


def worker(rank, world, port, mode, victim, ckpt, start_step):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    backend = "gloo" if mode == "gloo-reconfigure" else "collx"
    reconfigures = mode.endswith("reconfigure")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT),
                            enable_reconfigure=reconfigures)
    if reconfigures:
        dist.distributed_c10d._reconfigure(1, exchange_handles(store, 1, rank, range(world))).wait()
    model = make_model()
    if start_step > 0:
        model.load_state_dict(torch.load(ckpt))
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.BCEWithLogitsLoss()
    step, recovering = start_step, start_step > 0
    while step < STEPS:
        x, y = batch(step, rank)
        try:
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            if rank == victim and step == KILL_STEP and start_step == 0:
                store.set("killed_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            opt.step()
        except (dist.DistBackendError, RuntimeError):
            store.set(f"failed/{rank}", repr(time.time()))
            if mode == "restart":
                time.sleep(3600)  # as under torchrun: the supervisor kills the survivors
            store.wait(["dead"])
            dead = int(store.get("dead"))
            t0 = time.time()
            if mode == "collx-shrink":
                dist.shrink_group([dead])
            else:
                members = [r for r in range(world) if r != dead]
                dist.distributed_c10d._reconfigure(2, exchange_handles(store, 2, rank, members)).wait()
            store.set(f"regroup/{rank}", repr(time.time() - t0))
            ddp = DDP(model)
            recovering = True
            continue
        if recovering:
            store.set(f"recovered/{rank}", repr(time.time()))
            recovering = False
        if mode == "restart" and dist.get_rank() == 0:
            torch.save(model.state_dict(), ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        step += 1
    dist.destroy_process_group()


def trial(mode, ranks, victim):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ckpt = os.path.join(tempfile.mkdtemp(prefix="collx-recovery-"), "model.pt")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, ranks, store.port, mode, victim, ckpt, 0)) for r in range(ranks)]
    for p in procs:
        p.start()
    deadline = time.time() + 120
    while procs[victim].exitcode is None and time.time() < deadline:
        time.sleep(0.001)
    store.set("dead", str(victim))
    survivors = [r for r in range(ranks) if r != victim]
    if mode == "restart":
        for r in survivors:
            procs[r].kill()
        for r in survivors:
            procs[r].join()
        store2 = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store2.set("killed_at", store.get("killed_at"))
        store, survivors = store2, list(range(ranks - 1))
        procs = [ctx.Process(target=worker, args=(r, ranks - 1, store.port, mode, -1, ckpt, KILL_STEP))
                 for r in survivors]
        for p in procs:
            p.start()
    for r in survivors:
        procs[r].join(max(1.0, deadline - time.time()))
        if procs[r].exitcode != 0:
            raise RuntimeError(f"{mode}: rank {r} ended with {procs[r].exitcode}")
    killed = float(store.get("killed_at"))
    total = max(float(store.get(f"recovered/{r}")) for r in survivors) - killed
    if mode == "restart":
        return total, None, None
    failed = max(float(store.get(f"failed/{r}")) for r in survivors) - killed
    regroup = max(float(store.get(f"regroup/{r}")) for r in survivors)
    return total, failed, regroup


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--modes", default="collx-shrink,collx-reconfigure,gloo-reconfigure,restart")
    args = p.parse_args()
    modes = args.modes.split(",")
    runs = {m: [] for m in modes}
    for t in range(args.trials):
        for m in modes:  # interleaved, so that drifts of the machine hit every mode alike
            runs[m].append(trial(m, args.ranks, victim=args.ranks // 2))
    med = {m: statistics.median(r[0] for r in runs[m]) for m in modes}
    print(f"kill -> next completed step, {args.ranks} ranks -> {args.ranks - 1}, {args.trials} trials, "
          f"median (min-max); {time.strftime('%Y-%m-%d')}")
    print(f"  {'path':17s} {'total':>20s} {'all failed by':>14s} {'regroup call':>13s} {'restart/this':>13s}")
    for m in modes:
        total = [r[0] for r in runs[m]]
        ms = lambda v: f"{v * 1e3:.1f}" if v is not None else "-"  # noqa: E731
        failed = statistics.median(r[1] for r in runs[m]) if runs[m][0][1] is not None else None
        regroup = statistics.median(r[2] for r in runs[m]) if runs[m][0][2] is not None else None
        ratio = f"{med['restart'] / med[m]:.1f}x" if "restart" in med else "-"
        print(f"  {m:17s} {ms(med[m]):>8s} ({ms(min(total))}-{ms(max(total))}) {ms(failed):>10s} ms "
              f"{ms(regroup):>9s} ms {ratio:>13s}")


if __name__ == "__main__":
    main()
