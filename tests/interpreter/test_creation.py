"""Creating tiles (ops/interpreter/creation.py): full, zeros, ones, arange, astile."""
import pytest
import torch

import cuda.tile as ct

from ops.interpreter import KernelTypeError
from tests.interpreter.helpers import evaluate, randn


def test_factories():
    got = evaluate(lambda t: ct.full((2, 4), 3, ct.int16), randn(4))
    assert got.dtype == ct.int16 and got._t.tolist() == [[3] * 4] * 2
    assert evaluate(lambda t: ct.zeros(8, ct.float32), randn(4))._t.tolist() == [0.0] * 8
    assert evaluate(lambda t: ct.ones((2,), ct.bool_), randn(4))._t.tolist() == [True, True]
    assert evaluate(lambda t: ct.arange(8, dtype=ct.int32), randn(4))._t.tolist() == \
        list(range(8))
    assert evaluate(lambda t: ct.arange(4, dtype=ct.float32, start=2, step=-0.5),
                    randn(4))._t.tolist() == [2.0, 1.5, 1.0, 0.5]
    assert evaluate(lambda t: ct.astile(((1, 2), (3, 4)), dtype=ct.int32),
                    randn(4))._t.tolist() == [[1, 2], [3, 4]]
    fill = evaluate(lambda t: ct.full((4,), ct.sum(t), ct.float32), randn(4, seed=35))
    assert fill._t.tolist() == [randn(4, seed=35).sum().item()] * 4
    for make in (lambda t: ct.full((2, 3), 0, ct.float32), lambda t: ct.arange(12, dtype=ct.int32),
                 lambda t: ct.broadcast_to(t, (4, 12))):
        with pytest.raises(KernelTypeError, match="must be powers of two"):
            evaluate(make, randn(4))


# Python numbers as constants: rounded once from the Python float, as the compiler encodes them
# (cuTile's constant encoder). Going through float32 first would round twice: 1 + 2**-8 + 2**-30
# is 1 + 2**-8 in float32, a tie that bfloat16 breaks to 1.0, while the number itself lies above
# the midpoint of 1 and 1 + 2**-7, the nearest bfloat16.
ABOVE_A_BF16_TIE = 1 + 2**-8 + 2**-30
ABOVE_A_FP16_TIE = 1 + 2**-11 + 2**-40


@pytest.mark.parametrize("make", [
    lambda: ct.full((2,), ABOVE_A_BF16_TIE, dtype=ct.bfloat16),
    lambda: ct.ones((2,), dtype=ct.bfloat16) * ABOVE_A_BF16_TIE,
    lambda: ct.maximum(ct.zeros((2,), dtype=ct.bfloat16), ABOVE_A_BF16_TIE),
], ids=["full", "operand", "maximum"])
def test_float_constants_round_once_to_bfloat16(make):
    t = evaluate(lambda _: make(), torch.zeros(1))
    assert t.dtype == ct.bfloat16 and t._t.tolist() == [1 + 2**-7] * 2


def test_float_constants_round_once_to_float16():
    t = evaluate(lambda _: ct.full((1,), ABOVE_A_FP16_TIE, dtype=ct.float16), torch.zeros(1))
    assert t._t.tolist() == [1 + 2**-10]


def test_float8_constants_overflow_like_the_compilers_not_like_a_conversion():
    """A constant past float8's range is NaN in e4m3fn (no infinity) and inf in e5m2, as the
    compiler encodes it; a run-time conversion of the same value saturates (cvt.satfinite)."""
    got = evaluate(lambda x: (ct.full((1,), 1000.0, dtype=ct.float8_e4m3fn),
                              ct.full((1,), -1e6, dtype=ct.float8_e5m2),
                              x.astype(ct.float8_e4m3fn)), torch.full((1,), 1000.0))
    assert got[0]._t.float().isnan().all()
    assert got[1]._t.float().tolist() == [float("-inf")]
    assert got[2]._t.float().tolist() == [448.0]
