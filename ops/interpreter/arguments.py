"""Checking and converting the arguments of the emulated operations."""

import torch

import cuda.tile as ct
from cuda.tile import RoundingMode

from ops.runtime.cutile_internals import constant_float, is_float, promote_dtypes
from .dtypes import (
    TORCH_DTYPE,
    compute,
    convert,
    dtype_of_scalar,
    is_scalar,
    promote_with_scalar,
    storage,
    to_dtype,
)
from .errors import KernelTypeError, UnsupportedOperation
from .values import Tile


def promote(op, x, y, force_float=False):
    """Result dtype of a binary operation on tiles and/or Python scalars."""
    if isinstance(x, Tile) and isinstance(y, Tile):
        try:
            return promote_dtypes(x.dtype, y.dtype, force_float)
        except ct.TileError as e:
            raise KernelTypeError(f"{op}: {e.message}") from None
    if not isinstance(x, Tile) and not isinstance(y, Tile):
        return promote_dtypes(dtype_of_scalar(x), dtype_of_scalar(y), force_float)
    tile, scalar = (x, y) if isinstance(x, Tile) else (y, x)
    result = promote_with_scalar(op, tile.dtype, scalar)
    if force_float and not is_float(result):
        result = ct.float32
    return result


def require_tile(op, value, what="argument"):
    if not isinstance(value, Tile):
        raise KernelTypeError(f"{op}: {what} must be a tile, got {type(value).__name__}")
    return value


def as_tile(value):
    """A tile for a tile or a Python scalar (scalars get cuTile's default dtype)."""
    if isinstance(value, Tile):
        return value
    if is_scalar(value):
        dtype = dtype_of_scalar(value)
        return Tile(torch.tensor(value, dtype=TORCH_DTYPE[dtype]), dtype)
    raise KernelTypeError(f"expected a tile or a scalar, got {type(value).__name__}")


def constant(value, dtype):
    """A Python scalar as a 0-d tensor of `dtype`, as the compiler makes the constant: for a float
    dtype, the compiler's own rounding of the Python number (`constant_float`: once, from
    float64; float8 overflow gives inf or NaN, not the saturation of a run-time conversion)."""
    if is_float(dtype) and not isinstance(value, bool):
        exact = constant_float(value, dtype)            # representable: converts exactly
        return torch.tensor(exact, dtype=torch.float64).to(storage(dtype))
    return to_dtype(torch.tensor(value, dtype=compute(dtype)), dtype)


def operand(value, dtype):
    """`value` (tile or scalar) converted to `dtype`, in `dtype`'s compute precision."""
    if isinstance(value, Tile):
        t = convert(value._t, value.dtype, dtype)
    else:
        t = constant(value, dtype)
    precision = compute(dtype)
    return t if t.dtype == precision else t.to(precision)


def as_int(op, value, what):
    if isinstance(value, Tile):
        value = value.__index__()
    if not isinstance(value, int):
        raise KernelTypeError(f"{op}: {what} must be an integer, got {type(value).__name__}")
    return int(value)


def int_tuple(op, value, what):
    """An int or a tuple of ints (or 0-d integer tiles) as a tuple of ints."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    return tuple(as_int(op, v, what) for v in items)


def check_shape(op, shape):
    """Tile dimensions must be positive powers of two, as the compiler requires."""
    for size in shape:
        if size <= 0 or size & (size - 1):
            raise KernelTypeError(f"{op} shape {tuple(shape)} must be powers of two")


def axis_index(op, axis, ndim):
    """`axis` (negative counts from the end) as an index in range(ndim)."""
    axis = as_int(op, axis, "axis")
    if not -ndim <= axis < ndim:
        raise KernelTypeError(f"{op}: axis {axis} is out of range for a {ndim}-d tile")
    return axis % ndim


def check_rounding(op, rounding_mode):
    if rounding_mode not in (None, RoundingMode.RN, RoundingMode.FULL, RoundingMode.APPROX):
        raise UnsupportedOperation(
            f"{op}: rounding_mode={rounding_mode} is not supported by the CPU interpreter")


def broadcast_error(op, values):
    shapes = [v.shape for v in values if isinstance(v, Tile)]
    return KernelTypeError(f"{op}: shapes {', '.join(map(str, shapes))} are not broadcastable")


def elementwise(op, fn, args, dtype, result_dtype=None):
    """Convert `args` to `dtype`, apply the torch function `fn`, wrap the result.

    Narrow floats are computed in float32 and rounded once, to
    `result_dtype` (default: `dtype`).
    """
    tensors = [operand(a, dtype) for a in args]
    try:
        out = fn(*tensors)
    except RuntimeError:
        try:
            torch.broadcast_shapes(*(t.shape for t in tensors))
        except RuntimeError:
            raise broadcast_error(op, args) from None
        raise
    result_dtype = result_dtype or dtype
    return Tile(to_dtype(out, result_dtype), result_dtype)
