"""What a launch touched: the array elements each block loaded and stored.

``launch(grid, kernel, args, record=True)`` returns a `Trace`: one `Access` per memory operation
that ran, in the order they ran, each saying which block made it, from which kernel line, on
which kernel argument, and exactly which elements of that argument it read or wrote (a boolean
tensor of the argument's shape).  A grader turns it into "block (2, 0) stored out[32:48, 0:32]";
``ops.tools.picture`` draws it.

What is recorded
----------------
* ``ct.load`` / ``ct.store`` (with ``order=`` and partial tiles), ``TiledView.load`` /
  ``store`` / ``atomic_store_*`` (stores), ``ct.gather`` / ``ct.scatter`` and the
  advanced-indexing loads and stores.  ``ct.atomic_*`` on arrays and raw-memory accesses are
  not.
* ``elements`` holds only in-bounds elements.  The rest of the tile is counted in ``padded``:
  padding read on a load, elements dropped on a store.  For gather / scatter and advanced
  indexing, ``padded`` counts the enabled lanes whose index fell outside the array (lanes
  switched off by ``mask`` touch nothing and are not counted); a gather reads
  ``padding_value``, not a ``PaddingMode``, so its ``padding_mode`` is None.
* An access is the argument's whose array the kernel used (a tensor passed twice is two
  arguments, each named by the parameter it came through).  An array that is a view of an
  argument (``Array.slice``) is mapped back through memory: the storage offsets of the touched
  elements are decoded in the argument's strides, trying first an argument with the same layout,
  then the same strides, then any whose memory holds every touched element.
  An array no argument holds (a tensor inside a tuple argument, say) keeps ``arg=None``,
  ``name="?"`` and an ``elements`` mask of its own shape.  Recording never makes a launch fail:
  an access it cannot record warns and is left out.

Cost: nothing when off (the operations check one context variable); when on, one bool tensor
of the argument's size per access, so record small problems.
"""
import contextlib
import contextvars
import dataclasses
import math
import os
import warnings

import torch

from .errors import kernel_frame
from .work import COUNTING

# The recorder of the launch running on this thread; None (the common case) when not recording.
ACTIVE = contextvars.ContextVar("interpreter_trace", default=None)

# Operations whose accesses are one box of the array: the tile starts at the box's corner, so its
# padding is whole rows or columns of the tile and can be drawn past the array's end.
BOX_OPS = ("ct.load", "ct.store", "TiledView.load", "TiledView.store")


@dataclasses.dataclass(frozen=True, eq=False)   # eq=False: `elements` is a tensor
class Access:
    """One memory operation of one block: which elements of which kernel argument it touched."""
    block: tuple            # (x, y, z) of the block
    kind: str               # "load" or "store"
    arg: "int | None"       # position of the kernel argument; None if no argument holds the array
    name: str               # that parameter's name, "?" if unknown
    elements: torch.Tensor  # bool, the argument's shape: the in-bounds elements read or written
    tile_shape: tuple       # the tile's shape (for gather / scatter: the index shape)
    padded: int             # tile elements outside the array: padding read, or stores dropped
    padding_mode: "str | None"  # loads: the ct.PaddingMode name; None for stores and gather
    filename: str           # the kernel source line that made the access
    line: int
    function: str
    order: "tuple | None"   # the order= permutation if not the identity
    op: str = ""            # the operation: "ct.load", "TiledView.store", "ct.gather", ...


def normalize_block(value):
    """A block index given as an int or a tuple of 1 to 3 ints -> (x, y, z), missing axes 0."""
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(items, tuple) or not 1 <= len(items) <= 3
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in items)):
        raise ValueError(f"a block index is an int or a tuple of 1 to 3 ints, got {value!r}")
    return items + (0,) * (3 - len(items))


def grid_order(block):
    """Sort key of (x, y, z) blocks in the order a launch runs them: x fastest, then y, then z."""
    return block[2], block[1], block[0]


def block_name(block, grid):
    """A block as a learner writes it: ``3`` in a 1-D grid, ``(2, 0)`` in a 2-D one."""
    rank = max([1] + [axis + 1 for axis in range(3) if grid[axis] > 1])
    return str(block[0]) if rank == 1 else str(tuple(block[:rank]))


def _shape_text(shape):
    return "x".join(map(str, shape)) if shape else "scalar"


def _plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def box(mask):
    """(starts, stops) of the smallest box holding the True elements of ``mask``; None if none."""
    if not bool(mask.any()):
        return None
    if mask.dim() == 0:
        return (), ()
    where = mask.nonzero()
    return (tuple(where.min(0).values.tolist()), tuple((where.max(0).values + 1).tolist()))


def region_text(name, mask):
    """``name[32:48, 0:32]`` when the True elements form a box, else ``name: 37 elements in
    [32:48, 0:64]`` (the box around them), ``name: no elements`` when there are none."""
    bounds = box(mask)
    if bounds is None:
        return f"{name}: no elements"
    if mask.dim() == 0:
        return name
    inner = ", ".join(f"{a}:{b}" for a, b in zip(*bounds))
    count = int(mask.sum())
    if count == math.prod(b - a for a, b in zip(*bounds)):
        return f"{name}[{inner}]"
    return f"{name}: {count} elements in [{inner}]"


def tile_box(access):
    """(starts, stops) of the whole tile of a box access (``ct.load``, ``ct.store``, a tiled
    view's load or store) in its argument's coordinates, running past the array where the tile
    does; None for other accesses or when it cannot be told.  A tile starts inside the array,
    so its origin is the corner of its in-bounds elements; along argument axis ``order[j]`` it
    spans ``tile_shape[j]``."""
    if access.op not in BOX_OPS and not access.op.startswith("TiledView.atomic_store_"):
        return None
    bounds = box(access.elements)
    ndim = access.elements.dim()
    if bounds is None or not access.tile_shape or len(access.tile_shape) != ndim:
        return None
    starts, stops = bounds
    if int(access.elements.sum()) != math.prod(b - a for a, b in zip(starts, stops)):
        return None
    order = access.order or tuple(range(ndim))
    sizes = [0] * ndim
    for j, axis in enumerate(order):
        sizes[axis] = access.tile_shape[j]
    return starts, tuple(a + s for a, s in zip(starts, sizes))


def padding_text(access):
    """``6 rows padded`` / ``28 elements dropped`` (with ``: MODE`` for loads), or ""."""
    if not access.padded:
        return ""
    verb = "padded" if access.kind == "load" else "dropped"
    what = _plural(access.padded, "element")
    whole = tile_box(access)
    if whole is not None and access.elements.dim() == 2:
        starts, stops = box(access.elements)
        order = access.order or (0, 1)
        short = [j for j in (0, 1)
                 if stops[order[j]] - starts[order[j]] < access.tile_shape[j]]
        if len(short) == 1:
            j = short[0]
            missing = access.tile_shape[j] - (stops[order[j]] - starts[order[j]])
            what = _plural(missing, ("row", "column")[j])
    text = f"{what} {verb}"
    return f"{text}: {access.padding_mode}" if access.padding_mode else text


@dataclasses.dataclass(eq=False)
class Trace:
    """What one launch recorded: its grid, the kernel's parameters, and every access in order.

    ``arg`` (in `loads`, `stores`, `writers`) is a parameter's position or its name; ``block``
    an int or a tuple of up to 3 ints, missing axes 0, as ``launch(blocks=...)`` takes them.
    """
    grid: tuple                 # (x, y, z)
    arg_names: list             # the kernel's parameter names, in order
    arg_shapes: dict            # position -> shape, for the array (tensor) arguments
    accesses: list = dataclasses.field(default_factory=list)
    blocks: list = dataclasses.field(default_factory=list)   # the blocks that ran, in order
    kernel: str = ""            # the kernel function's name
    filename: str = ""          # and its file

    def __repr__(self):
        return (f"Trace({self.kernel or 'kernel'}, grid {self.grid}: {len(self.accesses)} "
                f"accesses by {len(self.blocks)} blocks)")

    def position(self, arg):
        """The position of parameter ``arg`` (its position or its name)."""
        if isinstance(arg, str):
            if arg not in self.arg_names:
                raise ValueError(f"the kernel has no parameter {arg!r}; its parameters are "
                                 f"{self.arg_names}")
            return self.arg_names.index(arg)
        if isinstance(arg, bool) or not isinstance(arg, int) or not \
                0 <= arg < len(self.arg_names):
            raise ValueError(f"arg must be a parameter name or a position below "
                             f"{len(self.arg_names)}, got {arg!r}")
        return arg

    def _select(self, kind, block, arg):
        block = None if block is None else normalize_block(block)
        arg = None if arg is None else self.position(arg)
        return [a for a in self.accesses if a.kind == kind and
                (block is None or a.block == block) and (arg is None or a.arg == arg)]

    def loads(self, block=None, arg=None):
        """The loads (of ``block``, of argument ``arg``; None: all), in the order they ran."""
        return self._select("load", block, arg)

    def stores(self, block=None, arg=None):
        """The stores (of ``block``, of argument ``arg``; None: all), in the order they ran."""
        return self._select("store", block, arg)

    def writers(self, arg, index):
        """The blocks that stored element ``index`` (a tuple, or an int for a 1-D argument) of
        argument ``arg``, in the order they first did: more than one is a race on the GPU,
        where blocks run in no set order."""
        position = self.position(arg)
        index = (index,) if isinstance(index, int) else tuple(index)
        shape = self.arg_shapes.get(position)
        if shape is None:
            raise ValueError(f"argument {self.arg_names[position]!r} is not an array")
        if len(index) != len(shape) or not all(0 <= i < n for i, n in zip(index, shape)):
            raise IndexError(f"index {index} is not inside {self.arg_names[position]} of "
                             f"shape {shape}")
        found = []
        for access in self.stores(arg=position):
            if access.block not in found and bool(access.elements[index]):
                found.append(access.block)
        return found

    def region(self, access):
        """The elements ``access`` touched, as text: ``out[32:48, 0:32]`` when they form a box,
        else ``out: 37 elements in [32:48, 0:64]``."""
        return region_text(access.name, access.elements)

    def where(self, access):
        """``line 7`` for the kernel's own lines; a helper's line names its function (and its
        file when it is another)."""
        if access.filename == self.filename and access.function == self.kernel:
            return f"line {access.line}"
        if access.filename == self.filename:
            return f"line {access.line} in {access.function}"
        return f"{os.path.basename(access.filename)}:{access.line} in {access.function}"

    def text(self, access):
        """One access as a line: ``line 7: load a[32:48, 0:32] (tile 16x32, 6 rows padded:
        UNDETERMINED)``.  ``ct.load`` / ``ct.store`` read as load / store, other operations
        by their name; the order= permutation is added when it is not the identity."""
        verb = {"ct.load": "load", "ct.store": "store"}.get(access.op, access.op or access.kind)
        notes = [f"tile {_shape_text(access.tile_shape)}"]
        if access.padded:
            notes.append(padding_text(access))
        if access.order is not None:
            notes.append(f"order {access.order}")
        return f"{self.where(access)}: {verb} {self.region(access)} ({', '.join(notes)})"

    def summary(self, block):
        """What ``block`` loaded and stored, one line per access in the order they ran."""
        block = normalize_block(block)
        lines = [self.text(a) for a in self.accesses if a.block == block]
        if not lines:
            ran = "ran" if block in self.blocks else "did not run"
            lines = [f"block {block_name(block, self.grid)} {ran} and touched no array"]
        return "\n".join(lines)


def _decode(offsets, base):
    """The indices into ``base`` of the storage offsets ``offsets`` (int64, in elements), one
    tensor per axis; None unless every offset is an element of ``base``.  Axes are taken from
    the largest stride down, as in a mixed-radix number, and the result is checked."""
    rest = offsets - base.storage_offset()
    indices = [None] * base.dim()
    for axis in sorted(range(base.dim()), key=lambda d: -base.stride(d)):
        stride, extent = base.stride(axis), base.shape[axis]
        if extent == 1 or stride == 0:
            indices[axis] = torch.zeros_like(rest)
            continue
        index = torch.div(rest, stride, rounding_mode="floor").clamp(0, extent - 1)
        rest = rest - index * stride
        indices[axis] = index
    if not bool((rest == 0).all()):
        return None
    return indices


def record_region(op, kind, array, region, tile_shape, **kwargs):
    """Report a box access to the launch's `Recorder`, if it records (``Recorder.region``): the
    one call ``ct.load``, ``ct.store`` and a tiled view's loads and stores make (their arguments
    are already computed; the element-wise operations check ``ACTIVE`` themselves, since theirs
    cost work to build). Counted too where ``work.count_work`` counts."""
    recorder = ACTIVE.get()
    if recorder is not None:
        recorder.region(op, kind, array, region, tile_shape, **kwargs)
    work = COUNTING.get()
    if work is not None:
        work.access(kind, array, region)


@contextlib.contextmanager
def recording(recorder):
    """While a launch runs: the `Recorder` its operations report to (None: no recording)."""
    token = ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        ACTIVE.reset(token)


class Recorder:
    """Collects a launch's accesses into ``trace``; `runner.launch` sets ``block``.

    ``tensors``: position -> the tensor passed there, for the array arguments; ``arrays``:
    position -> the `Array` the kernel gets there (one tensor passed twice is two arrays, and
    an access through either is the argument it came through).
    """

    def __init__(self, trace, tensors, arrays):
        self.trace = trace
        self.block = (0, 0, 0)
        self._tensors = tensors
        self._arrays = arrays
        self._candidates = {}

    def _arguments_of(self, t):
        """The argument positions that may hold tensor ``t``, the likeliest first (cached by
        layout: views are new tensors at every call)."""
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
               t.dtype)
        if key not in self._candidates:
            ranked = []
            for position, base in self._tensors.items():
                if base is t or (base.untyped_storage().data_ptr() == key[0]
                                 and base.element_size() == t.element_size()):
                    same = base is t or (base.storage_offset(), tuple(base.shape),
                                         base.stride(), base.dtype) == key[1:]
                    rank = 0 if same else 1 if base.stride() == t.stride() else 2
                    ranked.append((rank, position))
            self._candidates[key] = sorted(ranked)
        return self._candidates[key]

    def _locate(self, array, mask):
        """(position, elements of that argument) for the True elements of ``mask`` (the
        array's shape), or (None, mask) when no argument holds them all."""
        for position, argument in self._arrays.items():
            if argument is array:
                return position, mask
        t, offsets = array._t, None
        for rank, position in self._arguments_of(t):
            base = self._tensors[position]
            if rank == 0:
                return position, mask
            if offsets is None:
                where = mask.nonzero()
                strides = torch.tensor(t.stride(), dtype=torch.int64)
                offsets = t.storage_offset() + (where * strides).sum(1)
            indices = _decode(offsets, base)
            if indices is not None:
                elements = torch.zeros(base.shape, dtype=torch.bool)
                if offsets.numel():
                    elements[tuple(indices)] = True
                return position, elements
        return None, mask

    def _add(self, op, kind, array, mask, tile_shape, padded, padding_mode, order):
        position, elements = self._locate(array, mask)
        filename, line, function = kernel_frame()
        name = "?" if position is None else self.trace.arg_names[position]
        self.trace.accesses.append(Access(
            block=self.block, kind=kind, arg=position, name=name, elements=elements,
            tile_shape=tuple(tile_shape), padded=int(padded),
            padding_mode=None if padding_mode is None else padding_mode.name,
            filename=filename, line=line, function=function, order=order, op=op))

    def _guarded(self, op, record):
        try:
            record()
        except Exception as e:      # recording must never make a launch fail
            warnings.warn(f"{op}: this access could not be recorded ({type(e).__name__}: {e})",
                          RuntimeWarning, stacklevel=3)

    def region(self, op, kind, array, region, tile_shape, *, order=None, padding_mode=None):
        """A box access: ``region`` (slices of ``array`` with its axes permuted by ``order``)
        is the in-bounds part of a tile of ``tile_shape``."""
        def record():
            mask = torch.zeros(array.shape, dtype=torch.bool)
            identity = order is None or tuple(order) == tuple(range(array.ndim))
            (mask if identity else mask.permute(order))[region] = True
            full = math.prod(tile_shape) if tile_shape else 1
            self._add(op, kind, array, mask, tile_shape, full - int(mask.sum()),
                      padding_mode if kind == "load" else None,
                      None if identity else tuple(order))
        self._guarded(op, record)

    def lanes(self, op, kind, array, indices, tile_shape, padded, *, padding_mode=None):
        """An element-wise access: ``indices`` (one int64 tensor per axis) are the in-bounds
        lanes that touched memory; ``padded`` enabled lanes fell outside."""
        def record():
            mask = torch.zeros(array.shape, dtype=torch.bool)
            if array.ndim:
                mask[tuple(indices)] = True
            else:
                mask[()] = True
            self._add(op, kind, array, mask, tile_shape, padded,
                      padding_mode if kind == "load" else None, None)
        self._guarded(op, record)
