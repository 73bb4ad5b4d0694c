"""Tests of the CPU tile interpreter (ops/interpreter.py) and the launcher (ops/launch.py).

Most tests run on the CPU and compare an interpreted kernel with plain torch.
Inputs are random (seeded generators, never zeros), outputs are filled with
NaN (or an obviously wrong integer) before a kernel writes them, and tile
shapes are chosen so that the last tiles stick out of the arrays.

Exactness: an elementwise operation is emulated as "compute in float32,
round once to the tile dtype", which is also how the references below are
computed, so those compare bit for bit.  Sums and products of many terms are
compared with a tolerance because the summation order differs.

Tests marked ``gpu`` run the example kernels on a CUDA GPU with the same
inputs and compare the GPU's output with the interpreter's.
"""
import inspect
import io
import math
import sys

import pytest
import torch

import cuda.tile as ct
from cuda.tile import load as tile_load  # a kernel may import operations by name

from ops import interpreter
from ops.interpreter import KernelError, KernelTypeError, KernelValueError
from ops.launch import interpreting, launch
from tests import example_kernels as ek

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


def line_of(marker):
    """The line number of the line in this file ending with the comment `# marker`."""
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    return next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(f"# {marker}"))


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


def tf32(t):
    """float32 rounded to 10 mantissa bits, nearest-even, written independently."""
    bits = t.view(torch.int32).to(torch.int64)
    keep, rest = bits >> 13, bits & 0x1FFF
    up = (rest > 0x1000) | ((rest == 0x1000) & (keep & 1 == 1))
    return ((keep + up.long()) << 13).to(torch.int32).view(torch.float32)


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

def _array(dtype, ndim):
    import cuda.tile.compilation as cc
    return cc.ArrayConstraint(dtype, ndim, index_dtype=ct.int32, stride_lower_bound_incl=0,
                              alias_groups=[], may_alias_internally=False)


def _compile(kernel, parameters):
    import cuda.tile.compilation as cc
    signature = cc.KernelSignature(parameters,
                                   calling_convention=cc.CallingConvention.cutile_python_v1())
    binary = io.BytesIO()
    cc.export_kernel(kernel, [signature], binary, gpu_code="sm_90", output_format="cubin")
    return binary.getvalue()


AOT_CASES = {
    "vector_add": (ek.vector_add, lambda: [_array(ct.float32, 1)] * 3 + [128]),
    "matmul_f32": (ek.matmul, lambda: [_array(ct.float32, 2)] * 3 + [32, 32, 16, False]),
    "matmul_tf32": (ek.matmul, lambda: [_array(ct.float32, 2)] * 3 + [32, 32, 16, True]),
    "matmul_bf16": (ek.matmul, lambda: [_array(ct.bfloat16, 2)] * 2
                    + [_array(ct.float32, 2), 32, 32, 16, False]),
    "matmul_f16": (ek.matmul, lambda: [_array(ct.float16, 2)] * 2
                   + [_array(ct.float32, 2), 32, 32, 16, False]),
    "chunk_cumsum": (ek.chunk_cumsum, lambda: [_array(ct.bfloat16, 2), _array(ct.float32, 2), 64]),
}


@pytest.mark.parametrize("case", list(AOT_CASES))
def test_example_kernels_compile_for_sm90(case):
    kernel, parameters = AOT_CASES[case]
    assert len(_compile(kernel, parameters())) > 0


# ---------------------------------------------------------------------------
# The same inputs on a GPU: interpreter vs ct.launch
# ---------------------------------------------------------------------------

def _on_gpu_and_cpu(grid, kernel, args):
    """Run kernel on CPU copies and CUDA copies of args; return both (CPU tensors)."""
    cpu = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    launch(grid, kernel, cpu)
    launch(grid, kernel, gpu)
    torch.cuda.synchronize()
    return cpu, [a.cpu() if isinstance(a, torch.Tensor) else a for a in gpu]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_vector_add(dtype):
    args = (randn(1000, dtype=dtype, seed=1), randn(1000, dtype=dtype, seed=2),
            poisoned(1000, dtype=dtype), 128)
    cpu, gpu = _on_gpu_and_cpu(8, ek.vector_add, args)
    # One correctly rounded addition per element on both sides: identical bits.
    assert torch.equal(gpu[2], cpu[2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,use_tf32", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float16, False), (torch.float32, True)])
def test_gpu_matmul(dtype, use_tf32):
    args = (randn(100, 70, dtype=dtype, seed=3), randn(70, 90, dtype=dtype, seed=4),
            poisoned(100, 90), 32, 32, 16, use_tf32)
    cpu, gpu = _on_gpu_and_cpu((4, 3), ek.matmul, args)
    # Both sides form the same exact float32 products and add 70 of them in
    # different orders: at most 70 half-ulps of |sum| < 32, so atol 1e-4.
    # If the GPU rounded plain float32 operands to tf32 (or rounded tf32
    # differently from nearest-even), errors would be ~1e-2 and this fails.
    torch.testing.assert_close(gpu[2], cpu[2], rtol=0, atol=1e-4)


@pytest.mark.gpu
def test_gpu_chunk_cumsum():
    args = (randn(3, 200, seed=5), poisoned(3, 200), 64)
    cpu, gpu = _on_gpu_and_cpu((4, 3), ek.chunk_cumsum, args)
    # float32 prefix sums of <= 64 terms below ~25, summed in a different
    # order on the GPU (a parallel scan): at most 64 half-ulps, atol 1e-4.
    torch.testing.assert_close(gpu[1], cpu[1], rtol=0, atol=1e-4)


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


def _semantics_args():
    f = torch.tensor([math.nan, math.inf, -math.inf, 3e9, -3e9, 2.7, -2.7, 0.5,
                      -0.0, 1e-30, 123.9, -123.9, 2.5, -2.5, 7.0, math.nan])
    i = torch.arange(-8, 8, dtype=torch.int32) * 5
    return (f, i, poisoned(16, dtype=torch.int32), poisoned(16, dtype=torch.int32),
            poisoned(16, dtype=torch.int32), poisoned(16), poisoned(16), 16)


def test_semantics_probe_cpu():
    args = _semantics_args()
    launch(1, semantics_probe, args)
    f, i = args[0], args[1]
    assert args[2].tolist() == [0, 2**31 - 1, -2**31, 2**31 - 1, -2**31, 2, -2, 0,
                                0, 0, 123, -123, 2, -2, 7, 0]
    assert args[3].tolist() == [(v // 7) for v in i.tolist()]
    assert args[4].tolist() == [(v % -7) for v in i.tolist()]
    half = torch.tensor(0.5)
    assert torch.equal(args[5], torch.fmax(f, half))  # NaN ignored: no NaN left
    torch.testing.assert_close(args[6], torch.minimum(f, half), rtol=0, atol=0, equal_nan=True)


def test_semantics_probe_compiles_for_sm90():
    params = ([_array(ct.float32, 1), _array(ct.int32, 1)] + [_array(ct.int32, 1)] * 3
              + [_array(ct.float32, 1)] * 2 + [16])
    assert len(_compile(semantics_probe, params)) > 0


@pytest.mark.gpu
def test_gpu_semantics_probe():
    cpu, gpu = _on_gpu_and_cpu(1, semantics_probe, _semantics_args())
    names = ["float->int32", "int // 7", "int % -7", "maximum(x, 0.5)",
             "minimum(x, 0.5, propagate_nan=True)"]
    for k, name in enumerate(names, start=2):
        torch.testing.assert_close(gpu[k], cpu[k], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{name}: GPU {gpu[k].tolist()} vs "
                                                 f"interpreter {cpu[k].tolist()}\n{m}")


# ---------------------------------------------------------------------------
# Loads and stores
# ---------------------------------------------------------------------------

@ct.kernel
def copy_2d(src, dst, TM: ct.Constant[int], TN: ct.Constant[int]):
    tile = ct.load(src, (ct.bid(0), ct.bid(1)), (TM, TN))
    ct.store(dst, (ct.bid(0), ct.bid(1)), tile)


@ct.kernel
def copy_transposed(src, dst, TM: ct.Constant[int], TN: ct.Constant[int]):
    # order="F" reads src (N, M) as if it were (M, N): the tile is src's transpose.
    tile = ct.load(src, (ct.bid(0), ct.bid(1)), (TM, TN), order="F")
    ct.store(dst, (ct.bid(0), ct.bid(1)), tile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_load_store_partial_tiles(dtype):
    if dtype == torch.bool:
        src = randn(37, 50, seed=6) > 0
        dst = ~src  # every element starts wrong
    else:
        src = randint(37, 50, seed=6) if dtype == torch.int32 else randn(37, 50, dtype=dtype)
        dst = poisoned(37, 50, dtype=dtype)
    launch((3, 4), copy_2d, (src, dst, 16, 16))
    assert torch.equal(dst, src)


def test_load_order_f_and_permutation():
    src = randn(50, 37, seed=7)
    dst = poisoned(37, 50)
    launch((3, 4), copy_transposed, (src, dst, 16, 16))
    assert torch.equal(dst, src.T)

    x = randn(4, 8, 2, seed=8)  # order (0, 2, 1): tile[i, j, k] = x[i, k, j]
    results = []

    @ct.kernel
    def permuted(a):
        results.append(ct.load(a, (0, 0, 0), (4, 2, 8), order=(0, 2, 1)))

    interpreter.launch(1, permuted, (x,))
    assert torch.equal(results[0]._t, x.permute(0, 2, 1))


@pytest.mark.parametrize("mode,value", [
    (ct.PaddingMode.ZERO, 0.0), (ct.PaddingMode.NEG_ZERO, -0.0),
    (ct.PaddingMode.POS_INF, math.inf), (ct.PaddingMode.NEG_INF, -math.inf),
    (ct.PaddingMode.NAN, math.nan), (ct.PaddingMode.UNDETERMINED, math.nan)])
def test_padding_modes(mode, value):
    x = randn(10, seed=9)
    results = []

    @ct.kernel
    def pad(a):
        results.append(ct.load(a, (1,), (8,), padding_mode=mode))  # elements 8..15 of 10

    interpreter.launch(1, pad, (x,))
    tile = results[0]._t
    assert torch.equal(tile[:2], x[8:])
    expected = torch.full((6,), value)
    assert torch.equal(tile[2:].nan_to_num(1.25), expected.nan_to_num(1.25))
    assert torch.equal(torch.signbit(tile[2:]), torch.signbit(expected))


def test_undetermined_padding_poisons_integers_and_float_modes_need_floats():
    x = randint(10)
    results = []

    @ct.kernel
    def pad(a, MODE: ct.Constant[int]):
        mode = ct.PaddingMode.UNDETERMINED if MODE == 0 else ct.PaddingMode.NAN
        results.append(ct.load(a, (1,), (8,), padding_mode=mode))

    interpreter.launch(1, pad, (x, 0))
    assert results[0]._t[2:].tolist() == [-2**31] * 6
    with pytest.raises(KernelTypeError, match="floating-point array"):
        interpreter.launch(1, pad, (x, 1))


def test_scalar_and_0d_tiles_load_and_store():
    x = randn(3, 5, seed=10)
    out = poisoned(3, 5)

    @ct.kernel
    def scalars(a, b):
        v = ct.load(a, (1, 2), ())          # a 0-d tile: one element
        ct.store(b, (0, 0), v * 2)          # a 0-d tile is stored as one element
        ct.store(b, (0, 1), 1.5)            # so is a Python scalar

    launch(1, scalars, (x, out))
    assert out[0, 0] == x[1, 2] * 2 and out[0, 1] == 1.5
    assert torch.isnan(out[0, 2:]).all() and torch.isnan(out[1:]).all()


def test_store_widens_implicitly_but_never_narrows():
    x = randn(16, dtype=torch.bfloat16, seed=11)
    wide, narrow = poisoned(16), poisoned(16, dtype=torch.bfloat16)

    @ct.kernel
    def widen(a, b):
        ct.store(b, (0,), ct.load(a, (0,), (16,)))

    @ct.kernel
    def narrow_it(a, b):
        ct.store(b, (0,), ct.load(a, (0,), (16,)).astype(ct.float32))

    launch(1, widen, (x, wide))
    assert torch.equal(wide, x.float())
    with pytest.raises(KernelTypeError, match="cannot implicitly cast a float32 tile"):
        launch(1, narrow_it, (x, narrow))


@pytest.mark.parametrize("case,error,message", [
    ("shape_not_pow2", KernelTypeError, r"ct.load shape \(48,\) must be powers of two"),
    ("index_rank", KernelTypeError, "has 2 entries but the array has rank 1"),
    ("store_rank", KernelTypeError, "2-d tile cannot be stored into a 1-d array"),
    ("fully_outside", KernelValueError, "entirely outside the array"),
    ("unchecked_partial", KernelValueError, "check_bounds=False"),
])
def test_memory_errors(case, error, message):
    x = randn(100, seed=12)

    @ct.kernel
    def bad(a, CASE: ct.Constant[str]):
        if CASE == "shape_not_pow2":
            ct.load(a, (0,), (48,))
        elif CASE == "index_rank":
            ct.load(a, (0, 0), (16,))
        elif CASE == "store_rank":
            ct.store(a, (0,), ct.zeros((4, 4), ct.float32))
        elif CASE == "fully_outside":
            ct.load(a, (7,), (16,))  # elements 112..127 of 100
        else:
            ct.load(a, (6,), (16,), check_bounds=False)  # elements 96..111: partial

    with pytest.raises(error, match=message):
        launch(1, bad, (x, case))


# ---------------------------------------------------------------------------
# Blocks and grids
# ---------------------------------------------------------------------------

def test_bid_num_blocks_num_tiles_and_block_order():
    seen = []

    @ct.kernel
    def where_am_i(a, T: ct.Constant[int]):
        seen.append((ct.bid(0), ct.bid(1), ct.bid(2), ct.num_blocks(0), ct.num_blocks(1),
                     ct.num_blocks(2), ct.num_tiles(a, 1, (1, T)), ct.cdiv(a.shape[1], T)))

    launch((2, 3, 2), where_am_i, (randn(4, 100), 32))
    assert [s[:3] for s in seen] == [(x, y, z) for z in range(2) for y in range(3)
                                     for x in range(2)]
    assert all(s[3:] == (2, 3, 2, 4, 4) for s in seen)


def test_array_attributes_and_argument_kinds():
    seen = {}

    @ct.kernel
    def attributes(a, scale: float, n, flag, C: ct.Constant[float]):
        seen.update(shape=a.shape, dtype=a.dtype, ndim=a.ndim, strides=a.strides,
                    n=n, flag=flag, C=C,
                    product=(ct.load(a, (0, 0), (2, 4)) * scale).dtype)

    x = randn(6, 8, dtype=torch.bfloat16)[:, ::2]  # non-contiguous view
    launch(1, attributes, (x, 0.5, 3, True, 2.5))
    assert seen["shape"] == (6, 4) and seen["dtype"] == ct.bfloat16 and seen["ndim"] == 2
    assert seen["strides"] == (8, 2)
    assert (seen["n"], seen["flag"], seen["C"]) == (3, True, 2.5)
    # A float argument is a float32 value on the GPU: bf16 tile * scale is float32.
    assert seen["product"] == ct.float32


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
    assert result.dtype == interpreter._CT_DTYPE[dtype]
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
    assert result.dtype == interpreter._CT_DTYPE[dtype]
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


# ---------------------------------------------------------------------------
# Reductions and scans
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# Matrix multiplication
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,acc", [(torch.float32, ct.float32), (torch.bfloat16, ct.float32),
                                       (torch.float16, ct.float16), (torch.float64, ct.float64)])
def test_mma(dtype, acc):
    x, y = randn(16, 32, dtype=dtype, seed=29), randn(32, 8, dtype=dtype, seed=30)
    c = randn(16, 8, seed=31).to(interpreter._TORCH_DTYPE[acc])
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


# ---------------------------------------------------------------------------
# Creating and reshaping tiles
# ---------------------------------------------------------------------------

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


def test_shape_operations():
    x = randn(2, 4, 8, seed=36)
    for tile_fn, torch_fn in [
            (lambda t: t.reshape((8, -1)), lambda t: t.reshape(8, -1)),
            (lambda t: ct.permute(t, (2, 0, 1)), lambda t: t.permute(2, 0, 1)),
            (lambda t: t.transpose(0, 2), lambda t: t.transpose(0, 2)),
            (lambda t: ct.reshape(t, (8, 8)).transpose(), lambda t: t.reshape(8, 8).T),
            (lambda t: t[:, None], lambda t: t[:, None]),
            (lambda t: t[..., None], lambda t: t[..., None]),
            (lambda t: ct.expand_dims(t, -1), lambda t: t.unsqueeze(-1)),
            (lambda t: ct.broadcast_to(ct.extract(t, (0, 0, 0), (2, 4, 1)), (2, 4, 8)),
             lambda t: t[:, :, :1].expand(2, 4, 8)),
            (lambda t: ct.cat((t, t * 2), 1), lambda t: torch.cat([t, t * 2], 1)),
            (lambda t: ct.extract(t, (1, 0, 3), (1, 4, 2)), lambda t: t[1:2, 0:4, 6:8]),
            (lambda t: t.extract((0, 1, 1), ()).reshape((1,)), lambda t: t[0, 1, 1].reshape(1)),
            (lambda t: ct.extract(t, (0, 0, 0), (1, 1, 1)).item(), lambda t: t[0, 0, 0])]:
        assert torch.equal(evaluate(tile_fn, x)._t, torch_fn(x))
    expected = x.clone()
    expected[1, 2:4, 4:8] = -1
    got = evaluate(lambda t: ct.insert(t, (1, 1, 1), ct.full((1, 2, 4), -1.0, ct.float32)), x)
    assert torch.equal(got._t, expected)


@pytest.mark.parametrize("fn,message", [
    (lambda t: t.reshape((3, -1)), "cannot reshape"),
    (lambda t: t[0], "directly indexing a tile is not supported"),
    (lambda t: ct.extract(t, (4, 0), (1, 4)), "outside the grid"),
    (lambda t: ct.cat((t, t.astype(ct.float16)), 0), "same dtype"),
    (lambda t: ct.transpose(t.reshape((2, 2, 4))), "give axis0 and axis1"),
    (lambda t: ct.permute(t, (0, 0)), "not a permutation"),
])
def test_shape_errors(fn, message):
    with pytest.raises(KernelError, match=message):
        evaluate(fn, randn(4, 4))


# ---------------------------------------------------------------------------
# How kernels run: helpers, debugging, errors
# ---------------------------------------------------------------------------

def double_it(tile):
    """A plain helper: its ct calls are emulated too."""
    return ct.mul(tile, 2)


@ct.function
def add_one(tile):
    return tile + 1


def make_scaling_kernel(factor):
    """A kernel built by a factory: `factor` lives in a closure cell."""
    @ct.kernel
    def scale(a, b, T: ct.Constant[int], offset=0.0):
        t = tile_load(a, (ct.bid(0),), (T,))
        ct.store(b, (ct.bid(0),), add_one(double_it(t)) * factor + offset)
    return scale


def test_helpers_closures_imports_and_defaults():
    x = randn(40, seed=37)
    out = poisoned(40)
    launch(3, make_scaling_kernel(3.0), (x, out, 16))
    torch.testing.assert_close(out, (x * 2 + 1) * 3, rtol=0, atol=0)


def test_print_and_printf_inside_kernels(capsys):
    @ct.kernel
    def chatty(a):
        t = ct.load(a, (0,), (4,))
        print("block", ct.bid(0), t)
        print(f"{t:.1f}")
        ct.print("sum:", ct.sum(t.astype(ct.int32)))
        ct.printf("%d|%5.2f\n", ct.bid(0), t)

    launch(2, chatty, (torch.tensor([1.0, 2.5, -3.0, 4.0]),))
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == ["block 0 [1.000000, 2.500000, -3.000000, 4.000000]",
                         "[1.0, 2.5, -3.0, 4.0]", "sum: 4", "0|[ 1.00,  2.50, -3.00,  4.00]"]
    assert lines[4].startswith("block 1")


def test_breakpoint_sees_kernel_locals(monkeypatch):
    seen = {}

    def hook(*args, **kwargs):  # what pdb would be handed
        frame = sys._getframe(1)
        seen.update(name=frame.f_code.co_name, t=frame.f_locals["t"])

    monkeypatch.setattr(sys, "breakpointhook", hook)

    @ct.kernel
    def stop_here(a):
        t = ct.load(a, (0,), (4,))
        breakpoint()

    x = randn(4, seed=38)
    launch(1, stop_here, (x,))
    assert seen["name"] == "stop_here" and torch.equal(seen["t"]._t, x)


@ct.kernel
def broken_kernel(a):
    t = ct.load(a, (0,), (4,))
    u = ct.reshape(t, (3, -1))  # BROKEN
    ct.store(a, (0,), u)


def test_errors_name_the_kernel_line_and_tracebacks_point_at_it():
    with pytest.raises(KernelTypeError) as info:
        launch(1, broken_kernel, (randn(8),))
    line = line_of("BROKEN")
    assert str(info.value).startswith(f"test_interpreter.py:{line} in broken_kernel: ct.reshape")
    frames = [(f.f_code.co_name, lineno) for f, lineno in
              __import__("traceback").walk_tb(info.value.__traceback__)]
    assert ("broken_kernel", line) in frames
    if sys.version_info >= (3, 11):  # exception notes
        assert "block (0, 0, 0)" in "".join(info.value.__notes__)


def test_unsupported_operations_fail_loudly():
    @ct.kernel
    def atomic(a):
        ct.atomic_add(a, (0,), 1.0)

    with pytest.raises(NotImplementedError, match="ct.atomic_add is not supported"):
        launch(1, atomic, (randn(4),))


def test_truth_value_of_a_tile():
    with pytest.raises(KernelTypeError, match="ct.minimum or ct.maximum"):
        evaluate(lambda t: max(t, t * 2), randn(4))
    assert evaluate(lambda t: 1 if ct.sum(t) > 0 else -1, torch.ones(4)) == 1


def test_static_and_runtime_assertions():
    with pytest.raises(AssertionError, match="static assertion failed: need 8"):
        evaluate(lambda t: ct.static_assert(t.shape[0] == 8, "need 8"), randn(4))
    with pytest.raises(AssertionError, match="ct.assert_ failed: positive"):
        evaluate(lambda t: ct.assert_(t > 0, "positive"), -torch.ones(4))
    with pytest.raises(KernelValueError, match="not divisible by 16"):
        evaluate(lambda t: ct.assume_divisible_by(t.shape[0] + 2, 16), randn(4))
    assert evaluate(lambda t: ct.static_eval(t.shape[0] * 2), randn(4)) == 8
    assert evaluate(lambda t: sum(i for i in ct.static_iter(range(3))), randn(4)) == 3


def test_is_interpreting():
    assert not interpreter.is_interpreting()
    assert evaluate(lambda t: interpreter.is_interpreting(), randn(4))


def test_every_emulation_is_named_after_a_real_stub():
    import cuda.tile._stub as stub
    for name in interpreter._OPS:
        obj = stub
        for part in name.split("."):
            obj = getattr(obj, part)
        assert callable(obj), name


# ---------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------

def test_launcher_picks_the_device_and_rejects_mixtures():
    a = randn(10)
    assert interpreting((a, 3)) and interpreting(())
    with pytest.raises(ValueError, match="mix devices"):
        launch(1, ek.vector_add, (a, torch.empty(10, device="meta"), a, 16))
    with pytest.raises(ValueError, match="meta"):
        launch(1, ek.vector_add, (torch.empty(10, device="meta"),) * 3 + (16,))
    with pytest.raises(TypeError, match="expected a @ct.kernel"):
        launch(1, ek.vector_add._pyfunc, (a, a, a, 16))
    with pytest.raises(ValueError, match="grid"):
        launch((0,), ek.vector_add, (a, a, a, 16))
