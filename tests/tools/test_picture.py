"""ops.tools.picture: what each block of a launch touched, drawn and written out.

The figures are made without pyplot (nothing to close), except where a test hands draw() an
axes of its own. The kernel is the interpreter's partial-tile example: 100 elements in tiles of 32, so the last
of 4 blocks reads 4 elements and 28 of padding.  The figure is checked through its artists (a
panel per block, the hatched padding only in the last one) and by saving it; the text form is
compared with a string written out by hand.
"""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import cuda.tile as ct  # noqa: E402

from ops import interpreter  # noqa: E402
from ops.tools.picture import describe, draw  # noqa: E402
from tests.interpreter.helpers import poisoned, randn  # noqa: E402


@ct.kernel
def double_vector(x, out, T: ct.Constant[int]):
    b = ct.bid(0)
    t = ct.load(x, (b,), (T,))
    ct.store(out, (b,), t * 2)


@pytest.fixture
def trace():
    x, out = randn(100), poisoned(100)
    recorded = interpreter.launch(4, double_vector, (x, out, 32), record=True)
    assert torch.equal(out, x * 2)
    return recorded


def hatched(ax):
    return [p for p in ax.patches if p.get_hatch()]


def test_one_panel_per_block_and_padding_only_in_the_last(trace, tmp_path):
    open_before = plt.get_fignums()         # other tests may leave pyplot figures open
    fig = draw(trace, "x")
    assert [ax.get_title(loc="left").splitlines()[0] for ax in fig.axes] == [
        "block 0", "block 1", "block 2", "block 3"]
    assert [len(hatched(ax)) for ax in fig.axes] == [0, 0, 0, 1]
    [band] = hatched(fig.axes[3])
    # The band lies past the array's end: elements 100..127 (cell edges at k - 0.5).
    assert (band.get_x(), band.get_width()) == (99.5, 28)
    assert fig.axes[3].get_title(loc="left").splitlines()[1] == "28 padded: UNDETERMINED"
    [legend] = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["loaded", "untouched", "padding read past the end (UNDETERMINED)"]
    path = tmp_path / "x.png"
    fig.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert plt.get_fignums() == open_before     # pyplot's list of figures is left alone
    assert isinstance(fig, Figure) and fig._repr_png_()[:4] == b"\x89PNG"   # notebooks


def test_stores_and_selected_blocks(trace):
    fig = draw(trace, "out", blocks=[3, 1])
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["block 1", "block 3\n28 dropped"]
    assert [p.get_gid() for p in hatched(fig.axes[1])] == ["padding-store"]
    fig = draw(trace, "x", max_blocks=2)
    assert len(fig.axes) == 2 and "the first 2 of 4 blocks" in fig._suptitle.get_text()
    fig = draw(trace, "x", kind="store")
    assert all(ax.patches[1:] == [] for ax in fig.axes)      # only the array's border
    with pytest.raises(ValueError, match="kind must be"):
        draw(trace, "x", kind="loads")


def test_into_one_axes(trace):
    fig, ax = plt.subplots()
    try:
        assert draw(trace, 0, blocks=[2, 3], ax=ax) is fig
        assert len(fig.axes) == 1 and "2 blocks together" in ax.get_title()
        assert len(hatched(ax)) == 1
    finally:
        plt.close(fig)


@ct.kernel
def copy_tiles(a, out, TM: ct.Constant[int], TN: ct.Constant[int]):
    t = ct.load(a, (ct.bid(0), ct.bid(1)), (TM, TN))
    ct.store(out, (ct.bid(0), ct.bid(1)), t)


@ct.kernel
def copy_planes(a, out):
    ct.store(out, (ct.bid(0), 0, 0), ct.load(a, (ct.bid(0), 0, 0), (1, 4, 8)))


def test_two_and_three_dimensional_arguments():
    a, out = randn(20, 24), poisoned(20, 24)
    trace = interpreter.launch((2, 2), copy_tiles, (a, out, 16, 16), record=True)
    fig = draw(trace, "a")
    assert [ax.get_title().splitlines()[0] for ax in fig.axes] == [
        "block (0, 0)", "block (1, 0)", "block (0, 1)", "block (1, 1)"]
    # Block (1, 1): 4 of 16 rows and 8 of 16 columns inside: a band right, one below.
    assert [len(hatched(ax)) for ax in fig.axes] == [0, 1, 1, 2]

    a, out = randn(2, 4, 8), poisoned(2, 4, 8)
    trace = interpreter.launch(2, copy_planes, (a, out), record=True)
    fig = draw(trace, "out")
    assert "folded" in fig._suptitle.get_text() and len(fig.axes) == 2


def test_describe(trace):
    assert describe(trace, "x") == (
        "x (100,), grid (4, 1, 1):\n"
        "block 0: load x[0:32]\n"
        "block 1: load x[32:64]\n"
        "block 2: load x[64:96]\n"
        "block 3: load x[96:100] (28 padded: UNDETERMINED)")
    assert describe(trace, 1) == (
        "out (100,), grid (4, 1, 1):\n"
        "block 0: store out[0:32]\n"
        "block 1: store out[32:64]\n"
        "block 2: store out[64:96]\n"
        "block 3: store out[96:100] (28 dropped)")
    with pytest.raises(ValueError, match="'T' is not an array"):
        describe(trace, "T")
