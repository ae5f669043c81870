"""Does a group's past slow its later ops? How far does one group's time wander?

History (the default): four collx groups forced to the same algorithm; two of
them first run a few large all-reduces. Then all four run all-reduces of
--size in shuffled interleaved rounds, and the script prints each group's
median time per op.

Measured on the 2-core machine, n=2 over TCP, ring, 1 MiB: the two groups that
had run five 64 MiB all-reduces took 1.3x the others' time (511-561 against
377-413 us), in both phases; over shared memory the four were alike. With
net.ipv4.tcp_wmem's maximum lowered from 4 MiB to 512 KiB all four took
404-433 us (a 1 MiB tcp_rmem maximum changed nothing): the send buffers that
autotuning grew for the large ops slow the later ones. collx now fixes the
send buffer of its connections within a host (rendezvous.cc); with that, the
four took 412-450 us. Run it to check for a regression:

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/group_history.py --size 1M

Phases (--algorithms ring,tree,star): one group per algorithm, timed in
interleaved rounds with turns of 1, 4 and 12 ops, twice over; each line is
one such phase, about --rounds ops per group. It shows how far an
algorithm's own time moves from one phase to the next, which bounds what
any comparison of algorithms can resolve there:

    .venv/bin/torchrun --nproc_per_node=3 benchmarks/group_history.py --size 64M --algorithms ring,tree,star

Measured on the 2-core machine, n=3 over TCP, 64 MiB: ring stayed at 50-54
ms an op in all six phases, while star took 41.7 ms in the first and 60-70
in the last three, and tree 44-69: which of them is fastest depends on
when it is asked, by more than 10%.

Each phase also prints the mean op's time inside the backend (what auto's
online refinement times), to see whether it ranks the algorithms as the time
from op to op does. Over shared memory at n=3, 16 KiB, with --algorithms
shm,direct --turns 16,256 --rounds 2048: the windows took 0.81-1.03x direct's
time op to op and 0.84-1.01x inside, in eight phases over two runs.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import torchcollx
from bench_common import agreed_sum, interleaved_medians, parse_size, run_ops


def history(args):
    opts = torchcollx.Options(algorithm=args.algorithms[0], transport=args.transport)
    names = ["fresh0", "fresh1", "large0", "large1"]
    groups = {n: dist.new_group(backend="collx", pg_options=opts) for n in names}
    big = torch.zeros(args.before // 4)
    for n in names[2:]:
        for _ in range(5):
            dist.all_reduce(big, group=groups[n])
    del big
    buf = torch.zeros(max(1, args.size // 4))
    for n in names:
        run_ops(groups[n], buf, 50)
    for phase in range(2):
        med = interleaved_medians(groups, buf, args.rounds, 5)
        if dist.get_rank() == 0:
            print(f"phase {phase}: " + "  ".join(f"{n} {t * 1e6:.0f} us" for n, t in med.items()), flush=True)


def in_backend(groups):
    """{algorithm: (seconds, calls)} of each forced group's all-reduces inside the backend."""
    out = {}
    for a, g in groups.items():
        s = torchcollx.get_stats(g)["algorithms"].get(f"all_reduce/{a}", {"seconds": 0.0, "calls": 0})
        out[a] = (s["seconds"], s["calls"])
    return out


def phases(args):
    groups = {a: dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=a, transport=args.transport))
              for a in args.algorithms}
    buf = torch.zeros(max(1, args.size // 4))
    for g in groups.values():
        run_ops(g, buf, 5)
    n = dist.get_world_size()
    for _ in range(2):
        for k in args.turns:
            before = in_backend(groups)
            med = interleaved_medians(groups, buf, max(3, args.rounds // k), k)
            after = in_backend(groups)
            # The mean op inside the backend, over the phase's ops and the ranks
            # (as the refiner agrees a time): beside the time from op to op, it
            # shows whether both rank the algorithms alike.
            inside = agreed_sum(*[(after[a][0] - before[a][0]) / max(1, after[a][1] - before[a][1]) / n
                                  for a in groups])
            if dist.get_rank() == 0:
                print(f"turns of {k:2d}: " + "  ".join(f"{a} {med[a] * 1e6:.1f} us ({t * 1e6:.1f} inside)"
                                                       for a, t in zip(groups, inside)), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=1 << 20, help="bytes of the timed all-reduces")
    p.add_argument("--before", type=parse_size, default=64 << 20, help="bytes of the large all-reduces first")
    p.add_argument("--algorithms", default="ring", help="one: the history; several: the phases")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--rounds", type=int, default=None, help="default 40 (history), 24 (phases)")
    p.add_argument("--turns", default="1,4,12", help="the phases' ops per turn, a comma list")
    args = p.parse_args()
    args.algorithms = args.algorithms.split(",")
    args.turns = [int(k) for k in args.turns.split(",")]
    dist.init_process_group("gloo")
    run = history if len(args.algorithms) == 1 else phases
    args.rounds = args.rounds or (40 if run is history else 24)
    run(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
