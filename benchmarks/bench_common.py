"""Helpers shared by the benchmark scripts (sizes, iteration bounds, a max
over ranks through the gloo default group, what a collx group's stats
gained, timed all-reduces, the interleaved rounds, and torchrun jobs whose
rank 0 writes JSON)."""
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MIN_ITERS, MAX_ITERS = 5, 1000


def parse_size(s):
    """'4', '64K', '16MB', '1.5M' -> bytes."""
    s = s.strip().upper().removesuffix("B")
    unit = s[-1] if s and s[-1] in "KMG" else ""
    return int(float(s[: len(s) - len(unit)]) * UNITS[unit])


def parse_sizes(spec, max_size, smallest):
    """A comma list of sizes (default: powers of 4 from 4 B), clipped to [smallest, max_size]."""
    sizes = [parse_size(s) for s in spec.split(",")] if spec else [4 ** k for k in range(1, 14)]
    return sorted({s for s in sizes if smallest <= s <= parse_size(max_size)})


def _agreed(xs, op):
    t = torch.tensor(xs, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist() if len(xs) > 1 else t.item()


def agreed_max(*xs):
    """Elementwise max of floats over all ranks, via the gloo default group."""
    return _agreed(xs, dist.ReduceOp.MAX)


def agreed_sum(*xs):
    """Elementwise sum of floats over all ranks, via the gloo default group."""
    return _agreed(xs, dist.ReduceOp.SUM)


def compare_to_gloo(row, gloo_row, is_gloo):
    """Fills row's vs_gloo (time ratio) and busbw_x (busbw ratio) from the
    gloo row of the same point; a gloo row (is_gloo) becomes the reference.
    Returns the gloo row to compare the next rows with."""
    if is_gloo:
        return row
    if gloo_row:
        row["vs_gloo"] = row["time_us"] / gloo_row["time_us"]
        row["busbw_x"] = row["busbw"] / gloo_row["busbw"]
    return gloo_row


def stats_gained(before, after):
    """The calls and seconds each of torchcollx.get_stats()["algorithms"]'s
    entries gained from `before` to `after`, those that ran only."""
    out = {}
    for k, v in after.items():
        calls = v["calls"] - before.get(k, {}).get("calls", 0)
        if calls:
            out[k] = {"calls": calls, "seconds": v["seconds"] - before.get(k, {}).get("seconds", 0.0)}
    return out


def run_ops(group, buf, k, algorithm=None):
    """k back-to-back all_reduces; returns the k+1 timestamps around them
    (for CUDA tensors, each op counts until its result is on the device).
    With `algorithm`, on a collx group: each op runs that algorithm
    (allreduce_with; "auto" is the group's own choice, refined as usual)."""
    sync = torch.cuda.synchronize if buf.is_cuda else (lambda: None)
    if algorithm is None:
        op = lambda: dist.all_reduce(buf, group=group)  # noqa: E731
    else:
        backend = group._get_backend(buf.device)
        op = lambda: backend.allreduce_with(buf, algorithm, blocking=True)  # noqa: E731
    ts = [time.perf_counter()]
    for _ in range(k):
        op()
        sync()
        ts.append(time.perf_counter())
    return ts


def interleaved_turns(turns, rounds):
    """turns: {name: fn() -> seconds per op of one timed turn}. In each of
    `rounds` rounds every name takes a turn, in a new order each round,
    alike on every rank: the state one turn leaves lasts into the next one,
    and a rotation keeps every name behind the same one (n=3, 64 KiB: two
    ring groups, behind direct and behind tree, measured 151 and 167 us
    rotated, 138 and 139 us shuffled). Returns {name: [each round's turn,
    time per op, max over ranks]}, in seconds."""
    names = list(turns)
    per_round = {n: [] for n in names}
    for rnd in range(rounds):
        order = list(names)
        random.Random(rnd).shuffle(order)
        for n in order:
            per_round[n].append(turns[n]())
    flat = agreed_max(*[t for n in names for t in per_round[n]], 0.0)  # a list, even of one turn
    return {n: flat[i * rounds:(i + 1) * rounds] for i, n in enumerate(names)}


def interleaved(turns, rounds):
    """interleaved_turns(); {name: its median turn}."""
    return {n: statistics.median(ts) for n, ts in interleaved_turns(turns, rounds).items()}


def paired_ratio(turns, name, of):
    """The median over rounds of name's turn over `of`'s in the same round
    (interleaved_turns' lists): a ratio that a change of the machine's speed
    mode between rounds leaves as it is."""
    return statistics.median(a / b for a, b in zip(turns[name], turns[of]))


def interleaved_medians(groups, buf, rounds, k):
    """interleaved() over groups: {name: group, or (group, algorithm) for
    run_ops}; a group's turn is one untimed all-reduce of buf (a re-warm
    after the other groups), then k timed."""
    def turn(group, algorithm=None):
        run_ops(group, buf, 1, algorithm)
        ts = run_ops(group, buf, k, algorithm)
        return (ts[-1] - ts[0]) / k
    return interleaved({n: (lambda g=g: turn(*g) if isinstance(g, tuple) else turn(g)) for n, g in groups.items()},
                       rounds)


def launch_json(cmd, out, env=None):
    """Runs the job `cmd` (a launcher's command line that ends with
    `--json out`) from this folder, and returns what its rank 0 wrote to
    `out`. The job's output is shown only if it fails."""
    done = subprocess.run(cmd, env=dict(os.environ, **(env or {})), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=1800, cwd=Path(__file__).parent)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return json.loads(Path(out).read_text())


def cache_runs(repeats, job, labels=("first", "second")):
    """A job run against fresh calibration caches: each repeat makes a cache
    of its own (a folder for XDG_CACHE_HOME) and runs job(cache, order, out)
    once per label in turn, "first" calibrating and saving auto's choices and
    "second" starting from them; `order` (the repeat's parity) alternates.
    Returns {label: [job's result, one per repeat]}."""
    runs = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            cache = tempfile.mkdtemp(dir=tmp)
            for label in labels:
                runs[label].append(job(cache, i % 2, f"{tmp}/{label}{i}.json"))
            print(f"repeat {i + 1}/{repeats} done", file=sys.stderr)
    return runs


def torchrun_json(script, n, args, out, env=None):
    """launch_json of `script` under torchrun on n local ranks with `args`."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), f"--nproc_per_node={n}", str(script), *args, "--json", out]
    return launch_json(cmd, out, env)
