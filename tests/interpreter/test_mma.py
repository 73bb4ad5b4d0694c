"""Matrix multiplication (ops/interpreter/mma.py): ct.mma, ct.matmul and ``@``."""
import pytest
import torch

import cuda.tile as ct

from ops.interpreter import KernelTypeError
from ops.interpreter.dtypes import TORCH_DTYPE
from tests.interpreter.helpers import evaluate, randint, randn


@pytest.mark.parametrize("dtype,acc", [(torch.float32, ct.float32), (torch.bfloat16, ct.float32),
                                       (torch.float16, ct.float16), (torch.float64, ct.float64)])
def test_mma(dtype, acc):
    x, y = randn(16, 32, dtype=dtype, seed=29), randn(32, 8, dtype=dtype, seed=30)
    c = randn(16, 8, seed=31).to(TORCH_DTYPE[acc])
    got = evaluate(lambda a, b, d: ct.mma(a, b, d), x, y, c)
    assert got.dtype == acc
    expected = (x.double() @ y.double() + c.double()).to(c.dtype)
    tol = {torch.float16: 1e-2, torch.float64: 1e-12}.get(c.dtype, 1e-5)
    torch.testing.assert_close(got._t, expected, rtol=tol, atol=tol)


def test_mma_batched_int8_and_matmul():
    x, y = randn(2, 16, 32, seed=32), randn(32, 8, seed=33)  # y broadcasts over the batch
    got = evaluate(lambda a, b: ct.mma(a, b, ct.zeros((2, 16, 8), ct.float32)), x, y)
    torch.testing.assert_close(got._t, x @ y, rtol=1e-5, atol=1e-5)
    i, j = randint(16, 32, low=-128, high=128, dtype=torch.int8), randint(32, 16, dtype=torch.int8)
    got = evaluate(lambda a, b: ct.mma(a, b, ct.zeros((16, 16), ct.int32)), i, j)
    assert torch.equal(got._t, (i.long() @ j.long()).int())
    got = evaluate(lambda a, b: a @ b, x[0].bfloat16(), y.bfloat16())
    assert got.dtype == ct.bfloat16  # matmul keeps the operands' dtype
    torch.testing.assert_close(got._t.float(), x[0].bfloat16().float() @ y.bfloat16().float(),
                               rtol=1e-2, atol=5e-2)
    v = randn(32, seed=34)
    torch.testing.assert_close(evaluate(lambda a, b: a @ b, v, y)._t, v @ y)  # 1-d @ 2-d


@pytest.mark.parametrize("fn,message", [
    (lambda a, b: ct.mma(a, a, ct.zeros((16, 16), ct.float32)), "K dimensions differ"),
    (lambda a, b: ct.mma(a, b, ct.zeros((16, 16), ct.float32)), r"acc must have shape \(16, 8\)"),
    (lambda a, b: ct.mma(a, b.astype(ct.bfloat16), ct.zeros((16, 8), ct.float32)),
     "same dtype"),
    (lambda a, b: ct.mma(a, b, ct.zeros((16, 8), ct.float16)), "float32 accumulator"),
    (lambda a, b: ct.mma(a.astype(ct.int32), b.astype(ct.int32), ct.zeros((16, 8), ct.int32)),
     "unsupported operand dtype int32"),
])
def test_mma_errors(fn, message):
    with pytest.raises(KernelTypeError, match=message):
        evaluate(fn, randn(16, 32), randn(32, 8))
