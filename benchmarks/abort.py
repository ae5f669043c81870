"""How fast an abort takes effect, collx beside gloo in one run.

    python benchmarks/abort.py [--ranks 3] [--trials 5]

The last rank never joins an all_reduce that the others have in flight; after
0.2 s rank 0 calls _abort_process_group(). Measured from that call: when it
returns on rank 0, when rank 0's in-flight wait() raises, and when the other
ranks' wait() raises (they did not abort; they learn it from rank 0). gloo
has no way to tell its peers; there the last rank leaves after --timeout
(10 s by default), which ends the waits that nothing else ends.
"""
import argparse
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchcollx  # noqa: F401


def worker(rank, world, port, backend, timeout, out):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    dist.all_reduce(torch.ones(4))
    if rank == world - 1:
        try:
            store.wait(["done"], timedelta(seconds=timeout))  # then it leaves, which ends gloo's waits
        except Exception:
            pass
        return
    work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    time.sleep(0.2)
    if rank == 0:
        t0 = time.time()
        store.set("abort_at", repr(t0))
        dist.distributed_c10d._abort_process_group()
        out[f"{backend}/returned"] = time.time() - t0
    else:
        store.wait(["abort_at"])
    try:
        work.wait()
    except Exception:
        pass
    raised = time.time()
    if rank == 0:
        out[f"{backend}/abort"] = raised - float(store.get("abort_at"))
    store.set(f"raised/{rank}", repr(raised))
    if rank == 0:
        peers = [float(store.get(f"raised/{r}")) for r in range(1, world - 1)]
        out[f"{backend}/peers"] = max(peers) - float(store.get("abort_at")) if peers else 0.0
        store.set("done", "1")


def trial(backend, ranks, timeout):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    procs = [ctx.Process(target=worker, args=(r, ranks, store.port, backend, timeout, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout + 60)
        if p.is_alive():
            p.kill()
    return out[f"{backend}/returned"], out[f"{backend}/abort"], out[f"{backend}/peers"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args()
    if args.ranks < 3:
        sys.exit("needs 3 ranks or more: one aborts, one hears of it, one never joins")
    runs = {b: [] for b in ("collx", "gloo")}
    for _ in range(args.trials):
        for b in runs:
            runs[b].append(trial(b, args.ranks, args.timeout))
    print(f"abort with an all_reduce in flight, {args.ranks} ranks, {args.trials} trials, median (max), "
          f"group timeout {args.timeout:.0f} s; {time.strftime('%Y-%m-%d')}")
    for b, r in runs.items():
        cols = [[x[i] * 1e3 for x in r] for i in range(3)]
        print(f"  {b:6s} " + "; ".join(f"{what} {statistics.median(c):8.1f} ms ({max(c):.1f})" for what, c in zip(
            ("abort returns", "its wait raises", "a peer's wait raises"), cols)))


if __name__ == "__main__":
    main()
