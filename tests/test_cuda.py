"""Collectives on CUDA tensors, with 2 and 4 ranks sharing one GPU (cuda:0).

Skips cleanly without a GPU or without a CUDA build of collx. Every
collective is checked against locally computed values or against collx's
CPU path run on CPU copies of the same data in the same process. Stream
semantics: an input written by a slow kernel on the caller's stream is seen
whole, and the Future's callbacks see finished data.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torchcollx._C.cuda_kernels),
    reason="needs a GPU and a CUDA build of collx",
)

from collectives_common import _groups  # noqa: E402
from common import dtype_name, expected, gen, mismatch, ops_for, reduce_op, suite_test, tolerance  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8,
          torch.bool]
COUNTS = [0, 1, 7, 1000, 100003]
LARGE = 4 * 1024 * 1024 + 3  # float32: 16 MiB, pipelined (8, 8 MiB and 12 B)
# Whether this rank runs with reductions on the GPU (COLLX_DEVICE_REDUCE_MIN_BYTES).
ON_GPU = os.environ.get("COLLX_DEVICE_REDUCE_MIN_BYTES", "off") != "off"
DEV = torch.device("cuda", 0)
# Whether auto may all-reduce through the ranks' device buffers (COLLX_PEER_BUFFER_BYTES).
PEERS = os.environ.get("COLLX_PEER_BUFFER_BYTES", "") != "off"


def check_all_reduce_matrix(rank, ws, fail):
    for algo, group in _groups().items():
        for dtype in DTYPES:
            for op in ops_for(dtype):
                for count in COUNTS:
                    t = gen(rank, dtype, op, count).to(DEV)
                    dist.all_reduce(t, op=reduce_op(op), group=group)
                    rtol, atol = tolerance(dtype, op)
                    if m := mismatch(t.cpu(), expected(ws, dtype, op, count), rtol, atol):
                        fail(f"{algo} {op} {dtype_name(dtype)} count={count}: {m}")
        t = gen(rank, torch.float32, "SUM", LARGE, salt=1).to(DEV)
        dist.all_reduce(t, group=group)
        if m := mismatch(t.cpu(), expected(ws, torch.float32, "SUM", LARGE, salt=1)):
            fail(f"{algo} SUM float32 count={LARGE}: {m}")
        stats = torchcollx.get_stats(group)
        if stats["staged_ops"] != stats["ops"]:
            fail(f"{algo}: every op must be staged: {stats}")
        if not ON_GPU:  # the default: every reduction on the host
            if stats["device_reductions"]:
                fail(f"{algo}: reductions ran on the GPU without COLLX_DEVICE_REDUCE_MIN_BYTES: {stats}")
        # Every rank reduces in ring and direct (tree and star leave it to inner nodes).
        elif algo in ("ring", "direct") and stats["device_reductions"] <= 0:
            fail(f"{algo}: the large all_reduce ran no reduction on the GPU: {stats}")
        # The ring reduces into each rank's own buffer: on the GPU, into the tensor.
        elif algo == "ring" and stats["device_reductions_in_tensor"] <= 0:
            fail(f"ring: the large all_reduce ran no reduction into its tensor on the GPU: {stats}")
        # One host, one GPU: auto reduces through the ranks' mapped device
        # buffers (peer_allreduce.h), but AVG and PREMUL_SUM stage on the host.
        peers = stats["algorithms"].get("all_reduce/peers", {}).get("calls", 0)
        if algo == "auto" and PEERS and not peers:
            fail(f"auto: no all_reduce ran through the peers' device buffers: {stats}")
        if algo != "auto" and peers:
            fail(f"{algo}: all_reduce ran through the peers' device buffers: {stats}")


def check_noncontiguous_and_coalesced(rank, ws, fail):
    base = gen(rank, torch.float32, "SUM", 2000).to(DEV).view(40, 50)
    view = base[:, ::2]
    dist.all_reduce(view)
    want = expected(ws, torch.float32, "SUM", 2000).view(40, 50)
    if m := mismatch(base.cpu()[:, ::2], want[:, ::2]):
        fail(f"non-contiguous view: {m}")
    if m := mismatch(base.cpu()[:, 1::2], gen(rank, torch.float32, "SUM", 2000).view(40, 50)[:, 1::2]):
        fail(f"elements outside the view changed: {m}")
    ts = [gen(rank, torch.float64, "MAX", n, salt=i).to(DEV) for i, n in enumerate([7, 0, 5000])]
    with dist._coalescing_manager():
        for t in ts:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    for i, (t, n) in enumerate(zip(ts, [7, 0, 5000])):
        if m := mismatch(t.cpu(), expected(ws, torch.float64, "MAX", n, salt=i)):
            fail(f"_coalescing_manager all_reduce #{i}: {m}")


def check_caller_stream_order(rank, ws, fail):
    """The op waits for work queued before it on the caller's (side) stream."""
    side = torch.cuda.Stream()
    t = torch.zeros(1 << 20, device=DEV)
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time before the fill
        t.fill_(rank + 1)
        work = dist.all_reduce(t, async_op=True)
    work.wait()
    with torch.cuda.stream(side):
        got = t.cpu()  # ordered after the op on the stream that waited
    want = ws * (ws + 1) / 2
    if not bool((got == want).all()):
        fail(f"all_reduce after a slow fill on a side stream: got {got[:4].tolist()}..., want {want}")


def check_future_then(rank, ws, fail):
    t = gen(rank, torch.float32, "SUM", 300_000, salt=2).to(DEV)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    got = fut.wait().cpu()
    if m := mismatch(got, 2 * expected(ws, torch.float32, "SUM", 300_000, salt=2)):
        fail(f"Future.then on a CUDA all_reduce: {m}")


def _same_as_cpu(fail, what, cuda_out, cpu_out):
    for i, (a, b) in enumerate(zip(cuda_out, cpu_out)):
        if m := mismatch(a.cpu(), b):
            fail(f"{what} output #{i}, CUDA vs CPU path: {m}")


def check_moving_collectives(rank, ws, fail):
    """Each op on CUDA tensors vs the same op on CPU copies."""

    def both(fn, *tensor_lists):
        on_gpu = [[t.to(DEV, copy=True) for t in ts] for ts in tensor_lists]
        on_cpu = [[t.clone() for t in ts] for ts in tensor_lists]
        fn(*on_gpu)
        fn(*on_cpu)
        return on_gpu, on_cpu

    data = lambda n, salt=0: gen(rank, torch.float32, "SUM", n, salt)  # noqa: E731
    for root in range(ws):
        g, c = both(lambda ts: dist.broadcast(ts[0], src=root), [data(70001, root)])
        _same_as_cpu(fail, f"broadcast root={root}", g[0], c[0])
    g, c = both(lambda outs, ins: dist.all_gather(outs, ins[0]), [torch.zeros(1001) for _ in range(ws)], [data(1001)])
    _same_as_cpu(fail, "all_gather", g[0], c[0])
    g, c = both(lambda outs, ins: dist.all_gather_into_tensor(outs[0], ins[0]), [torch.zeros(ws * 90001)],
                [data(90001)])
    _same_as_cpu(fail, "all_gather_into_tensor", g[0], c[0])
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        g, c = both(lambda outs, ins: dist.reduce_scatter_tensor(outs[0], ins[0], op=op), [torch.zeros(50001)],
                    [data(ws * 50001, 3)])
        _same_as_cpu(fail, f"reduce_scatter_tensor {op}", g[0], c[0])
    g, c = both(lambda outs, ins: dist.reduce_scatter(outs[0], ins), [torch.zeros(30000)],
                [data(30000, 10 + r) for r in range(ws)])
    _same_as_cpu(fail, "reduce_scatter", g[0], c[0])
    g, c = both(lambda ts: dist.reduce(ts[0], dst=1), [data(200_000, 4)])
    _same_as_cpu(fail, "reduce (root 1; others unchanged)", g[0], c[0])
    splits = [(rank + r) % 3 for r in range(ws)]  # rows to rank r, zeros included
    in_splits = [(r + rank) % 3 for r in range(ws)]  # rows from rank r
    g, c = both(lambda outs, ins: dist.all_to_all_single(outs[0], ins[0], in_splits, splits),
                [torch.zeros(sum(in_splits), 5)], [data(sum(splits) * 5, 5).view(-1, 5)])
    _same_as_cpu(fail, "all_to_all_single (uneven)", g[0], c[0])
    g, c = both(lambda outs, ins: dist.all_to_all(outs, ins), [torch.zeros(77) for _ in range(ws)],
                [data(77, 20 + r) for r in range(ws)])
    _same_as_cpu(fail, "all_to_all", g[0], c[0])
    g, c = both(lambda outs, ins: dist.gather(ins[0], outs if rank == 0 else None, dst=0),
                [torch.zeros(333) for _ in range(ws)], [data(333, 6)])
    _same_as_cpu(fail, "gather", g[0], c[0])
    g, c = both(lambda outs, ins: dist.scatter(outs[0], ins if rank == 0 else None, src=0), [torch.zeros(444)],
                [data(444, 30 + r) for r in range(ws)])
    _same_as_cpu(fail, "scatter", g[0], c[0])

    def ring_p2p(outs, ins):
        ops = [dist.P2POp(dist.isend, ins[0], (rank + 1) % ws), dist.P2POp(dist.irecv, outs[0], (rank - 1) % ws)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    g, c = both(ring_p2p, [torch.zeros(120_000)], [data(120_000, 7)])
    _same_as_cpu(fail, "batch_isend_irecv ring", g[0], c[0])

    def ring_shift(outs, ins):  # gloo users' form: no batch, the receive posted first
        reqs = [dist.irecv(outs[0], (rank - 1) % ws), dist.isend(ins[0], (rank + 1) % ws)]
        for w in reqs:
            w.wait()

    g, c = both(ring_shift, [torch.zeros(1 << 20)], [data(1 << 20, 9)])
    _same_as_cpu(fail, "irecv/isend ring shift", g[0], c[0])
    if rank < 2:
        t = data(5000, 8).to(DEV) if rank == 0 else torch.zeros(5000, device=DEV)
        (dist.send if rank == 0 else dist.recv)(t, 1 - rank)
        if rank == 1 and (m := mismatch(t.cpu(), gen(0, torch.float32, "SUM", 5000, 8))):
            fail(f"send/recv: {m}")
    dist.barrier()


def check_mixed_devices_error(rank, ws, fail):
    outs = [torch.zeros(4, device=DEV) for _ in range(ws)]
    try:
        dist.all_gather(outs, torch.zeros(4))
    except dist.DistBackendError as e:
        if "one device" not in str(e) or "all_gather" not in str(e):
            fail(f"mixed devices: unclear error {e}")
    else:
        fail("all_gather with CUDA outputs and a CPU input did not raise")


def check_cpu_rank_beside_cuda_ranks(rank, ws, fail):
    """As gloo allows: rank 0 all-reduces a CPU tensor where the others pass
    CUDA tensors, once the group's peers' buffers are set up (4 MiB) and where
    staged tensors are pipelined (32 MiB). Every rank stages that op in one
    piece; the next all-CUDA op goes through the buffers again."""
    group = dist.new_group(backend="collx")
    for step, count in enumerate((1 << 20, 1 << 20, 8 << 20, 1 << 20)):
        cpu = step in (1, 2) and rank == 0
        t = gen(rank, torch.float32, "SUM", count, salt=step)
        t = t if cpu else t.to(DEV)
        dist.all_reduce(t, group=group)
        if m := mismatch(t.cpu(), expected(ws, torch.float32, "SUM", count, salt=step)):
            fail(f"step {step} ({'CPU' if cpu else 'CUDA'} tensor, count={count}): {m}")
    peers = torchcollx.get_stats(group)["algorithms"].get("all_reduce/peers", {}).get("calls", 0)
    if PEERS and peers != 2:
        fail(f"expected the first and last all_reduce through the peers' buffers, got {peers}")
    dist.destroy_process_group(group)


def check_ddp(rank, ws, fail):
    """DDP over collx on CUDA (ranks share cuda:0) matches one process on all the data."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ref.load_state_dict(model.state_dict())
    ddp = DDP(model.to(DEV), device_ids=[0], bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(ws)]
        ys = [x.sum(1, keepdim=True) for x in xs]
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(xs[rank].to(DEV)), ys[rank].to(DEV)).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    for (name, p), q in zip(ddp.module.named_parameters(), ref.parameters()):
        if m := mismatch(p.detach().cpu(), q.detach(), 1e-4, 1e-5):
            fail(f"DDP parameter {name} after 5 steps: {m}")



def check_profiler_shows_staging_copies(rank, ws, fail):
    """torch.profiler with CUDA activities sees a staged all-reduce whole: the
    c10d op on the host, collx's span over its run, and its copies to the
    pinned mirror and back, which collx makes on its own stream."""
    from torch.profiler import ProfilerActivity, profile

    t = torch.ones(1 << 18, device=DEV)  # 1 MiB: staged on the host, one piece
    dist.all_reduce(t)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.all_reduce(t)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    for want in ("c10d::allreduce_", "collx:all_reduce", "record_param_comms", "Memcpy DtoH", "Memcpy HtoD"):
        if not any(want in n for n in names):
            fail(f"no {want!r} event in the trace of a staged all_reduce: {sorted(names)[:40]}")
    if m := mismatch(t.cpu(), torch.full((1 << 18,), float(ws) ** 2)):
        fail(f"all_reduce under the profiler: {m}")

CHECKS = [
    check_all_reduce_matrix,
    check_noncontiguous_and_coalesced,
    check_caller_stream_order,
    check_future_then,
    check_moving_collectives,
    check_mixed_devices_error,
    check_cpu_rank_beside_cuda_ranks,
    check_ddp,
    check_profiler_shows_staging_copies,
]


def _use_gpu0():
    torch.cuda.set_device(0)


test_cuda = suite_test(__name__, "CHECKS", [2, 4], setup="_use_gpu0", timeout=300)

# Every reduction on the GPU, whatever its size (counts 1, 7, ...), into the
# tensor or device scratch: the path COLLX_DEVICE_REDUCE_MIN_BYTES turns on.
ALL_ON_GPU_CHECKS = [check_all_reduce_matrix, check_moving_collectives]
test_cuda_every_reduction_on_gpu = suite_test(__name__, "ALL_ON_GPU_CHECKS", [2], setup="_use_gpu0", timeout=300,
                                              env={"COLLX_DEVICE_REDUCE_MIN_BYTES": "0"})


# The all-reduce through peers' device buffers at every size, in 1 MiB chunks
# (the large tensor in 17), and, for comparison, every all-reduce staged on
# the host.
test_cuda_peer_chunks = suite_test(__name__, "ALL_ON_GPU_CHECKS", [2], setup="_use_gpu0", timeout=300,
                                   env={"COLLX_PEER_BUFFER_BYTES": "1048576", "COLLX_PEER_MIN_BYTES": "0"})
test_cuda_without_peers = suite_test(__name__, "CHECKS", [2], setup="_use_gpu0", timeout=300,
                                     env={"COLLX_PEER_BUFFER_BYTES": "off"})


def _split_group(rank, ws):
    """split_group needs a default group bound to an accelerator (device_id)."""
    import os

    dist.init_process_group("collx", init_method=os.environ["COLLX_TEST_INIT_METHOD"], rank=rank, world_size=ws,
                            device_id=DEV)
    halves = dist.split_group(split_ranks=[[0, 1], [2, 3]])
    mine = [0, 1] if rank < 2 else [2, 3]
    t = torch.full((300_000,), float(rank + 1), device=DEV)
    dist.all_reduce(t, group=halves)
    ok = bool((t == sum(r + 1 for r in mine)).all())
    pair = dist.new_group([1, 2])  # non-members take part in the split source's no-color split
    if rank in (1, 2):
        u = torch.full((10,), float(rank), device=DEV)
        dist.all_reduce(u, group=pair)
        ok = ok and bool((u == 3).all())
    dist.destroy_process_group()
    return ok


def test_split_group_with_a_bound_device():
    from launcher import run_ranks

    assert run_ranks(_split_group, 4, timeout=180, init=False) == [True] * 4
