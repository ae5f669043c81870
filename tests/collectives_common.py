"""Helpers shared by several collective test files (each name here is used by
more than one of them):

* the sizes and the data of the per-collective checks of test_reduce_ops.py,
  test_gather_ops.py, test_p2p.py, test_groups.py and test_mismatch.py
  (test_collectives.py and test_lifecycle.py use _data too);
* the per-algorithm collx groups of test_allreduce.py and test_allreduce_misc.py.

Import it after ``pytest.importorskip("torchcollx")``.
"""
from __future__ import annotations

import torch.distributed as dist
import torchcollx

from common import ALGORITHMS, expected, gen

# Sizes of the per-collective checks (test_allreduce*.py and test_collectives.py have their own).
WORLD_SIZES = [2, 3, 4]
COUNTS = [0, 1, 7, 1000]
LARGE = 1 << 20 | 1          # float32 only: ~4 MB, not divisible by 2, 3 or 4
RING_BLOCK = 100003          # float32 elements per rank: > 256 KiB, so all-gather takes the ring (n > 2)
MIB4 = 1 << 20               # float32 elements in 4 MiB


def _data(rank, dtype, count, salt=0):
    """Any-valued deterministic data of ``rank`` (MIN data: random, exact)."""
    return gen(rank, dtype, "MIN", count, salt)


def _rs_expected(ws, rank, dtype, op, block, salt):
    return expected(ws, dtype, op, ws * block, salt).view(ws, block)[rank].clone()


def _split(i, j, salt):
    """Rows rank i sends to rank j in the uneven cases (0 to 3; zeros included)."""
    return (3 * i + 5 * j + salt) % 4


def _chunk(i, j, rows, cols, dtype, salt):
    return _data(i, dtype, rows * cols, 10_000 * salt + 100 * j + i).view(rows, cols)


def _groups():
    return {a: dist.new_group(backend="collx", pg_options=torchcollx.Options(algorithm=a)) for a in ALGORITHMS}
