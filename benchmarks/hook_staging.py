"""CUDA buckets in the DDP comm hook: the hook's own staging against the backend's.

    torchrun --nproc_per_node=2 benchmarks/hook_staging.py [--sizes 1M,25M] [--iters 20]

Two ways to average a CUDA gradient bucket over a collx group:

  hook staging     torchcollx.ddp._cuda_hook: the hook copies the bucket (or its
                   16-bit cast, made on the GPU) into a pinned host buffer kept
                   across steps, all-reduces that, and copies back in the future.
  backend staging  torchcollx.ddp._reduce_in_place: the bucket (or its cast) goes
                   to the backend as a CUDA tensor, and the backend stages it
                   (its pipelined device path, reductions on the GPU when large).

Each point is a bucket handed to the path and waited for (future, then the
device), timed from a common start on every rank; a point's time is the slowest
rank's. The two paths alternate call by call, so a disturbance hits both alike.
The table gives the median per path and backend/hook (< 1: the backend is faster).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import torchcollx  # noqa: F401  registers the "collx" backend
from torchcollx import ddp
from bench_common import parse_size


class Bucket:  # the two methods of dist.GradBucket the hook reads
    def __init__(self, index, buf):
        self._index, self._buf = index, buf

    def index(self):
        return self._index

    def buffer(self):
        return self._buf


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256K,4M,25M,64M", help="bucket bytes (float32), K/M suffixes ok")
    p.add_argument("--iters", type=int, default=20, help="timed calls per path and point")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()

    dist.init_process_group("collx")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")  # the timer's barrier and max, apart from the timed group
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    paths = {"hook staging": ddp._cuda_hook, "backend staging": ddp._reduce_in_place}  # comm_hook: the latter
    if rank == 0:
        print(f"# {world} ranks on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
        print(f"{'bytes':>10} {'compression':>11} {'hook us':>10} {'backend us':>11} {'backend/hook':>13}")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        for compression in (None, "bf16"):
            state = ddp.CommHookState(None, "auto", compression)
            buf = torch.randn(size // 4, device=dev)
            times = {name: [] for name in paths}
            for it in range(args.warmup + args.iters):
                for name, path in paths.items():
                    torch.cuda.synchronize()
                    dist.barrier(group=gloo)
                    t0 = time.perf_counter()
                    path(state, Bucket(0, buf), buf).wait()
                    torch.cuda.synchronize()
                    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
                    if it >= args.warmup:
                        times[name].append(t.item() * 1e6)
            hook, backend = (statistics.median(times[n]) for n in paths)
            if rank == 0:
                print(f"{size:>10} {str(compression):>11} {hook:>10.0f} {backend:>11.0f} {backend / hook:>13.2f}",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
