"""What users see of collx with torch's own tools, at 2 and 4 ranks:

- torch.profiler: a ``collx:all_reduce`` span over the op's run, its
  ``record_param_comms`` metadata, and the algorithm and carriers chosen, in
  the exported Chrome trace;
- the flight recorder: ``_dump_fr_trace()`` lists collx's ops with their
  sequence numbers, sizes, dtypes and states, also one in flight;
- a rank stopped with SIGSTOP: every other rank's timeout error names it,
  and the per-rank dumps, read by ``python -m torchcollx.fr``, say which op
  it never reached;
- get_stats() counts the bytes moved through shared memory.
"""
from __future__ import annotations

import datetime
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

from launcher import Died, run_ranks  # noqa: E402

WORLD_SIZES = [2, 4]


def _dump():
    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace())


def _profiled(rank, ws, trace_dir):
    t = torch.ones(1 << 18)  # 1 MiB
    for _ in range(3):
        dist.all_reduce(t)  # auto settles; the calibration is behind us
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with torch.profiler.record_function("test:call"):
                dist.all_reduce(t)
    path = os.path.join(trace_dir, f"trace{rank}.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    # The trace prints whole nanoseconds as microseconds: read them back exactly.
    ns = lambda e: (round(e["ts"] * 1000), round(e["dur"] * 1000))  # noqa: E731
    calls = [ns(e) for e in events if e.get("name") == "test:call"]
    spans = [ns(e) for e in events if e.get("name") == "collx:all_reduce"]
    comms = [e for e in events if e.get("name") == "record_param_comms"]
    chosen = [e["name"] for e in events if e.get("name", "").startswith("collx:all_reduce/")]
    work = dist.all_reduce(t, async_op=True)  # the op after the three
    work.wait()
    seq = work._get_sequence_number() - 1
    return {"calls": calls, "spans": spans, "comms": [e["args"] for e in comms],
            "chosen": chosen, "seq": seq, "algorithms": sorted(torchcollx.get_stats()["algorithms"])}


@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def test_profiler_spans_cover_the_op_with_its_metadata(ws, tmp_path):
    res = run_ranks(_profiled, ws, timeout=120, args=(str(tmp_path),))
    for rank, r in enumerate(res):
        assert len(r["spans"]) == len(r["calls"]) == 3, f"rank {rank}: {r}"
        # The span is the op's run: within the caller's call, both read on
        # the profiler's one clock (a clock beside it, such as perf_counter,
        # can disagree with it by more than the gap between the two), and
        # most of it, for all but an op whose caller the machine preempted
        # after the op had ended (once in a full suite: a span under 0.3x its
        # call).
        for (span_ts, span_dur), (call_ts, call_dur) in zip(r["spans"], r["calls"]):
            assert call_ts <= span_ts and span_ts + span_dur <= call_ts + call_dur, (
                f"rank {rank}: span [{span_ts}, +{span_dur}] ns outside its call [{call_ts}, +{call_dur}] ns")
        covered = sorted(span[1] / call[1] for span, call in zip(r["spans"], r["calls"]))
        assert covered[1] >= 0.3, f"rank {rank}: spans {r['spans']} ns, calls {r['calls']} ns"
        assert len(r["comms"]) == 3, r["comms"]
        for i, args in enumerate(r["comms"]):
            assert args["Collective name"] == "all_reduce", args
            assert args["In msg nelems"] == args["Out msg nelems"] == 1 << 18, args
            assert args["dtype"] == "Float" and args["Group size"] == ws and args["Rank"] == rank, args
            assert args["Process Group Ranks"] == str(list(range(ws))), args
            assert args["Seq"] == r["seq"] - 2 + i, (args, r["seq"])  # the group's sequence numbers
        assert len(r["chosen"]) == 3, r["chosen"]
        for name in r["chosen"]:
            label, via = name[len("collx:"):].split(" via ")
            assert label in r["algorithms"], (name, r["algorithms"])
            assert via != "none" and set(via.split(",")) <= {"tcp", "shm_ring", "shm_window", "peer_memory"}, name


def _recorded(rank, ws):
    t = torch.arange(10, dtype=torch.float64)
    dist.all_reduce(t)
    dist.broadcast(torch.ones(3, 4), src=0)
    out = [torch.zeros(5, dtype=torch.int32) for _ in range(ws)]
    dist.all_gather(out, torch.ones(5, dtype=torch.int32))
    done = [e for e in _dump()["entries"] if e["profiling_name"].startswith("collx:")]
    right, left = (rank + 1) % ws, (rank - 1) % ws
    works = [dist.isend(torch.ones(6), right), dist.irecv(torch.zeros(6), left)]
    for w in works:
        w.wait()
    p2p = [e for e in _dump()["entries"] if e["is_p2p"]]
    # An op in flight: rank 0's all-reduce waits while the others hold back.
    in_flight = None
    if rank == 0:
        work = dist.all_reduce(torch.ones(7), async_op=True)
        time.sleep(0.5)
        in_flight = [e for e in _dump()["entries"] if e["profiling_name"].startswith("collx:")][-1]
        work.wait()
    else:
        time.sleep(1.0)
        dist.all_reduce(torch.ones(7))
    after = [e for e in _dump()["entries"] if e["profiling_name"].startswith("collx:")][-1]
    return {"done": done, "p2p": p2p, "in_flight": in_flight, "after": after}


@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def test_flight_recorder_lists_collx_ops_with_their_states(ws):
    res = run_ranks(_recorded, ws, timeout=120, env={"TORCH_FR_BUFFER_SIZE": "100"})
    for rank, r in enumerate(res):
        done = r["done"]
        names = [e["profiling_name"] for e in done]
        assert names[-3:] == ["collx:all_reduce", "collx:broadcast", "collx:all_gather"], names
        seqs = [e["collective_seq_id"] for e in done[-3:]]
        assert seqs == list(range(seqs[0], seqs[0] + 3)), seqs
        ar, bc, ag = done[-3:]
        assert ar["input_sizes"] == [[10]] and ar["input_dtypes"] == ["Double"], ar
        assert bc["input_sizes"] == [[3, 4]] and bc["output_dtypes"] == ["Float"], bc
        assert ag["input_sizes"] == [[5]] and ag["output_sizes"] == [[5]] * ws, ag
        assert ag["input_dtypes"] == ["Int"], ag
        for e in done[-3:]:
            assert e["state"] == "completed" and e["retired"] and not e["is_p2p"], e
            assert e["time_created_ns"] <= e["time_discovered_started_ns"] <= e["time_discovered_completed_ns"], e
            assert e["duration_ms"] >= 0 and e["process_group"] == ("0", "default_pg"), e
            assert e["frames"], "the entry has the caller's Python stack"
        assert r["after"]["state"] == "completed" and r["after"]["input_sizes"] == [[7]], r["after"]
        p2p = {e["profiling_name"]: e for e in r["p2p"]}
        send, recv = p2p[f"collx:send {rank}->{(rank + 1) % ws}"], p2p[f"collx:recv {rank}<-{(rank - 1) % ws}"]
        assert send["input_sizes"] == [[6]] and recv["output_sizes"] == [[6]], (send, recv)
        assert sorted([send["p2p_seq_id"], recv["p2p_seq_id"]]) == [1, 2], (send, recv)
        for e in (send, recv):
            assert e["state"] == "completed" and e["collective_seq_id"] == 0, e
        if rank == 0:
            e = r["in_flight"]
            assert e["profiling_name"] == "collx:all_reduce" and e["state"] == "started", e
            assert e["time_discovered_completed_ns"] is None and not e["retired"], e


def _last_entry_frames(rank, ws):
    dist.all_reduce(torch.ones(3))
    return [e for e in _dump()["entries"] if e["profiling_name"] == "collx:all_reduce"][-1]["frames"]


@pytest.mark.parametrize("value,stacks", [("1", True), ("true", True), ("0", False)])
def test_fr_stack_variable_keeps_or_drops_the_callers_stack(value, stacks):
    res = run_ranks(_last_entry_frames, 2, timeout=60, env={"TORCH_FR_BUFFER_SIZE": "10", "COLLX_FR_STACK": value})
    for frames in res:
        assert bool(frames) == stacks, (value, frames)


def _held_back(rank, ws, victim, prefix):
    pids = [None] * ws
    dist.all_gather_object(pids, os.getpid())
    t = torch.ones(1000)
    for _ in range(5):
        dist.all_reduce(t)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    last = work._get_sequence_number()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
        return "continued"
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
        result = ("ok", "")
    except Exception as e:
        result = (type(e).__name__, str(e))
    took = time.monotonic() - t0
    deadline = time.monotonic() + 10  # every survivor's dump is written before the victim goes
    while time.monotonic() < deadline and not all(os.path.exists(f"{prefix}{r}") for r in range(ws) if r != victim):
        time.sleep(0.05)
    if rank == min(r for r in range(ws) if r != victim):
        os.kill(pids[victim], signal.SIGKILL)
    return {"error": result, "took": took, "last": last}


@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def test_stopped_rank_is_named_by_every_timeout_and_by_the_dumps(ws, tmp_path):
    victim, timeout = ws - 1, 3.0
    prefix = str(tmp_path / "fr_rank_")
    res = run_ranks(_held_back, ws, timeout=120, pg_timeout=timeout, may_die=(victim,), args=(victim, prefix),
                    env={"TORCH_FR_BUFFER_SIZE": "100", "TORCH_FR_DUMP_TEMP_FILE": prefix})
    assert isinstance(res[victim], Died), res[victim]
    seq = res[0]["last"] + 1  # the all-reduce the victim never reached
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        kind, msg = r["error"]
        report = f"rank {rank} after {r['took']:.2f} s: {kind}: {msg}"
        print(report)
        assert kind == "DistBackendError" and "Timed out" in msg, report
        assert f"all_reduce #{seq}" in msg, report
        # Its own timeout names the victim with its last op, read in shared
        # memory; a rank failed by a peer's timeout carries the peer's words.
        assert f"rank {victim} (its last op: all_reduce #{seq - 1}, completed)" in msg or \
            f"peer(s) {victim} " in msg, report
        others = [r for r in range(ws) if r not in (rank, victim)]
        if "its last op" in msg and others:
            sent = f"rank {others[0]}" if len(others) == 1 else f"ranks {others[0]}-{others[-1]}" \
                if others == list(range(others[0], others[-1] + 1)) else "ranks " + ", ".join(map(str, others))
            assert f"; {sent} had sent." in msg, report
        assert r["took"] <= timeout + 3.0, report
    out = subprocess.run([sys.executable, "-m", "torchcollx.fr", prefix], capture_output=True, text=True, timeout=60)
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stderr
    assert f"rank {victim} never reached all_reduce #{seq}" in out.stdout, out.stdout
    survivors = ", ".join(str(r) for r in range(ws - 1)) if ws == 2 else f"0-{ws - 2}"
    assert f"all_reduce #{seq}: ranks {survivors} started" in out.stdout, out.stdout


def test_analyzer_reports_mismatches_and_ranks_behind(tmp_path):
    """torchcollx.fr on hand-made dumps: a size mismatch, and a rank whose
    last op is older than the others'."""
    def entry(seq, size, state="completed"):
        return {"collective_seq_id": seq, "is_p2p": False, "process_group": ("0", "default_pg"),
                "profiling_name": "collx:all_reduce", "input_sizes": [[size]], "input_dtypes": ["Float"],
                "state": state}
    config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
    dumps = {0: [entry(1, 8), entry(2, 8), entry(3, 8, "started")],
             1: [entry(1, 8), entry(2, 9), entry(3, 8, "started")],
             2: [entry(1, 8), entry(2, 8)]}
    for rank, entries in dumps.items():
        with open(tmp_path / f"d{rank}", "wb") as f:
            pickle.dump({"pg_config": config, "entries": entries}, f)
    out = subprocess.run([sys.executable, "-m", "torchcollx.fr", str(tmp_path / "d")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "mismatch at #2: rank 0: collx:all_reduce [[8]]" in out.stdout and "rank 1: collx:all_reduce [[9]]" \
        in out.stdout, out.stdout
    assert "rank 2 never reached all_reduce #3 (its last op: all_reduce #2, completed)" in out.stdout, out.stdout


def _stats(rank, ws):
    before = torchcollx.get_stats()
    t = torch.ones(1 << 18)
    for _ in range(3):
        dist.all_reduce(t)
    after = torchcollx.get_stats()
    return before, after


@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def test_stats_count_shared_memory_traffic(ws):
    res = run_ranks(_stats, ws, timeout=120, pg_options=torchcollx.Options(algorithm="shm"))
    nbytes = 3 * (1 << 20)
    for rank, (before, after) in enumerate(res):
        window = {k: after["carriers"]["shm_window"][k] - before.get("carriers", {}).get("shm_window", {}).get(k, 0)
                  for k in ("bytes_sent", "bytes_received")}
        # Each rank puts its megabyte in (sent) and takes its peers' shares
        # twice, to reduce and to gather (received): 2(n-1)/n of it.
        assert window["bytes_sent"] >= nbytes, (rank, window)
        expected = 2 * (ws - 1) * nbytes // ws
        assert abs(window["bytes_received"] - expected) <= ws * 64, (rank, window, expected)
        assert after["bytes_sent"] - before["bytes_sent"] >= window["bytes_sent"], (rank, before, after)


def _group_ranks(rank, ws):
    mine = [r for r in range(ws) if r % 2 == rank % 2]
    split = dist.distributed_c10d._get_default_group().split_group(
        mine, timeout=datetime.timedelta(seconds=60), opts=None, group_name=f"parity{rank % 2}")
    odd = dist.new_group([r for r in range(ws) if r % 2 == 1])
    dist.all_reduce(torch.ones(2), group=split)
    if rank % 2 == 1:
        dist.all_reduce(torch.ones(2), group=odd)
    return _dump()["pg_config"]


def test_recorder_names_each_groups_global_ranks():
    """A split group and a new_group list their members by global rank, as
    torch's recorder does, so that dumps of several groups line up."""
    ws = 4
    res = run_ranks(_group_ranks, ws, timeout=120)
    for rank, config in enumerate(res):
        parity = [r for r in range(ws) if r % 2 == rank % 2]
        assert config[f"parity{rank % 2}"]["ranks"] == str(parity), (rank, config)
        if rank % 2 == 1:
            assert str(parity) in [c["ranks"] for name, c in config.items() if not name.startswith("parity")], config
