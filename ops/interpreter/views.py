"""Array views: Array.slice and Array.tiled_view (TiledView load / store / atomic stores).

``array.slice(axis, start, stop)`` is an `Array` over a torch view of the
same memory (``Tensor.narrow``), so every operation on arrays works on it
and writes reach the original tensor.

``array.tiled_view(tile_shape, padding_mode=..., traversal_steps=...)`` is a
`TiledView`: tile ``i`` along an axis starts at element ``i * step`` (step =
``traversal_steps`` or the tile size) and covers ``tile size`` elements.
As for ``ct.load`` / ``ct.store``, out-of-bounds elements are padded with
the view's padding mode on load and dropped on store; a tile starting
outside the array, or a partial tile with ``check_bounds=False``, is
undefined behaviour and an error here.  ``num_tiles`` counts the tile
origins inside the array, ``ceil(extent / step)``.

The atomic stores of a tiled view touch each element once per call, so they
are exact here; their dtype rules are those of `atomics`.
"""

import torch

from cuda.tile import PaddingMode

from ops.runtime.cutile_internals import is_integral, is_signed
from .arguments import as_int, axis_index, check_shape, int_tuple
from .atomics import SUPPORTED, check_dtype, combine_fn, named, operand_values
from .errors import KernelTypeError, KernelValueError, UnsupportedOperation
from .memory import _padding_value, padding_fill
from .registry import emulates
from .trace import record_region
from .values import Array, Tile


def _require_array(op, array):
    if not isinstance(array, Array):
        raise KernelTypeError(f"{op}: needs a kernel array, got {type(array).__name__}")
    return array


def _slice_bound(op, value, what):
    """A slice bound: an int or a 0-d signed integer tile."""
    if isinstance(value, Tile):
        if value.ndim != 0 or not is_integral(value.dtype) or not is_signed(value.dtype):
            raise KernelTypeError(f"{op}: {what} must be an int or a 0-d signed integer tile, "
                                  f"got a {value.dtype} tile of shape {value.shape}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise KernelTypeError(f"{op}: {what} must be an integer, got {type(value).__name__}")
    return value


@emulates("Array.slice")
def array_slice(array, axis, start, stop):
    op = "Array.slice"
    array = _require_array(op, array)
    if isinstance(axis, Tile) or isinstance(axis, bool) or not isinstance(axis, int):
        raise KernelTypeError(f"{op}: axis must be a constant integer, got {axis!r}")
    axis = axis_index(op, axis, array.ndim)
    start = _slice_bound(op, start, "start")
    stop = _slice_bound(op, stop, "stop")
    extent = array.shape[axis]
    # The documented contract; anything else is undefined behaviour on the GPU.
    if not 0 <= start < extent or not start <= stop <= extent:
        raise KernelValueError(f"{op}: start={start}, stop={stop} must satisfy "
                               f"0 <= start < {extent} and start <= stop <= {extent} "
                               f"(the size of axis {axis})")
    return Array(array._t.narrow(axis, start, stop - start))


def _constant_shape(op, value, ndim, what, powers_of_two):
    shape = int_tuple(op, value, what)
    if isinstance(value, (tuple, list)) and len(shape) == 0 and what == "tile_shape":
        return ()
    if len(shape) != ndim:
        raise KernelTypeError(f"{op}: {what} {shape} must have one entry per array axis "
                              f"({ndim})")
    if powers_of_two:
        check_shape(op, shape)
    elif any(s <= 0 for s in shape):
        raise KernelTypeError(f"{op}: {what} {shape} must be positive")
    return shape


@emulates("Array.tiled_view")
def array_tiled_view(array, tile_shape, *, padding_mode=PaddingMode.UNDETERMINED,
                     traversal_steps=None):
    op = "Array.tiled_view"
    array = _require_array(op, array)
    shape = _constant_shape(op, tile_shape, array.ndim, "tile_shape", True)
    if not isinstance(padding_mode, PaddingMode):
        raise KernelTypeError(f"{op}: padding_mode must be a ct.PaddingMode, "
                              f"got {padding_mode!r}")
    _padding_value(op, padding_mode, array.dtype)  # NAN etc. need a float array
    full = shape or (1,) * array.ndim
    steps = full if traversal_steps is None else _constant_shape(
        op, traversal_steps, array.ndim, "traversal_steps", False)
    return TiledView(array, shape, padding_mode, steps)


class TiledView:
    """An array partitioned into tiles of `tile_shape`, whose origins are `traversal_steps` apart."""

    __slots__ = ("_array", "_shape", "_padding_mode", "_steps")

    def __init__(self, array, tile_shape, padding_mode, steps):
        self._array = array
        self._shape = tile_shape
        self._padding_mode = padding_mode
        self._steps = steps

    @property
    def dtype(self):
        return self._array.dtype

    @property
    def tile_shape(self):
        return self._shape

    @property
    def traversal_steps(self):
        return self._steps

    @property
    def ndim(self):
        return self._array.ndim

    def num_tiles(self, axis):
        axis = axis_index("TiledView.num_tiles", axis, self.ndim)
        return -(-self._array.shape[axis] // self._steps[axis])

    def _full_shape(self):
        return self._shape or (1,) * self.ndim

    def _region(self, op, index, check_bounds):
        """(array slices, tile slices or None when the tile lies wholly inside)."""
        items = index if isinstance(index, (tuple, list)) else (index,)
        index = tuple(as_int(op, i, "index") for i in items)
        if len(index) != self.ndim:
            raise KernelTypeError(f"{op}: index {index} has {len(index)} entries but the "
                                  f"tiled view has rank {self.ndim}")
        if not isinstance(check_bounds, bool):
            raise KernelTypeError(f"{op}: check_bounds must be a constant bool, "
                                  f"got {check_bounds!r}")
        full = self._full_shape()
        array_slices, tile_slices, partial = [], [], False
        for i, size, step, extent in zip(index, full, self._steps, self._array.shape):
            start = i * step
            if i < 0 or start >= extent:
                raise KernelValueError(
                    f"{op}: tile index {index} lies entirely outside the tiled view of "
                    f"array shape {self._array.shape}, tile shape {full}, steps "
                    f"{self._steps} (undefined behaviour on the GPU)")
            stop = min(start + size, extent)
            partial |= stop - start < size
            array_slices.append(slice(start, stop))
            tile_slices.append(slice(0, stop - start))
        if partial and not check_bounds:
            raise KernelValueError(f"{op}: check_bounds=False but tile {index} extends past "
                                   f"the array of shape {self._array.shape} (undefined "
                                   "behaviour)")
        return tuple(array_slices), (tuple(tile_slices) if partial else None)

    def _tile_data(self, op, value, what, bitwise=False):
        """`value` broadcast to the tile shape, converted (implicitly) to the view's dtype."""
        return operand_values(op, value, self.dtype, self._full_shape(), what, bitwise,
                              shape_name="tiled view's tile")

    def load(self, index, *, check_bounds=True, latency=None, allow_tma=None):
        op = "TiledView.load"
        region, inside = self._region(op, index, check_bounds)
        source = self._array._t
        if inside is None:
            data = source[region].clone()  # a copy: later stores must not change it
        else:
            fill = padding_fill(op, self._padding_mode, self.dtype)
            data = torch.full(self._full_shape(), fill, dtype=source.dtype)
            data[inside] = source[region]
        record_region(op, "load", self._array, region, self._shape,
                      padding_mode=self._padding_mode)
        return Tile(data.reshape(self._shape), self.dtype)

    def store(self, index, tile, *, check_bounds=True, latency=None, allow_tma=None):
        op = "TiledView.store"
        region, inside = self._region(op, index, check_bounds)
        data = self._tile_data(op, tile, "tile")
        self._array._t[region] = data if inside is None else data[inside]
        record_region(op, "store", self._array, region, self._shape)

    def _atomic_store(self, name, index, update):
        """The body of every ``atomic_store_<name>`` method (they are added below the class)."""
        op = f"TiledView.atomic_store_{name}"
        check_dtype(op, name, self.dtype)
        region, inside = self._region(op, index, True)
        data = self._tile_data(op, update, "update", bitwise=SUPPORTED[name][1])
        target = self._array._t
        # Overlapping traversal steps never put two lanes of one tile on one element.
        target[region] = combine_fn(name, self.dtype)(
            target[region], data if inside is None else data[inside])
        record_region(op, "store", self._array, region, self._shape)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnsupportedOperation(f"TiledView.{name} is not supported by the CPU interpreter")

    def __repr__(self):
        return (f"TiledView[{self.dtype}, array {self._array.shape}, tile {self._shape}, "
                f"steps {self._steps}]")


# The atomic stores of a tiled view: the read-modify-write atomics but xchg, each a method
# ``atomic_store_<op>(index, update, /)`` that returns nothing.
ATOMIC_STORES = ("add", "max", "min", "and", "or", "xor")


def _atomic_store_method(name):
    def method(self, index, update, /):
        self._atomic_store(name, index, update)
    return named(method, f"atomic_store_{name}", "TiledView")


for _name in ATOMIC_STORES:
    setattr(TiledView, f"atomic_store_{_name}", _atomic_store_method(_name))

# The view's methods are the emulations of cuTile's ``TiledView`` stubs of the same names (a
# kernel calls them on the view ``Array.tiled_view`` returned, an object of this class).
for _name in ("load", "store", "num_tiles") + tuple(f"atomic_store_{n}" for n in ATOMIC_STORES):
    emulates(f"TiledView.{_name}")(getattr(TiledView, _name))
del _name
