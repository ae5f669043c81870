"""collx's own reduce and cast-and-scale kernels against torch, on the CPU and
(where a GPU and a CUDA build are present) on CUDA; the CUDA twins skip cleanly
otherwise. Misaligned views exercise the kernels' head and tail paths."""
import pytest
import torch

torchcollx = pytest.importorskip("torchcollx")
_C = torchcollx._C

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool]
OPS = ["sum", "product", "min", "max", "band", "bor", "bxor"]
COUNTS = [0, 1, 7, 1000, 65537]

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() and _C.cuda_kernels), reason="needs a GPU and a CUDA build of collx")),
]


def reference(op, a, b):
    if a.dtype == torch.bool:
        return {"sum": a | b, "max": a | b, "bor": a | b, "product": a & b, "min": a & b,
                "band": a & b, "bxor": a ^ b}[op]
    return {"sum": lambda: a + b, "product": lambda: a * b, "min": lambda: torch.minimum(a, b),
            "max": lambda: torch.maximum(a, b), "band": lambda: a & b, "bor": lambda: a | b,
            "bxor": lambda: a ^ b}[op]()


def data(dtype, n, device, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.randint(0, 2, (n + 1,), generator=g).bool()
    elif dtype.is_floating_point:
        t = (torch.randint(-8, 9, (n + 1,), generator=g) * 0.5).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, (n + 1,), generator=g).to(dtype)
    # Offset by one element: the data no longer starts on a 16-byte boundary.
    return t.to(device)[1:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_matches_torch(device, dtype):
    for op in OPS:
        if dtype.is_floating_point and op in ("band", "bor", "bxor"):
            with pytest.raises(RuntimeError):
                _C.reduce_into(data(dtype, 8, device, 0).clone(), data(dtype, 8, device, 1).clone(), op)
            continue
        for n in COUNTS:
            for aligned in (True, False):
                a, b = data(dtype, n, device, 2 * n), data(dtype, n, device, 2 * n + 1)
                if aligned:
                    a, b = a.clone(), b.clone()
                want = reference(op, a, b)
                _C.reduce_into(a, b, op)
                assert torch.equal(a, want), (device, dtype, op, n, aligned)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_sum_with_post_scale_is_avg(device, dtype):
    a, b = data(dtype, 4099, device, 3).clone(), data(dtype, 4099, device, 4).clone()
    want = ((a.double() + b.double()) * 0.25).to(dtype)
    _C.reduce_into(a, b, "sum", 0.25)
    assert torch.equal(a, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=str)
def test_cast_scale_round_trip(device, half):
    src = (torch.arange(-64, 65, dtype=torch.float32) * 0.25).to(device)  # exact in bf16 too
    packed = torch.empty(src.shape, dtype=half, device=device)
    _C.cast_scale(packed, src, 0.5)
    assert torch.equal(packed, (src * 0.5).to(half))
    back = torch.empty_like(src)
    _C.cast_scale(back, packed, 2.0)
    assert torch.equal(back, src)
    with pytest.raises(RuntimeError):
        _C.cast_scale(torch.empty(4, dtype=torch.int32, device=device), src[:4], 1.0)
