"""How soon an op fails after dist.set_timeout, collx beside gloo in one run.

    python benchmarks/set_timeout.py [--trials 3] [--timeout 1.0]

2 ranks, group timeout 60 s. Rank 1 never joins; rank 0 calls
dist.set_timeout(--timeout) and then an all_reduce, and times how long it
takes to raise, and with what message.
"""
import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchcollx  # noqa: F401


def worker(rank, port, backend, limit, out):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        store.wait(["done"])
        return
    dist.set_timeout(timedelta(seconds=limit))
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(10))
        out["msg"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["msg"] = str(e).splitlines()[0][:120]
    out["secs"] = time.perf_counter() - t0
    store.set("done", "1")


def trial(backend, limit):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    procs = [ctx.Process(target=worker, args=(r, store.port, backend, limit, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    return out["secs"], out["msg"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1.0)
    args = p.parse_args()
    runs = {b: [] for b in ("collx", "gloo")}
    for _ in range(args.trials):
        for b in runs:
            runs[b].append(trial(b, args.timeout))
    print(f"set_timeout({args.timeout} s), then an all_reduce a peer never joins (group timeout 60 s), "
          f"{args.trials} trials, median (min-max); {time.strftime('%Y-%m-%d')}")
    for b, r in runs.items():
        secs = [x[0] for x in r]
        print(f"  {b:6s} raised after {statistics.median(secs):.3f} s ({min(secs):.3f}-{max(secs):.3f}): {r[0][1]}")


if __name__ == "__main__":
    main()
