"""One rank of tests/installed/test_torchrun_hosts.py, started by the wheel
venv's torchrun inside a network namespace (a "host") with COLLX_SOCKET_IFNAME
set to its veth. It never imports torchcollx: init_process_group("collx")
finds the backend through the installed package's entry point.

Checks all_reduce, all_gather and broadcast against values computed from the
ranks, and DDP steps on collx against the same steps on gloo in the same
processes; writes what it saw to RESULTS/rank{r}.json.
"""
import argparse
import datetime
import gc
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def data(rank, count, dtype=torch.float32):
    """Small integers: every sum is exact."""
    return ((torch.arange(count, dtype=torch.int64) * 3 + rank * 7) % 11 - 5).to(dtype)


def check_collectives(rank, ws, fails):
    for count in (1, 1000, 1 << 20):
        t = data(rank, count)
        dist.all_reduce(t)
        if not torch.equal(t, sum(data(r, count) for r in range(ws))):
            fails.append(f"all_reduce of {count} floats: wrong sum")
    for count in (3, 100000):
        out = [torch.empty(count, dtype=torch.int64) for _ in range(ws)]
        dist.all_gather(out, data(rank, count, torch.int64))
        if not all(torch.equal(o, data(r, count, torch.int64)) for r, o in enumerate(out)):
            fails.append(f"all_gather of {count} int64: wrong pieces")
    for src in (0, ws - 1):
        t = data(rank, 50000, torch.float64)
        dist.broadcast(t, src=src)
        if not torch.equal(t, data(src, 50000, torch.float64)):
            fails.append(f"broadcast of 50000 doubles from rank {src}: wrong values")


def check_ddp(rank, ws, fails, gloo):
    """3 SGD steps of DDP on collx (the default group) and on gloo, from the
    same initial weights on the same batches. With 4 ranks the two sum the
    gradients in different orders, so they agree to float64 rounding."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()

    models = {"collx": DDP(model()), "gloo": DDP(model(), process_group=gloo)}
    for name, m in models.items():
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(3):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x, y = (torch.randn(5, n, generator=gen, dtype=torch.float64) for n in (8, 1))
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(models["collx"].parameters(), models["gloo"].parameters()))
    if diff > 1e-12:
        fails.append(f"DDP: collx's weights differ from gloo's by {diff:.3g}")
    return diff


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--results", required=True)
    args = p.parse_args()
    # gloo binds where collx does: the hostname resolves to neither namespace
    os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ["COLLX_SOCKET_IFNAME"])

    res = {"fails": []}
    try:
        dist.init_process_group("collx", timeout=datetime.timedelta(seconds=60))  # a stuck op fails, and reports
        rank, ws = dist.get_rank(), dist.get_world_size()
        res.update(backend=dist.get_backend(), world_size=ws,
                   torchcollx_file=getattr(sys.modules.get("torchcollx"), "__file__", None))
        check_collectives(rank, ws, res["fails"])
        res["hosts"] = list(dist.group.WORLD._get_backend(torch.device("cpu")).hosts)
        res["ddp_max_diff"] = check_ddp(rank, ws, res["fails"], dist.new_group(backend="gloo"))
    except Exception:
        res["exception"] = traceback.format_exc()
    with open(os.path.join(args.results, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(res, f)
    gc.collect()  # the DDP models before their groups: gloo may abort at exit otherwise
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
