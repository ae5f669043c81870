"""One rank of benchmarks/hosts.py (and tests/test_hosts_harness.py), started
by torchrun inside a network namespace of tests/netns.py, with
COLLX_SOCKET_IFNAME set to its host's NIC and NETNS_HOST to the host's index.

Every rank makes the gloo default group and collx groups: "auto" (Options()
defaults) and one per forced all-reduce algorithm (Options(algorithm=...)).
For each op and size, in the same processes:

1. check: every candidate runs the op once on data known from each rank's
   rank, and each rank compares its result with the values computed locally
   from every rank's data (small integers, so float sums are exact). A wrong
   candidate is reported and not timed at that size.
2. time: the candidates take turns in --rounds rounds, in a new order each
   round, alike on every rank (bench_common.interleaved_turns); a turn is one
   untimed op, then k timed ones, k agreed so a turn lasts about
   --turn-seconds. A turn's time is the slowest rank's time per op (the max
   over ranks); the driver reports the median over rounds.

Candidates: all_reduce: gloo and collx with each of --algos ("auto" first);
all_gather, reduce_scatter (all_gather_into_tensor, reduce_scatter_tensor,
what FSDP calls) and broadcast (from rank 0): gloo and collx auto (the
algorithm option is the all-reduce's). Sizes are the larger buffer in bytes
(nccl-tests' convention): the all-reduce's and the broadcast's buffer, the
all-gather's output, the reduce-scatter's input, float32, rounded up to n
equal blocks.

Rank 0 writes the results to --json; every rank leaves with os._exit, so a
peer's late teardown never holds up the job. Times use time.monotonic().
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import agreed_max, interleaved_turns, parse_size, stats_gained  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
MAX_K = 200


def data(rank: int, count: int) -> torch.Tensor:
    """Small integers in [-5, 5]: every sum over up to 64 ranks is exact in float32."""
    return ((torch.arange(count, dtype=torch.int64) * 3 + rank * 7) % 11 - 5).to(torch.float32)


class Point:
    """The buffers of one op at one size on this rank, its check and its call."""

    def __init__(self, op: str, nbytes: int, rank: int, n: int):
        self.op, self.rank, self.n = op, rank, n
        if op in ("all_reduce", "broadcast"):
            self.block = self.count = max(1, nbytes // 4)
            self.inp = self.out = torch.empty(self.count)
        else:
            self.block = max(1, -(-nbytes // 4 // n))
            self.count = self.block * n
            big, small = torch.empty(self.count), torch.empty(self.block)
            self.inp, self.out = (small, big) if op == "all_gather" else (big, small)
        self.nbytes = self.count * 4

    def run(self, group):
        if self.op == "all_reduce":
            dist.all_reduce(self.out, group=group)
        elif self.op == "broadcast":
            dist.broadcast(self.out, group_src=0, group=group)
        elif self.op == "all_gather":
            dist.all_gather_into_tensor(self.out, self.inp, group=group)
        else:
            dist.reduce_scatter_tensor(self.out, self.inp, group=group)

    def expected(self) -> torch.Tensor:
        n, r = self.n, self.rank
        if self.op == "broadcast":
            return data(0, self.count)
        if self.op == "all_gather":
            return torch.cat([data(q, self.block) for q in range(n)])
        want = torch.zeros(self.count)
        for q in range(n):
            want += data(q, self.count)
        return want if self.op == "all_reduce" else want[r * self.block:(r + 1) * self.block].clone()

    def check(self, group, want) -> str | None:
        """Runs the op once on known data; None, or what was wrong."""
        self.inp.copy_(data(self.rank, self.inp.numel()))
        if self.out is not self.inp:
            self.out.fill_(-99.0)
        self.run(group)
        bad = (self.out != want).nonzero()
        if bad.numel():
            i = bad[0].item()
            return (f"{bad.numel()}/{want.numel()} elements wrong, e.g. [{i}] = {self.out[i].item()}, "
                    f"want {want[i].item()}")
        return None

    def zero(self):
        """Zeros stay zeros under repeated sums: timed ops never overflow."""
        self.inp.zero_()
        self.out.zero_()


def candidates(op: str, groups: dict) -> dict:
    """{name: group} for `op`; groups holds "gloo" and the collx algorithms."""
    if op == "all_reduce":
        return dict(groups)
    return {n: g for n, g in groups.items() if n in ("gloo", "auto")}


def timed_turn(point, group, k):
    """One untimed op (a re-warm after the other candidates), then k timed:
    seconds per op on this rank."""
    point.run(group)
    t0 = time.monotonic()
    for _ in range(k):
        point.run(group)
    return (time.monotonic() - t0) / k


def pick_k(point, group, turn_seconds):
    """Timed ops per turn, the same on every rank: from the slowest rank's
    time of one op (after an untimed one)."""
    t = agreed_max(timed_turn(point, group, 1))
    return int(min(MAX_K, max(1, round(turn_seconds / max(t, 1e-9)))))


def run_point(op, nbytes, groups, args, rank, n):
    """Checks then times `op` at `nbytes` on every candidate; rank 0's row."""
    point = Point(op, nbytes, rank, n)
    want = point.expected()
    names, errors = [], {}
    for name, g in candidates(op, groups).items():
        err = point.check(g, want)
        if agreed_max(1.0 if err else 0.0):
            errors[name] = err or "wrong on another rank"
            print(f"[rank {rank}] WRONG {name} {op} {point.nbytes} B: {errors[name]}", file=sys.stderr, flush=True)
        else:
            names.append(name)
    row = {"op": op, "bytes": point.nbytes, "errors": errors, "checked": names, "times": {}, "labels": {}}
    if args.rounds <= 0 or not names:
        return row
    point.zero()
    ks = {name: pick_k(point, groups[name], args.turn_seconds) for name in names}
    before = {name: _stats(groups[name]) for name in names if name != "gloo"}
    turns = {name: (lambda g=groups[name], k=ks[name]: timed_turn(point, g, k)) for name in names}
    row["times"] = interleaved_turns(turns, args.rounds)
    row["k"] = ks
    for name, b in before.items():
        grown = stats_gained(b, _stats(groups[name]))
        row["labels"][name] = max(grown, key=lambda x: grown[x]["calls"]) if grown else "?"
    return row


def _stats(group):
    import torchcollx
    return torchcollx.get_stats(group)["algorithms"]


def make_groups(algos):
    """gloo (the default group) and one collx group per algorithm, auto first."""
    import torchcollx
    groups = {"gloo": dist.group.WORLD}
    for a in algos:
        groups[a] = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=a))
    return groups


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="all_reduce")
    p.add_argument("--sizes", default="4,64K,1M,16M")
    p.add_argument("--algos", default="auto,ring,tree,hier")
    p.add_argument("--rounds", type=int, default=3, help="0: check only")
    p.add_argument("--turn-seconds", type=float, default=0.3)
    p.add_argument("--timeout", type=float, default=120, help="every group's timeout, seconds")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    result = {"rank": rank}
    code = 0
    try:
        timeout = datetime.timedelta(seconds=args.timeout)
        dist.init_process_group("gloo", timeout=timeout)
        n = dist.get_world_size()
        algos = [a for a in args.algos.split(",") if a]
        algos = ["auto"] + [a for a in algos if a != "auto"]
        groups = make_groups(algos)
        host = torch.tensor([int(os.environ.get("NETNS_HOST", -1))])
        hosts = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(hosts, host)
        import torchcollx
        result.update(world=n, netns_hosts=[int(h) for h in hosts],
                      collx_hosts=list(torchcollx.stats.backend_of(groups["auto"]).hosts), rows=[])
        for op in args.ops.split(","):
            for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
                result["rows"].append(run_point(op, nbytes, groups, args, rank, n))
                if rank == 0:
                    print(f"done {op} {nbytes} B", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - reported through the file
        result["exception"] = traceback.format_exc()
        code = 1
    if rank == 0 or code:
        path = args.json if rank == 0 else f"{args.json}.rank{rank}"
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.rename(path + ".tmp", path)
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
