"""torchft's reconfigurable process group over collx.

    from torchcollx.torchft import ProcessGroupCollx
    manager = torchft.Manager(pg=ProcessGroupCollx(timeout=timedelta(seconds=10)), ...)

torchft re-forms the group on every quorum change (``configure``), and a
replica that leaves only shuts its group down: the others' ops that need it
fail with "peer r closed its group" (or "Connection closed by peer r"), and
the ops among the rest go on until torchft configures the next group.
Importing this module imports torchft.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _DistributedBackendOptions
from torchft.process_group import ProcessGroupWrapper

from . import _create_backend


class ProcessGroupCollx(ProcessGroupWrapper):
    """A torchft ProcessGroup whose every configuration is a collx group,
    serving CPU and CUDA tensors (as torchft's ProcessGroupGloo does)."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60), options=None) -> None:
        super().__init__(timeout=timeout)
        self._collx_options = options  # torchcollx.Options, or None for the defaults

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        opts = _DistributedBackendOptions()
        opts.store = store
        opts.group_rank = rank
        opts.group_size = world_size
        opts.timeout = self._timeout
        opts.global_ranks_in_group = list(self._global_ranks or range(world_size))
        backend = _create_backend(opts, self._collx_options)
        pg = dist.ProcessGroup(store, rank, world_size)
        custom = dist.ProcessGroup.BackendType.CUSTOM
        pg._set_default_backend(custom)
        for device in ("cpu", "cuda"):
            pg._register_backend(torch.device(device), custom, backend)
        return pg

    def getBackendName(self) -> str:
        return "torchft-collx"
