"""Element-wise indexed memory access: ct.gather, ct.scatter, ct.Slice and the
advanced-indexing loads/stores (``load_advanced_indexing`` / ``store_advanced_indexing``).

Semantics follow cuda-tile 1.7's documentation and compiler:

* gather/scatter: one index (tile or int) per array dimension, broadcast to a
  common shape, which is the result's (gather) or the stored value's
  (scatter) shape.  Indices are compared as unsigned numbers, so a negative
  index is out of bounds.  With ``check_bounds=True`` out-of-bounds elements
  read ``padding_value`` / are not stored; with ``check_bounds=False`` they
  are undefined behaviour and raise here.  ``mask`` is ANDed in.
* Two elements of one scatter (or one ``store_advanced_indexing``) that
  write the same array element are unordered on the GPU.  If they write the
  same bits the outcome is defined and allowed; different values raise
  `KernelValueError` rather than pick a winner.
* advanced indexing: exactly one 1-D integer tile (the sparse dimension),
  every other entry ``ct.Slice(start, length)`` (an element offset and a
  constant power-of-two length).  Out-of-bounds elements of either kind of
  dimension are padded per ``padding_mode`` / dropped; a tile with no
  element inside the array is undefined behaviour and raises.
* Hints (``latency``, ``allow_tma``) are validated like the compiler does and
  otherwise ignored.
"""

import cuda.tile as ct
import torch
from cuda.tile import PaddingMode

from ops.runtime.cutile_internals import is_boolean, is_integral, is_signed
from .arguments import check_shape
from .errors import KernelTypeError, KernelValueError
from .memory import _padding_value, implicit_cast, padding_fill
from .registry import emulates
from .trace import ACTIVE as RECORDING
from .values import Array, Tile


def _require_array(op, array):
    if not isinstance(array, Array):
        raise KernelTypeError(f"{op}: `array` must be a kernel array argument, "
                              f"got {type(array).__name__}")
    return array


def _check_hints(op, latency, allow_tma=None):
    if latency is not None:
        if isinstance(latency, bool) or not isinstance(latency, int):
            raise KernelTypeError(f"{op}: `latency` must be a constant int or None, "
                                  f"got {type(latency).__name__}")
        if not 1 <= latency <= 10:
            raise KernelValueError(f"{op}: `latency` must be between 1 and 10, got {latency}")
    if allow_tma is not None and not isinstance(allow_tma, bool):
        raise KernelTypeError(f"{op}: `allow_tma` must be a constant bool or None, "
                              f"got {allow_tma!r}")


def _broadcastable_to(shape, target):
    try:
        return tuple(torch.broadcast_shapes(shape, target)) == tuple(target)
    except RuntimeError:
        return False


def _index_items(op, array, indices):
    """gather/scatter indices as int64 tensors broadcast to their common shape."""
    if isinstance(indices, (tuple, list)):
        items = tuple(indices)
    elif array.ndim == 1:
        items = (indices,)  # the documented shorthand for 1-D arrays
    else:
        raise KernelTypeError(f"{op}: for an array of rank {array.ndim}, `indices` must be a "
                              f"tuple of length {array.ndim}, got {type(indices).__name__}")
    if len(items) != array.ndim:
        raise KernelTypeError(f"{op}: `indices` has {len(items)} entries but the array has "
                              f"rank {array.ndim}")
    tensors = []
    for dim, item in enumerate(items):
        if isinstance(item, Tile) and is_integral(item.dtype):
            tensors.append(item._t.to(torch.int64))
        elif isinstance(item, int) and not isinstance(item, bool):
            tensors.append(torch.tensor(item, dtype=torch.int64))
        else:
            got = item.dtype if isinstance(item, Tile) else type(item).__name__
            raise KernelTypeError(f"{op}: `indices` entry {dim} must be an integer tile or int, "
                                  f"got {got}")
    try:
        shape = tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
    except RuntimeError:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise KernelTypeError(f"{op}: `indices` shapes {shapes} are not broadcastable "
                              "to a common shape") from None
    return [t.expand(shape) for t in tensors], shape


def _in_bounds(array, idx, shape):
    inside = torch.ones(shape, dtype=torch.bool)
    for t, extent in zip(idx, array.shape):
        inside &= (t >= 0) & (t < extent)  # unsigned compare: negatives are outside
    return inside


def _mask(op, mask, shape):
    if mask is None:
        return torch.ones(shape, dtype=torch.bool)
    if isinstance(mask, bool):
        return torch.full(shape, mask)
    if not isinstance(mask, Tile) or not is_boolean(mask.dtype):
        got = mask.dtype if isinstance(mask, Tile) else type(mask).__name__
        raise KernelTypeError(f"{op}: `mask` must be a boolean tile or bool, got {got}")
    if not _broadcastable_to(mask.shape, shape):
        raise KernelTypeError(f"{op}: `mask` shape {mask.shape} is not broadcastable to the "
                              f"index shape {shape}")
    return mask._t.expand(shape)


def _active(op, array, idx, shape, mask, check_bounds):
    """Elements that access memory; out-of-bounds ones are UB without check_bounds."""
    enabled = _mask(op, mask, shape)
    inside = _in_bounds(array, idx, shape)
    if not check_bounds:
        bad = enabled & ~inside
        if bad.any():
            where = tuple(int(i) for i in bad.nonzero()[0])
            index = tuple(int(t[where]) for t in idx)
            raise KernelValueError(
                f"{op}: check_bounds=False but element {where} accesses index {index} outside "
                f"the array of shape {array.shape} (undefined behaviour on the GPU)")
    return enabled & inside


def _bits(t):
    """An integer view of `t`'s storage, so that equality means identical bits."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                       8: torch.int64}[t.element_size()])                # float8 .. float64
    return t


def check_no_conflicts(op, shape, targets, values, where="array index"):
    """Refuse two writes of different values to one element (their order is unspecified):
    ``targets`` are flat element numbers of an array of ``shape``, ``values`` what each writes."""
    if targets.numel() < 2:
        return
    order = torch.argsort(targets, stable=True)
    t, v = targets[order], _bits(values)[order]
    clash = (t[1:] == t[:-1]) & (v[1:] != v[:-1])
    if clash.any():
        k = int(clash.nonzero()[0])
        index = tuple(int(i) for i in torch.unravel_index(t[k], tuple(shape)))
        raise KernelValueError(
            f"{op}: several elements write different values to {where} "
            f"{index[0] if where == 'offset' else index}; the GPU does not define which one wins")


def _write(op, array, idx, data):
    """array[idx] = data for int64 index tensors `idx` (one per dim), conflicts refused."""
    if data.numel() == 0:
        return
    if array.ndim:
        flat = torch.zeros_like(idx[0])
        for t, extent in zip(idx, array.shape):
            flat = flat * extent + t
        check_no_conflicts(op, array.shape, flat, data)
    array._t[tuple(idx)] = data


# ---------------------------------------------------------------------------
# gather / scatter
# ---------------------------------------------------------------------------

def _indexed_operand(op, array, indices, value, what, mask, check_bounds, latency):
    """What gather and scatter check and prepare alike: (array, the index tensors, `value` (the
    padding or the stored value) cast to the array's dtype and broadcast to the index shape,
    the active lanes)."""
    array = _require_array(op, array)
    idx, shape = _index_items(op, array, indices)
    if not isinstance(check_bounds, bool):
        raise KernelTypeError(f"{op}: `check_bounds` must be a constant bool, "
                              f"got {check_bounds!r}")
    _check_hints(op, latency)
    data = implicit_cast(op, f"`{what}`", value, array.dtype)
    if not _broadcastable_to(data.shape, shape):
        raise KernelTypeError(f"{op}: `{what}` shape {tuple(data.shape)} is not "
                              f"broadcastable to the index shape {shape}")
    active = _active(op, array, idx, shape, mask, check_bounds)
    return array, idx, data.expand(shape), active


@emulates("gather")
def gather(array, indices, /, *, mask=None, padding_value=0, check_bounds=True, latency=None):
    array, idx, pad, active = _indexed_operand("ct.gather", array, indices, padding_value,
                                               "padding_value", mask, check_bounds, latency)
    result = pad.clone()
    result[active] = array._t[tuple(t[active] for t in idx)]
    recorder = RECORDING.get()
    if recorder is not None:
        recorder.lanes("ct.gather", "load", array, [t[active] for t in idx], active.shape,
                       _outside(array, idx, mask))
    return Tile(result, array.dtype)


@emulates("scatter")
def scatter(array, indices, value, /, *, mask=None, check_bounds=True, latency=None):
    op = "ct.scatter"
    array, idx, data, active = _indexed_operand(op, array, indices, value, "value", mask,
                                                check_bounds, latency)
    _write(op, array, [t[active] for t in idx], data[active])
    recorder = RECORDING.get()
    if recorder is not None:
        recorder.lanes(op, "store", array, [t[active] for t in idx], active.shape,
                       _outside(array, idx, mask))


def _outside(array, idx, mask):
    """How many enabled lanes index outside the array (what a trace counts as padded)."""
    shape = idx[0].shape if idx else ()
    return int((_mask("", mask, shape) & ~_in_bounds(array, idx, shape)).sum())


# ---------------------------------------------------------------------------
# ct.Slice and advanced indexing
# ---------------------------------------------------------------------------

@emulates("Slice.__init__")
def slice_init(self, start, length, /):
    op = "ct.Slice"
    for what, v in (("start", start), ("length", length)):
        ok = (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, Tile) and v.ndim == 0 and is_integral(v.dtype) and is_signed(v.dtype))
        if not ok:
            raise KernelTypeError(f"{op}: `{what}` must be a signed integer scalar, got {v!r}")
    # Keep a tile length as a tile: only a Python int counts as compile-time.
    self.start, self.length = int(start), length


def _advanced_index(op, array, indices):
    """(sparse dim, its index tensor, [(start, length) or None per dim], tile shape)."""
    if array.ndim < 2:
        other = "ct.gather()" if op.startswith("ct.load") else "ct.scatter()"
        raise KernelTypeError(f"{op} needs an array of rank 2 or more; use {other} "
                              "for 1-D arrays")
    if not isinstance(indices, (tuple, list)) or len(indices) != array.ndim:
        n = len(indices) if isinstance(indices, (tuple, list)) else type(indices).__name__
        raise KernelTypeError(f"{op}: `indices` must be a tuple of length {array.ndim} "
                              f"(the array rank), got {n}")
    sparse, slices, shape = [], [], []
    for dim, item in enumerate(indices):
        if isinstance(item, Tile):
            if item.ndim != 1 or not is_integral(item.dtype):
                raise KernelTypeError(f"{op}: sparse index at dim {dim} must be a 1-D integer "
                                      f"tile, got a {item.ndim}-d {item.dtype} tile")
            sparse.append(dim)
            slices.append(None)
            shape.append(item.shape[0])
        elif isinstance(item, ct.Slice):
            length = item.length
            if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
                raise KernelTypeError(f"{op}: ct.Slice length at dim {dim} must be a positive "
                                      f"compile-time int, got {length!r}")
            slices.append((item.start, length))
            shape.append(length)
        else:
            raise KernelTypeError(f"{op}: `indices` entry {dim} must be a 1-D integer tile or "
                                  f"ct.Slice(start, length), got {type(item).__name__}")
    if len(sparse) != 1:
        raise KernelTypeError(f"{op}: exactly one entry of `indices` must be a 1-D integer "
                              f"tile (the sparse dim); found {len(sparse)}")
    check_shape(op, shape)
    return sparse[0], indices[sparse[0]]._t.to(torch.int64), slices, tuple(shape)


def _advanced_coordinates(op, array, indices):
    """Per-dim int64 index tensors of the tile's shape, and which elements are inside."""
    sparse, rows, slices, shape = _advanced_index(op, array, indices)
    idx = []
    for dim, extent in enumerate(array.shape):
        if dim == sparse:
            axis = rows
        else:
            start, length = slices[dim]
            axis = torch.arange(start, start + length, dtype=torch.int64)
        view = [1] * len(shape)
        view[dim] = shape[dim]
        idx.append(axis.reshape(view).expand(shape))
    inside = _in_bounds(array, idx, shape)
    if not inside.any():
        raise KernelValueError(f"{op}: the tile of shape {shape} lies entirely outside the "
                               f"array of shape {array.shape} (undefined behaviour on the GPU)")
    return idx, inside, shape


@emulates("load_advanced_indexing")
def load_advanced_indexing(array, indices, /, *, padding_mode=PaddingMode.UNDETERMINED,
                           latency=None, allow_tma=None):
    op = "ct.load_advanced_indexing"
    array = _require_array(op, array)
    if not isinstance(padding_mode, PaddingMode):
        raise KernelTypeError(f"{op}: `padding_mode` must be a ct.PaddingMode, "
                              f"got {padding_mode!r}")
    _check_hints(op, latency, allow_tma)
    idx, inside, shape = _advanced_coordinates(op, array, indices)
    fill = (_padding_value if bool(inside.all()) else padding_fill)(op, padding_mode, array.dtype)
    result = torch.full(shape, fill, dtype=array._t.dtype)
    result[inside] = array._t[tuple(t[inside] for t in idx)]
    recorder = RECORDING.get()
    if recorder is not None:
        recorder.lanes(op, "load", array, [t[inside] for t in idx], shape,
                       int((~inside).sum()), padding_mode=padding_mode)
    return Tile(result, array.dtype)


@emulates("store_advanced_indexing")
def store_advanced_indexing(array, indices, tile, /, *, latency=None, allow_tma=None):
    op = "ct.store_advanced_indexing"
    array = _require_array(op, array)
    _check_hints(op, latency, allow_tma)
    idx, inside, shape = _advanced_coordinates(op, array, indices)
    if not isinstance(tile, Tile) or tile.shape != shape:
        got = tile.shape if isinstance(tile, Tile) else type(tile).__name__
        raise KernelTypeError(f"{op}: `tile` must be a tile of exactly the shape {shape} "
                              f"implied by the indices, got {got}")
    data = implicit_cast(op, "`tile`", tile, array.dtype)
    _write(op, array, [t[inside] for t in idx], data[inside])
    recorder = RECORDING.get()
    if recorder is not None:
        recorder.lanes(op, "store", array, [t[inside] for t in idx], shape,
                       int((~inside).sum()))

