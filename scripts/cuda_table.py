"""The CUDA all-reduce table of docs/cuda.md from one `gpu_check.sh OUT peers` run.

    python scripts/cuda_table.py DIR     # DIR: gpu_check.tar.gz unpacked

For n = 2 and 4, at each size, from the run's JSON rows (benchmarks/allreduce.py):
- busbw vs gloo: collx auto as it runs by default (staged on the host below
  COLLX_PEER_MIN_BYTES, through the peers' device buffers from it) over gloo,
  both on the same CUDA tensors;
- CPU time / CUDA time: collx on CPU tensors over collx by default on CUDA
  tensors (above 1: the CUDA tensor is faster);
- staged time / peers time: every op staged over every op through the peers'
  buffers.
"""
import json
import sys
from pathlib import Path

PEER_MIN_BYTES = 2 << 20  # COLLX_PEER_MIN_BYTES' default


def rows(path, name):
    data = json.loads(Path(path).read_text())
    return {r["bytes"]: r for r in data["rows"] if r["name"] == name}


def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def main(d):
    d = Path(d)
    lines = []
    for n in (2, 4):
        peers = rows(d / f"bench_peers_cuda_n{n}.json", "collx/auto")
        gloo = rows(d / f"bench_peers_cuda_n{n}.json", "gloo")
        staged = rows(d / f"bench_staged_cuda_n{n}.json", "collx/auto")
        cpu = rows(d / f"bench_peers_cpu_n{n}.json", "collx/auto")
        sizes = sorted(peers)
        if not lines:
            lines.append("| | " + " | ".join(size(b) for b in sizes) + " |")
            lines.append("|---" * (len(sizes) + 1) + "|")
        default = {b: (peers if b >= PEER_MIN_BYTES else staged)[b] for b in sizes}
        cells = {
            "busbw vs gloo": [f"{default[b]['busbw'] / gloo[b]['busbw']:.2f}x" for b in sizes],
            "CPU time / CUDA time": [f"{cpu[b]['time_us'] / default[b]['time_us']:.2f}" for b in sizes],
            "staged time / peers time": [f"{staged[b]['time_us'] / peers[b]['time_us']:.2f}" for b in sizes],
        }
        for label, row in cells.items():
            lines.append(f"| n={n}, {label} | " + " | ".join(row) + " |")
        lines.append(f"| n={n}, collx time (µs) | " + " | ".join(f"{default[b]['time_us']:.0f}" for b in sizes) + " |")
        lines.append(f"| n={n}, gloo time (µs) | " + " | ".join(f"{gloo[b]['time_us']:.0f}" for b in sizes) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
