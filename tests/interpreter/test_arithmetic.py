"""Elementwise operations and conversions (ops/interpreter/arithmetic.py): results bit for bit
against torch, promotion, errors.
"""
import math

import pytest
import torch

import cuda.tile as ct

from ops.interpreter import KernelTypeError
from ops.interpreter.dtypes import CT_DTYPE
from ops.runtime.launch import launch
from tests.interpreter.helpers import (
    evaluate,
    randint,
    randn,
    rounded,
    semantics_args,
    semantics_probe,
    tf32,
)


# ---------------------------------------------------------------------------
# Results the GPU defines exactly
# ---------------------------------------------------------------------------

def test_semantics_probe_cpu():
    args = semantics_args()
    launch(1, semantics_probe, args)
    f, i = args[0], args[1]
    assert args[2].tolist() == [0, 2**31 - 1, -2**31, 2**31 - 1, -2**31, 2, -2, 0,
                                0, 0, 123, -123, 2, -2, 7, 0]
    assert args[3].tolist() == [(v // 7) for v in i.tolist()]
    assert args[4].tolist() == [(v % -7) for v in i.tolist()]
    half = torch.tensor(0.5)
    assert torch.equal(args[5], torch.fmax(f, half))  # NaN ignored: no NaN left
    torch.testing.assert_close(args[6], torch.minimum(f, half), rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------
# Elementwise arithmetic and promotion
# ---------------------------------------------------------------------------

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


BINARY = {
    "add": (lambda x, y: x + y, lambda x, y: x + y),
    "sub": (lambda x, y: x - y, lambda x, y: x - y),
    "mul": (lambda x, y: x * y, lambda x, y: x * y),
    "truediv": (lambda x, y: x / y, lambda x, y: x / y),
    "floordiv": (lambda x, y: x // y, lambda x, y: torch.floor(x / y)),
    "mod": (lambda x, y: x % y, lambda x, y: torch.remainder(x, y)),
    "maximum": (ct.maximum, torch.maximum),
    "minimum": (ct.minimum, torch.minimum),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", list(BINARY))
def test_binary_float_ops(name, dtype):
    tile_fn, torch_fn = BINARY[name]
    x, y = randn(8, 16, dtype=dtype, seed=13), randn(1, 16, dtype=dtype, seed=14)  # broadcast
    result = evaluate(tile_fn, x, y)
    assert result.dtype == CT_DTYPE[dtype]
    expected = rounded(torch_fn, x, y, dtype=dtype)
    torch.testing.assert_close(result._t, expected, rtol=0, atol=0, equal_nan=True)


def test_binary_int_ops_follow_python():
    x, y = randint(4, 8, seed=15), randint(4, 8, seed=16)
    for tile_fn, py_fn in [(lambda a, b: a // b, lambda a, b: a // b),
                           (lambda a, b: a % b, lambda a, b: a % b),
                           (lambda a, b: a * b - a, lambda a, b: a * b - a),
                           (lambda a, b: a & b, lambda a, b: a & b),
                           (lambda a, b: a | b, lambda a, b: a | b),
                           (lambda a, b: a ^ b, lambda a, b: a ^ b),
                           (lambda a, b: ~a, lambda a, b: ~a),
                           (lambda a, b: a << 2, lambda a, b: a << 2),
                           (lambda a, b: a >> 1, lambda a, b: a >> 1)]:
        result = evaluate(tile_fn, x, y)
        assert result.dtype == ct.int32
        expected = [[py_fn(a, b) for a, b in zip(r, s)] for r, s in zip(x.tolist(), y.tolist())]
        assert result._t.tolist() == expected


def test_float_mod_and_floordiv_signs():
    x = torch.tensor([5.5, -5.5, 5.5, -5.5, 0.0, -7.0, 3.0, 1e-3])
    y = torch.tensor([2.0, 2.0, -2.0, -2.0, 3.0, 7.0, -1.5, -1.0])
    mod = evaluate(lambda a, b: a % b, x, y)._t
    # Python's % on the same float32 inputs, in float64: the sign follows y.
    expected = torch.tensor([a % b for a, b in zip(x.tolist(), y.tolist())])
    torch.testing.assert_close(mod, expected, rtol=1e-6, atol=0)
    assert torch.equal(torch.signbit(mod[mod != 0]), torch.signbit(y[mod != 0]))
    assert evaluate(lambda a, b: a // b, x, y)._t.tolist() == [
        math.floor(a / b) for a, b in zip(x.tolist(), y.tolist())]


@pytest.mark.parametrize("fn,expected", [
    (lambda t: t + 1.5, ct.bfloat16),                        # a scalar: the tile wins
    (lambda t: t.astype(ct.int32) + 1.5, ct.float32),        # a stronger scalar wins
    (lambda t: t.astype(ct.int8) + 3, ct.int8),
    (lambda t: t.astype(ct.int32) / 2, ct.float32),          # true division gives float
    (lambda t: (t > 0) + 1, ct.int32),
    (lambda t: t + t.astype(ct.float32), ct.float32),        # two tiles: cuTile's table
    (lambda t: t.astype(ct.int16) + t.astype(ct.int32), ct.int32),
    (lambda t: t ** 2, ct.bfloat16),
    (lambda t: -(t > 0), ct.int32),
    (lambda t: ct.exp(t.astype(ct.int32)), ct.float32),     # float math on ints -> float32
    (lambda t: ct.where(t > 0, t, 0), ct.bfloat16),
    (lambda t: ct.where(t > 0, t, t.astype(ct.float32)), ct.float32),
    (lambda t: ct.where(t > 0, 1, 0.5), ct.float32),
])
def test_promotion(fn, expected):
    assert evaluate(fn, randn(16, dtype=torch.bfloat16)).dtype == expected


@pytest.mark.parametrize("fn,message", [
    (lambda t: t + t.astype(ct.float16), "Implicit promotion of bfloat16 and float16"),
    (lambda t: (t > 0) + (t < 0), "does not support bool"),
    (lambda t: t.astype(ct.int8) + 1000, "out of range of int8"),
    (lambda t: t & t, "needs integers or booleans"),
    (lambda t: t.reshape((4, 4)) + t.reshape((2, 8)), "not broadcastable"),
    (lambda t: ct.floor(t.astype(ct.int32)), "does not support int32"),
])
def test_elementwise_errors(fn, message):
    with pytest.raises(KernelTypeError, match=message):
        evaluate(fn, randn(16, dtype=torch.bfloat16))


def test_scalars_are_rounded_to_the_tile_dtype():
    x = randn(16, dtype=torch.bfloat16)
    result = evaluate(lambda t: t * 0.1, x)
    # 0.1 becomes a bfloat16 constant, then the product is rounded once.
    expected = (x.float() * torch.tensor(0.1, dtype=torch.bfloat16).float()).bfloat16()
    assert torch.equal(result._t, expected)


def test_comparisons_give_bool_tiles():
    x, y = randn(16, seed=17), randn(16, seed=18)
    for tile_fn, torch_fn in [(lambda a, b: a < b, torch.lt), (lambda a, b: a <= b, torch.le),
                              (lambda a, b: a > b, torch.gt), (lambda a, b: a >= b, torch.ge),
                              (lambda a, b: a == a, lambda a, b: a == a),
                              (lambda a, b: a != b, torch.ne)]:
        result = evaluate(tile_fn, x, y)
        assert result.dtype == ct.bool_ and torch.equal(result._t, torch_fn(x, y))


UNARY = {
    "exp": (ct.exp, torch.exp), "exp2": (ct.exp2, torch.exp2),
    "log": (lambda t: ct.log(abs(t)), lambda t: torch.log(t.abs())),
    "log2": (lambda t: ct.log2(abs(t)), lambda t: torch.log2(t.abs())),
    "sqrt": (lambda t: ct.sqrt(abs(t)), lambda t: torch.sqrt(t.abs())),
    "rsqrt": (lambda t: ct.rsqrt(abs(t)), lambda t: torch.rsqrt(t.abs())),
    "abs": (ct.abs, torch.abs), "neg": (lambda t: -t, torch.neg),
    "tanh": (ct.tanh, torch.tanh), "sin": (ct.sin, torch.sin), "cos": (ct.cos, torch.cos),
    "floor": (ct.floor, torch.floor), "ceil": (ct.ceil, torch.ceil),
    "pow": (lambda t: ct.pow(abs(t), 1.5), lambda t: torch.pow(t.abs(), 1.5)),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_float_ops(name, dtype):
    tile_fn, torch_fn = UNARY[name]
    x = randn(4, 16, dtype=dtype, seed=19) * 3
    result = evaluate(tile_fn, x)
    assert result.dtype == CT_DTYPE[dtype]
    assert torch.equal(result._t, rounded(torch_fn, x, dtype=dtype))


def test_isnan_and_nan_handling_of_minimum_maximum():
    x = torch.tensor([1.0, math.nan, -2.0, math.nan])
    y = torch.tensor([0.0, 3.0, math.nan, math.nan])
    assert evaluate(ct.isnan, x)._t.tolist() == [False, True, False, True]
    # Default: a NaN operand is ignored; propagate_nan=True makes it win.
    assert torch.equal(evaluate(ct.maximum, x, y)._t.nan_to_num(9), torch.tensor([1., 3, -2, 9]))
    got = evaluate(lambda a, b: ct.minimum(a, b, propagate_nan=True), x, y)._t
    assert torch.equal(got.nan_to_num(9), torch.tensor([0., 9, 9, 9]))


# ---------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------

def test_astype_rounds_like_the_gpu():
    x = randn(256, seed=20) * 100
    assert torch.equal(evaluate(lambda t: t.astype(ct.bfloat16), x)._t, x.bfloat16())
    assert torch.equal(evaluate(lambda t: t.astype(ct.float16), x)._t, x.half())
    assert torch.equal(evaluate(lambda t: t.astype(ct.tfloat32), x)._t, tf32(x))
    # Ties go to even: 1 + 2**-11 is halfway between 1 and 1 + 2**-10.
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), math.inf, math.nan,
                         -math.inf, 3.4e38, 1e-40])
    got = evaluate(lambda t: t.astype(ct.tfloat32), ties)._t
    assert got[:4].tolist() == [1.0, 1 + 2**-9, -1.0, math.inf] and math.isnan(got[4])
    assert got[5:].tolist() == tf32(ties[5:]).tolist()  # -inf, overflow to inf, subnormal


def test_float_to_int_truncates_and_saturates():
    x = torch.tensor([2.9, -2.9, 300.0, -300.0, math.nan, math.inf, 1e20, -1e20])
    assert evaluate(lambda t: t.astype(ct.int8), x)._t.tolist() == [2, -2, 127, -128, 0, 127,
                                                                      127, -128]
    assert evaluate(lambda t: t.astype(ct.int64), x)._t.tolist()[6] == 2**63 - 1
    assert evaluate(lambda t: t.astype(ct.bool_), x)._t.tolist() == [True] * 8


def test_bitcast():
    x = torch.tensor([1.0, -2.0, 0.5, 0.0])
    assert evaluate(lambda t: ct.bitcast(t, ct.int32), x)._t.tolist() == \
        x.view(torch.int32).tolist()
