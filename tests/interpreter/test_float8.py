"""float8 tiles: loads, stores, conversions (round to nearest even, saturating) and mma."""
import math

import cuda.tile as ct
import pytest
import torch

from ops import interpreter
from ops.interpreter import KernelTypeError, UnsupportedOperation
from tests.interpreter.helpers import evaluate, on_gpu_and_cpu, poisoned, randn

ConstInt = ct.Constant[int]
FLOAT8 = [(ct.float8_e4m3fn, torch.float8_e4m3fn), (ct.float8_e5m2, torch.float8_e5m2)]


def _saturating(t, torch_dtype):
    """Reference conversion: nearest even, +-inf and overflow to +-max, NaN kept."""
    limit = torch.finfo(torch_dtype).max
    return t.float().clamp(-limit, limit).to(torch_dtype)


@ct.kernel
def quantize_round_trip(x, q, y, B: ConstInt):
    """float32 -> float8 stored in q; q loaded back and widened to float32 in y."""
    i = ct.bid(0)
    t = ct.load(x, (i,), (B,))
    ct.store(q, (i,), t.astype(q.dtype))
    back = ct.load(q, (i,), (B,))
    ct.store(y, (i,), back.astype(ct.float32))


@pytest.mark.parametrize("ct_dtype, torch_dtype", FLOAT8)
def test_quantize_round_trip(ct_dtype, torch_dtype):
    x = randn(100, seed=1) * 40
    x[:4] = torch.tensor([math.inf, -math.inf, 1e6, math.nan])
    q = torch.zeros(100, dtype=torch_dtype)
    y = poisoned(100)
    interpreter.launch((4,), quantize_round_trip, (x, q, y, 32))
    expected = _saturating(x, torch_dtype)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    torch.testing.assert_close(y, expected.float(), rtol=0, atol=0, equal_nan=True)
    limit = torch.finfo(torch_dtype).max
    assert y[:3].tolist() == [limit, -limit, limit] and math.isnan(y[3])


@pytest.mark.parametrize("ct_dtype, torch_dtype", FLOAT8)
def test_rounding_is_nearest_even(ct_dtype, torch_dtype):
    # Exact midpoints between neighbouring float8 values, and their neighbours.
    grid = torch.arange(256, dtype=torch.uint8).view(torch_dtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[:-1] + grid[1:]) / 2
    x = torch.cat([mids, mids.nextafter(torch.tensor(math.inf)),
                   mids.nextafter(torch.tensor(-math.inf))])
    x = torch.cat([x, x[:1024 - len(x)]])  # tile sizes are powers of two
    r = evaluate(lambda t: t.astype(ct_dtype), x)
    assert r.dtype is ct_dtype
    assert torch.equal(r._t.view(torch.uint8), x.to(torch_dtype).view(torch.uint8))


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.int32])
def test_from_other_dtypes_and_back(src):
    x = (randn(64, seed=2) * 30).to(src) if src.is_floating_point else \
        torch.arange(-32, 32, dtype=src) * 9
    r = evaluate(lambda t: t.astype(ct.float8_e4m3fn).astype(ct.float16), x)
    assert torch.equal(r._t, _saturating(x, torch.float8_e4m3fn).half())
    i = evaluate(lambda t: t.astype(ct.float8_e5m2).astype(ct.int32), x)
    assert torch.equal(i._t, _saturating(x, torch.float8_e5m2).float().trunc().int())
    b = evaluate(lambda t: t.astype(ct.float8_e4m3fn).astype(ct.bool_), x)
    assert torch.equal(b._t, _saturating(x, torch.float8_e4m3fn).float() != 0)


def test_arithmetic_on_float8_is_refused():
    x = torch.ones(8, dtype=torch.float8_e4m3fn)
    with pytest.raises(KernelTypeError):
        evaluate(lambda t: t + t, x)


@ct.kernel
def fp8_gemm(a, b, c, BM: ConstInt, BN: ConstInt, BK: ConstInt, FAST: ConstInt):
    i, j = ct.bid(0), ct.bid(1)
    acc = ct.zeros((BM, BN), dtype=ct.float32)
    for k in range(ct.num_tiles(a, 1, (BM, BK))):
        x = ct.load(a, (i, k), (BM, BK))
        y = ct.load(b, (k, j), (BK, BN))
        acc = ct.mma(x, y, acc, use_fast_acc=bool(FAST))
    ct.store(c, (i, j), acc)


@pytest.mark.parametrize("fast", [0, 1])
@pytest.mark.parametrize("ct_dtype, torch_dtype", FLOAT8)
def test_mma_accumulates_float8_products_in_float32(ct_dtype, torch_dtype, fast):
    a = _saturating(randn(32, 64, seed=3) * 4, torch_dtype)
    b = _saturating(randn(64, 16, seed=4) * 4, torch_dtype)
    c = poisoned(32, 16)
    interpreter.launch((2, 1), fp8_gemm, (a, b, c, 16, 16, 32, fast))
    torch.testing.assert_close(c, a.double().mm(b.double()).float(), rtol=1e-6, atol=1e-4)


def test_mma_float8_float16_accumulator_and_matmul():
    a = _saturating(randn(16, 16, seed=5), torch.float8_e4m3fn)
    b = _saturating(randn(16, 16, seed=6), torch.float8_e4m3fn)
    r = evaluate(lambda x, y: ct.mma(x, y, ct.zeros((16, 16), dtype=ct.float16)), a, b)
    assert r.dtype is ct.float16
    assert torch.equal(r._t, (a.float() @ b.float()).half())
    m = evaluate(lambda x, y: x @ y, a, b)  # matmul: float16 accumulator, back to float8
    assert m.dtype is ct.float8_e4m3fn
    assert torch.equal(m._t.view(torch.uint8),
                       _saturating((a.float() @ b.float()).half(), torch.float8_e4m3fn)
                       .view(torch.uint8))


def test_mixed_float8_mma_is_refused():
    a = torch.ones(16, 16, dtype=torch.float8_e4m3fn)
    b = torch.ones(16, 16, dtype=torch.float8_e5m2)
    with pytest.raises(KernelTypeError, match="same dtype"):
        evaluate(lambda x, y: ct.mma(x, y, ct.zeros((16, 16), dtype=ct.float32)), a, b)


def test_fast_acc_needs_float8():
    a = torch.ones(16, 16, dtype=torch.float16)
    with pytest.raises(KernelTypeError, match="use_fast_acc"):
        evaluate(lambda x: ct.mma(x, x, ct.zeros((16, 16), dtype=ct.float32),
                                  use_fast_acc=True), a)


@pytest.mark.parametrize("dtype", [ct.float8_e5m3fnu, ct.float4_e2m1fn, ct.float8_e8m0fnu])
def test_dtypes_without_emulation_name_themselves(dtype):
    with pytest.raises(UnsupportedOperation, match=str(dtype)):
        evaluate(lambda t: t.astype(dtype), randn(4))


@pytest.mark.gpu
@pytest.mark.parametrize("ct_dtype, torch_dtype", FLOAT8)
def test_gpu_quantize_round_trip(ct_dtype, torch_dtype):
    """Also checks the saturation assumption (inf and overflow become +-max)."""
    x = randn(128, seed=7) * 300
    x[:4] = torch.tensor([math.inf, -math.inf, 1e6, math.nan])
    args = [x, torch.zeros(128, dtype=torch_dtype), poisoned(128), 32]
    cpu, gpu = on_gpu_and_cpu((4,), quantize_round_trip, args)
    assert torch.equal(gpu[1].view(torch.uint8), cpu[1].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [0, 1])
def test_gpu_fp8_gemm(fast):
    from ops.runtime.launch import launch
    a = _saturating(randn(64, 128, seed=8) * 4, torch.float8_e4m3fn)
    b = _saturating(randn(128, 64, seed=9) * 4, torch.float8_e4m3fn)
    args = [a, b, poisoned(64, 64), 32, 32, 64, fast]
    cpu = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    gpu = [t.cuda() if isinstance(t, torch.Tensor) else t for t in args]
    launch((2, 2), fp8_gemm, cpu)
    launch((2, 2), fp8_gemm, gpu)
    torch.cuda.synchronize()
    torch.testing.assert_close(gpu[2].cpu(), cpu[2], rtol=1e-3, atol=1e-2)
