"""COLLX_TUNING: auto's cost model, calibrated at group creation (the
default), cached, taken from the static table, or read from a file.

The C++ test tests/cpp/test_tuning.cc covers the fit, the file format and
the agreement between ranks; here the same through init_process_group and
new_group, with a private cache folder (XDG_CACHE_HOME) per test.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

from launcher import run_ranks  # noqa: E402

SIZES = [4 ** k for k in range(14)]  # 1 B .. 64 MiB


def _groups(rank, ws):
    """The default group, then a new group of the same shape: the tuning each
    reports, and what auto would run at each size."""
    first = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    second = dist.new_group(backend="collx")._get_backend(torch.device("cpu"))
    t = torch.full((100_003,), float(rank + 1))
    dist.all_reduce(t)  # auto, with the fitted model
    return {
        "tunings": [first.tuning, second.tuning],
        "choices": [first.choose_allreduce(s) for s in SIZES],
        "ok": bool((t == ws * (ws + 1) / 2).all()),
    }


@pytest.mark.parametrize("ws", [2, 4])
def test_calibrated_then_cached(ws, tmp_path):
    def fitted(tuning):  # the constants and crossovers, without the refinement of the ops run
        return tuning.split(":", 1)[1].split("; refin")[0]

    results = run_ranks(_groups, ws, timeout=120, env={"XDG_CACHE_HOME": str(tmp_path), "COLLX_TUNING": None})
    for r in results:
        first, second = r["tunings"]
        assert first.startswith("tuning from calibration in "), first
        assert second.startswith("tuning from cache " + str(tmp_path / "torchcollx")), second
        # The same constants and choices as rank 0's: every rank picks the same algorithm.
        # Its ops' refinement too; the second group has run none.
        assert first.split(":", 1)[1] == results[0]["tunings"][0].split(":", 1)[1]
        assert fitted(second) == fitted(first)
        assert r["choices"] == results[0]["choices"] and r["ok"]
    assert len(os.listdir(tmp_path / "torchcollx")) == 1
    # A later run on the same machine reuses the cache from its first group on.
    again = run_ranks(_groups, ws, timeout=120, env={"XDG_CACHE_HOME": str(tmp_path), "COLLX_TUNING": None})
    assert all(r["tunings"][0].startswith("tuning from cache ") for r in again), again[0]["tunings"]


# The table and file tests check the cost model's choices, so their ranks use
# TCP: on shared memory auto takes the shm all-reduce up to 4 KiB and from
# 64 KiB whatever the model says (test_shm_takes_over_the_small_and_large).
def test_table(tmp_path):
    results = run_ranks(_groups, 2, timeout=60,
                        env={"XDG_CACHE_HOME": str(tmp_path), "COLLX_TUNING": "table", "COLLX_TRANSPORT": "tcp"})
    assert all(t.startswith("tuning from table: ") for r in results for t in r["tunings"]), results[0]["tunings"]
    assert all(r["choices"] == [torchcollx._C.choose_allreduce(2, 2, s) for s in SIZES] for r in results)
    assert not os.path.exists(tmp_path / "torchcollx")


TUNING_FILE = """\
# direct is made very cheap, ring very dear: auto picks direct at every size
collx-tuning 1
ring 500 10
tree 500 10
star 500 10
direct 1 100000
hier 500 10
"""


def test_file(tmp_path):
    path = tmp_path / "tuning.txt"
    path.write_text(TUNING_FILE)
    results = run_ranks(_groups, 3, timeout=60, env={"COLLX_TUNING": str(path), "COLLX_TRANSPORT": "tcp"})
    for r in results:
        assert r["tunings"][0].startswith(f"tuning from file {path}: "), r["tunings"]
        assert r["choices"] == ["direct"] * len(SIZES) and r["ok"]


def test_shm_takes_over_the_small_and_large(tmp_path):
    path = tmp_path / "tuning.txt"
    path.write_text(TUNING_FILE)
    for r in run_ranks(_groups, 3, timeout=60, env={"COLLX_TUNING": str(path)}):
        want = ["shm" if s <= 4 << 10 or s >= 64 << 10 else "direct" for s in SIZES]
        assert r["choices"] == want and r["ok"], r["choices"]


def _init_only(rank, ws):
    return True


@pytest.mark.parametrize("value, message", [
    ("", "COLLX_TUNING is empty"),
    ("/nonexistent/tuning.txt", "cannot read the tuning file /nonexistent/tuning.txt"),
])
def test_bad_value_is_a_clear_error(value, message):
    with pytest.raises(AssertionError, match=message):
        run_ranks(_init_only, 2, timeout=60, env={"COLLX_TUNING": value})


def test_bad_file_is_a_clear_error(tmp_path):
    path = tmp_path / "tuning.txt"
    path.write_text("collx-tuning 1\nring 30 fast\n")
    with pytest.raises(AssertionError, match="bad constants for 'ring'"):
        run_ranks(_init_only, 2, timeout=60, env={"COLLX_TUNING": str(path)})


def _runs_every_class(rank, ws, stderr_path):
    """70 auto all-reduces at each size from 4 B to 4 MiB: enough for online
    refinement to try every class the model finds close (under the slow
    model below, blocks of 8 or 4 ops: 64 trial ops at most); then every
    class still refining runs on until it has settled, which its check may
    take past 70 ops (up to 256 for a fast op). Which classes have a trial
    depends on the fit the first calibration made, under whatever load the
    machine had. stderr goes to a file, to read the WARN line."""
    fd = os.open(f"{stderr_path}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    b = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    ok = True

    def run(t):
        nonlocal ok
        t.fill_(rank + 1)
        dist.all_reduce(t)
        ok = ok and bool((t == ws * (ws + 1) / 2).all())

    for k in range(11):
        t = torch.ones(4 ** k)
        for _ in range(70):
            run(t)
    for k in range(11):  # every rank agrees the refiner's state, so all stop at the same op
        t = torch.ones(4 ** k)
        for _ in range(400):
            if not b.refining(t.nbytes):
                break
            run(t)
    return b.tuning, ok


def test_a_cache_fitted_under_load_is_dropped(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path), "COLLX_TUNING": None, "COLLX_TRANSPORT": "tcp", "COLLX_DEBUG": "WARN"}
    run_ranks(_groups, 2, timeout=120, env=env)
    [cache] = (tmp_path / "torchcollx").iterdir()
    # The same fit 100x slower, as a calibration on a loaded machine may write:
    # the same choices and crossovers, far slower predictions.
    lines = []
    for line in cache.read_text().splitlines():
        f = line.split()
        lines.append(line if line.startswith(("#", "collx-tuning")) else
                     f"{f[0]} {float(f[1]) * 100} {float(f[2]) / 100}")
    cache.write_text("\n".join(lines) + "\n")
    res = run_ranks(_runs_every_class, 2, timeout=120, env=env, args=(str(tmp_path / "stderr"),))
    errs = [(tmp_path / f"stderr.{rank}").read_text() for rank in range(2)]
    for rank, (tuning, ok) in enumerate(res):
        assert tuning.startswith(f"tuning from cache {cache}") and "refined: " in tuning, tuning
        assert ok, f"rank {rank}: wrong sums"
        assert errs[rank].count("it was fitted on a busier machine") == 1, errs[rank]
    # Both ranks remove the host's one cache file; one of them finds it.
    assert sum("dropped its cache" in err for err in errs) == 1, errs
    assert not cache.exists(), "the stale cache was kept"
    # The refined choices are the ops' own times: they stay for the next run.
    assert list(cache.parent.glob("*.refined")), "the choices refined under the stale cache were not saved"
    again = run_ranks(_groups, 2, timeout=120, env=env)
    assert all(r["tunings"][0].startswith("tuning from calibration in ") for r in again), again[0]["tunings"]


def _size_name(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _settles(rank, ws, sizes):
    """Auto all-reduces of each size until its class has settled once (the
    line turns up in the tuning on every rank at the same op); returns the
    tuning after each size's first op, and at the end."""
    b = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    firsts, ok = [], True
    for s in sizes:
        t = torch.empty(s // 4)
        # A cheap class runs up to 64 rounds (4096 ops for 4 candidates), then
        # its checks: 20000 ops let one more trial follow a saved choice's check.
        for i in range(20000):
            t.fill_(rank + 1)
            dist.all_reduce(t)
            ok = ok and bool((t == ws * (ws + 1) / 2).all())
            if i == 0:
                firsts.append(b.tuning)
            if f"refined: {_size_name(s)}:" in b.tuning or (i > 0 and not b.refining(s)):
                break
    return {"firsts": firsts, "tuning": b.tuning, "ok": ok}


def test_refined_choices_are_saved_for_the_next_run(tmp_path):
    """A job's second run starts each class at the check of what its first
    run settled on, instead of a trial (its first op already runs it)."""
    env = {"XDG_CACHE_HOME": str(tmp_path), "COLLX_TUNING": None, "COLLX_TRANSPORT": "tcp"}
    sizes = [16 << 10, 256 << 10, 1 << 20]
    first = run_ranks(_settles, 2, timeout=180, env=env, args=(sizes,))
    assert all(r["ok"] for r in first)
    files = list((tmp_path / "torchcollx").glob("*.refined"))
    assert len(files) == 1, f"{files}; rank 0's tuning: {first[0]['tuning']}"
    [refined] = files
    header, *saved = refined.read_text().splitlines()
    assert header == "collx-refined 2", header
    assert saved, f"no class had a trial: {first[0]['tuning']}"
    kept = {}
    for line in saved:
        nbytes, kind, algorithm = line.split()[:3]
        assert kind == "flat" and int(nbytes) in sizes, line
        name = _size_name(int(nbytes))
        assert f"refined: {name}: {algorithm} (" in first[0]["tuning"], (line, first[0]["tuning"])
        kept[int(nbytes)] = (name, algorithm)
    second = run_ranks(_settles, 2, timeout=180, env=env, args=(sizes,))
    for r in second:
        assert r["ok"]
        for s, after_one in zip(sizes, r["firsts"]):
            if s in kept:
                name, algorithm = kept[s]
                assert f"refining: {name}: checking {algorithm}, 1 of " in after_one, after_one
                # It settles: on the saved choice where its check held (the
                # line says so), else on what the trial after it found.
                lines = [x for x in r["tuning"].split("; refin") if x.startswith(f"ed: {name}: ")]
                assert len(lines) == 1, r["tuning"]
                assert "the saved choice, checked" not in lines[0] or lines[0].startswith(
                    f"ed: {name}: {algorithm} ("), lines[0]
            else:  # a class with one candidate: nothing to try or save
                assert f"{_size_name(s)}:" not in r["tuning"], r["tuning"]


def test_trials_at_large_sizes_agree_with_more_ranks_than_cores(tmp_path):
    """Four ranks on this host's cores, freshly calibrated, through auto's
    trials at 4 and 16 MiB: every rank runs the same algorithm at every op
    (a rank that chose on its own state, its workspace or its clock, would
    meet a peer running another and fail as a mismatch) and gets the sum."""
    env = {"XDG_CACHE_HOME": str(tmp_path), "COLLX_TUNING": None}
    res = run_ranks(_settles, 4, timeout=240, env=env, args=([4 << 20, 16 << 20],))
    assert all(r["ok"] for r in res), [r["ok"] for r in res]
    kept = [[x for x in r["tuning"].split("; refin") if x.startswith("ed: ")] for r in res]
    assert len(kept[0]) == 2 and all(k == kept[0] for k in kept), kept
