"""Gathers, scatters and advanced indexing (ops/interpreter/indexing.py).

Expected values come from plain torch indexing.  The ``gpu`` tests at the end
run the same kernels with ``ct.launch`` and compare them with the interpreter.
"""
import pytest
import torch

import cuda.tile as ct

from ops import interpreter
from ops.interpreter import KernelTypeError, KernelValueError
from ops.runtime.launch import launch
from tests.interpreter.helpers import on_gpu_and_cpu, poisoned, randint, randn

ConstInt = ct.Constant[int]


@ct.kernel
def gather_rows(x, idx, out, TM: ConstInt, N: ConstInt):
    """out[i, :] = x[idx[i], :]; rows of out whose index is out of bounds get -1."""
    rows = ct.load(idx, (ct.bid(0),), (TM,), padding_mode=ct.PaddingMode.ZERO)
    cols = ct.arange(N, dtype=ct.int32)
    tile = ct.gather(x, (rows[:, None], cols[None, :]), padding_value=-1)
    ct.store(out, (ct.bid(0), 0), tile)


@ct.kernel
def scatter_rows(x, idx, out, TM: ConstInt, N: ConstInt):
    """out[idx[i], :] = x[i, :]."""
    rows = ct.load(idx, (ct.bid(0),), (TM,), padding_mode=ct.PaddingMode.ZERO)
    tile = ct.load(x, (ct.bid(0), 0), (TM, N))
    cols = ct.arange(N, dtype=ct.int32)
    # Rows past the end of idx were padded with 0: mask them off.
    valid = ct.bid(0) * TM + ct.arange(TM, dtype=ct.int32) < idx.shape[0]
    ct.scatter(out, (rows[:, None], cols[None, :]), tile, mask=valid[:, None])


@ct.kernel
def masked_gather(x, idx, out, pad, T: ConstInt):
    """1-D gather with the tile shorthand: even indices only, others read `pad`."""
    i = ct.load(idx, (ct.bid(0),), (T,))
    p = ct.load(pad, (ct.bid(0),), (T,))
    ct.store(out, (ct.bid(0),), ct.gather(x, i, mask=i % 2 == 0, padding_value=p, latency=3))


@ct.kernel
def gather_2d_index(x, idx, out, TM: ConstInt, TN: ConstInt):
    """A 2-D index tile into a 1-D array: out[a, b] = x[idx[a, b]]."""
    i = ct.load(idx, (0, 0), (TM, TN))
    ct.store(out, (0, 0), ct.gather(x, (i,)))


@ct.kernel
def take_rows_cols(x, idx, out, col0: int, TM: ConstInt, TN: ConstInt):
    """out = x[idx][:, col0:col0+TN] through load_advanced_indexing (zero padding)."""
    rows = ct.load(idx, (0,), (TM,))
    tile = ct.load_advanced_indexing(x, (rows, ct.Slice(col0, TN)),
                                     padding_mode=ct.PaddingMode.ZERO, latency=2)
    ct.store(out, (0, 0), tile)


@ct.kernel
def put_rows_cols(x, idx, out, col0: int, TM: ConstInt, TN: ConstInt):
    """out[idx, col0:col0+TN] = x through store_advanced_indexing."""
    rows = ct.load(idx, (0,), (TM,))
    ct.store_advanced_indexing(out, (rows, ct.Slice(col0, TN)), ct.load(x, (0, 0), (TM, TN)))


def _indices(n, high, seed, low=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=g, dtype=torch.int32)


def _source(shape, dtype, seed):
    return randint(*shape, seed=seed, dtype=dtype) if not dtype.is_floating_point \
        else randn(*shape, dtype=dtype, seed=seed)


# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_gather_rows(dtype):
    x = _source((37, 16), dtype, seed=1)
    idx = _indices(50, 37, seed=2)
    out = poisoned(50, 16, dtype=dtype)
    launch((4,), gather_rows, (x, idx, out, 16, 16))
    assert torch.equal(out, x[idx.long()])


def test_gather_out_of_bounds_rows_read_padding():
    x = randn(10, 8, seed=3)
    idx = torch.tensor([3, -1, 10, 9, -100, 0, 2**31 - 1, 5], dtype=torch.int32)
    out = poisoned(8, 8)
    launch((1,), gather_rows, (x, idx, out, 8, 8))
    inside = (idx >= 0) & (idx < 10)
    expected = torch.full((8, 8), -1.0)
    expected[inside] = x[idx[inside].long()]
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_scatter_rows(dtype):
    x = _source((40, 16), dtype, seed=4)
    idx = torch.randperm(40, generator=torch.Generator().manual_seed(5)).to(torch.int32)
    out = poisoned(40, 16, dtype=dtype)
    launch((3,), scatter_rows, (x, idx, out, 16, 16))
    expected = torch.empty_like(x)
    expected[idx.long()] = x
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_scatter_rows_of_float8(dtype):
    """One-byte floats go through the duplicate-write check like the others."""
    x = _source((40, 16), torch.float32, seed=4).to(dtype)
    idx = torch.randperm(40, generator=torch.Generator().manual_seed(5)).to(torch.int32)
    out = torch.full((40, 16), float("nan")).to(dtype)
    launch((3,), scatter_rows, (x, idx, out, 16, 16))
    expected = torch.empty_like(x)
    expected[idx.long()] = x
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def test_scatter_out_of_bounds_rows_are_dropped():
    x = randn(8, 8, seed=6)
    idx = torch.tensor([2, -1, 8, 0, 100, 5, -7, 7], dtype=torch.int32)
    out = poisoned(8, 8)
    expected = out.clone()
    launch((1,), scatter_rows, (x, idx, out, 8, 8))
    inside = (idx >= 0) & (idx < 8)
    expected[idx[inside].long()] = x[inside]
    assert torch.equal(out.nan_to_num(7.5), expected.nan_to_num(7.5))


def test_masked_gather_with_padding_tile():
    x = randn(100, seed=7)
    idx = _indices(64, 120, seed=8, low=-10)  # some out of bounds on both sides
    pad = randn(64, seed=9)
    out = poisoned(64)
    launch((4,), masked_gather, (x, idx, out, pad, 16))
    take = (idx % 2 == 0) & (idx >= 0) & (idx < 100)
    expected = torch.where(take, x[idx.long().clamp(0, 99)], pad)
    assert torch.equal(out, expected)


def test_gather_2d_index_tile_and_broadcast_indices():
    x = randn(50, seed=10)
    idx = _indices(32, 50, seed=11).reshape(4, 8)
    out = poisoned(4, 8)
    launch((1,), gather_2d_index, (x, idx, out, 4, 8))
    assert torch.equal(out, x[idx.long()])

    # (M, 1, 1) and (1, N, K) index tiles of a 2-D array broadcast to (M, N, K).
    y = randn(6, 9, seed=12)
    results = []

    @ct.kernel
    def outer(a):
        i = ct.arange(2, dtype=ct.int32)[:, None, None] * 2 + 1
        j = ct.reshape(ct.arange(8, dtype=ct.int32), (1, 2, 4))
        results.append(ct.gather(a, (i, j), padding_value=5))

    interpreter.launch(1, outer, (y,))
    tile = results[0]
    expected = y[torch.tensor([1, 3])[:, None, None], torch.arange(8).reshape(1, 2, 4)]
    assert tile.shape == (2, 2, 4) and tile.dtype == ct.float32
    assert torch.equal(tile._t, expected)


def test_gather_scalar_indices_dtypes_and_default_padding():
    results = []

    @ct.kernel
    def probe(a, b):
        results.append(ct.gather(a, (2, ct.arange(4, dtype=ct.int64) * 3)))  # 0 past the end
        results.append(ct.gather(b, ct.arange(4, dtype=ct.uint8) + 3))  # False past the end
        results.append(ct.gather(a, (1, 1)))  # all scalars: a 0-d tile

    a = randn(4, 10, dtype=torch.bfloat16, seed=13)
    b = randn(5, seed=14) > 0
    interpreter.launch(1, probe, (a, b))
    row, flags, one = results
    assert row.dtype == ct.bfloat16 and torch.equal(row._t, torch.cat([a[2, [0, 3, 6, 9]]]))
    assert flags.dtype == ct.bool_
    assert torch.equal(flags._t, torch.tensor([b[3].item(), b[4].item(), False, False]))
    assert one.shape == () and one._t.item() == a[1, 1].item()


def test_gather_check_bounds_false_in_bounds_and_masked():
    x = randn(16, seed=15)
    results = []

    @ct.kernel
    def probe(a):
        i = ct.arange(32, dtype=ct.int32)
        # Masked-off indices may be out of bounds even without bounds checks.
        results.append(ct.gather(a, i, mask=i < 16, padding_value=-0.0, check_bounds=False))

    interpreter.launch(1, probe, (x,))
    expected = torch.cat([x, torch.full((16,), -0.0)])
    assert torch.equal(results[0]._t, expected)
    assert torch.equal(torch.signbit(results[0]._t), torch.signbit(expected))


def test_scatter_scalar_and_broadcast_value_and_identical_duplicates():
    out = torch.zeros(4, 6, dtype=torch.int32)

    @ct.kernel
    def fill(a):
        i = ct.arange(4, dtype=ct.int32)
        ct.scatter(a, (i[:, None], ct.arange(2, dtype=ct.int32)[None, :]), 7)
        # Every row writes the same row vector: duplicates of identical values are defined.
        ct.scatter(a, (1, ct.arange(4, dtype=ct.int32)[None, :] + 2 + 0 * i[:, None]),
                   ct.arange(4, dtype=ct.int32)[None, :] * 10)

    interpreter.launch(1, fill, (out,))
    expected = torch.zeros(4, 6, dtype=torch.int32)
    expected[:, :2] = 7
    expected[1, 2:6] = torch.tensor([0, 10, 20, 30], dtype=torch.int32)
    assert torch.equal(out, expected)


def test_scatter_widens_value_dtype():
    out = torch.zeros(8)

    @ct.kernel
    def widen(a):
        ct.scatter(a, ct.arange(8, dtype=ct.int32), ct.arange(8, dtype=ct.int16).astype(ct.bfloat16))

    interpreter.launch(1, widen, (out,))
    assert torch.equal(out, torch.arange(8.0))


@pytest.mark.parametrize("col0", [0, 5, -2])
def test_load_advanced_indexing(col0):
    x = randn(12, 10, seed=16)
    idx = torch.tensor([11, 0, 12, 3, -1, 7, 7, 2], dtype=torch.int32)  # 12 and -1 outside
    out = poisoned(8, 8)
    launch((1,), take_rows_cols, (x, idx, out, col0, 8, 8))
    expected = torch.zeros(8, 8)
    for r, row in enumerate(idx.tolist()):
        for c in range(8):
            if 0 <= row < 12 and 0 <= col0 + c < 10:
                expected[r, c] = x[row, col0 + c]
    assert torch.equal(out, expected)


def test_load_advanced_indexing_undetermined_padding_and_the_documented_example():
    results = []

    @ct.kernel
    def probe(a, col_start: int):
        rows = ct.arange(4, dtype=ct.int32)
        results.append(ct.load_advanced_indexing(a, (rows, ct.Slice(col_start, 4)),
                                                 padding_mode=ct.PaddingMode.ZERO))
        results.append(ct.load_advanced_indexing(a, (ct.Slice(6, 4), rows * 2)))

    x = torch.arange(64, dtype=torch.int32).reshape(8, 8)
    interpreter.launch(1, probe, (x, 2))
    assert results[0]._t.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13], [18, 19, 20, 21],
                                      [26, 27, 28, 29]]
    low = torch.iinfo(torch.int32).min  # undetermined padding is poisoned
    assert results[1]._t.tolist() == [[48, 50, 52, 54], [56, 58, 60, 62], [low] * 4, [low] * 4]


def test_store_advanced_indexing():
    x = randn(8, 4, seed=17)
    idx = torch.tensor([4, 0, 9, 2, -3, 6, 1, 3], dtype=torch.int32)
    out = poisoned(8, 6)
    expected = out.clone()
    launch((1,), put_rows_cols, (x, idx, out, 3, 8, 4))
    inside = (idx >= 0) & (idx < 8)
    expected[idx[inside].long(), 3:6] = x[inside][:, :3]  # column 6 is past the end
    assert torch.equal(out.nan_to_num(9.0), expected.nan_to_num(9.0))


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

def _run(body, *tensors):
    @ct.kernel
    def kernel(a, b):
        body(a, b)

    interpreter.launch(1, kernel, tensors or (randn(8, 8, seed=20), randint(8)))


def _i(n=8):
    return ct.arange(n, dtype=ct.int32)


@pytest.mark.parametrize("body,error,words", [
    (lambda a, b: ct.gather(a, _i()), KernelTypeError, "`indices` must be a tuple of length 2"),
    (lambda a, b: ct.gather(a, (_i(), _i(), _i())), KernelTypeError, "has 3 entries"),
    (lambda a, b: ct.gather(a, (_i(), _i().astype(ct.float32))), KernelTypeError,
     "`indices` entry 1 must be an integer"),
    (lambda a, b: ct.gather(a, (_i() > 2, 0)), KernelTypeError, "`indices` entry 0"),
    (lambda a, b: ct.gather(a, (_i(), _i(4))), KernelTypeError, "not broadcastable"),
    (lambda a, b: ct.gather(a, (_i(), 0), mask=_i()), KernelTypeError, "`mask` must be a boolean"),
    (lambda a, b: ct.gather(a, (_i()[:, None], 0), mask=_i() > 1), KernelTypeError,
     "`mask` shape (8,)"),
    (lambda a, b: ct.gather(b, _i(), padding_value=0.5), KernelTypeError, "`padding_value`"),
    (lambda a, b: ct.gather(a, (_i(), 0), padding_value=ct.zeros((8,), ct.float64)),
     KernelTypeError, "`padding_value`"),
    (lambda a, b: ct.gather(a, (0, _i()), padding_value=ct.zeros((4,), ct.float32)),
     KernelTypeError, "`padding_value` shape (4,)"),
    (lambda a, b: ct.gather(a, (_i(), 0), check_bounds=1), KernelTypeError, "`check_bounds`"),
    (lambda a, b: ct.gather(a, (_i() + 1, 0), check_bounds=False), KernelValueError,
     "check_bounds=False but element (7,) accesses index (8, 0)"),
    (lambda a, b: ct.gather(a, (_i(), 0), latency=0), KernelValueError, "`latency`"),
    (lambda a, b: ct.gather(a, (_i(), 0), latency="high"), KernelTypeError, "`latency`"),
    (lambda a, b: ct.gather(ct.zeros((8,), ct.int32), _i()), KernelTypeError, "`array`"),
    (lambda a, b: ct.scatter(b, _i(), 0.5), KernelTypeError, "`value`"),
    (lambda a, b: ct.scatter(a, (_i(), 0), ct.zeros((8,), ct.float64)), KernelTypeError,
     "`value`"),
    (lambda a, b: ct.scatter(a, (_i(), 0), ct.zeros((8, 8), ct.float32)), KernelTypeError,
     "`value` shape (8, 8)"),
    (lambda a, b: ct.scatter(b, _i() // 2, _i()), KernelValueError,
     "write different values to array index (0,)"),
    (lambda a, b: ct.scatter(b, _i() - 1, 1, check_bounds=False), KernelValueError,
     "accesses index (-1,)"),
    (lambda a, b: ct.load_advanced_indexing(b, (_i(),)), KernelTypeError, "use ct.gather()"),
    (lambda a, b: ct.load_advanced_indexing(a, (_i(), _i())), KernelTypeError,
     "found 2"),
    (lambda a, b: ct.load_advanced_indexing(a, (ct.Slice(0, 8), ct.Slice(0, 8))),
     KernelTypeError, "found 0"),
    (lambda a, b: ct.load_advanced_indexing(a, (_i(), ct.Slice(0, 6))), KernelTypeError,
     "powers of two"),
    (lambda a, b: ct.load_advanced_indexing(a, (_i(), 0)), KernelTypeError,
     "`indices` entry 1"),
    (lambda a, b: ct.load_advanced_indexing(a, (_i()[:, None], ct.Slice(0, 8))),
     KernelTypeError, "1-D integer tile"),
    (lambda a, b: ct.load_advanced_indexing(a, (_i(), ct.Slice(0, ct.load(b, (0,), (1,)).item()))),
     KernelTypeError, "compile-time"),
    (lambda a, b: ct.load_advanced_indexing(a, (_i(), ct.Slice(0.5, 8))), KernelTypeError,
     "`start`"),
    (lambda a, b: ct.load_advanced_indexing(a, (_i() + 8, ct.Slice(0, 8))), KernelValueError,
     "entirely outside"),
    (lambda a, b: ct.load_advanced_indexing(a, (_i(), ct.Slice(8, 8))), KernelValueError,
     "entirely outside"),
    (lambda a, b: ct.load_advanced_indexing(a, (_i(), ct.Slice(0, 8)), padding_mode=0),
     KernelTypeError, "`padding_mode`"),
    (lambda a, b: ct.load_advanced_indexing(a, (_i(), ct.Slice(0, 8)), allow_tma=1),
     KernelTypeError, "`allow_tma`"),
    (lambda a, b: ct.store_advanced_indexing(a, (_i(), ct.Slice(0, 4)), ct.zeros((8, 8),
                                                                                  ct.float32)),
     KernelTypeError, "exactly the shape (8, 4)"),
    (lambda a, b: ct.store_advanced_indexing(a, (_i(), ct.Slice(0, 4)), 1.0), KernelTypeError,
     "`tile` must be a tile"),
    (lambda a, b: ct.store_advanced_indexing(a, (_i() // 2, ct.Slice(0, 2)),
                                             ct.reshape(_i(16).astype(ct.float32), (8, 2))),
     KernelValueError, "different values"),
])
def test_errors(body, error, words):
    with pytest.raises(error) as info:
        _run(body)
    message = str(info.value)
    assert words in message, message
    assert message.startswith("test_indexing.py:"), message  # names the kernel's line


# ---------------------------------------------------------------------------
# The GPU against the interpreter
# ---------------------------------------------------------------------------



def _assert_same(gpu, cpu):
    torch.testing.assert_close(gpu, cpu, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_gpu_gather_rows(dtype):
    idx = torch.cat([_indices(46, 37, seed=30), torch.tensor([-1, 37, 40, -50], dtype=torch.int32)])
    args = (_source((37, 16), dtype, seed=31), idx, poisoned(50, 16, dtype=dtype), 16, 16)
    cpu, gpu = on_gpu_and_cpu((4,), gather_rows, args)
    _assert_same(gpu[2], cpu[2])


@pytest.mark.gpu
def test_gpu_scatter_rows():
    idx = torch.randperm(40, generator=torch.Generator().manual_seed(32)).to(torch.int32)
    idx[[3, 17]] = torch.tensor([-1, 40], dtype=torch.int32)  # dropped rows
    args = (randn(40, 16, seed=33), idx, poisoned(40, 16), 16, 16)
    cpu, gpu = on_gpu_and_cpu((3,), scatter_rows, args)
    _assert_same(gpu[2], cpu[2])


@pytest.mark.gpu
def test_gpu_masked_gather():
    args = (randn(100, seed=34), _indices(64, 120, seed=35, low=-10), poisoned(64),
            randn(64, seed=36), 16)
    cpu, gpu = on_gpu_and_cpu((4,), masked_gather, args)
    _assert_same(gpu[2], cpu[2])


@pytest.mark.gpu
def test_gpu_gather_2d_index():
    args = (randn(50, seed=37), _indices(32, 60, seed=38, low=-5).reshape(4, 8), poisoned(4, 8),
            4, 8)
    cpu, gpu = on_gpu_and_cpu((1,), gather_2d_index, args)
    _assert_same(gpu[2], cpu[2])


@pytest.mark.gpu
@pytest.mark.parametrize("col0", [0, 5])
def test_gpu_load_advanced_indexing(col0):
    idx = torch.tensor([11, 0, 12, 3, -1, 7, 7, 2], dtype=torch.int32)
    args = (randn(12, 10, seed=39), idx, poisoned(8, 8), col0, 8, 8)
    cpu, gpu = on_gpu_and_cpu((1,), take_rows_cols, args)
    _assert_same(gpu[2], cpu[2])


@pytest.mark.gpu
def test_gpu_store_advanced_indexing():
    idx = torch.tensor([4, 0, 9, 2, -3, 6, 1, 3], dtype=torch.int32)
    args = (randn(8, 4, seed=40), idx, poisoned(8, 6), 3, 8, 4)
    cpu, gpu = on_gpu_and_cpu((1,), put_rows_cols, args)
    _assert_same(gpu[2], cpu[2])
