"""Reductions and scans (ops/interpreter/reductions.py)."""
import math

import pytest
import torch

import cuda.tile as ct

from tests.interpreter.helpers import evaluate, randint, randn


@pytest.mark.parametrize("axis,keepdims", [(None, False), (None, True), (0, False), (1, True),
                                           (-1, False), ((0, 2), False), ((0, 2), True)])
def test_reductions(axis, keepdims):
    x = randn(4, 8, 16, seed=21)
    dims = tuple(range(3)) if axis is None else axis
    for tile_fn, torch_fn in [(ct.sum, torch.sum), (ct.max, torch.amax), (ct.min, torch.amin)]:
        got = evaluate(lambda t: tile_fn(t, axis, keepdims=keepdims), x)
        expected = torch_fn(x, dim=dims, keepdim=keepdims)
        assert got.shape == tuple(expected.shape) and got.dtype == ct.float32
        # float32 sums of up to 512 terms below ~60 in another order: 1e-4.
        torch.testing.assert_close(got._t, expected, rtol=0, atol=1e-4)


def test_prod():
    x = randn(4, 16, seed=39) * 0.1 + 1
    torch.testing.assert_close(evaluate(lambda t: ct.prod(t, 1), x)._t, x.prod(1))
    got = evaluate(lambda t: ct.prod(t, None, keepdims=True), x)
    assert got.shape == (1, 1)
    torch.testing.assert_close(got._t.reshape(()), x.prod())


def test_integer_and_bool_reductions():
    x = randint(4, 16, seed=22)
    assert torch.equal(evaluate(lambda t: ct.sum(t, 1), x)._t, x.sum(1).int())
    got = evaluate(lambda t: ct.sum(t > 0), x)
    assert got.dtype == ct.int32 and got._t.item() == (x > 0).sum().item()
    i8 = torch.full((16,), 100, dtype=torch.int8)
    assert evaluate(ct.sum, i8)._t.item() == (1600 + 128) % 256 - 128  # wraps like int8


def test_argmax_argmin():
    x = randn(4, 16, seed=23)
    x[1, 3] = x[1, 9] = 50.0  # a tie: the smallest index wins
    x[2, 0] = math.nan        # NaN loses unless propagate_nan=True
    assert evaluate(lambda t: ct.argmax(t, 1), x)._t.tolist()[:3] == [
        int(torch.argmax(x[0])), 3, int(torch.argmax(x[2, 1:])) + 1]
    assert evaluate(lambda t: ct.argmax(t, 1, propagate_nan=True), x)._t.tolist()[2] == 0
    got = evaluate(lambda t: ct.argmin(t, None, keepdims=True), x)
    assert got.dtype == ct.int32 and got.shape == (1, 1)
    assert got._t.item() == int(torch.argmin(x.nan_to_num(math.inf)))


def test_16bit_sum_rounds_partial_sums():
    x = torch.full((64,), 1.0, dtype=torch.bfloat16)
    x[0] = 256.0  # bfloat16 steps by 2 in [256, 512): 256 + 1 rounds back to 256
    got = evaluate(ct.sum, x)
    assert got.dtype == ct.bfloat16
    # Pairwise with every partial sum rounded: 256 meets a 1 first (-> 256),
    # then 2, 4, ..., 32: 318.  Rounding only the final float32 sum would give
    # 320, adding the ones one by one in bfloat16 would give 256.
    assert got._t.item() == 318.0
    y = randn(4, 32, dtype=torch.bfloat16, seed=24)
    torch.testing.assert_close(evaluate(lambda t: ct.sum(t, 1), y)._t.float(),
                               y.double().sum(1).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("axis,reverse", [(0, False), (1, False), (1, True), (-1, True)])
def test_cumsum_cumprod(axis, reverse):
    x = randn(8, 16, seed=25) * 0.5 + 1

    def torch_scan(fn, t):
        t = t.flip(axis) if reverse else t
        t = fn(t, axis)
        return t.flip(axis) if reverse else t

    got = evaluate(lambda t: ct.cumsum(t, axis, reverse=reverse), x)._t
    torch.testing.assert_close(got, torch_scan(torch.cumsum, x), rtol=1e-6, atol=1e-5)
    got = evaluate(lambda t: ct.cumprod(t, axis, reverse=reverse), x)._t
    torch.testing.assert_close(got, torch_scan(torch.cumprod, x), rtol=1e-5, atol=1e-6)
    ints = randint(8, 16, seed=26)
    assert torch.equal(evaluate(lambda t: ct.cumsum(t, axis, reverse=reverse), ints)._t,
                       torch_scan(torch.cumsum, ints).int())


def test_16bit_cumsum():
    x = randn(64, dtype=torch.bfloat16, seed=27)
    got = evaluate(ct.cumsum, x)
    assert got.dtype == ct.bfloat16
    torch.testing.assert_close(got._t.double(), x.double().cumsum(0), rtol=2e-2, atol=5e-2)


def test_custom_reduce_and_scan():
    x = randn(4, 16, seed=28)
    got = evaluate(lambda t: ct.reduce(t, 1, lambda a, b: ct.maximum(a, b), -math.inf), x)
    assert torch.equal(got._t, x.amax(1))
    got = evaluate(lambda t: ct.scan(t, 1, lambda a, b: a + b, 0.0), x)._t
    torch.testing.assert_close(got, x.cumsum(1), rtol=1e-6, atol=1e-6)
    # Tuples: a running (max, count of new maxima) pair.
    pair = evaluate(lambda t: ct.reduce((t, ct.ones(t.shape, ct.int32)), 1,
                                        lambda a, n, b, m: (ct.maximum(a, b), n + m),
                                        (-math.inf, 0)), x)
    assert torch.equal(pair[0]._t, x.amax(1)) and pair[1]._t.tolist() == [16] * 4
