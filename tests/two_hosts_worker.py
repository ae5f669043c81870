"""One rank of the two-host run (tests/test_two_hosts.py, benchmarks/two_hosts.py),
started by torchrun inside a network namespace with COLLX_SOCKET_IFNAME set to
its veth. Writes what it saw to RESULTS/rank{r}.json, then leaves with
os._exit: after the link is cut, a clean shutdown could wait on the store.

Modes:
  test   all-reduce results (ring, hier, auto), DDP, the veth bytes of ring
         and hier, then all-reduces in a loop until the test cuts the link
  bench  the veth bytes and time per op of ring and hier only
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

import torchcollx
from torchcollx.ddp import CommHookState, comm_hook

ALGOS = ("ring", "hier", "auto")
COUNTS = (0, 1, 7, 1000, 100003)


def veth_bytes() -> int:
    dev = os.environ["COLLX_SOCKET_IFNAME"]  # /sys is this namespace's (ip netns exec)
    return sum(int(open(f"/sys/class/net/{dev}/statistics/{k}").read()) for k in ("tx_bytes", "rx_bytes"))


def data(rank, count, dtype):
    """Small integers: sums are exact in every dtype used here."""
    return ((torch.arange(count, dtype=torch.int64) * 3 + rank * 7) % 11 - 5).to(dtype)


def check_allreduce(groups, rank, ws, fails):
    cases = [(torch.float32, dist.ReduceOp.SUM), (torch.float64, dist.ReduceOp.SUM), (torch.int64, dist.ReduceOp.MAX)]
    for algo, g in groups.items():
        for dtype, op in cases:
            for count in COUNTS + ((1 << 22,) if dtype == torch.float32 else ()):
                t = data(rank, count, dtype)
                dist.all_reduce(t, op=op, group=g)
                every = torch.stack([data(r, count, dtype) for r in range(ws)])
                want = every.sum(0) if op == dist.ReduceOp.SUM else every.max(0).values
                if not torch.equal(t, want.to(dtype)):
                    fails.append(f"{algo} {dtype} {op} count={count}: wrong result")
        labels = set(torchcollx.get_stats(g)["algorithms"])
        expect = {"all_reduce/" + ("hier" if algo == "auto" else algo)}
        if labels != expect:
            fails.append(f"{algo}: ran {sorted(labels)}, expected {sorted(expect)}")


def check_ddp(rank, ws, fails, hook):
    """3 SGD steps of DDP over the 4 ranks vs the same steps computed locally
    on every rank's batch (DDP averages the per-rank gradients)."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()

    def batch(r, step):
        gen = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(5, 8, generator=gen, dtype=torch.float64), torch.randn(5, 1, generator=gen, dtype=torch.float64)

    ddp = torch.nn.parallel.DistributedDataParallel(model())
    if hook:
        ddp.register_comm_hook(CommHookState(None, "auto"), comm_hook)
    ref = model()
    opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(ref(batch(r, step)[0]), batch(r, step)[1]) for r in range(ws)) / ws
        loss.backward()
        ref_opt.step()
    for a, b in zip(ddp.module.parameters(), ref.parameters()):
        if not torch.allclose(a, b, rtol=1e-10, atol=1e-12):
            fails.append(f"DDP (hook={hook}): parameters differ from the local computation by "
                         f"{(a - b).abs().max().item():.3g}")


def quiet_veth_bytes(g):
    """veth_bytes() while the wire is quiet: after a barrier (every rank has
    received all bytes of the ops before it) and before the barrier that lets
    the ranks go on (its root, rank 0, releases the others only after it has
    read). Each barrier adds a few hundred bytes."""
    dist.barrier(group=g)
    n = veth_bytes()
    dist.barrier(group=g)
    return n


def measure(groups, size_mb, iters):
    """Bytes through this namespace's veth (tx+rx) and seconds per all-reduce;
    the counters of rank 0 are the ones to use (it is the barriers' root)."""
    out = {}
    t = torch.zeros(size_mb * (1 << 20) // 4)
    for algo in ("ring", "hier"):
        g = groups[algo]
        dist.all_reduce(t, group=g)  # warm-up: first-touch and the segment pipeline
        before = quiet_veth_bytes(g)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t, group=g)
        seconds = (time.perf_counter() - start) / iters
        out[algo] = {"veth_bytes_per_op": (quiet_veth_bytes(g) - before) / iters, "seconds_per_op": seconds,
                     "buffer_bytes": t.numel() * 4}
    return out


def loop_until_error(rank, ready_path, limit_s):
    """All-reduces on the default group until one fails (the test cuts the link)."""
    t = torch.ones(1 << 18)
    start = time.monotonic()
    open(ready_path, "w").close()
    while time.monotonic() - start < limit_s:
        try:
            dist.all_reduce(t)
        except Exception as e:  # noqa: BLE001 - recorded and judged by the test
            return {"type": type(e).__name__, "dist_backend_error": isinstance(e, dist.DistBackendError),
                    "message": str(e)[:2000], "time": time.monotonic()}
        t.fill_(1.0)
    return {"type": None, "message": f"no error in {limit_s} s", "time": time.monotonic()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("test", "bench"), default="test")
    p.add_argument("--results", required=True)
    p.add_argument("--timeout", type=float, default=20.0, help="group timeout, seconds")
    p.add_argument("--size-mb", type=int, default=16)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    result = {"rank": rank, "ifname": os.environ.get("COLLX_SOCKET_IFNAME"), "fails": []}
    code = 0
    try:
        dist.init_process_group("collx", timeout=datetime.timedelta(seconds=args.timeout))
        ws = dist.get_world_size()
        backend = torchcollx.stats.backend_of()
        result["hosts"] = list(backend.hosts)
        result["auto_choice"] = {n: backend.choose_allreduce(n) for n in (4, 1 << 24)}
        groups = {a: dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=a)) for a in ALGOS}
        if args.mode == "test":
            check_allreduce(groups, rank, ws, result["fails"])
            check_ddp(rank, ws, result["fails"], hook=False)
            check_ddp(rank, ws, result["fails"], hook=True)
        result["measure"] = measure(groups, args.size_mb, args.iters)
        if args.mode == "test":
            dist.barrier()
            result["cut"] = loop_until_error(rank, os.path.join(args.results, f"loop{rank}"), 4 * args.timeout)
    except Exception:  # noqa: BLE001 - reported to the test through the file
        result["exception"] = traceback.format_exc()
        code = 1
    tmp = os.path.join(args.results, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.rename(tmp, os.path.join(args.results, f"rank{rank}.json"))
    os._exit(code)


if __name__ == "__main__":
    main()
