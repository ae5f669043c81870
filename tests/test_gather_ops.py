"""The data-moving collectives of the collx backend, checked against gloo (a
gloo group over the same processes) or against values computed locally, at
world sizes 2, 3 and 4:

  broadcast (direct and tree), all_gather / all_gather_into_tensor /
  all_gather_object / all_gather_coalesced / _coalescing_manager(all_gather_into_tensor),
  all_to_all / all_to_all_single (equal and uneven splits, zero-size splits),
  gather / scatter and the object collectives.

Process startup costs seconds, so each world size runs ONE launch (a Suite)
for all the checks of this file.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

import launcher  # noqa: E402
from collectives_common import (  # noqa: E402
    COUNTS,
    LARGE,
    MIB4,
    RING_BLOCK,
    WORLD_SIZES,
    _chunk,
    _data,
    _split,
)
from common import (  # noqa: E402
    DTYPES,
    SHM_MIN_BYTES,
    dtype_name,
    labels_delta,
    mismatch,
    on_shm,
    suite_test,
)


# ------------------------------------------------------------------ broadcast

def check_broadcast(rank, ws, fail):
    """Every root, every dtype, counts 0/1/7/1000, and ~4 MB from every root,
    on the world group and on a group whose cost model prefers a chain tree
    (tree_arity=1) for large messages: the stats label says which ran (shm
    from SHM_MIN_BYTES where the group shares memory)."""
    for root in range(ws):
        for dtype in DTYPES:
            for count in COUNTS:
                salt = 1000 * root + 7
                t = _data(rank, dtype, count, salt) if rank == root else torch.ones(count, dtype=dtype)
                dist.broadcast(t, src=root)
                if m := mismatch(t, _data(root, dtype, count, salt)):
                    fail(f"broadcast root={root} {dtype_name(dtype)} count={count}: {m}")
    chain = dist.new_group(backend="collx", pg_options=torchcollx.Options(tree_arity=1))
    groups = {"world": (None, 2), "tree_arity=1": (chain, 1)}
    for gname, (g, arity) in groups.items():
        # The static table (tuning.cc) takes the fastest of direct (k = n-1), the
        # configured arity and a chain (k = 1) by depth(k)*30us + bytes*k/1000:
        # at n=2 direct and chain coincide (labelled direct); at 4 MB a chain otherwise.
        large_label = "broadcast/direct" if ws == 2 else "broadcast/chain"
        if on_shm(g) and 4 * MIB4 >= SHM_MIN_BYTES:
            large_label = "broadcast/shm"
        for root in range(ws):
            for count, want_label in ((1000, "broadcast/direct"), (MIB4, large_label)):
                t = _data(rank, torch.float32, count, root) if rank == root else torch.zeros(count)
                before = torchcollx.get_stats(g)["algorithms"]
                dist.broadcast(t, src=root, group=g)
                labels = labels_delta(g, before)
                if m := mismatch(t, _data(root, torch.float32, count, root)):
                    fail(f"{gname}: broadcast root={root} float32 count={count}: {m}")
                if labels != {want_label: 1}:
                    fail(f"{gname}: broadcast of {4 * count} B from {root} on {ws} ranks: stats labels "
                         f"{labels}, expected {{{want_label!r}: 1}}")
    dist.destroy_process_group(chain)


# ------------------------------------------------------------------ all_gather

def check_all_gather(rank, ws, fail):
    """all_gather (list) for every dtype and count, and a block > 256 KiB (the
    ring at n > 2 over TCP, shm where the group shares memory); vs local values
    and vs gloo."""
    for dtype in DTYPES:
        for count in COUNTS:
            x = _data(rank, dtype, count, 11)
            outs = [torch.empty(count, dtype=dtype) for _ in range(ws)]
            dist.all_gather(outs, x)
            ref = [torch.empty(count, dtype=dtype) for _ in range(ws)]
            dist.all_gather(ref, x, group=launcher.gloo())
            for r in range(ws):
                if m := mismatch(outs[r], _data(r, dtype, count, 11)):
                    fail(f"all_gather {dtype_name(dtype)} count={count}: block of rank {r}: {m}")
                if m := mismatch(outs[r], ref[r]):
                    fail(f"all_gather {dtype_name(dtype)} count={count}: vs gloo, block {r}: {m}")
    # In shared memory at every size; else a direct exchange, or a ring for large blocks.
    small, ring = ("all_gather/shm", "all_gather/shm") if on_shm() else (
        "all_gather/direct", "all_gather/direct" if ws == 2 else "all_gather/ring")
    for count, want in ((1000, small), (RING_BLOCK, ring)):
        x = _data(rank, torch.float32, count, 12)
        outs = [torch.empty(count) for _ in range(ws)]
        before = torchcollx.get_stats()["algorithms"]
        dist.all_gather(outs, x)
        labels = labels_delta(None, before)
        for r in range(ws):
            if m := mismatch(outs[r], _data(r, torch.float32, count, 12)):
                fail(f"all_gather float32 count={count}: block of rank {r}: {m}")
        if labels != {want: 1}:
            fail(f"all_gather of {4 * count} B per rank on {ws} ranks: labels {labels}, expected {{{want!r}: 1}}")


def check_all_gather_into_tensor(rank, ws, fail):
    """1-D (ws*n) and 2-D (ws, n) outputs, every dtype, small and ring sizes."""
    for dtype in DTYPES:
        for count in COUNTS + ([RING_BLOCK] if dtype == torch.float32 else []):
            x = _data(rank, dtype, count, 21)
            want = torch.cat([_data(r, dtype, count, 21) for r in range(ws)])
            out = torch.empty(ws * count, dtype=dtype)
            dist.all_gather_into_tensor(out, x)
            if m := mismatch(out, want):
                fail(f"all_gather_into_tensor 1-D {dtype_name(dtype)} count={count}: {m}")
            out2 = torch.empty(ws, count, dtype=dtype)
            dist.all_gather_into_tensor(out2, x)
            if m := mismatch(out2, want.view(ws, count)):
                fail(f"all_gather_into_tensor (ws, n) {dtype_name(dtype)} count={count}: {m}")
            if count <= 1000:
                ref = torch.empty(ws * count, dtype=dtype)
                dist.all_gather_into_tensor(ref, x, group=launcher.gloo())
                if m := mismatch(out, ref):
                    fail(f"all_gather_into_tensor {dtype_name(dtype)} count={count}: vs gloo: {m}")
    # A 2-D input of shape (k, m) into a (ws*k, m) output (the FSDP / DTensor shape).
    x = _data(rank, torch.bfloat16, 6 * 5, 23).view(6, 5)
    out = torch.empty(ws * 6, 5, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, x)
    if m := mismatch(out, torch.cat([_data(r, torch.bfloat16, 30, 23).view(6, 5) for r in range(ws)])):
        fail(f"all_gather_into_tensor (6,5) -> ({ws * 6},5) bfloat16: {m}")


def check_all_gather_object(rank, ws, fail):
    """Objects of very different sizes per rank (one > 256 KiB pickled)."""
    def obj(r):
        return {"rank": r, "payload": "x" * (300_000 if r == ws - 1 else r * 100 + 1),
                "t": torch.arange(r + 1), "nested": [(r, None, 1.5)] * r}

    got = [None] * ws
    dist.all_gather_object(got, obj(rank))
    for r in range(ws):
        want = obj(r)
        g = got[r]
        if not (isinstance(g, dict) and g.keys() == want.keys() and g["payload"] == want["payload"]
                and torch.equal(g["t"], want["t"]) and g["nested"] == want["nested"] and g["rank"] == r):
            fail(f"all_gather_object: entry {r} is {str(g)[:200]}")


def check_all_gather_coalesced(rank, ws, fail):
    """dist.all_gather_coalesced: output_tensor_lists[r][i] is rank r's input i
    (c10d's layout for allgather_coalesced, and gloo's): vs local values and gloo."""
    for shapes in ([(3,), (2, 2), (5,)],          # different shapes
                   [(4,)] * ws,                   # ws inputs of one shape: a transposed layout passes shape checks
                   [(1000,), (RING_BLOCK,)]):     # small + ring-sized
        ins = [_data(rank, torch.float32, int(torch.Size(s).numel()), 30 + i).view(s) for i, s in enumerate(shapes)]
        outs = [[torch.full(s, -1.0) for s in shapes] for _ in range(ws)]
        try:
            dist.all_gather_coalesced(outs, ins)
        except Exception as e:
            fail(f"all_gather_coalesced shapes={shapes}: raised {type(e).__name__}: {str(e)[:300]}")
            continue
        for r in range(ws):
            for i, s in enumerate(shapes):
                want = _data(r, torch.float32, int(torch.Size(s).numel()), 30 + i).view(s)
                if m := mismatch(outs[r][i], want):
                    fail(f"all_gather_coalesced shapes={shapes}: output_tensor_lists[{r}][{i}] "
                         f"(rank {r}'s input {i}): {m}")
        if max(int(torch.Size(s).numel()) for s in shapes) <= 1000:
            ref = [[torch.full(s, -1.0) for s in shapes] for _ in range(ws)]
            dist.all_gather_coalesced(ref, ins, group=launcher.gloo())
            for r in range(ws):
                for i in range(len(shapes)):
                    if m := mismatch(outs[r][i], ref[r][i]):
                        fail(f"all_gather_coalesced shapes={shapes}: [{r}][{i}] vs gloo: {m}")


def check_coalescing_manager_all_gather(rank, ws, fail):
    """_coalescing_manager around several all_gather_into_tensor (one
    allgather_into_tensor_coalesced call), sync and async_ops=True."""
    for async_ops in (False, True):
        specs = [(torch.float32, 5), (torch.float32, 0), (torch.float32, 1000), (torch.float32, RING_BLOCK)]
        ins = [_data(rank, d, n, 40 + i) for i, (d, n) in enumerate(specs)]
        outs = [torch.empty(ws * n, dtype=d) for d, n in specs]
        with dist._coalescing_manager(async_ops=async_ops) as cm:
            for o, x in zip(outs, ins):
                dist.all_gather_into_tensor(o, x)
        if async_ops:
            cm.wait()
        for i, (d, n) in enumerate(specs):
            want = torch.cat([_data(r, d, n, 40 + i) for r in range(ws)])
            if m := mismatch(outs[i], want):
                fail(f"_coalescing_manager(async_ops={async_ops}) all_gather_into_tensor #{i} ({n} per rank): {m}")


# ------------------------------------------------------------------ all_to_all

def check_all_to_all(rank, ws, fail):
    """all_to_all_single with equal splits (every dtype, 2-D rows) and uneven
    splits incl. zero-size ones, all_to_all (list) with per-peer sizes; vs local
    values and vs gloo."""
    cols = 3
    for dtype in DTYPES:
        for rows in (0, 1, 7):  # rows per peer, equal splits
            inp = torch.cat([_chunk(rank, j, rows, cols, dtype, 1) for j in range(ws)])
            want = torch.cat([_chunk(i, rank, rows, cols, dtype, 1) for i in range(ws)])
            out = torch.full((ws * rows, cols), 1, dtype=dtype)
            dist.all_to_all_single(out, inp)
            if m := mismatch(out, want):
                fail(f"all_to_all_single equal {dtype_name(dtype)} rows={rows}: {m}")
            ref = torch.empty_like(out)
            dist.all_to_all_single(ref, inp, group=launcher.gloo())
            if m := mismatch(out, ref):
                fail(f"all_to_all_single equal {dtype_name(dtype)} rows={rows}: vs gloo: {m}")
    # Equal, large: 4 MiB of float32 in all, 1-D.
    n = MIB4 // ws * ws
    inp = _data(rank, torch.float32, n, 5)
    out = torch.empty(n)
    dist.all_to_all_single(out, inp)
    want = torch.cat([_data(i, torch.float32, n, 5).view(ws, -1)[rank] for i in range(ws)])
    if m := mismatch(out, want):
        fail(f"all_to_all_single equal float32 {n} elements: {m}")
    # Uneven splits, several patterns (each has zeros somewhere).
    for salt in (1, 2, 3):
        for dtype in (torch.float32, torch.int8, torch.bool, torch.float16):
            ins = [_split(rank, j, salt) for j in range(ws)]
            outs = [_split(i, rank, salt) for i in range(ws)]
            inp = torch.cat([_chunk(rank, j, ins[j], cols, dtype, salt) for j in range(ws)])
            want = torch.cat([_chunk(i, rank, outs[i], cols, dtype, salt) for i in range(ws)])
            out = torch.full((sum(outs), cols), 1, dtype=dtype)
            dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins)
            if m := mismatch(out, want):
                fail(f"all_to_all_single uneven salt={salt} {dtype_name(dtype)} in={ins} out={outs}: {m}")
            ref = torch.empty_like(out)
            dist.all_to_all_single(ref, inp, output_split_sizes=outs, input_split_sizes=ins, group=launcher.gloo())
            if m := mismatch(out, ref):
                fail(f"all_to_all_single uneven salt={salt} {dtype_name(dtype)}: vs gloo: {m}")
    # Uneven and large: rank i sends (i + j + 1) * 64K floats to j, 0 to itself.
    big = 1 << 16
    ins = [0 if j == rank else (rank + j + 1) * big for j in range(ws)]
    outs = [0 if i == rank else (i + rank + 1) * big for i in range(ws)]
    inp = torch.cat([_chunk(rank, j, ins[j], 1, torch.float32, 9).view(-1) for j in range(ws)])
    out = torch.empty(sum(outs))
    dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins)
    want = torch.cat([_chunk(i, rank, outs[i], 1, torch.float32, 9).view(-1) for i in range(ws)])
    if m := mismatch(out, want):
        fail(f"all_to_all_single uneven large in={ins} out={outs}: {m}")
    # A rank that sends and receives nothing at all.
    ins = [0] * ws if rank == 0 else [0] + [2] * (ws - 1)
    ins = [0 if j == 0 else ins[j] for j in range(ws)]
    outs = [0 if (i == 0 or rank == 0) else 2 for i in range(ws)]
    inp = torch.cat([_chunk(rank, j, ins[j], cols, torch.int64, 4) for j in range(ws)])
    out = torch.empty(sum(outs), cols, dtype=torch.int64)
    dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins)
    want = torch.cat([_chunk(i, rank, outs[i], cols, torch.int64, 4) for i in range(ws)])
    if m := mismatch(out, want):
        fail(f"all_to_all_single where rank 0 moves nothing: {m}")
    # all_to_all (list): per-peer sizes (uneven, zeros) and equal sizes, every
    # dtype; vs gloo for equal sizes (gloo's alltoall requires them).
    for dtype in DTYPES:
        for uneven in (True, False):
            def rows(i, j):
                return _split(i, j, 2) if uneven else 5
            ins = [_chunk(rank, j, rows(rank, j), cols, dtype, 7) for j in range(ws)]
            outs = [torch.full((rows(i, rank), cols), 1, dtype=dtype) for i in range(ws)]
            dist.all_to_all(outs, ins)
            for i in range(ws):
                if m := mismatch(outs[i], _chunk(i, rank, rows(i, rank), cols, dtype, 7)):
                    fail(f"all_to_all (list, uneven={uneven}) {dtype_name(dtype)}: block from rank {i}: {m}")
            if not uneven:
                refs = [torch.empty_like(o) for o in outs]
                dist.all_to_all(refs, ins, group=launcher.gloo())
                for i in range(ws):
                    if m := mismatch(outs[i], refs[i]):
                        fail(f"all_to_all (list) {dtype_name(dtype)}: block from rank {i} vs gloo: {m}")


# ------------------------------------------------------------------ gather / scatter / objects

def check_gather_scatter(rank, ws, fail):
    """gather and scatter to/from every root, every dtype and count, ~1M float32."""
    for root in range(ws):
        for dtype in DTYPES:
            for count in COUNTS + ([LARGE] if dtype == torch.float32 else []):
                x = _data(rank, dtype, count, 80 + root)
                glist = [torch.full((count,), 1, dtype=dtype) for _ in range(ws)] if rank == root else None
                dist.gather(x, glist, dst=root)
                if rank == root:
                    for r in range(ws):
                        if m := mismatch(glist[r], _data(r, dtype, count, 80 + root)):
                            fail(f"gather root={root} {dtype_name(dtype)} count={count}: entry {r}: {m}")
                slist = [_data(root, dtype, count, 90 + j) for j in range(ws)] if rank == root else None
                out = torch.full((count,), 1, dtype=dtype)
                dist.scatter(out, slist, src=root)
                if m := mismatch(out, _data(root, dtype, count, 90 + rank)):
                    fail(f"scatter root={root} {dtype_name(dtype)} count={count}: {m}")
        # vs gloo, one dtype.
        x = _data(rank, torch.int32, 100, 3)
        a = [torch.empty(100, dtype=torch.int32) for _ in range(ws)] if rank == root else None
        b = [torch.empty(100, dtype=torch.int32) for _ in range(ws)] if rank == root else None
        dist.gather(x, a, dst=root)
        dist.gather(x, b, dst=root, group=launcher.gloo())
        if rank == root and any(mismatch(p, q) for p, q in zip(a, b)):
            fail(f"gather root={root} int32: differs from gloo")


def check_object_collectives(rank, ws, fail):
    """gather_object, scatter_object_list and broadcast_object_list, every root."""
    def obj(r, root):
        return {"from": r, "root": root, "blob": bytes(range(256)) * (r + 1), "t": torch.full((r + 1,), r)}

    def same(a, b):
        return (isinstance(a, dict) and a.keys() == b.keys() and a["from"] == b["from"] and a["root"] == b["root"]
                and a["blob"] == b["blob"] and torch.equal(a["t"], b["t"]))

    for root in range(ws):
        got = [None] * ws if rank == root else None
        dist.gather_object(obj(rank, root), got, dst=root)
        if rank == root:
            for r in range(ws):
                if not same(got[r], obj(r, root)):
                    fail(f"gather_object root={root}: entry {r} is {str(got[r])[:200]}")
        out = [None]
        dist.scatter_object_list(out, [obj(j, root) for j in range(ws)] if rank == root else None, src=root)
        if not same(out[0], obj(rank, root)):
            fail(f"scatter_object_list root={root}: got {str(out[0])[:200]}")
        lst = [obj(root, root), "s" * 100_000, 3.25, None] if rank == root else [None] * 4
        dist.broadcast_object_list(lst, src=root)
        if not (same(lst[0], obj(root, root)) and lst[1] == "s" * 100_000 and lst[2] == 3.25 and lst[3] is None):
            fail(f"broadcast_object_list root={root}: got {str(lst)[:200]}")


SUITE_CHECKS = [
    check_broadcast,
    check_all_gather,
    check_all_gather_into_tensor,
    check_all_gather_object,
    check_all_gather_coalesced,
    check_coalescing_manager_all_gather,
    check_all_to_all,
    check_gather_scatter,
    check_object_collectives,
]


# check_broadcast expects the static table's tree arities (COLLX_TUNING=table);
# test_tuning.py covers the calibrated model.
test_collective = suite_test(__name__, "SUITE_CHECKS", WORLD_SIZES, with_gloo=True, timeout=240,
                             env={"COLLX_TUNING": "table"})
