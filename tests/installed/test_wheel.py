"""The wheel as users install it: `pip install torch dist/torchcollx-*.whl` in
a venv that holds nothing else, then `init_process_group("collx")` with no
import (torch finds the backend through the package's entry point). Also the
wheel's metadata, a torch it was not built for, an unknown backend name, and
TORCH_DEVICE_BACKEND_AUTOLOAD=0.
"""
from __future__ import annotations

import glob
import json
import os
import tempfile
import zipfile

from installed import clean_env, run, venv

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def _python(code, timeout=120, **env):
    v = venv("COLLX_WHEEL_VENV")
    return run([os.path.join(v, "bin", "python"), "-c", code], timeout, env=clean_env(**env))


def _installed():
    """(version, torch version) of the package installed in the wheel venv."""
    p = _python("import importlib.metadata as m, torch; print(m.version('torchcollx'), torch.__version__)")
    assert p.returncode == 0, p.stdout
    return p.stdout.split()[-2:]


def test_the_venv_holds_only_torch_and_the_wheel():
    code = """
import importlib.metadata as m
from pip._vendor.packaging.requirements import Requirement
def key(name): return name.lower().replace('_', '-')
names = {key(d.metadata['Name']) for d in m.distributions()}
need, seen = [('torch', ''), ('torchcollx', '')], set()
while need:  # the requirements' closure, with the extras they ask for
    n, extra = need.pop()
    if (n, extra) in seen: continue
    seen.add((n, extra))
    try:
        requires = m.requires(n) or []
    except m.PackageNotFoundError:  # not for this platform
        continue
    for text in requires:
        r = Requirement(text)
        if r.marker is None or r.marker.evaluate({'extra': extra}):
            need += [(key(r.name), e) for e in [''] + sorted(r.extras)]
print(sorted(names - {n for n, _ in seen} - {'pip', 'setuptools', 'wheel'}))
print(m.requires('torchcollx'))
"""
    p = _python(code)
    assert p.returncode == 0, p.stdout
    extra, requires = p.stdout.strip().splitlines()[-2:]
    assert extra == "[]", f"the wheel venv holds more than torch and torchcollx: {extra}"
    version, torch_version = _installed()
    assert requires == f"['torch=={torch_version.split('+')[0]}']", requires


def test_wheel_metadata_names_its_torch_and_the_entry_point():
    wheels = glob.glob(os.path.join(ROOT, "dist", "torchcollx-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in dist/, found {wheels}: run `make wheel`"
    version, torch_version = _installed()
    release, variant = torch_version.split("+")
    assert version.endswith(f"+torch{release}.{variant}"), version
    assert os.path.basename(wheels[0]).startswith(f"torchcollx-{version}-"), (wheels[0], version)
    with zipfile.ZipFile(wheels[0]) as z:
        info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = z.read(info).decode()
        entry_points = z.read(info.replace("METADATA", "entry_points.txt")).decode()
        assert not any(n.startswith(("tests/", "csrc/")) for n in z.namelist())
    assert f"Requires-Dist: torch=={release}\n" in metadata, metadata
    assert "[torch.distributed.backends]\ncollx = torchcollx:register" in entry_points, entry_points
    assert "[torch.backends]" not in entry_points, "collx must not load into every torch process (device autoload)"


def test_two_ranks_without_import_match_gloo():
    v = venv("COLLX_WHEEL_VENV")
    out = tempfile.mkdtemp(prefix="collx_wheel_")
    # collx is no device backend: device autoload off changes nothing.
    p = run([os.path.join(v, "bin", "torchrun"), "--nproc_per_node=2", "--master-port=29641",
             os.path.join(HERE, "wheel_script.py"), out], 300, env=clean_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert p.returncode == 0, p.stdout[-6000:]
    for rank in (0, 1):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            r = json.load(f)
        assert r["imported_before_init"] is False
        assert r["backend"] == "collx" and r["subgroup_backend"] == "collx", r
        assert r["torchcollx_file"].startswith(v), f"torchcollx loaded from {r['torchcollx_file']}, not the venv"
        assert r["differ"] == [], f"rank {rank}: " + "\n".join(r["differ"])


def test_a_torch_it_was_not_built_for_is_a_clear_error():
    # As if this torch were another release: the import, and the entry point
    # that init_process_group loads, say both versions and how to rebuild.
    version, torch_version = _installed()
    code = """
import torch, torch.distributed as dist
torch.__version__ = '2.13.0+cpu'
try:
    dist.init_process_group('collx', init_method='tcp://127.0.0.1:29643', rank=0, world_size=1)
except Exception as e:
    cause = e.__cause__
    print(type(e).__name__, '|', type(cause).__name__, '|', cause)
"""
    p = _python(code)
    assert p.returncode == 0, p.stdout
    line = p.stdout.strip().splitlines()[-1]
    assert line.startswith("RuntimeError | ImportError | "), line
    assert f"built against torch {torch_version}" in line and "runs torch 2.13.0+cpu" in line, line
    assert "make wheel" in line and "pip install --no-build-isolation" in line, line


def test_an_unknown_backend_name_keeps_torchs_error():
    code = """
import torch.distributed as dist
try:
    dist.init_process_group('collxx', init_method='tcp://127.0.0.1:29644', rank=0, world_size=1)
except Exception as e:
    print(type(e).__name__, '|', e)
"""
    p = _python(code)
    assert p.returncode == 0, p.stdout
    assert p.stdout.strip().splitlines()[-1] == "AssertionError | Unknown backend type collxx", p.stdout
