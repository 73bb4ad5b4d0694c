"""Recording a launch (ops/interpreter/trace.py) and running only some of its blocks.

``launch(..., record=True)`` must say, for every load and store, which block made it, from which
kernel line, and exactly which elements of which argument it touched; the expected element sets
are boxes worked out by hand from the tile shapes, the last tiles sticking out of the arrays.
``launch(..., blocks=...)`` must run only the blocks named: inputs are random and outputs
poisoned with NaN, so an element a skipped block would have written stays NaN.
"""
import dataclasses
import inspect

import pytest
import torch

import cuda.tile as ct

from ops import interpreter
from ops.interpreter import Access, Trace, trace as trace_module
from ops.runtime.cutile_internals import kernel_function
from tests.interpreter.helpers import poisoned, randn

ConstInt = ct.Constant[int]


def line_of(kernel, text):
    """The line number, in its file, of the one line of ``kernel``'s source containing ``text``."""
    lines, first = inspect.getsourcelines(kernel_function(kernel))
    [k] = [k for k, line in enumerate(lines) if text in line]
    return first + k


def box(shape, *slices):
    """A bool tensor of ``shape``, True on the box ``slices``."""
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[slices] = True
    return mask


@ct.kernel
def double_vector(x, out, T: ConstInt):
    b = ct.bid(0)
    t = ct.load(x, (b,), (T,))
    ct.store(out, (b,), t * 2)


def run_double_vector(**options):
    x, out = randn(100), poisoned(100)
    result = interpreter.launch(4, double_vector, (x, out, 32), **options)
    return x, out, result


# ---------------------------------------------------------------------------
# What is recorded
# ---------------------------------------------------------------------------

def test_partial_last_tile_elements_padding_and_lines():
    # 100 elements in tiles of 32: blocks 0-2 read whole tiles, block 3 reads 4 elements and
    # 28 of padding, and stores 4 (dropping 28).
    x, out, trace = run_double_vector(record=True)
    assert torch.equal(out, x * 2)
    assert isinstance(trace, Trace)
    assert trace.grid == (4, 1, 1) and trace.blocks == [(b, 0, 0) for b in range(4)]
    assert trace.arg_names == ["x", "out", "T"] and trace.arg_shapes == {0: (100,), 1: (100,)}
    load_line = line_of(double_vector, "ct.load(")
    store_line = line_of(double_vector, "ct.store(")
    filename = inspect.getsourcefile(kernel_function(double_vector))
    assert len(trace.accesses) == 8
    for b in range(4):
        inside = box((100,), slice(32 * b, min(32 * b + 32, 100)))
        padded = 28 if b == 3 else 0
        [load] = trace.loads(block=b)
        [store] = trace.stores(block=(b,))
        assert trace.accesses[2 * b:2 * b + 2] == [load, store]     # in the order they ran
        assert (load.block, load.kind, load.arg, load.name) == ((b, 0, 0), "load", 0, "x")
        assert (store.block, store.kind, store.arg, store.name) == ((b, 0, 0), "store", 1, "out")
        for access in (load, store):
            assert torch.equal(access.elements, inside)
            assert access.tile_shape == (32,) and access.padded == padded
            assert access.order is None
            assert (access.filename, access.function) == (filename, "double_vector")
        assert (load.line, store.line) == (load_line, store_line)
        assert (load.op, store.op) == ("ct.load", "ct.store")
        assert load.padding_mode == "UNDETERMINED" and store.padding_mode is None
    assert trace.loads(arg="x") == trace.loads(arg=0) == trace.loads()
    assert trace.stores(block=(3, 0, 0), arg="x") == []


def test_access_is_a_frozen_record():
    _, _, trace = run_double_vector(record=True)
    access = trace.accesses[0]
    assert isinstance(access, Access)
    with pytest.raises(dataclasses.FrozenInstanceError):
        access.line = 0


@ct.kernel
def padded_loads(a, out, T: ConstInt):
    b = ct.bid(0)
    zero = ct.load(a, (b,), (T,), padding_mode=ct.PaddingMode.ZERO)
    low = ct.load(a, (b,), (T,), padding_mode=ct.PaddingMode.NEG_INF)
    ct.store(out, (b,), ct.maximum(zero, low))


def test_padding_mode_names():
    a, out = randn(20), poisoned(20)
    trace = interpreter.launch(2, padded_loads, (a, out, 16), record=True)
    assert torch.equal(out, a)
    assert [(x.padding_mode, x.padded) for x in trace.loads(block=1)] == [("ZERO", 12),
                                                                         ("NEG_INF", 12)]


@ct.kernel
def transpose(a, out, TM: ConstInt, TN: ConstInt):
    bx, by = ct.bid(0), ct.bid(1)
    t = ct.load(a, (by, bx), (TN, TM), order=(1, 0))
    ct.store(out, (by, bx), t)


def test_transposed_loads_map_to_the_argument_elements():
    # The tile (TN, TM) = (32, 16) indexes a with its axes swapped: block (bx, by) reads rows
    # 16 bx.. and columns 32 by.. of a, and writes the transposed box of out.  a is 20 x 40, so
    # the tiles of bx = 1 have 4 of 16 rows, those of by = 1 8 of 32 columns.
    a, out = randn(20, 40), poisoned(40, 20)
    trace = interpreter.launch((2, 2), transpose, (a, out, 16, 32), record=True)
    assert torch.equal(out, a.T)
    assert trace.grid == (2, 2, 1)
    assert trace.blocks == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    for bx in range(2):
        for by in range(2):
            rows = slice(16 * bx, min(16 * bx + 16, 20))
            cols = slice(32 * by, min(32 * by + 32, 40))
            count = (rows.stop - rows.start) * (cols.stop - cols.start)
            [load] = trace.loads(block=(bx, by))
            [store] = trace.stores(block=(bx, by))
            assert torch.equal(load.elements, box((20, 40), rows, cols))
            assert torch.equal(store.elements, box((40, 20), cols, rows))
            assert load.order == (1, 0) and store.order is None
            assert load.tile_shape == store.tile_shape == (32, 16)
            assert load.padded == store.padded == 512 - count


@ct.kernel
def copy_rows(a, out, TM: ConstInt, TN: ConstInt):
    t = ct.load(a, (ct.bid(0), 0), (TM, TN))
    ct.store(out, (ct.bid(0), 0), t)


def test_region_and_summary_text():
    a, out = randn(40, 32), poisoned(40, 32)
    trace = interpreter.launch(3, copy_rows, (a, out, 16, 32), record=True)
    load, store = trace.loads(block=2)[0], trace.stores(block=2)[0]
    assert trace.region(load) == "a[32:40, 0:32]"
    assert trace.region(store) == "out[32:40, 0:32]"
    load_line = line_of(copy_rows, "ct.load(")
    assert trace.summary(2) == (
        f"line {load_line}: load a[32:40, 0:32] (tile 16x32, 8 rows padded: UNDETERMINED)\n"
        f"line {load_line + 1}: store out[32:40, 0:32] (tile 16x32, 8 rows dropped)")
    assert trace.summary(0) == (f"line {load_line}: load a[0:16, 0:32] (tile 16x32)\n"
                                f"line {load_line + 1}: store out[0:16, 0:32] (tile 16x32)")

    # Transposed: the padding is counted in the tile's own rows and columns.
    a, out = randn(20, 40), poisoned(40, 20)
    trace = interpreter.launch((2, 2), transpose, (a, out, 16, 32), record=True)
    line = line_of(transpose, "ct.load(")
    assert trace.summary((1, 0)) == (
        f"line {line}: load a[16:20, 0:32] (tile 32x16, 12 columns padded: UNDETERMINED, "
        "order (1, 0))\n"
        f"line {line + 1}: store out[0:32, 16:20] (tile 32x16, 12 columns dropped)")
    assert trace.summary((1, 1)).splitlines()[0] == (
        f"line {line}: load a[16:20, 32:40] (tile 32x16, 480 elements padded: UNDETERMINED, "
        "order (1, 0))")


@ct.kernel
def every_other(x, out, T: ConstInt):
    even = ct.arange(T, dtype=ct.int32) * 2
    picked = ct.gather(x, even)
    ct.scatter(out, even + 1, picked)


def test_gather_scatter_and_boxes_that_are_not_boxes():
    # 8 lanes at 0, 2, .., 14 of a 12-element x: 6 inside, 2 read padding_value.
    x, out = randn(12), poisoned(12)
    trace = interpreter.launch(1, every_other, (x, out, 8), record=True)
    [load], [store] = trace.loads(), trace.stores()
    assert (load.op, store.op) == ("ct.gather", "ct.scatter")
    assert torch.equal(load.elements, torch.arange(12) % 2 == 0)
    assert torch.equal(store.elements, torch.arange(12) % 2 == 1)
    assert (load.padded, store.padded) == (2, 2)
    assert load.tile_shape == (8,) and load.padding_mode is None
    assert trace.region(load) == "x: 6 elements in [0:11]"
    assert trace.region(store) == "out: 6 elements in [1:12]"
    assert trace.summary(0).splitlines()[0].endswith(
        "ct.gather x: 6 elements in [0:11] (tile 8, 2 elements padded)")


@ct.kernel
def through_views(a, out, T: ConstInt):
    part = a.slice(1, 2, 6)                               # columns 2..5 of a
    t = ct.load(part, (ct.bid(0), 0), (T, 4))
    ct.store(out, (ct.bid(0), 0), t)
    view = out.tiled_view((T, 2), padding_mode=ct.PaddingMode.ZERO)
    view.store((ct.bid(0), 1), view.load((ct.bid(0), 1)) * 2)


def test_views_map_back_to_the_argument():
    # a is itself a strided view (every other column of an 8 x 12 buffer), then sliced inside
    # the kernel: positions are decoded through the strides.
    a, out = randn(6, 12)[:, ::2], poisoned(6, 4)
    trace = interpreter.launch(2, through_views, (a, out, 4), record=True)
    expected = a[:, 2:6].clone()
    expected[:, 2:4] *= 2
    assert torch.equal(out, expected)
    for b in range(2):
        rows = slice(4 * b, min(4 * b + 4, 6))
        load, view_load = trace.loads(block=b)
        assert (load.arg, load.name) == (0, "a")
        assert torch.equal(load.elements, box((6, 6), rows, slice(2, 6)))
        assert load.padded == (8 if b else 0)
        assert (view_load.op, view_load.arg, view_load.padding_mode) == ("TiledView.load", 1,
                                                                         "ZERO")
        assert torch.equal(view_load.elements, box((6, 4), rows, slice(2, 4)))
        assert view_load.padded == (4 if b else 0)
        store, view_store = trace.stores(block=b)
        assert view_store.op == "TiledView.store"
        assert torch.equal(store.elements, box((6, 4), rows, slice(0, 4)))
        assert torch.equal(view_store.elements, box((6, 4), rows, slice(2, 4)))
    assert trace.region(trace.loads(block=1)[0]) == "a[4:6, 2:6]"


@ct.kernel
def add_into(a, b, T: ConstInt):
    ct.store(b, (ct.bid(0),), ct.load(a, (ct.bid(0),), (T,)) + 1)


def test_one_tensor_passed_twice_is_named_as_it_was_reached():
    x = randn(16)
    expected = x + 1
    trace = interpreter.launch(2, add_into, (x, x, 8), record=True)
    assert torch.equal(x, expected)
    assert [(a.kind, a.arg, a.name) for a in trace.accesses[:2]] == [("load", 0, "a"),
                                                                     ("store", 1, "b")]


@ct.kernel
def first_of_pair(arrays, out, T: ConstInt):
    ct.store(out, (ct.bid(0),), ct.load(arrays[0], (ct.bid(0),), (T,)))


def test_an_array_no_argument_is_stays_unnamed():
    # A tensor inside a tuple argument: recorded, with its own shape, but not named.
    a, out = randn(8), poisoned(8)
    trace = interpreter.launch(1, first_of_pair, ((a, randn(8, seed=1)), out, 8), record=True)
    [load] = trace.loads()
    assert (load.arg, load.name) == (None, "?")
    assert torch.equal(load.elements, torch.ones(8, dtype=torch.bool))
    assert trace.region(load) == "?[0:8]"
    assert trace.arg_shapes == {1: (8,)}


def test_recording_never_makes_a_launch_fail(monkeypatch):
    def broken(self, array, mask):
        raise RuntimeError("no such storage")
    monkeypatch.setattr(trace_module.Recorder, "_locate", broken)
    with pytest.warns(RuntimeWarning, match="could not be recorded.*no such storage"):
        x, out, trace = run_double_vector(record=True)
    assert torch.equal(out, x * 2)
    assert trace.accesses == [] and len(trace.blocks) == 4


@ct.kernel
def all_write_first(out, T: ConstInt):
    ct.store(out, (0,), ct.full((T,), ct.bid(0), dtype=ct.float32))


def test_writers():
    _, _, trace = run_double_vector(record=True)
    assert trace.writers("out", (97,)) == [(3, 0, 0)]
    assert trace.writers(1, 5) == [(0, 0, 0)]
    assert trace.writers("x", (5,)) == []                  # read, never written
    with pytest.raises(IndexError, match="not inside out"):
        trace.writers("out", (100,))
    with pytest.raises(ValueError, match="no parameter 'y'"):
        trace.writers("y", (0,))
    # Every block writing the same tile: a race on the GPU, all of them writers.
    out = poisoned(4)
    trace = interpreter.launch(3, all_write_first, (out, 4), record=True)
    assert trace.writers("out", (2,)) == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]


# ---------------------------------------------------------------------------
# Running some blocks
# ---------------------------------------------------------------------------

def test_blocks_runs_only_those_blocks():
    x, out, trace = run_double_vector(blocks=[1, (3,)], record=True)
    assert trace.blocks == [(1, 0, 0), (3, 0, 0)]
    assert [a.block for a in trace.accesses] == [(1, 0, 0)] * 2 + [(3, 0, 0)] * 2
    ran = torch.zeros(100, dtype=torch.bool)
    ran[32:64] = ran[96:] = True
    assert torch.equal(out[ran], x[ran] * 2)
    assert out[~ran].isnan().all()
    assert trace.summary(0) == "block 0 did not run and touched no array"


def test_blocks_see_the_whole_grid():
    seen = []

    @ct.kernel
    def where_am_i(out):
        seen.append((ct.bid(0), ct.bid(1), ct.bid(2),
                     ct.num_blocks(0), ct.num_blocks(1), ct.num_blocks(2)))

    # Given out of order and twice: each runs once, in grid order (x fastest).
    interpreter.launch((2, 3), where_am_i, (poisoned(1),), blocks=[(1, 2), (0, 1, 0), (1, 2)])
    assert seen == [(0, 1, 0, 2, 3, 1), (1, 2, 0, 2, 3, 1)]


@pytest.mark.parametrize("blocks, message", [
    ([4], r"blocks: block 4 is outside the grid \(4, 1, 1\)"),
    ([(0, 1)], r"blocks: block \(0, 1\) is outside the grid \(4, 1, 1\)"),
    ([-1], r"blocks: block -1 is outside the grid"),
    ([(1, 0, 0, 0)], r"blocks: \(1, 0, 0, 0\) is not a block index"),
    ([1.0], r"blocks: 1.0 is not a block index"),
    ([True], r"blocks: True is not a block index"),
    (2, r"blocks must be None or an iterable of block indices"),
    ("01", r"blocks must be None or an iterable of block indices"),
])
def test_bad_blocks_are_refused_before_any_block_runs(blocks, message):
    x, out = randn(100), poisoned(100)
    with pytest.raises(ValueError, match=message):
        interpreter.launch(4, double_vector, (x, out, 32), blocks=blocks)
    assert out.isnan().all()


def test_no_record_no_trace():
    x, out, result = run_double_vector()
    assert result is None and torch.equal(out, x * 2)
    _, _, result = run_double_vector(record=False, blocks=None)
    assert result is None
    assert trace_module.ACTIVE.get() is None       # nothing left behind after a launch


def test_scalar_load():
    # A 0-d load (shape ()) reads one element: no padding, and a "scalar" tile.
    @ct.kernel
    def one(a, out):
        ct.store(out, (0,), ct.load(a, (3,), ()))

    a, out = randn(5), poisoned(1)
    trace = interpreter.launch(1, one, (a, out), record=True)
    assert out[0] == a[3]
    [load] = trace.loads()
    assert load.tile_shape == () and load.padded == 0 and trace.region(load) == "a[3:4]"
    assert "load a[3:4] (tile scalar)" in trace.summary(0)
