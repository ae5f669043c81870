"""Reconfigure and shrink calls, collx beside gloo in one run.

    python benchmarks/reconfigure.py [--ranks 3] [--trials 5]

Each trial starts --ranks processes with enable_reconfigure=True (collx, then
gloo), times _reconfigure forming all of them, then without the last rank,
which leaves (cleanly: no failure to detect). For collx it also times
shrink_group without the last rank on a normal group. Each time is the
slowest rank's call, from a common start (a store barrier before it).
Calibration is cached per shape, so the first trial may calibrate.
"""
import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchcollx  # noqa: F401


def timed(store, tag, rank, members, fn):
    """Runs fn after every member arrived; stores this rank's seconds."""
    store.add(f"{tag}/arrived", 1)
    while int(store.add(f"{tag}/arrived", 0)) < len(members):
        time.sleep(0.0005)
    t0 = time.perf_counter()
    fn()
    store.set(f"{tag}/{rank}", repr(time.perf_counter() - t0))


def handles(store, tag, rank, members):
    store.set(f"{tag}/handle/{rank}", dist.distributed_c10d._get_reconfigure_handle())
    return [store.get(f"{tag}/handle/{r}").decode() for r in members]


def worker(rank, world, port, backend, shrink):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    if shrink:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        dist.all_reduce(torch.ones(4))
        if rank == world - 1:
            dist.destroy_process_group()
            return
        keep = list(range(world - 1))
        timed(store, "shrink", rank, keep, lambda: dist.shrink_group([world - 1]))
        dist.all_reduce(torch.ones(4))
        dist.destroy_process_group()
        return
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, enable_reconfigure=True)
    everyone = list(range(world))
    h = handles(store, "form", rank, everyone)
    timed(store, "form", rank, everyone, lambda: dist.distributed_c10d._reconfigure(1, h).wait())
    dist.all_reduce(torch.ones(4))
    if rank == world - 1:
        dist.destroy_process_group()
        return
    keep = everyone[:-1]
    h = handles(store, "smaller", rank, keep)
    timed(store, "smaller", rank, keep, lambda: dist.distributed_c10d._reconfigure(2, h).wait())
    dist.all_reduce(torch.ones(4))
    dist.destroy_process_group()


def trial(backend, ranks, shrink):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, ranks, store.port, backend, shrink)) for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.exitcode != 0:
            raise RuntimeError(f"{backend}: a rank ended with {p.exitcode}")
    slowest = lambda tag, n: max(float(store.get(f"{tag}/{r}")) for r in range(n))  # noqa: E731
    if shrink:
        return {"shrink": slowest("shrink", ranks - 1)}
    return {"form": slowest("form", ranks), "smaller": slowest("smaller", ranks - 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    rows = {}
    for _ in range(args.trials):  # interleaved
        for name, backend, shrink in (("collx", "collx", False), ("gloo", "gloo", False), ("collx", "collx", True)):
            for what, secs in trial(backend, args.ranks, shrink).items():
                rows.setdefault((name, what), []).append(secs * 1e3)
    n = args.ranks
    labels = {"form": f"_reconfigure forming {n}", "smaller": f"_reconfigure {n} -> {n - 1}",
              "shrink": f"shrink_group {n} -> {n - 1}"}
    print(f"{args.trials} trials, slowest rank's call, median (min-max) ms; {time.strftime('%Y-%m-%d')}")
    for what in ("form", "smaller", "shrink"):
        for name in ("collx", "gloo"):
            v = rows.get((name, what))
            if v:
                print(f"  {labels[what]:26s} {name:6s} {statistics.median(v):8.2f} ({min(v):.2f}-{max(v):.2f})")


if __name__ == "__main__":
    main()
