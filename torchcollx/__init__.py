"""collx: a TCP collective backend for torch.distributed.

``dist.init_process_group("collx")`` finds it through the entry point
``torch.distributed.backends`` of the installed package, which calls
``register``; ``import torchcollx`` registers it too. Either way the backend
``"collx"`` serves CPU and CUDA tensors.
"""
from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

from ._build import TORCH_VERSION as _BUILT_FOR, VERSION as __version__


def _check_torch():
    """The extension is tied to the torch it was built against (vtables and
    symbols differ between releases and between CPU and CUDA builds), so a
    mismatch is an error that says what to do, not an undefined symbol."""
    if torch.__version__ != _BUILT_FOR:
        raise ImportError(
            f"torchcollx {__version__} was built against torch {_BUILT_FOR}, but this process runs torch "
            f"{torch.__version__}. Install the torchcollx wheel built for torch {torch.__version__}, or rebuild "
            f"it against this torch: `pip install --no-build-isolation .` (or `make wheel`) in the torchcollx "
            f"source tree, with this torch installed.")


_check_torch()

from . import _C, fr  # noqa: E402
from .ddp import CommHookState, comm_hook
from .options import ALGORITHMS, Options
from .stats import get_stats, hook_stats

__all__ = ["register", "Options", "ALGORITHMS", "get_stats", "hook_stats", "BACKEND_NAME", "CommHookState", "comm_hook"]

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
        opts.transport,
        # enable_reconfigure=True: no members until dist.distributed_c10d._reconfigure.
        not getattr(dist_options, "enable_reconfigure", False),
        list(getattr(dist_options, "global_ranks_in_group", None) or []),
    )


class _SplitOptions(_C10dBackend.Options):
    """``backend.options``: what ``dist.split_group`` of torch <= 2.11 deep-copies
    from the parent's backend and hands to ``split()``, which reads only its
    timeout. torch's own ``Backend.Options`` cannot be deep-copied."""

    def __deepcopy__(self, memo):
        return _SplitOptions(self.backend, self._timeout)


_C.CollxBackend.options = property(
    lambda b: _SplitOptions(BACKEND_NAME, datetime.timedelta(seconds=b.timeout_seconds)),
    doc="The group's c10d options (backend name and timeout), deep-copyable.")


def _perform_nocolor_split(backend, device):
    """What torch calls on each non-member of a new group when the default
    group is bound to a device (device_id=): NCCL's split is collective over the
    parent group. A collx subgroup meets among its members through the store,
    so a non-member has nothing to do."""


_C.CollxBackend.perform_nocolor_split = _perform_nocolor_split


def _serving_every_device(create):
    """torch's shrink_group registers the new backend for one device only (the
    group's bound device, else the CPU), as NCCL serves one. A shrunk collx
    group serves CPU and CUDA tensors, as its parent and every collx group do."""

    @functools.wraps(create)
    def create_shrunk(new_backend, *args, **kwargs):
        pg = create(new_backend, *args, **kwargs)
        if isinstance(new_backend, _C.CollxBackend):
            custom = dist.ProcessGroup.BackendType.CUSTOM
            for device in ("cpu", "cuda"):
                pg._register_backend(torch.device(device), custom, new_backend)
            pg._set_default_backend(custom)
        return pg

    return create_shrunk


if hasattr(dist.distributed_c10d, "_create_shrunk_process_group"):
    dist.distributed_c10d._create_shrunk_process_group = _serving_every_device(
        dist.distributed_c10d._create_shrunk_process_group)

fr.install()


def register():
    """Registers the backend "collx" for CPU and CUDA tensors, once per process.
    torch.distributed calls it through the package's entry point the first
    time a group names "collx"; the import calls it too."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])


register()
