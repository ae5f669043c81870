"""all_reduce of the collx backend, checked against locally computed results
and against a gloo group over the same processes.

Startup of a rank costs seconds, so each world size gets ONE launch for the
whole dtype x op x count x algorithm matrix (one collx group per algorithm,
made with new_group(pg_options=...)), and one more launch for the other
checks; the tests below read their share of the results of these launches.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

import launcher  # noqa: E402
from common import (  # noqa: E402
    ALGORITHMS,
    BITWISE_OPS,
    DTYPES,
    FLOAT_DTYPES,
    Suite,
    dtype_name,
    expected,
    gen,
    gloo_supports,
    mismatch,
    ops_for,
    reduce_op,
    run_checks,
    tolerance,
)

WORLD_SIZES = [2, 3, 4]
COUNTS = [0, 1, 7, 1000, 100003]  # 1000 and 100003 are not divisible by 3 (nor 100003 by 2 or 4)
LARGE = 4 * 1024 * 1024 + 3       # float32 SUM only; not divisible by 2, 3 or 4


def _allreduce_one(group, rank, ws, dtype, op, count, salt=0, shape=None):
    """Runs one all_reduce on collx (and on gloo where gloo supports it) and
    returns the list of failure messages."""
    x = gen(rank, dtype, op, count, salt)
    want = expected(ws, dtype, op, count, salt)
    if shape is not None:
        x, want = x.view(shape), want.view(shape)
    rtol, atol = tolerance(dtype, op)
    where = f"{op} {dtype_name(dtype)} count={count}"
    t = x.clone()
    try:
        ret = dist.all_reduce(t, op=reduce_op(op), group=group)
    except Exception as e:
        return [f"{where}: raised {type(e).__name__}: {e}"]
    msgs = []
    if ret is not None:
        msgs.append(f"{where}: all_reduce without async_op returned {ret!r}, expected None")
    m = mismatch(t, want, rtol, atol)
    if m:
        msgs.append(f"{where}: collx vs local expectation: {m}")
    if gloo_supports(dtype, op):
        y = x.clone()
        dist.all_reduce(y, op=reduce_op(op), group=launcher.gloo())
        m = mismatch(t, y, rtol, atol)
        if m:
            msgs.append(f"{where}: collx vs gloo: {m}")
    return msgs


def _matrix(rank, ws):
    """Child: the whole matrix for one world size. Returns {key: [failures]}."""
    out = {}
    for algo in ALGORITHMS:
        group = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=algo))
        calls = 0
        for dtype in DTYPES:
            fails = out.setdefault(f"{algo}/{dtype_name(dtype)}", [])
            for op in ops_for(dtype):
                for count in COUNTS:
                    fails.extend(_allreduce_one(group, rank, ws, dtype, op, count))
                    calls += 1
        out[f"{algo}/large"] = _allreduce_one(group, rank, ws, torch.float32, "SUM", LARGE)
        calls += 1
        stats_fails = out.setdefault(f"{algo}/stats", [])
        stats = torchcollx.get_stats(group)
        labels = set(stats["algorithms"])
        concrete = [a for a in ALGORITHMS if a != "auto"]
        allowed = {f"all_reduce/{a}" for a in concrete} if algo == "auto" else {f"all_reduce/{algo}"}
        if not labels or not labels <= allowed:
            stats_fails.append(f"Options(algorithm={algo!r}): stats labels {sorted(labels)}, expected a subset of "
                               f"{sorted(allowed)}")
        n_calls = sum(v["calls"] for v in stats["algorithms"].values())
        if n_calls != calls or stats["ops"] != calls:
            stats_fails.append(f"Options(algorithm={algo!r}): {calls} all_reduce calls issued, stats say ops="
                               f"{stats['ops']}, calls per label {stats['algorithms']}")
        dist.destroy_process_group(group)
    return out


MATRIX = {ws: Suite(_matrix, ws, with_gloo=True, timeout=420) for ws in WORLD_SIZES}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def test_allreduce_matrix(ws, algo, dtype):
    """Every valid op for dtype, counts 0/1/7/1000/100003, vs expectation and gloo."""
    MATRIX[ws].check(f"{algo}/{dtype_name(dtype)}")


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def test_allreduce_large_float32(ws, algo):
    """~4M float32 elements (not divisible by the world size), SUM."""
    MATRIX[ws].check(f"{algo}/large")


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def test_allreduce_stats_match_forced_algorithm(ws, algo):
    MATRIX[ws].check(f"{algo}/stats")


# ------------------------------------------------------------------ other checks
# Each takes (rank, ws, fail) and reports problems through fail(msg).

def _groups():
    return {a: dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=a)) for a in ALGORITHMS}


def check_noncontiguous(rank, ws, fail):
    for algo, g in _groups().items():
        # Transposed 2-D view: the result must land in the view (and so in its base).
        base = gen(rank, torch.float32, "SUM", 37 * 23).view(37, 23)
        want = expected(ws, torch.float32, "SUM", 37 * 23).view(37, 23)
        t = base.t()
        assert not t.is_contiguous()
        dist.all_reduce(t, group=g)
        if m := mismatch(t, want.t()):
            fail(f"{algo}: transposed float32 SUM: {m}")
        if m := mismatch(base, want):
            fail(f"{algo}: base of the transposed view after SUM: {m}")

        # Strided slice: elements between the slice's must stay untouched.
        buf = gen(rank, torch.int64, "SUM", 3001)
        keep = buf.clone()
        view = buf[1::3]
        dist.all_reduce(view, op=dist.ReduceOp.SUM, group=g)
        if m := mismatch(view, expected(ws, torch.int64, "SUM", 3001)[1::3]):
            fail(f"{algo}: strided int64 slice SUM: {m}")
        for start in (0, 2):
            if m := mismatch(buf[start::3], keep[start::3]):
                fail(f"{algo}: elements outside the strided slice were modified (start {start}): {m}")

        # Contiguous view with a storage offset.
        buf = gen(rank, torch.float64, "MAX", 500)
        keep = buf.clone()
        view = buf[100:400]
        dist.all_reduce(view, op=dist.ReduceOp.MAX, group=g)
        if m := mismatch(view, expected(ws, torch.float64, "MAX", 500)[100:400]):
            fail(f"{algo}: offset float64 view MAX: {m}")
        if mismatch(buf[:100], keep[:100]) or mismatch(buf[400:], keep[400:]):
            fail(f"{algo}: elements outside the offset view were modified")

        # Permuted 3-D float16 MIN, and transposed float32 AVG / PREMUL_SUM.
        x = gen(rank, torch.float16, "MIN", 120).view(4, 5, 6).permute(2, 0, 1)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=g)
        if m := mismatch(x, expected(ws, torch.float16, "MIN", 120).view(4, 5, 6).permute(2, 0, 1)):
            fail(f"{algo}: permuted float16 MIN: {m}")
        for op in ("AVG", "PREMUL_SUM"):
            x = gen(rank, torch.float32, op, 40 * 7).view(40, 7).t()
            dist.all_reduce(x, op=reduce_op(op), group=g)
            rtol, atol = tolerance(torch.float32, op)
            if m := mismatch(x, expected(ws, torch.float32, op, 40 * 7).view(40, 7).t(), rtol, atol):
                fail(f"{algo}: transposed float32 {op}: {m}")

        # Non-contiguous + async: the result is in the tensor after wait().
        x = gen(rank, torch.int32, "BXOR", 64 * 9).view(64, 9).t()
        dist.all_reduce(x, op=dist.ReduceOp.BXOR, group=g, async_op=True).wait()
        if m := mismatch(x, expected(ws, torch.int32, "BXOR", 64 * 9).view(64, 9).t()):
            fail(f"{algo}: transposed int32 BXOR async: {m}")

        # channels_last 4-D: dense, but not contiguous in the default format.
        x = gen(rank, torch.float32, "SUM", 2 * 3 * 4 * 5).view(2, 3, 4, 5).to(memory_format=torch.channels_last)
        dist.all_reduce(x, group=g)
        if m := mismatch(x, expected(ws, torch.float32, "SUM", 2 * 3 * 4 * 5).view(2, 3, 4, 5)):
            fail(f"{algo}: channels_last float32 SUM: {m}")

        # 0-dim scalar and empty 2-D tensors keep their shapes.
        s = gen(rank, torch.float64, "SUM", 1).reshape(())
        dist.all_reduce(s, group=g)
        if m := mismatch(s, expected(ws, torch.float64, "SUM", 1).reshape(())):
            fail(f"{algo}: 0-dim float64 SUM: {m}")
        e = torch.empty(0, 5)
        dist.all_reduce(e, group=g)
        if e.shape != (0, 5):
            fail(f"{algo}: empty (0, 5) tensor came back with shape {tuple(e.shape)}")


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


def check_premul_sum_factors(rank, ws, fail):
    for algo, g in _groups().items():
        for dtype in FLOAT_DTYPES:
            for factor in (0.25, 3.0, torch.tensor(0.125, dtype=dtype)):
                x = gen(rank, dtype, "PREMUL_SUM", 1003)
                f = factor.item() if isinstance(factor, torch.Tensor) else factor
                dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor), group=g)
                want = expected(ws, dtype, "PREMUL_SUM", 1003, factor=f)
                if m := mismatch(x, want):
                    kind = "tensor" if isinstance(factor, torch.Tensor) else "float"
                    fail(f"{algo}: PREMUL_SUM {dtype_name(dtype)} with {kind} factor {f}: {m}")


SEGMENT_GROUPS = [
    dict(algorithm="ring", segment_bytes=64),
    dict(algorithm="ring", segment_bytes=100),   # not a multiple of any element size > 4
    dict(algorithm="tree", tree_arity=1, segment_bytes=100),  # a chain
    dict(algorithm="tree", tree_arity=3, segment_bytes=72),
    dict(algorithm="tree", tree_arity=8, segment_bytes=1000),
    dict(algorithm="star", segment_bytes=100),
    dict(algorithm="auto", segment_bytes=1 << 30),
]


def check_segment_sizes_and_arities(rank, ws, fail):
    for spec in SEGMENT_GROUPS:
        g = dist.new_group(backend="collx", pg_options=torchcollx.Options(**spec))
        for dtype in (torch.float32, torch.float64, torch.float16, torch.int8):
            for op in ("SUM", "MAX"):
                for count in (1, 7, 1000, 10007):
                    for m in _allreduce_one(g, rank, ws, dtype, op, count, salt=7):
                        fail(f"Options({spec}): {m}")
        dist.destroy_process_group(g)


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
    (by 1) and PREMUL_SUM still scales."""
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
        dist.barrier(group=g)
    dist.barrier(group=launcher.gloo())


def check_inexact_floats_agree_across_ranks(rank, ws, fail):
    """Random (inexact) float data: the result is close to the float64 sum
    and bitwise identical on every rank."""
    n = 100003
    for algo, g in _groups().items():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for op in ("SUM", "AVG", "PREMUL_SUM"):
                factor = 0.1
                xs = [torch.randn(n, generator=torch.Generator().manual_seed(77 + r), dtype=torch.float64).to(dtype)
                      for r in range(ws)]
                t = xs[rank].clone()
                dist.all_reduce(t, op=reduce_op(op, factor), group=g)
                exact = sum(x.double() for x in xs)
                if op == "AVG":
                    exact = exact / ws
                elif op == "PREMUL_SUM":
                    exact = sum((x * factor).double() for x in xs)
                bound = sum(x.double().abs() for x in xs) * (ws + 1) * torch.finfo(dtype).eps
                err = (t.double() - exact).abs()
                if (err > bound).any():
                    i = int((err - bound).argmax())
                    fail(f"{algo}: {op} {dtype_name(dtype)} random data: element {i} is {t[i].item()}, "
                         f"float64 reference {exact[i].item()}")
                every = [torch.empty_like(t) for _ in range(ws)]
                dist.all_gather(every, t, group=launcher.gloo())
                for r in range(ws):
                    if not torch.equal(every[r].view(torch.int16 if dtype != torch.float32 else torch.int32),
                                       t.view(torch.int16 if dtype != torch.float32 else torch.int32)):
                        fail(f"{algo}: {op} {dtype_name(dtype)}: the result on rank {r} differs from rank {rank}'s")
                        break


def check_inf_nan(rank, ws, fail):
    """IEEE specials: inf and NaN propagate through SUM, and MIN/MAX
    propagate NaN like torch.minimum / torch.maximum."""
    inf, nan = float("inf"), float("nan")
    for algo, g in _groups().items():
        for dtype in FLOAT_DTYPES:
            # column 0: inf on rank 0 only; 1: +inf on rank 0, -inf on rank 1;
            # 2: NaN on the last rank; 3: finite.
            x = torch.tensor([inf if rank == 0 else 1.0,
                              inf if rank == 0 else (-inf if rank == 1 else 0.0),
                              nan if rank == ws - 1 else 2.0,
                              float(rank)], dtype=dtype)
            s = x.clone()
            dist.all_reduce(s, group=g)
            want = torch.tensor([inf, nan, nan, float(sum(range(ws)))], dtype=dtype)
            if m := mismatch(s, want):
                fail(f"{algo}: SUM {dtype_name(dtype)} with inf/NaN: {m}")
            for op, fn in (("MAX", torch.maximum), ("MIN", torch.minimum)):
                y = x.clone()
                dist.all_reduce(y, op=getattr(dist.ReduceOp, op), group=g)
                cols = [torch.tensor([inf if r == 0 else 1.0, inf if r == 0 else (-inf if r == 1 else 0.0),
                                      nan if r == ws - 1 else 2.0, float(r)], dtype=dtype) for r in range(ws)]
                want = cols[0]
                for c in cols[1:]:
                    want = fn(want, c)
                if m := mismatch(y, want):
                    fail(f"{algo}: {op} {dtype_name(dtype)} with inf/NaN: {m}")


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


MISC_CHECKS = [
    check_noncontiguous,
    check_async,
    check_future_done_after_wait,
    check_two_groups_interleaved,
    check_bitwise_on_float_raises,
    check_premul_sum_factors,
    check_segment_sizes_and_arities,
    check_subgroup,
    check_singleton_group,
    check_inexact_floats_agree_across_ranks,
    check_inf_nan,
    check_unsupported_dtypes,
    check_async_mixed_kinds,
]


def _misc(rank, ws):
    return run_checks(MISC_CHECKS, rank, ws)


MISC_WS = [3, 4]
MISC = {ws: Suite(_misc, ws, with_gloo=True, timeout=300) for ws in MISC_WS}


@pytest.mark.parametrize("check", [c.__name__ for c in MISC_CHECKS])
@pytest.mark.parametrize("ws", MISC_WS, ids=lambda ws: f"ws{ws}")
def test_allreduce_misc(ws, check):
    MISC[ws].check(check)
