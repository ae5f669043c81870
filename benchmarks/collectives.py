"""Collectives benchmark: gloo vs collx for reduce_scatter_single, all_gather_single,
all_gather into a list of tensors (all_gather_list), broadcast, all_to_all_single (equal
splits) and reduce; CPU float32.

Run from the repository root:

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/collectives.py
    .venv/bin/torchrun --nproc_per_node=4 benchmarks/collectives.py --ops reduce_scatter,all_gather \
        --sizes 4K,64K,1M,16M --time-per-point 0.2 --json /tmp/coll.json

The size of a point is the total bytes of the larger buffer of the op (nccl-tests'
convention): the input of reduce_scatter, the output of all_gather, the (equal) input and
output of all_to_all, the buffer of broadcast and reduce. Where the op splits the buffer
into n blocks it is rounded up to a multiple of 4·n bytes (so the smallest valid size of
those is 4·n B). busbw = algbw · factor with factor (n-1)/n for reduce_scatter, all_gather
and all_to_all and 1 for broadcast and reduce (root 0). At each size, gloo and collx (a
group with torchcollx.Options() defaults: algorithm auto) run one after the other. Every
point is checked for correctness first, then timed; the reported time is the max over
ranks of the mean per-op time (p50: max over ranks of the median op). For collx the
column "algo" is the stats label that ran (e.g. broadcast/tree).
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench_common import MAX_ITERS, MIN_ITERS, agreed_max, compare_to_gloo, parse_sizes, stats_gained

OPS = ["reduce_scatter", "all_gather", "all_gather_list", "broadcast", "all_to_all", "reduce"]
ROOT = 0
SMALL_MAX, LARGE_MIN = 64 << 10, 1 << 20          # the target bands
TIME_TARGET, BUSBW_TARGET = 0.3, 1.0               # collx/gloo time at <=64 KB; busbw ratio at >=1 MB


def fmt_size(b):
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if b >= div and b % div == 0:
            return f"{b // div}{unit}"
    return f"{b}"


def busbw_factor(op, n):
    return (n - 1) / n if op in ("reduce_scatter", "all_gather", "all_gather_list", "all_to_all") else 1.0


def elements(op, nbytes, n):
    """float32 elements of the larger buffer for a requested size."""
    if op in ("broadcast", "reduce"):
        return max(1, nbytes // 4)
    return max(n, -(-nbytes // 4 // n) * n)  # rounded up to n blocks of whole elements


# ----------------------------------------------------------------- one op
class Point:
    """The buffers of one op at one size, its correctness check and its call."""

    def __init__(self, op, count, group, rank, n):
        self.op, self.count, self.group, self.rank, self.n = op, count, group, rank, n
        block = count // n
        if op == "reduce_scatter":
            self.inp, self.out = torch.empty(count), torch.empty(block)
        elif op == "all_gather":
            self.inp, self.out = torch.empty(block), torch.empty(count)
        elif op == "all_gather_list":  # a tensor of its own per rank, as most callers write it
            self.inp, self.outs = torch.empty(block), [torch.empty(block) for _ in range(n)]
        elif op == "all_to_all":
            self.inp, self.out = torch.empty(count), torch.empty(count)
        else:
            self.inp = self.out = torch.empty(count)

    def run(self):
        g = self.group
        if self.op == "reduce_scatter":
            dist.reduce_scatter_single(self.out, self.inp, group=g)
        elif self.op == "all_gather":
            dist.all_gather_single(self.out, self.inp, group=g)
        elif self.op == "all_gather_list":
            dist.all_gather(self.outs, self.inp, group=g)
        elif self.op == "all_to_all":
            dist.all_to_all_single(self.out, self.inp, group=g)
        elif self.op == "broadcast":
            dist.broadcast(self.out, group_src=ROOT, group=g)
        else:
            dist.reduce(self.out, group_dst=ROOT, group=g)

    def check(self, check_non_root):
        """Fills known values, runs once, returns None or a description of the error."""
        r, n, count = self.rank, self.n, self.count
        block = count // n
        blocks = lambda t: t.view(n, block)  # noqa: E731
        if self.op == "reduce_scatter":     # block j of rank r holds (r+1)*(j+1)
            blocks(self.inp).copy_(torch.arange(1, n + 1, dtype=torch.float32).view(n, 1) * (r + 1))
            want = torch.full((block,), float((r + 1) * n * (n + 1) // 2))
        elif self.op in ("all_gather", "all_gather_list"):
            self.inp.fill_(r + 1)
            want = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(block)
        elif self.op == "all_to_all":      # block j of rank r holds r*n + j
            blocks(self.inp).copy_(torch.arange(n, dtype=torch.float32).view(n, 1) + r * n)
            want = (torch.arange(n, dtype=torch.float32) * n + r).repeat_interleave(block)
        elif self.op == "broadcast":
            self.out.fill_(7.0 if r == ROOT else -1.0)
            want = torch.full((count,), 7.0)
        else:
            self.out.fill_(r + 1)
            want = torch.full((count,), float(n * (n + 1) // 2)) if r == ROOT else self.out.clone()
        for t in self.outputs():
            if t is not self.inp:
                t.fill_(-1.0)
        self.run()
        if self.op == "reduce" and r != ROOT and not check_non_root:
            return None  # gloo leaves partial sums in the non-roots' buffers
        got = torch.cat(self.outputs())
        bad = (got != want).nonzero()
        if bad.numel():
            i = bad[0].item()
            return (f"{bad.numel()}/{got.numel()} elements differ, e.g. [{i}]={got[i].item()} "
                    f"expected {want[i].item()}")
        return None

    def outputs(self):
        return self.outs if self.op == "all_gather_list" else [self.out]

    def zero(self):
        self.inp.zero_()
        for t in self.outputs():
            t.zero_()


def run_ops(point, k):
    ts = [time.perf_counter()]
    for _ in range(k):
        point.run()
        ts.append(time.perf_counter())
    return ts


def time_point(name, point, args):
    err = point.check(check_non_root=name != "gloo")
    if agreed_max(1.0 if err else 0.0):
        if err:
            print(f"[rank {point.rank}] WRONG RESULT {name} {point.op} {point.count * 4} B: {err}",
                  file=sys.stderr, flush=True)
        if point.rank == 0:
            print(f"ABORT: {name} returned a wrong {point.op} result at {point.count * 4} B; "
                  "not timing a broken backend.", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.exit(1)
    point.zero()  # zeros stay zeros under repeated reductions
    ts = run_ops(point, args.warmup)
    est = agreed_max((ts[-1] - ts[0]) / args.warmup)
    k = int(min(200, max(1, 0.2 * args.time_per_point / est)))  # second, longer warmup
    ts = run_ops(point, k)
    est = agreed_max((ts[-1] - ts[0]) / k)
    iters = int(min(MAX_ITERS, max(MIN_ITERS, round(args.time_per_point / est))))
    dist.barrier(group=point.group)
    ts = run_ops(point, iters)
    p50 = statistics.median(b - a for a, b in zip(ts, ts[1:]))
    mean, p50 = agreed_max((ts[-1] - ts[0]) / iters, p50)
    return mean, p50, iters


def collx_label(group, before):
    import torchcollx
    grown = {k: v["calls"] for k, v in stats_gained(before, torchcollx.get_stats(group)["algorithms"]).items()
             if not k.startswith("barrier")}
    return max(grown, key=grown.get) if grown else "?"


# ----------------------------------------------------------------- output
HEAD = (f"{'size(B)':>10s}  {'backend':<7s} {'algo':<22s} {'time(us)':>10s} {'p50(us)':>9s} "
        f"{'algbw(GB/s)':>11s} {'busbw(GB/s)':>11s} {'vs_gloo':>8s} {'busbw_x':>8s} {'iters':>6s}")


def fmt_row(r):
    def opt(v, w, d=2):
        return f"{'-':>{w}}" if v is None else f"{v:>{w}.{d}f}"
    return (f"{r['bytes']:>10d}  {r['backend']:<7s} {r['algo']:<22s} {r['time_us']:>10.1f} {r['p50_us']:>9.1f} "
            f"{r['algbw']:>11.4f} {r['busbw']:>11.4f} {opt(r['vs_gloo'], 8)} {opt(r['busbw_x'], 8)} "
            f"{r['iters']:>6d}")


def target(rows, what, key, goal, higher_is_better):
    """One target over `rows`: its worst row, met or missed by how much, and how
    many sizes meet it. Returns (text, met)."""
    if not rows:
        return f"{what}: no sizes", True
    meets = (lambda v: v >= goal) if higher_is_better else (lambda v: v <= goal)
    worst = (min if higher_is_better else max)(rows, key=lambda r: r[key])
    ok = meets(worst[key])
    return (f"{what} {key} {'min' if higher_is_better else 'max'} {worst[key]:.2f} at {fmt_size(worst['bytes'])} "
            + ("MET" if ok else f"MISSED by {abs(goal - worst[key]):.2f}")
            + f" ({sum(meets(r[key]) for r in rows)}/{len(rows)} sizes)"), ok


def targets(rows, ops, n):
    """Footer lines: per op, the two targets and by how much they are met or missed."""
    lines = [f"# targets at n={n}: collx busbw >= {BUSBW_TARGET:.1f}x gloo at >= 1 MB; "
             f"collx time <= {TIME_TARGET:.1f}x gloo at <= 64 KB"]
    met_all = True
    for op in ops:
        cx = [r for r in rows if r["op"] == op and r["backend"] == "collx" and r["vs_gloo"] is not None]
        large, large_ok = target([r for r in cx if r["bytes"] >= LARGE_MIN], ">=1MB", "busbw_x", BUSBW_TARGET, True)
        small, small_ok = target([r for r in cx if r["bytes"] <= SMALL_MAX], "<=64KB", "vs_gloo", TIME_TARGET, False)
        met_all &= large_ok and small_ok
        lines.append(f"#   {op:<15s} {large}; {small}")
    lines.append(f"# all targets {'MET' if met_all else 'NOT all met'} at n={n}")
    return lines


def over_tcp(rows):
    """Per op and size, each other collx group's time over collx/tcp's."""
    tcp = {(r["op"], r["bytes"]): r["time_us"] for r in rows if r["backend"] == "collx/tcp"}
    others = sorted({r["backend"] for r in rows if r["backend"].startswith("collx") and r["backend"] != "collx/tcp"})
    if not tcp or not others:
        return []
    lines = [f"# time over collx/tcp's (lower is better): {', '.join(others)}"]
    for r in rows:
        if r["backend"] == others[0] and (r["op"], r["bytes"]) in tcp:
            cells = [f"{o['time_us'] / tcp[(r['op'], r['bytes'])]:.2f}" for o in rows
                     if o["backend"] in others and (o["op"], o["bytes"]) == (r["op"], r["bytes"])]
            lines.append(f"#   {r['op']:<15s} {r['bytes']:>10d}  " + "  ".join(cells))
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {','.join(OPS)}")
    p.add_argument("--backends", default="gloo,collx", help="comma list of gloo,collx")
    p.add_argument("--sizes", help="comma list of byte sizes, K/M/G suffixes ok "
                   "(default: powers of 4 from 4 B to --max-size)")
    p.add_argument("--max-size", default="64M", help="largest size (default 64M)")
    p.add_argument("--time-per-point", type=float, default=0.5, help="seconds per point")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="dump all rows to this JSON file")
    p.add_argument("--transports", default="auto",
                   help="comma list of collx transports (auto,tcp,shm): one collx group each; auto's is "
                        "named collx, the others collx/<transport>; with tcp among them, a summary of "
                        "each group's time over collx/tcp's")
    args = p.parse_args()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if set(ops) - set(OPS):
        p.error(f"unknown op(s) {sorted(set(ops) - set(OPS))}; choose from {OPS}")
    if set(backends) - {"gloo", "collx"}:
        p.error(f"unknown backend(s) {sorted(set(backends) - {'gloo', 'collx'})}")
    sizes = parse_sizes(args.sizes, args.max_size, 1)

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = []
    if "gloo" in backends:
        groups.append(("gloo", dist.new_group(backend="gloo")))
    if "collx" in backends:
        try:
            import torchcollx
        except ImportError as e:
            sys.exit(f"[rank {rank}] cannot import torchcollx ({e}); build it or run with --backends gloo")
        for t in (t.strip() for t in args.transports.split(",") if t.strip()):
            name = "collx" if t == "auto" else f"collx/{t}"
            groups.append((name, dist.new_group(backend="collx", pg_options=torchcollx.Options(transport=t))))
    if rank == 0:
        print(f"# collectives benchmark  world_size={n}  torch={torch.__version__}  dtype=float32 "
              f"device=cpu  cpus={os.cpu_count()}  backends={[g for g, _ in groups]}  "
              f"time_per_point={args.time_per_point}s")
        print("# size = bytes of the larger buffer; time = mean per op (max over ranks), p50 = median op; "
              "busbw = algbw*factor ((n-1)/n: reduce_scatter, all_gather(_list), all_to_all; 1: broadcast, reduce; "
              f"root {ROOT}); vs_gloo = time/gloo_time (lower is better); busbw_x = busbw/gloo_busbw", flush=True)

    rows = []
    for op in ops:
        if rank == 0:
            print(f"\n## {op}  (busbw factor {busbw_factor(op, n):.3f})\n{HEAD}", flush=True)
        for count in dict.fromkeys(elements(op, nbytes, n) for nbytes in sizes):  # rounding may merge sizes
            gloo_row = None
            for name, group in groups:  # interleaved: every backend at one size, then the next size
                point = Point(op, count, group, rank, n)
                if name.startswith("collx"):
                    import torchcollx
                    before = torchcollx.get_stats(group)["algorithms"]
                t, p50, iters = time_point(name, point, args)
                algo = collx_label(group, before) if name.startswith("collx") else "-"
                algbw = count * 4 / t / 1e9
                r = dict(op=op, bytes=count * 4, backend=name, algo=algo, time_us=t * 1e6, p50_us=p50 * 1e6,
                         algbw=algbw, busbw=algbw * busbw_factor(op, n), iters=iters, vs_gloo=None, busbw_x=None)
                gloo_row = compare_to_gloo(r, gloo_row, name == "gloo")
                rows.append(r)
                if rank == 0:
                    print(fmt_row(r), flush=True)
                del point

    if rank == 0:
        if "gloo" in backends and "collx" in backends:
            print()
            print("\n".join(targets(rows, ops, n)))
        print("\n".join(over_tcp(rows)))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            meta = dict(world_size=n, torch=torch.__version__, cpus=os.cpu_count(),
                        time_per_point=args.time_per_point, root=ROOT, dtype="float32")
            Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
            print(f"rows written to {args.json}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
