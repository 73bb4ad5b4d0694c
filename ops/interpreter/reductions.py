"""Reductions and scans: sum, prod, max, min, argmax, argmin, cumsum, cumprod, reduce, scan."""

import math

import torch

import cuda.tile as ct

from ops.runtime.cutile_internals import is_arithmetic, is_boolean
from .arguments import as_tile, axis_index, check_rounding, require_tile
from .dtypes import NARROW_FLOATS, to_dtype
from .errors import KernelTypeError
from .registry import OPS, emulates
from .values import Tile


def _reduction_axes(op, x, axis):
    if axis is None:
        return tuple(range(x.ndim))
    axes = tuple(axis_index(op, a, x.ndim) for a in (axis if isinstance(axis, tuple) else (axis,)))
    if len(set(axes)) != len(axes):
        raise KernelTypeError(f"{op}: repeated axis in {axis}")
    return axes


def _reduced_shape(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if d in axes else n for d, n in enumerate(shape))
    return tuple(n for d, n in enumerate(shape) if d not in axes)


def _move_axes_last(t, axes):
    """Permute `axes` to the end and merge them into one last dimension."""
    kept = [d for d in range(t.dim()) if d not in axes]
    t = t.permute(kept + list(axes))
    return t.reshape(t.shape[:len(kept)] + (-1,))


def _tree_reduce(t, combine):
    """Reduce the last dimension (a power of two) pairwise, like a GPU reduction tree."""
    while t.shape[-1] > 1:
        pairs = t.unflatten(-1, (-1, 2))
        t = combine(pairs[..., 0], pairs[..., 1])
    return t[..., 0]


def _arithmetic_tile(op, x):
    """`x` if it is an arithmetic tile, a bool tile as int32 (as cuTile reduces and scans it)."""
    x = require_tile(op, x)
    if not (is_arithmetic(x.dtype) or is_boolean(x.dtype)):
        raise KernelTypeError(f"{op} does not support {x.dtype} tiles")
    if x.dtype is ct.bool_:
        x = OPS["astype"](x, ct.int32)
    return x


def _simple_reduce(op, x, axis, keepdims, fn, torch_fn):
    """sum/prod/max/min.  `fn` combines two tensors; `torch_fn` reduces one dim."""
    x = _arithmetic_tile(op, x)
    axes = _reduction_axes(op, x, axis)
    t = _move_axes_last(x._t, axes)
    if x.dtype in NARROW_FLOATS:
        # Every partial result is a value of the tile's dtype, so round it.
        out = _tree_reduce(t, lambda a, b: to_dtype(fn(a.float(), b.float()), x.dtype))
    else:
        out = torch_fn(t)
    return Tile(out.reshape(_reduced_shape(x.shape, axes, keepdims)), x.dtype)


@emulates("sum")
def sum_(x, /, axis=None, *, keepdims=False, rounding_mode=None, flush_to_zero=False):
    check_rounding("ct.sum", rounding_mode)
    # dtype= keeps integer sums in the tile's dtype (wrapping like the GPU).
    return _simple_reduce("ct.sum", x, axis, keepdims, torch.add,
                          lambda t: t.sum(-1, dtype=t.dtype))


@emulates("prod")
def prod(x, /, axis=None, *, keepdims=False, rounding_mode=None, flush_to_zero=False):
    check_rounding("ct.prod", rounding_mode)
    return _simple_reduce("ct.prod", x, axis, keepdims, torch.mul,
                          lambda t: t.prod(-1, dtype=t.dtype))


def _nan_to(t, value, propagate_nan):
    """Unless NaN should propagate, make NaN lose every comparison."""
    if propagate_nan or not t.is_floating_point():
        return t
    return torch.where(torch.isnan(t), value, t)


@emulates("max")
def max_(x, /, axis=None, *, keepdims=False, flush_to_zero=False, propagate_nan=False):
    both = torch.maximum if propagate_nan else torch.fmax
    return _simple_reduce("ct.max", x, axis, keepdims, both,
                          lambda t: _nan_to(t, -math.inf, propagate_nan).amax(-1))


@emulates("min")
def min_(x, /, axis=None, *, keepdims=False, flush_to_zero=False, propagate_nan=False):
    both = torch.minimum if propagate_nan else torch.fmin
    return _simple_reduce("ct.min", x, axis, keepdims, both,
                          lambda t: _nan_to(t, math.inf, propagate_nan).amin(-1))


def _arg_reduce(op, x, axis, keepdims, propagate_nan, largest):
    x = require_tile(op, x)
    t = x._t.to(torch.int32) if x.dtype is ct.bool_ else x._t
    if axis is None:
        shape = (1,) * x.ndim if keepdims else ()
        t, axis, keepdims = t.reshape(-1), 0, False
    else:
        axis, shape = axis_index(op, axis, x.ndim), None
    # torch already returns the first index among ties and prefers NaN.
    t = _nan_to(t, -math.inf if largest else math.inf, propagate_nan)
    fn = torch.argmax if largest else torch.argmin
    out = fn(t, dim=axis, keepdim=keepdims).to(torch.int32)
    return Tile(out if shape is None else out.reshape(shape), ct.int32)


@emulates("argmax")
def argmax(x, /, axis=None, *, keepdims=False, propagate_nan=False):
    return _arg_reduce("ct.argmax", x, axis, keepdims, propagate_nan, largest=True)


@emulates("argmin")
def argmin(x, /, axis=None, *, keepdims=False, propagate_nan=False):
    return _arg_reduce("ct.argmin", x, axis, keepdims, propagate_nan, largest=False)


def _prefix_scan(t, combine, identity):
    """Inclusive scan along the last dim in log2(n) steps (Hillis-Steele).

    Step d combines every element with the partial result d places to its
    left; after log2(n) steps each element holds its full prefix.
    """
    n, d = t.shape[-1], 1
    while d < n:
        pad = torch.full(t.shape[:-1] + (d,), identity, dtype=t.dtype)
        t = combine(torch.cat([pad, t[..., :-d]], dim=-1), t)
        d *= 2
    return t


def _simple_scan(op, x, axis, reverse, fn, torch_fn, identity):
    x = _arithmetic_tile(op, x)
    axis = axis_index(op, axis, x.ndim)
    t = x._t.movedim(axis, -1)
    if reverse:
        t = t.flip(-1)
    if x.dtype in NARROW_FLOATS:
        t = _prefix_scan(t, lambda a, b: to_dtype(fn(a.float(), b.float()), x.dtype), identity)
    else:
        t = torch_fn(t, -1, dtype=t.dtype)
    if reverse:
        t = t.flip(-1)
    return Tile(t.movedim(-1, axis), x.dtype)


@emulates("cumsum")
def cumsum(x, /, axis=0, *, reverse=False, rounding_mode=None, flush_to_zero=False):
    check_rounding("ct.cumsum", rounding_mode)
    return _simple_scan("ct.cumsum", x, axis, reverse, torch.add, torch.cumsum, 0)


@emulates("cumprod")
def cumprod(x, /, axis=0, *, reverse=False, rounding_mode=None, flush_to_zero=False):
    check_rounding("ct.cumprod", rounding_mode)
    return _simple_scan("ct.cumprod", x, axis, reverse, torch.mul, torch.cumprod, 1)


def _tiles_tuple(op, x):
    """`x` as a tuple of tiles, and whether it was a tuple (ct.reduce/ct.scan)."""
    if isinstance(x, tuple):
        return tuple(require_tile(op, v) for v in x), True
    return (require_tile(op, x),), False


def _call_combine(op, func, lhs, rhs, is_tuple):
    """Call a user's combine function on tiles and return a tuple of tiles."""
    result = func(*lhs, *rhs) if is_tuple else func(lhs[0], rhs[0])
    result = result if is_tuple else (result,)
    return tuple(as_tile(r) for r in result)


@emulates("reduce")
def reduce(x, /, axis, func, identity, *, keepdims=False):
    op = "ct.reduce"
    xs, is_tuple = _tiles_tuple(op, x)
    axis = axis_index(op, axis, xs[0].ndim)
    shape = torch.broadcast_shapes(*(v.shape for v in xs))
    # Move the axis last, then halve it repeatedly, combining neighbours.
    parts = tuple(Tile(v._t.expand(shape).movedim(axis, -1), v.dtype) for v in xs)
    while parts[0].shape[-1] > 1:
        pairs = [v._t.unflatten(-1, (-1, 2)) for v in parts]
        lhs = tuple(Tile(p[..., 0], v.dtype) for p, v in zip(pairs, parts))
        rhs = tuple(Tile(p[..., 1], v.dtype) for p, v in zip(pairs, parts))
        parts = _call_combine(op, func, lhs, rhs, is_tuple)
    out_shape = _reduced_shape(tuple(shape), (axis,), keepdims)
    result = tuple(Tile(v._t.reshape(out_shape), v.dtype) for v in parts)
    return result if is_tuple else result[0]


@emulates("scan")
def scan(x, /, axis, func, identity, *, reverse=False):
    op = "ct.scan"
    xs, is_tuple = _tiles_tuple(op, x)
    identities = identity if is_tuple else (identity,)
    shape = torch.broadcast_shapes(*(v.shape for v in xs))
    axis = axis_index(op, axis, len(shape))
    parts = []
    for v in xs:
        t = v._t.expand(shape).movedim(axis, -1)
        parts.append(Tile(t.flip(-1) if reverse else t, v.dtype))
    n, d = shape[axis], 1
    while d < n:  # the same Hillis-Steele scan as _prefix_scan, on tiles
        shifted = []
        for v, ident in zip(parts, identities):
            pad = torch.full(v.shape[:-1] + (d,), ident, dtype=v._t.dtype)
            shifted.append(Tile(torch.cat([pad, v._t[..., :-d]], -1), v.dtype))
        parts = _call_combine(op, func, tuple(shifted), tuple(parts), is_tuple)
        d *= 2
    result = []
    for v in parts:
        t = v._t.flip(-1) if reverse else v._t
        result.append(Tile(t.movedim(-1, axis), v.dtype))
    return tuple(result) if is_tuple else result[0]
