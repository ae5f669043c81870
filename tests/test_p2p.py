"""Point-to-point ops and barriers of the collx backend, checked against
values computed locally, at world sizes 2, 3 and 4:

  send / recv / isend / irecv (tags, any source, out-of-order tags, the ring
  shift under every all-reduce algorithm, mismatches, timeouts),
  batch_isend_irecv, barrier (waits for earlier async work), monitored_barrier.

Process startup costs seconds, so each world size runs ONE launch (a Suite)
for all the checks of this file.
"""
from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

from collectives_common import MIB4, WORLD_SIZES, _data  # noqa: E402
from common import DTYPES, attempt, dtype_name, mismatch, suite_test  # noqa: E402


# ------------------------------------------------------------------ point to point

def check_send_recv(rank, ws, fail):
    """Blocking send/recv around the ring with tags (several tags in a row,
    matched in order), isend/irecv between every pair at once, and recv from
    any source returning the source rank."""
    right, left = (rank + 1) % ws, (rank - 1) % ws
    for dtype in DTYPES:
        for count in (0, 1, 1000):
            for tag in (0, 5):
                x = _data(rank, dtype, count, 100 + tag)
                y = torch.full((count,), 1, dtype=dtype)
                if rank % 2 == 0:
                    dist.send(x, right, tag=tag)
                    got = dist.recv(y, left, tag=tag)
                else:
                    got = dist.recv(y, left, tag=tag)
                    dist.send(x, right, tag=tag)
                if got != left:
                    fail(f"recv(src={left}, tag={tag}) returned {got!r}")
                if m := mismatch(y, _data(left, dtype, count, 100 + tag)):
                    fail(f"send/recv ring {dtype_name(dtype)} count={count} tag={tag}: {m}")
    # isend / irecv with every peer, all posted before any wait, receives
    # first on every rank: two tagged messages each way per pair (a small and
    # a 1.2 MB one), as gloo users write it.
    sends, recvs = [], []
    for p in range(ws):
        if p == rank:
            continue
        for tag, count in ((1, 10), (2, 300_000)):
            buf = torch.zeros(count)
            recvs.append((p, tag, count, buf, dist.irecv(buf, p, tag=tag)))
    for p in range(ws):
        if p == rank:
            continue
        for tag, count in ((1, 10), (2, 300_000)):
            sends.append(dist.isend(_data(rank, torch.float32, count, 1000 * p + tag), p, tag=tag))
    for w in sends:
        w.wait()
    for p, tag, count, buf, w in recvs:
        w.wait()
        if m := mismatch(buf, _data(p, torch.float32, count, 1000 * rank + tag)):
            fail(f"irecv from {p} tag={tag} count={count}: {m}")
    # Any source: rank 0 receives one message from each other rank, in arrival order.
    dist.barrier()
    if rank == 0:
        seen = []
        for _ in range(ws - 1):
            t = torch.zeros(64, dtype=torch.int64)
            src = dist.recv(t, tag=9)
            seen.append(src)
            if not isinstance(src, int) or not 1 <= src < ws:
                fail(f"recv() from any source returned {src!r}")
            elif m := mismatch(t, torch.full((64,), 1000 + src, dtype=torch.int64)):
                fail(f"recv() from any source (returned src={src}): data: {m}")
        if sorted(seen) != list(range(1, ws)):
            fail(f"recv() from any source returned sources {seen}, expected each of 1..{ws - 1} once")
    else:
        time.sleep(0.05 * rank)
        dist.send(torch.full((64,), 1000 + rank, dtype=torch.int64), 0, tag=9)
    # irecv from any source (src=None) gives the source through the work.
    if rank == 0:
        t = torch.zeros(8)
        w = dist.irecv(t)
        w.wait()
        if hasattr(w, "_source_rank"):
            if w._source_rank() != ws - 1:
                fail(f"irecv() from any source: work._source_rank() = {w._source_rank()}, expected {ws - 1}")
        if m := mismatch(t, torch.full((8,), 7.0)):
            fail(f"irecv() from any source: data: {m}")
    elif rank == ws - 1:
        dist.send(torch.full((8,), 7.0), 0)
    dist.barrier()


def check_p2p_out_of_order_tags(rank, ws, fail):
    """Two messages to one peer, received in the opposite tag order: tags match
    independently (gloo's semantics), so the receive of the second tag
    completes before the first tag's is even posted. Small and large (the
    large ones go by request and clearance) messages; then three messages with
    one tag arrive in posting order."""
    for count in (3, 300_000):
        if rank == 0:
            a = dist.isend(torch.full((count,), 1.0), 1, tag=1)
            b = dist.isend(torch.full((count,), 2.0), 1, tag=2)
            a.wait()
            b.wait()
            for k in range(3):
                dist.send(torch.full((count,), 10.0 + k), 1, tag=3)
        elif rank == 1:
            x, y = torch.zeros(count), torch.zeros(count)
            dist.irecv(y, 0, tag=2).wait()
            dist.irecv(x, 0, tag=1).wait()
            if not (torch.equal(x, torch.full((count,), 1.0)) and torch.equal(y, torch.full((count,), 2.0))):
                fail(f"out-of-order tags count={count}: x={x[:3]} y={y[:3]}")
            bufs = [torch.zeros(count) for _ in range(3)]
            works = [dist.irecv(b, 0, tag=3) for b in bufs]
            for k, (b, w) in enumerate(zip(bufs, works)):
                w.wait()
                if not torch.equal(b, torch.full((count,), 10.0 + k)):
                    fail(f"same-tag messages out of order count={count}: message {k} got {b[:3]}")
    dist.barrier()


def check_ring_shift(rank, ws, fail):
    """The gloo user's ring shift: irecv(prev); isend(next); wait -- on every
    rank at once, at 4 KB and 16 MB, with all_reduce calls between the posts
    and the waits, on a group per all-reduce algorithm."""
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    for algo in ("auto", "ring", "tree", "star", "direct", "hier"):
        g = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=algo))
        for count in (1000, 4 << 20):
            buf = torch.zeros(count)
            reqs = [dist.irecv(buf, src=prv, group=g), dist.isend(torch.full((count,), float(rank)), dst=nxt, group=g)]
            t = torch.full((1000,), float(rank))
            dist.all_reduce(t, group=g)
            for r in reqs:
                r.wait()
            if not torch.equal(buf, torch.full((count,), float(prv))):
                fail(f"ring shift {algo} count={count}: got {buf[:3]}, expected {prv}")
            if t[0].item() != sum(range(ws)):
                fail(f"all_reduce between ring-shift posts ({algo}): got {t[0].item()}")
            # An unmatched receive does not hold back later collectives.
            late = torch.zeros(7)
            w = dist.irecv(late, src=prv, group=g, tag=5)
            t = torch.ones(count)
            dist.all_reduce(t, group=g)
            dist.barrier(group=g)
            if t[-1].item() != ws:
                fail(f"all_reduce behind an unmatched irecv ({algo}): got {t[-1].item()}")
            dist.send(torch.full((7,), float(rank)), nxt, group=g, tag=5)
            w.wait()
            if not torch.equal(late, torch.full((7,), float(prv))):
                fail(f"late-matched irecv ({algo}): got {late}")
        dist.destroy_process_group(g)


def check_p2p_mismatch(rank, ws, fail):
    """A size or dtype mismatch fails the receive with a clear error before
    its buffer is written (and a large send with it); the group goes on."""
    for count, wrong in ((10, torch.zeros(12)), (10, torch.zeros(10, dtype=torch.int32)),
                         (300_000, torch.zeros(300_001))):
        wrong.fill_(-7)
        if rank == 0:
            kind, msg, _ = attempt(lambda: dist.send(torch.ones(count), 1, tag=8))
            if count > 16384 and (kind != "DistBackendError" or "refused" not in msg):
                fail(f"large send into a mismatched recv: {kind}: {msg}")
        elif rank == 1:
            kind, msg, _ = attempt(lambda: dist.recv(wrong, 0, tag=8))
            if kind != "DistBackendError" or "mismatched send/recv with peer 0" not in msg or "rank 1" not in msg:
                fail(f"mismatched recv of {count} into {wrong.numel()} x {wrong.dtype}: {kind}: {msg}")
            if not torch.all(wrong == -7):
                fail("a mismatched recv wrote to its buffer")
        dist.barrier()
    x = torch.full((5,), float(rank))
    dist.all_reduce(x)
    if x[0].item() != sum(range(ws)):
        fail(f"all_reduce after p2p mismatches: {x}")
    if rank < 2:
        y = torch.zeros(5)
        works = [dist.irecv(y, 1 - rank), dist.isend(torch.full((5,), float(rank)), 1 - rank)]
        for w in works:
            w.wait()
        if y[0].item() != 1 - rank:
            fail(f"send/recv after mismatches: {y}")


def check_p2p_timeout(rank, ws, fail):
    """A receive nobody sends to times out with gloo's wording, naming the
    peer and the tag, on its own short-timeout group; the group stays usable."""
    g = dist.new_group(backend="collx", timeout=datetime.timedelta(seconds=1))
    if rank == 0:
        kind, msg, took = attempt(lambda: dist.recv(torch.zeros(4), 1, group=g, tag=42))
        if kind != "DistBackendError" or " Timed out " not in msg or "peer 1" not in msg or "tag 42" not in msg:
            fail(f"p2p timeout: {kind}: {msg}")
        if not 0.9 < took < 10:
            fail(f"p2p timeout of 1 s took {took:.1f} s")
    dist.barrier()
    y = torch.ones(3)
    dist.all_reduce(y, group=g)
    if y[0].item() != ws:
        fail(f"all_reduce on the group after a p2p timeout: {y}")
    dist.destroy_process_group(g)


def check_batch_isend_irecv(rank, ws, fail):
    """A ring exchange in both directions with 4 MB tensors in ONE batch (every
    rank posts its sends first: the batch must not deadlock), then a batch of
    small mixed-dtype ops to every peer."""
    right, left = (rank + 1) % ws, (rank - 1) % ws
    for count in (MIB4, 10):
        to_r = _data(rank, torch.float32, count, 200)
        to_l = _data(rank, torch.float32, count, 201)
        from_l, from_r = torch.zeros(count), torch.zeros(count)
        ops = [dist.P2POp(dist.isend, to_r, right), dist.P2POp(dist.isend, to_l, left),
               dist.P2POp(dist.irecv, from_l, left), dist.P2POp(dist.irecv, from_r, right)]
        t0 = time.monotonic()
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        took = time.monotonic() - t0
        if m := mismatch(from_l, _data(left, torch.float32, count, 200)):
            fail(f"batch ring count={count}: from the left ({left}): {m}")
        if m := mismatch(from_r, _data(right, torch.float32, count, 201)):
            fail(f"batch ring count={count}: from the right ({right}): {m}")
        if took > 20:
            fail(f"batch ring count={count} took {took:.1f} s")
    ops, bufs = [], []
    for p in range(ws):
        if p == rank:
            continue
        for i, dtype in enumerate((torch.int8, torch.float64, torch.bool)):
            ops.append(dist.P2POp(dist.isend, _data(rank, dtype, 17 + p, 300 + i), p))
            b = torch.zeros(17 + rank, dtype=dtype)
            bufs.append((p, i, dtype, b))
            ops.append(dist.P2POp(dist.irecv, b, p))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    for p, i, dtype, b in bufs:
        if m := mismatch(b, _data(p, dtype, 17 + rank, 300 + i)):
            fail(f"batch to every peer: {dtype_name(dtype)} from {p}: {m}")


# ------------------------------------------------------------------ barrier

def check_barrier_waits_for_async_work(rank, ws, fail):
    """dist.barrier() returns only after every async op issued before it has
    completed (here: one rank issues its ops late), and monitored_barrier works."""
    for late in (0, ws - 1):
        dist.barrier()
        if rank == late:
            time.sleep(0.3)
        ts = [torch.full((MIB4,), float(rank + i)) for i in range(3)]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        works.append(dist.broadcast(torch.full((1000,), float(rank)), src=late, async_op=True))
        dist.barrier()
        pending = [i for i, w in enumerate(works) if not w.is_completed()]
        if pending:
            fail(f"barrier returned while async works {pending} were not completed (late rank {late})")
        for w in works:
            w.wait()
        for i, t in enumerate(ts):
            if t[0].item() != sum(range(ws)) + ws * i or t[-1].item() != t[0].item():
                fail(f"async all_reduce {i} before the barrier: got {t[0].item()}")
    for wait_all in (False, True):
        if rank == ws - 1:
            time.sleep(0.3)
        t0 = time.monotonic()
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=wait_all)
        waited = time.monotonic() - t0
        if rank != ws - 1 and waited < 0.2:
            fail(f"monitored_barrier(wait_all_ranks={wait_all}) returned after {waited:.3f} s although "
                 f"rank {ws - 1} arrived 0.3 s late")


SUITE_CHECKS = [
    check_send_recv,
    check_p2p_out_of_order_tags,
    check_ring_shift,
    check_p2p_mismatch,
    check_p2p_timeout,
    check_batch_isend_irecv,
    check_barrier_waits_for_async_work,
]


test_collective = suite_test(__name__, "SUITE_CHECKS", WORLD_SIZES, with_gloo=True, timeout=240)
