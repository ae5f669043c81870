"""Bytes across the wire: hierarchical against flat ring all-reduce on two "hosts".

    sudo .venv/bin/python benchmarks/two_hosts.py [--size-mb 16] [--iters 10] [--nproc 2] [--rate 1gbit]

Makes two network namespaces, each with a veth on one bridge (tests/netns.py), runs a
torchrun with --nproc ranks in each (collx bound to the veth), and has every
rank all-reduce a --size-mb float32 buffer --iters times with the ring, then
with hier (tests/two_hosts_worker.py --mode bench). The veth's tx+rx byte
counters (read inside the namespace, so TCP/IP headers and ACKs included)
give what crossed between the hosts per all-reduce.

The model column is the payload alone: the flat ring over n = 2p ranks has two
links between the hosts, each carrying 2(n-1)/n of the buffer; hier's leaders'
ring over h = 2 hosts carries 2(h-1)/h = 1 buffer each way. The veth is a
memory copy, as fast as loopback, so without --rate the times show the cost
of the extra local steps rather than a slow network's savings; --rate limits
each direction of the wire with a tc token bucket (e.g. 1gbit).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from netns import NamespacesUnavailable, TwoHosts  # noqa: E402

WORKER = os.path.join(HERE, "..", "tests", "two_hosts_worker.py")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--nproc", type=int, default=2, help="ranks per host")
    p.add_argument("--rate", default=None, help="limit each direction of the wire, tc syntax (e.g. 1gbit)")
    p.add_argument("--timeout", type=float, default=300, help="hard limit for the whole run, seconds")
    args = p.parse_args()
    ws = 2 * args.nproc
    tmp = tempfile.mkdtemp(prefix="collx_two_hosts_bench_")
    try:
        with TwoHosts() as hosts:
            if args.rate:
                hosts.shape(args.rate)
            root = os.path.abspath(os.path.join(HERE, ".."))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
                       OMP_NUM_THREADS="1")
            worker_args = ["--mode", "bench", "--results", tmp, "--timeout", "60",
                           "--size-mb", str(args.size_mb), "--iters", str(args.iters)]
            procs = hosts.torchrun(WORKER, worker_args, env, port=29612, nproc=args.nproc, log_dir=tmp)
            deadline = time.monotonic() + args.timeout
            path = os.path.join(tmp, "rank0.json")
            while time.monotonic() < deadline and not os.path.exists(path):
                if all(pr.poll() is not None for pr in procs):
                    break
                time.sleep(0.2)
            if not os.path.exists(path):
                with open(os.path.join(tmp, "host0.log"), "rb") as f:
                    sys.exit("rank 0 reported nothing; host 0's log:\n" + f.read()[-3000:].decode("utf-8", "replace"))
            with open(path) as f:
                res = json.load(f)
    except NamespacesUnavailable as e:
        sys.exit(f"cannot create network namespaces: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if "exception" in res:
        sys.exit(res["exception"])
    m = res["measure"]
    size = m["ring"]["buffer_bytes"]
    model = {"ring": 2 * 2 * (ws - 1) / ws, "hier": 2 * 2 * (2 - 1) / 2}
    print(f"all-reduce of {size / 2**20:.0f} MiB float32, {ws} ranks on 2 namespaces ({args.nproc} + {args.nproc}), "
          f"{args.iters} iterations; wire: {args.rate or 'veth, unlimited'}; hosts seen: {res['hosts']}")
    print(f"{'algorithm':<10} {'bytes across veth / op':>24} {'÷ buffer':>9} {'model':>6} {'time / op':>11}")
    for algo in ("ring", "hier"):
        b, s = m[algo]["veth_bytes_per_op"], m[algo]["seconds_per_op"]
        print(f"{algo:<10} {b:>24,.0f} {b / size:>9.3f} {model[algo]:>6.3f} {s * 1e3:>8.1f} ms")
    print(f"hier / ring bytes: {m['hier']['veth_bytes_per_op'] / m['ring']['veth_bytes_per_op']:.3f}")


if __name__ == "__main__":
    main()
