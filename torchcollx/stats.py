"""Per-group counters of the collx backend, and of the DDP comm hooks on it."""
from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist


class HookCounters:
    """Counters of the collx DDP comm hook: buckets, bytes before and after
    compression, and per algorithm (auto resolved) buckets and bytes."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._buckets = self._bytes_in = self._bytes_reduced = 0
            self._per_algorithm: dict = {}

    def add(self, algorithm: str, bytes_in: int, bytes_reduced: int) -> None:
        with self._lock:
            self._buckets += 1
            self._bytes_in += bytes_in
            self._bytes_reduced += bytes_reduced
            entry = self._per_algorithm.setdefault(algorithm, {"buckets": 0, "bytes": 0})
            entry["buckets"] += 1
            entry["bytes"] += bytes_reduced

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "buckets": self._buckets,
                "bytes_in": self._bytes_in,
                "bytes_reduced": self._bytes_reduced,
                "compression_ratio": (self._bytes_in / self._bytes_reduced) if self._bytes_reduced else 1.0,
                "algorithms": {k: dict(v) for k, v in sorted(self._per_algorithm.items())},
            }


# The hook counters of each process group (cumulative over every CommHookState
# that ran on it, also those whose DDP model is gone), and the live states.
_GROUP_COUNTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_HOOK_STATES: "weakref.WeakSet" = weakref.WeakSet()
_REGISTRY_LOCK = threading.Lock()


def _hook_counters_of(pg, state) -> HookCounters:
    """Registers ``state`` (a CommHookState on ``pg``); returns the group's counters."""
    with _REGISTRY_LOCK:
        _HOOK_STATES.add(state)
        counters = _GROUP_COUNTERS.get(pg)
        if counters is None:
            counters = _GROUP_COUNTERS[pg] = HookCounters()
        return counters


def _group(group):
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("collx: no process group; call dist.init_process_group('collx') first")
    return pg


def backend_of(group=None):
    """The collx backend object behind ``group`` (default: the world group)."""
    pg = _group(group)
    backend = pg._get_backend(torch.device("cpu"))
    from . import _C

    if not isinstance(backend, _C.CollxBackend):
        raise ValueError(f"collx: the group's CPU backend is {type(backend).__name__}, not collx")
    return backend


def hook_stats(group=None) -> dict:
    """The collx DDP comm hook counters of ``group``, over every
    ``CommHookState`` created on it: ``states`` (live ones), ``buckets``,
    ``bytes_in`` (before compression), ``bytes_reduced`` (after),
    ``compression_ratio`` and ``algorithms`` mapping e.g. ``"ring"`` to
    ``{"buckets", "bytes"}`` ("auto" resolved to what ran)."""
    pg = _group(group)
    with _REGISTRY_LOCK:
        counters = _GROUP_COUNTERS.get(pg)
        live = sum(1 for s in _HOOK_STATES if s.process_group is pg)
    out = {"states": live}
    out.update((counters or HookCounters()).snapshot())
    return out


def get_stats(group=None) -> dict:
    """Counters of ``group``: ``ops``; ``bytes_sent`` and ``bytes_received`` to and
    from its peers, split under ``carriers`` by what moved them (``tcp``,
    ``shm_ring``, ``shm_window``, ``peer_memory``, ``cuda_peers``, those that
    moved any); ``algorithms`` mapping e.g. ``"all_reduce/ring"`` to ``{"calls", "seconds"}``,
    and ``ddp_hook``: the counters of the collx DDP comm hook on this group
    (see :func:`hook_stats`; zeros when it never ran)."""
    stats = backend_of(group).stats()
    stats["ddp_hook"] = hook_stats(group)
    return stats
