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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "ddp: DistributedDataParallel end-to-end tests (multi-process)")
    config.addinivalue_line("markers", "gpu_alone: fills the GPU, so no other test may share it meanwhile")
    config._collx_cache = tempfile.mkdtemp(prefix="collx_test_cache_")
    os.environ["XDG_CACHE_HOME"] = config._collx_cache


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_collx_cache", ""), ignore_errors=True)


def pytest_report_header(config):
    try:
        import torch

        import torchcollx

        return f"torch {torch.__version__}, torchcollx from {os.path.dirname(torchcollx.__file__)}"
    except Exception as e:
        return f"torchcollx cannot be imported: {type(e).__name__}: {e}"
