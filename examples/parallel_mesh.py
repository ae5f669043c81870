"""Data, tensor and pipeline parallel groups over collx with DeviceMesh.

    torchrun --nproc_per_node=8 examples/parallel_mesh.py

Eight ranks form a (pp=2, dp=2, tp=2) mesh. Along each dimension the example
runs the collective that parallelism uses and checks the result against
values computed locally:
  dp: all_reduce of gradients (average)
  tp: all_gather of activation shards, then reduce_scatter of their grads
  pp: send of activations from stage 0 to stage 1 (batch_isend_irecv)
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import torchcollx  # noqa: F401  registers the "collx" backend


def main():
    dist.init_process_group("collx")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 8, "run with --nproc_per_node=8"
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp, tp = mesh.get_group("pp"), mesh.get_group("dp"), mesh.get_group("tp")
    coords = mesh.get_coordinate()  # [pp, dp, tp] of this rank

    # Data parallel: average a "gradient" over the dp replicas.
    grad = torch.full((1000,), float(rank))
    dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=dp)
    dp_ranks = dist.get_process_group_ranks(dp)
    assert torch.allclose(grad, torch.full((1000,), sum(dp_ranks) / len(dp_ranks))), "dp all_reduce"

    # Tensor parallel: gather activation shards, reduce-scatter their gradients.
    tp_ranks = dist.get_process_group_ranks(tp)
    shard = torch.arange(4, dtype=torch.float32) + 100 * rank
    full = torch.empty(4 * len(tp_ranks))
    dist.all_gather_single(full, shard, group=tp)
    assert torch.equal(full, torch.cat([torch.arange(4, dtype=torch.float32) + 100 * r for r in tp_ranks])), "tp gather"
    grad_full = torch.ones(4 * len(tp_ranks)) * (rank + 1)
    grad_shard = torch.empty(4)
    dist.reduce_scatter_single(grad_shard, grad_full, group=tp)
    assert torch.equal(grad_shard, torch.ones(4) * sum(r + 1 for r in tp_ranks)), "tp reduce_scatter"

    # Pipeline parallel: stage 0 sends its activations to stage 1.
    pp_ranks = dist.get_process_group_ranks(pp)
    act = torch.full((256,), float(rank))
    if coords[0] == 0:
        ops = [dist.P2POp(dist.isend, act, pp_ranks[1], group=pp)]
    else:
        ops = [dist.P2POp(dist.irecv, act, pp_ranks[0], group=pp)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(act, torch.full((256,), float(pp_ranks[0]))), "pp send/recv"

    dist.barrier()
    if rank == 0:
        print(f"mesh {tuple(mesh.mesh.shape)} ({', '.join(mesh.mesh_dim_names)}): dp all_reduce, "
              "tp all_gather + reduce_scatter, pp send/recv all correct on 8 ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
