"""Helpers shared by the benchmark scripts (sizes, iteration bounds, and a
max over ranks through the gloo default group)."""
import torch
import torch.distributed as dist

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MIN_ITERS, MAX_ITERS = 5, 1000


def parse_size(s):
    """'4', '64K', '16MB', '1.5M' -> bytes."""
    s = s.strip().upper().removesuffix("B")
    unit = s[-1] if s and s[-1] in "KMG" else ""
    return int(float(s[: len(s) - len(unit)]) * UNITS[unit])


def parse_sizes(spec, max_size, smallest):
    """A comma list of sizes (default: powers of 4 from 4 B), clipped to [smallest, max_size]."""
    sizes = [parse_size(s) for s in spec.split(",")] if spec else [4 ** k for k in range(1, 14)]
    return sorted({s for s in sizes if smallest <= s <= parse_size(max_size)})


def agreed_max(*xs):
    """Elementwise max of floats over all ranks, via the gloo default group."""
    t = torch.tensor(xs, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist() if len(xs) > 1 else t.item()


def compare_to_gloo(row, gloo_row, is_gloo):
    """Fills row's vs_gloo (time ratio) and busbw_x (busbw ratio) from the
    gloo row of the same point; a gloo row (is_gloo) becomes the reference.
    Returns the gloo row to compare the next rows with."""
    if is_gloo:
        return row
    if gloo_row:
        row["vs_gloo"] = row["time_us"] / gloo_row["time_us"]
        row["busbw_x"] = row["busbw"] / gloo_row["busbw"]
    return gloo_row
