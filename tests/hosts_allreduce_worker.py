"""One rank of tests/test_hosts_allreduce.py, started by torchrun inside a
network namespace (tests/netns.py).

The default group is gloo; a collx group forces the hierarchical all-reduce
(Options(algorithm="hier")), which from kTwoLevelMinBytes is the two-level
one. For every dtype and reduce op, each rank all-reduces the same data
through gloo and through collx, and checks that collx's result equals
gloo's exactly, and is the same on every rank. The data are small integers
(products stay small), so every dtype's reductions are exact in any order.
AVG, which gloo lacks, is checked against the exact SUM over the world size.
Every rank, not only one per host, must send across hosts (TCP bytes).
all_gather and reduce_scatter (tensor and list forms, every dtype and op)
run their two-level forms on any collx group that spans hosts with several
ranks on one; they are checked against gloo's all_gather and against the
block of gloo's all-reduce, and their stats must name the hierarchical path.
Rank 0 writes "ok" or the failures to --result; every rank leaves with
os._exit, so a peer's late teardown never holds up the job. With --loop, a
collx default group runs one collective until it fails (loop_until_error).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

R = dist.ReduceOp
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int32, torch.int64, torch.uint8]
OPS = {"sum": R.SUM, "product": R.PRODUCT, "min": R.MIN, "max": R.MAX, "band": R.BAND, "bor": R.BOR,
       "bxor": R.BXOR}


def data(rank, count, dtype, op):
    i = torch.arange(count, dtype=torch.int64)
    if op == "product":
        v = (i + rank) % 2 + 1  # 1 or 2: at most 2^n
    else:
        v = (i * 3 + rank * 7) % 11
    if dtype.is_floating_point and op not in ("product",):
        v = v - 5
    return v.to(dtype)


def tcp_sent(group) -> int:
    import torchcollx

    return torchcollx.stats.get_stats(group)["carriers"].get("tcp", {}).get("bytes_sent", 0)


def check_moves(rank, n, block, collx, failures):
    """all_gather and reduce_scatter on `collx` against gloo's results."""
    import torchcollx

    for dtype in FLOATS + INTS:
        mine = data(rank, block, dtype, "sum")
        want = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(want, mine)
        got = torch.empty(n * block, dtype=dtype)
        dist.all_gather_into_tensor(got, mine, group=collx)
        listed = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(listed, mine, group=collx)
        if not torch.equal(got, torch.cat(want)) or not all(map(torch.equal, listed, want)):
            failures.append(f"rank {rank} {dtype} all_gather: differs from gloo")
        ops = ["sum", "product", "min", "max"] + ([] if dtype.is_floating_point else ["band", "bor", "bxor"])
        for op in ops:
            full = data(rank, n * block, dtype, op)
            want = full.clone()
            dist.all_reduce(want, OPS[op])
            want = want[rank * block:(rank + 1) * block]
            got = torch.empty(block, dtype=dtype)
            dist.reduce_scatter_tensor(got, full, OPS[op], group=collx)
            listed = torch.empty(block, dtype=dtype)
            dist.reduce_scatter(listed, list(full.chunk(n)), OPS[op], group=collx)
            if not torch.equal(got, want) or not torch.equal(listed, want):
                failures.append(f"rank {rank} {dtype} reduce_scatter {op}: differs from gloo's all-reduce")
        if dtype.is_floating_point:  # AVG, which gloo lacks: the exact SUM over n
            full = data(rank, n * block, dtype, "sum")
            total = data(rank, n * block, torch.float64, "sum")
            dist.all_reduce(total)
            got = torch.empty(block, dtype=dtype)
            dist.reduce_scatter_tensor(got, full, R.AVG, group=collx)
            if not torch.allclose(got.double(), total[rank * block:(rank + 1) * block] / n, rtol=1e-2, atol=1e-2):
                failures.append(f"rank {rank} {dtype} reduce_scatter avg: not the sum over {n}")
    labels = torchcollx.stats.get_stats(collx)["algorithms"]
    for label in ("all_gather/hier", "reduce_scatter/hier"):
        if label not in labels:
            failures.append(f"rank {rank}: no {label} in {sorted(labels)}")


def loop_until_error(rank, count, results, timeout, op):
    """--loop: a collx default group runs `op` (all_reduce, all_gather or
    reduce_scatter) on `count` floats until an op fails (the test cuts a link
    or kills a host); records how, and when on CLOCK_MONOTONIC (one clock
    for every namespace), in RESULTS/rank{r}.json."""
    out = {"type": None}
    try:
        dist.init_process_group("collx", timeout=datetime.timedelta(seconds=timeout))
        n = dist.get_world_size()
        block = count // n
        t = torch.ones(block * n)
        run = {"all_reduce": lambda: dist.all_reduce(t),
               "all_gather": lambda: dist.all_gather_into_tensor(t, t[:block]),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(t[:block], t.clone())}[op]
        run()
        want = {"all_reduce": n, "all_gather": 1, "reduce_scatter": n}[op]
        out["first_ok"] = torch.equal(t[:block], torch.full((block,), float(want)))
        with open(os.path.join(results, f"loop{rank}"), "w") as f:
            f.write(os.environ["NETNS_HOST"])
        start = time.monotonic()
        while time.monotonic() - start < 4 * timeout:
            t.fill_(1)
            run()
        out["message"] = f"no error in {4 * timeout} s"
    except Exception as e:  # noqa: BLE001 - recorded and judged by the test
        out = dict(out, type=type(e).__name__, dist_backend_error=isinstance(e, dist.DistBackendError),
                   message=str(e)[:2000], time=time.monotonic())
        try:  # the broken group still shuts down, and promptly
            dist.destroy_process_group()
            out["destroyed_in"] = time.monotonic() - out["time"]
        except Exception as e2:  # noqa: BLE001
            out["destroy_error"] = str(e2)[:500]
    with open(os.path.join(results, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(out, f)
    os.rename(os.path.join(results, f"rank{rank}.json.tmp"), os.path.join(results, f"rank{rank}.json"))
    sys.stderr.flush()
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--result", required=True, help="a file (checks), or a folder with --loop")
    p.add_argument("--loop", type=float, default=None, help="run --op until it fails; the group timeout, s")
    p.add_argument("--op", default="all_reduce", help="with --loop: all_reduce, all_gather or reduce_scatter")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    if args.loop is not None:
        loop_until_error(rank, args.count, args.result, args.loop, args.op)
    failures = []
    code = 0
    try:
        import torchcollx

        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", timeout=timeout)
        n = dist.get_world_size()
        collx = dist.new_group(backend="collx", timeout=timeout, pg_options=torchcollx.Options(algorithm="hier"))
        for dtype in FLOATS + INTS:
            ops = ["sum", "product", "min", "max"] + ([] if dtype.is_floating_point else ["band", "bor", "bxor"])
            for op in ops:
                want = data(rank, args.count, dtype, op)
                dist.all_reduce(want, OPS[op])
                got = data(rank, args.count, dtype, op)
                dist.all_reduce(got, OPS[op], group=collx)
                if not torch.equal(got, want):
                    bad = (got != want).nonzero()[:3].flatten().tolist()
                    failures.append(f"rank {rank} {dtype} {op}: differs from gloo at {bad}")
            if dtype.is_floating_point:
                got = data(rank, args.count, dtype, "sum")
                dist.all_reduce(got, R.AVG, group=collx)
                total = data(rank, args.count, torch.float64, "sum")
                dist.all_reduce(total)
                if not torch.allclose(got.double(), total / n, rtol=1e-2, atol=1e-2):
                    failures.append(f"rank {rank} {dtype} avg: not the sum over {n}")
            # Bit-identical on every rank: rank 0's result against each rank's.
            mine = data(rank, args.count, dtype, "sum")
            dist.all_reduce(mine, group=collx)
            first = mine.clone()
            dist.broadcast(first, 0)
            if not torch.equal(mine, first):
                failures.append(f"rank {rank} {dtype}: result differs from rank 0's")
        check_moves(rank, n, (3 * args.count // n) | 1, collx, failures)
        # Every rank, not one leader per host, sends its slice across hosts.
        before = tcp_sent(collx)
        dist.all_reduce(torch.ones(args.count), group=collx)
        crossed = tcp_sent(collx) - before
        if crossed < args.count * 4 // n:
            failures.append(f"rank {rank}: sent {crossed} B over TCP in a {args.count * 4} B all-reduce")
        outcomes = [None] * n
        dist.all_gather_object(outcomes, failures)
        failures = [f for each in outcomes for f in each]
    except Exception:  # noqa: BLE001 - reported through the file
        failures.append(f"rank {rank} raised:\n{traceback.format_exc()}")
        code = 1
    if rank == 0 or code:
        path = args.result if rank == 0 else f"{args.result}.rank{rank}"
        with open(path, "w") as f:
            f.write("\n".join(failures) if failures else "ok")
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
