"""pytest setup of the collx Python tests.

The tests launch real multi-process groups through tests/launcher.py; every
launch has a hard timeout. Each test module starts with
``pytest.importorskip("torchcollx")``, so a missing or broken build (e.g. an
undefined symbol in torchcollx._C) skips the modules with the import error as
the reason instead of failing in every child process.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "ddp: DistributedDataParallel end-to-end tests (multi-process)")


def pytest_report_header(config):
    try:
        import torch

        import torchcollx

        return f"torch {torch.__version__}, torchcollx from {os.path.dirname(torchcollx.__file__)}"
    except Exception as e:
        return f"torchcollx cannot be imported: {type(e).__name__}: {e}"
