"""collx: a TCP collective backend for torch.distributed.

``import torchcollx`` registers the backend ``"collx"`` for CPU and CUDA
tensors; then ``dist.init_process_group("collx")``.
"""
from __future__ import annotations

import torch.distributed as dist

from . import _C
from .ddp import CommHookState, comm_hook
from .options import ALGORITHMS, Options
from .stats import get_stats, hook_stats

__all__ = ["Options", "ALGORITHMS", "get_stats", "hook_stats", "BACKEND_NAME", "CommHookState", "comm_hook"]

BACKEND_NAME = "collx"


def _create_backend(dist_options, pg_options):
    """Creator called by torch.distributed once per group (extended API)."""
    if pg_options is None:
        pg_options = Options()
    elif not isinstance(pg_options, Options):
        raise TypeError(f"collx: pg_options must be torchcollx.Options, got {type(pg_options).__name__}")
    opts = pg_options.resolved()
    return _C.create_backend(
        dist_options.store,
        dist_options.group_rank,
        dist_options.group_size,
        dist_options.timeout.total_seconds(),
        opts.algorithm,
        opts.tree_arity,
        opts.segment_bytes,
        opts.socket_ifname,
        opts.socket_family,
    )


if BACKEND_NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])
