"""The values an interpreted kernel handles: tiles and kernel arrays."""

import torch

import cuda.tile as ct

from ops.runtime.cutile_internals import is_boolean, is_float, is_integral
from .dtypes import CT_DTYPE
from .errors import KernelTypeError, UnsupportedOperation
from .registry import OPS

ORDINARY = (bool, int, float)


class _TensorValue:
    """A torch tensor (`_t`) seen as a cuTile value of `dtype`: what tiles and arrays share."""

    __slots__ = ("_t", "dtype")

    @property
    def shape(self):
        return tuple(self._t.shape)

    @property
    def ndim(self):
        return self._t.dim()


class Tile(_TensorValue):
    """An immutable tile: a torch tensor (`_t`) plus its cuTile dtype.

    `_t` always has the storage dtype of `dtype` (see `dtypes.TORCH_DTYPE`).
    Operators follow cuTile: ``a + b`` broadcasts and promotes, comparisons
    give bool tiles, ``t[None, :]`` inserts an axis.  The methods and
    operators call the emulations in `registry.OPS`.
    """

    __slots__ = ()

    def __init__(self, tensor, dtype):
        self._t = tensor
        self.dtype = dtype

    # -- methods of ct.Tile (shape and ndim come from _TensorValue) -------
    def item(self):
        if self._t.numel() != 1:
            raise KernelTypeError(f"item() needs a tile with one element, got shape {self.shape}")
        return Tile(self._t.reshape(()), self.dtype)

    def astype(self, dtype, *, rounding_mode=None):
        return OPS["astype"](self, dtype, rounding_mode=rounding_mode)

    def reshape(self, shape):
        return OPS["reshape"](self, shape)

    def permute(self, axes):
        return OPS["permute"](self, axes)

    def transpose(self, axis0=None, axis1=None):
        return OPS["transpose"](self, axis0, axis1)

    def extract(self, index, shape):
        return OPS["extract"](self, index, shape)

    def insert(self, index, value):
        return OPS["insert"](self, index, value)

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
                "Python's if/while/and/or need a single element; use ct.where (or "
                "min()/max(), which are elementwise on tiles) for elementwise choices")
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
        return format_nested(values, lambda v: format(v, spec))

    def __str__(self):
        return self.__format__("")

    def __repr__(self):
        return f"Tile[{self.dtype}, {self.shape}]\n{self._t}"

    # -- unary operators (the binary ones are added below the class) ------
    def __neg__(self):
        return OPS["negative"](self)

    def __pos__(self):
        return OPS["astype"](self, ct.int32) if self.dtype is ct.bool_ else self

    def __abs__(self):
        return OPS["abs"](self)

    def __invert__(self):
        return OPS["bitwise_not"](self)

    __hash__ = None


# Python's binary operators -> the cuTile operation each one is.  Each also
# gets its reflected form: __add__ and __radd__ are both ct.add.
_BINARY_OPERATORS = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "truediv": "truediv",
    "floordiv": "floordiv",
    "mod": "mod",
    "divmod": "divmod",
    "pow": "pow",
    "and": "bitwise_and",
    "or": "bitwise_or",
    "xor": "bitwise_xor",
    "lshift": "bitwise_lshift",
    "rshift": "bitwise_rshift",
    "matmul": "matmul",
}

# Comparisons have no reflected forms: Python swaps ``3 < t`` into ``t > 3``.
_COMPARISON_OPERATORS = {
    "lt": "less",
    "le": "less_equal",
    "gt": "greater",
    "ge": "greater_equal",
    "eq": "equal",
    "ne": "not_equal",
}


def _operator(method, name, reflected):
    """Tile.<method>: ct.<name>(self, other), or ct.<name>(other, self) if `reflected`."""
    def apply(self, other):
        x, y = (other, self) if reflected else (self, other)
        # Apply the operation if both operands are tiles or Python scalars,
        # else let Python try the other operand's method.
        if not isinstance(x, (Tile,) + ORDINARY) or not isinstance(y, (Tile,) + ORDINARY):
            return NotImplemented
        return OPS[name](x, y)
    apply.__name__, apply.__qualname__ = method, f"Tile.{method}"
    return apply


for _python, _cutile in _BINARY_OPERATORS.items():
    for _method, _reflected in ((f"__{_python}__", False), (f"__r{_python}__", True)):
        setattr(Tile, _method, _operator(_method, _cutile, _reflected))
for _python, _cutile in _COMPARISON_OPERATORS.items():
    setattr(Tile, f"__{_python}__", _operator(f"__{_python}__", _cutile, False))
del _python, _cutile, _method, _reflected


def format_nested(values, fmt):
    """Nested lists of Python numbers as "[a, b, ...]", each number formatted by `fmt`."""
    if isinstance(values, list):
        return "[" + ", ".join(format_nested(v, fmt) for v in values) + "]"
    return fmt(values)


class Array(_TensorValue):
    """A kernel array argument: a CPU torch tensor seen through cuTile's Array API."""

    __slots__ = ()

    def __init__(self, tensor):
        if tensor.dtype not in CT_DTYPE:
            raise UnsupportedOperation(
                f"arrays of {tensor.dtype} are not supported by the CPU interpreter")
        self._t = tensor
        self.dtype = CT_DTYPE[tensor.dtype]

    @property
    def strides(self):
        return tuple(self._t.stride())

    # Views: emulated in `views` (registered there under these names).
    def slice(self, axis, start, stop):
        return OPS["Array.slice"](self, axis, start, stop)

    def tiled_view(self, tile_shape, **kwargs):
        return OPS["Array.tiled_view"](self, tile_shape, **kwargs)

    # Raw memory (offset loads, stores and atomics): emulated in `rawmemory`.
    def get_raw_memory(self):
        return OPS["Array.get_raw_memory"](self)

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
