"""Elementwise operations: arithmetic, comparisons, bit operations, math, conversions.

The many operations that differ only in the torch function computing them
are registered from the tables below (cuTile name -> torch function); the
others are written out.
"""

import torch

import cuda.tile as ct
from cuda.tile import RoundingMode

from ops.runtime.cutile_internals import is_arithmetic, is_boolean, is_float, is_integral
from .arguments import (
    as_tile,
    broadcast_error,
    check_rounding,
    elementwise,
    operand,
    promote,
)
from .dtypes import convert, dtype_of_scalar, require_dtype, storage, to_dtype
from .errors import KernelTypeError, UnsupportedOperation
from .registry import OPS, emulates
from .values import Tile


def _arith(op, fn, x, y, force_float=False):
    dtype = promote(op, x, y, force_float)
    for v in (x, y):
        if isinstance(v, Tile) and not is_arithmetic(v.dtype):
            raise KernelTypeError(f"{op} does not support {v.dtype} tiles")
    if dtype is ct.bool_:
        raise KernelTypeError(f"{op} does not support bool; cast with .astype(ct.int32)")
    return elementwise(op, fn, (x, y), dtype)


def _compare(op, fn, x, y):
    return elementwise(op, fn, (x, y), promote(op, x, y), result_dtype=ct.bool_)


def _bitwise(op, fn, x, y, shift=False):
    dtypes = [v.dtype if isinstance(v, Tile) else dtype_of_scalar(v) for v in (x, y)]
    allowed = is_integral if shift else (lambda d: is_integral(d) or is_boolean(d))
    if not all(allowed(d) for d in dtypes):
        what = "integers" if shift else "integers or booleans"
        raise KernelTypeError(f"{op} needs {what}, got {dtypes[0]} and {dtypes[1]}")
    both_tiles = isinstance(x, Tile) and isinstance(y, Tile)
    if not shift and both_tiles and x.dtype != y.dtype:
        raise KernelTypeError(f"{op}: operands must have the same dtype, "
                              f"got {x.dtype} and {y.dtype}")
    return elementwise(op, fn, (x, y), promote(op, x, y))


def _shift(op, fn, x, y):
    return _bitwise(op, fn, x, y, shift=True)


# Unary operations.  on_int / on_bool / on_float say what a tile of that kind
# becomes before the operation: True keeps its dtype, "float" converts it to
# float32 (ct.exp of an int tile), "int" to int32 (-bool), None rejects it.

def _unary(op, fn, x, *, on_int="float", on_bool=None, on_float=True):
    x = as_tile(x)
    dtype = x.dtype
    rule = on_bool if is_boolean(dtype) else on_int if is_integral(dtype) else on_float
    if rule is None or not (is_arithmetic(dtype) or is_boolean(dtype)):
        raise KernelTypeError(f"{op} does not support {dtype} tiles")
    if rule == "float":
        dtype = ct.float32
    elif rule == "int":
        dtype = ct.int32
    return elementwise(op, fn, (x,), dtype)


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


# ---------------------------------------------------------------------------
# Operations registered from tables: ct.<name> -> torch function
# ---------------------------------------------------------------------------

# ct.<name>(x, y, /, *, rounding_mode=None, flush_to_zero=False).
_ROUNDED_ARITHMETIC = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
}

# ct.<name>(x, y, /), each table with the function that checks the operands,
# promotes them and applies the torch function.
_BINARY = [
    (_arith, {"floordiv": _floordiv, "mod": _mod}),
    (_compare, {  # the result is a bool tile
        "equal": torch.eq,
        "not_equal": torch.ne,
        "less": torch.lt,
        "less_equal": torch.le,
        "greater": torch.gt,
        "greater_equal": torch.ge,
    }),
    (_bitwise, {  # both operands of one dtype, integer or bool
        "bitwise_and": torch.bitwise_and,
        "bitwise_or": torch.bitwise_or,
        "bitwise_xor": torch.bitwise_xor,
    }),
    (_shift, {  # integers; right shifts are arithmetic for signed types, as in torch
        "bitwise_lshift": torch.bitwise_left_shift,
        "bitwise_rshift": torch.bitwise_right_shift,
    }),
]

# ct.<name>(x, /, *, rounding_mode=None, flush_to_zero=False): float-only
# math; int and bool tiles are converted to float32 first.
_FLOAT_MATH = {
    "exp": torch.exp,
    "exp2": torch.exp2,
    "log": torch.log,
    "log2": torch.log2,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "sin": torch.sin,
    "cos": torch.cos,
    "tan": torch.tan,
    "sinh": torch.sinh,
    "cosh": torch.cosh,
    "tanh": torch.tanh,
}

# ct.<name>(x, /) of float tiles only (integer tiles are rejected).
_ROUND_TO_INTEGRAL = {
    "floor": torch.floor,
    "ceil": torch.ceil,
}


def _rounded_arithmetic(name, fn):
    op = f"ct.{name}"

    def emulation(x, y, /, *, rounding_mode=None, flush_to_zero=False):
        check_rounding(op, rounding_mode)
        return _arith(op, fn, x, y)
    return emulation


def _binary(name, fn, apply):
    op = f"ct.{name}"

    def emulation(x, y, /):
        return apply(op, fn, x, y)
    return emulation


def _float_math(name, fn):
    op = f"ct.{name}"

    def emulation(x, /, *, rounding_mode=None, flush_to_zero=False):
        check_rounding(op, rounding_mode)
        return _unary(op, fn, x, on_int="float", on_bool="float")
    return emulation


def _round_to_integral(name, fn):
    op = f"ct.{name}"

    def emulation(x, /):
        return _unary(op, fn, x, on_int=None)
    return emulation


def _register(name, emulation):
    emulation.__name__ = emulation.__qualname__ = name
    emulates(name)(emulation)


for _name, _fn in _ROUNDED_ARITHMETIC.items():
    _register(_name, _rounded_arithmetic(_name, _fn))
for _apply, _table in _BINARY:
    for _name, _fn in _table.items():
        _register(_name, _binary(_name, _fn, _apply))
for _name, _fn in _FLOAT_MATH.items():
    _register(_name, _float_math(_name, _fn))
for _name, _fn in _ROUND_TO_INTEGRAL.items():
    _register(_name, _round_to_integral(_name, _fn))
del _name, _fn, _apply, _table


# ---------------------------------------------------------------------------
# Binary operations written out
# ---------------------------------------------------------------------------

@emulates("truediv")
def truediv(x, y, /, *, rounding_mode=None, flush_to_zero=False):
    # Integer operands give float32, as in Python 3 and cuTile.
    check_rounding("ct.truediv", rounding_mode)
    return _arith("ct.truediv", torch.div, x, y, force_float=True)


@emulates("divmod")
def divmod_(x, y, /):
    if is_float(promote("divmod", x, y)):
        raise KernelTypeError("divmod() is not implemented for floating point values")
    return OPS["floordiv"](x, y), OPS["mod"](x, y)


@emulates("pow")
def pow_(x, y, /):
    # A float tile to an integer power keeps the tile's dtype (cuTile's fpowi).
    exponent_is_int = (isinstance(y, int) and not isinstance(y, bool)) or (
        isinstance(y, Tile) and is_integral(y.dtype))
    if isinstance(x, Tile) and is_float(x.dtype) and is_arithmetic(x.dtype) and exponent_is_int:
        exponent = y._t if isinstance(y, Tile) else y
        try:
            out = torch.pow(operand(x, x.dtype), exponent)
        except RuntimeError:
            raise broadcast_error("ct.pow", (x, y)) from None
        return Tile(to_dtype(out, x.dtype), x.dtype)
    return _arith("ct.pow", torch.pow, x, y)


@emulates("atan2")
def atan2(x1, x2, /):
    if not is_float(promote("ct.atan2", x1, x2)):
        raise KernelTypeError("ct.atan2 needs floating-point operands")
    return _arith("ct.atan2", torch.atan2, x1, x2)


def _min_max(op, nan_ignoring, nan_propagating, x, y, propagate_nan):
    dtype = promote(op, x, y)
    fn = nan_propagating if propagate_nan or not is_float(dtype) else nan_ignoring
    return _arith(op, fn, x, y)


@emulates("minimum")
def minimum(x, y, /, *, flush_to_zero=False, propagate_nan=False):
    # By default a NaN operand is ignored (fmin), as cuTile's default.
    return _min_max("ct.minimum", torch.fmin, torch.minimum, x, y, propagate_nan)


@emulates("maximum")
def maximum(x, y, /, *, flush_to_zero=False, propagate_nan=False):
    return _min_max("ct.maximum", torch.fmax, torch.maximum, x, y, propagate_nan)


@emulates("where")
def where(cond, x, y, /):
    op = "ct.where"
    condition = operand(as_tile(cond), ct.bool_)
    dtype = promote(op, x, y)
    try:
        out = torch.where(condition, operand(x, dtype), operand(y, dtype))
    except RuntimeError:
        raise broadcast_error(op, (as_tile(cond), x, y)) from None
    return Tile(to_dtype(out, dtype), dtype)


# ---------------------------------------------------------------------------
# Unary operations written out
# ---------------------------------------------------------------------------

@emulates("abs")
def abs_(x, /):
    x = as_tile(x)
    if x.dtype is ct.bool_:
        return x  # torch has no abs for bool; it is the identity anyway
    return _unary("ct.abs", torch.abs, x, on_int=True)


@emulates("negative")
def negative(x, /):
    return _unary("ct.negative", torch.neg, x, on_int=True, on_bool="int")


@emulates("bitwise_not")
def bitwise_not(x, /):
    return _unary("ct.bitwise_not", torch.bitwise_not, x, on_int=True, on_bool=True,
                  on_float=None)


@emulates("isnan")
def isnan(x, /):
    x = as_tile(x)
    if not is_float(x.dtype):
        raise KernelTypeError(f"ct.isnan needs a floating-point tile, got {x.dtype}")
    return Tile(torch.isnan(x._t), ct.bool_)


# ---------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------

@emulates("astype")
def astype(x, dtype, /, *, rounding_mode=None):
    op = "astype"
    x = as_tile(x)
    dtype = require_dtype(op, dtype)
    if rounding_mode is not None:
        if not (is_float(x.dtype) and is_float(dtype)):
            raise KernelTypeError(f"{op}: rounding_mode is only valid for float to float "
                                  "conversions")
        if rounding_mode is not RoundingMode.RN:
            raise UnsupportedOperation(f"{op}: rounding_mode={rounding_mode} is not supported "
                                       "by the CPU interpreter")
    return Tile(convert(x._t, x.dtype, dtype), dtype)


@emulates("bitcast")
def bitcast(x, /, dtype):
    op = "ct.bitcast"
    x = as_tile(x)
    dtype = require_dtype(op, dtype)
    if ct.bool_ in (x.dtype, dtype) or ct.tfloat32 in (x.dtype, dtype):
        raise KernelTypeError(f"{op}: cannot bitcast between {x.dtype} and {dtype}")
    if x.dtype.bitwidth != dtype.bitwidth:
        raise KernelTypeError(f"{op}: {x.dtype} and {dtype} have different bit widths")
    return Tile(x._t.view(storage(dtype)), dtype)


@emulates("cdiv")
def cdiv(x, y, /):
    # cuTile's own definition, which also holds for Python ints on the host.
    return -((-x) // y)
