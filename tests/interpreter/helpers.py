"""Shared helpers of the interpreter's tests: seeded inputs, a tile probe, references.

Inputs are random (seeded generators, never zeros), outputs are filled with
NaN (or an obviously wrong integer) before a kernel writes them, and tile
shapes are chosen so that the last tiles stick out of the arrays.

Exactness: an elementwise operation is emulated as "compute in float32,
round once to the tile dtype", which is also how the references are
computed, so those compare bit for bit.  Sums and products of many terms are
compared with a tolerance because the summation order differs.
"""
import io
import math

import torch

import cuda.tile as ct

from ops import interpreter


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def randint(*shape, low=-50, high=50, dtype=torch.int32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(low, high, shape, generator=g, dtype=torch.int64)
    return torch.where(t == 0, 7, t).to(dtype)  # never zero (divisors)


def poisoned(*shape, dtype=torch.float32):
    """An output buffer whose every element is obviously unwritten."""
    if dtype.is_floating_point:
        return torch.full(shape, math.nan, dtype=dtype)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype)


def evaluate(fn, *tensors):
    """Load each tensor whole as one tile, return the tile fn(*tiles) computes.

    The result is smuggled out through a Python list, which only works in the
    interpreter; it lets one test look at any tile's values and dtype.
    """
    results = []

    @ct.kernel
    def probe(arrays):
        tiles = [ct.load(a, (0,) * a.ndim, a.shape) for a in arrays]
        results.append(fn(*tiles))

    interpreter.launch((1,), probe, (tuple(tensors),))
    return results[0]


def rounded(fn, *tensors, dtype):
    """Reference: fn in float32 (integers: natively), rounded once to `dtype`."""
    if dtype.is_floating_point and dtype != torch.float64:
        return fn(*(t.float() for t in tensors)).to(dtype)
    return fn(*tensors).to(dtype)


def tf32(t):
    """float32 rounded to 10 mantissa bits, nearest-even, written independently."""
    bits = t.view(torch.int32).to(torch.int64)
    keep, rest = bits >> 13, bits & 0x1FFF
    up = (rest > 0x1000) | ((rest == 0x1000) & (keep & 1 == 1))
    return ((keep + up.long()) << 13).to(torch.int32).view(torch.float32)


# ---------------------------------------------------------------------------
# Ahead-of-time compilation for sm_90 (no GPU needed)
# ---------------------------------------------------------------------------

def array_constraint(dtype, ndim):
    import cuda.tile.compilation as cc
    return cc.ArrayConstraint(dtype, ndim, index_dtype=ct.int32, stride_lower_bound_incl=0,
                              alias_groups=[], may_alias_internally=False)


def compile_for_sm90(kernel, parameters):
    import cuda.tile.compilation as cc
    signature = cc.KernelSignature(parameters,
                                   calling_convention=cc.CallingConvention.cutile_python_v1())
    binary = io.BytesIO()
    cc.export_kernel(kernel, [signature], binary, gpu_code="sm_90", output_format="cubin")
    return binary.getvalue()


# ---------------------------------------------------------------------------
# A kernel of exactly defined results, run on the CPU, the GPU and compiled
# ---------------------------------------------------------------------------

@ct.kernel
def semantics_probe(f, i, out_int, out_div, out_mod, out_max, out_min, T: ct.Constant[int]):
    """Operations whose GPU results are exactly defined; the interpreter must match bit for bit."""
    x = ct.load(f, (0,), (T,))
    n = ct.load(i, (0,), (T,))
    ct.store(out_int, (0,), x.astype(ct.int32))    # truncation, saturation, NaN
    ct.store(out_div, (0,), n // 7)                 # floor division of negatives
    ct.store(out_mod, (0,), n % -7)                 # Python's sign rule
    ct.store(out_max, (0,), ct.maximum(x, 0.5))     # NaN operands are ignored by default
    ct.store(out_min, (0,), ct.minimum(x, 0.5, propagate_nan=True))


def semantics_args():
    f = torch.tensor([math.nan, math.inf, -math.inf, 3e9, -3e9, 2.7, -2.7, 0.5,
                      -0.0, 1e-30, 123.9, -123.9, 2.5, -2.5, 7.0, math.nan])
    i = torch.arange(-8, 8, dtype=torch.int32) * 5
    return (f, i, poisoned(16, dtype=torch.int32), poisoned(16, dtype=torch.int32),
            poisoned(16, dtype=torch.int32), poisoned(16), poisoned(16), 16)


def on_gpu_and_cpu(grid, kernel, args):
    """Run ``kernel`` on CPU copies (the interpreter) and CUDA copies (``ct.launch``) of
    ``args``; returns both argument lists, the GPU's moved back to the CPU."""
    from ops.runtime.launch import launch
    cpu = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    launch(grid, kernel, cpu)
    launch(grid, kernel, gpu)
    torch.cuda.synchronize()
    return cpu, [a.cpu() if isinstance(a, torch.Tensor) else a for a in gpu]


# ---------------------------------------------------------------------------
# An attention kernel as often written (test_builtins, test_padding)
# ---------------------------------------------------------------------------

@ct.kernel
def attention_default_padding(q, k, v, o, sm_scale: float, BLOCK_M: ct.Constant[int],
                              BLOCK_N: ct.Constant[int], HEAD_DIM: ct.Constant[int]):
    """One query block against all keys by online softmax, the running max taken by the builtin
    max() of two tiles.  Keys and values of the last, partial tile are loaded with the default
    padding; the scores of padded keys are masked to -inf, so their weights are exactly 0, but
    0 times the padded values must be 0: it is on a GPU (they read as tiny finite numbers), not
    with NaN padding.  With a key count that is a multiple of BLOCK_N nothing is padded or
    masked, and the result is plain softmax attention."""
    start_m = ct.bid(0)
    q_tile = ct.load(q, (start_m, 0), (BLOCK_M, HEAD_DIM))
    m_i = ct.full((BLOCK_M,), -math.inf, dtype=ct.float32)
    l_i = ct.zeros((BLOCK_M,), dtype=ct.float32)
    acc = ct.zeros((BLOCK_M, HEAD_DIM), dtype=ct.float32)
    n_keys = k.shape[0]
    for start_n in range(ct.num_tiles(k, 0, (BLOCK_N, HEAD_DIM))):
        k_tile = ct.load(k, (start_n, 0), (BLOCK_N, HEAD_DIM))
        v_tile = ct.load(v, (start_n, 0), (BLOCK_N, HEAD_DIM))
        s = ct.mma(q_tile, ct.transpose(k_tile), ct.zeros((BLOCK_M, BLOCK_N), dtype=ct.float32))
        offs_n = start_n * BLOCK_N + ct.arange(BLOCK_N, dtype=ct.int32)
        s = ct.where(offs_n[None, :] < n_keys, s * sm_scale, -math.inf)
        m_new = max(m_i, ct.max(s, axis=1))
        p = ct.exp(s - m_new[:, None])
        alpha = ct.exp(m_i - m_new)
        l_i = l_i * alpha + ct.sum(p, axis=1)
        acc = acc * alpha[:, None] + ct.mma(p, v_tile, ct.zeros((BLOCK_M, HEAD_DIM),
                                                                dtype=ct.float32))
        m_i = m_new
    ct.store(o, (start_m, 0), acc / l_i[:, None])
