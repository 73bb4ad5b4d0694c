"""The example kernels (ops/examples.py) on the CPU against torch, and compiled
ahead of time for sm_90 (so they are valid cuTile).
"""
import pytest
import torch

import cuda.tile as ct

from ops.runtime.launch import launch
from ops import examples as ek
from tests.interpreter.helpers import (
    array_constraint,
    compile_for_sm90,
    poisoned,
    randn,
    semantics_probe,
    tf32,
)


# ---------------------------------------------------------------------------
# Example kernels on the CPU, against torch
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vector_add(dtype):
    a, b = randn(1000, dtype=dtype, seed=1), randn(1000, dtype=dtype, seed=2)
    c = poisoned(1000, dtype=dtype)
    launch(8, ek.vector_add, (a, b, c, 128))  # 8 x 128 = 1024: the last tile is partial
    # One addition, rounded once, as torch does it: bit for bit.
    assert torch.equal(c, a + b)


@pytest.mark.parametrize("dtype,use_tf32", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float16, False), (torch.float32, True)])
def test_matmul(dtype, use_tf32):
    M, K, N = 100, 70, 90  # none a multiple of the tiles: partial tiles everywhere
    a, b = randn(M, K, dtype=dtype, seed=3), randn(K, N, dtype=dtype, seed=4)
    c = poisoned(M, N)
    launch((4, 3), ek.matmul, (a, b, c, 32, 32, 16, use_tf32))
    a64, b64 = (tf32(a), tf32(b)) if use_tf32 else (a, b)
    ref = a64.double() @ b64.double()
    # Products of 16-bit or tf32 operands are exact in float32; only the 70
    # float32 additions round (|sums| < 32, half an ulp ~2e-6 each).
    torch.testing.assert_close(c.double(), ref, rtol=0, atol=1e-4)
    if use_tf32:  # and the tf32 rounding really happened
        assert (c.double() - a.double() @ b.double()).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_cumsum(dtype):
    x = randn(3, 200, dtype=dtype, seed=5)
    out = poisoned(3, 200)
    launch((4, 3), ek.chunk_cumsum, (x, out, 64))  # 200 = 3 chunks of 64 + 8
    ref = torch.cat([c.cumsum(-1) for c in x.double().split(64, dim=-1)], dim=-1)
    # float32 running sums of at most 64 terms below ~25: 64 half-ulps < 1e-4.
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------
# The example kernels compile for sm_90 (so they are valid cuTile)
# ---------------------------------------------------------------------------

AOT_CASES = {
    "vector_add": (ek.vector_add, lambda: [array_constraint(ct.float32, 1)] * 3 + [128]),
    "matmul_f32": (ek.matmul, lambda: [array_constraint(ct.float32, 2)] * 3 + [32, 32, 16, False]),
    "matmul_tf32": (ek.matmul, lambda: [array_constraint(ct.float32, 2)] * 3 + [32, 32, 16, True]),
    "matmul_bf16": (ek.matmul, lambda: [array_constraint(ct.bfloat16, 2)] * 2
                    + [array_constraint(ct.float32, 2), 32, 32, 16, False]),
    "matmul_f16": (ek.matmul, lambda: [array_constraint(ct.float16, 2)] * 2
                   + [array_constraint(ct.float32, 2), 32, 32, 16, False]),
    "chunk_cumsum": (ek.chunk_cumsum, lambda: [array_constraint(ct.bfloat16, 2), array_constraint(ct.float32, 2), 64]),
}


@pytest.mark.parametrize("case", list(AOT_CASES))
def test_example_kernels_compile_for_sm90(case):
    kernel, parameters = AOT_CASES[case]
    assert len(compile_for_sm90(kernel, parameters())) > 0


def test_semantics_probe_compiles_for_sm90():
    params = ([array_constraint(ct.float32, 1), array_constraint(ct.int32, 1)] + [array_constraint(ct.int32, 1)] * 3
              + [array_constraint(ct.float32, 1)] * 2 + [16])
    assert len(compile_for_sm90(semantics_probe, params)) > 0
