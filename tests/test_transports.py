"""The main suites once more with COLLX_TRANSPORT=tcp, at world size 3.

Ranks on one host use shared memory by default (test_shm.py), so the other
modules of this suite run their local ranks over the rings; the sockets are
what ranks on other hosts use, and what a user can force. Here the
all_reduce matrix, the other collectives and the gather ops run over TCP
(test_faults.py runs over both transports itself; the C++ tests run every
collective, mismatches and timeouts over both), with the local connections'
congestion control (COLLX_TCP_CONGESTION) both ways and a refused one.
"""
from __future__ import annotations

import pytest

pytest.importorskip("torchcollx")

import test_allreduce  # noqa: E402
import test_collectives  # noqa: E402, F401
import test_gather_ops  # noqa: E402, F401  (suite_test finds it in sys.modules)
from common import ALGORITHMS, DTYPES, Suite, dtype_name, suite_test  # noqa: E402
from launcher import run_ranks  # noqa: E402

TCP = {"COLLX_TRANSPORT": "tcp"}
WS = 3

MATRIX = Suite(test_allreduce._matrix, WS, with_gloo=True, timeout=420, env=TCP)
OVER_TCP = [a for a in ALGORITHMS if a != "shm"]  # shm needs shared memory


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("algo", OVER_TCP)
def test_allreduce_matrix_over_tcp(algo, dtype):
    MATRIX.check(f"{algo}/{dtype_name(dtype)}")


@pytest.mark.parametrize("algo", OVER_TCP)
def test_allreduce_large_float32_over_tcp(algo):
    MATRIX.check(f"{algo}/large")


test_collectives_over_tcp = suite_test("test_collectives", "SUITE_CHECKS", [WS], with_gloo=True, timeout=300,
                                       env=TCP)
test_gather_ops_over_tcp = suite_test("test_gather_ops", "SUITE_CHECKS", [WS], with_gloo=True, timeout=240,
                                      env=dict(TCP, COLLX_TUNING="table"))  # as test_gather_ops.py runs it


def _sum(rank, ws):
    import torch
    import torch.distributed as dist
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1000,), ws * (ws + 1) / 2)), t[:4]
    return True


@pytest.mark.parametrize("congestion", ["reno", "system"])
def test_local_congestion_control(congestion):
    run_ranks(_sum, 2, timeout=60, env=dict(TCP, COLLX_TUNING="table", COLLX_TCP_CONGESTION=congestion))


def test_a_refused_congestion_control_is_a_clear_error():
    with pytest.raises(AssertionError, match="refuses congestion control 'no-such-cc' \\(COLLX_TCP_CONGESTION\\)"):
        run_ranks(_sum, 2, timeout=60, env=dict(TCP, COLLX_TCP_CONGESTION="no-such-cc"))
