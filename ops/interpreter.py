"""A CPU interpreter for cuTile kernels.

`launch(grid, kernel, args)` runs a ``@ct.kernel`` on CPU torch tensors, one
block after another, with every ``cuda.tile`` operation emulated in torch.
It exists so that a kernel can be read, stepped through with ``pdb``,
``print``-debugged and unit-tested on a machine without a GPU.

How the kernel's ``ct.*`` calls reach this file
-----------------------------------------------
Every public cuTile operation (``ct.load``, ``ct.mma``, ...) is a *stub*: a
Python function whose body does nothing, wrapped so that calling it asks
cuTile's current *dispatch mode* what to do.  Outside a compiler the mode is
"refuse" ("device functions can only be called from device code"); the
compiler installs its own mode while it traces a kernel.  The interpreter
installs a third mode, `_Interpreter`, whose answer is "run the torch
emulation registered under that operation's name in `_OPS`".

We call the kernel's own Python function (``kernel._pyfunc``) directly
inside that mode.  Compared with copying the function and swapping its
globals, this

* runs the exact object that is launched on the GPU: line numbers,
  tracebacks, ``breakpoint()``, closures and default arguments are simply
  the kernel's own;
* needs no bookkeeping for helper functions, whether they are plain
  functions, ``@ct.function`` helpers, imported with ``from cuda.tile
  import load`` or reached through another module;
* fails loudly for operations we do not emulate: the stub still calls us
  and we raise ``NotImplementedError`` naming it.

The price is that the hook (``cuda.tile._dispatch_mode``) is internal to
cuTile; this file targets cuda-tile 1.7.

Values inside an interpreted kernel
-----------------------------------
* Kernel array arguments become `Array` (a torch tensor plus its cuTile
  dtype).  Tiles are `Tile`: a torch tensor plus a cuTile dtype.  Tiles are
  immutable; every operation returns a new one.
* ``ct.bid``, ``ct.num_blocks``, array shapes, loop counters and integer
  kernel arguments are plain Python ints.  Float kernel arguments that are
  not ``ct.Constant`` become 0-d float32 tiles, because on the GPU they are
  float32 values (``bf16_tile * scale`` is a float32 tile there).
* Python scalars are "loosely typed" as in cuTile: in ``tile + 1.5`` the
  tile's dtype wins unless the scalar is of a stronger kind (a float scalar
  with an int tile gives float32).  Two tiles of different dtypes promote
  with cuTile's own table (``cuda.tile._datatype.promote_dtypes``), so
  mixing e.g. bfloat16 and float16 is an error here as in the compiler.

Numerics
--------
* float16/bfloat16/tfloat32 tiles are stored in their own precision; each
  elementwise operation computes in float32 and rounds the result to the
  tile's dtype (round to nearest even), as the GPU does.  float32 stays
  float32.  Reductions and scans over 16-bit tiles combine partial results
  pairwise and round every partial result, like a reduction tree on the
  GPU (the GPU's exact combining order is not known, so the last bits can
  differ).
* ``ct.mma`` multiplies the operands exactly as stored and accumulates in
  float32 (float64 for float64, int32 for int8).  float32 operands are NOT
  rounded to tf32: for sm_90 the compiler lowers a float32 ``mma`` to FMA
  instructions (``tileiras --remarks=tensorcore`` reports it).  Converting
  the operands with ``.astype(ct.tfloat32)`` is what selects tensor cores;
  the interpreter then rounds them to 10 mantissa bits, nearest-even.
* Float to integer conversion truncates toward zero and saturates, NaN
  becoming 0, as PTX's conversion instructions do (the GPU test
  ``test_gpu_semantics_probe`` checks this and other exact results).

Memory
------
``ct.load`` copies the tile; elements outside the array are padded per
``padding_mode``.  ``PaddingMode.UNDETERMINED`` (the default) pads floats
with NaN and integers with their most negative value (booleans with True),
so a kernel that lets undetermined padding reach a result is caught.
``ct.store`` drops out-of-bounds elements.  A tile lying entirely outside
the array, or a partial tile with ``check_bounds=False``, is undefined
behaviour on the GPU and an error here.  Hints (``latency``,
``allow_tma``, memory order/scope) are accepted and ignored.

Errors
------
Mistakes the compiler would reject, and undefined behaviour we can detect,
raise `KernelTypeError` / `KernelValueError` (subclasses of TypeError and
ValueError) whose message starts with the kernel's file, line and function,
e.g. ``kernel.py:42 in chunk_cumsum: ct.load shape (48,) must be powers of
two``.

Not emulated: atomics, gather/scatter, advanced indexing, tiled views and
``Array.slice``, foreign pointers, float8/float4 and unsigned types other
than uint8, rounding modes other than the default, flush-to-zero (ignored),
``ct.float32(x)``-style dtype calls, and Python's builtin ``min``/``max`` on
multi-element tiles (cuTile makes them elementwise; use ``ct.minimum`` /
``ct.maximum``).  There is no timing and no concurrency: blocks run one at a
time, x fastest, then y, then z.
"""

import builtins
import functools
import math
import os
import re
import sys
import typing

import torch

import cuda.tile as ct
from cuda.tile import MemoryOrder, MemoryScope, PaddingMode, RoundingMode
from cuda.tile._datatype import (
    is_arithmetic,
    is_boolean,
    is_float,
    is_integral,
    is_signed,
    promote_dtypes,
)
from cuda.tile._dispatch_mode import DispatchMode
from cuda.tile._stub import ConstantAnnotation, ScalarAnnotation

__all__ = [
    "Array",
    "KernelAssertionError",
    "KernelError",
    "KernelTypeError",
    "KernelValueError",
    "Tile",
    "UnsupportedOperation",
    "is_interpreting",
    "launch",
]


# ---------------------------------------------------------------------------
# Errors that point at the kernel's source line
# ---------------------------------------------------------------------------

_THIS_FILE = os.path.abspath(__file__)
_CUDA_TILE_DIR = os.path.dirname(os.path.abspath(ct.__file__))


def _kernel_location():
    """'file.py:LINE in function' of the innermost frame outside the interpreter.

    When an operation fails, the Python stack is: kernel line -> cuTile's
    stub wrapper -> this file.  Skipping our frames and cuTile's leaves the
    kernel's (or its helper's) line.
    """
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != _THIS_FILE and not filename.startswith(_CUDA_TILE_DIR):
            name = os.path.basename(filename)
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<kernel>"


class KernelError(Exception):
    """Base of the interpreter's errors; the message starts with the kernel line."""

    def __init__(self, message):
        super().__init__(f"{_kernel_location()}: {message}")


class KernelTypeError(KernelError, TypeError):
    """Something the cuTile compiler would reject (shape, dtype, rank)."""


class KernelValueError(KernelError, ValueError):
    """A run-time value that is undefined behaviour on the GPU."""


class KernelAssertionError(KernelError, AssertionError):
    """A failed ``ct.assert_`` or ``ct.static_assert``."""


class UnsupportedOperation(KernelError, NotImplementedError):
    """A cuTile feature the CPU interpreter does not emulate."""


# ---------------------------------------------------------------------------
# Data types
# ---------------------------------------------------------------------------

# How each cuTile dtype is stored in torch.  tfloat32 has no torch dtype: it
# is a float32 whose mantissa has been rounded to 10 bits.
_TORCH_DTYPE = {
    ct.bool_: torch.bool,
    ct.uint8: torch.uint8,
    ct.int8: torch.int8,
    ct.int16: torch.int16,
    ct.int32: torch.int32,
    ct.int64: torch.int64,
    ct.float16: torch.float16,
    ct.bfloat16: torch.bfloat16,
    ct.tfloat32: torch.float32,
    ct.float32: torch.float32,
    ct.float64: torch.float64,
}
_CT_DTYPE = {t: d for d, t in _TORCH_DTYPE.items() if d is not ct.tfloat32}

# Dtypes narrower than float32: arithmetic runs in float32, then rounds back.
_NARROW_FLOATS = (ct.float16, ct.bfloat16, ct.tfloat32)


def _storage(dtype):
    """The torch dtype holding tiles of cuTile `dtype`."""
    try:
        return _TORCH_DTYPE[dtype]
    except KeyError:
        raise UnsupportedOperation(
            f"{dtype} tiles are not supported by the CPU interpreter") from None


def _compute(dtype):
    """The torch dtype in which arithmetic on `dtype` tiles is carried out."""
    return torch.float32 if dtype in _NARROW_FLOATS else _storage(dtype)


def _round_tf32(t):
    """Round float32 values to tfloat32 (10 mantissa bits), ties to even."""
    bits = t.view(torch.int32)
    # Add half of the dropped 13 bits (minus one unless the kept LSB is odd,
    # which turns ties into ties-to-even), then clear them.
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0xFFF + lsb) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isnan(t), t, rounded)  # keep NaN payloads NaN


def _to_dtype(t, dtype):
    """Round a result computed in `_compute(dtype)` to the storage of `dtype`."""
    if dtype is ct.tfloat32:
        return _round_tf32(t.to(torch.float32))
    storage = _TORCH_DTYPE[dtype]
    return t if t.dtype == storage else t.to(storage)


def _convert(t, src, dst):
    """Elementwise conversion of a tensor holding `src` values to `dst` (astype)."""
    if src == dst:
        return t
    if dst is ct.bool_:
        return t != 0
    if is_float(src) and is_integral(dst):
        # Truncate toward zero and saturate at the integer range, NaN -> 0.
        storage = _storage(dst)
        info = torch.iinfo(storage)
        x = t.double().nan_to_num(nan=0.0).clamp(info.min, info.max).trunc()
        out = x.to(storage)
        if storage == torch.int64:  # 2**63 is not an int64: saturate by hand
            out = torch.where(x >= 2.0**63, info.max, out)
        return out
    return _to_dtype(t.to(_compute(dst)), dst)


def _dtype_of_scalar(value):
    """The dtype cuTile gives a Python constant (used for promotion)."""
    if isinstance(value, bool):
        return ct.bool_
    if isinstance(value, int):
        return ct.int32 if -2**31 <= value < 2**31 else ct.int64
    return ct.float32


def _kind(dtype):
    """0 for bool, 1 for integers, 2 for floats: a scalar only wins if stronger."""
    return 0 if is_boolean(dtype) else 1 if is_integral(dtype) else 2


def _is_scalar(value):
    return isinstance(value, (bool, int, float))


def _promote(op, x, y, force_float=False):
    """Result dtype of a binary operation on tiles and/or Python scalars."""
    if isinstance(x, Tile) and isinstance(y, Tile):
        try:
            return promote_dtypes(x.dtype, y.dtype, force_float)
        except ct.TileError as e:
            raise KernelTypeError(f"{op}: {e.message}") from None
    if not isinstance(x, Tile) and not isinstance(y, Tile):
        return promote_dtypes(_dtype_of_scalar(x), _dtype_of_scalar(y), force_float)
    tile, scalar = (x, y) if isinstance(x, Tile) else (y, x)
    result = _promote_with_scalar(op, tile.dtype, scalar)
    if force_float and not is_float(result):
        result = ct.float32
    return result


def _promote_with_scalar(op, dtype, scalar):
    """cuTile's rule for a tile and a Python scalar: the tile wins within its kind."""
    scalar_dtype = _dtype_of_scalar(scalar)
    if _kind(scalar_dtype) > _kind(dtype):
        return scalar_dtype
    if _kind(dtype) == 1 and _kind(scalar_dtype) == 1:
        info = torch.iinfo(_storage(dtype))
        if not info.min <= scalar <= info.max:
            raise KernelTypeError(f"{op}: integer constant {scalar} is out of range of {dtype}")
    return dtype


# ---------------------------------------------------------------------------
# Tiles and arrays
# ---------------------------------------------------------------------------

_ORDINARY = (bool, int, float)


class Tile:
    """An immutable tile: a torch tensor (`_t`) plus its cuTile dtype.

    `_t` always has the storage dtype of `dtype` (see `_TORCH_DTYPE`).
    Operators follow cuTile: ``a + b`` broadcasts and promotes, comparisons
    give bool tiles, ``t[None, :]`` inserts an axis.
    """

    __slots__ = ("_t", "dtype")

    def __init__(self, tensor, dtype):
        self._t = tensor
        self.dtype = dtype

    # -- attributes and methods of ct.Tile --------------------------------
    @property
    def shape(self):
        return tuple(self._t.shape)

    @property
    def ndim(self):
        return self._t.dim()

    def item(self):
        if self._t.numel() != 1:
            raise KernelTypeError(f"item() needs a tile with one element, got shape {self.shape}")
        return Tile(self._t.reshape(()), self.dtype)

    def astype(self, dtype, *, rounding_mode=None):
        return astype(self, dtype, rounding_mode=rounding_mode)

    def reshape(self, shape):
        return reshape(self, shape)

    def permute(self, axes):
        return permute(self, axes)

    def transpose(self, axis0=None, axis1=None):
        return transpose(self, axis0, axis1)

    def extract(self, index, shape):
        return extract(self, index, shape)

    def insert(self, index, value):
        return insert(self, index, value)

    def __getitem__(self, key):
        # Only axis insertion is allowed: t[None], t[:, None], t[..., None].
        key = key if isinstance(key, tuple) else (key,)
        if any(k is not None and k is not Ellipsis and k != slice(None) for k in key):
            raise KernelTypeError(
                "directly indexing a tile is not supported; use extract() or item()")
        try:
            return Tile(self._t[key], self.dtype)
        except IndexError as e:
            raise KernelTypeError(f"bad tile subscript {key}: {e}") from None

    def __setitem__(self, key, value):
        raise KernelTypeError("tiles are immutable: item assignment is not supported")

    def __iter__(self):
        raise KernelTypeError("tiles are not iterable; use extract() to take a part")

    # -- conversion to Python values (0-d or one-element tiles) -----------
    def _python_value(self, what):
        if self._t.numel() != 1:
            raise KernelTypeError(
                f"{what} of a tile with {self._t.numel()} elements is ambiguous. "
                "Python's if/while/and/or, and the builtins min()/max() on tiles, "
                "need a single element; use ct.where, ct.minimum or ct.maximum "
                "for elementwise choices")
        return self._t.item()

    def __bool__(self):
        return bool(self._python_value("the truth value"))

    def __index__(self):
        if not (is_integral(self.dtype) or is_boolean(self.dtype)):
            raise KernelTypeError(f"a {self.dtype} tile cannot be used as an integer index")
        return int(self._python_value("the integer value"))

    def __int__(self):
        return int(self._python_value("the integer value"))

    def __float__(self):
        return float(self._python_value("the float value"))

    # -- printing: the GPU prints ints with %d and floats with %f ---------
    def __format__(self, spec):
        if not spec:
            spec = "f" if is_float(self.dtype) else "d"
        values = self._t.to(torch.float64 if is_float(self.dtype) else torch.int64).tolist()
        return _format_nested(values, lambda v: format(v, spec))

    def __str__(self):
        return self.__format__("")

    def __repr__(self):
        return f"Tile[{self.dtype}, {self.shape}]\n{self._t}"

    # -- operators (cuTile semantics; see the elementwise section) --------
    def __add__(self, o): return _binop(add, self, o)
    def __radd__(self, o): return _binop(add, o, self)
    def __sub__(self, o): return _binop(sub, self, o)
    def __rsub__(self, o): return _binop(sub, o, self)
    def __mul__(self, o): return _binop(mul, self, o)
    def __rmul__(self, o): return _binop(mul, o, self)
    def __truediv__(self, o): return _binop(truediv, self, o)
    def __rtruediv__(self, o): return _binop(truediv, o, self)
    def __floordiv__(self, o): return _binop(floordiv, self, o)
    def __rfloordiv__(self, o): return _binop(floordiv, o, self)
    def __mod__(self, o): return _binop(mod, self, o)
    def __rmod__(self, o): return _binop(mod, o, self)
    def __divmod__(self, o): return _binop(divmod_, self, o)
    def __rdivmod__(self, o): return _binop(divmod_, o, self)
    def __pow__(self, o): return _binop(pow_, self, o)
    def __rpow__(self, o): return _binop(pow_, o, self)
    def __and__(self, o): return _binop(bitwise_and, self, o)
    def __rand__(self, o): return _binop(bitwise_and, o, self)
    def __or__(self, o): return _binop(bitwise_or, self, o)
    def __ror__(self, o): return _binop(bitwise_or, o, self)
    def __xor__(self, o): return _binop(bitwise_xor, self, o)
    def __rxor__(self, o): return _binop(bitwise_xor, o, self)
    def __lshift__(self, o): return _binop(bitwise_lshift, self, o)
    def __rlshift__(self, o): return _binop(bitwise_lshift, o, self)
    def __rshift__(self, o): return _binop(bitwise_rshift, self, o)
    def __rrshift__(self, o): return _binop(bitwise_rshift, o, self)
    def __matmul__(self, o): return _binop(matmul, self, o)
    def __rmatmul__(self, o): return _binop(matmul, o, self)
    def __lt__(self, o): return _binop(less, self, o)
    def __le__(self, o): return _binop(less_equal, self, o)
    def __gt__(self, o): return _binop(greater, self, o)
    def __ge__(self, o): return _binop(greater_equal, self, o)
    def __eq__(self, o): return _binop(equal, self, o)
    def __ne__(self, o): return _binop(not_equal, self, o)
    def __neg__(self): return negative(self)
    def __pos__(self): return astype(self, ct.int32) if self.dtype is ct.bool_ else self
    def __abs__(self): return abs_(self)
    def __invert__(self): return bitwise_not(self)

    __hash__ = None


def _binop(op, x, y):
    """Apply `op` if both operands are tiles or Python scalars (else let Python decide)."""
    if not isinstance(x, (Tile,) + _ORDINARY) or not isinstance(y, (Tile,) + _ORDINARY):
        return NotImplemented
    return op(x, y)


def _format_nested(values, fmt):
    if isinstance(values, list):
        return "[" + ", ".join(_format_nested(v, fmt) for v in values) + "]"
    return fmt(values)


class Array:
    """A kernel array argument: a CPU torch tensor seen through cuTile's Array API."""

    __slots__ = ("_t", "dtype")

    def __init__(self, tensor):
        if tensor.dtype not in _CT_DTYPE:
            raise UnsupportedOperation(
                f"arrays of {tensor.dtype} are not supported by the CPU interpreter")
        self._t = tensor
        self.dtype = _CT_DTYPE[tensor.dtype]

    @property
    def shape(self):
        return tuple(self._t.shape)

    @property
    def ndim(self):
        return self._t.dim()

    @property
    def strides(self):
        return tuple(self._t.stride())

    def __getattr__(self, name):  # only called for attributes we do not define
        if name.startswith("__"):  # Python and libraries probing for protocols
            raise AttributeError(name)
        raise UnsupportedOperation(
            f"Array.{name} is not supported by the CPU interpreter")

    def __getitem__(self, key):
        raise KernelTypeError("arrays are not directly subscriptable; use ct.load()")

    def __setitem__(self, key, value):
        raise KernelTypeError("arrays do not support item assignment; use ct.store()")

    def __repr__(self):
        return f"Array[{self.dtype}, {self.shape}]"


# ---------------------------------------------------------------------------
# The operation table and argument checking helpers
# ---------------------------------------------------------------------------

# Stub name (its __qualname__ in cuda.tile._stub) -> emulation.
_OPS = {}


def _op(*names):
    """Register the decorated function as the emulation of ``ct.<name>``."""
    def register(fn):
        for name in names:
            _OPS[name] = fn
        return fn
    return register


def _require_tile(op, value, what="argument"):
    if not isinstance(value, Tile):
        raise KernelTypeError(f"{op}: {what} must be a tile, got {type(value).__name__}")
    return value


def _as_tile(value):
    """A tile for a tile or a Python scalar (scalars get cuTile's default dtype)."""
    if isinstance(value, Tile):
        return value
    if _is_scalar(value):
        dtype = _dtype_of_scalar(value)
        return Tile(torch.tensor(value, dtype=_TORCH_DTYPE[dtype]), dtype)
    raise KernelTypeError(f"expected a tile or a scalar, got {type(value).__name__}")


def _operand(value, dtype):
    """`value` (tile or scalar) converted to `dtype`, in `dtype`'s compute precision."""
    if isinstance(value, Tile):
        t = _convert(value._t, value.dtype, dtype)
    else:
        t = _to_dtype(torch.tensor(value, dtype=_compute(dtype)), dtype)
    compute = _compute(dtype)
    return t if t.dtype == compute else t.to(compute)


def _as_int(op, value, what):
    if isinstance(value, Tile):
        value = value.__index__()
    if not isinstance(value, int):
        raise KernelTypeError(f"{op}: {what} must be an integer, got {type(value).__name__}")
    return int(value)


def _int_tuple(op, value, what):
    """An int or a tuple of ints (or 0-d integer tiles) as a tuple of ints."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    return tuple(_as_int(op, v, what) for v in items)


def _check_shape(op, shape):
    """Tile dimensions must be positive powers of two, as the compiler requires."""
    for size in shape:
        if size <= 0 or size & (size - 1):
            raise KernelTypeError(f"{op} shape {tuple(shape)} must be powers of two")


def _axis(op, axis, ndim):
    axis = _as_int(op, axis, "axis")
    if not -ndim <= axis < ndim:
        raise KernelTypeError(f"{op}: axis {axis} is out of range for a {ndim}-d tile")
    return axis % ndim


def _check_rounding(op, rounding_mode):
    if rounding_mode not in (None, RoundingMode.RN, RoundingMode.FULL, RoundingMode.APPROX):
        raise UnsupportedOperation(
            f"{op}: rounding_mode={rounding_mode} is not supported by the CPU interpreter")


def _broadcast_error(op, values):
    shapes = [v.shape for v in values if isinstance(v, Tile)]
    return KernelTypeError(f"{op}: shapes {', '.join(map(str, shapes))} are not broadcastable")


def _elementwise(op, fn, args, dtype, result_dtype=None):
    """Convert `args` to `dtype`, apply the torch function `fn`, wrap the result.

    Narrow floats are computed in float32 and rounded once, to
    `result_dtype` (default: `dtype`).
    """
    tensors = [_operand(a, dtype) for a in args]
    try:
        out = fn(*tensors)
    except RuntimeError:
        try:
            torch.broadcast_shapes(*(t.shape for t in tensors))
        except RuntimeError:
            raise _broadcast_error(op, args) from None
        raise
    result_dtype = result_dtype or dtype
    return Tile(_to_dtype(out, result_dtype), result_dtype)


# ---------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------

def _launch_state():
    mode = DispatchMode.get_current()
    assert isinstance(mode, _Interpreter)
    return mode


@_op("bid")
def bid(axis):
    axis = _as_int("ct.bid", axis, "axis")
    if axis not in (0, 1, 2):
        raise KernelTypeError(f"ct.bid: axis must be 0, 1 or 2, got {axis}")
    return _launch_state().block[axis]


@_op("num_blocks")
def num_blocks(axis):
    axis = _as_int("ct.num_blocks", axis, "axis")
    if axis not in (0, 1, 2):
        raise KernelTypeError(f"ct.num_blocks: axis must be 0, 1 or 2, got {axis}")
    return _launch_state().grid[axis]


# ---------------------------------------------------------------------------
# Memory: load and store
# ---------------------------------------------------------------------------

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
    perm = tuple(_as_int(op, a, "order") % ndim if ndim else 0 for a in order)
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


def _padding_value(op, mode, dtype):
    if mode is PaddingMode.ZERO:
        return 0
    if mode is PaddingMode.UNDETERMINED:
        # Any value is allowed; pick one that cannot go unnoticed.
        if is_float(dtype):
            return math.nan
        if is_boolean(dtype):
            return True
        info = torch.iinfo(_storage(dtype))
        return info.min if is_signed(dtype) else info.max
    if not is_float(dtype):
        raise KernelTypeError(f"{op}: padding_mode {mode} needs a floating-point array, "
                              f"got {dtype}")
    return {PaddingMode.NEG_ZERO: -0.0, PaddingMode.NAN: math.nan,
            PaddingMode.POS_INF: math.inf, PaddingMode.NEG_INF: -math.inf}[mode]


def _index(op, array, index):
    index = _int_tuple(op, index, "index")
    if len(index) != array.ndim:
        raise KernelTypeError(f"{op}: index {index} has {len(index)} entries but the array "
                              f"has rank {array.ndim}")
    return index


@_op("load")
def load(array, /, index, shape, *, order="C", padding_mode=PaddingMode.UNDETERMINED,
         check_bounds=True, latency=None, allow_tma=None,
         memory_order=MemoryOrder.WEAK, memory_scope=MemoryScope.NONE):
    op = "ct.load"
    array = _require_array(op, array)
    index = _index(op, array, index)
    shape = _int_tuple(op, shape, "shape")
    if len(shape) not in (0, array.ndim):
        raise KernelTypeError(f"{op}: shape {shape} has {len(shape)} dimensions but the "
                              f"array has rank {array.ndim}")
    _check_shape(op, shape)
    full_shape = shape or (1,) * array.ndim  # a 0-d load reads a 1x..x1 tile
    view = _array_view(array, _axis_order(op, order, array.ndim))
    region, inside = _tile_region(op, view.shape, index, full_shape, check_bounds)
    if inside is None:
        data = view[region].clone()  # a copy: later stores must not change this tile
    else:
        fill = _padding_value(op, padding_mode, array.dtype)
        data = torch.full(full_shape, fill, dtype=view.dtype)
        data[inside] = view[region]
    return Tile(data.reshape(shape), array.dtype)


def _check_implicit_cast(op, value, dtype):
    """A store may widen (bf16 tile -> f32 array) but never narrow implicitly."""
    if isinstance(value, Tile):
        try:
            ok = promote_dtypes(value.dtype, dtype) == dtype
        except ct.TileError:
            ok = False
        if not ok:
            raise KernelTypeError(f"{op}: cannot implicitly cast a {value.dtype} tile to "
                                  f"the {dtype} array; use .astype({dtype}) first")
        return
    kind = _kind(_dtype_of_scalar(value))
    if kind > _kind(dtype) or (is_boolean(dtype) and value not in (0, 1)):
        raise KernelTypeError(f"{op}: cannot implicitly cast {value!r} to {dtype}")
    if kind == 1 and _kind(dtype) == 1:
        info = torch.iinfo(_storage(dtype))
        if not info.min <= value <= info.max:
            raise KernelTypeError(f"{op}: {value} is out of range of {dtype}")


@_op("store")
def store(array, /, index, tile, *, order="C", check_bounds=True, latency=None,
          allow_tma=None, memory_order=MemoryOrder.WEAK, memory_scope=MemoryScope.NONE):
    op = "ct.store"
    array = _require_array(op, array)
    index = _index(op, array, index)
    if not isinstance(tile, Tile) and not _is_scalar(tile):
        raise KernelTypeError(f"{op}: can only store a tile or a scalar, got {type(tile).__name__}")
    _check_implicit_cast(op, tile, array.dtype)
    data = _as_tile(tile)
    data = _convert(data._t, data.dtype, array.dtype)
    if data.dim() == 0:
        data = data.reshape((1,) * array.ndim)  # scalars are stored as 1x..x1 tiles
    elif data.dim() != array.ndim:
        raise KernelTypeError(f"{op}: a {data.dim()}-d tile cannot be stored into a "
                              f"{array.ndim}-d array; the ranks must match")
    view = _array_view(array, _axis_order(op, order, array.ndim))
    region, inside = _tile_region(op, view.shape, index, data.shape, check_bounds)
    view[region] = data if inside is None else data[inside]


@_op("num_tiles")
def num_tiles(array, /, axis, shape, order="C"):
    op = "ct.num_tiles"
    array = _require_array(op, array)
    shape = _int_tuple(op, shape, "shape") or (1,) * array.ndim
    extent = _array_view(array, _axis_order(op, order, array.ndim)).shape
    axis = _axis(op, axis, array.ndim)
    return -(-extent[axis] // shape[axis])


# ---------------------------------------------------------------------------
# Creating tiles
# ---------------------------------------------------------------------------

def _require_dtype(op, dtype):
    if not isinstance(dtype, ct.DType):
        raise KernelTypeError(f"{op}: dtype must be a cuTile dtype such as ct.float32, "
                              f"got {dtype!r}")
    _storage(dtype)
    return dtype


@_op("full")
def full(shape, fill_value, dtype):
    op = "ct.full"
    shape = _int_tuple(op, shape, "shape")
    _check_shape(op, shape)
    dtype = _require_dtype(op, dtype)
    value = _as_tile(fill_value)
    if value.ndim != 0:
        raise KernelTypeError(f"{op}: fill_value must be a scalar, got shape {value.shape}")
    # expand() makes a view without copying; tiles are never written in place.
    return Tile(_convert(value._t, value.dtype, dtype).expand(shape), dtype)


@_op("zeros")
def zeros(shape, dtype):
    return full(shape, 0, dtype)


@_op("ones")
def ones(shape, dtype):
    return full(shape, 1, dtype)


@_op("arange")
def arange(size, /, *, dtype, start=0, step=1):
    op = "ct.arange"
    size = _as_int(op, size, "size")
    _check_shape(op, (size,))
    dtype = _require_dtype(op, dtype)
    # As in cuTile: 0..size-1 in `dtype`, then * step, then + start, in `dtype`.
    result = Tile(_convert(torch.arange(size), ct.int64, dtype), dtype)
    if not (_is_scalar(step) and step == 1):
        result = mul(result, astype(_as_tile(step), dtype))
    if not (_is_scalar(start) and start == 0):
        result = add(result, astype(_as_tile(start), dtype))
    return result


@_op("astile")
def astile(value, /, *, dtype):
    op = "ct.astile"
    dtype = _require_dtype(op, dtype)

    def python_values(v):
        if isinstance(v, tuple):
            _check_shape(op, (len(v),))
            return [python_values(item) for item in v]
        return _as_tile(v)._t.item()

    nested = python_values(value)
    source = torch.tensor(nested, dtype=torch.float64)
    return Tile(_convert(source, ct.float64, dtype), dtype)


# ---------------------------------------------------------------------------
# Elementwise arithmetic, comparisons and bit operations
# ---------------------------------------------------------------------------

def _arith(op, fn, x, y, force_float=False):
    dtype = _promote(op, x, y, force_float)
    for v in (x, y):
        if isinstance(v, Tile) and not is_arithmetic(v.dtype):
            raise KernelTypeError(f"{op} does not support {v.dtype} tiles")
    if dtype is ct.bool_:
        raise KernelTypeError(f"{op} does not support bool; cast with .astype(ct.int32)")
    return _elementwise(op, fn, (x, y), dtype)


@_op("add")
def add(x, y, /, *, rounding_mode=None, flush_to_zero=False):
    _check_rounding("ct.add", rounding_mode)
    return _arith("ct.add", torch.add, x, y)


@_op("sub")
def sub(x, y, /, *, rounding_mode=None, flush_to_zero=False):
    _check_rounding("ct.sub", rounding_mode)
    return _arith("ct.sub", torch.sub, x, y)


@_op("mul")
def mul(x, y, /, *, rounding_mode=None, flush_to_zero=False):
    _check_rounding("ct.mul", rounding_mode)
    return _arith("ct.mul", torch.mul, x, y)


@_op("truediv")
def truediv(x, y, /, *, rounding_mode=None, flush_to_zero=False):
    # Integer operands give float32, as in Python 3 and cuTile.
    _check_rounding("ct.truediv", rounding_mode)
    return _arith("ct.truediv", torch.div, x, y, force_float=True)


def _floordiv(a, b):
    if a.is_floating_point():
        return torch.floor(a / b)  # cuTile: floor(x / y)
    return torch.div(a, b, rounding_mode="floor")


def _mod(a, b):
    # Python's sign convention (result has the sign of b), built like cuTile
    # does from the C remainder, which has the sign of a.
    if not a.is_floating_point():
        return torch.remainder(a, b)
    r = torch.fmod(a, b)
    fix = (r != 0) & ((r < 0) != (b < 0))
    return torch.where(fix, r + b, r)


@_op("floordiv")
def floordiv(x, y, /):
    return _arith("ct.floordiv", _floordiv, x, y)


@_op("mod")
def mod(x, y, /):
    return _arith("ct.mod", _mod, x, y)


@_op("divmod")
def divmod_(x, y, /):
    if is_float(_promote("divmod", x, y)):
        raise KernelTypeError("divmod() is not implemented for floating point values")
    return floordiv(x, y), mod(x, y)


@_op("pow")
def pow_(x, y, /):
    # A float tile to an integer power keeps the tile's dtype (cuTile's fpowi).
    exponent_is_int = (isinstance(y, int) and not isinstance(y, bool)) or (
        isinstance(y, Tile) and is_integral(y.dtype))
    if isinstance(x, Tile) and is_float(x.dtype) and is_arithmetic(x.dtype) and exponent_is_int:
        exponent = y._t if isinstance(y, Tile) else y
        try:
            out = torch.pow(_operand(x, x.dtype), exponent)
        except RuntimeError:
            raise _broadcast_error("ct.pow", (x, y)) from None
        return Tile(_to_dtype(out, x.dtype), x.dtype)
    return _arith("ct.pow", torch.pow, x, y)


@_op("atan2")
def atan2(x1, x2, /):
    if not is_float(_promote("ct.atan2", x1, x2)):
        raise KernelTypeError("ct.atan2 needs floating-point operands")
    return _arith("ct.atan2", torch.atan2, x1, x2)


def _min_max(op, nan_ignoring, nan_propagating, x, y, propagate_nan):
    dtype = _promote(op, x, y)
    fn = nan_propagating if propagate_nan or not is_float(dtype) else nan_ignoring
    return _arith(op, fn, x, y)


@_op("minimum")
def minimum(x, y, /, *, flush_to_zero=False, propagate_nan=False):
    # By default a NaN operand is ignored (fmin), as cuTile's default.
    return _min_max("ct.minimum", torch.fmin, torch.minimum, x, y, propagate_nan)


@_op("maximum")
def maximum(x, y, /, *, flush_to_zero=False, propagate_nan=False):
    return _min_max("ct.maximum", torch.fmax, torch.maximum, x, y, propagate_nan)


def _compare(op, fn, x, y):
    return _elementwise(op, fn, (x, y), _promote(op, x, y), result_dtype=ct.bool_)


@_op("equal")
def equal(x, y, /):
    return _compare("ct.equal", torch.eq, x, y)


@_op("not_equal")
def not_equal(x, y, /):
    return _compare("ct.not_equal", torch.ne, x, y)


@_op("less")
def less(x, y, /):
    return _compare("ct.less", torch.lt, x, y)


@_op("less_equal")
def less_equal(x, y, /):
    return _compare("ct.less_equal", torch.le, x, y)


@_op("greater")
def greater(x, y, /):
    return _compare("ct.greater", torch.gt, x, y)


@_op("greater_equal")
def greater_equal(x, y, /):
    return _compare("ct.greater_equal", torch.ge, x, y)


def _bitwise(op, fn, x, y, shift=False):
    dtypes = [v.dtype if isinstance(v, Tile) else _dtype_of_scalar(v) for v in (x, y)]
    allowed = is_integral if shift else (lambda d: is_integral(d) or is_boolean(d))
    if not all(allowed(d) for d in dtypes):
        what = "integers" if shift else "integers or booleans"
        raise KernelTypeError(f"{op} needs {what}, got {dtypes[0]} and {dtypes[1]}")
    both_tiles = isinstance(x, Tile) and isinstance(y, Tile)
    if not shift and both_tiles and x.dtype != y.dtype:
        raise KernelTypeError(f"{op}: operands must have the same dtype, "
                              f"got {x.dtype} and {y.dtype}")
    return _elementwise(op, fn, (x, y), _promote(op, x, y))


@_op("bitwise_and")
def bitwise_and(x, y, /):
    return _bitwise("ct.bitwise_and", torch.bitwise_and, x, y)


@_op("bitwise_or")
def bitwise_or(x, y, /):
    return _bitwise("ct.bitwise_or", torch.bitwise_or, x, y)


@_op("bitwise_xor")
def bitwise_xor(x, y, /):
    return _bitwise("ct.bitwise_xor", torch.bitwise_xor, x, y)


@_op("bitwise_lshift")
def bitwise_lshift(x, y, /):
    return _bitwise("ct.bitwise_lshift", torch.bitwise_left_shift, x, y, shift=True)


@_op("bitwise_rshift")
def bitwise_rshift(x, y, /):
    # Arithmetic shift for signed types, logical for unsigned: torch does the same.
    return _bitwise("ct.bitwise_rshift", torch.bitwise_right_shift, x, y, shift=True)


@_op("where")
def where(cond, x, y, /):
    op = "ct.where"
    condition = _operand(_as_tile(cond), ct.bool_)
    dtype = _promote(op, x, y)
    try:
        out = torch.where(condition, _operand(x, dtype), _operand(y, dtype))
    except RuntimeError:
        raise _broadcast_error(op, (_as_tile(cond), x, y)) from None
    return Tile(_to_dtype(out, dtype), dtype)


# Unary operations.  on_int / on_bool / on_float say what a tile of that kind
# becomes before the operation: True keeps its dtype, "float" converts it to
# float32 (ct.exp of an int tile), "int" to int32 (-bool), None rejects it.

def _unary(op, fn, x, *, on_int="float", on_bool=None, on_float=True):
    x = _as_tile(x)
    dtype = x.dtype
    rule = on_bool if is_boolean(dtype) else on_int if is_integral(dtype) else on_float
    if rule is None or not (is_arithmetic(dtype) or is_boolean(dtype)):
        raise KernelTypeError(f"{op} does not support {dtype} tiles")
    if rule == "float":
        dtype = ct.float32
    elif rule == "int":
        dtype = ct.int32
    return _elementwise(op, fn, (x,), dtype)


def _float_unary(name, fn):
    """Register ct.<name>: float-only math; int/bool inputs are taken as float32."""
    @_op(name)
    def emulation(x, /, *, rounding_mode=None, flush_to_zero=False):
        _check_rounding(f"ct.{name}", rounding_mode)
        return _unary(f"ct.{name}", fn, x, on_int="float", on_bool="float")
    emulation.__name__ = name
    return emulation


exp = _float_unary("exp", torch.exp)
exp2 = _float_unary("exp2", torch.exp2)
log = _float_unary("log", torch.log)
log2 = _float_unary("log2", torch.log2)
sqrt = _float_unary("sqrt", torch.sqrt)
rsqrt = _float_unary("rsqrt", torch.rsqrt)
sin = _float_unary("sin", torch.sin)
cos = _float_unary("cos", torch.cos)
tan = _float_unary("tan", torch.tan)
sinh = _float_unary("sinh", torch.sinh)
cosh = _float_unary("cosh", torch.cosh)
tanh = _float_unary("tanh", torch.tanh)


@_op("floor")
def floor(x, /):
    return _unary("ct.floor", torch.floor, x, on_int=None)


@_op("ceil")
def ceil(x, /):
    return _unary("ct.ceil", torch.ceil, x, on_int=None)


@_op("abs")
def abs_(x, /):
    x = _as_tile(x)
    if x.dtype is ct.bool_:
        return x  # torch has no abs for bool; it is the identity anyway
    return _unary("ct.abs", torch.abs, x, on_int=True)


@_op("negative")
def negative(x, /):
    return _unary("ct.negative", torch.neg, x, on_int=True, on_bool="int")


@_op("bitwise_not")
def bitwise_not(x, /):
    return _unary("ct.bitwise_not", torch.bitwise_not, x, on_int=True, on_bool=True,
                  on_float=None)


@_op("isnan")
def isnan(x, /):
    x = _as_tile(x)
    if not is_float(x.dtype):
        raise KernelTypeError(f"ct.isnan needs a floating-point tile, got {x.dtype}")
    return Tile(torch.isnan(x._t), ct.bool_)


@_op("astype")
def astype(x, dtype, /, *, rounding_mode=None):
    op = "astype"
    x = _as_tile(x)
    dtype = _require_dtype(op, dtype)
    if rounding_mode is not None:
        if not (is_float(x.dtype) and is_float(dtype)):
            raise KernelTypeError(f"{op}: rounding_mode is only valid for float to float "
                                  "conversions")
        if rounding_mode is not RoundingMode.RN:
            raise UnsupportedOperation(f"{op}: rounding_mode={rounding_mode} is not supported "
                                       "by the CPU interpreter")
    return Tile(_convert(x._t, x.dtype, dtype), dtype)


@_op("bitcast")
def bitcast(x, /, dtype):
    op = "ct.bitcast"
    x = _as_tile(x)
    dtype = _require_dtype(op, dtype)
    if ct.bool_ in (x.dtype, dtype) or ct.tfloat32 in (x.dtype, dtype):
        raise KernelTypeError(f"{op}: cannot bitcast between {x.dtype} and {dtype}")
    if x.dtype.bitwidth != dtype.bitwidth:
        raise KernelTypeError(f"{op}: {x.dtype} and {dtype} have different bit widths")
    return Tile(x._t.view(_storage(dtype)), dtype)


# ---------------------------------------------------------------------------
# Reductions and scans
# ---------------------------------------------------------------------------

def _reduction_axes(op, x, axis):
    if axis is None:
        return tuple(range(x.ndim))
    axes = tuple(_axis(op, a, x.ndim) for a in (axis if isinstance(axis, tuple) else (axis,)))
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


def _simple_reduce(op, x, axis, keepdims, fn, torch_fn):
    """sum/prod/max/min.  `fn` combines two tensors; `torch_fn` reduces one dim."""
    x = _require_tile(op, x)
    if not (is_arithmetic(x.dtype) or is_boolean(x.dtype)):
        raise KernelTypeError(f"{op} does not support {x.dtype} tiles")
    if x.dtype is ct.bool_:
        x = astype(x, ct.int32)  # as cuTile: bool is reduced as int32
    axes = _reduction_axes(op, x, axis)
    t = _move_axes_last(x._t, axes)
    if x.dtype in _NARROW_FLOATS:
        # Every partial result is a value of the tile's dtype, so round it.
        out = _tree_reduce(t, lambda a, b: _to_dtype(fn(a.float(), b.float()), x.dtype))
    else:
        out = torch_fn(t)
    return Tile(out.reshape(_reduced_shape(x.shape, axes, keepdims)), x.dtype)


@_op("sum")
def sum_(x, /, axis=None, *, keepdims=False, rounding_mode=None, flush_to_zero=False):
    _check_rounding("ct.sum", rounding_mode)
    # dtype= keeps integer sums in the tile's dtype (wrapping like the GPU).
    return _simple_reduce("ct.sum", x, axis, keepdims, torch.add,
                          lambda t: t.sum(-1, dtype=t.dtype))


@_op("prod")
def prod(x, /, axis=None, *, keepdims=False, rounding_mode=None, flush_to_zero=False):
    _check_rounding("ct.prod", rounding_mode)
    return _simple_reduce("ct.prod", x, axis, keepdims, torch.mul,
                          lambda t: t.prod(-1, dtype=t.dtype))


def _nan_to(t, value, propagate_nan):
    """Unless NaN should propagate, make NaN lose every comparison."""
    if propagate_nan or not t.is_floating_point():
        return t
    return torch.where(torch.isnan(t), value, t)


@_op("max")
def max_(x, /, axis=None, *, keepdims=False, flush_to_zero=False, propagate_nan=False):
    both = torch.maximum if propagate_nan else torch.fmax
    return _simple_reduce("ct.max", x, axis, keepdims, both,
                          lambda t: _nan_to(t, -math.inf, propagate_nan).amax(-1))


@_op("min")
def min_(x, /, axis=None, *, keepdims=False, flush_to_zero=False, propagate_nan=False):
    both = torch.minimum if propagate_nan else torch.fmin
    return _simple_reduce("ct.min", x, axis, keepdims, both,
                          lambda t: _nan_to(t, math.inf, propagate_nan).amin(-1))


def _arg_reduce(op, x, axis, keepdims, propagate_nan, largest):
    x = _require_tile(op, x)
    t = x._t.to(torch.int32) if x.dtype is ct.bool_ else x._t
    if axis is None:
        shape = (1,) * x.ndim if keepdims else ()
        t, axis, keepdims = t.reshape(-1), 0, False
    else:
        axis, shape = _axis(op, axis, x.ndim), None
    # torch already returns the first index among ties and prefers NaN.
    t = _nan_to(t, -math.inf if largest else math.inf, propagate_nan)
    fn = torch.argmax if largest else torch.argmin
    out = fn(t, dim=axis, keepdim=keepdims).to(torch.int32)
    return Tile(out if shape is None else out.reshape(shape), ct.int32)


@_op("argmax")
def argmax(x, /, axis=None, *, keepdims=False, propagate_nan=False):
    return _arg_reduce("ct.argmax", x, axis, keepdims, propagate_nan, largest=True)


@_op("argmin")
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
    x = _require_tile(op, x)
    if not (is_arithmetic(x.dtype) or is_boolean(x.dtype)):
        raise KernelTypeError(f"{op} does not support {x.dtype} tiles")
    if x.dtype is ct.bool_:
        x = astype(x, ct.int32)
    axis = _axis(op, axis, x.ndim)
    t = x._t.movedim(axis, -1)
    if reverse:
        t = t.flip(-1)
    if x.dtype in _NARROW_FLOATS:
        t = _prefix_scan(t, lambda a, b: _to_dtype(fn(a.float(), b.float()), x.dtype), identity)
    else:
        t = torch_fn(t, -1, dtype=t.dtype)
    if reverse:
        t = t.flip(-1)
    return Tile(t.movedim(-1, axis), x.dtype)


@_op("cumsum")
def cumsum(x, /, axis=0, *, reverse=False, rounding_mode=None, flush_to_zero=False):
    _check_rounding("ct.cumsum", rounding_mode)
    return _simple_scan("ct.cumsum", x, axis, reverse, torch.add, torch.cumsum, 0)


@_op("cumprod")
def cumprod(x, /, axis=0, *, reverse=False, rounding_mode=None, flush_to_zero=False):
    _check_rounding("ct.cumprod", rounding_mode)
    return _simple_scan("ct.cumprod", x, axis, reverse, torch.mul, torch.cumprod, 1)


def _tiles_tuple(op, x):
    """`x` as a tuple of tiles, and whether it was a tuple (ct.reduce/ct.scan)."""
    if isinstance(x, tuple):
        return tuple(_require_tile(op, v) for v in x), True
    return (_require_tile(op, x),), False


def _call_combine(op, func, lhs, rhs, is_tuple):
    """Call a user's combine function on tiles and return a tuple of tiles."""
    result = func(*lhs, *rhs) if is_tuple else func(lhs[0], rhs[0])
    result = result if is_tuple else (result,)
    return tuple(_as_tile(r) for r in result)


@_op("reduce")
def reduce(x, /, axis, func, identity, *, keepdims=False):
    op = "ct.reduce"
    xs, is_tuple = _tiles_tuple(op, x)
    axis = _axis(op, axis, xs[0].ndim)
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


@_op("scan")
def scan(x, /, axis, func, identity, *, reverse=False):
    op = "ct.scan"
    xs, is_tuple = _tiles_tuple(op, x)
    identities = identity if is_tuple else (identity,)
    shape = torch.broadcast_shapes(*(v.shape for v in xs))
    axis = _axis(op, axis, len(shape))
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


# ---------------------------------------------------------------------------
# Matrix multiplication
# ---------------------------------------------------------------------------

# Operand dtype -> allowed accumulator dtypes (the table in help(ct.mma)).
_MMA_ACCUMULATORS = {
    ct.float16: (ct.float16, ct.float32),
    ct.bfloat16: (ct.float32,),
    ct.float32: (ct.float32,),
    ct.tfloat32: (ct.float32,),
    ct.float64: (ct.float64,),
    ct.int8: (ct.int32,),
    ct.uint8: (ct.int32,),
}


def _matmul_shape(op, x_shape, y_shape):
    """Broadcast batch dims of (..., M, K) @ (..., K, N); returns (..., M, N)."""
    if x_shape[-1] != y_shape[-2]:
        raise KernelTypeError(
            f"{op}: the K dimensions differ: x has shape {x_shape} (K={x_shape[-1]}) and "
            f"y has shape {y_shape} (K={y_shape[-2]})")
    try:
        batch = tuple(torch.broadcast_shapes(x_shape[:-2], y_shape[:-2]))
    except RuntimeError:
        raise KernelTypeError(f"{op}: batch dimensions of {x_shape} and {y_shape} "
                              "are not broadcastable") from None
    return batch + (x_shape[-2], y_shape[-1])


def _check_mma_dtypes(op, x_dtype, y_dtype, acc_dtype):
    ints = (ct.int8, ct.uint8)
    if x_dtype != y_dtype and not (x_dtype in ints and y_dtype in ints):
        raise KernelTypeError(f"{op}: x and y must have the same dtype, got {x_dtype} and "
                              f"{y_dtype}; convert one with .astype()")
    if x_dtype not in _MMA_ACCUMULATORS:
        raise KernelTypeError(f"{op}: unsupported operand dtype {x_dtype}; supported: "
                              f"{', '.join(str(d) for d in _MMA_ACCUMULATORS)}")
    allowed = _MMA_ACCUMULATORS[x_dtype]
    if acc_dtype not in allowed:
        raise KernelTypeError(f"{op}: {x_dtype} operands need a "
                              f"{' or '.join(str(d) for d in allowed)} accumulator, "
                              f"got {acc_dtype}")


def _mma_product(x, y, acc_dtype):
    """x @ y computed exactly as the hardware sees it: operands as stored, wide sums."""
    if is_integral(acc_dtype):
        out = torch.matmul(x._t.to(torch.int64), y._t.to(torch.int64))
        return out  # wrapped to int32 by the caller's conversion
    wide = torch.float64 if acc_dtype is ct.float64 else torch.float32
    return torch.matmul(x._t.to(wide), y._t.to(wide))


@_op("mma")
def mma(x, y, /, acc, *, use_fast_acc=False):
    op = "ct.mma"
    x, y, acc = (_require_tile(op, v, name) for v, name in ((x, "x"), (y, "y"), (acc, "acc")))
    for v, name in ((x, "x"), (y, "y")):
        if v.ndim not in (2, 3):
            raise KernelTypeError(f"{op}: {name} must be 2-d or 3-d, got shape {v.shape}")
    out_shape = _matmul_shape(op, x.shape, y.shape)
    if acc.shape != out_shape:
        raise KernelTypeError(f"{op}: acc must have shape {out_shape} for x {x.shape} and "
                              f"y {y.shape}, got {acc.shape}")
    _check_mma_dtypes(op, x.dtype, y.dtype, acc.dtype)
    if use_fast_acc:
        raise KernelTypeError(f"{op}: use_fast_acc needs float8 operands")
    product = _mma_product(x, y, acc.dtype)
    out = product + acc._t.to(product.dtype)
    if is_integral(acc.dtype):
        return Tile(out.to(torch.int32), acc.dtype)
    return Tile(_to_dtype(out, acc.dtype), acc.dtype)


@_op("matmul")
def matmul(x, y, /):
    op = "ct.matmul"
    x, y = _require_tile(op, x, "x"), _require_tile(op, y, "y")
    dtype = _promote(op, x, y)
    if dtype not in _MMA_ACCUMULATORS:
        raise KernelTypeError(f"{op}: unsupported dtype {dtype}")
    # 1-d operands are treated as a row (x) or a column (y) and squeezed after.
    x2 = x.reshape((1,) + x.shape) if x.ndim == 1 else x
    y2 = y.reshape(y.shape + (1,)) if y.ndim == 1 else y
    out_shape = _matmul_shape(op, x2.shape, y2.shape)
    acc_dtype = _MMA_ACCUMULATORS[dtype][0]
    product = _mma_product(astype(x2, dtype), astype(y2, dtype), acc_dtype)
    # Round to the accumulator dtype (as mma would), then to the promoted dtype.
    product = product.to(torch.int32) if is_integral(acc_dtype) else _to_dtype(product, acc_dtype)
    result = Tile(_convert(product, acc_dtype, dtype).reshape(out_shape), dtype)
    if x.ndim == 1:
        result = Tile(result._t.squeeze(-2), dtype)
    if y.ndim == 1:
        result = Tile(result._t.squeeze(-1), dtype)
    return result


# ---------------------------------------------------------------------------
# Shape manipulation
# ---------------------------------------------------------------------------

@_op("reshape")
def reshape(x, /, shape):
    op = "ct.reshape"
    x = _as_tile(x)
    shape = _int_tuple(op, shape, "shape")
    known = math.prod(s for s in shape if s != -1)
    numel = x._t.numel()
    if shape.count(-1) > 1 or any(s < -1 for s in shape):
        raise KernelTypeError(f"{op}: bad shape {shape} (at most one -1 allowed)")
    if (-1 in shape and (known == 0 or numel % known)) or (-1 not in shape and known != numel):
        raise KernelTypeError(f"{op}: cannot reshape a tile of shape {x.shape} to {shape}")
    return Tile(x._t.reshape(shape), x.dtype)


@_op("permute")
def permute(x, /, axes):
    op = "ct.permute"
    x = _require_tile(op, x)
    axes = tuple(_axis(op, a, x.ndim) for a in axes)
    if sorted(axes) != list(range(x.ndim)):
        raise KernelTypeError(f"{op}: axes {axes} are not a permutation of {x.ndim} axes")
    return Tile(x._t.permute(axes), x.dtype)


@_op("transpose")
def transpose(x, /, axis0=None, axis1=None):
    op = "ct.transpose"
    x = _require_tile(op, x)
    if x.ndim < 2:
        raise KernelTypeError(f"{op}: cannot transpose a {x.ndim}-d tile")
    if axis0 is None and axis1 is None:
        if x.ndim != 2:
            raise KernelTypeError(f"{op}: give axis0 and axis1 for a {x.ndim}-d tile")
        axis0, axis1 = 0, 1
    elif axis0 is None or axis1 is None:
        raise KernelTypeError(f"{op}: give both axis0 and axis1, or neither")
    return Tile(x._t.transpose(_axis(op, axis0, x.ndim), _axis(op, axis1, x.ndim)), x.dtype)


@_op("expand_dims")
def expand_dims(x, /, axis):
    x = _as_tile(x)
    return Tile(x._t.unsqueeze(_axis("ct.expand_dims", axis, x.ndim + 1)), x.dtype)


@_op("broadcast_to")
def broadcast_to(x, /, shape):
    op = "ct.broadcast_to"
    x = _as_tile(x)
    shape = _int_tuple(op, shape, "shape")
    _check_shape(op, shape)
    try:
        ok = tuple(torch.broadcast_shapes(x.shape, shape)) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise KernelTypeError(f"{op}: cannot broadcast shape {x.shape} to {shape}")
    return Tile(x._t.expand(shape), x.dtype)


@_op("cat")
def cat(tiles, /, axis):
    op = "ct.cat"
    if not isinstance(tiles, (tuple, list)) or not 1 <= len(tiles) <= 2:
        raise KernelTypeError(f"{op} takes a tuple of one or two tiles")
    tiles = [_require_tile(op, t) for t in tiles]
    first = tiles[0]
    axis = _axis(op, axis, first.ndim)
    for t in tiles[1:]:
        if t.dtype != first.dtype:
            raise KernelTypeError(f"{op}: tiles must have the same dtype, got {first.dtype} "
                                  f"and {t.dtype}")
        same = [n for d, n in enumerate(t.shape) if d != axis]
        if t.ndim != first.ndim or same != [n for d, n in enumerate(first.shape) if d != axis]:
            raise KernelTypeError(f"{op}: shapes {first.shape} and {t.shape} differ outside "
                                  f"axis {axis}")
    out = torch.cat([t._t for t in tiles], dim=axis)
    _check_shape(op, out.shape)
    return Tile(out, first.dtype)


def _subtile_slices(op, x, index, shape):
    index = _int_tuple(op, index, "index")
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


@_op("extract")
def extract(x, /, index, shape):
    op = "ct.extract"
    x = _require_tile(op, x)
    shape = _int_tuple(op, shape, "shape")
    if len(shape) not in (0, x.ndim):
        raise KernelTypeError(f"{op}: shape {shape} does not match the tile rank {x.ndim}")
    _check_shape(op, shape)
    slices = _subtile_slices(op, x, index, shape or (1,) * x.ndim)
    return Tile(x._t[slices].reshape(shape), x.dtype)


@_op("insert")
def insert(x, /, index, value):
    op = "ct.insert"
    x, value = _require_tile(op, x), _require_tile(op, value, "value")
    if value.dtype != x.dtype:
        raise KernelTypeError(f"{op}: cannot insert a {value.dtype} tile into a {x.dtype} tile")
    data = value._t.reshape((1,) * x.ndim) if value.ndim == 0 else value._t
    if data.dim() != x.ndim:
        raise KernelTypeError(f"{op}: value rank {value.ndim} does not match tile rank {x.ndim}")
    out = x._t.clone()
    out[_subtile_slices(op, x, index, data.shape)] = data
    return Tile(out, x.dtype)


@_op("Tile.item")
def _tile_item(self):
    return self.item()


# ---------------------------------------------------------------------------
# Compile-time helpers, hints and debugging
# ---------------------------------------------------------------------------

@_op("static_eval", "ensure_constant")
def static_eval(expr, /):
    # Python has already evaluated the argument; there is nothing more to do.
    return expr


@_op("static_assert")
def static_assert(condition, message=None, /):
    if not condition:
        raise KernelAssertionError(f"static assertion failed: {'' if message is None else message}")


@_op("assume_divisible_by")
def assume_divisible_by(x, divisor):
    # A false promise is undefined behaviour on the GPU, so check it here.
    if int(x) % divisor:
        raise KernelValueError(f"ct.assume_divisible_by: {int(x)} is not divisible by {divisor}")
    return x


@_op("assert_")
def assert_(cond, /, message=None):
    cond = _require_tile("ct.assert_", cond)
    if not bool(torch.all(cond._t)):
        raise KernelAssertionError(f"ct.assert_ failed: {message or ''}")


@_op("print")
def print_(*args, sep=" ", end="\n"):
    builtins.print(*args, sep=sep, end=end)


_PRINTF_SPEC = re.compile(r"%([-+ #0]*\d*(?:\.\d+)?)(?:hh|h|ll|l|z|j|t|L)?([diuoxXeEfFgGaA%])")


@_op("printf")
def printf(format, *args):
    """C printf: each conversion formats one tile, element by element."""
    values = iter(args)

    def convert(match):
        flags, conversion = match.groups()
        if conversion == "%":
            return "%"
        tile = _as_tile(next(values))
        spec = "%" + flags + {"i": "d", "u": "d", "a": "e", "A": "E"}.get(conversion, conversion)
        return _format_nested(tile._t.tolist(), lambda v: spec % v)

    sys.stdout.write(_PRINTF_SPEC.sub(convert, format))


# ---------------------------------------------------------------------------
# Launching a kernel
# ---------------------------------------------------------------------------

class _Interpreter(DispatchMode):
    """cuTile dispatch mode active while a kernel runs on the CPU.

    cuTile's stubs call `call_tile_function_from_host` with themselves as
    `func`; we answer with the emulation registered for that stub.
    """

    def __init__(self, grid):
        self.grid = grid
        self.block = (0, 0, 0)

    def call_tile_function_from_host(self, func, args, kwargs):
        if getattr(func, "_cutile_python_stub", None) is None:
            # A user helper decorated with @ct.function: run its Python body.
            return func.__wrapped__(*args, **kwargs)
        emulation = None
        if func.__module__ == "cuda.tile._stub":
            emulation = _OPS.get(func.__qualname__)
        if emulation is None:
            raise UnsupportedOperation(
                f"ct.{func.__qualname__} is not supported by the CPU interpreter")
        return emulation(*args, **kwargs)


def is_interpreting():
    """True while a kernel runs inside the CPU interpreter (on this thread)."""
    return isinstance(DispatchMode.get_current(), _Interpreter)


@functools.lru_cache(maxsize=None)
def _parameter_kinds(pyfunc):
    """For each parameter: "constant", or the cuTile dtype its scalars take."""
    hints = typing.get_type_hints(pyfunc, include_extras=True)
    kinds = []
    for name in pyfunc.__code__.co_varnames[:pyfunc.__code__.co_argcount]:
        metadata = getattr(hints.get(name), "__metadata__", ())
        if any(isinstance(m, ConstantAnnotation) for m in metadata):
            kinds.append("constant")
        else:
            scalar = [m.dtype for m in metadata if isinstance(m, ScalarAnnotation)]
            kinds.append(scalar[0] if scalar else None)
    return tuple(kinds)


def _kernel_argument(value, scalar_dtype):
    """Turn a host-side launch argument into what the kernel sees."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"the CPU interpreter needs CPU tensors, got one on {value.device}")
        return Array(value)
    if isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        # A float argument is a float32 value on the GPU (promotion cares).
        dtype = scalar_dtype or ct.float32
        return Tile(_to_dtype(torch.tensor(value, dtype=_compute(dtype)), dtype), dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_kernel_argument(v, scalar_dtype) for v in value)
    raise TypeError(f"unsupported kernel argument of type {type(value).__name__}")


def _normalize_grid(grid):
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    if not 1 <= len(grid) <= 3 or not all(isinstance(g, int) and g > 0 for g in grid):
        raise ValueError(f"grid must be 1 to 3 positive ints, got {grid}")
    return grid + (1,) * (3 - len(grid))


def launch(grid, kernel, args):
    """Run a ``@ct.kernel`` on CPU tensors, block by block, in the calling thread.

    Arguments mirror ``ct.launch(stream, grid, kernel, args)`` without the
    stream.  Array arguments must be CPU tensors; results are written into
    them in place.
    """
    if not isinstance(kernel, ct.kernel):
        raise TypeError(f"expected a @ct.kernel, got {type(kernel).__name__}")
    grid = _normalize_grid(grid)
    pyfunc = kernel._pyfunc
    kinds = _parameter_kinds(pyfunc)
    if len(args) > len(kinds):
        raise TypeError(f"{pyfunc.__name__} takes {len(kinds)} arguments, got {len(args)}")
    call_args = [value if kind == "constant" else _kernel_argument(value, kind)
                 for value, kind in zip(args, kinds)]
    mode = _Interpreter(grid)
    with torch.no_grad(), mode.as_current():
        for z in range(grid[2]):
            for y in range(grid[1]):
                for x in range(grid[0]):
                    mode.block = (x, y, z)
                    try:
                        pyfunc(*call_args)
                    except Exception as e:
                        if hasattr(e, "add_note"):  # Python >= 3.11
                            e.add_note(f"(CPU interpreter: block {mode.block} of grid {grid})")
                        raise
