"""Raw memory: Array.get_raw_memory and RawArrayMemory's offset loads, stores and atomics.

``array.get_raw_memory()`` holds the array's base pointer; its methods
address ``base_ptr + offset`` with offsets counted in **elements** of the
array's dtype, ignoring the array's shape and strides.  Here the memory is
the flat run of the tensor's storage that starts at the array's first
element and ends at its last one (``1 + sum((size - 1) * stride)``
elements, so the gaps of a strided view are reachable as on the GPU, and
``array.slice(...)`` moves the base pointer).  An offset outside that run
(negative offsets included: the compiler converts offsets to uint64) is
memory the array does not own, undefined behaviour on the GPU and an error
here; lanes switched off by ``mask`` are not checked.

* ``load_offset(offset, mask=None, padding_value=0)``: shape of ``offset``;
  masked-off lanes get ``padding_value`` (implicitly cast to the array dtype);
* ``store_offset(offset, value, mask=None)``: ``value`` is implicitly cast
  and broadcast to the offset shape; lanes storing different values to the
  same element race on a GPU (any one may win), so they are refused, as
  ``ct.scatter`` refuses them (lanes storing the same value are fine);
* ``atomic_<op>_offset``: the dtype rules, memory order / scope checks and
  lane serialization of `atomics` (C order, one lane at a time per
  element).  Masked-off lanes do nothing; ``atomic_cas_offset`` returns
  their ``expected`` value as documented, the other operations an
  implementation-defined value, for which we return NaN or the most
  negative integer.

``mask`` must be a boolean tile broadcastable to the offset shape;
``latency`` must be None or an int in 1..10 and is otherwise ignored.
"""

import torch
from cuda.tile import MemoryOrder, MemoryScope

from ops.runtime.cutile_internals import is_boolean, is_integral
from . import atomics
from .errors import KernelTypeError, KernelValueError
from .indexing import check_no_conflicts
from .registry import OPS, emulates
from .values import Array, Tile


class RawArrayMemory:
    """What ``array.get_raw_memory()`` returns: the array's elements as one flat run."""

    __slots__ = ("_array", "_flat")

    def __init__(self, array):
        t = array._t
        span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        self._array = array
        self._flat = t.as_strided((span,), (1,), t.storage_offset())

    @property
    def dtype(self):
        return self._array.dtype

    def load_offset(self, *args, **kwargs):
        return OPS["RawArrayMemory.load_offset"](self, *args, **kwargs)

    def store_offset(self, *args, **kwargs):
        return OPS["RawArrayMemory.store_offset"](self, *args, **kwargs)

    def atomic_cas_offset(self, *args, **kwargs):
        return OPS["RawArrayMemory.atomic_cas_offset"](self, *args, **kwargs)

    def __repr__(self):
        return f"RawArrayMemory[{self.dtype}, {self._flat.numel()} elements]"


def _rmw_method(name):
    def method(self, *args, **kwargs):
        return OPS[f"RawArrayMemory.atomic_{name}_offset"](self, *args, **kwargs)
    return atomics.named(method, f"atomic_{name}_offset", "RawArrayMemory")


for _name in atomics.READ_MODIFY_WRITE:
    setattr(RawArrayMemory, f"atomic_{_name}_offset", _rmw_method(_name))


@emulates("Array.get_raw_memory")
def get_raw_memory(array):
    if not isinstance(array, Array):
        raise KernelTypeError("Array.get_raw_memory: needs a kernel array, "
                              f"got {type(array).__name__}")
    return RawArrayMemory(array)


def _require_raw(op, raw):
    if not isinstance(raw, RawArrayMemory):
        raise KernelTypeError(f"{op}: needs the RawArrayMemory of array.get_raw_memory(), "
                              f"got {type(raw).__name__}")
    return raw


def _offsets(op, offset):
    """The offsets as an int64 tensor (its shape is the shape of the operation)."""
    if isinstance(offset, Tile):
        if not is_integral(offset.dtype):
            raise KernelTypeError(f"{op}: offset must have an integer dtype, got {offset.dtype}")
        return offset._t.to(torch.int64)
    if isinstance(offset, int) and not isinstance(offset, bool):
        return torch.tensor(offset, dtype=torch.int64)
    raise KernelTypeError(f"{op}: offset must be an integer tile or int, "
                          f"got {type(offset).__name__}")


def _active(op, raw, offsets, mask):
    """Lanes the mask leaves on; each of them must address the array's memory."""
    if mask is None:
        active = torch.ones(offsets.shape, dtype=torch.bool)
    else:
        if not isinstance(mask, Tile) or not is_boolean(mask.dtype):
            what = mask.dtype if isinstance(mask, Tile) else type(mask).__name__
            raise KernelTypeError(f"{op}: mask must be a boolean tile, got {what}")
        try:
            active = torch.broadcast_to(mask._t, offsets.shape).clone()
        except RuntimeError:
            raise KernelTypeError(f"{op}: mask shape {mask.shape} is not broadcastable to the "
                                  f"offset shape {tuple(offsets.shape)}") from None
    size = raw._flat.numel()
    outside = active & ((offsets < 0) | (offsets >= size))
    if bool(outside.any()):
        bad = offsets[outside][0].item()
        raise KernelValueError(f"{op}: offset {bad} lies outside the array's memory of {size} "
                               f"elements [0, {size}) (undefined behaviour on the GPU)")
    return active


def _check_latency(op, latency):
    if latency is None:
        return
    if isinstance(latency, bool) or not isinstance(latency, int):
        raise KernelTypeError(f"{op}: latency must be a constant int or None, got {latency!r}")
    if not 1 <= latency <= 10:
        raise KernelValueError(f"{op}: latency must be between 1 and 10, got {latency}")


def _cast_value(op, value, dtype, shape, what):
    """`value` implicitly cast to `dtype` and broadcast to `shape` (store / padding rules)."""
    return atomics.operand_values(op, value, dtype, shape, what, bitwise=False,
                                  shape_name="offset")


@emulates("RawArrayMemory.load_offset")
def load_offset(raw, offset, /, *, mask=None, padding_value=0, latency=None):
    op = "RawArrayMemory.load_offset"
    raw = _require_raw(op, raw)
    _check_latency(op, latency)
    offsets = _offsets(op, offset)
    active = _active(op, raw, offsets, mask)
    dtype = raw.dtype
    if padding_value is None:  # no padding given: any value, one that is noticed
        data = atomics.poison(dtype, offsets.shape)
    else:
        data = _cast_value(op, padding_value, dtype, offsets.shape, "padding_value").clone()
    data[active] = raw._flat[offsets[active]]
    return Tile(data, dtype)


@emulates("RawArrayMemory.store_offset")
def store_offset(raw, offset, value, /, *, mask=None, latency=None):
    op = "RawArrayMemory.store_offset"
    raw = _require_raw(op, raw)
    _check_latency(op, latency)
    offsets = _offsets(op, offset)
    active = _active(op, raw, offsets, mask)
    data = _cast_value(op, value, raw.dtype, offsets.shape, "value")
    # Lanes storing different values to one element race on the GPU (as in ct.scatter): refused.
    targets, values = offsets[active], data[active]
    check_no_conflicts(op, raw._flat.shape, targets, values, where="offset")
    raw._flat[targets] = values


def _atomic_offset(name, raw, offset, operands, what, mask, memory_order, memory_scope):
    op = f"RawArrayMemory.atomic_{name}_offset"
    raw = _require_raw(op, raw)
    atomics.check_dtype(op, name, raw.dtype)
    atomics.check_order_and_scope(op, memory_order, memory_scope)
    offsets = _offsets(op, offset)
    active = _active(op, raw, offsets, mask)
    return atomics.serialized_atomic(op, name, raw.dtype, raw._flat, [offsets], offsets.shape,
                                     active, operands, what)


def _read_modify_write(name):
    def rmw(raw, offset, update, /, *, mask=None, memory_order=MemoryOrder.ACQ_REL,
            memory_scope=MemoryScope.DEVICE):
        return _atomic_offset(name, raw, offset, (update,), ("update",), mask,
                              memory_order, memory_scope)
    return rmw


atomics.emulate_read_modify_write("RawArrayMemory.atomic_{}_offset", _read_modify_write)


@emulates("RawArrayMemory.atomic_cas_offset")
def atomic_cas_offset(raw, offset, expected, desired, /, *, mask=None,
                      memory_order=MemoryOrder.ACQ_REL, memory_scope=MemoryScope.DEVICE):
    return _atomic_offset("cas", raw, offset, (expected, desired), ("expected", "desired"),
                          mask, memory_order, memory_scope)
