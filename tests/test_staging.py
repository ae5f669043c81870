"""The device path of CUDA tensors (csrc/torch/staging.h), run on the CPU.

COLLX_STAGE_CPU_TENSORS=1 sends CPU tensors through the same staging code
that CUDA tensors take: host mirrors, copy-in before the op and copy-out
after it, the op's Work reporting the user's tensors, batches of p2p ops
sharing one staging, and large reductions running through the "device"
reduce (scratch copies of dst and src, reduced apart, copied back). Only the
copies and the kernel differ on a GPU (tests/test_cuda.py runs those).

One launch at world size 3 reruns the all-reduce matrix and the reduce,
gather and p2p suites of the other test files in that mode; a second reruns
the matrix and the reduce suite with every reduction on the "device". The
all-reduce through the ranks' mapped device buffers (peer_allreduce.h) runs
here on memfd segments, at every size and in small chunks, and beside ranks
whose tensors cannot take it.
"""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

import test_allreduce  # noqa: E402
import test_gather_ops  # noqa: E402
import test_p2p  # noqa: E402
import test_reduce_ops  # noqa: E402
from common import (ALGORITHMS, DTYPES, Suite, attempt, dtype_name, expected, gen, mismatch, ops_for,  # noqa: E402
                    reduce_op, run_checks, tolerance)
from launcher import run_ranks  # noqa: E402

# The table (COLLX_TUNING): test_gather_ops' checks expect its tree arities.
STAGED_ENV = {"COLLX_STAGE_CPU_TENSORS": "1", "COLLX_TUNING": "table"}
WS = 3


def check_staging_counters(rank, ws, fail):
    """Every op is staged; by default every reduction runs on the host."""
    group = dist.new_group(backend="collx")
    small = gen(rank, torch.float32, "SUM", 100)
    large = gen(rank, torch.float32, "SUM", 1 << 20, salt=1)
    dist.all_reduce(small, group=group)
    dist.all_reduce(large, group=group)
    stats = torchcollx.get_stats(group)
    if stats["device_reductions"] != 0:
        fail(f"reductions ran on the device without COLLX_DEVICE_REDUCE_MIN_BYTES: {stats}")
    if stats["staged_ops"] != stats["ops"] or stats["ops"] != 2:
        fail(f"expected 2 ops, both staged: {stats}")
    for name, got, count, salt in (("small", small, 100, 0), ("large", large, 1 << 20, 1)):
        if m := mismatch(got, expected(ws, torch.float32, "SUM", count, salt), 1e-5, 1e-5):
            fail(f"{name} all_reduce: {m}")
    dist.destroy_process_group(group)


def check_work_result_is_the_users_tensor(rank, ws, fail):
    """Work.result() and the Future hold the caller's tensors, not the mirrors."""
    t = gen(rank, torch.float64, "SUM", 1000)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    work.wait()
    if work.result()[0].data_ptr() != t.data_ptr():
        fail("Work.result() is not the tensor passed to all_reduce")
    if fut.value()[0].data_ptr() != t.data_ptr():
        fail("the Future's value is not the tensor passed to all_reduce")
    if m := mismatch(t, expected(ws, torch.float64, "SUM", 1000), 1e-12, 1e-12):
        fail(f"all_reduce: {m}")


CHECKS = (
    [check_staging_counters, check_work_result_is_the_users_tensor]
    + test_reduce_ops.SUITE_CHECKS
    + test_gather_ops.SUITE_CHECKS
    + test_p2p.SUITE_CHECKS
)


def _matrix_and(rank, ws, checks):
    """The all-reduce matrix, then the checks of the list named `checks`
    (a name: see common.run_listed_checks)."""
    out = test_allreduce._matrix(rank, ws)
    out.update(run_checks(globals()[checks], rank, ws))
    return out


SUITE = Suite(_matrix_and, WS, args=("CHECKS",), with_gloo=True, timeout=600, env=STAGED_ENV)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_staged_allreduce_matrix(algo, dtype):
    SUITE.check(f"{algo}/{dtype_name(dtype)}")


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_staged_allreduce_large_and_stats(algo):
    SUITE.check(f"{algo}/large")
    SUITE.check(f"{algo}/stats")


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_staged(check):
    SUITE.check(check)


# Every reduction of any size on the "device": the all-reduce matrix (counts
# 0, 1, 7, ...) and the reduce suite, where each reduction goes into the
# user's tensor or into device scratch, as check_where_reductions_go expects.
ALL_ON_DEVICE_ENV = {**STAGED_ENV, "COLLX_DEVICE_REDUCE_MIN_BYTES": "0"}


def check_where_reductions_go(rank, ws, fail):
    def reductions(algo, run):
        group = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=algo))
        run(group)
        stats = torchcollx.get_stats(group)
        dist.destroy_process_group(group)
        return stats["device_reductions"], stats["device_reductions_in_tensor"]

    def all_reduce(op, out):
        def run(group):
            t = gen(rank, torch.float32, op, 7)
            dist.all_reduce(t, op=reduce_op(op), group=group)
            out.append(mismatch(t, expected(ws, torch.float32, op, 7), 1e-6, 1e-6))
        return run

    results = []
    # The ring reduces ws-1 times into each rank's buffer: into the tensor.
    if (got := reductions("ring", all_reduce("SUM", results))) != (ws - 1, ws - 1):
        fail(f"ring SUM of 7 elements: (device, in tensor) reductions {got}, expected {(ws - 1, ws - 1)}")
    # PREMUL_SUM's pre-scale writes the mirror first: into scratch.
    if (got := reductions("ring", all_reduce("PREMUL_SUM", results))) != (ws - 1, 0):
        fail(f"ring PREMUL_SUM: (device, in tensor) reductions {got}, expected {(ws - 1, 0)}")
    # A leader of hier writes its buffer before reducing into it: never into the tensor.
    got = reductions("hier", all_reduce("SUM", results))
    if got[1] != 0 or (rank == 0 and got[0] == 0):
        fail(f"hier SUM: (device, in tensor) reductions {got}, expected none into the tensor")
    # reduce: the root reduces into its tensor, the others (if at all) into private copies.
    t = gen(rank, torch.float32, "SUM", 7)
    got = reductions("auto", lambda group: dist.reduce(t, dst=0, group=group))
    if (rank == 0 and (got[0] == 0 or got[1] != got[0])) or (rank != 0 and got[1] != 0):
        fail(f"reduce to rank 0: (device, in tensor) reductions {got} on rank {rank}")
    if rank == 0:
        results.append(mismatch(t, expected(ws, torch.float32, "SUM", 7), 1e-6, 1e-6))
    for m in filter(None, results):
        fail(f"wrong result: {m}")


ALL_ON_DEVICE_CHECKS = [check_where_reductions_go] + test_reduce_ops.SUITE_CHECKS
ALL_ON_DEVICE = Suite(_matrix_and, WS, args=("ALL_ON_DEVICE_CHECKS",), with_gloo=True, timeout=600,
                      env=ALL_ON_DEVICE_ENV)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_all_on_device_allreduce_matrix(algo, dtype):
    ALL_ON_DEVICE.check(f"{algo}/{dtype_name(dtype)}")


@pytest.mark.parametrize("check", [c.__name__ for c in ALL_ON_DEVICE_CHECKS])
def test_all_on_device(check):
    ALL_ON_DEVICE.check(check)


def _device_reductions_from(rank, ws):
    t = gen(rank, torch.float32, "SUM", 1 << 20)
    dist.all_reduce(t)
    stats = torchcollx.get_stats()
    return stats["staged_ops"], stats["device_reductions"], mismatch(t, expected(ws, torch.float32, "SUM", 1 << 20),
                                                                     1e-5, 1e-5)


# The default group's auto would take the peers' buffers (no reductions).
HOST_STAGED_ENV = {**STAGED_ENV, "COLLX_PEER_BUFFER_BYTES": "off"}


def test_device_reductions_off():
    env = {**HOST_STAGED_ENV, "COLLX_DEVICE_REDUCE_MIN_BYTES": "off"}
    for staged, reductions, m in run_ranks(_device_reductions_from, 2, timeout=60, env=env):
        assert (staged, reductions, m) == (1, 0, None)


def test_device_reductions_from_64k():
    """COLLX_DEVICE_REDUCE_MIN_BYTES=65536: a 4 MiB all_reduce reduces on the "device"."""
    env = {**HOST_STAGED_ENV, "COLLX_DEVICE_REDUCE_MIN_BYTES": "65536"}
    for staged, reductions, m in run_ranks(_device_reductions_from, 2, timeout=60, env=env):
        assert staged == 1 and reductions > 0 and m is None


def _unstaged_counters(rank, ws):
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    stats = torchcollx.get_stats()
    return stats["staged_ops"], stats["device_reductions"], float(t[0])


def test_cpu_tensors_are_not_staged_by_default():
    for staged, reductions, value in run_ranks(_unstaged_counters, 2, timeout=60):
        assert (staged, reductions, value) == (0, 0, 2.0)


def _init_only(rank, ws):
    return True


def test_bad_stage_value_is_a_clear_error():
    with pytest.raises(AssertionError, match="COLLX_STAGE_CPU_TENSORS='?yes'? must be 0 or 1"):
        run_ranks(_init_only, 2, timeout=60, env={"COLLX_STAGE_CPU_TENSORS": "yes"})


@pytest.mark.parametrize("value", ["-1", "64k", "", " 5", "+5"])
def test_bad_device_reduce_min_bytes_is_a_clear_error(value):
    with pytest.raises(AssertionError, match="COLLX_DEVICE_REDUCE_MIN_BYTES=.* must be a byte count or off"):
        run_ranks(_init_only, 2, timeout=60, env={"COLLX_DEVICE_REDUCE_MIN_BYTES": value})


@pytest.mark.parametrize("value", ["-1", "4M", "", "0"])
def test_bad_staging_chunk_bytes_is_a_clear_error(value):
    with pytest.raises(AssertionError, match="COLLX_STAGING_CHUNK_BYTES=.*(must be a byte count or off|use off)"):
        run_ranks(_init_only, 2, timeout=60, env={"COLLX_STAGING_CHUNK_BYTES": value})


def _pipelined(rank, ws):
    """A pipelined all-reduce in many small chunks (the last one short), under
    every algorithm, with reductions on the host and on the "device"."""
    out = []
    for algo in ALGORITHMS:
        group = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=algo))
        for dtype, op, count in ((torch.float32, "SUM", 100_003), (torch.float64, "MAX", 3001),
                                 (torch.int32, "SUM", 1024)):
            t = gen(rank, dtype, op, count)
            dist.all_reduce(t, op=reduce_op(op), group=group)
            if m := mismatch(t, expected(ws, dtype, op, count), 1e-5, 1e-5):
                out.append(f"{algo} {op} {dtype_name(dtype)} count={count}: {m}")
        dist.destroy_process_group(group)
    return out


@pytest.mark.parametrize("reduce_min", ["off", "0"])
def test_pipelined_in_small_chunks(reduce_min):
    # Without the all-reduce through peers' buffers, which auto takes otherwise.
    env = {**HOST_STAGED_ENV, "COLLX_STAGING_CHUNK_BYTES": "4000", "COLLX_DEVICE_REDUCE_MIN_BYTES": reduce_min}
    assert run_ranks(_pipelined, 3, timeout=120, env=env) == [[]] * 3


PEER_MIN_BYTES = 2 << 20  # the default of COLLX_PEER_MIN_BYTES (kPeerMinBytes, staging.h)
PEER_COUNTS = (0, 1, 7, 1000, 100_003, 300_001)


def _through_peers(rank, ws):
    """Every dtype, op and awkward count through an auto group, which takes the
    peers' buffers for every op but AVG and PREMUL_SUM from COLLX_PEER_MIN_BYTES;
    a forced algorithm and a non-contiguous tensor are staged as before.
    Returns the mismatches and the ops each path ran."""
    min_bytes = int(os.environ.get("COLLX_PEER_MIN_BYTES", PEER_MIN_BYTES))
    out = []
    auto = dist.new_group(backend="collx")
    ring = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm="ring"))
    through_peers = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for count in PEER_COUNTS:
                t = gen(rank, dtype, op, count)
                dist.all_reduce(t, op=reduce_op(op), group=auto)
                if m := mismatch(t, expected(ws, dtype, op, count), *tolerance(dtype, op)):
                    out.append(f"{op} {dtype_name(dtype)} count={count}: {m}")
                through_peers += op not in ("AVG", "PREMUL_SUM") and t.nbytes >= min_bytes
    t = gen(rank, torch.float32, "SUM", 1000)
    dist.all_reduce(t, group=ring)
    strided = gen(rank, torch.float32, "SUM", 2000)[::2]
    dist.all_reduce(strided, group=auto)
    for name, got, want in (("ring", t, expected(ws, torch.float32, "SUM", 1000)),
                            ("strided", strided, expected(ws, torch.float32, "SUM", 2000)[::2])):
        if m := mismatch(got, want, 1e-6, 1e-6):
            out.append(f"{name}: {m}")
    calls = lambda group: {k: v["calls"] for k, v in torchcollx.get_stats(group)["algorithms"].items()}  # noqa: E731
    return out, through_peers, calls(auto), calls(ring)


@pytest.mark.parametrize("knobs", [{"COLLX_PEER_BUFFER_BYTES": "4096", "COLLX_PEER_MIN_BYTES": "0"}, {}],
                         ids=["every-size-in-chunks", "defaults"])
def test_allreduce_through_peers_buffers(knobs):
    """Memfd buffers stand for CUDA IPC ones. 4096-byte buffers make the larger
    counts run in chunks; by default (64 MiB buffers, from 2 MiB) the largest
    tensors run in one and the others are staged."""
    ops = sum(len(ops_for(d)) for d in DTYPES) * len(PEER_COUNTS) + 1  # and the strided one
    for out, through_peers, auto, ring in run_ranks(_through_peers, 3, timeout=180, env={**STAGED_ENV, **knobs}):
        assert out == []
        assert through_peers > 0 and auto.pop("all_reduce/peers") == through_peers
        assert sum(auto.values()) == ops - through_peers
        assert "all_reduce/peers" not in ring


def _mixed(rank, ws):
    """Rank 0 stages its tensors, as it would CUDA tensors; rank 1 passes plain
    CPU tensors, as gloo allows. Then both stage, with rank 0 passing a
    non-contiguous view. Sizes where auto's device path takes part (4 MiB)
    and where a staged tensor is pipelined (32 MiB). Returns the mismatches."""
    out = []

    def sums(group, label, strided=False):
        for count in (1 << 20, 8 << 20):
            t = gen(rank, torch.float32, "SUM", count)
            if strided and rank == 0:
                t = torch.zeros(2 * count)[::2].copy_(t)
            dist.all_reduce(t, group=group)
            if m := mismatch(t, expected(ws, torch.float32, "SUM", count)):
                out.append(f"{label} count={count}: {m}")

    timeout = datetime.timedelta(seconds=60)
    if rank == 0:
        os.environ["COLLX_STAGE_CPU_TENSORS"] = "1"
    sums(dist.new_group(backend="collx", timeout=timeout), "rank 0 staged, rank 1 not")
    os.environ["COLLX_STAGE_CPU_TENSORS"] = "1"
    sums(dist.new_group(backend="collx", timeout=timeout), "rank 0 non-contiguous", strided=True)
    return out


# The votes run in the shared windows, or over TCP where the transport is TCP.
TRANSPORTS = pytest.mark.parametrize("transport", [{}, {"COLLX_TRANSPORT": "tcp"}], ids=["default", "tcp"])


@TRANSPORTS
@pytest.mark.parametrize("peers", [{}, {"COLLX_PEER_BUFFER_BYTES": "off"}], ids=["peers", "no-peers"])
def test_mixed_ranks_stage_in_the_same_pieces(transport, peers):
    """Ranks whose tensors cannot take the device path (a CPU tensor beside a
    device one, a non-contiguous one) all stage, in the same pieces: no rank
    waits for a peer that runs another op. The peers path's vote settles it
    where auto may take that path; a vote of its own elsewhere."""
    assert run_ranks(_mixed, 2, timeout=120, env={**transport, **peers}) == [[], []]



def _no_buffer(rank, ws, plain_rank):
    """Rank 0 stages its tensors but cannot make its peer buffer: its file size
    limit refuses the memfd segment, as a full GPU refuses cudaMalloc. Rank
    `plain_rank` (if any) passes plain CPU tensors. Sizes where auto's device
    path takes part (4 MiB) and where a staged tensor is pipelined (32 MiB).
    Returns (mismatches, algorithm labels, rank's collx lines about staging)."""
    import resource
    import signal
    import tempfile

    log = tempfile.TemporaryFile(mode="w+")
    os.dup2(log.fileno(), 2)
    if rank != plain_rank:
        os.environ["COLLX_STAGE_CPU_TENSORS"] = "1"
    dist.init_process_group("collx", init_method=os.environ["COLLX_TEST_INIT_METHOD"], rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=60))
    if rank == 0:  # below the smallest buffer (1 MiB): ftruncate fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 19, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    out = []
    for i, count in enumerate((1 << 20, 1 << 20, 8 << 20, 1 << 20, 8 << 20)):
        t = gen(rank, torch.float32, "SUM", count, salt=i)
        dist.all_reduce(t)
        if m := mismatch(t, expected(ws, torch.float32, "SUM", count, salt=i)):
            out.append(f"op {i} count={count}: {m}")
    labels = {k: v["calls"] for k, v in torchcollx.get_stats()["algorithms"].items()}
    dist.destroy_process_group()
    log.seek(0)
    return out, labels, [line.strip() for line in log if "through host memory" in line]


@pytest.mark.parametrize("plain_rank", [1, None], ids=["beside-cpu-tensors", "all-staged"])
def test_rank_without_peer_buffer_gives_up_once(plain_rank):
    """A device rank that cannot make its buffer makes the group stage every
    later op without trying again, also when the other ranks pass CPU tensors
    (which alone would only stage the op at hand); it says why once. Every op
    is right, and the ranks stage in the same pieces."""
    env = {"COLLX_DEBUG": "info", "COLLX_STAGE_CPU_TENSORS": None}
    results = run_ranks(_no_buffer, 3, timeout=120, init=False, env=env, args=(plain_rank,))
    for rank, (out, labels, lines) in enumerate(results):
        assert out == [], (rank, out)
        assert "all_reduce/peers" not in labels and sum(labels.values()) >= 5, (rank, labels)
        if rank == plain_rank:
            assert lines == [], lines
        else:
            assert len(lines) == 1, (rank, lines)
            why = "File too large" if rank == 0 else "another rank cannot make or map its device buffer"
            assert why in lines[0], (rank, lines)


def _uneven(rank, ws):
    """Sizes that differ across ranks where auto's device path takes part: one
    rank under its threshold (a plain all-reduce beside the other's vote), and
    both over it. Returns {case: (exception name, message, seconds)}."""
    out = {}
    for case, count in (("across the threshold", (1 << 20) if rank == 0 else (1 << 18)),
                        ("both over it", (1 << 20) if rank == 0 else (2 << 20))):
        group = dist.new_group(backend="collx", timeout=datetime.timedelta(seconds=10))
        out[case] = attempt(lambda: dist.all_reduce(torch.ones(count), group=group))  # noqa: B023
    return out


@TRANSPORTS
@pytest.mark.parametrize("env", [STAGED_ENV, {}], ids=["staged", "cpu"])
def test_uneven_sizes_around_the_peers_path_raise(env, transport):
    """A mismatched collective, reported at once on every rank (not at the
    timeout), and never reduced through buffers of different sizes."""
    for rank, res in enumerate(run_ranks(_uneven, 2, timeout=120, env={**env, **transport})):
        for case, (kind, msg, took) in res.items():
            assert kind == "DistBackendError" and "mismatched collective" in msg and took < 5, (rank, case, msg)


def _peers_off(rank, ws):
    t = gen(rank, torch.float32, "SUM", 1000)
    dist.all_reduce(t)
    return list(torchcollx.get_stats()["algorithms"]), mismatch(t, expected(ws, torch.float32, "SUM", 1000))


def test_peer_buffers_off():
    for labels, m in run_ranks(_peers_off, 2, timeout=60, env=HOST_STAGED_ENV):
        assert m is None and len(labels) == 1 and labels[0] != "all_reduce/peers"


@pytest.mark.parametrize("value", ["-1", "64M", "0", "4095"])
def test_bad_peer_buffer_bytes_is_a_clear_error(value):
    with pytest.raises(AssertionError, match="COLLX_PEER_BUFFER_BYTES=.*(must be a byte count or off|use off or at "
                                             "least 4096 bytes)"):
        run_ranks(_init_only, 2, timeout=60, env={"COLLX_PEER_BUFFER_BYTES": value})


@pytest.mark.parametrize("value", ["-1", "1M", ""])
def test_bad_peer_min_bytes_is_a_clear_error(value):
    with pytest.raises(AssertionError, match="COLLX_PEER_MIN_BYTES=.* must be a byte count or off"):
        run_ranks(_init_only, 2, timeout=60, env={"COLLX_PEER_MIN_BYTES": value})
