"""all_reduce of the collx backend, checked against locally computed results
and against a gloo group over the same processes.

Startup of a rank costs seconds, so each world size gets ONE launch for the
whole dtype x op x count x algorithm matrix (one collx group per algorithm,
made with new_group(pg_options=...)), and one more launch for the other
checks of this file (layouts, PREMUL_SUM factors, segment sizes and arities,
inexact floats, inf / NaN); the tests below read their share of the results
of these launches. Async ops, subgroups and error cases: test_allreduce_misc.py.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

import launcher  # noqa: E402
from collectives_common import _groups  # noqa: E402
from common import (  # noqa: E402
    ALGORITHMS,
    DTYPES,
    FLOAT_DTYPES,
    dtype_name,
    expected,
    gen,
    gloo_supports,
    mismatch,
    ops_for,
    reduce_op,
    Suite,
    suite_test,
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
        if algo == "shm" and os.environ.get("COLLX_TRANSPORT") == "tcp":
            continue  # no shared memory to run it in
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
        concrete = [a for a in ALGORITHMS if a not in ("auto", "hier")]  # one host: auto never takes hier
        allowed = {f"all_reduce/{a}" for a in concrete} if algo == "auto" else {f"all_reduce/{algo}"}
        if algo == "auto" and os.environ.get("COLLX_STAGE_CPU_TENSORS") == "1":
            allowed.add("all_reduce/peers")  # staged tensors on one host (csrc/torch/peer_allreduce.h)
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


MISC_CHECKS = [
    check_noncontiguous,
    check_premul_sum_factors,
    check_segment_sizes_and_arities,
    check_inexact_floats_agree_across_ranks,
    check_inf_nan,
]


MISC_WS = [3, 4]
test_allreduce_misc = suite_test(__name__, "MISC_CHECKS", MISC_WS, with_gloo=True, timeout=300)
