"""Atomics: ct.atomic_add / max / min / and / or / xor / xchg / cas on kernel arrays.

Blocks run one after another, so every atomic is exact here: there is no
other block that could interleave.  Inside one call the lanes of the index
tile are applied one at a time in row-major (C) order of the index shape.
That is one of the serializations the GPU may pick ("the order of individual
writes is unspecified"), so for lanes hitting the same element:

* add: every contribution is summed.  For floats the additions happen in
  that lane order, each one rounded to the array dtype (float16 / bfloat16
  round after every addition, as their atomic adds do); a GPU may add in
  another order, so float results can differ from it in the last bits;
* max / min / and / or / xor: the order does not matter, results are exact;
* xchg: the element ends with the LAST lane's value (C order) and each lane
  gets the value written by the lane before it; on a GPU any lane may win;
* cas: lanes compare against the value left by the previous lanes, so with
  equal `expected` only the first lane succeeds; on a GPU it may be any one.
  Floats are compared by bit pattern, as the hardware does (NaN == NaN with
  the same bits, -0.0 != 0.0).

The returned old values are those of this serialization.  Lanes outside the
array (check_bounds=True) do nothing; cas returns their `expected` value as
documented, the other operations an "implementation-defined value", for
which we return NaN (floats) or the most negative integer, so that a kernel
relying on it is noticed.
"""

import torch

import cuda.tile as ct
from cuda.tile import MemoryOrder, MemoryScope

from ops.runtime.cutile_internals import is_float, is_integral
from .arguments import as_tile, constant
from .dtypes import convert, is_scalar, storage
from .errors import KernelTypeError, KernelValueError
from .memory import implicit_cast
from .registry import emulates
from .values import Array, Tile

INT_32_64 = (ct.int32, ct.int64)
INT_FLOAT_32_64 = INT_32_64 + (ct.float32, ct.float64)

# Operation -> (dtypes the compiler accepts, bitwise: update dtype must match exactly).
# uint32/uint64 are also accepted on the GPU but cannot be interpreter arrays.
SUPPORTED = {
    "add": (INT_FLOAT_32_64 + (ct.float16, ct.bfloat16), False),
    "max": (INT_32_64, False),
    "min": (INT_32_64, False),
    "and": (INT_32_64, True),
    "or": (INT_32_64, True),
    "xor": (INT_32_64, True),
    "xchg": (INT_FLOAT_32_64, False),
    "cas": (INT_FLOAT_32_64, False),
}

VALID_ORDERS = (MemoryOrder.RELAXED, MemoryOrder.ACQUIRE, MemoryOrder.RELEASE,
                MemoryOrder.ACQ_REL)
VALID_SCOPES = (MemoryScope.NONE, MemoryScope.BLOCK, MemoryScope.DEVICE, MemoryScope.SYS)


def check_order_and_scope(op, memory_order, memory_scope):
    """The compiler's rules; both only matter for concurrency, so nothing else is done."""
    if not isinstance(memory_order, MemoryOrder) or memory_order not in VALID_ORDERS:
        raise KernelTypeError(f"{op}: memory_order must be one of "
                              f"{', '.join(map(str, VALID_ORDERS))}, got {memory_order!r}")
    if not isinstance(memory_scope, MemoryScope) or memory_scope not in VALID_SCOPES:
        raise KernelTypeError(f"{op}: memory_scope must be one of "
                              f"{', '.join(map(str, VALID_SCOPES))}, got {memory_scope!r}")
    if memory_scope is MemoryScope.NONE:
        raise KernelTypeError(f"{op}: memory_order {memory_order} requires a memory_scope "
                              "other than MemoryScope.NONE")


def check_dtype(op, name, dtype):
    if dtype not in SUPPORTED[name][0]:
        allowed = ", ".join(map(str, SUPPORTED[name][0]))
        raise KernelTypeError(f"{op}: arrays of {dtype} are not supported (supported: "
                              f"{allowed})")


def operand_values(op, value, dtype, shape, what, bitwise, shape_name="index"):
    """`value` (tile or scalar) broadcast to `shape` (the `shape_name` shape, for messages)
    and converted to the array's `dtype` by the implicit-cast rule of stores."""
    if not isinstance(value, Tile) and not is_scalar(value):
        raise KernelTypeError(f"{op}: {what} must be a tile or a scalar, "
                              f"got {type(value).__name__}")
    if bitwise and isinstance(value, Tile) and value.dtype != dtype:
        raise KernelTypeError(f"{op}: {what} dtype {value.dtype} must exactly match the "
                              f"array dtype {dtype} (bitwise atomics do not cast)")
    try:
        implicit_cast(op, what, value, dtype)
    except (KernelTypeError, KernelValueError):     # the compiler: a type error for atomics
        raise KernelTypeError(f"{op}: {what} of dtype "
                              f"{value.dtype if isinstance(value, Tile) else repr(value)} "
                              f"cannot be implicitly cast to the {dtype} array") from None
    if is_scalar(value):
        # a constant: the compiler rounds the Python number once to the array's dtype
        return torch.broadcast_to(constant(value, dtype), tuple(shape))
    tile = as_tile(value)
    try:
        data = torch.broadcast_to(tile._t, shape)
    except RuntimeError:
        raise KernelTypeError(f"{op}: {what} shape {tile.shape} is not broadcastable to the "
                              f"{shape_name} shape {tuple(shape)}") from None
    return convert(data, tile.dtype, dtype)


def index_tensors(op, array, indices):
    """The index tuple as int64 tensors of one common (broadcast) shape."""
    items = tuple(indices) if isinstance(indices, (tuple, list)) else (indices,)
    if len(items) != array.ndim:
        extra = ", or a single scalar/tile" if array.ndim == 1 else ""
        raise KernelTypeError(f"{op}: indices must be a tuple of length {array.ndim}"
                              f"{extra} for an array of rank {array.ndim}, got {len(items)} "
                              "entries")
    tensors = []
    for dim, item in enumerate(items):
        if isinstance(item, Tile):
            if not is_integral(item.dtype):
                raise KernelTypeError(f"{op}: indices[{dim}] has non-integer dtype {item.dtype}")
            tensors.append(item._t.to(torch.int64))
        elif isinstance(item, int) and not isinstance(item, bool):
            tensors.append(torch.tensor(item, dtype=torch.int64))
        else:
            raise KernelTypeError(f"{op}: indices[{dim}] must be an integer tile or int, "
                                  f"got {type(item).__name__}")
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise KernelTypeError(f"{op}: index shapes {shapes} are not broadcastable to a "
                              "common shape") from None
    return [torch.broadcast_to(t, shape) for t in tensors], tuple(shape)


def in_bounds(op, array, indices, check_bounds):
    """Lanes whose index lies inside the array (negative indices are outside, as on the GPU)."""
    if not isinstance(check_bounds, bool):
        raise KernelTypeError(f"{op}: check_bounds must be a constant bool, got {check_bounds!r}")
    ok = torch.ones(indices[0].shape if indices else (), dtype=torch.bool)
    for ind, size in zip(indices, array.shape):
        ok &= (ind >= 0) & (ind < size)
    if not check_bounds and not bool(ok.all()):
        raise KernelValueError(f"{op}: check_bounds=False but an index lies outside the array "
                               f"of shape {array.shape} (undefined behaviour on the GPU)")
    return ok


def occurrence_rank(flat_address):
    """For each lane, how many earlier lanes (C order) address the same element."""
    n = flat_address.numel()
    order = torch.sort(flat_address, stable=True).indices
    ordered = flat_address[order]
    position = torch.arange(n)
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    group_start = torch.cummax(torch.where(starts, position, 0), dim=0).values
    rank = torch.empty(n, dtype=torch.int64)
    rank[order] = position - group_start
    return rank


def bits(t):
    """Floats as their bit patterns, for cas' bitwise comparison."""
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.float64:
        return t.view(torch.int64)
    return t


def combine_fn(name, dtype):
    """(current, update[, desired]) -> new value, computed in the array's storage dtype."""
    if name == "add":
        if dtype in (ct.float16, ct.bfloat16):
            # Each atomic add is one correctly rounded addition.
            return lambda cur, upd: (cur.float() + upd.float()).to(cur.dtype)
        return lambda cur, upd: cur + upd  # integers wrap around, as on the GPU
    return {
        "max": torch.maximum,
        "min": torch.minimum,
        "and": torch.bitwise_and,
        "or": torch.bitwise_or,
        "xor": torch.bitwise_xor,
        "xchg": lambda cur, upd: upd,
        "cas": lambda cur, exp, des: torch.where(bits(cur) == bits(exp), des, cur),
    }[name]


def poison(dtype, shape):
    """The value returned for lanes outside the array (implementation-defined on the GPU)."""
    t = storage(dtype)
    fill = float("nan") if is_float(dtype) else torch.iinfo(t).min
    return torch.full(shape, fill, dtype=t)


def apply_serialized(target, indices, active, operands, fn, old):
    """Apply fn lane by lane in C order (vectorized over lanes of distinct elements).

    `target` is the array's tensor, `indices` int64 index tensors, `operands`
    the per-lane update tensors; the previous value of every active lane is
    written into `old`.
    """
    flat_active = active.reshape(-1)
    if not bool(flat_active.any()):
        return
    lanes = flat_active.nonzero().squeeze(1)
    flat_idx = [ind.reshape(-1)[lanes] for ind in indices]
    if target.dim() == 0:  # a 0-d array: one element, addressed as element 0 of a 1-d view
        target, flat_idx = target.view(1), [torch.zeros_like(lanes)]
    flat_ops = [o.reshape(-1)[lanes] for o in operands]
    address = torch.zeros(lanes.numel(), dtype=torch.int64)
    for ind, size in zip(flat_idx, target.shape):
        address = address * size + ind
    rank = occurrence_rank(address)
    flat_old = old.view(-1)
    # Round k applies every lane that is the k-th to hit its element.
    for k in range(int(rank.max()) + 1):
        sel = rank == k
        where = tuple(ind[sel] for ind in flat_idx)
        current = target[where]
        flat_old[lanes[sel]] = current
        new = fn(current, *(o[sel] for o in flat_ops))
        target[where] = new


def serialized_atomic(op, name, dtype, target, indices, shape, active, operands, what):
    """What every atomic does once its lanes are located: the operands cast to the array's
    `dtype` and broadcast to the lanes' `shape`, then applied lane by lane to `target` (the
    tensor `indices` address) in C order.  Returns the tile of old values; lanes that are not
    `active` (outside the array, masked off) change nothing and read as `poison`, except for
    cas, whose inactive lanes return their `expected` value as documented."""
    bitwise = SUPPORTED[name][1]
    values = [operand_values(op, v, dtype, shape, w, bitwise) for v, w in zip(operands, what)]
    old = poison(dtype, shape)
    if name == "cas":  # inactive lanes return their `expected`
        old = torch.where(active, old, values[0])
    apply_serialized(target, indices, active, values, combine_fn(name, dtype), old)
    return Tile(old, dtype)


def atomic(name, array, indices, operands, what, check_bounds, memory_order, memory_scope):
    op = f"ct.atomic_{name}"
    if not isinstance(array, Array):
        raise KernelTypeError(f"{op}: array must be a kernel array argument, "
                              f"got {type(array).__name__}")
    check_dtype(op, name, array.dtype)
    check_order_and_scope(op, memory_order, memory_scope)
    tensors, shape = index_tensors(op, array, indices)
    active = in_bounds(op, array, tensors, check_bounds)
    return serialized_atomic(op, name, array.dtype, array._t, tensors, shape, active, operands,
                             what)


# The read-modify-write atomics: one update operand each (cas, below, takes two).
READ_MODIFY_WRITE = ("add", "max", "min", "and", "or", "xor", "xchg")


def named(fn, name, owner=None):
    """`fn` renamed `name` (a method of the class named `owner`, if given).  The functions a
    loop makes, one per operation, get the name of what they emulate, for tracebacks and reprs."""
    fn.__name__ = name
    fn.__qualname__ = name if owner is None else f"{owner}.{name}"
    return fn


def emulate_read_modify_write(stub, make):
    """Register ``make(name)`` as the emulation of the stub ``stub.format(name)`` for every
    read-modify-write atomic `name`, named as that stub's function (or method) is.

    cuTile has one stub per operation with the same signature, so the emulations come from
    one factory; cas, with its two operands, is written out by hand."""
    for name in READ_MODIFY_WRITE:
        full_name = stub.format(name)
        emulates(full_name)(named(make(name), full_name.rpartition(".")[2]))


def _read_modify_write(name):
    def rmw(array, indices, update, /, *, check_bounds=True,
            memory_order=MemoryOrder.ACQ_REL, memory_scope=MemoryScope.DEVICE):
        return atomic(name, array, indices, (update,), ("update",), check_bounds,
                      memory_order, memory_scope)
    return rmw


emulate_read_modify_write("atomic_{}", _read_modify_write)


@emulates("atomic_cas")
def atomic_cas(array, indices, expected, desired, /, *, check_bounds=True,
               memory_order=MemoryOrder.ACQ_REL, memory_scope=MemoryScope.DEVICE):
    return atomic("cas", array, indices, (expected, desired), ("expected", "desired"),
                  check_bounds, memory_order, memory_scope)
