"""Hugging Face Accelerate on CPU over collx.

    torchrun --nproc_per_node=2 examples/accelerate_ddp.py [--backend collx] [--out weights.pt]

On CPU, Accelerate initializes the process group with gloo (or mpi) whatever
backend it is given, unless one already exists: then it adopts that one. So
the script creates the group first, init_process_group(BACKEND), and then
Accelerator(cpu=True). Accelerate's state keeps saying "gloo"; the model it
wraps in DDP runs on the group made here, which every rank checks. The script
never imports torchcollx: with the wheel installed, torch finds "collx"
through the package's entry point. The model, data and seed are fixed, so a
run on collx and one on gloo end with the same weights.

--out saves, from rank 0, {"state_dict", "backend", "world_size", "steps",
"replicas_agree", "torchcollx_file"}: the final weights, the backend of the
group DDP used, whether every rank ended with the same weights, and where the
backend's package was loaded from.
"""
import argparse
import gc
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def make_data(n=384, dim=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centers[labels] + 0.5 * torch.randn(n, dim, generator=g), labels)


def replicas_agree(params):
    """Whether every rank holds exactly these weights: DDP keeps its replicas
    equal, on ranks that saw different batches, only through its all-reduces."""
    hi = torch.cat([p.detach().reshape(-1) for p in params])
    lo = hi.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return torch.equal(hi, lo)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="collx")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out", help="where rank 0 saves the final weights")
    args = p.parse_args()

    dist.init_process_group(args.backend)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(make_data(), batch_size=8, shuffle=False))
    backend = dist.get_backend(model.process_group)  # the group of Accelerate's DDP
    if backend != args.backend or accelerator.num_processes != dist.get_world_size():
        raise RuntimeError(f"rank {dist.get_rank()}: Accelerate's DDP runs on {backend} over "
                           f"{accelerator.num_processes} processes, not on {args.backend} over {dist.get_world_size()}")
    steps = 0
    for _ in range(args.epochs):
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            steps += 1
    agree = replicas_agree(model.parameters())
    if accelerator.is_main_process:
        print(f"backend {backend}, {accelerator.num_processes} ranks, {steps} steps", flush=True)
        if args.out:
            torch.save({"state_dict": accelerator.unwrap_model(model).state_dict(), "backend": backend,
                        "world_size": accelerator.num_processes, "steps": steps, "replicas_agree": agree,
                        "torchcollx_file": getattr(sys.modules.get("torchcollx"), "__file__", None)}, args.out)
    # A DDP model that outlives its gloo group sometimes aborts the process at
    # exit ("terminate called without an active exception"), so the model goes
    # before end_training destroys the group.
    accelerator.wait_for_everyone()
    model, opt, loader = accelerator.free_memory(model, opt, loader)
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
