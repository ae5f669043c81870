"""collx's own cost of a call (its glue), beside torch's: one process, a
one-rank group of collx and one of torch's fake backend (which completes an
all_reduce at once and moves nothing), the same calls on each, back to back:

  dist.all_reduce         as users call it (Python's torch.distributed)
  group.allreduce().wait()  torch's C++ ProcessGroup straight from Python,
                          a synchronous op (asyncOp False): its dispatcher
                          op, the backend and the Work
  backend.allreduce().wait()  the backend itself, past the dispatcher

Each figure is the best of --rounds timed loops of --calls calls (a one-rank
op moves no byte, so the best loop is the one the machine interrupted least),
us per call; "glue" is collx's less fake's. Runs in one process so that both
groups see the same machine state; for an older build beside this one, run
it again with that build on PYTHONPATH.

    .venv/bin/python benchmarks/call_cost.py [--calls 50000] [--rounds 5]
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import fake_pg  # noqa: F401  (registers the "fake" backend)

import torchcollx  # noqa: F401  (registers collx)


def best_us(call, calls, rounds):
    for _ in range(calls // 10):
        call()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=50000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29741")
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(1)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    rows = {}
    for backend in ("fake", "collx"):
        group = dist.new_group(backend=backend)
        pg = group._get_backend(torch.device("cpu"))
        rows[backend] = (best_us(lambda: dist.all_reduce(t, group=group), args.calls, args.rounds),
                         best_us(lambda: group.allreduce([t], opts).wait(), args.calls, args.rounds),
                         best_us(lambda: pg.allreduce([t], opts).wait(), args.calls, args.rounds))
    print("us per call, a one-rank group, 4-byte float32 all_reduce, best of", args.rounds, "loops of", args.calls)
    print("| call | torch (fake) | collx | glue |")
    print("|---|---|---|---|")
    for i, name in enumerate(("dist.all_reduce", "group.allreduce().wait()", "backend.allreduce().wait()")):
        fake, collx = rows["fake"][i], rows["collx"][i]
        print(f"| {name} | {fake:.2f} | {collx:.2f} | {collx - fake:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
