"""Per-group counters of the collx backend."""
from __future__ import annotations

import torch
import torch.distributed as dist


def backend_of(group=None):
    """The collx backend object behind ``group`` (default: the world group)."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("collx: no process group; call dist.init_process_group('collx') first")
    backend = pg._get_backend(torch.device("cpu"))
    from . import _C

    if not isinstance(backend, _C.CollxBackend):
        raise ValueError(f"collx: the group's CPU backend is {type(backend).__name__}, not collx")
    return backend


def get_stats(group=None) -> dict:
    """Counters of ``group``: ``ops``, ``bytes_sent``, ``bytes_received`` and
    ``algorithms`` mapping e.g. ``"all_reduce/ring"`` to ``{"calls", "seconds"}``."""
    return backend_of(group).stats()
