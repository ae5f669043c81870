"""Options and the COLLX_* environment of collx: validation and resolution in
process, environment overrides where Options fields are None, Options as
init_process_group's pg_options, and bad environment values.
"""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

from common import expected, gen, mismatch  # noqa: E402
from launcher import run_ranks  # noqa: E402


# ------------------------------------------------------------------ Options / environment

def test_options_resolve_in_process(monkeypatch):
    """Options validation and env fallback, without processes."""
    for var in ("COLLX_ALGORITHM", "COLLX_TREE_ARITY", "COLLX_SEGMENT_BYTES", "COLLX_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    r = torchcollx.Options().resolved()
    assert (r.algorithm, r.tree_arity, r.segment_bytes) == ("auto", 2, 512 * 1024)
    monkeypatch.setenv("COLLX_ALGORITHM", "star")
    monkeypatch.setenv("COLLX_TREE_ARITY", "4")
    monkeypatch.setenv("COLLX_SEGMENT_BYTES", "8192")
    r = torchcollx.Options().resolved()
    assert (r.algorithm, r.tree_arity, r.segment_bytes) == ("star", 4, 8192)
    r = torchcollx.Options(algorithm="ring", tree_arity=3, segment_bytes=1024).resolved()
    assert (r.algorithm, r.tree_arity, r.segment_bytes) == ("ring", 3, 1024)
    for kwargs, word in ((dict(algorithm="bogus"), "algorithm"), (dict(tree_arity=0), "tree_arity"),
                         (dict(segment_bytes=-1), "segment_bytes"), (dict(segment_bytes="abc"), "segment_bytes")):
        with pytest.raises(ValueError, match=word):
            torchcollx.Options(**kwargs).resolved()
    for var, value in (("COLLX_ALGORITHM", "bogus"), ("COLLX_TREE_ARITY", "0"), ("COLLX_SEGMENT_BYTES", "abc")):
        monkeypatch.setenv(var, value)
        with pytest.raises(ValueError, match=var):
            torchcollx.Options().resolved()
        monkeypatch.delenv(var)


def _env_override(rank, ws):
    """Runs with COLLX_ALGORITHM=tree, COLLX_TREE_ARITY=3, COLLX_SEGMENT_BYTES=4096."""
    out = []
    world = torchcollx.stats.backend_of(None)
    if (world.algorithm, world.tree_arity, world.segment_bytes) != ("tree", 3, 4096):
        out.append(f"world group config {(world.algorithm, world.tree_arity, world.segment_bytes)}, "
                   "expected ('tree', 3, 4096) from the environment")
    x = gen(rank, torch.float64, "SUM", 5001)
    dist.all_reduce(x)
    if m := mismatch(x, expected(ws, torch.float64, "SUM", 5001)):
        out.append(f"all_reduce under the env config: {m}")
    labels = sorted(torchcollx.get_stats()["algorithms"])
    if labels != ["all_reduce/tree"]:
        out.append(f"COLLX_ALGORITHM=tree: world stats labels {labels}")
    # Options fields win over the environment; None fields still take it.
    g = dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm="star", tree_arity=5))
    be = torchcollx.stats.backend_of(g)
    if (be.algorithm, be.tree_arity, be.segment_bytes) != ("star", 5, 4096):
        out.append(f"Options(algorithm='star', tree_arity=5) under the env: {(be.algorithm, be.tree_arity, be.segment_bytes)}")
    x = gen(rank, torch.int32, "SUM", 777)
    dist.all_reduce(x, group=g)
    if m := mismatch(x, expected(ws, torch.int32, "SUM", 777)):
        out.append(f"all_reduce on the star group: {m}")
    labels = sorted(torchcollx.get_stats(g)["algorithms"])
    if labels != ["all_reduce/star"]:
        out.append(f"Options(algorithm='star') overrides COLLX_ALGORITHM=tree: labels {labels}")
    return out


def test_env_overrides_apply_where_options_are_none():
    env = {"COLLX_ALGORITHM": "tree", "COLLX_TREE_ARITY": "3", "COLLX_SEGMENT_BYTES": "4096"}
    results = run_ranks(_env_override, 3, timeout=120, env=env)
    problems = [f"rank {r}: {m}" for r, ms in enumerate(results) for m in ms]
    assert not problems, "\n".join(problems)


def test_options_as_pg_options_of_init_process_group():
    results = run_ranks(_forced_world, 3, timeout=120, pg_options=torchcollx.Options(algorithm="star"),
                        env={"COLLX_ALGORITHM": "ring"})
    assert all(labels == ["all_reduce/star"] for labels in results), results


def _forced_world(rank, ws):
    x = gen(rank, torch.float32, "SUM", 1001)
    dist.all_reduce(x)
    assert mismatch(x, expected(ws, torch.float32, "SUM", 1001)) is None
    return sorted(torchcollx.get_stats()["algorithms"])


BAD_ENV = [
    ("COLLX_ALGORITHM", "bogus"),
    ("COLLX_TREE_ARITY", "0"),
    ("COLLX_TREE_ARITY", "-2"),
    ("COLLX_TREE_ARITY", "two"),
    ("COLLX_SEGMENT_BYTES", "abc"),
    ("COLLX_SEGMENT_BYTES", "1.5"),
    ("COLLX_SEGMENT_BYTES", "0"),
]


def _bad_env(rank, ws):
    base = os.environ["COLLX_TEST_INIT_METHOD"]
    assert base.startswith("file://")
    out = []
    for i, (var, value) in enumerate(BAD_ENV):
        os.environ[var] = value
        try:
            dist.init_process_group("collx", init_method=f"{base}.{i}", rank=rank, world_size=ws,
                                    timeout=datetime.timedelta(seconds=30))
            out.append(f"{var}={value!r}: init_process_group did not raise")
            dist.destroy_process_group()
        except ValueError as e:
            if var not in str(e):
                out.append(f"{var}={value!r}: ValueError does not name the variable: {e}")
        except Exception as e:
            out.append(f"{var}={value!r}: raised {type(e).__name__} instead of ValueError: {e}")
        finally:
            del os.environ[var]
        if dist.is_initialized():
            out.append(f"{var}={value!r}: a process group is left initialized after the error")
            dist.destroy_process_group()
    # A bad env value is ignored where the Options field is set.
    os.environ["COLLX_TREE_ARITY"] = "0"
    try:
        dist.init_process_group("collx", init_method=f"{base}.opt", rank=rank, world_size=ws,
                                pg_options=torchcollx.Options(tree_arity=2))
        t = torch.ones(3)
        dist.all_reduce(t)
        if not torch.equal(t, torch.full((3,), float(ws))):
            out.append(f"all_reduce with Options(tree_arity=2) over a bad env: {t}")
        # new_group also validates the environment (tree_arity is None here).
        try:
            dist.new_group(backend="collx")
            out.append("new_group under COLLX_TREE_ARITY=0 did not raise")
        except ValueError as e:
            if "COLLX_TREE_ARITY" not in str(e):
                out.append(f"new_group under COLLX_TREE_ARITY=0: ValueError without the name: {e}")
        dist.destroy_process_group()
    except Exception as e:
        out.append(f"init with Options(tree_arity=2) under COLLX_TREE_ARITY=0 raised {type(e).__name__}: {e}")
    finally:
        del os.environ["COLLX_TREE_ARITY"]
    # And a clean init still works in the same processes.
    dist.init_process_group("collx", init_method=f"{base}.good", rank=rank, world_size=ws)
    t = torch.full((5,), float(rank))
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((5,), float(sum(range(ws))))):
        out.append(f"all_reduce after the bad-env attempts: {t}")
    dist.destroy_process_group()
    return out


def test_bad_env_values_raise_value_error_naming_the_variable():
    results = run_ranks(_bad_env, 2, timeout=150, init=False)
    problems = [f"rank {r}: {m}" for r, ms in enumerate(results) for m in ms]
    assert not problems, "\n".join(problems)
