"""Ray Train's TorchTrainer on CPU over collx, selected by name only.

    python examples/ray_train.py [--backend collx] [--out weights.pt]

Starts a local Ray (no dashboard, no usage report, so it runs offline) with
two training workers. Ray's workers call init_process_group(BACKEND)
themselves; nothing here imports torchcollx: with the wheel installed, torch
finds "collx" through the package's entry point. The model, data and seed are
fixed, so a run on collx and one on gloo end with the same weights.

--out saves, from rank 0, {"state_dict", "backend", "world_size", "steps",
"replicas_agree", "torchcollx_file"}: the final weights (unwrapped from DDP),
the backend each worker trained on (checked on every worker), whether every
worker ended with the same weights, and where the backend's package was loaded
from.
"""
import argparse
import os
import sys
import tempfile

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import ray.train  # noqa: E402
import ray.train.torch  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


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


def train_fn(config):
    backend = dist.get_backend()
    rank = ray.train.get_context().get_world_rank()
    if backend != config["backend"]:
        raise RuntimeError(f"worker {rank} trains on {backend}, not {config['backend']}")
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    loader = ray.train.torch.prepare_data_loader(DataLoader(make_data(), batch_size=8, shuffle=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = 0
    for _ in range(config["epochs"]):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
    agree = replicas_agree(model.parameters())
    if rank == 0:
        print(f"backend {backend}, {dist.get_world_size()} ranks, {steps} steps", flush=True)
    if rank == 0 and config["out"]:
        torch.save({"state_dict": model.module.state_dict(), "backend": backend, "world_size": dist.get_world_size(),
                    "steps": steps, "replicas_agree": agree,
                    "torchcollx_file": getattr(sys.modules.get("torchcollx"), "__file__", None)}, config["out"])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="collx")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out", help="where rank 0 saves the final weights")
    args = p.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=True)
    try:
        with tempfile.TemporaryDirectory(prefix="ray_train_") as storage:
            trainer = TorchTrainer(
                train_fn,
                train_loop_config={"backend": args.backend, "epochs": args.epochs,
                                   "out": os.path.abspath(args.out) if args.out else None},
                torch_config=TorchConfig(backend=args.backend),
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                run_config=RunConfig(storage_path=storage, name="ray_train"))
            trainer.fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
