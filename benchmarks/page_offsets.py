"""Collectives on tensors at odd page offsets: collx and gloo, each beside itself at offset 0.

Rank r's tensors start r * step bytes past a page boundary (a view into a larger
tensor), so that the ranks' buffers, collx's shared windows and the receive buffers
lie a few bytes apart modulo a page. There glibc's memcpy and the kernel's
cross-memory reads take `rep movsb`, which some CPUs (AMD Zen 3) run many times
slower (csrc/core/copy.h). Views like these come from slicing a flat buffer, or
from the blocks of all_gather_into_tensor whose size is no multiple of 64 bytes.

For each op and size, every round times one block of calls per step (0 first, then
the others), for gloo and collx in turn; it prints each step's median time over the
rounds and its ratio to step 0 in the same rounds. Every call's first result is
checked.

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/page_offsets.py
    .venv/bin/torchrun --nproc_per_node=2 benchmarks/page_offsets.py --ops all_gather --sizes 256K,4M \\
        --steps 0,4,16,64 --rounds 7
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import torchcollx  # noqa: F401  (registers the backend)
from bench_common import agreed_max, parse_sizes
from collectives import Point, elements

OPS = ["all_reduce", "all_gather", "reduce_scatter"]


def at_offset(count, offset):
    """A float32 view of `count` elements starting `offset` bytes past a page boundary."""
    raw = torch.empty(count + 2048)
    start = ((-raw.data_ptr()) % 4096 + offset) // 4
    return raw[start:start + count]


class OffsetPoint(Point):
    """collectives.Point with its buffers moved to a page offset; all_reduce in place."""

    def __init__(self, op, count, group, rank, n, offset):
        super().__init__("broadcast" if op == "all_reduce" else op, count, group, rank, n)
        self.op = op
        self.inp = at_offset(self.inp.numel(), offset)
        self.out = self.inp if op == "all_reduce" else at_offset(self.out.numel(), offset)

    def run(self):
        if self.op == "all_reduce":
            dist.all_reduce(self.out, group=self.group)
        else:
            super().run()

    def check(self, check_non_root=True):
        if self.op != "all_reduce":
            return super().check(check_non_root)
        self.out.fill_(self.rank + 1)
        self.run()
        want = self.n * (self.n + 1) / 2
        return None if bool((self.out == want).all()) else f"all_reduce gave {self.out[0].item()}, not {want}"


def timed_block(point, seconds):
    """Seconds per call over a block of about `seconds`, agreed on every rank."""
    probe = time.perf_counter()
    point.run()
    k = int(agreed_max(max(1.0, seconds / max(time.perf_counter() - probe, 1e-7))))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(k):
        point.run()
    return agreed_max((time.perf_counter() - start) / k)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--sizes", default="64K,256K,1M,4M")
    p.add_argument("--steps", default="0,4,16,64", help="comma list of bytes; rank r's offset is r * step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.1, help="per block")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.new_group(backend="gloo"), "collx": dist.new_group(backend="collx")}
    steps = [int(s) for s in args.steps.split(",")]
    assert steps[0] == 0, "the first step is the reference: 0"
    if rank == 0:
        print(f"n={n}; each cell: median µs over {args.rounds} rounds (ratio to step 0 in the same rounds)")
        print(f"{'op':<15}{'bytes':>9} {'backend':<6}" + "".join(f"{'+' + str(s) + '·r':>18}" for s in steps))
    for op in args.ops.split(","):
        for size in parse_sizes(args.sizes, "1G", 4 * n):
            count = elements(op, size, n)
            for name, group in groups.items():
                points = [OffsetPoint(op, count, group, rank, n, s * rank) for s in steps]
                for s, pt in zip(steps, points):
                    bad = pt.check()
                    if agreed_max(1.0 if bad else 0.0):
                        raise SystemExit(f"{name} {op} at step {s}: {bad or 'wrong on another rank'}")
                    for _ in range(3):
                        pt.run()
                times = [[timed_block(pt, args.seconds) for pt in points] for _ in range(args.rounds)]
                if rank == 0:
                    cells = []
                    for i in range(len(steps)):
                        med = statistics.median(t[i] for t in times)
                        ratio = statistics.median(t[i] / t[0] for t in times)
                        cells.append(f"{med * 1e6:10.1f} ({ratio:4.2f})")
                    print(f"{op:<15}{size:>9} {name:<6}" + "".join(f"{c:>18}" for c in cells), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
