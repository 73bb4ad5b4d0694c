"""Creating tiles: ct.full, ct.zeros, ct.ones, ct.arange and ct.astile."""

import torch

import cuda.tile as ct

from .arguments import as_int, as_tile, check_shape, constant, int_tuple
from .dtypes import convert, is_scalar, require_dtype
from .errors import KernelTypeError
from .registry import OPS, emulates
from .values import Tile


@emulates("full")
def full(shape, fill_value, dtype):
    op = "ct.full"
    shape = int_tuple(op, shape, "shape")
    check_shape(op, shape)
    dtype = require_dtype(op, dtype)
    if is_scalar(fill_value):
        # A constant, rounded once from the Python number as the compiler does (not through
        # the float32 a Python float would otherwise be).
        t = constant(fill_value, dtype)
    else:
        value = as_tile(fill_value)
        if value.ndim != 0:
            raise KernelTypeError(f"{op}: fill_value must be a scalar, got shape {value.shape}")
        t = convert(value._t, value.dtype, dtype)
    # expand() makes a view without copying; tiles are never written in place.
    return Tile(t.expand(shape), dtype)


@emulates("zeros")
def zeros(shape, dtype):
    return full(shape, 0, dtype)


@emulates("ones")
def ones(shape, dtype):
    return full(shape, 1, dtype)


@emulates("arange")
def arange(size, /, *, dtype, start=0, step=1):
    op = "ct.arange"
    size = as_int(op, size, "size")
    check_shape(op, (size,))
    dtype = require_dtype(op, dtype)
    # As in cuTile: 0..size-1 in `dtype`, then * step, then + start, in `dtype`.
    astype, mul, add = OPS["astype"], OPS["mul"], OPS["add"]
    result = Tile(convert(torch.arange(size), ct.int64, dtype), dtype)
    if not (is_scalar(step) and step == 1):
        result = mul(result, astype(as_tile(step), dtype))
    if not (is_scalar(start) and start == 0):
        result = add(result, astype(as_tile(start), dtype))
    return result


@emulates("astile")
def astile(value, /, *, dtype):
    op = "ct.astile"
    dtype = require_dtype(op, dtype)

    def python_values(v):
        if isinstance(v, tuple):
            check_shape(op, (len(v),))
            return [python_values(item) for item in v]
        return as_tile(v)._t.item()

    nested = python_values(value)
    source = torch.tensor(nested, dtype=torch.float64)
    return Tile(convert(source, ct.float64, dtype), dtype)
