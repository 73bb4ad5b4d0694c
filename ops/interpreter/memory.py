"""Memory: ct.load, ct.store and ct.num_tiles, with padding and bounds checks."""

import contextlib
import contextvars
import math
import os
import warnings

import torch
from cuda.tile import MemoryOrder, MemoryScope, PaddingMode

from ops.runtime.cutile_internals import is_boolean, is_float, is_signed
from .arguments import as_int, axis_index, check_shape, constant, int_tuple
from .dtypes import convert, dtype_of_scalar, is_scalar, kind, storage, widens_to
from .errors import KernelTypeError, KernelValueError, kernel_location
from .registry import emulates
from .trace import record_region
from .values import Array, Tile


def _require_array(op, array):
    if not isinstance(array, Array):
        raise KernelTypeError(f"{op}: the first argument must be a kernel array argument, "
                              f"got {type(array).__name__}")
    return array


def _axis_order(op, order, ndim):
    """Normalize ``order`` ("C", "F" or a permutation) to a tuple of axes."""
    if order == "C":
        return tuple(range(ndim))
    if order == "F":
        return tuple(reversed(range(ndim)))
    perm = tuple(as_int(op, a, "order") % ndim if ndim else 0 for a in order)
    if sorted(perm) != list(range(ndim)):
        raise KernelTypeError(f"{op}: order {order} is not a permutation of {ndim} axes")
    return perm


def _array_view(array, order):
    """The array with its axes permuted by `order`: the space the tile index lives in."""
    if order == tuple(range(array.ndim)):
        return array._t
    return array._t.permute(order)


def _tile_region(op, space_shape, index, tile_shape, check_bounds):
    """Slices of the array and of the tile that overlap, for tile `index`.

    Returns (array_slices, tile_slices); tile_slices is None when the whole
    tile is inside the array.
    """
    array_slices, tile_slices, partial = [], [], False
    for i, size, extent in zip(index, tile_shape, space_shape):
        start = i * size
        stop = min(start + size, extent)
        if i < 0 or start >= extent:
            raise KernelValueError(
                f"{op}: tile index {tuple(index)} with tile shape {tuple(tile_shape)} lies "
                f"entirely outside the array of shape {tuple(space_shape)} "
                "(undefined behaviour on the GPU)")
        partial |= stop - start < size
        array_slices.append(slice(start, stop))
        tile_slices.append(slice(0, stop - start))
    if partial and not check_bounds:
        raise KernelValueError(
            f"{op}: check_bounds=False but tile {tuple(index)} of shape {tuple(tile_shape)} "
            f"extends past the array of shape {tuple(space_shape)} (undefined behaviour)")
    return tuple(array_slices), (tuple(tile_slices) if partial else None)


# Undetermined padding (``PaddingMode.UNDETERMINED``, the loads' default): what a padded element
# of a partial tile reads as. "nan" (the default) pads floats with NaN and integers with their
# most negative value, so a result that depends on it shows; "gpu" reads what an H200 returned
# (the bit pattern of the integer 1: the smallest positive subnormal of a float dtype, 1 for
# integers, True for booleans) and warns, once per kernel line, that the kernel relies on it.
UNDETERMINED_PADDING_ENV = "MAMBA2_CUTILE_UNDETERMINED_PADDING"
UNDETERMINED_PADDING_MODES = ("nan", "gpu")
_undetermined_padding = contextvars.ContextVar("undetermined_padding", default=None)


class UndeterminedPaddingWarning(UserWarning):
    """A kernel read padding elements of undetermined value under ``undetermined_padding="gpu"``."""


def undetermined_padding_mode(mode=None):
    """``mode``, else the environment's ``MAMBA2_CUTILE_UNDETERMINED_PADDING``, else "nan";
    checked."""
    if mode is None:
        mode = os.environ.get(UNDETERMINED_PADDING_ENV) or "nan"
    if mode not in UNDETERMINED_PADDING_MODES:
        raise ValueError(f"undetermined_padding (or ${UNDETERMINED_PADDING_ENV}) must be one of "
                         f"{UNDETERMINED_PADDING_MODES}, got {mode!r}")
    return mode


@contextlib.contextmanager
def undetermined_padding(mode):
    """While a launch runs: what undetermined padding reads as (``undetermined_padding_mode``)."""
    token = _undetermined_padding.set(undetermined_padding_mode(mode))
    try:
        yield
    finally:
        _undetermined_padding.reset(token)


def _gpu_undetermined(dtype):
    """The value an H200 returned for undetermined padding of 1-D partial tiles (all dtypes):
    the bit pattern of the integer 1."""
    if is_boolean(dtype):
        return True
    if not is_float(dtype):
        return 1
    torch_dtype = storage(dtype)
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[
        torch.empty((), dtype=torch_dtype).element_size()]
    return torch.ones((), dtype=bits).view(torch_dtype).item()


def padding_fill(op, mode, dtype):
    """The value padded elements of a partial tile read as (``mode`` the load's padding mode);
    under undetermined_padding="gpu" an undetermined read warns, naming the kernel line."""
    if mode is PaddingMode.UNDETERMINED and (_undetermined_padding.get() or
                                             undetermined_padding_mode()) == "gpu":
        warnings.warn(f"{kernel_location()}: {op} reads elements past the array with "
                      f"undetermined padding; they read as the GPU returned them (the bit "
                      f"pattern of the integer 1), which no padding_mode promises",
                      UndeterminedPaddingWarning, stacklevel=2)
        return _gpu_undetermined(dtype)
    return _padding_value(op, mode, dtype)


def _padding_value(op, mode, dtype):
    if mode is PaddingMode.ZERO:
        return 0
    if mode is PaddingMode.UNDETERMINED:
        # Any value is allowed; pick one that cannot go unnoticed.
        if is_float(dtype):
            return math.nan
        if is_boolean(dtype):
            return True
        info = torch.iinfo(storage(dtype))
        return info.min if is_signed(dtype) else info.max
    if not is_float(dtype):
        raise KernelTypeError(f"{op}: padding_mode {mode} needs a floating-point array, "
                              f"got {dtype}")
    return {PaddingMode.NEG_ZERO: -0.0, PaddingMode.NAN: math.nan,
            PaddingMode.POS_INF: math.inf, PaddingMode.NEG_INF: -math.inf}[mode]


def _index(op, array, index):
    index = int_tuple(op, index, "index")
    if len(index) != array.ndim:
        raise KernelTypeError(f"{op}: index {index} has {len(index)} entries but the array "
                              f"has rank {array.ndim}")
    return index


@emulates("load")
def load(array, /, index, shape, *, order="C", padding_mode=PaddingMode.UNDETERMINED,
         check_bounds=True, latency=None, allow_tma=None,
         memory_order=MemoryOrder.WEAK, memory_scope=MemoryScope.NONE):
    op = "ct.load"
    array = _require_array(op, array)
    index = _index(op, array, index)
    shape = int_tuple(op, shape, "shape")
    if len(shape) not in (0, array.ndim):
        raise KernelTypeError(f"{op}: shape {shape} has {len(shape)} dimensions but the "
                              f"array has rank {array.ndim}")
    check_shape(op, shape)
    full_shape = shape or (1,) * array.ndim  # a 0-d load reads a 1x..x1 tile
    axes = _axis_order(op, order, array.ndim)
    view = _array_view(array, axes)
    region, inside = _tile_region(op, view.shape, index, full_shape, check_bounds)
    if inside is None:
        data = view[region].clone()  # a copy: later stores must not change this tile
    else:
        fill = padding_fill(op, padding_mode, array.dtype)
        data = torch.full(full_shape, fill, dtype=view.dtype)
        data[inside] = view[region]
    record_region(op, "load", array, region, shape, order=axes, padding_mode=padding_mode)
    return Tile(data.reshape(shape), array.dtype)


def implicit_cast(op, what, value, dtype):
    """``value`` (a tile or a Python scalar) as a tensor of ``dtype``'s storage, by cuTile's
    implicit cast into an array (store, scatter, atomics), as its compiler rules (each case
    compiled for sm_90, ``tests/interpreter/test_memory.py``): a tile may widen but never narrow;
    a Python constant 0 or 1 (bool or int) may become a boolean, any other constant's kind (bool <
    int < float) must not exceed the array's, and an integer must lie in the array's range
    (else a value error, as the compiler's). A constant is rounded once, as the compiler's."""
    if isinstance(value, Tile):
        if not widens_to(value.dtype, dtype):
            raise KernelTypeError(f"{op}: cannot implicitly cast a {value.dtype} {what} to "
                                  f"the {dtype} array; use .astype({dtype}) first")
        return convert(value._t, value.dtype, dtype)
    if not is_scalar(value):
        raise KernelTypeError(f"{op}: {what} must be a tile or a scalar, "
                              f"got {type(value).__name__}")
    value_kind = kind(dtype_of_scalar(value))
    if is_boolean(dtype):
        if value_kind == 2 or value not in (0, 1):
            raise KernelTypeError(f"{op}: cannot implicitly cast {what} {value!r} to {dtype}")
    elif value_kind > kind(dtype):
        raise KernelTypeError(f"{op}: cannot implicitly cast {what} {value!r} to {dtype}")
    elif value_kind == 1 and kind(dtype) == 1:
        info = torch.iinfo(storage(dtype))
        if not info.min <= value <= info.max:
            raise KernelValueError(f"{op}: {what} {value} is out of range of {dtype}")
    return constant(value, dtype)


@emulates("store")
def store(array, /, index, tile, *, order="C", check_bounds=True, latency=None,
          allow_tma=None, memory_order=MemoryOrder.WEAK, memory_scope=MemoryScope.NONE):
    op = "ct.store"
    array = _require_array(op, array)
    index = _index(op, array, index)
    if not isinstance(tile, Tile) and not is_scalar(tile):
        raise KernelTypeError(f"{op}: can only store a tile or a scalar, got {type(tile).__name__}")
    data = implicit_cast(op, "tile", tile, array.dtype)
    if data.dim() == 0:
        data = data.reshape((1,) * array.ndim)  # scalars are stored as 1x..x1 tiles
    elif data.dim() != array.ndim:
        raise KernelTypeError(f"{op}: a {data.dim()}-d tile cannot be stored into a "
                              f"{array.ndim}-d array; the ranks must match")
    axes = _axis_order(op, order, array.ndim)
    view = _array_view(array, axes)
    region, inside = _tile_region(op, view.shape, index, data.shape, check_bounds)
    view[region] = data if inside is None else data[inside]
    record_region(op, "store", array, region, tile.shape if isinstance(tile, Tile) else (),
                  order=axes)


@emulates("num_tiles")
def num_tiles(array, /, axis, shape, order="C"):
    op = "ct.num_tiles"
    array = _require_array(op, array)
    shape = int_tuple(op, shape, "shape") or (1,) * array.ndim
    extent = _array_view(array, _axis_order(op, order, array.ndim)).shape
    axis = axis_index(op, axis, array.ndim)
    return -(-extent[axis] // shape[axis])
