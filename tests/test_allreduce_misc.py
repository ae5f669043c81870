"""all_reduce of the collx backend, the checks beyond the values of
test_allreduce.py: async ops and their futures (also mixed with other
collectives), two groups interleaved, subgroups and one-rank groups, and
errors (bitwise ops on floats, unsupported dtypes). Checked against locally
computed results and against a gloo group over the same processes.

Startup of a rank costs seconds, so each world size gets ONE launch (a Suite)
for all the checks of this file.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

import launcher  # noqa: E402
from collectives_common import _groups  # noqa: E402
from common import (  # noqa: E402
    BITWISE_OPS,
    FLOAT_DTYPES,
    dtype_name,
    expected,
    gen,
    mismatch,
    reduce_op,
    suite_test,
    tolerance,
)


# Each takes (rank, ws, fail) and reports problems through fail(msg).

ASYNC_SPECS = [
    (torch.float32, "SUM", 100003),
    (torch.int64, "MAX", 7),
    (torch.float64, "PRODUCT", 1000),
    (torch.float16, "SUM", 1),
    (torch.int32, "BXOR", 0),
    (torch.bfloat16, "MIN", 5000),
    (torch.float32, "AVG", 20000),
    (torch.uint8, "SUM", 333),
    (torch.float64, "PREMUL_SUM", 70001),
    (torch.bool, "BOR", 99),
]


def check_async(rank, ws, fail):
    for algo, g in _groups().items():
        tensors, works, chained = [], [], []
        order, lock = [], threading.Lock()

        def note(fut, i):
            with lock:
                order.append(i)
            return i

        for i, (dtype, op, count) in enumerate(ASYNC_SPECS):
            t = gen(rank, dtype, op, count, salt=i)
            tensors.append(t)
            w = dist.all_reduce(t, op=reduce_op(op), group=g, async_op=True)
            works.append(w)
            chained.append(w.get_future().then(lambda f, i=i: note(f, i)))
        for i in reversed(range(len(works))):
            if works[i].wait() is not True:
                fail(f"{algo}: work {i}.wait() did not return True")
            if not works[i].is_completed():
                fail(f"{algo}: work {i} not is_completed() after wait()")
            if i == len(works) - 1:
                not_done = [j for j in range(i) if not works[j].is_completed()]
                if not_done:
                    fail(f"{algo}: the last op completed before earlier ops {not_done} (issue order broken)")
        torch.futures.wait_all(chained)
        if order != list(range(len(works))):
            fail(f"{algo}: futures completed in order {order}, expected issue order")
        for i, ((dtype, op, count), t, w) in enumerate(zip(ASYNC_SPECS, tensors, works)):
            want = expected(ws, dtype, op, count, salt=i)
            if m := mismatch(t, want, *tolerance(dtype, op)):
                fail(f"{algo}: async #{i} {op} {dtype_name(dtype)} count={count}: {m}")
            # wait() on the future itself: check_future_done_after_wait covers
            # whether Work.wait() alone already made the future ready.
            value = w.get_future().wait()
            if not (isinstance(value, list) and len(value) == 1 and isinstance(value[0], torch.Tensor)):
                fail(f"{algo}: async #{i}: future value is {type(value).__name__} "
                     f"{value if not isinstance(value, list) else [type(v).__name__ for v in value]}, "
                     "expected a list of one tensor")
            elif m := mismatch(value[0], want, *tolerance(dtype, op)):
                fail(f"{algo}: async #{i}: future value: {m}")

        # Many tiny ops in flight at once, waited all at the end.
        ts = [torch.full((3,), float(rank + i)) for i in range(200)]
        ws_ = [dist.all_reduce(t, group=g, async_op=True) for t in ts]
        for w in reversed(ws_):
            w.wait()
        for i, t in enumerate(ts):
            want = float(sum(r + i for r in range(ws)))
            if not torch.equal(t, torch.full((3,), want)):
                fail(f"{algo}: tiny async op {i}: got {t.tolist()}, expected {want}")
                break


def check_future_done_after_wait(rank, ws, fail):
    """Once Work.wait() has returned, the work's future must be completed:
    get_future().done() is True and .value() returns the list of outputs
    (as with gloo). Many small ops, since a race shows only now and then."""
    not_done, errors, first = 0, 0, None
    for i in range(1000):
        t = torch.full((4,), float(rank + i))
        kind = i % 3
        if kind == 0:
            w = dist.all_reduce(t, async_op=True)
        elif kind == 1:
            w = dist.broadcast(t, src=i % ws, async_op=True)
        else:
            w = dist.all_gather_into_tensor(torch.empty(4 * ws), t, async_op=True)
        w.wait()
        fut = w.get_future()
        if not fut.done():
            not_done += 1
        try:
            value = fut.value()
            if not (isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value)):
                errors += 1
                first = first or f"op {i}: value {value!r} is not a non-empty list of tensors"
        except Exception as e:
            errors += 1
            first = first or f"op {i}: get_future().value() right after wait() raised {type(e).__name__}: {e}"
    if not_done or errors:
        fail(f"of 1000 async ops, {not_done} had get_future().done() == False right after Work.wait() "
             f"returned and {errors} failed get_future().value(); first: {first}")


def check_two_groups_interleaved(rank, ws, fail):
    """Async ops on two collx groups and gloo at once, waited out of order."""
    ga = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm="ring"))
    gb = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm="tree"))
    items = []
    for i in range(6):
        g = ga if i % 2 == 0 else gb
        dtype, op, count = [(torch.float32, "SUM", 30001), (torch.int64, "MIN", 1001)][i % 2]
        t = gen(rank, dtype, op, count, salt=100 + i)
        items.append((t, dist.all_reduce(t, op=reduce_op(op), group=g, async_op=True), dtype, op, count, i))
    for t, w, dtype, op, count, i in reversed(items):
        w.wait()
        if m := mismatch(t, expected(ws, dtype, op, count, salt=100 + i)):
            fail(f"interleaved op {i} ({'ring' if i % 2 == 0 else 'tree'} group): {m}")


def check_bitwise_on_float_raises(rank, ws, fail):
    groups = {"default": None, **_groups()}
    for algo, g in groups.items():
        for dtype in FLOAT_DTYPES:
            for op in BITWISE_OPS:
                for async_op in (False, True):
                    t = gen(rank, dtype, "SUM", 10)
                    before = t.clone()
                    try:
                        w = dist.all_reduce(t, op=reduce_op(op), group=g, async_op=async_op)
                        if async_op:
                            w.wait()
                        fail(f"{algo}: {op} on {dtype_name(dtype)} (async_op={async_op}) did not raise")
                        return
                    except dist.DistBackendError as e:
                        msg = str(e)
                        if "all_reduce" not in msg or f"rank {rank}" not in msg or (
                                op not in msg and "bitwise" not in msg.lower()):
                            fail(f"{algo}: unclear error for {op} on {dtype_name(dtype)}: {msg!r}")
                    except Exception as e:
                        fail(f"{algo}: {op} on {dtype_name(dtype)} raised {type(e).__name__} "
                             f"(expected DistBackendError): {e}")
                    if not torch.equal(t, before):
                        fail(f"{algo}: the failed {op} modified its input")
            # The group still works after the errors.
            x = gen(rank, torch.int64, "BAND", 513)
            dist.all_reduce(x, op=dist.ReduceOp.BAND, group=g)
            if m := mismatch(x, expected(ws, torch.int64, "BAND", 513)):
                fail(f"{algo}: BAND on int64 after the float errors: {m}")
            y = gen(rank, torch.float32, "SUM", 1001)
            dist.all_reduce(y, group=g)
            if m := mismatch(y, expected(ws, torch.float32, "SUM", 1001)):
                fail(f"{algo}: SUM on float32 after the float errors: {m}")


def check_subgroup(rank, ws, fail):
    """A collx group over a subset of the ranks, listed out of order."""
    members = [ws - 1, 0] if ws > 2 else [1, 0]
    for algo in ("ring", "tree", "star"):
        g = dist.new_group(ranks=members, backend="collx", pg_options=torchcollx.Options(algorithm=algo))
        if rank in members:
            x = gen(rank, torch.float64, "SUM", 10007)
            dist.all_reduce(x, group=g)
            want = sum(gen(r, torch.float64, "SUM", 10007) for r in members)
            if m := mismatch(x, want):
                fail(f"subgroup {members} {algo}: all_reduce: {m}")
            # src is a global rank; torch maps it to the group rank.
            b = gen(rank, torch.int32, "MIN", 301)
            dist.broadcast(b, src=ws - 1, group=g)
            if m := mismatch(b, gen(ws - 1, torch.int32, "MIN", 301)):
                fail(f"subgroup {members} {algo}: broadcast from global rank {ws - 1}: {m}")
            outs = [torch.empty(5) for _ in members]
            dist.all_gather(outs, torch.full((5,), float(rank)), group=g)
            got = [o[0].item() for o in outs]
            want_order = [float(dist.get_global_rank(g, i)) for i in range(len(members))]
            if got != want_order:
                fail(f"subgroup {members} {algo}: all_gather blocks {got}, expected {want_order}")
        dist.barrier(group=launcher.gloo())


def check_singleton_group(rank, ws, fail):
    """A collx group of one rank: every op is local, but AVG still divides
    (by 1) and PREMUL_SUM still scales, the all-reduce's and the
    reduce-scatter's alike."""
    for algo in ("ring", "tree", "star", "auto"):
        g = dist.new_group(ranks=[ws - 1], backend="collx", pg_options=torchcollx.Options(algorithm=algo))
        if rank != ws - 1:
            continue
        for dtype, op in ((torch.float32, "SUM"), (torch.float64, "AVG"), (torch.float16, "PREMUL_SUM"),
                          (torch.int64, "BXOR"), (torch.bfloat16, "PRODUCT")):
            x = gen(rank, dtype, op, 1001)
            dist.all_reduce(x, op=reduce_op(op), group=g)
            want = gen(rank, dtype, op, 1001) * 0.5 if op == "PREMUL_SUM" else gen(rank, dtype, op, 1001)
            if m := mismatch(x, want):
                fail(f"size-1 {algo} group: {op} {dtype_name(dtype)}: {m}")
        b = gen(rank, torch.int8, "MIN", 33)
        dist.broadcast(b, src=ws - 1, group=g)
        if m := mismatch(b, gen(rank, torch.int8, "MIN", 33)):
            fail(f"size-1 {algo} group: broadcast: {m}")
        out = [torch.empty(9)]
        dist.all_gather(out, torch.arange(9.0), group=g)
        if m := mismatch(out[0], torch.arange(9.0)):
            fail(f"size-1 {algo} group: all_gather: {m}")
        for dtype, op in ((torch.float32, "SUM"), (torch.float64, "AVG"), (torch.float32, "PREMUL_SUM")):
            x = gen(rank, dtype, op, 70001)  # past 64 KiB: a copy of its own
            rs = torch.empty_like(x)
            dist.reduce_scatter_tensor(rs, x, op=reduce_op(op), group=g)
            want = x * 0.5 if op == "PREMUL_SUM" else x
            if m := mismatch(rs, want):
                fail(f"size-1 {algo} group: reduce_scatter_tensor {op} {dtype_name(dtype)}: {m}")
            if m := mismatch(x, gen(rank, dtype, op, 70001)):
                fail(f"size-1 {algo} group: reduce_scatter_tensor {op} changed its input: {m}")
        dist.barrier(group=g)
    dist.barrier(group=launcher.gloo())


def check_unsupported_dtypes(rank, ws, fail):
    """Unsupported dtypes: DistBackendError naming the op and the rank, before
    anything is sent (so no hang), and the group keeps working."""
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.float8_e4m3fn):
        for op_name, call in (
            ("all_reduce", lambda t: dist.all_reduce(t)),
            ("broadcast", lambda t: dist.broadcast(t, src=0)),
            ("all_gather", lambda t: dist.all_gather([torch.empty_like(t) for _ in range(ws)], t)),
        ):
            t = torch.zeros(4, dtype=dtype)
            try:
                call(t)
                fail(f"{op_name} on {dtype_name(dtype)} did not raise")
            except dist.DistBackendError as e:
                if op_name not in str(e) or f"rank {rank}" not in str(e):
                    fail(f"{op_name} on {dtype_name(dtype)}: message does not name op and rank: {e}")
            except Exception as e:
                fail(f"{op_name} on {dtype_name(dtype)}: {type(e).__name__} instead of DistBackendError: {e}")
    # complex SUM goes through torch's view_as_real onto float32.
    c = torch.complex(gen(rank, torch.float32, "SUM", 99), gen(rank, torch.float32, "SUM", 99, salt=1))
    dist.all_reduce(c)
    want = torch.complex(expected(ws, torch.float32, "SUM", 99), expected(ws, torch.float32, "SUM", 99, salt=1))
    if not torch.equal(c, want):
        fail("complex64 SUM is wrong")
    x = gen(rank, torch.float32, "SUM", 10)
    dist.all_reduce(x)
    if m := mismatch(x, expected(ws, torch.float32, "SUM", 10)):
        fail(f"all_reduce after the dtype errors: {m}")


def check_async_mixed_kinds(rank, ws, fail):
    """all_reduce, broadcast, all_gather_into_tensor and barrier in flight at
    once; waited in reverse order; completion in issue order."""
    n = 20001
    a = gen(rank, torch.float32, "SUM", n, salt=3)
    b = gen(rank, torch.int64, "MIN", n, salt=4)
    c_in = gen(rank, torch.float16, "MIN", n, salt=5)
    c_out = torch.empty(ws * n, dtype=torch.float16)
    d = gen(rank, torch.float64, "MAX", 999, salt=6)
    works = [
        dist.all_reduce(a, async_op=True),
        dist.broadcast(b, src=ws - 1, async_op=True),
        dist.all_gather_into_tensor(c_out, c_in, async_op=True),
        dist.barrier(async_op=True),
        dist.all_reduce(d, op=dist.ReduceOp.MAX, async_op=True),
    ]
    works[-1].wait()
    if not all(w.is_completed() for w in works):
        fail(f"last op done before earlier ones: {[w.is_completed() for w in works]}")
    for w in reversed(works):
        w.wait()
    checks = [
        ("all_reduce", a, expected(ws, torch.float32, "SUM", n, salt=3)),
        ("broadcast", b, gen(ws - 1, torch.int64, "MIN", n, salt=4)),
        ("all_gather_into_tensor", c_out, torch.cat([gen(r, torch.float16, "MIN", n, salt=5) for r in range(ws)])),
        ("all_reduce MAX", d, expected(ws, torch.float64, "MAX", 999, salt=6)),
    ]
    for what, got, want in checks:
        if m := mismatch(got, want):
            fail(f"async mixed {what}: {m}")


def check_get_duration(rank, ws, fail):
    """work._get_duration(): the op's time in milliseconds once it completed
    (NCCL's with timing on; gloo raises), for a collective and a p2p op."""
    t = torch.ones(1 << 20)
    t0 = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    wall_ms = (time.perf_counter() - t0) * 1e3
    if not 0 < work._get_duration() <= wall_ms:
        fail(f"all_reduce: _get_duration() = {work._get_duration()} ms, the call and wait took {wall_ms:.3f} ms")
    peer = rank ^ 1
    if peer < ws:
        buf = torch.ones(1000)
        work = dist.isend(buf, peer) if rank % 2 == 0 else dist.irecv(buf, peer)
        work.wait()
        if not work._get_duration() > 0:
            fail(f"p2p: _get_duration() = {work._get_duration()} ms")


MISC_CHECKS = [
    check_async,
    check_future_done_after_wait,
    check_two_groups_interleaved,
    check_bitwise_on_float_raises,
    check_subgroup,
    check_singleton_group,
    check_unsupported_dtypes,
    check_async_mixed_kinds,
    check_get_duration,
]


MISC_WS = [3, 4]
test_allreduce_misc = suite_test(__name__, "MISC_CHECKS", MISC_WS, with_gloo=True, timeout=300)
