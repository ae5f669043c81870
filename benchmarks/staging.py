"""Where a staged CUDA all-reduce's time goes (issue 13's share: collx's time
on CPU tensors over its time on CUDA tensors). Per size, timed interleaved in
one run, every rank on cuda:0:

  cuda             the all-reduce of a CUDA tensor (the default staging)
  cuda/<setting>   the same under another staging setting (its own group)
  cpu              the all-reduce of a pageable CPU tensor (the floor)
  cpu pinned       the same on a pinned CPU tensor, like the staging's mirrors
  copies           D2H into a pinned buffer, sync, H2D back, sync: the copies
                   alone, every rank at once, no collective

    torchrun --nproc_per_node=2 benchmarks/staging.py [--sizes 1M,16M,64M]

--device cpu (no GPU) stages CPU tensors instead (COLLX_STAGE_CPU_TENSORS),
a dry run of the script; its times say nothing about a GPU.
"""
import argparse
import os
import time
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist

import torchcollx  # noqa: F401  registers the "collx" backend
from bench_common import agreed_max, interleaved, parse_size, run_ops

# Staging settings timed beside the default, each on a group of its own
# (collx reads them when a group is created).
SETTINGS = {
    "chunk 4M": {"COLLX_STAGING_CHUNK_BYTES": str(4 << 20)},
    "chunk off": {"COLLX_STAGING_CHUNK_BYTES": "off"},  # no pipelining
}


def collx_group(values):
    with mock.patch.dict(os.environ, values):
        return dist.new_group(backend="collx")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1M,16M,32M,64M", help="comma list of byte sizes, K/M/G suffixes ok")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--time-per-point", type=float, default=0.15, help="seconds per row per round, about")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        staged = {}
    else:
        device = torch.device("cpu")
        staged = {"COLLX_STAGE_CPU_TENSORS": "1"}
    plain = collx_group({})
    groups = {"cuda": collx_group(staged)}
    groups.update({f"cuda/{name}": collx_group({**staged, **v}) for name, v in SETTINGS.items()})

    if rank == 0:
        print(f"# staged all_reduce  world_size={world}  torch={torch.__version__}  device={device}  "
              f"cpus={os.cpu_count()}  {'' if on_gpu else '(dry run: staged CPU tensors)'}")
        print("# time = median over rounds of the mean per op (max over ranks); share = cpu time / this time")
        print(f"{'size(B)':>12}  {'row':<16}{'time(us)':>10}{'share':>8}")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        n = size // 4
        data = torch.arange(n, dtype=torch.float32) % 7
        gpu = data.to(device)
        pageable = data.clone()
        pinned = data.pin_memory() if on_gpu else data.clone()
        host = torch.empty_like(pinned)

        def copies():
            host.copy_(gpu, non_blocking=True)
            if on_gpu:
                torch.cuda.current_stream().synchronize()
            gpu.copy_(host, non_blocking=True)
            if on_gpu:
                torch.cuda.current_stream().synchronize()

        rows = {name: (lambda g=g: run_ops(g, gpu, 1)) for name, g in groups.items()}
        rows["cpu"] = lambda: run_ops(plain, pageable, 1)
        rows["cpu pinned"] = lambda: run_ops(plain, pinned, 1)
        rows["copies"] = copies
        for fn in rows.values():  # warm up, and a first estimate of k
            fn()
        t0 = time.perf_counter()
        rows["cuda"]()
        k = max(3, min(200, int(args.time_per_point / max(time.perf_counter() - t0, 1e-6))))
        k = int(agreed_max(k))

        def turn(fn):
            fn()  # re-warm after the other rows
            dist.barrier()
            t = time.perf_counter()
            for _ in range(k):
                fn()
            return (time.perf_counter() - t) / k

        times = interleaved({name: (lambda fn=fn: turn(fn)) for name, fn in rows.items()}, args.rounds)
        if rank == 0:
            for name, t in times.items():
                share = f"{times['cpu'] / t:8.2f}" if name != "copies" else f"{'':>8}"
                print(f"{size:>12}  {name:<16}{t * 1e6:>10.1f}{share}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
