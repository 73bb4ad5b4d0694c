"""Array views (ops/interpreter/views.py): Array.slice and Array.tiled_view."""
import math

import pytest
import torch

import cuda.tile as ct

from ops import interpreter
from ops.interpreter import KernelTypeError, KernelValueError
from tests.interpreter.helpers import on_gpu_and_cpu, poisoned, randint, randn


@ct.kernel
def copy_rows(src, dst, start, stop, T: ct.Constant[int]):
    # The slice is a view: loads read src[start:stop], stores write into dst[start:stop].
    s = src.slice(axis=0, start=start, stop=stop)
    d = dst.slice(0, start, stop)
    tile = ct.load(s, (ct.bid(0), 0), (T, 16), padding_mode=ct.PaddingMode.ZERO)
    ct.store(d, (ct.bid(0), 0), tile * 2)


@ct.kernel
def tiled_scale(src, dst, TM: ct.Constant[int], TN: ct.Constant[int]):
    src_tv = src.tiled_view((TM, TN), padding_mode=ct.PaddingMode.ZERO)
    dst_tv = dst.tiled_view((TM, TN))
    tile = src_tv.load((ct.bid(0), ct.bid(1)))
    dst_tv.store((ct.bid(0), ct.bid(1)), tile + 1.0)


@ct.kernel
def column_sums(x, out, TM: ct.Constant[int], TN: ct.Constant[int]):
    # Every block of rows adds its column sums into out with a tiled-view atomic store.
    tile = x.tiled_view((TM, TN), padding_mode=ct.PaddingMode.ZERO).load((ct.bid(0), ct.bid(1)))
    out.tiled_view(TN).atomic_store_add(ct.bid(1), ct.sum(tile, axis=0))


def test_slice_reads_and_writes_the_window():
    src = randn(40, 16, seed=1)
    dst = poisoned(40, 16)
    interpreter.launch(2, copy_rows, (src, dst, 5, 37, 16))  # 32 rows: 2 tiles
    assert torch.equal(dst[5:37], src[5:37] * 2)
    assert dst[:5].isnan().all() and dst[37:].isnan().all()  # outside the slice: untouched


def test_slice_last_axis_and_tile_bounds():
    x = randint(4, 10, seed=2)
    got = []

    @ct.kernel
    def k(a):
        s = a.slice(-1, ct.bid(0) + 2, 9)
        got.append((s.shape, ct.load(s, (0, 0), (4, 8), padding_mode=ct.PaddingMode.ZERO)))

    interpreter.launch(1, k, (x,))
    shape, tile = got[0]
    assert shape == (4, 7)
    expected = torch.zeros(4, 8, dtype=torch.int32)
    expected[:, :7] = x[:, 2:9]
    assert torch.equal(tile._t, expected)  # padded past stop, not filled from x[:, 9]


def test_tiled_view_load_store_partial_tiles():
    src = randn(37, 50, seed=3)
    dst = poisoned(37, 50)
    interpreter.launch((3, 4), tiled_scale, (src, dst, 16, 16))
    assert torch.equal(dst, src + 1.0)


def test_tiled_view_traversal_steps_and_num_tiles():
    x = torch.arange(16, dtype=torch.int32).reshape(4, 4)
    got = []

    @ct.kernel
    def k(a):
        tv = a.tiled_view((2, 4), traversal_steps=(1, 4))
        got.append((tv.load((1, 0)), tv.num_tiles(0), tv.num_tiles(1), tv.tile_shape,
                    tv.traversal_steps, tv.dtype))

    interpreter.launch(1, k, (x,))
    tile, n0, n1, shape, steps, dtype = got[0]
    assert torch.equal(tile._t, x[1:3])
    assert (n0, n1, shape, steps, dtype) == (4, 1, (2, 4), (1, 4), ct.int32)


def test_tiled_view_atomic_store_add_over_blocks():
    x = randn(100, 24, seed=4)
    out = torch.zeros(24)
    interpreter.launch((4, 2), column_sums, (x, out, 32, 16))
    torch.testing.assert_close(out, x.sum(0), rtol=0, atol=1e-5)


def test_tiled_view_padding_modes():
    x = randn(5, seed=5)
    got = []

    @ct.kernel
    def k(a):
        got.append(a.tiled_view(8, padding_mode=ct.PaddingMode.NEG_INF).load(0))
        got.append(a.tiled_view(8).load(0))

    interpreter.launch(1, k, (x,))
    assert torch.equal(got[0]._t[:5], x) and got[0]._t[5:].eq(-math.inf).all()
    assert got[1]._t[5:].isnan().all()  # undetermined padding is poisoned


@pytest.mark.parametrize("call,error,message", [
    (lambda a: a.slice(0, 3, 2), KernelValueError, "start <= stop"),
    (lambda a: a.slice(0, 8, 8), KernelValueError, "0 <= start < 8"),
    (lambda a: a.slice(2, 0, 1), KernelTypeError, "axis 2 is out of range"),
    (lambda a: a.slice(0, 0.5, 1), KernelTypeError, "start must be an integer"),
    (lambda a: a.slice(0, 0, ct.full((1,), 2, ct.int32)), KernelTypeError, "stop must be"),
    (lambda a: a.tiled_view(3), KernelTypeError, "powers of two"),
    (lambda a: a.tiled_view((2, 2)), KernelTypeError, "tile_shape"),
    (lambda a: a.tiled_view(4, traversal_steps=0), KernelTypeError, "traversal_steps"),
    (lambda a: a.tiled_view(4, padding_mode="zero"), KernelTypeError, "padding_mode"),
    (lambda a: a.tiled_view(4).load(2), KernelValueError, "entirely outside"),
    (lambda a: a.tiled_view(16).load(0, check_bounds=False), KernelValueError, "check_bounds"),
    (lambda a: a.tiled_view(4).load((0, 0)), KernelTypeError, "index"),
    (lambda a: a.tiled_view(4).store(0, ct.zeros((8,), ct.int32)), KernelTypeError,
     "not broadcastable"),
    (lambda a: a.tiled_view(4).store(0, ct.zeros((4,), ct.float32)), KernelTypeError,
     "implicitly cast"),
    (lambda a: a.tiled_view(4).atomic_store_or(0, ct.zeros((4,), ct.int64)), KernelTypeError,
     "exactly match"),
])
def test_wrong_usage(call, error, message):
    @ct.kernel
    def k(a):
        call(a)

    with pytest.raises(error, match=message):
        interpreter.launch(1, k, (torch.zeros(8, dtype=torch.int32),))


def test_atomic_store_on_float_view_rejects_bitwise():
    @ct.kernel
    def k(a):
        a.tiled_view(4).atomic_store_max(0, ct.zeros((4,), ct.float32))

    with pytest.raises(KernelTypeError, match="not supported"):
        interpreter.launch(1, k, (torch.zeros(8),))


# ---------------------------------------------------------------------------
# The same kernels on a GPU (skipped without CUDA): interpreter vs ct.launch
# ---------------------------------------------------------------------------



@pytest.mark.gpu
def test_gpu_slice_and_tiled_view():
    cpu, gpu = on_gpu_and_cpu(2, copy_rows, (randn(40, 16, seed=21), poisoned(40, 16), 5, 37, 16))
    # Untouched rows stay NaN on both sides; doubling is exact.
    torch.testing.assert_close(gpu[1], cpu[1], rtol=0, atol=0, equal_nan=True)
    cpu, gpu = on_gpu_and_cpu((3, 4), tiled_scale, (randn(37, 50, seed=22), poisoned(37, 50),
                                                  16, 16))
    assert torch.equal(gpu[1], cpu[1])  # one rounded addition per element: exact


@pytest.mark.gpu
def test_gpu_tiled_view_atomic_store_add():
    cpu, gpu = on_gpu_and_cpu((4, 2), column_sums, (randn(100, 24, seed=23), torch.zeros(24),
                                                  32, 16))
    # 4 partial sums of 32 terms each, |sum| < 60, in other orders: atol 1e-4.
    torch.testing.assert_close(gpu[1], cpu[1], rtol=0, atol=1e-4)
