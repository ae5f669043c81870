"""Lightning DDP on CPU over collx, selected by name only.

    python examples/lightning_ddp.py [--backend collx] [--out weights.pt]

Lightning starts the second rank itself (devices=2). The script never imports
torchcollx: with the wheel installed, init_process_group("collx") finds the
backend through the package's entry point. The model, data and seed are fixed,
so a run on collx and one on gloo end with the same weights.

--out saves, from rank 0, {"state_dict", "backend", "world_size", "steps",
"replicas_agree", "torchcollx_file"}: the final weights, the backend each rank
trained on (checked on every rank), whether every rank ended with the same
weights, and where the backend's package was loaded from.
"""
import argparse
import gc
import sys

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.pytorch.strategies import DDPStrategy
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


class Classifier(L.LightningModule):
    def __init__(self, backend):
        super().__init__()
        self.expected_backend = backend
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def on_train_start(self):
        self.backend = dist.get_backend()
        if self.backend != self.expected_backend:
            raise RuntimeError(f"rank {self.global_rank} trains on {self.backend}, not {self.expected_backend}")

    def on_train_end(self):
        self.replicas_agree = replicas_agree(self.parameters())

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="collx")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out", help="where rank 0 saves the final weights")
    args = p.parse_args()

    L.seed_everything(0, verbose=False)
    model = Classifier(args.backend)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=args.backend),
                        max_epochs=args.epochs, deterministic=True, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(make_data(), batch_size=8, shuffle=False))
    if trainer.global_rank == 0:
        print(f"backend {model.backend}, {trainer.world_size} ranks, {trainer.global_step} steps", flush=True)
        if args.out:
            torch.save({"state_dict": model.state_dict(), "backend": model.backend, "world_size": trainer.world_size,
                        "steps": trainer.global_step, "replicas_agree": model.replicas_agree,
                        "torchcollx_file": getattr(sys.modules.get("torchcollx"), "__file__", None)}, args.out)
    # Lightning leaves the group to the script. Left to the interpreter's exit,
    # a gloo group sometimes aborts the process ("terminate called without an
    # active exception"), so the dropped DDP wrapper goes first, then the group.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
