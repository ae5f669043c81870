"""torch 2.14's fault-tolerance API on collx, with real processes: set_timeout,
abort (with collectives, queued ops and p2p in flight) and its hooks,
get_error after each kind of failure, and shrink_group after a SIGKILLed
rank, over shared memory and TCP. The group timeout is 60 s everywhere, so
no failure here is noticed by a timeout unless the test sets one.
"""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

from launcher import Died, run_ranks  # noqa: E402

TRANSPORTS = ["shm", "tcp"]
GROUP_TIMEOUT = 60.0
ErrorType = torch._C._distributed_c10d.ErrorType
# torch 2.14 binds Backend.get_error; the GPU machine's torch 2.11 does not.
HAS_GET_ERROR = hasattr(torch._C._distributed_c10d.Backend, "get_error")


def _backend(group=None):
    return (group or dist.group.WORLD)._get_backend(torch.device("cpu"))


def _attempt(fn):
    """(exception name or "ok", message, seconds it took)."""
    t0 = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - t0)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)


# ------------------------------------------------------------------ set_timeout

def _set_timeout(rank, ws):
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        time.sleep(6)  # joins nothing for a while, then leaves
        return None
    dist.set_timeout(datetime.timedelta(seconds=1))
    return {"all_reduce": _attempt(lambda: dist.all_reduce(torch.ones(10)))}


def _set_timeout_fresh(rank, ws):
    dist.all_reduce(torch.ones(4))
    results = {}
    if rank == 1:
        time.sleep(8)
        return None
    dist.set_timeout(datetime.timedelta(seconds=1))
    results["recv"] = _attempt(lambda: dist.recv(torch.ones(3), src=1))
    results["monitored_barrier"] = _attempt(lambda: dist.monitored_barrier())
    return results


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_set_timeout_applies_to_later_ops(transport):
    res = run_ranks(_set_timeout, 2, timeout=60, pg_timeout=GROUP_TIMEOUT, env={"COLLX_TRANSPORT": transport})
    kind, msg, took = res[0]["all_reduce"]
    assert kind == "DistBackendError" and "Timed out" in msg, (kind, msg)
    assert 0.9 <= took <= 3.0, f"all_reduce failed after {took:.2f} s, not near the 1 s set: {msg}"


def test_set_timeout_applies_to_p2p_and_monitored_barrier():
    res = run_ranks(_set_timeout_fresh, 2, timeout=60, pg_timeout=GROUP_TIMEOUT)
    for op in ("recv", "monitored_barrier"):
        kind, msg, took = res[0][op]
        assert kind != "ok" and 0.9 <= took <= 3.0, f"{op}: {kind} after {took:.2f} s: {msg}"
        assert "Timed out" in msg or "failed to pass monitoredBarrier in 1000 ms" in msg, f"{op}: {msg}"


def _per_op_timeout_wins(rank, ws):
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        time.sleep(6)
        return None
    dist.set_timeout(datetime.timedelta(seconds=1))
    opts = dist.AllreduceOptions()
    opts.timeout = datetime.timedelta(seconds=2.5)
    return _attempt(lambda: _backend().allreduce([torch.ones(10)], opts).wait())


def test_per_op_timeout_wins_over_set_timeout():
    res = run_ranks(_per_op_timeout_wins, 2, timeout=60, pg_timeout=GROUP_TIMEOUT)
    kind, msg, took = res[0]
    assert kind == "DistBackendError" and "Timed out" in msg, (kind, msg)
    assert 2.3 <= took <= 5.0, f"failed after {took:.2f} s, not near the per-op 2.5 s"


# ------------------------------------------------------------------ abort

def _abort_in_flight(rank, ws, numel=1 << 18, device="cpu"):
    """Ranks 0..ws-2 have an all_reduce in flight that the last rank never
    joins, more ops queued behind it, and a pending irecv; rank 0 aborts."""
    x = torch.ones(1 << 16, device=device)
    dist.all_reduce(x)
    if rank == ws - 1:
        time.sleep(4)
        return None
    works = [dist.all_reduce(torch.ones(numel, device=device), async_op=True) for _ in range(3)]
    early = works[0].get_future()  # asked for before the failure; the others' after it
    recv = dist.irecv(torch.ones(8), src=ws - 1) if rank == 0 else None
    time.sleep(0.3)
    out = {}
    if rank == 0:
        t0 = time.monotonic()
        dist.distributed_c10d._abort_process_group()
        out["abort_took"] = time.monotonic() - t0
    t0 = time.monotonic()
    out["waits"] = [_attempt(w.wait) for w in works] + ([_attempt(recv.wait)] if recv else [])
    out["waited"] = time.monotonic() - t0
    out["futures"] = [_attempt(early.wait)] + [_attempt(w.get_future().wait) for w in works[1:]]
    if rank != 0:
        if HAS_GET_ERROR:
            out["error"] = str(_backend().get_error())
            out["error_is_remote"] = _backend().get_error() == ErrorType.REMOTE_ERROR
        out["later"] = _attempt(lambda: dist.all_reduce(torch.ones(4)))
    if device != "cpu":
        torch.cuda.synchronize()  # no CUDA error is left behind
    return out


@pytest.mark.parametrize("transport", TRANSPORTS + ["staged", "staged-peers"])
@pytest.mark.parametrize("ws", [3, 4], ids=lambda ws: f"ws{ws}")
def test_abort_fails_everything_in_flight_at_once(ws, transport):
    # "staged": the CUDA tensors' path, emulated on CPU tensors (staging.h);
    # "staged-peers": 4 MiB ops, which take the peers' buffers (memfd there).
    env = {"COLLX_STAGE_CPU_TENSORS": "1"} if transport.startswith("staged") else {"COLLX_TRANSPORT": transport}
    numel = 1 << 20 if transport == "staged-peers" else 1 << 18
    assert_abort_outcome(run_ranks(_abort_in_flight, ws, timeout=90, pg_timeout=GROUP_TIMEOUT, env=env, args=(numel,)),
                         ws)


def assert_abort_outcome(res, ws):
    """What every rank of _abort_in_flight must see (also for CUDA tensors)."""
    r0 = res[0]
    assert r0["abort_took"] < 1.0, f"abort took {r0['abort_took']:.2f} s"
    for rank in range(ws - 1):
        r = res[rank]
        for kind, msg, took in r["waits"]:
            assert kind == "DistBackendError", f"rank {rank}: {kind}: {msg}"
            assert "abort" in msg, f"rank {rank}: {msg}"
        assert r["waited"] < 2.0, f"rank {rank}: the ops failed only after {r['waited']:.2f} s"
        for (kind, msg, _), (wait_kind, wait_msg, _) in zip(r["futures"], r["waits"]):
            assert (kind, msg) == (wait_kind, wait_msg), f"rank {rank}: the future: {kind}: {msg}"
        if rank != 0:
            first = r["waits"][0][1]
            assert "peer 0" in first and "aborted" in first, f"rank {rank}: {first}"
            if HAS_GET_ERROR:
                assert r["error_is_remote"], f"rank {rank}: get_error() = {r['error']}"
            assert r["later"][0] == "DistBackendError" and r["later"][2] < 1.0, r["later"]


def _abort_after_shutdown_and_twice(rank, ws):
    dist.all_reduce(torch.ones(4))
    backend = _backend()
    backend.abort()
    backend.abort()
    later = _attempt(lambda: backend.allreduce([torch.ones(4)], dist.AllreduceOptions()).wait())
    dist.destroy_process_group()  # shutdown after abort
    backend.abort()  # and abort after shutdown
    # A second group: abort and shutdown at once from several threads, with an op in flight.
    store = dist.FileStore(os.environ["COLLX_TEST_FT_STORE"], ws)
    other = torchcollx._C.create_backend(store, rank, ws, 60.0, "auto", 2, 1 << 19, "", "", "auto")
    other.allreduce([torch.ones(1 << 16)], dist.AllreduceOptions()).wait()
    inflight = other.allreduce([torch.ones(1 << 16)], dist.AllreduceOptions()) if rank == 0 else None
    threads = [threading.Thread(target=other.abort if i % 2 else other.shutdown) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if inflight is not None:
        kind, msg, _ = _attempt(inflight.wait)
        assert kind == "DistBackendError", (kind, msg)
    return later


def test_abort_is_idempotent_and_safe_around_shutdown(tmp_path):
    res = run_ranks(_abort_after_shutdown_and_twice, 2, timeout=60, pg_timeout=GROUP_TIMEOUT,
                    env={"COLLX_TEST_FT_STORE": str(tmp_path / "store")})
    for kind, msg, took in res:
        assert kind == "DistBackendError" and "aborted" in msg and took < 1.0, (kind, msg, took)


# ------------------------------------------------------------------ get_error and abort hooks

def _errors_and_hooks(rank, ws, how, stamp):
    if rank == ws - 1:
        with open(stamp, "w") as f:
            f.write(str(os.getpid()))
    dist.all_reduce(torch.ones(4))
    pg = dist.group.WORLD
    ran = []
    pg.register_abort_hook(7, lambda: ran.append(time.monotonic()))
    pg.register_abort_hook(8, lambda: ran.append("unregistered"))
    pg.unregister_abort_hook(8)
    before = _backend().get_error()
    victim = ws - 1
    if rank == victim:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    time.sleep(0.3)
    if how == "stop":
        dist.set_timeout(datetime.timedelta(seconds=1))
    failed = _attempt(lambda: dist.all_reduce(torch.ones(1 << 16)))
    hooks_at_error = list(ran)
    err = _backend().get_error()
    if how == "stop" and rank == 0:
        with open(stamp) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    return {"before": before == ErrorType.SUCCESS, "failed": failed, "hooks": hooks_at_error,
            "timeout": err == ErrorType.TIMEOUT, "remote": err == ErrorType.REMOTE_ERROR, "error": str(err)}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_get_error_and_abort_hooks(how, transport, tmp_path):
    ws = 3
    stamp = str(tmp_path / "victim_pid")
    res = run_ranks(_errors_and_hooks, ws, timeout=60, pg_timeout=GROUP_TIMEOUT,
                    may_die=(ws - 1,), args=(how, stamp), env={"COLLX_TRANSPORT": transport})
    for rank in range(ws - 1):
        r = res[rank]
        assert r["before"], f"rank {rank}: get_error before any failure"
        assert r["failed"][0] == "DistBackendError", r["failed"]
        assert len(r["hooks"]) == 1 and r["hooks"][0] != "unregistered", f"rank {rank}: hooks {r['hooks']}"
        if how == "kill":
            assert "Connection closed by peer" in r["failed"][1] or "aborted the group" in r["failed"][1], r["failed"]
            assert r["remote"], f"rank {rank}: get_error() = {r['error']} after a peer died"
        else:
            # The rank waiting on the stopped one times out; a rank waiting
            # on that rank hears of it (a remote error) if it was not itself
            # waiting on the stopped rank.
            assert r["timeout"] or r["remote"], f"rank {rank}: get_error() = {r['error']}"
    if how == "stop":
        assert any(res[r]["timeout"] for r in range(ws - 1)), [res[r]["error"] for r in range(ws - 1)]


# ------------------------------------------------------------------ shrink

def _check_collectives(group, tag):
    """Every collective and p2p on `group`, checked against locally computed values."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    x = torch.full((1000,), float(r + 1))
    dist.all_reduce(x, group=group)
    assert torch.equal(x, torch.full((1000,), float(n * (n + 1) / 2))), (tag, "all_reduce", x[:3])
    big = torch.arange(1 << 18, dtype=torch.float32) * (r + 1)
    dist.all_reduce(big, group=group)
    assert torch.equal(big, torch.arange(1 << 18, dtype=torch.float32) * (n * (n + 1) / 2)), (tag, "large")
    b = torch.full((5,), float(r))
    dist.broadcast(b, src=dist.get_global_rank(group, n - 1), group=group)
    assert torch.equal(b, torch.full((5,), float(n - 1))), (tag, "broadcast", b)
    outs = [torch.empty(3) for _ in range(n)]
    dist.all_gather(outs, torch.full((3,), float(r)), group=group)
    assert all(torch.equal(o, torch.full((3,), float(i))) for i, o in enumerate(outs)), (tag, "all_gather")
    rs = torch.empty(2)
    dist.reduce_scatter(rs, [torch.full((2,), float(r + i)) for i in range(n)], group=group)
    assert torch.equal(rs, torch.full((2,), float(sum(q + r for q in range(n))))), (tag, "reduce_scatter", rs)
    a2a = torch.empty(n)
    dist.all_to_all_single(a2a, torch.arange(n, dtype=torch.float32) + 10 * r, group=group)
    assert torch.equal(a2a, torch.tensor([10.0 * q + r for q in range(n)])), (tag, "all_to_all", a2a)
    nxt, prv = (r + 1) % n, (r - 1) % n
    got = torch.empty(4)
    reqs = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, torch.full((4,), float(r)), dist.get_global_rank(group, nxt), group),
        dist.P2POp(dist.irecv, got, dist.get_global_rank(group, prv), group)])
    for q in reqs:
        q.wait()
    assert torch.equal(got, torch.full((4,), float(prv))), (tag, "p2p", got)
    dist.barrier(group=group)


def _train_ddp(group, steps=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    r = dist.get_rank(group)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + r)
        loss = ddp(torch.randn(8, 16, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(gathered[0], t) for t in gathered)


def _shrink_after_death(rank, ws, victim):
    dist.all_reduce(torch.ones(4))
    devices = sorted(d.type for d in dist.group.WORLD._device_types)
    if rank == victim:
        def die():
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.2, die).start()
    failed = None
    for _ in range(100000):  # a training loop that the kill interrupts
        try:
            dist.all_reduce(torch.ones(1 << 15))
        except Exception as e:
            failed = str(e)
            break
    t0 = time.monotonic()
    group = dist.shrink_group([victim])
    shrink_took = time.monotonic() - t0
    info = {"rank": dist.get_rank(), "size": dist.get_world_size(), "shrink_took": shrink_took,
            "failed": failed, "fresh": _backend(group).get_error() == ErrorType.SUCCESS,
            "devices": (devices, sorted(d.type for d in group._device_types)), "backend": dist.get_backend(group)}
    _check_collectives(group, "shrunk")
    info["ddp_identical"] = _train_ddp(group)
    return info


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("ws,victim", [(3, 1), (4, 2), (4, 0)], ids=["ws3v1", "ws4v2", "ws4v0"])
def test_shrink_after_a_rank_dies(ws, victim, transport):
    dev_shm = set(os.listdir("/dev/shm"))
    res = run_ranks(_shrink_after_death, ws, timeout=120, pg_timeout=GROUP_TIMEOUT, may_die=(victim,),
                    args=(victim,), env={"COLLX_TRANSPORT": transport})
    assert isinstance(res[victim], Died)
    survivors = [r for r in range(ws) if r != victim]
    for new_rank, old in enumerate(survivors):
        info = res[old]
        assert info["failed"] and ("Connection closed by peer" in info["failed"] or "aborted" in info["failed"]), info
        assert info["rank"] == new_rank and info["size"] == ws - 1 and info["fresh"], info
        # The shrunk group serves the parent's devices (CUDA tensors too: test_cuda_faults.py).
        assert info["devices"] == (["cpu", "cuda"], ["cpu", "cuda"]) and info["backend"] == "collx", info
        assert info["ddp_identical"], f"rank {old}: DDP weights differ after shrinking"
        assert info["shrink_took"] < 5.0, info
    assert set(os.listdir("/dev/shm")) == dev_shm, "a shrink or a killed rank left something in /dev/shm"


def _shrink_disagree(rank, ws):
    """Rank 1 also excludes rank 0: rank 0 must fail, naming the disagreement."""
    dist.all_reduce(torch.ones(4))
    exclude = [2] if rank != 1 else [0, 2]
    if rank == 2:
        dist.destroy_process_group()
        return None
    return _attempt(lambda: dist.shrink_group(exclude))


def test_shrink_fails_clearly_when_survivors_disagree():
    res = run_ranks(_shrink_disagree, 3, timeout=90, pg_timeout=10.0)
    kind, msg, took = res[0]
    assert kind == "DistBackendError" and "disagree" in msg, (kind, msg)
    assert took < 5.0, took


# ------------------------------------------------------------------ SHRINK_ABORT, a hung rank

def _shrink_abort_hung(rank, ws):
    """The last rank hangs (SIGSTOP) while the others have an all_reduce in
    flight on it; they shrink with SHRINK_ABORT, which fails that op at once."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    dist.all_reduce(torch.ones(4))
    if rank == ws - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    time.sleep(0.3)
    t0 = time.monotonic()
    group = dist.shrink_group([ws - 1], shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
    took = time.monotonic() - t0
    inflight = _attempt(work.wait)
    _check_collectives(group, "shrunk after SHRINK_ABORT")
    if rank == 0:
        os.kill(int(store.get(f"pid/{ws - 1}")), signal.SIGKILL)
    return {"took": took, "inflight": inflight, "size": dist.get_world_size()}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shrink_abort_with_a_hung_rank(transport):
    ws = 3
    res = run_ranks(_shrink_abort_hung, ws, timeout=90, pg_timeout=GROUP_TIMEOUT, may_die=(ws - 1,),
                    env={"COLLX_TRANSPORT": transport})
    for rank in range(ws - 1):
        r = res[rank]
        kind, msg, _ = r["inflight"]
        assert kind == "DistBackendError" and "abort" in msg, (kind, msg)
        assert r["took"] < 5.0 and r["size"] == ws - 1, r
