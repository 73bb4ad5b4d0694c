"""Pictures of what each block of a launch touched, drawn from an interpreter `Trace`.

    trace = interpreter.launch(grid, kernel, args, record=True)
    fig = draw(trace, "out")            # one panel per block: the cells it loaded and stored
    fig.savefig("out.png")
    print(describe(trace, "out"))       # the same, as text

Each panel is the whole argument, one cell per element (row 0 at the top, as a matrix is
printed): blue cells the block loaded, orange cells it stored, purple cells both, light grey
cells it did not touch.  The part of a tile that fell past the array's end lies outside the
array's black border, hatched: padding a load read (its ``PaddingMode`` in the legend), or
elements a store dropped.  A 1-D argument is one row of cells; an argument of 3 or more axes is
drawn over its last two, a cell coloured when the block touched any element behind it.
The figure is a ``matplotlib.figure.Figure`` on an Agg canvas, made without pyplot: nothing is
shown, pyplot's backend is not touched and its list of open figures stays empty (a grader may
draw many).  A notebook shows it as a cell's value (as a PNG, whether or not pyplot was
imported); a script saves it.  matplotlib is imported with this module: nothing in ``ops``
needs it but the tools that draw.
"""
import io
import math

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from ops.interpreter.trace import (block_name, box, grid_order, normalize_block, region_text,
                                   tile_box)

COLOURS = {"untouched": "#eeeeee", "load": "#3b7dd8", "store": "#f08c1e", "both": "#8e52b0"}
HATCHES = {"load": "///", "store": "\\\\\\"}
SMALL = 64          # up to this many cells along every axis: a border around each cell


class Picture(Figure):
    """A figure that shows itself in a notebook as a PNG, with or without pyplot's inline
    backend (which otherwise only displays the figures pyplot made)."""

    def _repr_png_(self):
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", bbox_inches="tight")
        return buffer.getvalue()


def _union(accesses, shape):
    mask = torch.zeros(shape, dtype=torch.bool)
    for access in accesses:
        mask |= access.elements
    return mask


def _modes(accesses):
    """The padding modes of the accesses that read padding, as text ("" when none is named)."""
    return ", ".join(sorted({a.padding_mode for a in accesses if a.padded and a.padding_mode}))


def _selected(trace, blocks):
    if blocks is None:
        return list(trace.blocks)
    chosen = {normalize_block(b) for b in blocks}
    return sorted(chosen, key=grid_order)


def _accesses(trace, position, blocks, kind):
    """(loads, stores) of ``blocks`` on argument ``position``, as ``kind`` asks."""
    blocks = set(blocks)
    loads = [a for a in trace.loads(arg=position) if a.block in blocks] \
        if kind in ("load", "both") else []
    stores = [a for a in trace.stores(arg=position) if a.block in blocks] \
        if kind in ("store", "both") else []
    return loads, stores


def describe(trace, arg):
    """What each block that ran loaded and stored of argument ``arg`` (position or name), one
    line per block in grid order: ``block 3: load x[96:100] (28 padded: UNDETERMINED)``.
    Several accesses of one kind are merged into the elements they touched together."""
    position = trace.position(arg)
    name, shape = trace.arg_names[position], trace.arg_shapes.get(position)
    if shape is None:
        raise ValueError(f"argument {name!r} is not an array")
    lines = [f"{name} {tuple(shape)}, grid {trace.grid}:"]
    for block in trace.blocks:
        loads, stores = _accesses(trace, position, [block], "both")
        parts = []
        for verb, accesses, extra in (("load", loads, "padded"), ("store", stores, "dropped")):
            if not accesses:
                continue
            text = f"{verb} {region_text(name, _union(accesses, shape))}"
            padded = sum(a.padded for a in accesses)
            if padded:
                modes = _modes(accesses)
                text += f" ({padded} {extra}{': ' + modes if modes else ''})"
            parts.append(text)
        lines.append(f"block {block_name(block, trace.grid)}: "
                     f"{'; '.join(parts) if parts else 'nothing'}")
    return "\n".join(lines)


def _plane(mask):
    """A mask as the 2-D grid of cells drawn: a row for 1-D, the last two axes for more."""
    if mask.dim() == 0:
        return mask.reshape(1, 1)
    if mask.dim() == 1:
        return mask.reshape(1, -1)
    if mask.dim() == 2:
        return mask
    return mask.flatten(0, -3).any(0)


def _padding_bands(access):
    """The padded part of a box access's tile, as (row0, row1, col0, col1) cell ranges in the
    drawn plane: the tile's box minus its in-bounds box (a band right of it and one below)."""
    whole = tile_box(access)
    inner = box(access.elements)
    if whole is None or inner is None or not whole[0]:
        return []
    (t0, t1), (i0, i1) = whole, inner
    if len(t0) == 1:
        t0, t1, i0, i1 = (0,) + t0, (1,) + t1, (0,) + i0, (1,) + i1
    (r0, c0), (r1, c1) = t0[-2:], t1[-2:]
    ir1, ic1 = i1[-2], i1[-1]
    bands = []
    if c1 > ic1:
        bands.append((r0, r1, ic1, c1))
    if r1 > ir1:
        bands.append((ir1, r1, c0, min(c1, ic1)))
    return bands


def _panel(ax, plane, loaded, stored, loads, stores, limits, one_dimensional):
    """One block's picture in ``ax``: coloured cells, the array's border, hatched padding."""
    rows, cols = plane
    category = loaded.to(torch.int64) + 2 * stored.to(torch.int64)
    cmap = ListedColormap([COLOURS[k] for k in ("untouched", "load", "store", "both")])
    ax.imshow(category.numpy(), cmap=cmap, vmin=-0.5, vmax=3.5, interpolation="nearest",
              aspect="auto" if one_dimensional else "equal")
    ax.add_patch(Rectangle((-0.5, -0.5), cols, rows, fill=False, edgecolor="black",
                           linewidth=1.5, zorder=3))
    # Stores' bands are transparent: where a tile read padding and dropped stores over the same
    # cells, both hatchings show.
    for kind, accesses in (("load", loads), ("store", stores)):
        for access in accesses:
            for r0, r1, c0, c1 in _padding_bands(access):
                ax.add_patch(Rectangle(
                    (c0 - 0.5, r0 - 0.5), c1 - c0, r1 - r0,
                    facecolor="white" if kind == "load" else "none",
                    edgecolor=COLOURS[kind], hatch=HATCHES[kind], linewidth=1.0, zorder=2,
                    gid=f"padding-{kind}"))
    max_rows, max_cols = limits
    ax.set_xlim(-0.5, max_cols - 0.5)
    ax.set_ylim(max_rows - 0.5, -0.5)
    for axis, extent, bins in ((ax.xaxis, max_cols, 16 if one_dimensional else 8),
                               (ax.yaxis, max_rows, 8)):
        # Element indices, at steps a tile size divides (4, 8, 16, ...) where they fit.
        axis.set_major_locator(MaxNLocator(nbins=bins, integer=True, steps=[1, 2, 4, 8, 10]))
        if max(max_rows, max_cols) <= SMALL:     # a border around every cell
            axis.set_ticks([k - 0.5 for k in range(extent + 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    ax.tick_params(which="major", labelsize=7)
    for spine in ax.spines.values():    # the array's own border is the one drawn
        spine.set_visible(False)
    if one_dimensional:
        ax.set_yticks([])


def _title(block_text, loads, stores):
    lines = [block_text]
    padded = sum(a.padded for a in loads)
    dropped = sum(a.padded for a in stores)
    if padded:
        modes = _modes(loads)
        lines.append(f"{padded} padded{': ' + modes if modes else ''}")
    if dropped:
        lines.append(f"{dropped} dropped")
    return "\n".join(lines)


def _legend_handles(loads, stores, categories):
    """Legend entries for the cell colours present (``categories``), untouched cells and
    the padding drawn."""
    labels = {1: ("load", "loaded"), 2: ("store", "stored"), 3: ("both", "loaded and stored")}
    handles = [Patch(facecolor=COLOURS[labels[c][0]], label=labels[c][1])
               for c in sorted(categories) if c in labels]
    handles.append(Patch(facecolor=COLOURS["untouched"], edgecolor="black", label="untouched"))
    modes = _modes(loads)
    if any(a.padded for a in loads):
        handles.append(Patch(facecolor="white", edgecolor=COLOURS["load"], hatch=HATCHES["load"],
                             label=f"padding read past the end{' (' + modes + ')' if modes else ''}"))
    if any(a.padded for a in stores):
        handles.append(Patch(facecolor="white", edgecolor=COLOURS["store"],
                             hatch=HATCHES["store"], label="store dropped past the end"))
    return handles


def draw(trace, arg, *, blocks=None, kind="both", ax=None, max_blocks=16):
    """A figure of argument ``arg`` (position or name) with one panel per block: the cells it
    loaded and stored and the padding its tiles read past the array's end.

    ``blocks``: the blocks to draw (block indices as ``launch(blocks=...)`` takes them), by
    default every block that ran; at most ``max_blocks`` panels, in grid order.  ``kind``:
    "load", "store" or "both".  ``ax``: draw into this one axes instead, all the selected
    blocks together (what they touched between them).  Returns the figure.
    """
    if kind not in ("load", "store", "both"):
        raise ValueError(f"kind must be 'load', 'store' or 'both', got {kind!r}")
    position = trace.position(arg)
    name, shape = trace.arg_names[position], trace.arg_shapes.get(position)
    if shape is None:
        raise ValueError(f"argument {name!r} is not an array")
    chosen = _selected(trace, blocks)
    shown = chosen[:max_blocks] if ax is None else chosen
    plane = tuple(_plane(torch.zeros(shape, dtype=torch.bool)).shape)
    one_dimensional = len(shape) <= 1

    panels = []
    for group in ([[b] for b in shown] if ax is None else [shown]):
        loads, stores = _accesses(trace, position, group, kind)
        panels.append((group, loads, stores))
    # Every panel spans the array and the farthest padding band, so that panels line up.
    max_rows, max_cols = plane
    for _, loads, stores in panels:
        for access in loads + stores:
            for _, r1, _, c1 in _padding_bands(access):
                max_rows, max_cols = max(max_rows, r1), max(max_cols, c1)
    all_loads = [a for _, loads, _ in panels for a in loads]
    all_stores = [a for _, _, stores in panels for a in stores]
    categories = set()
    for _, loads, stores in panels:
        both = _union(loads, shape).to(torch.int64) + 2 * _union(stores, shape).to(torch.int64)
        categories |= set(both.unique().tolist())
    handles = _legend_handles(all_loads, all_stores, categories)

    what = {"load": "loaded", "store": "stored", "both": "loaded and stored"}[kind]
    title = f"{name} {tuple(shape)}: what each block {what}"
    if len(shape) > 2:
        folded = "axis 0" if len(shape) == 3 else f"axes 0-{len(shape) - 3}"
        title += f"\n({folded} folded: a cell is coloured if any element behind it was touched)"
    if ax is None and len(chosen) > len(shown):
        title += f"\n(the first {len(shown)} of {len(chosen)} blocks)"

    if ax is not None:
        group, loads, stores = panels[0]
        text = (f"block {block_name(group[0], trace.grid)}" if len(group) == 1
                else f"{len(group)} blocks together")
        _panel(ax, plane, _plane(_union(loads, shape)), _plane(_union(stores, shape)), loads,
               stores, (max_rows, max_cols), one_dimensional)
        ax.set_title(f"{name} {tuple(shape)}: " + _title(text, loads, stores), fontsize=9)
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8,
                  frameon=False)
        return ax.figure

    count = max(len(panels), 1)
    if one_dimensional:
        ncols, nrows = 1, count
        width = min(14.0, max(6.0, 0.1 * max_cols + 1.5))
        figsize = (width, 0.8 * nrows + 1.3)
    else:
        ncols = min(count, 4)
        nrows = math.ceil(count / ncols)
        aspect = min(3.0, max(0.3, max_rows / max_cols))
        figsize = (3.2 * ncols + 0.6, (2.9 * aspect + 0.8) * nrows + 1.0)
    fig = Picture(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)    # measures the text when the layout is made, at the first save
    axes = fig.subplots(nrows, ncols, squeeze=False)
    flat = list(axes.flat)
    for k, panel_ax in enumerate(flat):
        if k >= len(panels):
            fig.delaxes(panel_ax)
            continue
        group, loads, stores = panels[k]
        _panel(panel_ax, plane, _plane(_union(loads, shape)), _plane(_union(stores, shape)),
               loads, stores, (max_rows, max_cols), one_dimensional)
        panel_ax.set_title(_title(f"block {block_name(group[0], trace.grid)}", loads, stores),
                           fontsize=9, loc="left" if one_dimensional else "center")
        if k // ncols == nrows - 1 or k + ncols >= len(panels):
            panel_ax.set_xlabel("index" if one_dimensional else "column", fontsize=8)
        if k % ncols == 0 and not one_dimensional:
            panel_ax.set_ylabel("row", fontsize=8)
    if not panels:
        title += "\n(no block ran)"
    fig.suptitle(title, fontsize=11)
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 3),
               fontsize=8, frameon=False)
    # The constrained layout settles in two passes (titles move once the axes are placed): make
    # the first here, so that the first save or display is laid out.
    fig.draw_without_rendering()
    return fig
