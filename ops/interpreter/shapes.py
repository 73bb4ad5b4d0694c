"""Shape manipulation: reshape, permute, transpose, expand_dims, broadcast_to, cat, extract,
insert and Tile.item."""

import math

import torch

from .arguments import as_tile, axis_index, check_shape, int_tuple, require_tile
from .errors import KernelTypeError, KernelValueError
from .registry import emulates
from .values import Tile


@emulates("reshape")
def reshape(x, /, shape):
    op = "ct.reshape"
    x = as_tile(x)
    shape = int_tuple(op, shape, "shape")
    known = math.prod(s for s in shape if s != -1)
    numel = x._t.numel()
    if shape.count(-1) > 1 or any(s < -1 for s in shape):
        raise KernelTypeError(f"{op}: bad shape {shape} (at most one -1 allowed)")
    if (-1 in shape and (known == 0 or numel % known)) or (-1 not in shape and known != numel):
        raise KernelTypeError(f"{op}: cannot reshape a tile of shape {x.shape} to {shape}")
    return Tile(x._t.reshape(shape), x.dtype)


@emulates("permute")
def permute(x, /, axes):
    op = "ct.permute"
    x = require_tile(op, x)
    axes = tuple(axis_index(op, a, x.ndim) for a in axes)
    if sorted(axes) != list(range(x.ndim)):
        raise KernelTypeError(f"{op}: axes {axes} are not a permutation of {x.ndim} axes")
    return Tile(x._t.permute(axes), x.dtype)


@emulates("transpose")
def transpose(x, /, axis0=None, axis1=None):
    op = "ct.transpose"
    x = require_tile(op, x)
    if x.ndim < 2:
        raise KernelTypeError(f"{op}: cannot transpose a {x.ndim}-d tile")
    if axis0 is None and axis1 is None:
        if x.ndim != 2:
            raise KernelTypeError(f"{op}: give axis0 and axis1 for a {x.ndim}-d tile")
        axis0, axis1 = 0, 1
    elif axis0 is None or axis1 is None:
        raise KernelTypeError(f"{op}: give both axis0 and axis1, or neither")
    return Tile(x._t.transpose(axis_index(op, axis0, x.ndim), axis_index(op, axis1, x.ndim)),
                x.dtype)


@emulates("expand_dims")
def expand_dims(x, /, axis):
    x = as_tile(x)
    return Tile(x._t.unsqueeze(axis_index("ct.expand_dims", axis, x.ndim + 1)), x.dtype)


@emulates("broadcast_to")
def broadcast_to(x, /, shape):
    op = "ct.broadcast_to"
    x = as_tile(x)
    shape = int_tuple(op, shape, "shape")
    check_shape(op, shape)
    try:
        ok = tuple(torch.broadcast_shapes(x.shape, shape)) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise KernelTypeError(f"{op}: cannot broadcast shape {x.shape} to {shape}")
    return Tile(x._t.expand(shape), x.dtype)


@emulates("cat")
def cat(tiles, /, axis):
    op = "ct.cat"
    if not isinstance(tiles, (tuple, list)) or not 1 <= len(tiles) <= 2:
        raise KernelTypeError(f"{op} takes a tuple of one or two tiles")
    tiles = [require_tile(op, t) for t in tiles]
    first = tiles[0]
    axis = axis_index(op, axis, first.ndim)
    for t in tiles[1:]:
        if t.dtype != first.dtype:
            raise KernelTypeError(f"{op}: tiles must have the same dtype, got {first.dtype} "
                                  f"and {t.dtype}")
        same = [n for d, n in enumerate(t.shape) if d != axis]
        if t.ndim != first.ndim or same != [n for d, n in enumerate(first.shape) if d != axis]:
            raise KernelTypeError(f"{op}: shapes {first.shape} and {t.shape} differ outside "
                                  f"axis {axis}")
    out = torch.cat([t._t for t in tiles], dim=axis)
    check_shape(op, out.shape)
    return Tile(out, first.dtype)


def _subtile_slices(op, x, index, shape):
    index = int_tuple(op, index, "index")
    if len(index) != x.ndim:
        raise KernelTypeError(f"{op}: index {index} does not match the tile rank {x.ndim}")
    slices = []
    for d, (i, size, extent) in enumerate(zip(index, shape, x.shape)):
        if extent % size:
            raise KernelTypeError(f"{op}: shape {x.shape} is not divisible by sub-tile "
                                  f"shape {tuple(shape)} at dimension {d}")
        if not 0 <= i < extent // size:
            raise KernelValueError(f"{op}: index {index} is outside the grid of "
                                   f"{tuple(e // s for e, s in zip(x.shape, shape))} sub-tiles")
        slices.append(slice(i * size, (i + 1) * size))
    return tuple(slices)


@emulates("extract")
def extract(x, /, index, shape):
    op = "ct.extract"
    x = require_tile(op, x)
    shape = int_tuple(op, shape, "shape")
    if len(shape) not in (0, x.ndim):
        raise KernelTypeError(f"{op}: shape {shape} does not match the tile rank {x.ndim}")
    check_shape(op, shape)
    slices = _subtile_slices(op, x, index, shape or (1,) * x.ndim)
    return Tile(x._t[slices].reshape(shape), x.dtype)


@emulates("insert")
def insert(x, /, index, value):
    op = "ct.insert"
    x, value = require_tile(op, x), require_tile(op, value, "value")
    if value.dtype != x.dtype:
        raise KernelTypeError(f"{op}: cannot insert a {value.dtype} tile into a {x.dtype} tile")
    data = value._t.reshape((1,) * x.ndim) if value.ndim == 0 else value._t
    if data.dim() != x.ndim:
        raise KernelTypeError(f"{op}: value rank {value.ndim} does not match tile rank {x.ndim}")
    out = x._t.clone()
    out[_subtile_slices(op, x, index, data.shape)] = data
    return Tile(out, x.dtype)


@emulates("Tile.item")
def _tile_item(self):
    return self.item()
