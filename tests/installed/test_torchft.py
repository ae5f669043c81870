"""torchft's process-group tests on collx (torchft_suite.py), in the
frameworks venv with the installed wheel: all 23 must pass, three runs in a
row (the resiliency cases race a member's shutdown against its peers' setup)."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from installed import run, venv

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("round", [1, 2, 3])
def test_torchft_process_group_tests_pass_on_collx(round):
    python = os.path.join(venv("COLLX_FRAMEWORKS_VENV"), "bin", "python")
    cwd = tempfile.mkdtemp(prefix="collx_torchft_")  # no conftest or source tree of ours above it
    shutil.copy(os.path.join(HERE, "torchft_suite.py"), cwd)
    p = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "torchft_suite.py"], 600, cwd=cwd)
    tail = p.stdout[-6000:]
    assert p.returncode == 0, tail
    assert "23 passed" in p.stdout, tail
