"""The same inputs on a GPU: the interpreter against ``ct.launch``.

Every test here is marked ``gpu`` and skipped without a CUDA GPU.
"""
import pytest
import torch

from ops import examples as ek
from tests.interpreter.helpers import (on_gpu_and_cpu, poisoned, randn, semantics_args,
                                       semantics_probe)




@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_vector_add(dtype):
    args = (randn(1000, dtype=dtype, seed=1), randn(1000, dtype=dtype, seed=2),
            poisoned(1000, dtype=dtype), 128)
    cpu, gpu = on_gpu_and_cpu(8, ek.vector_add, args)
    # One correctly rounded addition per element on both sides: identical bits.
    assert torch.equal(gpu[2], cpu[2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,use_tf32", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float16, False), (torch.float32, True)])
def test_gpu_matmul(dtype, use_tf32):
    args = (randn(100, 70, dtype=dtype, seed=3), randn(70, 90, dtype=dtype, seed=4),
            poisoned(100, 90), 32, 32, 16, use_tf32)
    cpu, gpu = on_gpu_and_cpu((4, 3), ek.matmul, args)
    # Both sides form the same exact float32 products and add 70 of them in
    # different orders: at most 70 half-ulps of |sum| < 32, so atol 1e-4.
    # If the GPU rounded plain float32 operands to tf32 (or rounded tf32
    # differently from nearest-even), errors would be ~1e-2 and this fails.
    torch.testing.assert_close(gpu[2], cpu[2], rtol=0, atol=1e-4)


@pytest.mark.gpu
def test_gpu_chunk_cumsum():
    args = (randn(3, 200, seed=5), poisoned(3, 200), 64)
    cpu, gpu = on_gpu_and_cpu((4, 3), ek.chunk_cumsum, args)
    # float32 prefix sums of <= 64 terms below ~25, summed in a different
    # order on the GPU (a parallel scan): at most 64 half-ulps, atol 1e-4.
    torch.testing.assert_close(gpu[1], cpu[1], rtol=0, atol=1e-4)


@pytest.mark.gpu
def test_gpu_semantics_probe():
    cpu, gpu = on_gpu_and_cpu(1, semantics_probe, semantics_args())
    names = ["float->int32", "int // 7", "int % -7", "maximum(x, 0.5)",
             "minimum(x, 0.5, propagate_nan=True)"]
    for k, name in enumerate(names, start=2):
        torch.testing.assert_close(gpu[k], cpu[k], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{name}: GPU {gpu[k].tolist()} vs "
                                                 f"interpreter {cpu[k].tolist()}\n{m}")
