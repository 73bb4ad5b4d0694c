"""Creating tiles (ops/interpreter/creation.py): full, zeros, ones, arange, astile."""
import pytest

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
