"""broadcast, all_gather(_into_tensor/_object), barrier, all_reduce_coalesced
and get_stats of collx. (Options / COLLX_* environment: test_options.py;
init methods, re-init, timeouts and failures: test_lifecycle.py.)

As in test_allreduce.py, the checks that can share processes run in one
launch per world size (a Suite) and are reported as separate tests.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

import launcher  # noqa: E402
from collectives_common import _data  # noqa: E402
from common import DTYPES, dtype_name, expected, gen, mismatch, suite_test  # noqa: E402

COUNTS = [0, 1, 7, 1000, 100003]


def _backend_error_ok(e, op, rank):
    """DistBackendError whose message names the op and the rank."""
    return isinstance(e, dist.DistBackendError) and op in str(e) and f"rank {rank}" in str(e)


# ------------------------------------------------------------------ broadcast

def check_broadcast(rank, ws, fail):
    groups = {"default": None, "ring": dist.new_group(backend="collx",
                                                     pg_options=torchcollx.Options(algorithm="ring"))}
    for gname, g in groups.items():
        for root in range(ws):
            for dtype in DTYPES:
                for count in COUNTS:
                    salt = 1000 * root + 7
                    t = _data(rank, dtype, count, salt) if rank == root else torch.zeros(count, dtype=dtype)
                    if rank != root and count:
                        t.fill_(1 if dtype != torch.bool else True)
                    dist.broadcast(t, src=root, group=g)
                    if m := mismatch(t, _data(root, dtype, count, salt)):
                        fail(f"{gname}: broadcast root={root} {dtype_name(dtype)} count={count}: {m}")
            # Large, with a segment pipeline.
            t = _data(rank, torch.float32, 1 << 20 | 5, 3)
            dist.broadcast(t, src=root, group=g)
            if m := mismatch(t, _data(root, torch.float32, 1 << 20 | 5, 3)):
                fail(f"{gname}: broadcast root={root} float32 count={1 << 20 | 5}: {m}")


def check_broadcast_noncontiguous_and_async(rank, ws, fail):
    for root in range(ws):
        # Transposed 2-D.
        base = _data(rank, torch.float64, 31 * 17, root).view(31, 17)
        t = base.t()
        dist.broadcast(t, src=root)
        if m := mismatch(base, _data(root, torch.float64, 31 * 17, root).view(31, 17)):
            fail(f"transposed float64 broadcast from {root}: {m}")
        # Strided slice: the elements between must stay untouched on every rank.
        buf = _data(rank, torch.int32, 3001, root + 50)
        keep = buf.clone()
        view = buf[2::3]
        dist.broadcast(view, src=root)
        if m := mismatch(view, _data(root, torch.int32, 3001, root + 50)[2::3]):
            fail(f"strided int32 broadcast from {root}: {m}")
        if mismatch(buf[0::3], keep[0::3]) or mismatch(buf[1::3], keep[1::3]):
            fail(f"strided int32 broadcast from {root} modified elements outside the slice")
        # Async, several in flight, futures hold the tensor.
        ts = [_data(rank, torch.bfloat16, 513 * (i + 1), root + 100 * i) for i in range(4)]
        works = [dist.broadcast(t, src=root, async_op=True) for t in ts]
        for i in reversed(range(4)):
            works[i].wait()
            if not works[i].is_completed():
                fail(f"async broadcast {i} from {root}: not is_completed() after wait()")
        for i, (t, w) in enumerate(zip(ts, works)):
            want = _data(root, torch.bfloat16, 513 * (i + 1), root + 100 * i)
            if m := mismatch(t, want):
                fail(f"async broadcast {i} from {root}: {m}")
            v = w.get_future().wait()  # see check_future_done_after_wait
            if not (isinstance(v, list) and len(v) == 1 and isinstance(v[0], torch.Tensor)):
                fail(f"async broadcast {i}: future value {v!r} is not a list of one tensor")
            elif m := mismatch(v[0], want):
                fail(f"async broadcast {i}: future value: {m}")


def check_broadcast_bad_root(rank, ws, fail):
    for bad in (ws, ws + 5, -1):
        t = torch.arange(5, dtype=torch.float32)
        try:
            dist.broadcast(t, src=bad)
            fail(f"broadcast(src={bad}) did not raise")
            return
        except (dist.DistBackendError, ValueError, RuntimeError) as e:
            if not (("broadcast" in str(e) or "root" in str(e).lower() or "src" in str(e).lower())
                    and str(bad) in str(e)):
                fail(f"broadcast(src={bad}): unclear error {type(e).__name__}: {e}")
        # Straight to the backend: the root check must be collx's own.
        backend = torchcollx.stats.backend_of(None)
        opts = dist.BroadcastOptions()
        opts.rootRank = bad
        try:
            backend.broadcast([torch.zeros(4)], opts).wait()
            fail(f"CollxBackend.broadcast(rootRank={bad}) did not raise")
            return
        except Exception as e:
            if not _backend_error_ok(e, "broadcast", rank):
                fail(f"CollxBackend.broadcast(rootRank={bad}): {type(e).__name__} not naming op and rank: {e}")
    # The group still works.
    t = _data(rank, torch.int64, 77, 9)
    dist.broadcast(t, src=ws - 1)
    if m := mismatch(t, _data(ws - 1, torch.int64, 77, 9)):
        fail(f"broadcast after the bad-root errors: {m}")


# ------------------------------------------------------------------ all_gather

GATHER_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool]


def check_all_gather(rank, ws, fail):
    for dtype in GATHER_DTYPES:
        for count in COUNTS + [1 << 20 | 3]:
            if count > 100003 and dtype != torch.float32:
                continue
            x = _data(rank, dtype, count, 11)
            outs = [torch.empty(count, dtype=dtype) for _ in range(ws)]
            dist.all_gather(outs, x)
            for r in range(ws):
                if m := mismatch(outs[r], _data(r, dtype, count, 11)):
                    fail(f"all_gather {dtype_name(dtype)} count={count}: block of rank {r}: {m}")
            if count <= 1000:
                ref = [torch.empty(count, dtype=dtype) for _ in range(ws)]
                dist.all_gather(ref, x, group=launcher.gloo())
                for r in range(ws):
                    if m := mismatch(outs[r], ref[r]):
                        fail(f"all_gather {dtype_name(dtype)} count={count}: vs gloo, block {r}: {m}")
    # 2-D, non-contiguous input and non-contiguous outputs.
    x = _data(rank, torch.float64, 6 * 5, 12).view(6, 5).t()
    outs = [torch.zeros(6, 5, dtype=torch.float64).t() for _ in range(ws)]
    dist.all_gather(outs, x)
    for r in range(ws):
        if m := mismatch(outs[r], _data(r, torch.float64, 6 * 5, 12).view(6, 5).t()):
            fail(f"all_gather non-contiguous 2-D: block of rank {r}: {m}")
    # Inputs among the outputs (the rank's own, and the first, which on the
    # other ranks is a block the op overwrites), outputs of which one is not
    # contiguous, and one tensor passed as every output (gloo leaves the last
    # rank's block in it); small (direct) and large (shared memory or the ring).
    for count in (1000, 1 << 18 | 1):
        for at in (rank, 0):
            outs = [torch.zeros(count) for _ in range(ws)]
            outs[at].copy_(_data(rank, torch.float32, count, 15))
            dist.all_gather(outs, outs[at])
            for r in range(ws):
                if m := mismatch(outs[r], _data(r, torch.float32, count, 15)):
                    fail(f"all_gather with the input in output {at}, count={count}: block of rank {r}: {m}")
        strided = [torch.zeros(count, 2)[:, 1] if r == (rank + 1) % ws else torch.zeros(count) for r in range(ws)]
        dist.all_gather(strided, _data(rank, torch.float32, count, 15))
        for r in range(ws):
            if m := mismatch(strided[r], _data(r, torch.float32, count, 15)):
                fail(f"all_gather into a strided output, count={count}: block of rank {r}: {m}")
        one, ref = torch.zeros(count), torch.zeros(count)
        dist.all_gather([one] * ws, _data(rank, torch.float32, count, 15))
        dist.all_gather([ref] * ws, _data(rank, torch.float32, count, 15), group=launcher.gloo())
        if m := mismatch(one, ref):
            fail(f"all_gather into one tensor passed {ws} times, count={count}: vs gloo: {m}")
    # Outputs that are views of one buffer (the usual list(buf.unbind(0))).
    x = _data(rank, torch.int64, 513, 14)
    buf = torch.zeros(ws, 513, dtype=torch.int64)
    dist.all_gather(list(buf.unbind(0)), x)
    if m := mismatch(buf, torch.stack([_data(r, torch.int64, 513, 14) for r in range(ws)])):
        fail(f"all_gather into views of one buffer: {m}")
    # Async with a future whose value holds the outputs.
    x = _data(rank, torch.int32, 999, 13)
    outs = [torch.empty(999, dtype=torch.int32) for _ in range(ws)]
    w = dist.all_gather(outs, x, async_op=True)
    w.wait()
    v = w.get_future().wait()  # see check_future_done_after_wait
    if not (isinstance(v, list) and all(isinstance(t, torch.Tensor) for t in v)):
        fail(f"async all_gather: future value {type(v).__name__} is not a list of tensors")
    for r in range(ws):
        if m := mismatch(outs[r], _data(r, torch.int32, 999, 13)):
            fail(f"async all_gather: block of rank {r}: {m}")


def check_all_gather_into_tensor(rank, ws, fail):
    """all_gather_into_tensor and its torch 2.14 name all_gather_single (users
    write both): 1-D and (ws, n) outputs, a non-contiguous one, in place."""
    for dtype in (torch.float32, torch.float64, torch.uint8, torch.bool):
        for count in (0, 1, 7, 1000, 100003, 1 << 20 | 1):
            if count > 100003 and dtype != torch.float32:
                continue
            x = _data(rank, dtype, count, 21)
            want = torch.cat([_data(r, dtype, count, 21) for r in range(ws)])
            out = torch.empty(ws * count, dtype=dtype)
            dist.all_gather_into_tensor(out, x)
            if m := mismatch(out, want):
                fail(f"all_gather_into_tensor 1-D {dtype_name(dtype)} count={count}: {m}")
            out2 = torch.empty(ws, count, dtype=dtype)
            dist.all_gather_single(out2, x)
            if m := mismatch(out2, want.view(ws, count)):
                fail(f"all_gather_single (ws, n) {dtype_name(dtype)} count={count}: {m}")
    # Non-contiguous output: (ws, n) seen through a transpose of an (n, ws) buffer.
    n = 257
    x = _data(rank, torch.float32, n, 22)
    want = torch.stack([_data(r, torch.float32, n, 22) for r in range(ws)])
    out = torch.zeros(n, ws).t()
    dist.all_gather_single(out, x)
    if m := mismatch(out, want):
        fail(f"all_gather_single into a non-contiguous output: {m}")
    # In place: the input is this rank's slice of the output (the FSDP pattern).
    out = torch.zeros(ws * n)
    out[rank * n:(rank + 1) * n] = x
    dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n])
    if m := mismatch(out, want.reshape(-1)):
        fail(f"in-place all_gather_into_tensor: {m}")
    # Wrong output size: a clear error on every rank, then the group still works.
    try:
        dist.all_gather_into_tensor(torch.empty(ws * n + 1), x)
        fail("all_gather_into_tensor with a wrong output size did not raise")
    except Exception as e:
        if not (isinstance(e, (dist.DistBackendError, ValueError, RuntimeError)) and "all_gather" in str(e)):
            fail(f"all_gather_into_tensor with a wrong output size: unclear {type(e).__name__}: {e}")
    out = torch.empty(ws * n)
    dist.all_gather_into_tensor(out, x)
    if m := mismatch(out, want.reshape(-1)):
        fail(f"all_gather_into_tensor after the size error: {m}")


def check_all_gather_object(rank, ws, fail):
    obj = {"rank": rank, "payload": "x" * (rank * 1000 + 3), "list": list(range(rank + 1))}
    got = [None] * ws
    dist.all_gather_object(got, obj)
    for r in range(ws):
        want = {"rank": r, "payload": "x" * (r * 1000 + 3), "list": list(range(r + 1))}
        if got[r] != want:
            fail(f"all_gather_object: entry {r} is {str(got[r])[:200]}")


# ------------------------------------------------------------------ barrier

def check_barrier(rank, ws, fail):
    groups = {"default": None}
    for algo in ("ring", "star"):
        groups[algo] = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=algo))
    for name, g in groups.items():
        for late in (0, ws - 1):
            dist.barrier(group=g)  # align
            if rank == late:
                time.sleep(1.0)
            t0 = time.monotonic()
            dist.barrier(group=g)
            waited = time.monotonic() - t0
            if rank != late and waited < 0.7:
                fail(f"{name}: barrier returned after {waited:.3f} s although rank {late} entered it ~1 s late")
    w = dist.barrier(async_op=True)
    w.wait()
    if not w.is_completed():
        fail("async barrier: not completed after wait()")


# ------------------------------------------------------------------ all_reduce_coalesced

COALESCED_SHAPES = [(3, 4), (5,), (2, 3, 2), (0,), (), (1000,)]


def check_all_reduce_coalesced(rank, ws, fail):
    for dtype, op in ((torch.float32, "SUM"), (torch.int64, "MAX"), (torch.float64, "AVG"), (torch.int32, "BXOR")):
        for async_op in (False, True):
            ts, wants = [], []
            for i, shape in enumerate(COALESCED_SHAPES):
                n = int(torch.tensor(shape).prod().item()) if shape else 1
                ts.append(gen(rank, dtype, op, n, salt=i).view(shape))
                wants.append(expected(ws, dtype, op, n, salt=i).view(shape))
            # One non-contiguous member.
            ts[0] = gen(rank, dtype, op, 12, salt=0).view(4, 3).t()
            wants[0] = expected(ws, dtype, op, 12, salt=0).view(4, 3).t()
            w = dist.all_reduce_coalesced(ts, op=getattr(dist.ReduceOp, op), async_op=async_op)
            if async_op:
                w.wait()
            for i, (t, want) in enumerate(zip(ts, wants)):
                rtol = torch.finfo(dtype).eps if op == "AVG" else 0.0
                if m := mismatch(t, want, rtol):
                    fail(f"all_reduce_coalesced {op} {dtype_name(dtype)} async={async_op} tensor {i} "
                         f"shape {tuple(t.shape)}: {m}")
            if op != "AVG":
                refs = [gen(rank, dtype, op, t.numel(), salt=i).view(t.shape) for i, t in enumerate(ts)]
                refs[0] = gen(rank, dtype, op, 12, salt=0).view(4, 3).t()
                dist.all_reduce_coalesced(refs, op=getattr(dist.ReduceOp, op), group=launcher.gloo())
                for i, (t, ref) in enumerate(zip(ts, refs)):
                    if m := mismatch(t, ref):
                        fail(f"all_reduce_coalesced {op} {dtype_name(dtype)} tensor {i}: vs gloo: {m}")
    # Mixed dtypes: a clear error before anything is sent, then the group works.
    try:
        dist.all_reduce_coalesced([torch.ones(3), torch.ones(3, dtype=torch.float64)])
        fail("all_reduce_coalesced with mixed dtypes did not raise")
    except Exception as e:
        if not isinstance(e, (dist.DistBackendError, ValueError, RuntimeError)):
            fail(f"all_reduce_coalesced with mixed dtypes raised {type(e).__name__}: {e}")
    t = [torch.full((4,), float(rank)), torch.full((2, 2), 1.0)]
    dist.all_reduce_coalesced(t)
    if not (torch.equal(t[0], torch.full((4,), float(sum(range(ws))))) and torch.equal(t[1], torch.full((2, 2), float(ws)))):
        fail(f"all_reduce_coalesced after the dtype error: {t}")


# ------------------------------------------------------------------ stats

def check_stats(rank, ws, fail):
    n, k = 10000, 5
    nbytes = 4 * n
    for algo in ("ring", "tree", "star", "auto"):
        g = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=algo))
        s0 = torchcollx.get_stats(g)
        for key in ("ops", "bytes_sent", "bytes_received", "algorithms"):
            if key not in s0:
                fail(f"{algo}: get_stats() has no {key!r}: {s0}")
                return
        if s0["ops"] != 0 or s0["algorithms"]:
            fail(f"{algo}: a fresh group already counts ops: {s0}")
        for i in range(k):
            t = torch.full((n,), float(rank + i))
            dist.all_reduce(t, group=g)
        s1 = torchcollx.get_stats(g)
        labels = s1["algorithms"]
        if algo != "auto":
            if set(labels) != {f"all_reduce/{algo}"}:
                fail(f"{algo}: labels after {k} all_reduce: {sorted(labels)}")
        else:
            # The group's choice, or, while online refinement tries this size
            # class (refine.h), the candidates in turn, in blocks of 16, 8 or
            # 4 ops, starting with the choice: k = 5 ops see it, or it and the next.
            choice = "all_reduce/" + g._get_backend(torch.device("cpu")).choose_allreduce(nbytes)
            calls = {label: v["calls"] for label, v in labels.items()}
            others = sorted(set(calls) - {choice})
            in_turn = len(others) == 1 and calls.get(choice) == 4 and calls[others[0]] == k - 4
            if calls != {choice: k} and not in_turn:
                fail(f"auto: labels after {k} all_reduce of one size: {calls}, but the group's model "
                     f"chooses {choice}, or that and one other in turn")
        if s1["ops"] != k or sum(v["calls"] for v in labels.values()) != k:
            fail(f"{algo}: after {k} all_reduce: ops={s1['ops']}, algorithms={labels}")
        if any(not (v["seconds"] > 0) for v in labels.values()):
            fail(f"{algo}: seconds not > 0: {labels}")
        if s1["bytes_sent"] <= s0["bytes_sent"] or s1["bytes_received"] <= s0["bytes_received"]:
            fail(f"{algo}: bytes did not grow: before {s0}, after {s1}")
        # Across ranks, since the group was made: everything sent was
        # received. (Not since s0: the group's setup, in the background,
        # exchanges its tuning check, which may leave one rank before its s0
        # and reach another after its own.) And the ops moved what an
        # all-reduce must move (2(n-1)/n of the buffer per rank, summed:
        # 2(ws-1)B), give or take headers.
        dist.barrier(group=g)
        s2 = torchcollx.get_stats(g)
        every = [None] * ws
        dist.all_gather_object(every, (s0, s2), group=launcher.gloo())
        total_sent = sum(b["bytes_sent"] for _, b in every)
        total_received = sum(b["bytes_received"] for _, b in every)
        if total_sent != total_received:
            fail(f"{algo}: bytes sent by all ranks {total_sent} != bytes received by all ranks {total_received}")
        sent = sum(b["bytes_sent"] - a["bytes_sent"] for a, b in every)
        # Direct (which auto may run) sends the whole buffer to every peer: ws(ws-1)B.
        per_op = {"all_reduce/direct": ws * (ws - 1) * nbytes}
        low = sum(per_op.get(label, 2 * (ws - 1) * nbytes) * v["calls"] for label, v in labels.items())
        if not (low <= sent <= 1.5 * low + 65536):
            fail(f"{algo}: {k} all_reduce of {nbytes} B on {ws} ranks sent {sent} B in all, expected "
                 f"about {low} B")
        # Other collectives are counted too.
        t = torch.zeros(100)
        dist.broadcast(t, src=0, group=g)
        dist.all_gather([torch.empty(100) for _ in range(ws)], t, group=g)
        s3 = torchcollx.get_stats(g)
        if s3["ops"] != s2["ops"] + 2:
            fail(f"{algo}: ops went {s2['ops']} -> {s3['ops']} over a broadcast and an all_gather")
        new = set(s3["algorithms"]) - set(s2["algorithms"])
        if not any(label.startswith("broadcast/") for label in new) or not any(
                label.startswith("all_gather/") for label in new):
            fail(f"{algo}: no broadcast/... and all_gather/... labels in {sorted(s3['algorithms'])}")
        if s3["bytes_sent"] < s2["bytes_sent"]:
            fail(f"{algo}: bytes_sent decreased")
        dist.destroy_process_group(g)
    # The world group (group=None), and a clear error for a non-collx group.
    before = torchcollx.get_stats()["ops"]
    dist.all_reduce(torch.ones(3))
    if torchcollx.get_stats(None)["ops"] != before + 1:
        fail("get_stats() of the world group did not count an all_reduce")
    try:
        torchcollx.get_stats(launcher.gloo())
        fail("get_stats(gloo group) did not raise")
    except (ValueError, RuntimeError, TypeError) as e:
        if "collx" not in str(e):
            fail(f"get_stats(gloo group): unclear error {e}")


SUITE_CHECKS = [
    check_broadcast,
    check_broadcast_noncontiguous_and_async,
    check_broadcast_bad_root,
    check_all_gather,
    check_all_gather_into_tensor,
    check_all_gather_object,
    check_barrier,
    check_all_reduce_coalesced,
    check_stats,
]


SUITE_WS = [2, 3, 4]
test_collective = suite_test(__name__, "SUITE_CHECKS", SUITE_WS, with_gloo=True, timeout=300)
