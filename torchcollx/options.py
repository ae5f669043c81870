"""Options of a collx process group, with COLLX_* environment overrides."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

ALGORITHMS = ("auto", "ring", "tree", "star", "direct", "hier", "shm")
TRANSPORTS = ("auto", "tcp", "shm")

_DEFAULTS = {"algorithm": "auto", "tree_arity": 2, "segment_bytes": 512 * 1024, "socket_ifname": "",
             "socket_family": "", "transport": "auto"}
SOCKET_FAMILIES = ("AF_INET", "AF_INET6")


@dataclass
class Options:
    """Pass as ``pg_options`` to ``init_process_group`` / ``new_group``.

    A field left as ``None`` takes its ``COLLX_*`` environment variable, or
    else the default: ``algorithm="auto"``, ``tree_arity=2``,
    ``segment_bytes=512 KiB``, ``socket_ifname=""`` (the hostname's address),
    ``socket_family=""`` (either; ``"AF_INET"`` or ``"AF_INET6"`` restricts the
    address collx listens on, like ``NCCL_SOCKET_FAMILY``),
    ``transport="auto"`` (ranks on one host exchange through shared memory
    where they can, the others through TCP; ``"tcp"`` never uses shared
    memory, ``"shm"`` requires it between ranks on one host).
    """

    algorithm: Optional[str] = None
    tree_arity: Optional[int] = None
    segment_bytes: Optional[int] = None
    socket_ifname: Optional[str] = None
    socket_family: Optional[str] = None
    transport: Optional[str] = None

    def resolved(self) -> "Options":
        """Fills every field from env or default, validating each value."""
        return Options(
            algorithm=_choice(self.algorithm, "algorithm", ALGORITHMS),
            tree_arity=_positive_int(self.tree_arity, "tree_arity", minimum=1),
            segment_bytes=_positive_int(self.segment_bytes, "segment_bytes", minimum=64),
            socket_ifname=_ifname(self.socket_ifname),
            socket_family=_family(self.socket_family),
            transport=_choice(self.transport, "transport", TRANSPORTS),
        )


def _env(field: str) -> tuple[Optional[str], str]:
    var = "COLLX_" + field.upper()
    return os.environ.get(var), var


def _choice(value, field, choices):
    source = f"Options.{field}"
    if value is None:
        value, source = _env(field)
        if value is None:
            return _DEFAULTS[field]
    if value not in choices:
        raise ValueError(f"collx: {source}={value!r} is not one of {', '.join(choices)}")
    return value


def _positive_int(value, field, minimum):
    source = f"Options.{field}"
    if value is None:
        value, source = _env(field)
        if value is None:
            return _DEFAULTS[field]
    try:
        number = int(value)
        if isinstance(value, float) or number < minimum:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"collx: {source}={value!r} must be an integer >= {minimum}") from None
    return number


def _ifname(value):
    if value is None:
        value, _ = _env("socket_ifname")
    return value or ""


def _family(value):
    source = "Options.socket_family"
    if value is None:
        value, source = _env("socket_family")
        if value is None:
            return _DEFAULTS["socket_family"]
    if value not in ("",) + SOCKET_FAMILIES:
        raise ValueError(f"collx: {source}={value!r} is not one of {', '.join(SOCKET_FAMILIES)}")
    return value
