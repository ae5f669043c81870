"""all_reduce benchmark: gloo vs collx (one group per collx algorithm), float32 on CPU or CUDA.

Run from the repository root:

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/allreduce.py
    .venv/bin/torchrun --nproc_per_node=4 benchmarks/allreduce.py --sizes 4,4K,64K,1M,16M,64M
    .venv/bin/torchrun --nproc_per_node=2 benchmarks/allreduce.py --backends gloo \
        --max-size 1M --time-per-point 0.1 --json /tmp/ar.json
    torchrun --nproc_per_node=4 benchmarks/allreduce.py --device cuda   # 4 ranks on cuda:0

Every point is checked for correctness first (rank r contributes r+1, the sum must be
n(n+1)/2), then timed; the reported time is the max over ranks of the mean per-op time.
busbw = algbw * 2(n-1)/n (nccl-tests convention). Before the collectives, rank 0 measures
loopback limits (4-byte ping-pong half-RTT, two opposite TCP streams) while the other
ranks wait at a barrier; %2str = busbw / per-direction two-stream throughput.

Groups are timed in the order given, gloo first, at each size. At the tiny sizes the
first collx group after gloo pays a scheduling penalty that later groups do not pay.
At 4 B, n=2, star measured 24 us when first and 18 us when second; auto measured 18 us
when second. So `auto`, the figure the targets are about, goes last by default.
"""
import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench_common import (MAX_ITERS, MIN_ITERS, agreed_max, compare_to_gloo, interleaved_medians, parse_size,
                          parse_sizes, run_ops)


# ----------------------------------------------------------------- loopback limits
_ECHO = """import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
b = bytearray(64)
while True:
    n = s.recv_into(b)
    if not n:
        break
    s.sendall(b[:n])
"""


def _tcp_pair():
    lst = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def memcpy_gbps(nbytes=64 << 20, repeats=5):
    """One core's memcpy: bytes copied per second, best of a few 64 MB copies
    (the ceiling of any path between ranks on one host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    torch.set_num_threads(threads)
    return best


def loopback_half_rtt_us(rounds=2000, warm=200):
    """Median half round trip of a 4-byte message to an echo subprocess (no shared GIL)."""
    lst = socket.create_server(("127.0.0.1", 0))
    peer = subprocess.Popen([sys.executable, "-c", _ECHO, str(lst.getsockname()[1])])
    conn, _ = lst.accept()
    lst.close()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg, buf, samples = b"ping", bytearray(4), []
    try:
        for i in range(rounds + warm):
            t0 = time.perf_counter()
            conn.sendall(msg)
            got = 0
            while got < 4:
                got += conn.recv_into(memoryview(buf)[got:])
            if i >= warm:
                samples.append(time.perf_counter() - t0)
    finally:
        conn.close()
        peer.wait(timeout=10)
    return statistics.median(samples) / 2 * 1e6


def loopback_two_streams_gbps(total=256 << 20, chunk=4 << 20, repeats=3):
    """Two opposite TCP streams at once (one sender + one receiver thread per stream);
    returns the best over `repeats` of the per-direction GB/s (mean of both streams)."""
    payload, chunks = memoryview(bytearray(chunk)), max(1, total // chunk)

    def send(s, i, t):
        t[i] = time.perf_counter()
        for _ in range(chunks):
            s.sendall(payload)

    def recv(s, i, t):
        buf, got = memoryview(bytearray(chunk)), 0
        while got < chunks * chunk:
            n = s.recv_into(buf)
            if not n:
                raise RuntimeError("loopback stream closed early")
            got += n
        t[i] = time.perf_counter()

    best = 0.0
    for _ in range(repeats):
        (a0, b0), (a1, b1) = _tcp_pair(), _tcp_pair()  # a0 -> b0 and b1 -> a1
        t = [0.0] * 4
        threads = [threading.Thread(target=f, args=(sk, i, t)) for f, sk, i in
                   ((send, a0, 0), (recv, b0, 1), (send, b1, 2), (recv, a1, 3))]
        [th.start() for th in threads]
        [th.join() for th in threads]
        [sk.close() for sk in (a0, b0, a1, b1)]
        best = max(best, chunks * chunk / 1e9 * (1 / (t[1] - t[0]) + 1 / (t[3] - t[2])) / 2)
    return best


# ----------------------------------------------------------------- benchmark
TWIN = "ring'"  # a second ring group: the interleaved measure's own noise


def make_groups(args):
    """The table's groups, and the twins that only auto_vs_best times."""
    groups, twins = [], []
    if "gloo" in args.backends:
        groups.append(("gloo", dist.new_group(backend="gloo")))
    if "collx" in args.backends:
        try:
            import torchcollx
        except ImportError as e:
            sys.exit(f"[rank {dist.get_rank()}] cannot import torchcollx ({e}); "
                     "build it or run with --backends gloo")
        extra = {k: v for k, v in (("tree_arity", args.tree_arity),
                                   ("segment_bytes", args.segment_bytes)) if v is not None}
        for transport in args.transports:
            prefix = "collx" if len(args.transports) == 1 else transport
            # The shared-memory windows need the shared-memory transport.
            for algo in (a for a in args.algos if not (a == "shm" and transport == "tcp")):
                opts = torchcollx.Options(algorithm=algo, transport=transport, **extra)
                groups.append((f"{prefix}/{algo}", dist.new_group(backend="collx", pg_options=opts)))
            if "auto" in args.algos and "ring" in args.algos and args.twin:
                opts = torchcollx.Options(algorithm="ring", transport=transport, **extra)
                twins.append((f"{prefix}/{TWIN}", dist.new_group(backend="collx", pg_options=opts)))
    return groups, twins


def collx_sets(groups):
    """The prefixes of the collx group sets: "collx", or one per transport."""
    return sorted({g.split("/")[0] for g, _ in groups if g != "gloo"})


def check(name, group, buf):
    rank, n = dist.get_rank(), dist.get_world_size()
    buf.fill_(rank + 1)
    dist.all_reduce(buf, group=group)
    want = n * (n + 1) / 2
    bad = (buf != want).nonzero()
    if bad.numel():
        i = bad[0].item()
        print(f"[rank {rank}] WRONG RESULT {name} size={buf.numel() * 4}B: "
              f"{bad.numel()}/{buf.numel()} elements differ, e.g. [{i}]={buf[i].item()} "
              f"expected {want}", file=sys.stderr, flush=True)
    if agreed_max(1.0 if bad.numel() else 0.0):
        if rank == 0:
            print(f"ABORT: {name} returned a wrong all_reduce result at "
                  f"{buf.numel() * 4} B; not timing a broken backend.", file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(1)


def settle(group, buf, device, cap=20000):
    """Runs ops until a collx auto group's online refinement (refine.h) has
    finished trying algorithms at this size, as a training loop's first
    steps would; returns how many ops that took (0 for other groups). Every
    rank sees the same ops, so all leave the loop together."""
    backend = group._get_backend(device)
    ops = 0
    while hasattr(backend, "refining") and backend.refining(buf.nbytes) and ops < cap:
        run_ops(group, buf, 1)
        ops += 1
    return ops


def time_point(name, group, nbytes, args):
    """The steady state of one group at one size: an auto group first
    settles its choice (settle), then the warm-ups, then the timed ops."""
    buf = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=args.device)
    check(name, group, buf)
    buf.zero_()  # stays 0 under repeated sums (no overflow / inf)
    settle(group, buf, torch.device(args.device))
    ts = run_ops(group, buf, args.warmup)
    est = agreed_max((ts[-1] - ts[0]) / args.warmup)
    k = int(min(200, max(1, 0.2 * args.time_per_point / est)))  # second, longer warmup
    ts = run_ops(group, buf, k)
    est = agreed_max((ts[-1] - ts[0]) / k)
    iters = int(min(MAX_ITERS, max(MIN_ITERS, round(args.time_per_point / est))))
    dist.barrier(group=group)
    ts = run_ops(group, buf, iters)
    p50 = statistics.median(b - a for a, b in zip(ts, ts[1:]))
    mean, p50 = agreed_max((ts[-1] - ts[0]) / iters, p50)
    return mean, p50, iters


def one_rank_floor_us(args):
    """Mean time of a 4-byte all_reduce on a one-rank collx group and on a
    one-rank gloo group: the per-call cost before any byte moves."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for backend in ("collx", "gloo"):
        mine = None
        for r in range(n):  # every rank takes part in creating every group
            g = dist.new_group(ranks=[r], backend=backend)
            if r == rank:
                mine = g
        buf = torch.zeros(1, device=args.device)
        run_ops(mine, buf, 100)
        ts = run_ops(mine, buf, 2000)
        out.append((ts[-1] - ts[0]) / 2000 * 1e6)
    return agreed_max(*out)


def shm_vs_tcp(rows):
    """With --transports tcp,shm: per size and algorithm, shm's time over tcp's."""
    by = {(r["name"], r["bytes"]): r for r in rows}
    algos = sorted({r["name"][4:] for r in rows if r["name"].startswith("shm/")})
    if not algos or not any(("tcp/" + a, b) in by for a in algos for _, b in by):
        return
    print("# shm time / tcp time per size (lower is better): " + ", ".join(algos))
    for size in sorted({b for _, b in by}):
        cells = [f"{by[('shm/' + a, size)]['time_us'] / by[('tcp/' + a, size)]['time_us']:.2f}"
                 if ("shm/" + a, size) in by and ("tcp/" + a, size) in by else "-" for a in algos]
        print(f"#   {size:>10d}  " + "  ".join(f"{c:>6s}" for c in cells))


def auto_vs_best(rows, groups, twins, args):
    """Per size: what auto chose (the group's fitted model, COLLX_TUNING) and
    how its time compares with the fastest forced algorithm's. Timed apart
    from the table, interleaved: rounds that each run every collx group in
    turn for about a millisecond of ops (see k below), so that a
    drift of the machine hits all alike, for --rounds-time per group and
    at least --rounds rounds; a group's time is its median round (per-op
    mean, max over ranks). Fine turns matter: at n=4 on 2 cores, two groups
    running the same algorithm differed by up to 1.24x in 5 rounds of 60
    ops, and by 1.03x in 60 rounds of 5. So does the time: at n=3 over TCP
    an algorithm runs in modes of 50-200 ms (tree at 1 MiB: 0.9 to 1.6 ms an
    op, 50 ops at a time), and in 17 rounds of 4 MiB star measured 1.41x
    tree, where 100 rounds put them 0.94-1.03x apart.
    auto/best: the auto group over the best forced group. choice/best: the
    forced group of the algorithm auto chose over the best: the model's own
    error, free of the auto group's separate setup. twin: a second ring
    group over the first, in the same rounds: how far apart this measure
    puts two groups that run the same algorithm.

    Over loopback TCP that is up to 1.5x: a connection that took spurious
    retransmits (reordering between cores) keeps a low slow-start threshold
    and restarts its window after each idle spell, so one group can run
    persistently slower than another that runs the same algorithm. The
    'one group' columns judge the choice apart from that: the auto group
    runs every algorithm itself (allreduce_with), interleaved the same way,
    so that all share its connections; 'auto' there is its own choice, and
    the twin is ring run twice.

    This is auto's steady state, as in the table: the auto group settles
    its choice first (settle); 'trial' counts the ops that took here: 0
    where the table's settle finished it, more where a class ran a new
    trial (after 65536 ops). It learns alone, in back-to-back ops, as in a
    training loop; learning in the rounds instead made its
    trial pay for the other groups' turns: at 16 KiB on shared memory (n=3
    and 4), ring's or tree's blocks measured 2x star and were dropped."""
    for prefix in collx_sets(groups):
        auto_vs_best_of(prefix, rows, groups, twins, args)


def auto_vs_best_of(prefix, rows, groups, twins, args):
    names = [g for g, _ in groups if g.startswith(prefix + "/")]
    auto, twin = prefix + "/auto", prefix + "/" + TWIN
    if auto not in names or len(names) < 2:
        return
    rank = dist.get_rank()
    group_of = dict(groups + twins)
    timed = names + [twin] if twin in group_of else names
    backend = group_of[auto]._get_backend(torch.device("cpu"))
    if rank == 0:
        print(f"# {prefix}: auto against the best forced algorithm, interleaved in rounds (at least {args.rounds}); "
              f"{backend.tuning}")
        print(f"#   {'':>10s}  {'':<8s} {' a group per algorithm ':-^42s}  {' one group ':-^24s}")
        print(f"#   {'size(B)':>10s}  {'auto ran':<8s} {'best':<8s} {'auto/best':>9s} {'choice/best':>11s} "
              f"{'trial':>5s} {'twin':>5s}  {'best':<8s} {'auto/best':>9s} {'twin':>5s}")
    worst, worst_apart = [0.0, 0.0, 0.0], [1.0, 1.0]
    for size in sorted({r["bytes"] for r in rows}):
        estimate = max(r["p50_us"] for r in rows if r["bytes"] == size and r["name"] in names) / 1e6
        # A turn of ~1 ms of ops, but 4 ops where that stays under 20 ms: the
        # first op after another group's turn may ride on what that turn left
        # (a token bucket's burst under tc: one fast op in a turn of two made
        # equal algorithms look 1.7x apart).
        k = int(min(50, max(math.ceil(1e-3 / estimate), min(4, math.ceil(20e-3 / estimate)))))
        rounds = int(min(400, max(args.rounds, args.rounds_time / (k * estimate))))
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=args.device)
        trial = settle(group_of[auto], buf, torch.device(args.device))
        med = interleaved_medians({g: group_of[g] for g in sorted(timed)}, buf, rounds, k)
        forced = [g for g in names if g != auto]
        best = min(forced, key=med.get)
        chose = f"{prefix}/{backend.choose_allreduce(size)}"
        cut = len(prefix) + 1
        algos = [g[cut:] for g in forced]
        runs = {a: (group_of[auto], a) for a in algos + ["auto"]}
        if twin in med:
            runs[TWIN] = (group_of[auto], "ring")
        one = interleaved_medians(runs, buf, rounds, k)
        one_best = min(algos, key=one.get)
        ratios = [med[auto] / med[best], med.get(chose, med[auto]) / med[best], one["auto"] / one[one_best]]
        worst = [max(w, r) for w, r in zip(worst, ratios)]
        aparts = ([max(a / b, b / a) for a, b in ((med[twin], med[prefix + "/ring"]), (one[TWIN], one["ring"]))]
                  if twin in med else [])
        worst_apart = [max(w, a) for w, a in zip(worst_apart, aparts)]
        if rank == 0:
            twins_at = [f"{a:.2f}" for a in aparts] or ["-", "-"]
            print(f"#   {size:>10d}  {chose[cut:]:<8s} {best[cut:]:<8s} {ratios[0]:>9.2f} {ratios[1]:>11.2f} "
                  f"{trial:>5d} {twins_at[0]:>5s}  {one_best:<8s} {ratios[2]:>9.2f} {twins_at[1]:>5s}", flush=True)
    if rank == 0:
        print(f"# worst over sizes: auto/best {worst[0]:.2f}, choice/best {worst[1]:.2f}"
              + (f"; the twin ring groups {worst_apart[0]:.2f}x apart" if twin in group_of else "")
              + f"; in one group: auto/best {worst[2]:.2f}"
              + (f", twin {worst_apart[1]:.2f}x apart" if twin in group_of else ""), flush=True)
        print(f"# the auto group after the rounds: {backend.tuning}", flush=True)


def fmt_row(r):
    def opt(v, w, d=2):
        return f"{'-':>{w}}" if v is None else f"{v:>{w}.{d}f}"
    return (f"{r['bytes']:>12d}  {r['name']:<13s} {r['time_us']:>10.1f} {r['p50_us']:>9.1f} "
            f"{r['algbw']:>11.4f} "
            f"{r['busbw']:>11.4f} {opt(r['vs_gloo'], 8)} {opt(r['busbw_x'], 8)} "
            f"{opt(r['pct_limit'], 6, 1)} {r['iters']:>6d}")


HEAD = (f"{'size(B)':>12s}  {'backend/algo':<13s} {'time(us)':>10s} {'p50(us)':>9s} "
        f"{'algbw(GB/s)':>11s} "
        f"{'busbw(GB/s)':>11s} {'vs_gloo':>8s} {'busbw_x':>8s} {'%2str':>6s} {'iters':>6s}")


def plot(rows, limit, n, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"note: matplotlib unavailable ({e}); skipping plot")
        return
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(13, 5))
    for name in dict.fromkeys(r["name"] for r in rows):
        rs = [r for r in rows if r["name"] == name]
        style = dict(marker="o", ms=3, label=name, ls="--" if name == "gloo" else "-")
        ax_t.plot([r["bytes"] for r in rs], [r["time_us"] for r in rs], **style)
        ax_b.plot([r["bytes"] for r in rs], [r["busbw"] for r in rs], **style)
    if limit:
        ax_b.axhline(limit, color="k", ls=":", label=f"loopback 2-stream {limit:.2f} GB/s/dir")
    for ax, yl in ((ax_t, "time per all_reduce (us)"), (ax_b, "busbw (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (B)")
        ax.set_ylabel(yl)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"all_reduce float32 CPU, world size {n}, torch {torch.__version__}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot saved to {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="gloo,collx", help="comma list of gloo,collx")
    p.add_argument("--algos", default="ring,tree,star,direct,shm,auto",
                   help="collx algorithms, timed in this order (shm: not on the tcp transport)")
    p.add_argument("--transports", default="auto",
                   help="comma list of collx transports (auto,tcp,shm); with several, each gets its own "
                        "set of groups, named by transport, and a shm-vs-tcp summary")
    p.add_argument("--sizes", help="comma list of byte sizes, K/M/G suffixes ok "
                   "(default: powers of 4 from 4 B)")
    p.add_argument("--max-size", default="64M", help="largest size (default 64M)")
    p.add_argument("--time-per-point", type=float, default=0.5, help="seconds per point")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=9,
                   help="fewest interleaved rounds of auto against the forced algorithms")
    p.add_argument("--rounds-time", type=float, default=1.0,
                   help="seconds per group in those rounds (at most 400 rounds)")
    p.add_argument("--no-twin", dest="twin", action="store_false",
                   help="leave out the second ring group that shows the rounds' own noise")
    p.add_argument("--tree-arity", type=int, help="passed to torchcollx.Options")
    p.add_argument("--segment-bytes", type=parse_size, help="passed to torchcollx.Options")
    p.add_argument("--loopback-mb", type=int, default=256, help="MB per direction")
    p.add_argument("--no-loopback", action="store_true", help="skip loopback limits")
    p.add_argument("--plot", help="PNG path (default benchmarks/results/allreduce_n{N}.png; "
                   "'' to skip)")
    p.add_argument("--json", help="dump all rows to this JSON file")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the tensors live; cuda: every rank on cuda:0 (collx shares a GPU)")
    args = p.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(0)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = set(args.backends) - {"gloo", "collx"}
    if unknown:
        p.error(f"unknown backend(s) {sorted(unknown)}")
    sizes = parse_sizes(args.sizes, args.max_size, 4)

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    rtt_us = limit = copy_gbps = None
    if rank == 0 and not args.no_loopback:  # other ranks sleep in the barrier below
        rtt_us = loopback_half_rtt_us()
        limit = loopback_two_streams_gbps(total=args.loopback_mb << 20)
        copy_gbps = memcpy_gbps()
    dist.barrier()
    groups, twins = make_groups(args)
    floor = one_rank_floor_us(args) if "collx" in args.backends else None

    if rank == 0:
        print(f"# all_reduce benchmark  world_size={n}  torch={torch.__version__}  "
              f"dtype=float32 device={args.device}  cpus={os.cpu_count()}  groups={[g for g, _ in groups]}")
        if limit is not None:
            print(f"# loopback: 4-byte ping-pong half-RTT {rtt_us:.1f} us; two opposite TCP "
                  f"streams {limit:.3f} GB/s per direction; one core's memcpy {copy_gbps:.2f} GB/s")
        if floor is not None:
            print(f"# per-call floor: a 4-byte all_reduce on a one-rank group takes {floor[0]:.1f} us on collx, "
                  f"{floor[1]:.1f} us on gloo (no communication: dispatch, Work, completion)")
        print("# time = mean per op (max over ranks), p50 = median op; busbw = algbw*2(n-1)/n;"
              " vs_gloo = time/gloo_time (lower is better); busbw_x = busbw/gloo_busbw;"
              " %2str = busbw/two-stream limit")
        print(HEAD, flush=True)
    rows = []
    for nbytes in sizes:
        nbytes = max(1, nbytes // 4) * 4
        gloo_row = None
        for name, group in groups:  # interleaved: all groups at one size, then next size
            t, p50, iters = time_point(name, group, nbytes, args)
            algbw = nbytes / t / 1e9
            busbw = algbw * 2 * (n - 1) / n
            r = dict(bytes=nbytes, name=name, time_us=t * 1e6, p50_us=p50 * 1e6, algbw=algbw,
                     busbw=busbw, iters=iters, vs_gloo=None, busbw_x=None,
                     pct_limit=100 * busbw / limit if limit else None)
            gloo_row = compare_to_gloo(r, gloo_row, name == "gloo")
            rows.append(r)
            if rank == 0:
                print(fmt_row(r), flush=True)

    auto_vs_best(rows, groups, twins, args)
    if rank == 0:
        shm_vs_tcp(rows)
    if rank == 0:
        for size in sorted({r["bytes"] for r in rows})[-2:] if limit else []:
            print(f"# busbw / loopback two-stream limit ({limit:.3f} GB/s/dir) at {size} B: "
                  + ", ".join(f"{r['name']} {r['busbw'] / limit:.1%}"
                              for r in rows if r["bytes"] == size))
        path = args.plot if args.plot is not None else str(
            Path(__file__).resolve().parent / "results" / f"allreduce_n{n}.png")
        if path and rows:
            plot(rows, limit, n, path)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            meta = dict(world_size=n, torch=torch.__version__, loopback_half_rtt_us=rtt_us,
                        loopback_two_stream_gbps=limit)
            Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
            print(f"rows written to {args.json}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
