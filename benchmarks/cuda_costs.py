"""What one staged CUDA op costs before any byte moves: the CUDA calls the
staging makes, timed one by one, and a 4 KB all_reduce on a one-rank collx
group on CUDA and on CPU tensors (the floor of every staged op).

    python benchmarks/cuda_costs.py [--iters 2000]
"""
import argparse
import tempfile
import time

import torch
import torch.distributed as dist

import torchcollx  # noqa: F401  registers the "collx" backend


def per_call_us(fn, iters):
    for _ in range(10):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    stream = torch.cuda.Stream()
    small = torch.ones(1024, device=dev)
    host = torch.empty(1024, pin_memory=True)
    event = torch.cuda.Event()

    def d2h_sync():
        with torch.cuda.stream(stream):
            host.copy_(small, non_blocking=True)
        stream.synchronize()

    def record_sync():
        event.record(stream)
        event.synchronize()

    dist.init_process_group("collx", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    cpu = torch.ones(1024)
    calls = {
        "torch.cuda.Event() (create + destroy)": lambda: torch.cuda.Event(),
        "event record + synchronize": record_sync,
        "synchronize an idle stream": stream.synchronize,
        "pinned 4 KB empty (caching host allocator)": lambda: torch.empty(1024, pin_memory=True),
        "4 KB D2H + stream synchronize": d2h_sync,
        "4 KB all_reduce, one-rank collx group, CPU tensor": lambda: dist.all_reduce(cpu),
        "4 KB all_reduce, one-rank collx group, CUDA tensor": lambda: dist.all_reduce(small),
    }
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; microseconds per call")
    for name, fn in calls.items():
        print(f"{per_call_us(fn, args.iters):10.1f}  {name}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
