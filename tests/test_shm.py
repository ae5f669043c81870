"""The shared-memory transport between ranks on one host (COLLX_TRANSPORT,
Options.transport), with real processes.

Every other test of this suite runs on the default, auto, which puts ranks on
one host on shared memory; test_transports.py runs the main suites over TCP.
Here: the choice itself, a peer that cannot be attached (the pair falls back
to TCP with one warning, or init fails clearly under transport=shm), nothing
left in /dev/shm, no descriptor, mapping or thread leaked over 50 groups, and
reduce_scatter, all_gather and broadcast in shared memory against TCP.
"""
from __future__ import annotations

import ctypes
import os

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

from common import SHM_MIN_BYTES, labels_delta  # noqa: E402
from launcher import run_ranks  # noqa: E402

TABLE = {"COLLX_TUNING": "table"}  # no calibration cache to read or write as another user


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
        try:
            dist.new_group(backend="collx", pg_options=torchcollx.Options(transport="shm"))
            out["forced"] = "no error"
        except Exception as e:
            out["forced"] = (type(e).__name__, str(e))
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


def _process_resources():
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as f:
        segments = sum("memfd:collx" in line for line in f)
    threads = len(os.listdir("/proc/self/task"))
    return fds, segments, threads


def _cycles(rank, ws, cycles):
    dist.destroy_process_group(dist.new_group(backend="collx"))  # warm: lazy allocations of torch
    before = _process_resources()
    during = None
    for _ in range(cycles):
        g = dist.new_group(backend="collx")
        x = torch.ones(300000)
        dist.all_reduce(x, group=g)
        assert x[0].item() == ws
        during = _process_resources()
        dist.destroy_process_group(g)
    del g  # a group still referenced keeps its backend, and so its mappings
    return before, during, _process_resources()


def test_no_descriptor_mapping_or_thread_leaks_over_50_groups():
    before_shm = set(os.listdir("/dev/shm"))
    for rank, (before, during, after) in enumerate(run_ranks(_cycles, 3, timeout=240, args=(50,))):
        assert during[1] == before[1] + 3, f"rank {rank}: a group of 3 maps its segment and its 2 peers': {during}"
        assert after == before, f"rank {rank}: (fds, segments, threads) {before} before, {after} after 50 groups"
    assert set(os.listdir("/dev/shm")) == before_shm, "collx left something in /dev/shm"


def _moving_collectives(rank, ws):
    """reduce_scatter, all_gather and broadcast at sizes around the shm
    threshold and over many window chunks, on the world group (shared memory)
    and on a TCP group: the values must equal the locally computed ones and
    each other, and the labels say which path ran. Integer-valued floats, so
    sums are exact in any order."""
    tcp = dist.new_group(backend="collx", pg_options=torchcollx.Options(transport="tcp"))
    out = []
    for nbytes in (SHM_MIN_BYTES - 4 * ws, SHM_MIN_BYTES + 4 * ws, 3 * (1 << 20) + 4 * 7 * ws):
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
            dist.all_gather_into_tensor(ag, x[rank * block:(rank + 1) * block].clone(), group=g)
            got["all_gather"] = ag
            for root in range(ws):
                b = x.clone() if rank == root else torch.zeros(total)
                dist.broadcast(b, src=root, group=g)
                got[f"broadcast from {root}"] = b
            labels = sorted(labels_delta(g, before))
            results[name] = (labels, got)
        base = torch.arange(total, dtype=torch.float32) % 1000
        want = {"reduce_scatter": base[rank * block:(rank + 1) * block] * (ws * (ws + 1) // 2),
                "all_gather": torch.cat([base[r * block:(r + 1) * block] * (r + 1) for r in range(ws)])}
        want.update({f"broadcast from {r}": base * (r + 1) for r in range(ws)})
        for name, (labels, got) in results.items():
            for op, w in want.items():
                assert torch.equal(got[op], w), f"{name} {op} of {nbytes} B on rank {rank}"
        out.append((4 * total, results["shm"][0], results["tcp"][0]))
    dist.destroy_process_group(tcp)
    return out


@pytest.mark.parametrize("ws", [2, 3], ids=lambda ws: f"ws{ws}")
def test_reduce_scatter_all_gather_broadcast_in_shared_memory(ws):
    for rank_result in run_ranks(_moving_collectives, ws, timeout=120, env=TABLE):
        for nbytes, shm_labels, tcp_labels in rank_result:
            assert not any(label.endswith("/shm") for label in tcp_labels), tcp_labels
            on_shm = [label for label in shm_labels if label.endswith("/shm")]
            if nbytes >= SHM_MIN_BYTES:
                assert on_shm == ["all_gather/shm", "broadcast/shm", "reduce_scatter/shm"], (nbytes, shm_labels)
            else:
                assert not on_shm, (nbytes, shm_labels)
