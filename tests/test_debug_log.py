"""COLLX_DEBUG: what each level writes to a rank's stderr.

Each rank sends its own stderr (fd 2, where the C++ side writes) to a file
before init, runs a group's life (an op, an op every rank rejects, an op
that fails on the executor when its peer leaves, destroy) and returns the
collx lines it wrote.
"""
from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

from launcher import run_ranks  # noqa: E402


def _life(rank, ws):
    log = tempfile.TemporaryFile(mode="w+")
    os.dup2(log.fileno(), 2)
    dist.init_process_group("collx", init_method=os.environ["COLLX_TEST_INIT_METHOD"], rank=rank, world_size=ws)
    t = torch.ones(1000)
    dist.all_reduce(t)
    try:
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND)  # rejected on every rank
    except dist.DistBackendError:
        pass
    dist.barrier()
    if rank == 0:
        try:
            dist.recv(torch.zeros(4), src=1)  # rank 1 leaves instead of sending
        except dist.DistBackendError:
            pass
    dist.destroy_process_group()
    log.seek(0)
    return [line.rstrip("\n") for line in log if " collx " in line]


def _lines(level):
    return run_ranks(_life, 2, timeout=60, init=False, env={"COLLX_DEBUG": level})


def test_trace_logs_setup_ops_failures_and_teardown():
    for rank, lines in enumerate(_lines("trace")):  # any case, like NCCL_DEBUG
        text = "\n".join(lines)
        prefix = f"collx INFO rank {rank} of 2: "
        assert f"{prefix}mesh of 2 ranks ready in " in text and "listening on " in text, text
        requests = re.search(r"ready in [\d.]+ ms after (\d+) store requests", text)
        assert requests and int(requests.group(1)) > 0, text
        assert "algorithm auto, tree arity 2, segment 524288 B" in text, text
        assert f"{prefix}tuning from " in text and " us/step " in text and "auto at n=2: " in text, text
        assert f"collx TRACE rank {rank} of 2: all_reduce #1 (float32): all_reduce/" in text, text
        assert f"collx WARN rank {rank} of 2: all_reduce #2 rejected: " in text and "BAND" in text, text
        assert f"{prefix}shutting down after 2 ops" in text, text  # all_reduce and barrier
        if rank == 0:
            assert "collx WARN rank 0 of 2: collx recv (float32) failed on rank 0: " in text, text
        # Every line names host, pid and thread, as NCCL's do.
        for line in lines:
            host_pid_tid = line.split(" ", 1)[0].split(":")
            assert len(host_pid_tid) == 3 and host_pid_tid[1].isdigit() and host_pid_tid[2].isdigit(), line


def test_warn_logs_only_failures():
    for rank, lines in enumerate(_lines("WARN")):
        assert lines and all(f"collx WARN rank {rank} of 2: " in line for line in lines), lines
        assert any("rejected" in line for line in lines), lines


@pytest.mark.parametrize("level", [None, "off"])
def test_off_by_default(level):
    assert _lines(level) == [[], []]


def test_bad_value_is_a_clear_error():
    with pytest.raises(AssertionError, match="COLLX_DEBUG=verbose must be WARN, INFO, TRACE or OFF"):
        _lines("verbose")
