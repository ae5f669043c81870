"""Shutdown: init/destroy cycles (with collectives in flight and p2p ops
unmatched at destroy) leak no threads and no file descriptors, and
an interpreter that exits with collx ops in flight (never waited, no
destroy_process_group) neither crashes nor hangs.
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchcollx")

import launcher  # noqa: E402
from common import settled_resources  # noqa: E402
from launcher import run_ranks  # noqa: E402

CYCLES = 50
WARMUP = 3


def _counts():
    fds, _, threads = settled_resources()
    return fds, threads


def _cycles(rank, ws, port):
    """One TCPStore for all cycles, served by the test's own process, so that
    a rank counts only its own threads and descriptors (a server's side of a
    peer's connection closes when the server gets to it); each cycle: init,
    a subgroup, ops, async ops never waited, destroy."""
    base = dist.TCPStore("127.0.0.1", port, ws, False, timeout=datetime.timedelta(seconds=60))
    counts = []
    for cycle in range(WARMUP + CYCLES):
        if cycle == WARMUP:
            counts.append(_counts())
        store = dist.PrefixStore(f"cycle{cycle}", base)
        dist.init_process_group("collx", store=store, rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=60))
        g = dist.new_group(backend="collx")
        x = torch.ones(1000)
        dist.all_reduce(x)
        dist.all_reduce(x, group=g)
        assert torch.equal(x, torch.full_like(x, ws * ws)), (cycle, x[:3])
        for _ in range(3):
            dist.all_reduce(torch.ones(1 << 16), async_op=True)  # in flight at destroy
        # p2p ops pending at destroy: a receive nobody sends to, a small send
        # and a large one nobody receives (parked at the peer, and one asking
        # to be cleared), a matched ring shift on the subgroup.
        peer = 1 - rank
        unmatched = [dist.irecv(torch.zeros(100), peer, tag=9),
                     dist.isend(torch.ones(100), peer, tag=10), dist.isend(torch.ones(1 << 18), peer, tag=11)]
        shifted = torch.zeros(1 << 18)
        for w in [dist.irecv(shifted, peer, group=g), dist.isend(torch.full((1 << 18,), float(rank)), peer, group=g)]:
            w.wait()
        assert shifted[0].item() == peer, (cycle, shifted[:3])
        t0 = time.monotonic()
        dist.destroy_process_group()
        assert time.monotonic() - t0 < 5, f"destroy with p2p pending took {time.monotonic() - t0:.1f} s"
        try:
            unmatched[0].wait()
            raise AssertionError("an unmatched irecv completed after destroy")
        except dist.DistBackendError as e:
            assert "shut down" in str(e) or "Connection closed by peer" in str(e), str(e)
    counts.append(_counts())
    return counts


def test_init_destroy_cycles_leak_no_threads_or_fds():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    counts = run_ranks(_cycles, 2, timeout=300, init=False, args=(server.port,))
    for rank, ((fd0, th0), (fd1, th1)) in enumerate(counts):
        print(f"rank {rank}: fds {fd0} -> {fd1}, threads {th0} -> {th1} over {CYCLES} cycles")
        assert fd1 == fd0, f"rank {rank}: {fd1 - fd0} file descriptors leaked over {CYCLES} cycles ({fd0} -> {fd1})"
        assert th1 == th0, f"rank {rank}: {th1 - th0} threads leaked over {CYCLES} cycles ({th0} -> {th1})"


EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    import torchcollx
    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("collx", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(10))
    if mode == "both" or rank == 0:
        works = [dist.all_reduce(torch.ones(1 << 22), async_op=True) for _ in range(4)]
    else:  # the peer goes on issuing ops after rank 0 has left
        for _ in range(20):
            try:
                dist.all_reduce(torch.ones(1 << 22))
            except dist.DistBackendError:
                break
    sys.exit(0)
""")


@pytest.mark.parametrize("mode", ["both", "one"])
def test_exit_with_ops_in_flight(mode, tmp_path):
    """sys.exit with async all_reduces never waited and no destroy: exit code
    0 within seconds on every rank ("one": the other rank is still issuing
    ops when rank 0 exits)."""
    script = tmp_path / "exit_in_flight.py"
    script.write_text(EXIT_SCRIPT)
    port = launcher.free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60)[0].decode(errors="replace"))
    finally:
        for p in procs:
            p.kill()
    took = time.monotonic() - t0
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{out[-3000:]}"
    assert took < 30, f"exit took {took:.1f} s"
