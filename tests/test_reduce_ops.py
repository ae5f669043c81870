"""The reducing collectives of the collx backend other than a plain all_reduce
(for which see test_allreduce.py and test_allreduce_misc.py), checked against
gloo (a gloo group over the same processes) or against values computed
locally, at world sizes 2, 3 and 4:

  reduce (every root; non-root tensors left unchanged, as in NCCL),
  reduce_scatter / reduce_scatter_tensor / _coalescing_manager(reduce_scatter_tensor),
  _coalescing_manager(all_reduce).

Process startup costs seconds, so each world size runs ONE launch (a Suite)
for all the checks of this file.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

import launcher  # noqa: E402
from collectives_common import COUNTS, LARGE, MIB4, WORLD_SIZES, _rs_expected  # noqa: E402
from common import (DTYPES, dtype_name, expected, gen, labels_delta, mismatch, on_shm, reduce_op,  # noqa: E402
                    suite_test, tolerance)


def reduce_ops_for(dtype):
    """The ops this file checks for reducing collectives (reduce, reduce_scatter)."""
    if dtype == torch.bool:
        return ["SUM", "MAX"]
    if dtype.is_floating_point:
        return ["SUM", "MAX", "AVG", "PREMUL_SUM"]
    return ["SUM", "MAX", "AVG"]


def _gloo_try(fn, unsupported, key):
    """Runs a gloo oracle call; an error gloo raises for an unsupported
    dtype/op (before any communication, on every rank) skips that comparison."""
    if key in unsupported:
        return False
    try:
        fn()
        return True
    except (RuntimeError, ValueError) as e:
        unsupported[key] = str(e).splitlines()[0][:100]
        return False


# ------------------------------------------------------------------ reduce

def check_reduce(rank, ws, fail):
    """Every root, every dtype and op, counts 0/1/7/1000 and ~1M float32.
    The root gets the reduction (vs local values and, for SUM/MAX, vs gloo);
    every other rank's tensor is left exactly as it was (NCCL semantics)."""
    gloo_unsupported = {}
    for root in range(ws):
        for dtype in DTYPES:
            for op in reduce_ops_for(dtype):
                for count in COUNTS:
                    x = gen(rank, dtype, op, count, salt=root)
                    t = x.clone()
                    where = f"reduce root={root} {op} {dtype_name(dtype)} count={count}"
                    ret = dist.reduce(t, dst=root, op=reduce_op(op))
                    if ret is not None:
                        fail(f"{where}: returned {ret!r} without async_op")
                    if rank == root:
                        rtol, atol = tolerance(dtype, op)
                        if m := mismatch(t, expected(ws, dtype, op, count, salt=root), rtol, atol):
                            fail(f"{where}: root vs local expectation: {m}")
                    elif m := mismatch(t, x):
                        fail(f"{where}: NON-ROOT tensor was modified: {m}")
                    if op in ("SUM", "MAX"):
                        y = x.clone()
                        if _gloo_try(lambda: dist.reduce(y, dst=root, op=reduce_op(op), group=launcher.gloo()),
                                     gloo_unsupported, (dtype, op)) and rank == root:
                            if m := mismatch(t, y):
                                fail(f"{where}: root vs gloo: {m}")
        for op in ("SUM", "AVG", "PREMUL_SUM", "MAX"):
            x = gen(rank, torch.float32, op, LARGE, salt=root)
            t = x.clone()
            dist.reduce(t, dst=root, op=reduce_op(op))
            where = f"reduce root={root} {op} float32 count={LARGE}"
            if rank == root:
                rtol, atol = tolerance(torch.float32, op)
                if m := mismatch(t, expected(ws, torch.float32, op, LARGE, salt=root), rtol, atol):
                    fail(f"{where}: root: {m}")
            elif m := mismatch(t, x):
                fail(f"{where}: NON-ROOT tensor was modified: {m}")
        # Non-contiguous and async: the root's view gets the result, others untouched.
        base = gen(rank, torch.float64, "SUM", 31 * 17, salt=root + 50).view(31, 17)
        keep = base.clone()
        w = dist.reduce(base.t(), dst=root, async_op=True)
        w.wait()
        if rank == root:
            if m := mismatch(base, expected(ws, torch.float64, "SUM", 31 * 17, salt=root + 50).view(31, 17)):
                fail(f"reduce root={root} transposed float64 async: {m}")
        elif m := mismatch(base, keep):
            fail(f"reduce root={root} transposed float64 async: NON-ROOT tensor was modified: {m}")
    if rank == 0 and gloo_unsupported:
        print(f"[rank 0] check_reduce: gloo oracle skipped for {gloo_unsupported}", flush=True)


# ------------------------------------------------------------------ reduce_scatter

def check_reduce_scatter(rank, ws, fail):
    """reduce_scatter (list), reduce_scatter_tensor (1-D input) and its torch
    2.14 name reduce_scatter_single ((ws, n) input),
    SUM/AVG/MAX (+PREMUL_SUM for floats), every dtype, blocks 0/1/7/1000 and
    ~256K float32; vs local values and, for SUM/MAX, vs gloo."""
    gloo_unsupported = {}
    for dtype in DTYPES:
        for op in reduce_ops_for(dtype):
            for block in COUNTS + ([MIB4 // 4 + 1] if dtype == torch.float32 and op in ("SUM", "AVG") else []):
                salt = block % 97
                x = gen(rank, dtype, op, ws * block, salt)
                want = _rs_expected(ws, rank, dtype, op, block, salt)
                rtol, atol = tolerance(dtype, op)
                where = f"{op} {dtype_name(dtype)} block={block}"
                out = torch.full((block,), 1, dtype=dtype)
                dist.reduce_scatter(out, list(x.clone().view(ws, block).unbind(0)), op=reduce_op(op))
                if m := mismatch(out, want, rtol, atol):
                    fail(f"reduce_scatter (list) {where}: {m}")
                inp = x.clone()
                out_t = torch.full((block,), 1, dtype=dtype)
                dist.reduce_scatter_tensor(out_t, inp, op=reduce_op(op))
                if m := mismatch(out_t, want, rtol, atol):
                    fail(f"reduce_scatter_tensor 1-D {where}: {m}")
                if m := mismatch(inp, x):
                    fail(f"reduce_scatter_tensor {where}: the input was modified: {m}")
                out2 = torch.full((1, block), 1, dtype=dtype)
                dist.reduce_scatter_single(out2, x.clone().view(ws, block), op=reduce_op(op))
                if m := mismatch(out2.view(-1), want, rtol, atol):
                    fail(f"reduce_scatter_single (ws, n) {where}: {m}")
                if op in ("SUM", "MAX") and block <= 1000:
                    ref = torch.empty(block, dtype=dtype)
                    if _gloo_try(lambda: dist.reduce_scatter_tensor(ref, x.clone(), op=reduce_op(op),
                                                                    group=launcher.gloo()),
                                 gloo_unsupported, (dtype, op)):
                        if m := mismatch(out_t, ref):
                            fail(f"reduce_scatter_tensor {where}: vs gloo: {m}")
    if rank == 0 and gloo_unsupported:
        print(f"[rank 0] check_reduce_scatter: gloo oracle skipped for {gloo_unsupported}", flush=True)


def check_reduce_scatter_layouts(rank, ws, fail):
    """reduce_scatter_single and reduce_scatter_tensor on the layouts users
    pass: a non-contiguous input ((ws, n) through a transpose), a
    non-contiguous output, and in place (the output is this rank's block of the
    input). Small and large blocks (messages and shared memory), SUM, AVG and
    PREMUL_SUM; the input must come out unchanged wherever it is not the output."""
    for block in (7, 20000):
        for op in ("SUM", "AVG", "PREMUL_SUM"):
            salt = block % 89
            x = gen(rank, torch.float32, op, ws * block, salt)
            want = _rs_expected(ws, rank, torch.float32, op, block, salt)
            rtol, atol = tolerance(torch.float32, op)
            where = f"{op} block={block}"
            strided_in = x.view(ws, block).t().contiguous().t()  # (ws, block), column-major
            out = torch.full((block,), -1.0)
            dist.reduce_scatter_single(out, strided_in, op=reduce_op(op))
            if m := mismatch(out, want, rtol, atol):
                fail(f"reduce_scatter_single from a non-contiguous input {where}: {m}")
            if m := mismatch(strided_in.reshape(-1), x):
                fail(f"reduce_scatter_single {where}: the non-contiguous input was modified: {m}")
            wide = torch.full((block, 2), -1.0)
            dist.reduce_scatter_tensor(wide[:, 0], x.clone(), op=reduce_op(op))
            if m := mismatch(wide[:, 0], want, rtol, atol):
                fail(f"reduce_scatter_tensor into a non-contiguous output {where}: {m}")
            if m := mismatch(wide[:, 1], torch.full((block,), -1.0)):
                fail(f"reduce_scatter_tensor {where}: wrote outside its strided output: {m}")
            inp = x.clone()
            mine = inp[rank * block:(rank + 1) * block]
            before = torchcollx.get_stats()["algorithms"]
            dist.reduce_scatter_tensor(mine, inp, op=reduce_op(op))
            # Every op, PREMUL_SUM's scaled copy too, in shared memory where the group has it.
            label = "reduce_scatter/shm" if on_shm() else "reduce_scatter/ring"
            if (labels := labels_delta(None, before)) != {label: 1}:
                fail(f"reduce_scatter_tensor in place {where}: stats labels {labels}, expected {{{label!r}: 1}}")
            if m := mismatch(mine, want, rtol, atol):
                fail(f"reduce_scatter_tensor in place {where}: {m}")
            others = torch.cat([inp[:rank * block], inp[(rank + 1) * block:]])
            if m := mismatch(others, torch.cat([x[:rank * block], x[(rank + 1) * block:]])):
                fail(f"reduce_scatter_tensor in place {where}: the other blocks were modified: {m}")


def check_coalescing_manager_reduce_scatter(rank, ws, fail):
    """_coalescing_manager around several reduce_scatter_tensor (one
    reduce_scatter_tensor_coalesced call), SUM and AVG, sync and async."""
    for op in ("SUM", "AVG"):
        for async_ops in (False, True):
            blocks = [3, 0, 1000, MIB4 // 4]
            ins = [gen(rank, torch.float32, op, ws * b, 60 + i) for i, b in enumerate(blocks)]
            outs = [torch.full((b,), -1.0) for b in blocks]
            with dist._coalescing_manager(async_ops=async_ops) as cm:
                for o, x in zip(outs, ins):
                    dist.reduce_scatter_tensor(o, x, op=reduce_op(op))
            if async_ops:
                cm.wait()
            rtol, atol = tolerance(torch.float32, op)
            for i, b in enumerate(blocks):
                if m := mismatch(outs[i], _rs_expected(ws, rank, torch.float32, op, b, 60 + i), rtol, atol):
                    fail(f"_coalescing_manager(async_ops={async_ops}) reduce_scatter_tensor {op} #{i} block={b}: {m}")


def check_coalescing_manager_all_reduce(rank, ws, fail):
    """_coalescing_manager around several all_reduce (one allreduce_coalesced)."""
    for dtype, op in ((torch.float32, "SUM"), (torch.int64, "MAX"), (torch.bfloat16, "AVG"),
                      (torch.float64, "PREMUL_SUM")):
        for async_ops in (False, True):
            counts = [7, 0, 1000, 1 if dtype != torch.float32 else LARGE]
            ts = [gen(rank, dtype, op, n, 70 + i) for i, n in enumerate(counts)]
            with dist._coalescing_manager(async_ops=async_ops) as cm:
                for t in ts:
                    dist.all_reduce(t, op=reduce_op(op))
            if async_ops:
                cm.wait()
            rtol, atol = tolerance(dtype, op)
            for i, n in enumerate(counts):
                if m := mismatch(ts[i], expected(ws, dtype, op, n, 70 + i), rtol, atol):
                    fail(f"_coalescing_manager(async_ops={async_ops}) all_reduce {op} {dtype_name(dtype)} "
                         f"#{i} count={n}: {m}")


SUITE_CHECKS = [
    check_reduce,
    check_reduce_scatter,
    check_reduce_scatter_layouts,
    check_coalescing_manager_reduce_scatter,
    check_coalescing_manager_all_reduce,
]


test_collective = suite_test(__name__, "SUITE_CHECKS", WORLD_SIZES, with_gloo=True, timeout=240)
