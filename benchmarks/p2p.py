"""Point-to-point benchmark: gloo vs collx, in the same run.

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/p2p.py [--sizes 4,4K,64K,1M,16M] [--time-per-point 0.3]

Two patterns per size, float32 on the CPU:
  pingpong  rank 0 sends, rank 1 sends it back (blocking send/recv); the
            figure is the one-way latency (half the round trip), and the
            bandwidth bytes / one-way time. Ranks >= 2 idle.
  shift     every rank at once: irecv(prev); isend(next); wait both (the ring
            shift gloo users write); time per shift, bandwidth bytes / time.
The reported time is the median over iterations of the max over ranks. Every
point checks the data it moved first.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from bench_common import agreed_max, parse_sizes


def pingpong(buf, peer, rank, group):
    if rank == 0:
        dist.send(buf, peer, group=group)
        dist.recv(buf, peer, group=group)
    elif rank == 1:
        dist.recv(buf, peer, group=group)
        dist.send(buf, peer, group=group)


def shift(out, inp, rank, n, group):
    reqs = [dist.irecv(inp, (rank - 1) % n, group=group), dist.isend(out, (rank + 1) % n, group=group)]
    for r in reqs:
        r.wait()


def measure(fn, seconds, sync):
    """Median seconds per call, after warm-up; ranks agree on the count of calls."""
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(5):  # the same number of calls on every rank: they pair up
        fn()
    per_call = agreed_max(time.perf_counter() - t0) / 5
    iters = int(agreed_max(min(2000, max(10, int(seconds / per_call)))))
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return agreed_max(statistics.median(times))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4,256,4K,64K,256K,1M,4M,16M,64M")
    p.add_argument("--time-per-point", type=float, default=0.3)
    p.add_argument("--no-shift", action="store_true",
                   help="pingpong only (collx before its asynchronous p2p hangs on the shift)")
    args = p.parse_args()
    sizes = parse_sizes(args.sizes, "64M", 4)

    dist.init_process_group("gloo")
    import torchcollx  # noqa: F401  (registers collx)
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = [("gloo", dist.new_group(backend="gloo")), ("collx", dist.new_group(backend="collx"))]
    sync = dist.barrier
    if rank == 0:
        print(f"p2p: {n} ranks, torch {torch.__version__}; one-way latency (pingpong) and ring-shift time")
        print(f"{'size':>8} | {'pingpong gloo':>13} {'collx':>9} {'ratio':>6} {'GB/s':>6} | "
              f"{'shift gloo':>10} {'collx':>9} {'ratio':>6} {'GB/s':>6}")
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        row = {}
        for name, g in groups:
            buf = torch.full((count,), float(rank))
            out, inp = torch.full((count,), float(rank)), torch.zeros(count)
            pingpong(buf, 1 - rank if rank < 2 else 0, rank, g)  # correctness first
            if rank < 2 and not torch.equal(buf, torch.full((count,), 0.0)):
                raise SystemExit(f"{name}: pingpong moved wrong data at {nbytes} B")
            pp = measure(lambda: pingpong(buf, 1 - rank if rank < 2 else 0, rank, g), args.time_per_point, sync) / 2
            sh = float("nan")
            if not args.no_shift:
                shift(out, inp, rank, n, g)
                if not torch.equal(inp, torch.full((count,), float((rank - 1) % n))):
                    raise SystemExit(f"{name}: ring shift moved wrong data at {nbytes} B")
                sh = measure(lambda: shift(out, inp, rank, n, g), args.time_per_point, sync)
            row[name] = (pp, sh)
        if rank == 0:
            (gp, gs), (cp, cs) = row["gloo"], row["collx"]
            b = count * 4
            print(f"{nbytes:>8} | {gp * 1e6:>11.1f}us {cp * 1e6:>7.1f}us {cp / gp:>5.2f}x {b / cp / 1e9:>6.2f} | "
                  f"{gs * 1e6:>8.1f}us {cs * 1e6:>7.1f}us {cs / gs:>5.2f}x {b / cs / 1e9:>6.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
