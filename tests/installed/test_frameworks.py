"""The frameworks that take a backend name, on the installed wheel.

Each example (examples/lightning_ddp.py, ray_train.py, accelerate_ddp.py)
trains with collx and with gloo from the same seed, as a subprocess of the
frameworks venv's interpreter (COLLX_FRAMEWORKS_VENV, made by `make
installed-venvs`) in a temporary folder, with no PYTHONPATH: torch finds
collx through the wheel's entry point. The test asserts that the ranks
trained on collx, loaded from that venv, and ended with exactly gloo's
weights (2 ranks: each all-reduce sum has one addition, so it is exact).

Every run has a hard timeout (installed.run), after which its whole process
tree is SIGKILLed.
"""
from __future__ import annotations

import os
import re
import tempfile
import time

import pytest
import torch

from installed import run, venv as venv_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")

# framework: (example, launcher, hard timeout in seconds per run)
FRAMEWORKS = {
    "lightning": ("lightning_ddp.py", "python", 240),
    "ray_train": ("ray_train.py", "python", 300),
    "accelerate": ("accelerate_ddp.py", "torchrun", 240),
}
PACKAGES = ("torch", "lightning", "ray", "accelerate", "torchcollx")


@pytest.fixture(scope="module")
def venv():
    """The frameworks venv, once it is known to hold the frameworks and the wheel."""
    return venv_path("COLLX_FRAMEWORKS_VENV", PACKAGES)


def _train(venv, framework, backend, tmp):
    script, launcher, limit = FRAMEWORKS[framework]
    out = os.path.join(tmp, f"{framework}_{backend}.pt")
    argv = [os.path.join(EXAMPLES, script), "--backend", backend, "--out", out]
    if launcher == "torchrun":
        argv = [os.path.join(venv, "bin", "torchrun"), "--standalone", "--nproc_per_node=2", *argv]
    else:
        argv = [os.path.join(venv, "bin", "python"), *argv]
    start = time.monotonic()
    p = run(argv, limit, cwd=tmp)
    seconds = time.monotonic() - start
    if p.returncode != 0 or not os.path.exists(out):
        pytest.fail(f"{framework} on {backend} failed (exit {p.returncode}). Output:\n{p.stdout[-6000:]}")
    print(f"{framework} on {backend}: {seconds:.1f} s")
    return torch.load(out)


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_collx_trains_to_gloos_weights(venv, framework):
    with tempfile.TemporaryDirectory(prefix=f"collx_{framework}_") as tmp:
        collx, gloo = (_train(venv, framework, b, tmp) for b in ("collx", "gloo"))
    assert collx["backend"] == "collx" and gloo["backend"] == "gloo", (collx["backend"], gloo["backend"])
    assert os.path.realpath(collx["torchcollx_file"]).startswith(os.path.realpath(venv) + os.sep), \
        f"collx came from {collx['torchcollx_file']}, not from the wheel installed in {venv}"
    assert collx["world_size"] == gloo["world_size"] == 2
    assert collx["steps"] == gloo["steps"] > 0
    assert collx["replicas_agree"] and gloo["replicas_agree"], "the ranks ended with different weights"
    assert collx["state_dict"].keys() == gloo["state_dict"].keys()
    differ = [k for k, v in collx["state_dict"].items() if not torch.equal(v, gloo["state_dict"][k])]
    assert not differ, f"{framework}: collx's final weights differ from gloo's in {differ}"


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_example_never_imports_torchcollx(framework):
    with open(os.path.join(EXAMPLES, FRAMEWORKS[framework][0])) as f:
        assert not re.search(r"^\s*(import|from)\s+torchcollx\b", f.read(), re.M)
