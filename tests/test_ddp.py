"""END-TO-END DDP TESTS (marker: ddp).

Plain ``DistributedDataParallel(model)`` (no comm hook) over collx: after a
few SGD steps, where each rank trains on its shard of a fixed global batch,
the parameters must equal single-process training on the whole batch (same
initial weights, same optimizer) within 1e-6. Models are float64 so that the
comparison is robust (differences are ~1e-15 when everything is right). The
models, data and training loop are the hook tests' (ddp_hook_common.py).

The non-zero ranks deliberately start from DIFFERENT random weights: DDP's
initial broadcast from rank 0 must fix that, so a broken broadcast fails too.
One launch per world size runs every model / variant (startup is expensive).
"""
from __future__ import annotations

import pytest

torchcollx = pytest.importorskip("torchcollx")

from common import suite_test  # noqa: E402
from ddp_hook_common import _exact  # noqa: E402  (models, data, training: shared with the hook tests)

pytestmark = pytest.mark.ddp


def check_mlp(rank, ws, fail):
    _exact(rank, ws, fail, "mlp", "mlp")


def check_mlp_small_buckets_momentum(rank, ws, fail):
    """Many buckets (so many all_reduces in flight at once) and momentum."""
    _exact(rank, ws, fail, "mlp", "mlp, bucket_cap_mb=0.002, momentum", momentum=0.9, bucket_cap_mb=0.002)


def check_mlp_gradient_as_bucket_view_no_sync(rank, ws, fail):
    _exact(rank, ws, fail, "mlp", "mlp, no_sync micro-batches, gradient_as_bucket_view", no_sync_micro=True,
           gradient_as_bucket_view=True)


def check_conv_bn(rank, ws, fail):
    """BatchNorm's buffers are broadcast from rank 0 before every forward."""
    _exact(rank, ws, fail, "conv_bn", "conv + BatchNorm")


def check_ddp_used_collx(rank, ws, fail):
    stats = torchcollx.get_stats()
    labels = stats["algorithms"]
    if not any(k.startswith("all_reduce/") for k in labels) or not any(k.startswith("broadcast/") for k in labels):
        fail(f"DDP did not run all_reduce and broadcast on the collx world group: {labels}")
    if stats["bytes_sent"] <= 0:
        fail(f"no bytes sent: {stats}")


DDP_CHECKS = [
    check_mlp,
    check_mlp_small_buckets_momentum,
    check_mlp_gradient_as_bucket_view_no_sync,
    check_conv_bn,
    check_ddp_used_collx,  # last: reads the counters of the checks above
]


test_ddp_matches_single_process = suite_test(__name__, "DDP_CHECKS", [2, 4], timeout=300)
