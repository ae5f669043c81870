"""collx beside DeepSpeed's CPU shared-memory all-reduce (the op CPU LLM
serving uses for tensor parallelism: deepspeed.comm.inference_all_reduce, its
shm_comm op) and gloo, in the same processes.

    make bench-setup    # installs deepspeed==0.19.8 beside the project's torch
    .venv/bin/torchrun --nproc_per_node=N benchmarks/vs_deepspeed.py [--sizes 1K,...,16M] [--rounds 3]

For each dtype (float32, bfloat16, float16) and size: every candidate's
result is checked first (rank r contributes (i % 8) + r + 1 at element i:
exact sums in every dtype here), then the three take turns in shuffled
rounds (bench_common.interleaved_turns), each turn long enough to time
(--time-per-turn), with the same number of ops on every rank. The table has
each candidate's median turn (time per op, the slowest rank's), collx over
DeepSpeed and gloo over collx; "paired" is the median over rounds of
collx's turn over DeepSpeed's turn of the same round.

DeepSpeed's op needs DS_ACCELERATOR=cpu and LOCAL_SIZE (the ranks on this
host; it segfaults without it) in its environment, which this script sets.
Its op reduces bf16 and fp16 only where the CPU has avx512bw (else it calls
torch's all_reduce on the default group: the table then says "fallback").
It leaves its shared-memory files in /dev/shm (named by the job's address,
port and rank); each rank removes its own at the end.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torchcollx  # noqa: E402,F401
from bench_common import agreed_max, interleaved_turns, paired_ratio, parse_size  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SIZES = "1K,4K,16K,64K,256K,1M,4M,16M"


def data(rank, numel, dtype):
    return (torch.arange(numel) % 8 + rank + 1).to(dtype)


def expected(n, numel, dtype):
    return (torch.arange(numel) % 8 * n + n * (n + 1) // 2).to(dtype)


def deepspeed_op():
    """DeepSpeed's shared-memory all-reduce, and whether it runs for bf16/fp16
    (its kernels there need avx512bw)."""
    import deepspeed.comm as ds
    from deepspeed.comm import comm
    ds.init_distributed(dist_backend="gloo")  # the default group exists: DeepSpeed only builds its op
    return ds.inference_all_reduce, getattr(comm.cdb, "shm_vector_kernel_level", 0)


def timed(op, buf, k):
    op(buf)  # a re-warm after the other candidates' turns
    t0 = time.perf_counter()
    for _ in range(k):
        op(buf)
    return (time.perf_counter() - t0) / k


def ops_per_turn(op, buf, seconds):
    """The same count on every rank: from the slowest rank's warm-up."""
    for _ in range(3):
        op(buf)
    per_op = agreed_max(timed(op, buf, 5))
    return max(3, min(20000, int(seconds / max(per_op, 1e-7))))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=SIZES)
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--time-per-turn", type=float, default=0.05, help="seconds of ops per turn")
    args = p.parse_args()
    shm_before = set(os.listdir("/dev/shm"))
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    collx = dist.new_group(backend="collx")
    ds_all_reduce, ds_level = deepspeed_op()
    candidates = {
        "deepspeed": ds_all_reduce,
        "collx": lambda t: dist.all_reduce(t, group=collx),
        "gloo": lambda t: dist.all_reduce(t),
    }
    if rank == 0:
        print(f"# n={n}, DeepSpeed vector kernel level {ds_level} (bf16/fp16 need 2), torch {torch.__version__}")
        print(f"{'dtype':9} {'size':>6} {'deepspeed us':>12} {'collx us':>9} {'gloo us':>9} "
              f"{'collx/ds':>8} {'paired':>7} {'gloo/collx':>10}")
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        fallback = dtype != torch.float32 and ds_level < 2
        for size in (parse_size(s) for s in args.sizes.split(",")):
            numel = size // dtype.itemsize
            for name, op in candidates.items():
                buf = data(rank, numel, dtype)
                op(buf)
                if not torch.equal(buf, expected(n, numel, dtype)):
                    raise SystemExit(f"rank {rank}: {name} gave a wrong {dname} all-reduce of {size} B")
            bufs = {name: data(rank, numel, dtype) for name in candidates}
            ks = {name: ops_per_turn(op, bufs[name], args.time_per_turn) for name, op in candidates.items()}
            turns = interleaved_turns({name: (lambda name=name: timed(candidates[name], bufs[name], ks[name]))
                                       for name in candidates}, args.rounds)
            med = {name: statistics.median(ts) * 1e6 for name, ts in turns.items()}
            if rank == 0:
                paired = paired_ratio(turns, "collx", "deepspeed")
                print(f"{dname:9} {size:>6} {med['deepspeed']:>12.1f} {med['collx']:>9.1f} {med['gloo']:>9.1f} "
                      f"{med['collx'] / med['deepspeed']:>8.2f} {paired:>7.2f} {med['gloo'] / med['collx']:>10.1f}"
                      + ("  (deepspeed: fallback)" if fallback else ""), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # DeepSpeed names this rank's file by the job's address, port and rank.
    mine = f"_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}_{rank}"
    for name in set(os.listdir("/dev/shm")) - shm_before:
        if name.endswith(mine):
            os.unlink(os.path.join("/dev/shm", name))


if __name__ == "__main__":
    main()
