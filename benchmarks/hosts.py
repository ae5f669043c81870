"""collx beside gloo across h emulated hosts: all_reduce, all_gather,
reduce_scatter and broadcast, with each host's NIC shaped by tc
(tests/netns.py).

The standard grid (issue 69), one job per line, all four ops:

    sudo .venv/bin/python benchmarks/hosts.py --grid

      2 hosts x 2 ranks, NIC 1 Gbit/s and 5 Gbit/s, 1, 16, 64 MiB
      2 hosts x 4 ranks, NIC 1 Gbit/s and 5 Gbit/s, 1, 16, 64 MiB
      2 hosts x 2 ranks, NIC 2 Gbit/s, each TCP flow capped at 0.5 Gbit/s, 1, 16, 64 MiB,
        with 1 socket per peer (the default) and 4 (COLLX_SOCKETS_PER_PEER)
      4 hosts x 1 rank and 4 hosts x 2 ranks, NIC 1 Gbit/s, 4 B to 16 MiB

One job:

    sudo .venv/bin/python benchmarks/hosts.py --hosts 2 --ranks-per-host 2 --rate 1gbit \\
        [--flow-cap 500mbit] [--sockets-per-peer 4] [--sizes 4,64K,1M,16M,64M] [--algos auto,ring,tree,hier] \\
        [--ops all_reduce,all_gather,reduce_scatter,broadcast] [--rounds 3] [--delay 50us --loss 0.1%]

Each job makes h namespaces on one bridge, shapes every NIC both ways, and
starts one torchrun per host (node rank = host index, rendezvous on host 0)
running benchmarks/hosts_worker.py, which checks every candidate's values,
then times the candidates alternating in rounds in the same processes
(its docstring has the rules). --ranks-per-host takes one count per host
for uneven hosts (e.g. 3,2).

Printed per op and size, for each candidate: what ran (collx's stats
label), the median over rounds of the slowest rank's time per op,
busbw = algbw x 2(n-1)/n (all_reduce), 1 (broadcast) or (n-1)/n (the
others), the NIC efficiency E = bound / time, where bound = 2(h-1)/h x S / B
for all_reduce, (h-1)/h x S / B for all_gather and reduce_scatter and S / B
for broadcast (S the size, B the shaped NIC rate in bytes/s: what the
busiest NIC must carry one way; from
64 KiB only), and time / gloo's; then a summary, one line per job, op and
size. tc counts whole frames and the ops move payload, so E cannot pass
about 0.956 (1448 payload bytes per 1514-byte frame).

Rules: each job calibrates collx in a fresh cache folder (XDG_CACHE_HOME,
removed after the job; --keep-cache for yours): the cache's key names the
interface, whose name here carries the pid, so every run would add files to
yours and none would ever be read again; and it does not name the link's
rate, so a cache from another rate would mislead auto.
Every job has a hard timeout (--timeout), after which its processes are
SIGKILLed; the namespaces are deleted whatever happens.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from netns import Hosts, NamespacesUnavailable, rate_bits  # noqa: E402

WORKER = os.path.join(HERE, "hosts_worker.py")
ALL_OPS = "all_reduce,all_gather,reduce_scatter,broadcast"
BIG = "1M,16M,64M"
SMALL = "4,64,1K,16K,64K,1M,16M"
E_MIN_BYTES = 64 << 10
GRID = [dict(hosts=2, ranks="2", rate="1gbit", sizes=BIG), dict(hosts=2, ranks="2", rate="5gbit", sizes=BIG),
        dict(hosts=2, ranks="4", rate="1gbit", sizes=BIG), dict(hosts=2, ranks="4", rate="5gbit", sizes=BIG),
        dict(hosts=2, ranks="2", rate="2gbit", flow_cap="500mbit", sizes=BIG),
        dict(hosts=2, ranks="2", rate="2gbit", flow_cap="500mbit", sockets=4, sizes=BIG),
        dict(hosts=4, ranks="1", rate="1gbit", sizes=SMALL), dict(hosts=4, ranks="2", rate="1gbit", sizes=SMALL)]


# ------------------------------------------------------------------ a job

def ranks_per_host(spec: str, h: int) -> list[int]:
    counts = [int(x) for x in str(spec).split(",")]
    counts = counts * h if len(counts) == 1 else counts
    if len(counts) != h or min(counts) < 1:
        raise SystemExit(f"--ranks-per-host {spec}: one count, or one per host ({h})")
    return counts


def job_env(cache: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    env.pop("COLLX_ALGORITHM", None)
    env.pop("COLLX_SOCKETS_PER_PEER", None)
    if cache:
        env["XDG_CACHE_HOME"] = cache
    return env


def wait_all(procs, deadline) -> bool:
    """Until every torchrun has exited (True) or the deadline (False)."""
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs):
            return True
        time.sleep(0.2)
    return False


def rank_errors(tmp) -> str:
    """The exceptions the other ranks wrote (result.json.rank<r>)."""
    out = []
    for name in sorted(os.listdir(tmp)):
        if name.startswith("result.json.rank") and not name.endswith(".tmp"):
            with open(os.path.join(tmp, name)) as f:
                out.append(f"rank {name.removeprefix('result.json.rank')}: {json.load(f).get('exception')}")
    return "\n".join(out)


def run_job(job: dict, args) -> dict:
    """One job in fresh namespaces; the worker's rank 0 result, with the
    job's settings, or {"error": ...}."""
    h, counts = job["hosts"], ranks_per_host(job["ranks"], job["hosts"])
    tmp = tempfile.mkdtemp(prefix="collx_hosts_")
    out = os.path.join(tmp, "result.json")
    worker_args = ["--ops", job.get("ops", args.ops), "--sizes", job["sizes"], "--algos", args.algos,
                   "--rounds", str(args.rounds), "--turn-seconds", str(args.turn_seconds),
                   "--timeout", str(args.group_timeout), "--json", out]
    res = {"error": None}
    try:
        with Hosts(h) as hosts:
            if job.get("rate"):
                hosts.shape(job["rate"], flow_cap=job.get("flow_cap"), delay=args.delay, loss=args.loss)
            env = job_env(None if args.keep_cache else os.path.join(tmp, "cache"))
            if job.get("sockets"):
                env["COLLX_SOCKETS_PER_PEER"] = str(job["sockets"])
            procs = hosts.torchrun(WORKER, worker_args, env, port=args.port, nproc=counts, log_dir=tmp)
            finished = wait_all(procs, time.monotonic() + args.timeout)
            hosts.close()  # SIGKILLs whatever still runs
            for p in procs:
                p.wait(timeout=30)
            if os.path.exists(out):
                with open(out) as f:
                    res = json.load(f)
                res.setdefault("error", res.get("exception"))
            if not os.path.exists(out) or res["error"]:
                why = "timed out" if not finished else f"torchrun exits {[p.returncode for p in procs]}"
                res["error"] = f"{why}; {res.get('error') or rank_errors(tmp) or 'rank 0 wrote nothing'}\n" \
                               f"{hosts.logs(tmp)}"
    except NamespacesUnavailable as e:
        res = {"error": f"cannot create network namespaces: {e}"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["job"] = dict(job, ranks=counts)
    return res


# ------------------------------------------------------------------ report

def fmt_size(b: int) -> str:
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if b >= div and b % div == 0:
            return f"{b // div}{unit}"
    return str(b)


def fmt_time(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


def derived(op: str, nbytes: int, seconds: float, n: int, h: int, nic_bytes_per_s: float | None) -> dict:
    """busbw (GB/s), and the bound and E: None without a shaped NIC, with one
    host, or below E_MIN_BYTES, where latency, not the NIC, sets the time."""
    factor = 2 * (n - 1) / n if op == "all_reduce" else 1 if op == "broadcast" else (n - 1) / n
    # What the busiest NIC must carry one way: a broadcast's every other host
    # receives the whole buffer.
    host_share = 1 if op == "broadcast" else (2 if op == "all_reduce" else 1) * (h - 1) / h
    shaped = nic_bytes_per_s and h > 1 and nbytes >= E_MIN_BYTES
    bound = host_share * nbytes / nic_bytes_per_s if shaped else None
    return {"busbw": nbytes / seconds * factor / 1e9, "bound": bound, "E": bound / seconds if bound else None}


def title(job: dict) -> str:
    counts = job["ranks"]
    shape = f"NIC {job['rate']}" if job.get("rate") else "unshaped"
    if job.get("flow_cap"):
        shape += f", flow cap {job['flow_cap']}"
    if job.get("sockets"):
        shape += f", {job['sockets']} sockets per peer"
    layout = f"{job['hosts']} hosts x {counts[0]}" if len(set(counts)) == 1 else "+".join(map(str, counts))
    return f"{layout} ranks, {shape}"


def report(res: dict, rounds: int, file=sys.stdout):
    job = res["job"]
    print(f"\n=== {title(job)} ===", file=file)
    if res.get("error"):
        print(f"FAILED: {res['error']}", file=file)
        return
    n, h = res["world"], job["hosts"]
    nic = rate_bits(job["rate"]) / 8 if job.get("rate") else None
    print(f"world {n}, ranks' hosts {res['netns_hosts']}, collx sees hosts {res['collx_hosts']}; "
          f"median of {rounds} rounds of the slowest rank's time per op", file=file)
    head = f"{'op':<15}{'size':>6}  {'candidate':<10}{'ran':<24}{'time':>11}{'busbw GB/s':>11}{'E':>6}{'/gloo':>7}"
    print(head, file=file)
    for row in res["rows"]:
        for line in row_lines(row, n, h, nic):
            print(line, file=file)


def row_lines(row, n, h, nic) -> list[str]:
    op, size = row["op"], row["bytes"]
    lines = [f"{op:<15}{fmt_size(size):>6}  {name:<10}WRONG: {err}" for name, err in row["errors"].items()]
    if not row["times"]:
        lines.append(f"{op:<15}{fmt_size(size):>6}  values right: {', '.join(row['checked']) or 'none'}")
    med = {name: statistics.median(ts) for name, ts in row["times"].items()}
    gloo = med.get("gloo")
    for name, t in med.items():
        d = derived(op, size, t, n, h, nic)
        e = f"{d['E']:6.2f}" if d["E"] is not None else f"{'-':>6}"
        vs = f"{t / gloo:7.2f}" if gloo and name != "gloo" else f"{'':>7}"
        ran = row["labels"].get(name, "")
        lines.append(f"{op:<15}{fmt_size(size):>6}  {name:<10}{ran:<24}{fmt_time(t):>11}{d['busbw']:>11.3f}{e}{vs}")
    forced = {k: v for k, v in med.items() if k not in ("gloo", "auto")}
    if "auto" in med and forced:
        best = min(forced, key=forced.get)
        lines.append(f"{'':<23}auto / best forced ({best}): {med['auto'] / forced[best]:.2f}")
    return lines


def summary(results, file=sys.stdout):
    """One line per job, op and size: gloo, auto, the best forced algorithm,
    the bound, auto's E, auto / gloo and auto / best (the issue's table)."""
    print(f"\n{'cell':<34}{'op':<15}{'size':>6}{'gloo':>11}{'auto':>11}  {'best forced':<20}{'bound':>11}"
          f"{'E auto':>7}{'/gloo':>7}{'/best':>7}", file=file)
    for res in results:
        if res.get("error"):
            print(f"{title(res['job']):<34}FAILED", file=file)
            continue
        job, n = res["job"], res["world"]
        nic = rate_bits(job["rate"]) / 8 if job.get("rate") else None
        for row in res["rows"]:
            med = {k: statistics.median(v) for k, v in row["times"].items()}
            if "auto" not in med or "gloo" not in med:
                continue
            d = derived(row["op"], row["bytes"], med["auto"], n, job["hosts"], nic)
            forced = {k: v for k, v in med.items() if k not in ("gloo", "auto")}
            best = min(forced, key=forced.get) if forced else None
            cols = [f"{fmt_time(med['gloo']):>11}", f"{fmt_time(med['auto']):>11}",
                    f"  {f'{best} {fmt_time(forced[best])}' if best else '-':<20}",
                    f"{fmt_time(d['bound']) if d['bound'] else '-':>11}",
                    f"{d['E']:7.2f}" if d["E"] is not None else f"{'-':>7}",
                    f"{med['auto'] / med['gloo']:7.2f}",
                    f"{med['auto'] / forced[best]:7.2f}" if best else f"{'-':>7}"]
            print(f"{title(job):<34}{row['op']:<15}{fmt_size(row['bytes']):>6}" + "".join(cols), file=file)


# ------------------------------------------------------------------ main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", action="store_true", help="run the standard grid (above) and nothing else")
    p.add_argument("--hosts", type=int, default=2, choices=range(1, 9), metavar="H")
    p.add_argument("--ranks-per-host", default="2", help="one count, or one per host (uneven: 3,2)")
    p.add_argument("--rate", default="1gbit", help="each NIC's rate, tc syntax; '' for unshaped")
    p.add_argument("--flow-cap", default=None, help="per-TCP-flow cap, tc syntax (e.g. 500mbit)")
    p.add_argument("--sockets-per-peer", type=int, default=None, help="COLLX_SOCKETS_PER_PEER for collx")
    p.add_argument("--delay", default=None, help="netem delay per host egress (RTT = 2x), where the kernel has it")
    p.add_argument("--loss", default=None, help="netem loss per host egress (e.g. 0.1%%), where the kernel has it")
    p.add_argument("--sizes", default="4,64K,1M,16M,64M")
    p.add_argument("--algos", default="auto,ring,tree,hier", help="collx all-reduce candidates (auto always)")
    p.add_argument("--ops", default=ALL_OPS)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (0: check values only)")
    p.add_argument("--turn-seconds", type=float, default=0.3, help="about how long one candidate's turn lasts")
    p.add_argument("--timeout", type=float, default=1200, help="hard limit per job, seconds")
    p.add_argument("--group-timeout", type=float, default=180, help="the groups' timeout, seconds")
    p.add_argument("--port", type=int, default=29650, help="rendezvous port on host 0 (inside its namespace)")
    p.add_argument("--keep-cache", action="store_true", help="calibrate into your cache, not a fresh one")
    p.add_argument("--link-check", action="store_true", help="first check the emulated link (hosts_link.py)")
    p.add_argument("--json", default=None, help="also write every job's results here")
    return p.parse_args(argv)


def main():
    args = parse_args()
    if args.grid:
        jobs, args.link_check = [dict(j) for j in GRID], True
    else:
        jobs = [dict(hosts=args.hosts, ranks=args.ranks_per_host, rate=args.rate or None,
                     flow_cap=args.flow_cap, sockets=args.sockets_per_peer, sizes=args.sizes)]
    if args.link_check:
        import hosts_link
        print("emulated link (benchmarks/hosts_link.py):")
        hosts_link.report(hosts_link.check("1gbit", "250mbit"))
    results = []
    for job in jobs:
        t0 = time.monotonic()
        res = run_job(job, args)
        report(res, args.rounds)
        print(f"(job took {time.monotonic() - t0:.0f} s)", flush=True)
        results.append(res)
    summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if any(r.get("error") for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
