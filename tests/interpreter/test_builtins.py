"""Python builtins inside kernels, as cuTile's compiler treats them."""
import builtins
import math

import cuda.tile as ct
import pytest
import torch

from ops import interpreter
from ops.interpreter import KernelTypeError
from tests.interpreter.helpers import (attention_default_padding, evaluate, on_gpu_and_cpu,
                                      poisoned, randint, randn)


def _attention_args(seed=0):
    """32 keys in tiles of 8: nothing is padded, so the kernel is plain softmax attention."""
    q, k, v = (randn(32, 16, seed=seed + i) for i in range(3))
    return [q, k, v, poisoned(32, 16), 0.25, 16, 8, 16]


def test_online_softmax_with_builtin_max():
    args = _attention_args()
    interpreter.launch((2,), attention_default_padding, args)
    q, k, v, out, scale = args[:5]
    expected = torch.softmax((q @ k.T) * scale, dim=1) @ v
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_max_min_are_elementwise_with_broadcast_and_promotion():
    a, b = randn(4, 8, seed=1), randn(8, seed=2).to(torch.bfloat16)
    hi = evaluate(lambda x, y: max(x, y), a, b)
    lo = evaluate(lambda x, y: min(y, x), a, b)
    assert hi.dtype is ct.float32 and lo.dtype is ct.float32  # bfloat16 promotes
    assert torch.equal(hi._t, torch.maximum(a, b.float()))
    assert torch.equal(lo._t, torch.minimum(a, b.float()))


def test_max_with_scalars_keeps_the_tile_dtype():
    x = randint(16, dtype=torch.int16)
    r = evaluate(lambda t: max(t, 0), x)
    assert r.dtype is ct.int16 and torch.equal(r._t, x.clamp(min=0))
    f = evaluate(lambda t: min(2.5, t), randn(16).half())
    assert f.dtype is ct.float16


def test_max_of_python_scalars_is_pythons():
    assert evaluate(lambda t: (max(3, 7), min(2.0, -1), max(-0.5, 1)), randn(2)) == (7, -1, 1)


def test_nan_is_ignored_like_ct_maximum():
    x = torch.tensor([math.nan, 1.0, -2.0, math.nan])
    y = torch.tensor([0.0, math.nan, 3.0, math.nan])
    r = evaluate(lambda a, b: max(a, b), x, y)
    expected = evaluate(lambda a, b: ct.maximum(a, b), x, y)
    assert torch.allclose(r._t, expected._t, equal_nan=True)


def test_abs_and_divmod():
    x, y = randint(32, seed=3), randint(32, seed=4)
    r = evaluate(lambda a: abs(a), x)
    assert torch.equal(r._t, x.abs())
    q, m = evaluate(lambda a, b: divmod(a, b), x, y)
    assert torch.equal(q._t, torch.div(x, y, rounding_mode="floor"))
    assert torch.equal(m._t, torch.remainder(x, y))


def test_divmod_of_floats_is_refused():
    with pytest.raises(KernelTypeError, match="divmod.*floating point"):
        evaluate(lambda a: divmod(a, 2), randn(4))


@pytest.mark.parametrize("call", [
    lambda t: max(t, t, t),
    lambda t: max([t, t]),
    lambda t: min(t, t, key=abs),
    lambda t: max(u for u in (t, t)),              # a generator's tiles are seen too
    lambda t: min(map(abs, (t, t))),
])
def test_max_min_take_exactly_two_arguments(call):
    with pytest.raises(KernelTypeError, match="exactly two positional arguments"):
        evaluate(call, randn(4))


@pytest.mark.parametrize("name, call", [
    ("pow", lambda t: pow(t, 2)),
    ("round", lambda t: round(t)),
    ("sum", lambda t: sum([t, t])),
    ("sum", lambda t: sum(u * 2 for u in (t, t))),
    ("any", lambda t: any(iter([t]))),
    ("any", lambda t: any([t])),
    ("all", lambda t: all([t])),
    ("sorted", lambda t: sorted([t, t])),
])
def test_unsupported_builtins_are_refused_like_the_compiler(name, call):
    with pytest.raises(KernelTypeError, match=rf"{name}\(\) is not supported in tile code"):
        evaluate(call, randn(4))


def test_generators_of_scalars_keep_pythons_builtins():
    # inside a kernel, builtins over plain Python values (shapes, sizes) are Python's
    assert evaluate(lambda t: t * max(n for n in (2, 3)) + sum(n for n in range(4)),
                    torch.ones(2))._t.tolist() == [9.0, 9.0]
    # any and all still stop at the deciding item (the rest is never made)
    import itertools
    assert evaluate(lambda t: t * any(10 // (2 - i) > 0 for i in range(3))
                    + all(n < 3 for n in itertools.count()), torch.ones(2))._t.tolist() == [1.0, 1.0]


def test_builtins_are_restored_and_untouched_outside_kernels():
    original = builtins.max
    evaluate(lambda t: max(t, 1.0), randn(4))
    assert builtins.max is original and builtins.sum is sum
    assert max([1, 5, 3]) == 5 and sum([1, 2]) == 3


def test_host_code_during_a_launch_is_unaffected():
    seen = []

    @ct.kernel
    def k(x):
        seen.append((max([4, 2, 9]), sum((1, 2, 3)), round(2.5), pow(2, 5)))

    interpreter.launch((1,), k, (torch.zeros(1),))
    assert seen == [(9, 6, 2, 32)]


def test_builtins_restored_after_an_error():
    original = builtins.max
    with pytest.raises(KernelTypeError):
        evaluate(lambda t: round(t), randn(4))
    assert builtins.max is original and builtins.round is round


def test_cdiv():
    assert evaluate(lambda t: ct.cdiv(9, 4), randn(1)) == 3
    r = evaluate(lambda a: ct.cdiv(a, 4), torch.tensor([-9, -8, 0, 9], dtype=torch.int32))
    assert r._t.tolist() == [-2, -2, 0, 3]


@pytest.mark.gpu
def test_gpu_online_softmax_with_builtin_max():
    cpu, gpu = on_gpu_and_cpu((2,), attention_default_padding, _attention_args(seed=5))
    torch.testing.assert_close(gpu[3], cpu[3], rtol=0, atol=1e-5)


def test_a_name_patched_during_a_launch_is_left_as_patched():
    """Only the interpreter's own replacements are taken back when the launch ends."""
    import builtins

    from ops.interpreter.pybuiltins import tile_builtins
    original = builtins.max
    mine = lambda *args, **kwargs: original(*args, **kwargs)
    try:
        with tile_builtins():
            builtins.max = mine
        assert builtins.max is mine
    finally:
        builtins.max = original
    with tile_builtins():
        pass
    assert builtins.max is original and builtins.min(3, 1) == 1
