"""What ``notebooks/CHEATSHEET.md`` says the interpreter and the compiler do, checked.

The cheat-sheet is the page learners keep open, so every statement it makes about behaviour is
run here:

* the "Common mistakes" table is parsed. Every row needs an entry in ``MISTAKES`` (keyed on a
  short phrase of its "mistake" cell): kernels that make the mistake through
  ``ops.interpreter.launch`` on random CPU inputs. Every message the row quotes (the text in
  backticks, ``...`` standing for anything) must be what one of those kernels raises, every
  kernel must raise one of them, and the message must start with the kernel's file and line, as
  the table's header says. Rows about NaN outputs are checks of their own (``NAN_ROWS``). A row
  added without a kernel, or a message the interpreter does not give, fails;
* the rows of the other tables ("The model", "Memory", "Tiles") each need at least one test
  marked ``@claim(table, phrase)`` with ``phrase`` in the row's first cell;
* the paragraph on running without a GPU: printing, ``breakpoint()``, tracebacks, the tools it
  names, the order blocks run in, the files it points to.

What the compiler accepts is checked by compiling ahead of time for sm_90 on this CPU
(``ops.tools.aot.compile_cubin``), a few small kernels only.
"""
import functools
import importlib.metadata
import inspect
import os
import pathlib
import re
import sys
import traceback

import pytest
import torch

import cuda.tile as ct
from ops.interpreter import KernelError, KernelTypeError, launch
from ops.runtime.cutile_internals import kernel_function, kernel_hints
from ops.tools import aot, sass

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "notebooks" / "CHEATSHEET.md"


@functools.cache
def page_text():
    """The page's text, read on first use (a tree without the notebooks still collects)."""
    return PAGE.read_text(encoding="utf-8")


MISTAKES_TITLE = "Common mistakes, and what the interpreter says"
CLAIM_TABLES = ("The model", "Memory", "Tiles")


# --- Reading the page ----------------------------------------------------------------------------

def section(title):
    """The text of the page's ``## title`` section."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", page_text(), re.M | re.S)
    assert match, f"CHEATSHEET.md has no section '## {title}'"
    return match.group(1)


def split_row(line):
    """The cells of a markdown table row; a ``|`` inside backticks does not split."""
    cells, cell, quoted = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            quoted = not quoted
        if ch == "|" and not quoted:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
    return cells + [cell.strip()]


def table(title):
    """(header cells, [row cells]) of the first table of section ``title``."""
    lines = [line for line in section(title).splitlines() if line.startswith("|")]
    assert len(lines) >= 3 and set(lines[1].replace("|", "").strip()) <= set("-: ")
    return split_row(lines[0]), [split_row(line) for line in lines[2:]]


def quoted(cell):
    """The backticked spans of a cell."""
    return re.findall(r"`([^`]*)`", cell)


def message_pattern(text):
    """A regex for a quoted message: ``...`` stands for anything."""
    return ".*?".join(re.escape(part.strip()) for part in text.split("..."))


def row_of(key):
    """The "Common mistakes" row whose mistake cell contains ``key``."""
    rows = [row for row in table(MISTAKES_TITLE)[1] if key in row[0]]
    assert len(rows) == 1, f"{len(rows)} rows of the mistakes table mention {key!r}"
    return rows[0]


# --- Small helpers -------------------------------------------------------------------------------

def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def nan(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype)


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def mistake_line(kernel):
    """(file name, line number, function name) of the line marked ``# mistake`` in ``kernel``."""
    fn = kernel_function(kernel)
    lines, first = inspect.getsourcelines(fn)
    marked = [first + i for i, line in enumerate(lines) if line.rstrip().endswith("# mistake")]
    assert len(marked) == 1, f"{fn.__name__} must mark exactly one line '# mistake'"
    return os.path.basename(fn.__code__.co_filename), marked[0], fn.__name__


_COMPILED = {}


def compiler_verdict(kernel, args, arch="sm_90"):
    """None if the compiler accepts the launch, else the first line of its error (cached)."""
    key = (kernel, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                         for a in args), arch)
    if key not in _COMPILED:
        try:
            aot.compile_cubin(kernel, args, arch)
            _COMPILED[key] = None
        except ct.TileError as e:
            _COMPILED[key] = str(e).splitlines()[0]
    return _COMPILED[key]


@pytest.fixture(autouse=True)
def nan_padding(monkeypatch):
    """The interpreter's default padding, whatever the environment asks for."""
    monkeypatch.delenv("MAMBA2_CUTILE_UNDETERMINED_PADDING", raising=False)


# --- The "Common mistakes" table -----------------------------------------------------------------
# Each kernel marks the line the interpreter blames with "# mistake".

@ct.kernel
def tile_of_48(a, out):
    ct.store(out, (0,), ct.load(a, (0,), shape=(48,)))  # mistake


@ct.kernel
def index_of_rank_1(a, out):
    ct.store(out, (0,), ct.load(a, (0,), shape=(16,)))  # mistake


@ct.kernel
def shape_of_rank_1(a, out):
    ct.store(out, (0,), ct.load(a, (0, 0), shape=(16,)))  # mistake


@ct.kernel
def store_without_astype(a, out):
    t = ct.load(a, (0,), shape=(16,))
    ct.store(out, (0,), t)  # mistake


@ct.kernel
def mma_of_mixed_dtypes(x, y, out):
    a = ct.load(x, (0, 0), shape=(16, 16))
    b = ct.load(y, (0, 0), shape=(16, 16))
    acc = ct.zeros((16, 16), dtype=ct.float32)
    ct.store(out, (0, 0), ct.mma(a, b, acc))  # mistake


@ct.kernel
def tile_outside(a, out):
    ct.store(out, (0,), ct.load(a, (4,), shape=(16,)))  # mistake


@ct.kernel
def if_on_tile(a, out):
    t = ct.load(a, (0,), shape=(16,))
    if t > 0:  # mistake
        t = -t
    ct.store(out, (0,), t)


@ct.kernel
def while_on_tile(a, out):
    t = ct.load(a, (0,), shape=(16,))
    while t > 0:  # mistake
        t = t - 1.0
    ct.store(out, (0,), t)


@ct.kernel
def and_on_tiles(a, out):
    t = ct.load(a, (0,), shape=(16,))
    inside = (t > -1.0) and (t < 1.0)  # mistake
    ct.store(out, (0,), ct.where(inside, t, 0.0))


@ct.kernel
def or_on_tiles(a, out):
    t = ct.load(a, (0,), shape=(16,))
    outside = (t < -1.0) or (t > 1.0)  # mistake
    ct.store(out, (0,), ct.where(outside, t, 0.0))


# key (a phrase of the row's mistake cell) -> [(code, kernel, args)]: kernels making the mistake
# (grid (1,)), ``code`` naming the piece of code quoted in the mistake cell that the kernel writes.
MISTAKES = {
    "not a power of two": lambda: [(None, tile_of_48, (rand(64), nan(64)))],
    "wrong rank": lambda: [(None, index_of_rank_1, (rand(16, 16), nan(16))),
                           (None, shape_of_rank_1, (rand(16, 16), nan(16)))],
    "float32 into a bfloat16": lambda: [
        (None, store_without_astype, (rand(16), nan(16, dtype=torch.bfloat16)))],
    "`ct.mma` on mixed dtypes": lambda: [
        ("ct.mma", mma_of_mixed_dtypes, (rand(16, 16, dtype=torch.bfloat16),
                                         rand(16, 16, dtype=torch.float16), nan(16, 16)))],
    "entirely outside": lambda: [(None, tile_outside, (rand(64), nan(16)))],
    "`if tile > 0:`": lambda: [("if tile > 0:", if_on_tile, (rand(16), nan(16))),
                               ("while", while_on_tile, (rand(16), nan(16))),
                               ("and", and_on_tiles, (rand(16), nan(16))),
                               ("or", or_on_tiles, (rand(16), nan(16)))],
}


@ct.kernel
def block_sums(a, out, n: int, ZERO: ct.Constant[bool], MASK: ct.Constant[bool]):
    """out[i] = the sum of a's i-th 16-element tile (the last one partial)."""
    i = ct.bid(0)
    if ZERO:
        t = ct.load(a, (i,), shape=(16,), padding_mode=ct.PaddingMode.ZERO)
    else:
        t = ct.load(a, (i,), shape=(16,))
    if MASK:
        t = ct.where(ct.arange(16, dtype=ct.int32) + i * 16 < n, t, 0.0)
    ct.store(out, (i,), ct.reshape(ct.sum(t), (1,)))


@ct.kernel
def scale_by_two(a, out):
    i = ct.bid(0)
    ct.store(out, (i,), ct.load(a, (i,), shape=(16,)) * 2.0)


def padding_nobody_asked_for(row):
    """A partial tile read with the default padding puts NaN in the output; the row's fixes
    (``padding_mode=ct.PaddingMode.ZERO``, or masking the result) give the right sums."""
    assert row[1].startswith("NaN in the output")
    assert "padding_mode=ct.PaddingMode.ZERO" in quoted(row[1]) and "mask" in row[1]
    a, n = rand(40), 40
    expected = torch.stack([a[i * 16:(i + 1) * 16].sum() for i in range(3)])
    out = torch.zeros(3)
    launch((3,), block_sums, (a, out, n, False, False))
    assert out[:2].isfinite().all() and out[2].isnan()
    for zero, mask in ((True, False), (False, True)):
        out = nan(3)
        launch((3,), block_sums, (a, out, n, zero, mask))
        torch.testing.assert_close(out, expected)


def output_never_written(row):
    """An output made with ``poison=True`` is NaN until written: a grid one block short leaves
    NaN in it, and the comparison with the reference fails."""
    from ops.kernels.common import new_output
    assert "poison=True" in quoted(row[1]) and "the NaN survives and the check fails" in row[1]
    a = rand(48)
    out = new_output((48,), torch.float32, "cpu", poison=True)
    assert out.isnan().all()
    launch((48 // 16 - 1,), scale_by_two, (a, out))      # one block short
    assert out[32:].isnan().all() and not out[:32].isnan().any()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out, a * 2)
    launch((48 // 16,), scale_by_two, (a, out))
    torch.testing.assert_close(out, a * 2)


NAN_ROWS = {
    "padding you did not ask for": padding_nobody_asked_for,
    "never written": output_never_written,
}


def test_every_mistake_row_has_a_kernel():
    """Every row of "Common mistakes" is checked by exactly one entry of MISTAKES or NAN_ROWS,
    and every entry still matches a row."""
    header, rows = table(MISTAKES_TITLE)
    assert header[0] == "mistake" and header[1].startswith("message")
    keys = list(MISTAKES) + list(NAN_ROWS)
    for row in rows:
        matching = [k for k in keys if k in row[0]]
        assert len(matching) == 1, f"row {row[0]!r} is checked by {matching} (need one key)"
    for key in keys:
        row_of(key)


@pytest.mark.parametrize("key", list(MISTAKES))
def test_mistake_message(key):
    """Each piece of code the mistake cell quotes is written by a kernel, and the row's quoted
    messages are what the interpreter raises for them, starting with the kernel's file and line
    ("file and line are the kernel's")."""
    assert "file and line are the kernel's" in table(MISTAKES_TITLE)[0][1]
    mistake, message = row_of(key)
    cases = MISTAKES[key]()
    assert set(quoted(mistake)) == {code for code, _, _ in cases if code}, \
        f"the code quoted in {mistake!r} is not what the row's kernels write"
    patterns = [message_pattern(text) for text in quoted(message)]
    assert patterns, f"row {mistake!r} quotes no message"
    produced = set()
    for _, kernel, args in cases:
        with pytest.raises(KernelError) as info:
            launch((1,), kernel, args)
        text = str(info.value)
        file, line, name = mistake_line(kernel)
        assert text.startswith(f"{file}:{line} in {name}: "), text
        hits = [p for p in patterns if re.search(p, text, re.S)]
        assert hits, f"{name} raised {text!r}, which the row {mistake!r} does not quote"
        produced.update(hits)
    assert produced == set(patterns), f"no kernel raises {set(patterns) - produced}"


@pytest.mark.parametrize("key", list(NAN_ROWS))
def test_mistake_nan(key):
    """The row about a NaN output: the NaN appears (see each check's docstring)."""
    NAN_ROWS[key](row_of(key))


# --- The model, Memory and Tiles tables ----------------------------------------------------------

CLAIMS = []


def claim(title, phrase):
    """Marks a test as checking the row of table ``title`` whose first cell contains ``phrase``."""
    def mark(test):
        CLAIMS.append((title, phrase, test.__name__))
        return test
    return mark


def test_every_table_row_is_tested():
    """Every row of the model, Memory and Tiles tables has a test, and every test's row exists."""
    for title in CLAIM_TABLES:
        firsts = [row[0] for row in table(title)[1]]
        for first in firsts:
            assert any(t == title and p in first for t, p, _ in CLAIMS), \
                f"no test for the row {first!r} of '{title}'"
    for title, phrase, name in CLAIMS:
        assert any(phrase in row[0] for row in table(title)[1]), \
            f"{name}: no row of '{title}' mentions {phrase!r}"


def row_note(title, phrase):
    """The second cell of the row of table ``title`` whose first cell contains ``phrase``."""
    rows = [row for row in table(title)[1] if phrase in row[0]]
    assert len(rows) == 1
    return rows[0][1]


def assert_note(title, phrase, *texts):
    """The row still says what its test checks."""
    note = row_note(title, phrase)
    for text in texts:
        assert text in note, f"the row {phrase!r} of '{title}' no longer says {text!r}"


# The model

@ct.kernel(occupancy=2)
def copy_with_hint(a, out):
    ct.store(out, (0,), ct.load(a, (0,), shape=(16,)))


@claim("The model", "@ct.kernel")
def test_kernel_hints():
    """``@ct.kernel(occupancy=2)`` sets a compiler hint; the interpreter runs the kernel as is."""
    assert kernel_hints(copy_with_hint)["occupancy"] == 2
    a, out = rand(16), nan(16)
    launch((1,), copy_with_hint, (a, out))
    torch.testing.assert_close(out, a)


@ct.kernel
def scaled_chunk(a, out, CHUNK: ct.Constant[int]):
    i = ct.bid(0)
    ct.store(out, (i,), ct.load(a, (i,), shape=(CHUNK,)) * CHUNK)


@claim("The model", "ct.Constant[int]")
def test_constant_variants():
    """A ``ct.Constant`` is a plain value in the kernel, each value compiles its own variant,
    and the project's ``ConstInt`` is ``ct.Constant[int]``."""
    from ops.kernels.common import ConstInt
    assert ConstInt == ct.Constant[int]
    a = rand(64)
    for chunk in (16, 32):
        out = nan(64)
        launch((64 // chunk,), scaled_chunk, (a, out, chunk))
        torch.testing.assert_close(out, a * chunk)
    c16 = aot.compile_cubin(scaled_chunk, (meta(64), meta(64), 16), "sm_90")
    c32 = aot.compile_cubin(scaled_chunk, (meta(64), meta(64), 32), "sm_90")
    assert c16 != c32


@ct.kernel
def block_ids(out):
    values = ct.full((1, 1, 4), 0, dtype=ct.int32)
    values = ct.where(ct.arange(4, dtype=ct.int32)[None, None, :] == 0, ct.bid(0), values)
    values = ct.where(ct.arange(4, dtype=ct.int32)[None, None, :] == 1, ct.num_blocks(0), values)
    values = ct.where(ct.arange(4, dtype=ct.int32)[None, None, :] == 2, ct.bid(1), values)
    values = ct.where(ct.arange(4, dtype=ct.int32)[None, None, :] == 3, ct.num_blocks(1), values)
    ct.store(out, (ct.bid(0), ct.bid(1), 0), values)


@claim("The model", "ct.bid(0)")
def test_bid_and_num_blocks():
    """``ct.bid(0)`` is the block's index along grid axis 0, ``ct.num_blocks(0)`` the grid's
    size there."""
    out = torch.full((3, 2, 4), -1, dtype=torch.int32)
    launch((3, 2), block_ids, (out,))
    for x in range(3):
        for y in range(2):
            assert out[x, y].tolist() == [x, 3, y, 2]


@ct.kernel
def cdiv_in_kernel(a, out, n: int):
    nblocks = ct.cdiv(n, 16)
    i = ct.bid(0)
    t = ct.load(a, (i,), shape=(16,), padding_mode=ct.PaddingMode.ZERO)
    ct.store(out, (i,), t + nblocks)


@claim("The model", "ct.cdiv")
def test_cdiv():
    """``ct.cdiv(a, b)`` is ceil(a / b) in a kernel and on the host, where it sizes grids."""
    assert_note('The model', 'ct.cdiv', 'in kernels and for grids')
    assert [ct.cdiv(n, 16) for n in (1, 16, 17, 40, 48)] == [1, 1, 2, 3, 3]
    a, out = rand(40), nan(40)
    launch((ct.cdiv(40, 16),), cdiv_in_kernel, (a, out, 40))
    torch.testing.assert_close(out, a + 3)


@ct.kernel
def sum_columns_to_dtype(a, out, TN: ct.Constant[int]):
    acc = ct.zeros((1,), dtype=ct.float32)
    for j in range(ct.cdiv(a.shape[1], TN)):
        acc = acc + ct.sum(ct.load(a, (0, j), shape=(1, TN), padding_mode=ct.PaddingMode.ZERO))
    ct.store(out, (0,), acc.astype(out.dtype))


@claim("The model", "a.shape[1]")
def test_array_shape_and_dtype_in_a_kernel():
    """An array argument's ``.shape`` and ``.dtype`` are read inside the kernel: a loop bound from
    ``a.shape[1]``, a conversion to ``out.dtype`` before the store; it compiles too."""
    assert_note("The model", "a.shape[1]", "loop bounds", "before a store")
    a, out = rand(1, 100), torch.full((1,), float("nan"), dtype=torch.bfloat16)
    launch((1,), sum_columns_to_dtype, (a, out, 32))
    torch.testing.assert_close(out.float(), a.sum(1, keepdim=True)[0].bfloat16().float(),
                               atol=0.05, rtol=0.01)      # one bfloat16 rounding of a sum ~10
    assert aot.compile_cubin(sum_columns_to_dtype, (meta(1, 100), meta(1, dtype=torch.bfloat16), 32),
                             "sm_90")


@claim("The model", "ct.launch")
def test_launch_on_gpu_or_cpu():
    """``ct.launch(stream, grid, kernel, args)``; ``ops.runtime.launch.launch(grid, kernel, args)``,
    and an ``ops`` wrapper, run CPU tensors through the interpreter."""
    from ops.runtime.launch import launch as project_launch
    assert list(inspect.signature(ct.launch).parameters)[:4] == [
        "stream", "grid", "kernel", "kernel_args"]
    a, out = rand(16), nan(16)
    project_launch((1,), copy_with_hint, (a, out))
    torch.testing.assert_close(out, a)
    # an ``ops`` wrapper given CPU tensors runs the same way ("Running without a GPU")
    from ops.core.chunk_cumsum import chunk_cumsum_core
    from ops.kernels.common import LOG2E
    dt, A = rand(1, 128, 8).abs(), -rand(8, seed=1).abs()
    dt_out, dA_cumsum = chunk_cumsum_core(dt, A, 64, poison=True)
    expected = (dt * A * LOG2E).permute(0, 2, 1).reshape(1, 8, 2, 64).cumsum(-1)
    torch.testing.assert_close(dA_cumsum, expected)


# Memory

@ct.kernel
def tiles_by_index(a, out):
    i, j = ct.bid(0), ct.bid(1)
    t = ct.load(a, (i, j), shape=(4, 8))
    ct.store(out, (i, j, 0, 0), ct.reshape(t, (1, 1, 4, 8)))


@ct.kernel
def rank4_load(x, out):
    b, h = ct.bid(0), ct.bid(1)
    t = ct.load(x, (b, 0, h, 0), shape=(1, 16, 1, 8))
    m = ct.reshape(t, (16, 8))
    ct.store(out, (b, h, 0, 0), ct.reshape(m * 2.0, (1, 1, 16, 8)))


@claim("Memory", "ct.load(a, index, shape=(m, n))")
def test_load_index_counts_tiles():
    """``ct.load``'s index counts tiles: tile (i, j) of shape (m, n) starts at element (i·m, j·n);
    the tile has the array's rank ((1, 16, 1, 8) from a 4-d array, then ``ct.reshape``)."""
    assert_note('Memory', 'ct.load(a, index', '`index` counts **tiles**',
                "The tile has the **array's rank**")
    a, out = rand(12, 16), nan(3, 2, 4, 8)
    launch((3, 2), tiles_by_index, (a, out))
    for i in range(3):
        for j in range(2):
            torch.testing.assert_close(out[i, j], a[i * 4:(i + 1) * 4, j * 8:(j + 1) * 8])
    x, out = rand(2, 16, 3, 8), nan(2, 3, 16, 8)
    launch((2, 3), rank4_load, (x, out))
    torch.testing.assert_close(out, x.permute(0, 2, 1, 3) * 2)


@ct.kernel
def copy_tiles(a, out, ZERO: ct.Constant[bool]):
    i = ct.bid(0)
    if ZERO:
        t = ct.load(a, (i,), shape=(16,), padding_mode=ct.PaddingMode.ZERO)
    else:
        t = ct.load(a, (i,), shape=(16,))
    ct.store(out, (i,), t)


@claim("Memory", "padding_mode=ct.PaddingMode.ZERO")
def test_padding():
    """Past the array's end, ``PaddingMode.ZERO`` reads 0 and the default (UNDETERMINED) reads
    NaN for floats in the interpreter."""
    assert_note('Memory', 'padding_mode=', 'read as 0', 'the interpreter reads floats as NaN')
    a = rand(20)
    out = nan(32)
    launch((2,), copy_tiles, (a, out, True))
    torch.testing.assert_close(out, torch.cat([a, torch.zeros(12)]))
    out = torch.zeros(32)
    launch((2,), copy_tiles, (a, out, False))
    torch.testing.assert_close(out[:20], a)
    assert out[20:].isnan().all()


@ct.kernel
def load_transposed(dt, out):
    c, b = ct.bid(0), ct.bid(1)
    t = ct.load(dt, (b, 0, c), shape=(1, 4, 16), order=(0, 2, 1))
    ct.store(out, (b, 0, c), t)


@claim("Memory", "order=(0, 2, 1)")
def test_load_order():
    """``order=(0, 2, 1)`` loads through a permuted view: ``dt`` stored (b, L, h) arrives as
    (b, h, L) tiles, index and shape in the view's axes; ``ops/core/chunk_cumsum.py`` does so."""
    assert_note('Memory', 'order=', 'stored `(b, L, h)` arrives as `(b, h, L)` tiles',
                '`ops/core/chunk_cumsum.py`')
    dt, out = rand(2, 32, 4), nan(2, 4, 32)
    launch((2, 2), load_transposed, (dt, out))
    torch.testing.assert_close(out, dt.permute(0, 2, 1))
    assert "order=(0, 2, 1)" in (ROOT / "ops/core/chunk_cumsum.py").read_text()


@claim("Memory", "ct.store(a, index, tile)")
def test_store():
    """``ct.store`` uses the same tile index; elements past the array's end are dropped (memory
    beyond a view is untouched); float32 into bfloat16 is refused, bfloat16 into float32 converts,
    by the interpreter and by the compiler."""
    assert_note('Memory', 'ct.store(', 'same index rules', "past the array's end are dropped",
                'needs `.astype(ct.bfloat16)` first (bfloat16 into float32 converts)')
    a = rand(32)
    buffer = torch.zeros(32)
    launch((2,), copy_tiles, (a, buffer[:20], True))
    torch.testing.assert_close(buffer[:20], a[:20])
    assert (buffer[20:] == 0).all()
    # dtypes: the mistakes table has the interpreter's message for float32 into bfloat16
    with pytest.raises(KernelTypeError, match="cannot implicitly cast a float32 tile"):
        launch((1,), store_without_astype, (a[:16], nan(16, dtype=torch.bfloat16)))
    x, out = rand(16, dtype=torch.bfloat16), nan(16)
    launch((1,), store_without_astype, (x, out))
    torch.testing.assert_close(out, x.float())
    verdict = compiler_verdict(store_without_astype, (meta(16), meta(16, dtype=torch.bfloat16)))
    assert verdict and "cannot implicitly cast float32 to bfloat16" in verdict
    assert compiler_verdict(store_without_astype,
                            (meta(16, dtype=torch.bfloat16), meta(16))) is None


@ct.kernel
def load_with_latency(a, out, LAT: ct.Constant[int]):
    ct.store(out, (0,), ct.load(a, (0,), shape=(16,), latency=LAT))


@claim("Memory", "latency=8")
def test_latency_hint():
    """``latency=`` is a hint from 1 to 10: the compiler refuses 0 and 11, the interpreter runs
    the load unchanged; notebook 06 uses it."""
    assert_note('Memory', 'latency=', '(1..10; the compiler refuses other values)', 'notebook 06')
    a, out = rand(16), nan(16)
    launch((1,), load_with_latency, (a, out, 8))
    torch.testing.assert_close(out, a)
    assert compiler_verdict(load_with_latency, (meta(16), meta(16), 8)) is None
    for bad in (0, 11):
        verdict = compiler_verdict(load_with_latency, (meta(16), meta(16), bad))
        assert verdict and "Latency must be between 1 and 10" in verdict
    notebook, = ROOT.glob("notebooks/06_*.ipynb")
    assert "latency=" in notebook.read_text(encoding="utf-8")


# Tiles

@ct.kernel
def new_tiles(out):
    ct.store(out, (0, 0), ct.reshape(ct.zeros((8,), dtype=ct.float32), (1, 8)))
    ct.store(out, (1, 0), ct.reshape(ct.full((8,), 2.5, dtype=ct.float32), (1, 8)))
    ct.store(out, (2, 0), ct.reshape(ct.arange(8, dtype=ct.int32).astype(ct.float32), (1, 8)))


@claim("Tiles", "ct.zeros(shape, dtype=ct.float32)")
def test_new_tiles():
    """``ct.zeros``, ``ct.full``, ``ct.arange(n, dtype=ct.int32)`` make new tiles."""
    out = nan(3, 8)
    launch((1,), new_tiles, (out,))
    torch.testing.assert_close(out, torch.stack([torch.zeros(8), torch.full((8,), 2.5),
                                                 torch.arange(8.0)]))


@ct.kernel
def broadcasting(a, b, out, less):
    t = ct.load(a, (0,), shape=(8,))
    u = ct.load(b, (0,), shape=(16,))
    ct.store(out, (0, 0), (t[:, None] * 2.0 + u[None, :]) / 3.0 - u[None, :])
    ct.store(less, (0, 0), ct.where(t[:, None] < u[None, :], 1, 0))


@claim("Tiles", "+ - * /")
def test_arithmetic_broadcasts():
    """``+ - * /`` and comparisons are elementwise, ``t[:, None]`` broadcasts as in NumPy."""
    a, b = rand(8, seed=1), rand(16, seed=2)
    out, less = nan(8, 16), torch.full((8, 16), -1, dtype=torch.int32)
    launch((1,), broadcasting, (a, b, out, less))
    torch.testing.assert_close(out, (a[:, None] * 2 + b[None, :]) / 3 - b[None, :])
    assert torch.equal(less, (a[:, None] < b[None, :]).int())


@ct.kernel
def choices(a, b, out):
    t = ct.load(a, (0,), shape=(16,))
    u = ct.load(b, (0,), shape=(16,))
    ct.store(out, (0, 0), ct.reshape(ct.where(t > u, t, u), (1, 16)))
    ct.store(out, (1, 0), ct.reshape(ct.maximum(t, u), (1, 16)))
    ct.store(out, (2, 0), ct.reshape(max(t, u), (1, 16)))
    ct.store(out, (3, 0), ct.reshape(ct.minimum(t, 0.0), (1, 16)))
    ct.store(out, (4, 0), ct.reshape(min(t, 0.0), (1, 16)))
    ct.store(out, (5, 0), ct.reshape(max(t, 0.0), (1, 16)))


@claim("Tiles", "ct.where(cond, x, y)")
def test_elementwise_choice():
    """``ct.where``, ``ct.minimum``, ``ct.maximum`` choose elementwise; Python's ``max(x, y)`` /
    ``min(x, y)`` on a tile and a tile or a number are the same, in the interpreter and for the
    compiler (``if`` on a tile: the mistakes table)."""
    assert_note('Tiles', 'ct.where(', "**not** Python's `if` on a tile",
                '`max(x, y)` / `min(x, y)`',
                '`ct.maximum` / `ct.minimum`: `max(t, 0.0)` is elementwise')
    a, b = rand(16, seed=1), rand(16, seed=2)
    out = nan(6, 16)
    launch((1,), choices, (a, b, out))
    both = torch.maximum(a, b)
    expected = torch.stack([both, both, both, a.clamp(max=0), a.clamp(max=0), a.clamp(min=0)])
    torch.testing.assert_close(out, expected)
    assert compiler_verdict(choices, (meta(16), meta(16), meta(6, 16))) is None


@ct.kernel
def math_functions(a, out):
    t = ct.load(a, (0,), shape=(16,))
    ct.store(out, (0, 0), ct.reshape(ct.exp2(t), (1, 16)))
    ct.store(out, (1, 0), ct.reshape(ct.exp(t), (1, 16)))
    ct.store(out, (2, 0), ct.reshape(ct.log(ct.exp(t)), (1, 16)))


@claim("Tiles", "ct.exp2")
def test_math():
    """``ct.exp2``, ``ct.exp``, ``ct.log`` are the math functions; the kernels of ``ops/core``
    decay with ``exp2`` (log2 units), never ``exp``."""
    a, out = rand(16), nan(3, 16)
    launch((1,), math_functions, (a, out))
    torch.testing.assert_close(out, torch.stack([torch.exp2(a), torch.exp(a), a]))
    for path in sorted((ROOT / "ops/core").glob("*.py")):
        source = path.read_text()
        assert "ct.exp(" not in source, path
    uses = [p.name for p in (ROOT / "ops/core").glob("*.py") if "ct.exp2(" in p.read_text()]
    assert len(uses) >= 2


@ct.kernel
def scans_and_reductions(a, out, sums, maxes):
    t = ct.load(a, (0, 0), shape=(4, 8))
    ct.store(out, (0, 0), ct.cumsum(t, axis=1))
    ct.store(sums, (0,), ct.sum(t, axis=1))
    ct.store(maxes, (0,), ct.max(t, axis=1))


@claim("Tiles", "ct.cumsum(t, axis=1)")
def test_scans_and_reductions():
    """``ct.cumsum(t, axis=1)`` scans along a row; ``ct.sum``, ``ct.max`` reduce."""
    a, out, sums, maxes = rand(4, 8), nan(4, 8), nan(4), nan(4)
    launch((1,), scans_and_reductions, (a, out, sums, maxes))
    torch.testing.assert_close(out, a.cumsum(1))
    torch.testing.assert_close(sums, a.sum(1))
    torch.testing.assert_close(maxes, a.amax(1))


@ct.kernel
def shapes(a, out_t, out_p, out_r, out_e):
    t = ct.load(a, (0, 0, 0), shape=(2, 4, 8))
    ct.store(out_t, (0, 0, 0), ct.transpose(t, 1, 2))
    ct.store(out_p, (0, 0, 0), ct.permute(t, (2, 0, 1)))
    ct.store(out_r, (0, 0), ct.reshape(t, (8, 8)))
    ct.store(out_e, (0, 0, 0, 0), ct.expand_dims(t, 1))


@claim("Tiles", "ct.reshape")
def test_shapes():
    """``ct.reshape``, ``ct.transpose``, ``ct.permute``, ``ct.expand_dims`` act as in torch."""
    a = rand(2, 4, 8)
    outs = nan(2, 8, 4), nan(8, 2, 4), nan(8, 8), nan(2, 1, 4, 8)
    launch((1,), shapes, (a, *outs))
    for out, expected in zip(outs, (a.transpose(1, 2), a.permute(2, 0, 1), a.reshape(8, 8),
                                    a[:, None])):
        torch.testing.assert_close(out, expected)


@ct.kernel
def extract_and_item(a, out):
    t = ct.load(a, (0,), shape=(8,))
    ct.store(out, (0,), ct.extract(t, (1,), shape=(4,)))
    square = ct.reshape(t, (2, 4))
    ct.store(out, (1,), ct.reshape(ct.extract(square, (1, 0), shape=(1, 4)), (4,)))
    third = ct.extract(t, (3,), shape=(1,)).item()
    ct.store(out, (2,), ct.full((4,), third, dtype=ct.float32))


@ct.kernel
def item_of_many(a, out):
    t = ct.load(a, (0,), shape=(8,))
    ct.store(out, (0,), ct.full((8,), t.item(), dtype=ct.float32))


@claim("Tiles", "ct.extract(t, index, shape=...)")
def test_extract_and_item():
    """``ct.extract``'s index is in units of the sub-tile's shape (index (1,) of shape (4,):
    elements 4..7); ``.item()`` takes the value of a one-element tile, and only of one."""
    assert_note('Tiles', 'ct.extract(',
                'index in units of its shape (index `(1,)`, shape `(4,)`: elements 4..7)',
                '`.item()` on a 1-element tile')
    a, out = rand(8), nan(12)
    launch((1,), extract_and_item, (a, out))
    torch.testing.assert_close(out, torch.cat([a[4:8], a[4:8], a[3].expand(4)]))
    with pytest.raises(KernelTypeError, match="one element"):
        launch((1,), item_of_many, (a, nan(8)))


@ct.kernel
def bf16_arithmetic(a, b, c, out, converted):
    x = ct.load(a, (0,), shape=(256,))
    y = ct.load(b, (0,), shape=(256,))
    z = ct.load(c, (0,), shape=(256,))
    ct.store(out, (0,), x * y + z)
    ct.store(converted, (0,), (x.astype(ct.float32) * 3.0).astype(ct.bfloat16))


@claim("Tiles", "t.astype(ct.bfloat16)")
def test_16_bit_arithmetic_rounds_each_result():
    """``.astype`` converts (to nearest); arithmetic on bfloat16 tiles rounds each result to
    bfloat16, so ``x * y + z`` is not the float32 value rounded once."""
    assert_note('Tiles', 't.astype(', 'arithmetic on 16-bit tiles rounds each result')
    bf = torch.bfloat16
    a, b, c = (rand(256, dtype=bf, seed=s) for s in (1, 2, 3))
    out, converted = nan(256, dtype=bf), nan(256, dtype=bf)
    launch((1,), bf16_arithmetic, (a, b, c, out, converted))
    stepwise = ((a.float() * b.float()).to(bf).float() + c.float()).to(bf)
    once = (a.float() * b.float() + c.float()).to(bf)
    assert torch.equal(out, stepwise)
    assert not torch.equal(out, once)
    assert torch.equal(converted, (a.float() * 3).to(bf))


SHORT_DTYPES = {"f16": ct.float16, "bf16": ct.bfloat16, "f32": ct.float32, "i8": ct.int8,
                "i32": ct.int32}


def mma_kernel(x_dtype, acc_dtype, n=16):
    """out = mma(ones, ones, zeros) for these dtypes, in float32."""
    @ct.kernel
    def mma_of(out):
        x = ct.full((n, n), 1, dtype=x_dtype)
        acc = ct.zeros((n, n), dtype=acc_dtype)
        ct.store(out, (0, 0), ct.mma(x, x, acc).astype(ct.float32))
    return mma_of


def accumulators():
    """{operand dtype: [accumulator dtypes]} as the mma row of the Tiles table lists them."""
    note = row_note("Tiles", "ct.mma(x, y, acc)")
    pairs = re.findall(r"(\w+) → (\w+(?: or \w+)*)", note)
    assert pairs
    return {SHORT_DTYPES[x]: [SHORT_DTYPES[a] for a in accs.split(" or ")] for x, accs in pairs}


@ct.kernel
def mma_product(x, y, acc, out):
    a = ct.load(x, (0, 0), shape=(16, 32))
    b = ct.load(y, (0, 0), shape=(32, 16))
    ct.store(out, (0, 0), ct.mma(a, b, ct.load(acc, (0, 0), shape=(16, 16))))


@claim("Tiles", "ct.mma(x, y, acc)")
def test_mma_value_and_accumulators_interpreter():
    """``ct.mma(x, y, acc)`` is ``acc + x @ y``; the interpreter accepts exactly the accumulators
    the row lists for each operand dtype (f16: f16 or f32; bf16, f32: f32; i8: i32)."""
    h = torch.float16
    x, y = rand(16, 32, dtype=h, seed=1), rand(32, 16, dtype=h, seed=2)
    acc, out = rand(16, 16), nan(16, 16)
    launch((1,), mma_product, (x, y, acc, out))
    torch.testing.assert_close(out, acc + x.float() @ y.float())
    table_accs = accumulators()
    assert table_accs == {ct.float16: [ct.float16, ct.float32], ct.bfloat16: [ct.float32],
                          ct.float32: [ct.float32], ct.int8: [ct.int32]}
    for x_dtype, allowed in table_accs.items():
        for acc_dtype in (ct.float16, ct.bfloat16, ct.float32, ct.int32):
            out = nan(16, 16)
            if acc_dtype in allowed:
                launch((1,), mma_kernel(x_dtype, acc_dtype), (out,))
                assert (out == 16).all()
            else:
                with pytest.raises(KernelTypeError, match="accumulator"):
                    launch((1,), mma_kernel(x_dtype, acc_dtype), (out,))


@claim("Tiles", "ct.mma(x, y, acc)")
def test_mma_accumulators_compiler():
    """The compiler (sm_90) agrees on the 16-bit float operands: f16 takes an f16 or f32
    accumulator, bf16 only f32."""
    table_accs = accumulators()
    for x_dtype in (ct.float16, ct.bfloat16):
        for acc_dtype in (ct.float16, ct.bfloat16, ct.float32):
            verdict = compiler_verdict(mma_kernel(x_dtype, acc_dtype), (meta(16, 16),))
            if acc_dtype in table_accs[x_dtype]:
                assert verdict is None, (x_dtype, acc_dtype, verdict)
            else:
                assert verdict and "Unsupported acc dtype" in verdict, (x_dtype, acc_dtype)


@ct.kernel
def mma_f32(x, y, out, TF32: ct.Constant[bool]):
    a = ct.load(x, (0, 0), shape=(64, 64))
    b = ct.load(y, (0, 0), shape=(64, 64))
    if TF32:
        a, b = a.astype(ct.tfloat32), b.astype(ct.tfloat32)
    ct.store(out, (0, 0), ct.mma(a, b, ct.zeros((64, 64), dtype=ct.float32)))


@claim("Tiles", "ct.mma(x, y, acc)")
def test_mma_f32_and_tf32_on_sm90():
    """On sm_90 an f32 ``mma`` compiles to plain float32 instructions, no tensor cores; with
    the operands ``.astype(ct.tfloat32)`` it uses them (HGMMA)."""
    assert_note('Tiles', 'ct.mma(',
                'f32 operands compile to plain float32 instructions on sm_90, not tensor cores',
                '`.astype(ct.tfloat32)` selects them')
    args = (meta(64, 64), meta(64, 64), meta(64, 64))
    f32 = sass.sass_report(mma_f32, args + (False,), "sm_90")
    tf32 = sass.sass_report(mma_f32, args + (True,), "sm_90")
    assert f32.mma_count == 0 and f32.count("FFMA", "FMUL", "FADD") >= 64 * 64
    assert tf32.mma_count > 0 and all(op.startswith("HGMMA") for op in tf32.mma)


# --- Running without a GPU -----------------------------------------------------------------------

@ct.kernel
def debugged(a, out):
    t = ct.load(a, (0,), shape=(4,))
    print(t)
    breakpoint()
    ct.store(out, (0,), t)


@ct.kernel
def raises_in_kernel(a, out):
    t = ct.load(a, (0,), shape=(4,))
    ct.store(out, (0,), t[:, None])


def test_print_breakpoint_and_tracebacks(capsys, monkeypatch):
    """Interpreted, a kernel is ordinary Python: ``print(tile)`` prints its values,
    ``breakpoint()`` stops in the kernel's frame, and a traceback reaches the kernel's line."""
    frames = []
    monkeypatch.setattr(sys, "breakpointhook", lambda: frames.append(sys._getframe(1)))
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = nan(4)
    launch((1,), debugged, (a, out))
    torch.testing.assert_close(out, a)
    assert "1.000000, 2.000000, 3.000000, 4.000000" in capsys.readouterr().out
    assert [f.f_code.co_name for f in frames] == ["debugged"] and "t" in frames[0].f_locals
    with pytest.raises(KernelError) as info:
        launch((1,), raises_in_kernel, (a, nan(4)))
    names = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "raises_in_kernel" in names


def test_compile_for_a_gpu_you_do_not_have():
    """``ops.tools.aot.compile_cubin`` compiles for sm_80, sm_90 and sm_100 on a CPU (an ELF
    cubin); ``python -m ops.tools.sass`` has a command line."""
    assert aot.ARCHS == ["sm_80", "sm_90", "sm_100"]
    for arch in ("sm_80", "sm_100"):
        assert aot.compile_cubin(copy_with_hint, (meta(16), meta(16)), arch)[:4] == b"\x7fELF"
    assert callable(sass.main) and 'if __name__ == "__main__":' in inspect.getsource(sass)


def test_specialised_source_and_source_diff():
    """``specialised_source(plan)`` shows one launch's code with its constants;
    ``source_diff(fn, {"LOAD_LAT": 0}, {"LOAD_LAT": 8})`` shows a config as a code change."""
    from ops.core.chunk_cumsum import chunk_cumsum_core_plan
    from ops.kernels.common import load_state
    from ops.tools.source import source_diff, specialised_source
    plan = chunk_cumsum_core_plan(meta(1, 128, 8), meta(8), 64)
    text = specialised_source(plan)
    assert "CHUNK=64" in text.splitlines()[0] and "def chunk_cumsum_core_kernel" in text
    diff = source_diff(load_state, {"LOAD_LAT": 0}, {"LOAD_LAT": 8})
    assert any(line.startswith("+") and "latency=" in line for line in diff.splitlines())


@ct.kernel
def record_block(out):
    ORDER.append((ct.bid(0), ct.bid(1)))


ORDER = []


def test_blocks_run_one_after_another():
    """The interpreter runs the blocks one at a time, x fastest, then y."""
    ORDER.clear()
    launch((2, 3), record_block, (nan(1),))
    assert ORDER == [(x, y) for y in range(3) for x in range(2)]


def test_pins_paths_and_references():
    """The page's version pin is the project's and the installed one; the files, folders and
    README section it names exist; it tells how to run another project's kernel."""
    pin = re.search(r"this project pins `([^`]+)`", page_text()).group(1)
    assert f"cuda-tile{pin}" in (ROOT / "requirements.txt").read_text().split()
    assert importlib.metadata.version("cuda-tile").startswith("1.7.")
    paths = {p for p in re.findall(r"`(ops/[\w/.]*)`", page_text())}
    assert {"ops/core/", "ops/interpreter/", "ops/core/chunk_cumsum.py"} <= paths
    for path in paths:
        assert (ROOT / path).exists(), path
    assert "### Your own kernels" in (ROOT / "README.md").read_text()
    assert "`ops.interpreter.launch(grid, kernel, args)`" in page_text()
