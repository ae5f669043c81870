"""Groups of the collx backend and whole-stack runs:

  new_group subsets (members and non-members), overlapping groups with async
  ops, new_subgroups and one-rank groups, at world sizes 2, 3 and 4 (ONE
  launch per world size, a Suite); TORCH_DISTRIBUTED_DEBUG=DETAIL (one
  launch); a (2,2,2) DeviceMesh on 8 ranks (one launch); split_group.
"""
from __future__ import annotations

import copy
import datetime
import os
import runpy

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

from collectives_common import (  # noqa: E402
    MIB4,
    RING_BLOCK,
    WORLD_SIZES,
    _chunk,
    _data,
    _rs_expected,
    _split,
)
from common import expected, gen, mismatch, suite_test, tolerance  # noqa: E402
from launcher import run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ groups

def _subgroup_ops(g, members, rank, fail, where):
    """all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor,
    all_to_all_single, reduce and a p2p ring on group ``g`` of global ranks
    ``members``."""
    n = len(members)
    me = members.index(rank)
    x = torch.full((100,), float(rank + 1))
    dist.all_reduce(x, group=g)
    if x[0].item() != sum(r + 1 for r in members):
        fail(f"{where}: all_reduce gave {x[0].item()}")
    b = torch.full((10,), float(rank))
    dist.broadcast(b, src=members[-1], group=g)  # src is a global rank
    if b[0].item() != members[-1]:
        fail(f"{where}: broadcast from global rank {members[-1]} gave {b[0].item()}")
    out = torch.empty(3 * n)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank)), group=g)
    if out.tolist() != [float(r) for r in members for _ in range(3)]:
        fail(f"{where}: all_gather_into_tensor gave {out.tolist()}")
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n) + rank, group=g)
    if rs.tolist() != [float(sum(2 * me + k + r for r in members)) for k in range(2)]:
        fail(f"{where}: reduce_scatter_tensor gave {rs.tolist()}")
    a2a = torch.empty(n)
    dist.all_to_all_single(a2a, torch.arange(n, dtype=torch.float32) + 10 * rank, group=g)
    if a2a.tolist() != [float(me + 10 * r) for r in members]:
        fail(f"{where}: all_to_all_single gave {a2a.tolist()}")
    red = torch.full((5,), float(rank))
    dist.reduce(red, dst=members[0], group=g)
    want = float(sum(members)) if rank == members[0] else float(rank)
    if red[0].item() != want:
        fail(f"{where}: reduce to global rank {members[0]}: got {red[0].item()}, expected {want}")
    if n > 1:
        right, left = members[(me + 1) % n], members[(me - 1) % n]
        s, r = torch.full((4,), float(rank)), torch.zeros(4)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, s, right, g), dist.P2POp(dist.irecv, r, left, g)]):
            w.wait()
        if r[0].item() != left:
            fail(f"{where}: batch_isend_irecv from global rank {left} gave {r[0].item()}")


def check_groups(rank, ws, fail):
    """new_group subsets (members and non-members), overlapping groups with
    async ops interleaved, new_subgroups, and one-rank groups."""
    subsets = [[0, 1], list(range(1, ws)), [0, ws - 1], list(range(ws))]
    groups = [(s, dist.new_group(ranks=s, backend="collx")) for s in subsets]
    for s, g in groups:
        if rank in s:
            _subgroup_ops(g, s, rank, fail, f"new_group({s})")
        else:
            # Not a member: the ops do nothing and leave the tensors alone.
            t = torch.full((4,), 5.0)
            if dist.all_reduce(t, group=g) is not None or t.tolist() != [5.0] * 4:
                fail(f"new_group({s}): all_reduce by non-member rank {rank} touched {t.tolist()}")
            if g != dist.GroupMember.NON_GROUP_MEMBER:
                fail(f"new_group({s}) on non-member rank {rank} returned {g!r}")
    dist.barrier()
    # Overlapping groups, async ops interleaved (each group in the same order on its members).
    works = []
    for s, g in groups:
        if rank in s:
            t = torch.full((300_000,), float(rank))
            works.append((s, t, dist.all_reduce(t, group=g, async_op=True)))
    for s, t, w in works:
        w.wait()
        if t[0].item() != float(sum(s)) or t[-1].item() != float(sum(s)):
            fail(f"overlapping async all_reduce on {s}: got {t[0].item()}")
    # new_subgroups: one-rank groups everywhere, pairs where ws is even.
    for size in (1, 2) if ws % 2 == 0 else (1, ws):
        cur, subs = dist.new_subgroups(group_size=size)
        members = dist.get_process_group_ranks(cur)
        want = list(range(rank // size * size, rank // size * size + size))
        if members != want:
            fail(f"new_subgroups(group_size={size}): rank {rank} is in {members}, expected {want}")
            continue
        _subgroup_ops(cur, members, rank, fail, f"new_subgroups(group_size={size}) {members}")
        # A one-rank group: every collective is the identity.
        if size == 1:
            x = _data(rank, torch.int32, 50, 1)
            out = torch.empty(50, dtype=torch.int32)
            dist.all_gather_into_tensor(out, x, group=cur)
            gbuf = torch.empty(50, dtype=torch.int32)
            dist.gather(x, [gbuf], dst=rank, group=cur)
            dist.barrier(group=cur)
            if mismatch(out, x) or mismatch(gbuf, x):
                fail("one-rank group: all_gather_into_tensor / gather is not the identity")
        for sg in subs:
            dist.destroy_process_group(sg)
    for _, g in groups:
        if g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)


SUITE_CHECKS = [
    check_groups,
]


test_collective = suite_test(__name__, "SUITE_CHECKS", WORLD_SIZES, with_gloo=True, timeout=240)


# ------------------------------------------------------------------ TORCH_DISTRIBUTED_DEBUG=DETAIL

def _detail(rank, ws):
    """A representative subset under TORCH_DISTRIBUTED_DEBUG=DETAIL (the
    backend is wrapped in _ProcessGroupWrapper, so no get_stats here)."""
    out = []
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    wrapped = type(backend).__name__
    x = gen(rank, torch.float32, "SUM", 10007)
    dist.all_reduce(x)
    if m := mismatch(x, expected(ws, torch.float32, "SUM", 10007)):
        out.append(f"all_reduce: {m}")
    for root in range(ws):
        t = _data(rank, torch.int64, 1000, root)
        dist.broadcast(t, src=root)
        if m := mismatch(t, _data(root, torch.int64, 1000, root)):
            out.append(f"broadcast root={root}: {m}")
        x0 = gen(rank, torch.float64, "SUM", 500, root)
        t = x0.clone()
        dist.reduce(t, dst=root)
        if m := mismatch(t, expected(ws, torch.float64, "SUM", 500, root) if rank == root else x0):
            out.append(f"reduce root={root}: {m}")
    outs = [torch.empty(7) for _ in range(ws)]
    dist.all_gather(outs, _data(rank, torch.float32, 7, 1))
    if any(mismatch(outs[r], _data(r, torch.float32, 7, 1)) for r in range(ws)):
        out.append("all_gather: wrong blocks")
    flat = torch.empty(ws * RING_BLOCK)
    dist.all_gather_into_tensor(flat, _data(rank, torch.float32, RING_BLOCK, 2))
    if m := mismatch(flat, torch.cat([_data(r, torch.float32, RING_BLOCK, 2) for r in range(ws)])):
        out.append(f"all_gather_into_tensor: {m}")
    rs = torch.empty(1000)
    dist.reduce_scatter_tensor(rs, gen(rank, torch.float32, "AVG", ws * 1000, 3), op=dist.ReduceOp.AVG)
    if m := mismatch(rs, _rs_expected(ws, rank, torch.float32, "AVG", 1000, 3), *tolerance(torch.float32, "AVG")):
        out.append(f"reduce_scatter_tensor AVG: {m}")
    ins = [_split(rank, j, 1) for j in range(ws)]
    outs_s = [_split(i, rank, 1) for i in range(ws)]
    a = torch.empty(sum(outs_s), 3)
    dist.all_to_all_single(a, torch.cat([_chunk(rank, j, ins[j], 3, torch.float32, 1) for j in range(ws)]),
                           output_split_sizes=outs_s, input_split_sizes=ins)
    if m := mismatch(a, torch.cat([_chunk(i, rank, outs_s[i], 3, torch.float32, 1) for i in range(ws)])):
        out.append(f"all_to_all_single uneven: {m}")
    glist = [torch.empty(5) for _ in range(ws)] if rank == 0 else None
    dist.gather(torch.full((5,), float(rank)), glist, dst=0)
    if rank == 0 and [g[0].item() for g in glist] != [float(r) for r in range(ws)]:
        out.append(f"gather: {glist}")
    s = torch.empty(5)
    dist.scatter(s, [torch.full((5,), float(j)) for j in range(ws)] if rank == ws - 1 else None, src=ws - 1)
    if s[0].item() != rank:
        out.append(f"scatter: {s}")
    objs = [None] * ws
    dist.all_gather_object(objs, {"r": rank})
    if objs != [{"r": r} for r in range(ws)]:
        out.append(f"all_gather_object: {objs}")
    right, left = (rank + 1) % ws, (rank - 1) % ws
    r_buf = torch.zeros(MIB4)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((MIB4,), float(rank)), right),
                                     dist.P2POp(dist.irecv, r_buf, left)]):
        w.wait()
    if r_buf[0].item() != left or r_buf[-1].item() != left:
        out.append(f"batch_isend_irecv: got {r_buf[0].item()}")
    if rank == 0:
        dist.send(torch.full((3,), 42.0), 1, tag=3)
    elif rank == 1:
        t = torch.zeros(3)
        dist.recv(t, 0, tag=3)
        if t.tolist() != [42.0] * 3:
            out.append(f"send/recv: {t}")
    with dist._coalescing_manager():
        cs = [torch.full((4,), float(rank)), torch.full((9,), 1.0)]
        for c in cs:
            dist.all_reduce(c)
    if cs[0][0].item() != sum(range(ws)) or cs[1][0].item() != ws:
        out.append(f"_coalescing_manager all_reduce: {cs}")
    g = dist.new_group(ranks=[0, 1])
    if rank in (0, 1):
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=g)
        if t[0].item() != 3.0:
            out.append(f"new_group([0,1]) all_reduce: {t}")
    dist.barrier()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    return wrapped, out


def test_torch_distributed_debug_detail():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend in _ProcessGroupWrapper
    (it checks every collective's fingerprint across ranks first); the ops must
    still give the right results. torchcollx.get_stats() is not called here:
    under DETAIL it cannot find the collx backend behind the wrapper."""
    results = run_ranks(_detail, 3, timeout=120, with_gloo=False, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    problems = [f"rank {r}: {m}" for r, (_, ms) in enumerate(results) for m in ms]
    assert not problems, "\n".join(problems)
    assert all("Wrapper" in w for w, _ in results), f"backend not wrapped under DETAIL: {[w for w, _ in results]}"


# ------------------------------------------------------------------ DeviceMesh (8 ranks)

def _mesh(rank, ws):
    runpy.run_path(os.path.join(ROOT, "examples", "parallel_mesh.py"), run_name="__main__")
    return True


def test_device_mesh_2x2x2_example():
    """examples/parallel_mesh.py: init_device_mesh("cpu", (2, 2, 2)) over collx
    and a collective along each dimension (dp all_reduce, tp all_gather +
    reduce_scatter, pp batch_isend_irecv), on 8 ranks (env://)."""
    assert run_ranks(_mesh, 8, timeout=150, backend_init="env", init=False) == [True] * 8


# ------------------------------------------------------------------ split_group

def _split_halves(rank, ws):
    """ProcessGroup.split_group, the C++ call dist.split_group makes once it
    has checked for an accelerator device_id (which a CPU-only box cannot
    bind; tests/test_cuda.py runs dist.split_group itself on a GPU). It asks
    the backend for getBackendOptions() and split()."""
    pg = dist.distributed_c10d._get_default_group()
    mine = [0, 1] if rank < 2 else [2, 3]
    sub = pg.split_group(mine, timeout=datetime.timedelta(seconds=60), opts=None, group_name=f"halves{mine[0]}",
                         group_desc="halves")
    backend = sub._get_backend(torch.device("cpu"))
    t = torch.full((100_003,), float(rank + 1))
    sub.allreduce([t]).wait()
    # torch <= 2.11's dist.split_group passes a deep copy of the parent
    # backend's `options` as opts.
    parent = pg._get_backend(torch.device("cpu")).options
    opts = copy.deepcopy(parent)
    copied = (opts.backend, opts._timeout) == ("collx", parent._timeout) and opts is not parent
    again = pg.split_group(mine, timeout=datetime.timedelta(seconds=60), opts=opts, group_name=f"again{mine[0]}",
                           group_desc="halves again")
    u = torch.full((7,), float(rank))
    again.allreduce([u]).wait()
    return (sub.size(), sub.rank(), type(backend).__name__, bool((t == sum(r + 1 for r in mine)).all()),
            bool((u == sum(mine)).all()), copied)


def test_split_group():
    results = run_ranks(_split_halves, 4, timeout=60)
    assert results == [(2, r % 2, "CollxBackend", True, True, True) for r in range(4)]


def _new_group_beside_a_bound_device(rank, ws):
    """With the default group bound to a GPU (device_id=), torch calls the
    split source's perform_nocolor_split(device) on each non-member of a new
    group (test_cuda's split_group test runs that on a GPU; a CPU cannot be
    bound). Here the non-members make that call themselves: the members'
    group still forms and works."""
    source = dist.distributed_c10d._get_split_source(dist.distributed_c10d._get_default_group())
    if rank not in (1, 2):
        source.perform_nocolor_split(torch.device("cuda", 0))
    pair = dist.new_group([1, 2])
    if rank not in (1, 2):
        return pair is dist.GroupMember.NON_GROUP_MEMBER
    t = torch.full((5,), float(rank))
    dist.all_reduce(t, group=pair)
    return bool((t == 3).all())


def test_new_group_beside_a_bound_device():
    assert run_ranks(_new_group_beside_a_bound_device, 4, timeout=60) == [True] * 4
