"""The shared-memory transport between ranks on one host (COLLX_TRANSPORT,
Options.transport), with real processes.

Every other test of this suite runs on the default, auto, which puts ranks on
one host on shared memory; test_transports.py runs the main suites over TCP.
Here: the choice itself, a peer that cannot be attached (the pair falls back
to TCP with one warning, or init fails clearly under transport=shm), nothing
left in /dev/shm, no descriptor, mapping or thread leaked over 50 groups, and
reduce_scatter, all_gather and broadcast in shared memory against TCP, with
and without cross-memory attach (COLLX_SHM_CMA), a rank whose policy
refuses it (every rank then does without), the collectives on views at odd
page offsets, and ranks that start stacked on one core parting within a few
ops.
"""
from __future__ import annotations

import ctypes
import os
import platform
import time

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

from common import SHM_MIN_BYTES, labels_delta, process_resources, settled_resources  # noqa: E402
from launcher import run_ranks  # noqa: E402

TABLE = {"COLLX_TUNING": "table"}  # no calibration cache to read or write as another user
# all_gather reads the peers' blocks in place, where the ranks may, from blocks
# of this size or outputs of SHM_MIN_BYTES (algorithms.h: kReadInPlaceMinBlockBytes,
# kReadInPlaceMinOpBytes).
READ_IN_PLACE_MIN_BLOCK = 8 << 10


def _backend(group=None):
    return (group or dist.group.WORLD)._get_backend(torch.device("cpu"))


def _transport_and_sum(rank, ws):
    x = torch.full((100003,), float(rank + 1))
    dist.all_reduce(x)
    return _backend().transport, x[0].item(), x[-1].item()


@pytest.mark.parametrize("ws", [2, 4], ids=lambda ws: f"ws{ws}")
def test_auto_puts_local_peers_on_shared_memory(ws):
    want = ws * (ws + 1) / 2
    for note, first, last in run_ranks(_transport_and_sum, ws, timeout=90):
        assert note.startswith(f"shared memory with {ws - 1} local peer(s), 1024 KiB rings"), note
        assert first == last == want


def test_tcp_uses_no_shared_memory():
    for note, first, _ in run_ranks(_transport_and_sum, 2, timeout=90, env={"COLLX_TRANSPORT": "tcp"}):
        assert note == "" and first == 3


def test_a_bad_transport_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="Options.transport='udp'"):
        torchcollx.Options(transport="udp").resolved()
    monkeypatch.setenv("COLLX_TRANSPORT", "SHM")
    with pytest.raises(ValueError, match="COLLX_TRANSPORT='SHM'"):
        torchcollx.Options().resolved()
    monkeypatch.delenv("COLLX_TRANSPORT")
    assert torchcollx.Options(transport="shm").resolved().transport == "shm"


def _init_only(rank, ws):
    return True


def test_a_bad_cross_memory_attach_value_is_a_clear_error():
    with pytest.raises(AssertionError, match="COLLX_SHM_CMA must be 0, 1 or auto, not 'yes'"):
        run_ranks(_init_only, 2, timeout=60, env={"COLLX_SHM_CMA": "yes"})


def _unattachable(rank, ws, stderr_path):
    """Rank 1 cannot open rank 0's segment: as root it drops its effective
    uid (and so its capabilities) during setup; otherwise rank 0 makes itself
    non-dumpable, which closes its /proc/<pid>/fd to other processes. Both
    are what a hardened host does. stderr goes to a file, to count warnings."""
    fd = os.open(f"{stderr_path}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    if os.geteuid() == 0:
        if rank == 1:
            os.seteuid(65534)
    elif rank == 0:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    out = {}
    try:
        groups = [dist.new_group(backend="collx") for _ in range(2)]
        out["notes"] = [_backend(g).transport for g in groups]
        x = torch.full((1 << 20,), float(rank + 1))
        dist.all_reduce(x, group=groups[1])
        out["sum"] = x[0].item()
        try:  # the group meets its peers on its first op, which fails
            forced = dist.new_group(backend="collx", pg_options=torchcollx.Options(transport="shm"))
            dist.all_reduce(torch.ones(4), group=forced)
            out["forced"] = "no error"
        except Exception as e:
            out["forced"] = (type(e).__name__, str(e))
        # Rank 0 serves the Store (tcp://): it stays until rank 1's failing
        # setup is done with the Store too, else rank 1 sees the Store vanish.
        dist.barrier()
    finally:
        if os.geteuid() != os.getuid():
            os.seteuid(0)
    return out


def test_a_peer_that_cannot_be_attached_falls_back_to_tcp(tmp_path):
    res = run_ranks(_unattachable, 2, timeout=120, backend_init="tcp", env=TABLE,
                    args=(str(tmp_path / "stderr"),))
    for rank, r in enumerate(res):
        for note in r["notes"]:
            assert note.startswith("shared memory unavailable (peer ") and "those pairs use TCP" in note, note
        assert r["sum"] == 3, r
        kind, msg = r["forced"]
        assert kind == "DistBackendError" and "COLLX_TRANSPORT=shm, but shared memory unavailable" in msg, msg
        warnings = (tmp_path / f"stderr.{rank}").read_text().count("WARN")
        assert warnings == 1, f"rank {rank}: {warnings} warnings, want one per process"


def _cycles(rank, ws, cycles):
    dist.barrier()  # the default group is set up (after init returned, in the background)
    dist.destroy_process_group(dist.new_group(backend="collx"))  # warm: lazy allocations of torch
    before = settled_resources()
    during = None
    for _ in range(cycles):
        g = dist.new_group(backend="collx")
        x = torch.ones(300000)
        dist.all_reduce(x, group=g)
        assert x[0].item() == ws
        during = process_resources()
        dist.destroy_process_group(g)
    del g  # a group still referenced keeps its backend, and so its mappings
    return before, during, settled_resources()


def test_no_descriptor_mapping_or_thread_leaks_over_50_groups():
    before_shm = set(os.listdir("/dev/shm"))
    for rank, (before, during, after) in enumerate(run_ranks(_cycles, 3, timeout=240, args=(50,))):
        assert during[1] == before[1] + 3, f"rank {rank}: a group of 3 maps its segment and its 2 peers': {during}"
        assert after == before, f"rank {rank}: (fds, segments, threads) {before} before, {after} after 50 groups"
    assert set(os.listdir("/dev/shm")) == before_shm, "collx left something in /dev/shm"


def _peer_reads(group):
    """Bytes this rank has read from its peers' memory in place."""
    return torchcollx.get_stats(group)["carriers"].get("peer_memory", {}).get("bytes_received", 0)


def _moving_collectives(rank, ws):
    """reduce_scatter, all_gather and broadcast at sizes around the shm
    threshold and over many window chunks, on the world group (shared memory)
    and on a TCP group: the values must equal the locally computed ones and
    each other, and the labels say which path ran. Integer-valued floats, so
    sums are exact in any order."""
    tcp = dist.new_group(backend="collx", pg_options=torchcollx.Options(transport="tcp"))
    out = []
    sizes = (4 * ws, ws * READ_IN_PLACE_MIN_BLOCK - 4 * ws, ws * READ_IN_PLACE_MIN_BLOCK, SHM_MIN_BYTES - 4 * ws,
             SHM_MIN_BYTES + 4 * ws, 3 * (1 << 20) + 4 * 7 * ws)
    for nbytes in sizes:
        total = nbytes // 4 // ws * ws  # float32 elements of the whole buffer
        block = total // ws
        results = {}
        for name, g in (("shm", None), ("tcp", tcp)):
            labels, got = [], {}
            x = (torch.arange(total, dtype=torch.float32) % 1000) * (rank + 1)
            before = torchcollx.get_stats(g)["algorithms"]
            rs = torch.empty(block)
            dist.reduce_scatter_tensor(rs, x, group=g)
            got["reduce_scatter"] = rs
            ag = torch.empty(total)
            read_before = _peer_reads(g)
            dist.all_gather_into_tensor(ag, x[rank * block:(rank + 1) * block].clone(), group=g)
            got["all_gather"] = ag
            ag_read_in_place = _peer_reads(g) > read_before
            for root in range(ws):
                b = x.clone() if rank == root else torch.zeros(total)
                dist.broadcast(b, src=root, group=g)
                got[f"broadcast from {root}"] = b
            labels = sorted(labels_delta(g, before))
            results[name] = (labels, got, ag_read_in_place)
        base = torch.arange(total, dtype=torch.float32) % 1000
        want = {"reduce_scatter": base[rank * block:(rank + 1) * block] * (ws * (ws + 1) // 2),
                "all_gather": torch.cat([base[r * block:(r + 1) * block] * (r + 1) for r in range(ws)])}
        want.update({f"broadcast from {r}": base * (r + 1) for r in range(ws)})
        for name, (labels, got, _) in results.items():
            for op, w in want.items():
                assert torch.equal(got[op], w), f"{name} {op} of {nbytes} B on rank {rank}"
        out.append((4 * total, results["shm"][0], results["tcp"][0], results["shm"][2]))
    dist.destroy_process_group(tcp)
    return _backend().transport, out


# all_gather and reduce_scatter run in shared memory at every size, broadcast
# from SHM_MIN_BYTES. With cross-memory attach, all_gather reads the peers'
# blocks where they lie from blocks of READ_IN_PLACE_MIN_BLOCK (the same
# memory either way, so the labels say shm); the 3 MB point spans several
# window halves. auto reads in place where the ranks measured that it pays
# (their note says).
@pytest.mark.parametrize("cma", ["1", "0", "auto"], ids=lambda v: f"cma{v}")
@pytest.mark.parametrize("ws", [2, 3], ids=lambda ws: f"ws{ws}")
def test_reduce_scatter_all_gather_broadcast_in_shared_memory(ws, cma):
    res = run_ranks(_moving_collectives, ws, timeout=120, env={**TABLE, "COLLX_SHM_CMA": cma})
    notes = {note for note, _ in res}
    assert len(notes) == 1, f"the ranks disagree on cross-memory attach: {notes}"
    note = notes.pop()
    if cma == "0":
        assert "cross-memory attach" not in note and "a read" not in note, note
    if cma == "auto":
        assert ", cross-memory attach" in note or "a read of a peer's memory costs over" in note, note
    reads = ", cross-memory attach" in note
    for _, rank_result in res:
        for nbytes, shm_labels, tcp_labels, ag_read_in_place in rank_result:
            assert not any(label.endswith("/shm") for label in tcp_labels), tcp_labels
            on_shm = [label for label in shm_labels if label.endswith("/shm")]
            if nbytes >= SHM_MIN_BYTES:
                assert on_shm == ["all_gather/shm", "broadcast/shm", "reduce_scatter/shm"], (nbytes, shm_labels)
            else:
                assert on_shm == ["all_gather/shm", "reduce_scatter/shm"], (nbytes, shm_labels)
            # A read's system call costs more than a small block's copies.
            wants_read = reads and (nbytes // ws >= READ_IN_PLACE_MIN_BLOCK or nbytes >= SHM_MIN_BYTES)
            assert ag_read_in_place == wants_read, (nbytes, note)


def _at_page_offset(count, offset):
    """A float32 view of `count` elements starting `offset` bytes past a page boundary."""
    raw = torch.zeros(count + 2048)
    start = ((-raw.data_ptr()) % 4096 + offset) // 4
    return raw[start:start + count]


def _collectives_at_odd_offsets(rank, ws):
    """all_reduce, all_gather_into_tensor, reduce_scatter_tensor and a
    coalesced all_reduce on views that start 4 + 12 * rank bytes past a page:
    modulo a page, each rank's buffers lie 4 to 28 bytes past the windows and
    12 or 24 from their peers', where memcpy's `rep movsb` crawls on some CPUs
    and collx copies otherwise (csrc/core/copy.h). Sizes through the windows, the
    reads in place, and the all-reduce's own reads in place (5 MiB); on
    shared memory and on TCP. Integer-valued floats: sums are exact."""
    tcp = dist.new_group(backend="collx", pg_options=torchcollx.Options(transport="tcp"))
    offset = 4 + 12 * rank
    total_of = lambda nbytes: nbytes // 4 // ws * ws  # noqa: E731
    checked = []
    for g in (None, tcp):
        for nbytes in (64 << 10, 1 << 20, 5 << 20):
            total = total_of(nbytes)
            block = total // ws
            base = torch.arange(total, dtype=torch.float32) % 1000
            x = _at_page_offset(total, offset)
            x.copy_(base * (rank + 1))
            dist.all_reduce(x, group=g)
            assert torch.equal(x, base * (ws * (ws + 1) // 2)), f"all_reduce of {nbytes} B"
            x.copy_(base * (rank + 1))
            rs = _at_page_offset(block, offset)
            dist.reduce_scatter_tensor(rs, x, group=g)
            assert torch.equal(rs, base[rank * block:(rank + 1) * block] * (ws * (ws + 1) // 2)), \
                f"reduce_scatter of {nbytes} B"
            ag = _at_page_offset(total, offset)
            dist.all_gather_into_tensor(ag, x[rank * block:(rank + 1) * block], group=g)
            assert torch.equal(ag, torch.cat([base[r * block:(r + 1) * block] * (r + 1) for r in range(ws)])), \
                f"all_gather of {nbytes} B"
            parts = [_at_page_offset(n, offset + 4 * i) for i, n in enumerate((3001, block))]
            for p in parts:
                p.copy_(base[:p.numel()] * (rank + 1))
            dist.all_reduce_coalesced(parts, group=g)
            for p in parts:
                assert torch.equal(p, base[:p.numel()] * (ws * (ws + 1) // 2)), f"coalesced all_reduce of {nbytes} B"
            checked.append(nbytes)
    dist.destroy_process_group(tcp)
    return checked


@pytest.mark.parametrize("cma", ["1", "0"], ids=lambda v: f"cma{v}")
@pytest.mark.parametrize("ws", [2, 3], ids=lambda ws: f"ws{ws}")
def test_collectives_on_views_at_odd_page_offsets(ws, cma):
    res = run_ranks(_collectives_at_odd_offsets, ws, timeout=120, env={**TABLE, "COLLX_SHM_CMA": cma})
    assert all(len(checked) == 6 for checked in res), res


def _refuse_cross_memory_attach():
    """A seccomp filter that fails process_vm_readv with EPERM, as a hardened
    container's policy may, while /proc/<pid>/fd stays open to the peers."""
    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    nr_process_vm_readv, eperm = 310, 1
    insns = (Filter * 4)(
        Filter(0x20, 0, 0, 0),                     # load the syscall number
        Filter(0x15, 0, 1, nr_process_vm_readv),   # process_vm_readv?
        Filter(0x06, 0, 0, 0x00050000 | eperm),    # yes: fail with EPERM
        Filter(0x06, 0, 0, 0x7FFF0000))            # no: allow
    prog = Program(len(insns), insns)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER


def _one_rank_refuses(rank, ws):
    allowed = _backend().transport  # the host's policy, before rank 1 refuses
    if rank == 1:
        _refuse_cross_memory_attach()
    g = dist.new_group(backend="collx", pg_options=torchcollx.Options(transport="shm"))
    block = 300000  # float32 elements: over a window half
    out = torch.empty(ws * block)
    before = torchcollx.get_stats(g)["algorithms"]
    dist.all_gather_into_tensor(out, torch.full((block,), float(rank + 1)), group=g)
    want = torch.cat([torch.full((block,), float(r + 1)) for r in range(ws)])
    return allowed, _backend(g).transport, torch.equal(out, want), labels_delta(g, before)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter names x86_64's syscall number")
def test_a_rank_refused_cross_memory_attach_makes_every_rank_do_without():
    res = run_ranks(_one_rank_refuses, 3, timeout=120, env={**TABLE, "COLLX_SHM_CMA": "1"})
    if not all("cross-memory attach" in allowed for allowed, *_ in res):
        pytest.skip(f"this host refuses cross-memory attach to every rank: {res[0][0]}")
    for rank, (_, note, right, labels) in enumerate(res):
        assert note.startswith("shared memory with 2 local peer(s)"), note
        assert "cross-memory attach" not in note, f"rank {rank}: {note}"
        assert right, f"rank {rank}: all_gather through the windows gave wrong values"
        assert labels == {"all_gather/shm": 1}, labels


def _stacked_then_free(rank, ws, ops):
    """Both ranks start on one core, free to run on any, as processes launched
    together often do: the core each op ended on and when, and whether the mask
    ends as it began."""
    sched_getcpu = ctypes.CDLL(None).sched_getcpu
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mask)})
    x = torch.ones(1024)
    dist.all_reduce(x)  # both on that core
    os.sched_setaffinity(0, mask)
    cores = []
    start = time.monotonic()
    for i in range(ops):
        x.fill_(float(rank + i))
        dist.all_reduce(x)
        assert x[0].item() == x[-1].item() == 2 * i + 1, (i, x[0].item())
        cores.append((sched_getcpu(), time.monotonic()))
    return cores, os.sched_getaffinity(0) == mask, torchcollx.get_stats()["core_moves"], start


# A stack made this way often parts by itself within a few ops, where jobs
# launched by torchrun stayed stacked for hundreds (benchmarks/stacked_start.py
# counts those): this checks what a user sees, right values, parted ranks and
# masks as they were, not that collx did the parting.
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_ranks_started_on_one_core_part_within_a_few_ops():
    ops = 300
    (a, kept_a, moves_a, start_a), (b, kept_b, moves_b, start_b) = run_ranks(_stacked_then_free, 2, timeout=90,
                                                                             env=TABLE, args=(ops,))
    assert kept_a and kept_b, "a rank's affinity mask changed"
    # A thread moves at most once per 10 ms (the setup's ops before the loop included).
    for moves, cores, start in ((moves_a, a, start_a), (moves_b, b, start_b)):
        secs = cores[-1][1] - start
        assert 0 <= moves <= 2 + secs * 100, (moves, secs)
    # Every stretch of ops on one core ends within 20 ops: the stack they
    # started in, and any the scheduler makes later (on a busy machine it
    # may place both on one core again for a moment). A rank moves at most
    # once per 10 ms, so a stack made within 10 ms of its last move may last
    # that long: such a stretch ends within 20 ms.
    shared = [a[i][0] == b[i][0] for i in range(ops)] + [False]
    stretches, first = [], None  # (first op, ops, seconds) of each run of shared ops
    for i, on_one in enumerate(shared):
        if on_one and first is None:
            first = i
        elif not on_one and first is not None:
            end = max(a[i - 1][1], b[i - 1][1])
            start = min(a[first - 1][1], b[first - 1][1]) if first else min(start_a, start_b)
            stretches.append((first, i - first, end - start))
            first = None
    long = [s for s in stretches if s[1] > 20 and s[2] > 0.020]
    assert not long, f"the ranks shared a core for over 20 ops and 20 ms: (first op, ops, s) {long}"


def _pinned_on_one_core(rank, ws, ops, when):
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})  # this thread only; threads it starts later inherit the mask
    if when == "before init":
        dist.init_process_group("collx", init_method=os.environ["COLLX_TEST_INIT_METHOD"], rank=rank, world_size=ws)
    x = torch.ones(1024)
    for i in range(ops):
        x.fill_(float(rank + i))
        dist.all_reduce(x)
        assert x[0].item() == 2 * i + 1, (i, x[0].item())
    return torchcollx.get_stats()["core_moves"], os.sched_getaffinity(0) == {core}


@pytest.mark.parametrize("when", ["before init", "after init"])
def test_ranks_pinned_to_one_core_stay_there(when):
    """The user's pinning holds: the waits that part stacked ranks never move a
    pinned thread, and leave the caller's mask as it was. Pinned before init,
    every thread of the rank is pinned, so no move may happen at all. Pinned
    after init, only the caller's thread is: an op run on collx's executor
    thread (the first, queued behind the group's setup) may move that thread,
    as its mask is the one it had at init (as gloo's and NCCL's threads)."""
    for moves, still_pinned in run_ranks(_pinned_on_one_core, 2, timeout=90, env=TABLE, args=(200, when),
                                         init=when != "before init"):
        assert still_pinned, "the caller's affinity mask changed"
        if when == "before init":
            assert moves == 0, f"{moves} moves of a rank whose threads are all pinned"
