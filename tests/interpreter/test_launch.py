"""Running kernels (ops/interpreter/runner.py) and the launcher (ops/runtime/launch.py): blocks and grids,
kernel arguments, helper functions, device choice.
"""
import os
import subprocess
import sys

import pytest
import torch

import cuda.tile as ct
from cuda.tile import load as tile_load  # a kernel may import operations by name

from ops import interpreter
from ops.runtime.cutile_internals import kernel_function
from ops.runtime.launch import _device_type, launch
from ops import examples as ek
from tests.interpreter.helpers import evaluate, poisoned, randn


# ---------------------------------------------------------------------------
# Blocks, grids and kernel arguments
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
# Helpers called by kernels
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


def test_is_interpreting():
    assert not interpreter.is_interpreting()
    assert evaluate(lambda t: interpreter.is_interpreting(), randn(4))


# ---------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------

def test_launcher_picks_the_device_and_rejects_mixtures():
    a = randn(10)
    assert _device_type((a, 3)) == "cpu" and _device_type(()) == "cpu"
    with pytest.raises(ValueError, match="mix devices"):
        launch(1, ek.vector_add, (a, torch.empty(10, device="meta"), a, 16))
    with pytest.raises(ValueError, match="meta"):
        launch(1, ek.vector_add, (torch.empty(10, device="meta"),) * 3 + (16,))
    with pytest.raises(TypeError, match="expected a @ct.kernel"):
        launch(1, kernel_function(ek.vector_add), (a, a, a, 16))
    with pytest.raises(ValueError, match="grid"):
        launch((0,), ek.vector_add, (a, a, a, 16))


def test_only_cpu_launches_import_the_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, ops.runtime.launch; print('ops.interpreter' in sys.modules); "
            "import torch, ops.examples as ek; t = torch.ones(4); "
            "ops.runtime.launch.launch(1, ek.vector_add, (t, t, t, 4)); "
            "print('ops.interpreter' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                            text=True, check=True)
    assert result.stdout.split() == ["False", "True"]


def test_the_projects_forward_is_quick_on_one_core():
    """The whole interpreted forward at (batch 1, 512 tokens, 4 heads of 16 x 32), three kernels and
    every block of each, stays far under 10 s on one CPU thread (measured ~0.1 s on a 2-core
    machine): quick enough to step through and to grade exercises on a laptop."""
    import time

    from ops.forward import kernel_forward
    from reference.problems import make_problem
    kw = make_problem(batch=1, seqlen=512, nheads=4, headdim=16, ngroups=1, dstate=32, D="1d",
                      dtype=torch.float32, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        out, _ = kernel_forward(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 64, D=kw["D"],
                                z=kw["z"], dt_bias=kw["dt_bias"], dt_softplus=True)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    assert out.shape == kw["x"].shape and not out.isnan().any()
    assert seconds < 10, seconds
