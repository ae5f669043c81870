"""pytest setup of the collx Python tests.

The tests launch real multi-process groups through tests/launcher.py; every
launch has a hard timeout. Each test module starts with
``pytest.importorskip("torchcollx")``, so a missing or broken build (e.g. an
undefined symbol in torchcollx._C) skips the modules with the import error as
the reason instead of failing in every child process.

The ranks calibrate auto's cost model (COLLX_TUNING=calibrate) on a machine
busy with the tests, so their tunings go to a cache folder of the session's,
not the user's (~/.cache/torchcollx), where they would mislead later runs.
"""
import os
import shutil
import sys
import tempfile
import time

import pytest
from _pytest.runner import runtestprotocol

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine_stalls import StallWatch  # noqa: E402


# make check's tier (pytest -m quick): one multi-process case per feature, for
# a loop of about 2 minutes while editing. A suite's case runs the whole
# suite's launch (common.Suite), so each of those stands for its suite.
QUICK = {
    "test_allreduce.py::test_allreduce_large_float32[ws3-auto]",
    "test_allreduce_misc.py::test_allreduce_misc[ws3-check_async]",
    "test_collectives.py::test_collective[ws2-check_broadcast]",
    "test_gather_ops.py::test_collective[ws2-check_all_to_all]",
    "test_reduce_ops.py::test_collective[ws2-check_reduce_scatter]",
    "test_p2p.py::test_collective[ws2-check_send_recv]",
    "test_sparse.py::test_sparse[ws2-check_sparse_all_reduce]",
    "test_ddp.py::test_ddp_matches_single_process[ws2-check_mlp]",
    "test_ddp_hook.py::test_ddp_comm_hook[ws2-check_hook_mlp_each_algorithm]",
    "test_groups.py::test_split_group",
    "test_shm.py::test_auto_puts_local_peers_on_shared_memory[ws2]",
    "test_transports.py::test_collectives_over_tcp[ws3-check_broadcast]",
    "test_staging.py::test_mixed_ranks_stage_in_the_same_pieces[peers-default]",
    "test_bad_input.py::test_one_rank_bad_input_others_fail_fast[ws3]",
    "test_faults.py::test_dead_peer_fails_every_survivor_fast[ws3-during-shm-all_reduce-16777216]",
    "test_fault_tolerance.py::test_abort_fails_everything_in_flight_at_once[ws3-shm]",
    "test_fault_tolerance.py::test_shrink_after_a_rank_dies[ws3v1-shm]",
    "test_reconfigure.py::test_reconfigure_grow_shrink_and_reject[shm]",
    "test_lifecycle.py::test_destroy_and_reinit_several_times",
    "test_observability.py::test_flight_recorder_lists_collx_ops_with_their_states[ws2]",
    "test_options.py::test_options_resolve_in_process",
    "test_tuning.py::test_table",
    "test_launcher.py::test_returns_values_by_rank",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "ddp: DistributedDataParallel end-to-end tests (multi-process)")
    config.addinivalue_line("markers", "quick: make check's tier (QUICK in tests/conftest.py)")
    config.addinivalue_line("markers", "gpu_alone: fills the GPU, so no other test may share it meanwhile")
    config._collx_cache = tempfile.mkdtemp(prefix="collx_test_cache_")
    os.environ["XDG_CACHE_HOME"] = config._collx_cache
    config._collx_stalls = StallWatch()
    config._collx_reruns = []


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_collx_cache", ""), ignore_errors=True)
    if hasattr(config, "_collx_stalls"):
        config._collx_stalls.close()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that failed while the whole machine stood still
    (machine_stalls.py) runs once more, and its second run is the one
    reported; the stall and the first failure go to the summary. A failure
    with no stall, or a second one, is reported as it is."""
    config = item.config
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    start = time.monotonic()
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    if any(r.failed for r in reports):
        stalls = config._collx_stalls.during(start, time.monotonic())
        if stalls:
            first = next(r for r in reports if r.failed)
            crash = getattr(first.longrepr, "reprcrash", None)
            why = (crash.message if crash else first.longreprtext).splitlines()[0]
            config._collx_reruns.append((item.nodeid, stalls, why))
            reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_terminal_summary(terminalreporter, config):
    for nodeid, stalls, why in getattr(config, "_collx_reruns", []):
        gaps = ", ".join(f"{b - a:.1f} s" for a, b in stalls)
        terminalreporter.write_line(f"RERUN {nodeid}: the machine stopped for {gaps} during its first run, "
                                    f"which failed: {why}")


def pytest_report_header(config):
    try:
        import torch

        import torchcollx

        return f"torch {torch.__version__}, torchcollx from {os.path.dirname(torchcollx.__file__)}"
    except Exception as e:
        return f"torchcollx cannot be imported: {type(e).__name__}: {e}"


def pytest_collection_modifyitems(config, items):
    found = set()
    for item in items:
        name = item.nodeid.rsplit("/", 1)[-1]
        if name in QUICK:
            item.add_marker(pytest.mark.quick)
            found.add(name)
    if config.option.markexpr == "quick" and found != QUICK:  # a renamed test must not drop out silently
        raise pytest.UsageError(f"QUICK names tests that do not exist: {sorted(QUICK - found)}")
