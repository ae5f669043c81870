"""Throughput of collx's reduce kernel beside torch's own a.add_(b).

    python benchmarks/kernels.py [--mb 256] [--device cuda|cpu]
    python benchmarks/kernels.py --device cpu --kb 64,256,512     # buffers in the CPU's caches

Counts bytes read and written (3 x the buffer for dst = dst + src), the way
memory bandwidth is quoted; on an H100 the target is >= 80% of ~3 TB/s.
"""
import argparse
import time

import torch

import torchcollx


def timed(fn, sync, iters):
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kb", help="comma list of buffer sizes in KiB, instead of --mb")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"# reduce kernel benchmark  device={dev}  torch={torch.__version__}  "
          f"cuda_kernels={torchcollx._C.cuda_kernels}")
    print(f"{'dtype':>10} {'op':>5} {'KiB':>8} {'collx GB/s':>11} {'torch GB/s':>11} {'collx/torch':>11}")
    sizes = [int(k) << 10 for k in args.kb.split(",")] if args.kb else [args.mb << 20]
    for nbytes in sizes:
        iters = max(args.iters, (1 << 28) // nbytes)  # small buffers: enough calls to time
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            n = nbytes // torch.tensor([], dtype=dtype).element_size()
            a = torch.ones(n, dtype=dtype, device=dev)
            b = torch.ones(n, dtype=dtype, device=dev)
            moved = 3 * a.nbytes
            t_collx = timed(lambda: torchcollx._C.reduce_into(a, b, "sum"), sync, iters)
            t_torch = timed(lambda: a.add_(b), sync, iters)
            print(f"{str(dtype).replace('torch.', ''):>10} {'sum':>5} {nbytes >> 10:>8} {moved / t_collx / 1e9:>11.1f} "
                  f"{moved / t_torch / 1e9:>11.1f} {t_torch / t_collx:>11.2f}")


if __name__ == "__main__":
    main()
