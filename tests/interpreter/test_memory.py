"""Loads and stores (ops/interpreter/memory.py): partial tiles, orders, padding, errors."""
import math

import pytest
import torch

import cuda.tile as ct

from ops import interpreter
from ops.interpreter import KernelTypeError, KernelValueError
from ops.runtime.launch import launch
from tests.interpreter.helpers import poisoned, randint, randn


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


@ct.kernel
def store_constant(out, idx, SCATTER: ct.Constant[bool], VALUE: ct.Constant[int]):
    if SCATTER:
        ct.scatter(out, ct.load(idx, (0,), (4,)), VALUE)
    else:
        ct.store(out, (0,), VALUE)


@pytest.mark.parametrize("how", ["store", "scatter"])
@pytest.mark.parametrize("dtype,value,error", [
    (torch.bool, 1, None), (torch.bool, 0, None), (torch.bool, 2, KernelTypeError),
    (torch.int8, 127, None), (torch.int8, 300, KernelValueError),
    (torch.int8, -129, KernelValueError)],
    ids=["1-to-bool", "0-to-bool", "2-to-bool", "127-to-int8", "300-to-int8", "-129-to-int8"])
def test_python_constants_cast_as_the_compiler_casts_them(how, dtype, value, error):
    """A Python integer stored or scattered into an array: the interpreter accepts what the
    compiler compiles (0 and 1 become booleans; an integer in the array's range), refuses the
    rest with the compiler's kind of error (a type error for a kind the array cannot hold, a
    value error out of range), and store and scatter agree. The compiler's answer is asked for
    each case, by compiling the same kernel for sm_90."""
    import cuda.tile.compilation as cc
    from cuda.tile._exception import InvalidValueError, TypeCheckingError

    from tests.interpreter.helpers import array_constraint, compile_for_sm90
    params = [array_constraint(getattr(ct, "bool_" if dtype == torch.bool else "int8"), 1),
              array_constraint(ct.int32, 1), cc.ConstantConstraint(how == "scatter"),
              cc.ConstantConstraint(value)]
    compiler_error = {None: None, KernelTypeError: TypeCheckingError,
                      KernelValueError: InvalidValueError}[error]
    if compiler_error is None:
        assert len(compile_for_sm90(store_constant, params)) > 0
    else:
        with pytest.raises(compiler_error):
            compile_for_sm90(store_constant, params)
    out = torch.zeros(4, dtype=dtype) if value else torch.ones(4, dtype=dtype)
    idx = torch.arange(4, dtype=torch.int32)
    if error is None:
        launch(1, store_constant, (out, idx, how == "scatter", value))
        written = out[:1] if how == "store" else out
        assert torch.equal(written, torch.full_like(written, value))
    else:
        with pytest.raises(error, match="implicitly cast|out of range"):
            launch(1, store_constant, (out, idx, how == "scatter", value))


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
