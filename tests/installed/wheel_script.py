"""What a user of the installed wheel runs under torchrun: it never imports
torchcollx. torch finds the backend "collx" through the package's entry
point. Every collective runs on collx and on a gloo group of the same ranks,
and the rank writes what differed (nothing, when all is well) to OUT/rank<r>.json.

    torchrun --nproc_per_node=2 wheel_script.py OUT
"""
import json
import os
import sys

import torch
import torch.distributed as dist


def inputs(rank, ws):
    return torch.arange(10, dtype=torch.float32) + 100 * rank, torch.arange(ws * 3, dtype=torch.int64) * (rank + 1)


def collectives(group, rank, ws):
    """Every collective on `group`; returns name -> result tensors. (torch's
    object collectives need numpy, which torch does not install.)"""
    f, i = inputs(rank, ws)
    out = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        t = f.clone()
        dist.all_reduce(t, op=op, group=group)
        out[f"all_reduce {op}"] = [t]
    t = i.clone()
    dist.all_reduce(t, group=group)
    out["all_reduce int64"] = [t]
    t = f.clone()
    dist.broadcast(t, src=1, group=group)
    out["broadcast"] = [t]
    lst = [torch.empty_like(f) for _ in range(ws)]
    dist.all_gather(lst, f, group=group)
    out["all_gather"] = lst
    big = torch.empty(ws * f.numel())
    dist.all_gather_into_tensor(big, f, group=group)
    out["all_gather_into_tensor"] = [big]
    rs = torch.empty(3, dtype=torch.int64)
    dist.reduce_scatter_tensor(rs, i, group=group)
    out["reduce_scatter_tensor"] = [rs]
    rs2 = torch.empty(3, dtype=torch.int64)
    dist.reduce_scatter(rs2, list(i.chunk(ws)), group=group)
    out["reduce_scatter"] = [rs2]
    t = f.clone()
    dist.reduce(t, dst=0, group=group)
    out["reduce"] = [t] if rank == 0 else []
    g = [torch.empty_like(f) for _ in range(ws)] if rank == 0 else None
    dist.gather(f, g, dst=0, group=group)
    out["gather"] = g or []
    s = torch.empty_like(f)
    dist.scatter(s, [f + k for k in range(ws)] if rank == 0 else None, src=0, group=group)
    out["scatter"] = [s]
    a2a = torch.empty_like(i)
    dist.all_to_all_single(a2a, i, group=group)
    out["all_to_all_single"] = [a2a]
    lst = [torch.empty(3, dtype=torch.int64) for _ in range(ws)]
    dist.all_to_all(lst, list(i.chunk(ws)), group=group)
    out["all_to_all"] = lst
    dist.barrier(group=group)
    peer = (rank + 1) % ws
    got = torch.empty_like(f)
    reqs = [dist.irecv(got, src=(rank - 1) % ws, group=group), dist.isend(f, dst=peer, group=group)]
    for r in reqs:
        r.wait()
    out["irecv/isend ring"] = [got]
    return out


def ddp_step(group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
    return list(model.state_dict().values())


def main():
    out_dir = sys.argv[1]
    imported_before = "torchcollx" in sys.modules
    dist.init_process_group("collx")
    rank, ws = dist.get_rank(), dist.get_world_size()
    report = {
        "imported_before_init": imported_before,
        "backend": dist.get_backend(),
        "torchcollx_file": getattr(sys.modules.get("torchcollx"), "__file__", None),
        "torchcollx_version": getattr(sys.modules.get("torchcollx"), "__version__", None),
        "differ": [],
    }
    gloo = dist.new_group(backend="gloo")
    sub = dist.new_group(backend="collx")
    report["subgroup_backend"] = dist.get_backend(sub)
    for name, group in (("default", None), ("new_group", sub)):
        mine, ref = collectives(group, rank, ws), collectives(gloo, rank, ws)
        for key in ref:
            if len(mine[key]) != len(ref[key]) or not all(torch.equal(a, b) for a, b in zip(mine[key], ref[key])):
                report["differ"].append(f"{name}: {key}: {mine[key]} vs gloo {ref[key]}")
    for a, b in zip(ddp_step(None), ddp_step(gloo)):
        if not torch.equal(a, b):
            report["differ"].append(f"DDP: {a} vs gloo {b}")
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
