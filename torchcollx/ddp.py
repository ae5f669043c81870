"""The collx communication hook for ``DistributedDataParallel``.

    from torchcollx.ddp import CommHookState, comm_hook
    model = DDP(model)                      # its process group: collx
    model.register_comm_hook(CommHookState(process_group=None, algorithm="auto",
                                           compression=None), comm_hook)

Per bucket, the hook all-reduces DDP's flat gradient buffer with an algorithm
chosen for that call (``allreduce_with``), not through the group-wide
``Options.algorithm`` / ``COLLX_ALGORITHM``:

* ``algorithm="auto"`` lets the group's cost model (``csrc/core/algorithms/
  tuning.cc``, fitted to the group's links: ``COLLX_TUNING``; the group
  backend's ``choose_allreduce`` tells its choice) pick the algorithm for
  the bytes that bucket puts on the wire, so DDP's small first bucket (1 MiB),
  its 25 MiB buckets and a tiny last one may travel differently;
  ``"ring"``, ``"tree"``, ``"star"``, ``"direct"`` or ``"hier"`` force one. A
  group that spans hosts, with several ranks on some host, takes ``"hier"``.
* ``compression="bf16"`` or ``"fp16"`` casts a float32 bucket into one cached
  16-bit buffer with the fused ``_C.cast_scale`` kernel, pre-scaled by
  1/world_size (so fp16 sums cannot overflow), SUM-all-reduces it, and casts
  it back into the bucket inside the future's callback. The bucket buffer is
  written in place and is the future's value.
* ``compression=None`` divides the bucket by world_size and SUM-all-reduces it
  in place (DDP's own order of operations).

Which gradients are compressed: float32 buckets are. A bucket that already is
float16/bfloat16 (a half-precision model) travels in its own dtype, pre-divided
by world_size like the uncompressed path. A float64 bucket with compression raises a
``TypeError``: casting it to 16 bits would silently throw away the precision
the model asked for, and silently not compressing would hide that the option
does nothing; use ``compression=None`` for float64 models.

CUDA buckets (or their 16-bit casts, made on the GPU) go to the backend as
they are, and the backend stages them (its pipelined copies); the future is
the backend's CUDA-aware one. A copy of the hook's own, through a pinned
buffer per bucket, was measured against this on an H100 and was no faster
(0.90-1.07x, 2 and 4 ranks, 1 and 25 MB buckets), so it is gone.

Every problem with the state (a group that is not collx, an unknown algorithm
or compression, no process group) raises in ``CommHookState(...)``, i.e.
before ``register_comm_hook``, not at the first backward pass.

One ``CommHookState`` per DDP model: it caches one compressed buffer per bucket
index, which a second model running its backward at the same time would share.
"""
# No ``from __future__ import annotations``: DDP compares comm_hook's
# annotations with dist.GradBucket and torch.futures.Future[torch.Tensor]
# objects, and would reject strings.
import time
from typing import Optional

import torch
import torch.distributed as dist

from . import _C
from .options import ALGORITHMS
from .stats import HookCounters, _hook_counters_of, backend_of

__all__ = ["CommHookState", "comm_hook", "COMPRESSIONS"]

COMPRESSIONS = (None, "fp16", "bf16", "auto")
_WIRE_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
_HALF_DTYPES = (torch.float16, torch.bfloat16)

def _resolve_group(process_group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "collx comm hook: torch.distributed is not initialized; call "
            "dist.init_process_group('collx') before creating CommHookState")
    pg = dist.group.WORLD if process_group is None else process_group
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("collx comm hook: this rank is not a member of the given process group")
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"collx comm hook: process_group must be a torch.distributed ProcessGroup "
                        f"or None (the default group), got {type(pg).__name__}")
    try:
        backend = backend_of(pg)
    except (ValueError, RuntimeError) as e:
        try:
            name = dist.get_backend(pg)
        except Exception:  # noqa: BLE001  only for the message
            name = "unknown"
        raise ValueError(
            f"collx comm hook: the process group's backend is {name!r}, not 'collx' ({e}). Create "
            f"the group with backend='collx' (dist.init_process_group('collx') or "
            f"dist.new_group(backend='collx')) and pass it, or None for the default group") from None
    return pg, backend


class CommHookState:
    """State of :func:`comm_hook`: the collx group, the algorithm, the
    compression, the cached compressed buffers and the statistics.

    Args:
        process_group: a collx process group, or ``None`` for the default group
            (resolved now). Use the same group as the DDP model.
        algorithm: ``"auto"`` (per bucket, by size and host layout), or ``"ring"``, ``"tree"``,
            ``"star"``, ``"direct"``, ``"hier"`` (any of ``torchcollx.ALGORITHMS``).
        compression: ``None``, ``"bf16"`` or ``"fp16"`` (float32 gradients only; see the module doc),
            or ``"auto"``: bf16 for the float32 buckets where the group's fitted model
            (``COLLX_TUNING``) says the wire time saved exceeds the two casts' time,
            which is measured here, on every rank (a collective on the group).

    Raises ``ValueError`` / ``TypeError`` / ``RuntimeError`` here, at construction,
    for anything the hook could not run with.
    """

    def __init__(self, process_group=None, algorithm: str = "auto", compression: Optional[str] = None):
        if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
            raise ValueError(f"collx comm hook: algorithm={algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        if compression is not None and (not isinstance(compression, str) or compression not in COMPRESSIONS):
            raise ValueError(f"collx comm hook: compression={compression!r} is not one of None, "
                             f"{', '.join(repr(c) for c in COMPRESSIONS if c)}")
        self.process_group, self.backend = _resolve_group(process_group)
        self.algorithm = algorithm
        self.compression = compression
        self.world_size = self.process_group.size()
        self.rank = self.process_group.rank()
        self._wire_dtype = _WIRE_DTYPE.get(compression)
        self._buffers = {}  # (bucket index, role) -> tensor, reused while its size/dtype/device fit
        self._cast_us_per_byte = _agreed_cast_costs(self.process_group) if compression == "auto" else {}
        self._compress = {}  # compression="auto": (device type, bytes) -> bf16 or None
        self._counters = HookCounters()
        self._group_counters = _hook_counters_of(self.process_group, self)  # for get_stats()

    def __repr__(self):
        return (f"CommHookState(world_size={self.world_size}, algorithm={self.algorithm!r}, "
                f"compression={self.compression!r})")

    # ------------------------------------------------------------ statistics

    def stats(self) -> dict:
        """``buckets`` handled, ``bytes_in`` (gradient bytes, before compression),
        ``bytes_reduced`` (bytes all-reduced, after compression),
        ``compression_ratio`` and ``algorithms``: ``{"ring": {"buckets", "bytes"}, ...}``
        (``bytes`` after compression), with "auto" resolved to what ran.
        ``torchcollx.get_stats(group)["ddp_hook"]`` sums these over the group."""
        out = {"algorithm": self.algorithm, "compression": self.compression}
        out.update(self._counters.snapshot())
        return out

    def reset_stats(self) -> None:
        """Zeroes this state's counters (not the group's in get_stats())."""
        self._counters.reset()

    def _record(self, bytes_in: int, bytes_reduced: int) -> None:
        algo = self.algorithm
        if algo == "auto":  # the backend's own choice (host layout, then tuning.cc): what "auto" runs
            algo = self.backend.choose_allreduce(bytes_reduced)
        self._counters.add(algo, bytes_in, bytes_reduced)
        self._group_counters.add(algo, bytes_in, bytes_reduced)

    # ------------------------------------------------------------ buffers

    def _buffer(self, index: int, role: str, like: torch.Tensor, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        key = (index, role)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != like.numel() or buf.dtype != dtype or buf.device != device:
            self._buffers.pop(key, None)  # free the old one before allocating its replacement
            buf = torch.empty(like.numel(), dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf


def _value_of_first(fut):
    return fut.value()[0]


def comm_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages ``bucket`` over ``state.process_group``
    with ``state.algorithm`` and ``state.compression``. Returns a Future whose
    value is the bucket buffer itself, averaged in place."""
    if not isinstance(state, CommHookState):
        raise TypeError(f"collx comm_hook needs a torchcollx.ddp.CommHookState as its state, "
                        f"got {type(state).__name__}")
    buf = bucket.buffer()
    if buf.device.type not in ("cpu", "cuda"):
        raise TypeError(f"collx comm_hook: gradients on {buf.device} are not supported (CPU and CUDA are)")
    return _reduce_in_place(state, bucket, buf)


def _reduce_in_place(state, bucket, buf):
    """Hands the bucket (or its 16-bit cast, made on its device) to the
    backend, which stages CUDA tensors itself."""
    world = state.world_size
    wire = _wire_dtype(state, bucket, buf)

    if wire is None:  # uncompressed
        state._record(buf.nbytes, buf.nbytes)
        # Divide before the sum, as DDP's default does: 16-bit sums cannot
        # overflow, and torch's div_ is faster than the backend's AVG pass.
        buf.div_(world)
        work = state.backend.allreduce_with(buf, state.algorithm, False)
        return work.get_future().then(_value_of_first)

    comp = state._buffer(bucket.index(), "wire", buf, wire, buf.device)
    state._record(buf.nbytes, comp.nbytes)
    _cast_scale(comp, buf, 1.0 / world)
    work = state.backend.allreduce_with(comp, state.algorithm, False)

    def decompress(fut):
        fut.value()  # re-raises the all-reduce's error
        _cast_scale(buf, comp, 1.0)
        return buf

    return work.get_future().then(decompress)


def _cast_us_per_byte(device: torch.device) -> float:
    """Microseconds per float32 byte of the casts compression adds: to bf16
    before the all-reduce and back after (best of 5, on 1 MiB)."""
    src = torch.randn(1 << 18, device=device)
    mid = torch.empty(1 << 18, dtype=torch.bfloat16, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for rep in range(7):
        sync()
        t0 = time.perf_counter()
        _cast_scale(mid, src, 1.0)
        _cast_scale(src, mid, 1.0)
        sync()
        if rep >= 2:  # after two warm-ups
            best = min(best, time.perf_counter() - t0)
    return best * 1e6 / src.nbytes


def _agreed_cast_costs(group) -> dict:
    """The cast cost on CPU (and on the current GPU, if any), the slowest
    rank's: every rank must make the same compression choice."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    costs = torch.tensor([_cast_us_per_byte(d) for d in devices], dtype=torch.float64)
    dist.all_reduce(costs, op=dist.ReduceOp.MAX, group=group)
    return {d.type: c for d, c in zip(devices, costs.tolist())}


def _auto_wire_dtype(state, buf):
    """compression="auto": bf16 when the model's wire time saved by halving
    the bucket exceeds the casts' measured time. Both are the same on every
    rank (the fitted model and the agreed cast cost), so the ranks agree."""
    key = (buf.device.type, buf.nbytes)
    if key not in state._compress:
        predict = state.backend.predict_allreduce_us
        saved = predict(buf.nbytes, state.algorithm) - predict(buf.nbytes // 2, state.algorithm)
        cost = state._cast_us_per_byte.get(buf.device.type, float("inf")) * buf.nbytes
        state._compress[key] = torch.bfloat16 if saved > cost else None
    return state._compress[key]


def _wire_dtype(state, bucket, buf):
    """The dtype that goes over the wire, or None to reduce ``buf`` itself."""
    if state.compression == "auto":
        return _auto_wire_dtype(state, buf) if buf.dtype == torch.float32 else None
    if state._wire_dtype is None or buf.dtype in _HALF_DTYPES:
        return None
    if buf.dtype != torch.float32:
        raise TypeError(
            f"collx comm_hook: compression={state.compression!r} needs float32 gradients, but bucket "
            f"{bucket.index()} is {buf.dtype}; use compression=None for this model")
    return state._wire_dtype


def _cast_scale(dst, src, factor):
    if _C.cuda_kernels or not src.is_cuda:
        _C.cast_scale(dst, src, factor)
    else:  # an extension built without its CUDA kernels: one fused torch kernel instead
        torch.mul(src, factor, out=dst)
