"""Python's builtin functions applied to tiles, as cuTile's compiler treats them.

The compiler resolves a kernel's names in its globals, then its builtins,
and has its own implementation for a few builtins (cuda-tile 1.7: the
``tile_impl_registry`` of ``cuda.tile._ir.ops``).  On tiles, the ones that
matter are

* ``max(x, y)`` / ``min(x, y)``: exactly two arguments, elementwise with
  broadcasting and dtype promotion, i.e. ``ct.maximum`` / ``ct.minimum``;
* ``abs(x)``: ``ct.abs``; ``divmod(x, y)``: ``ct.divmod`` (integers only);
* ``bool(x)`` of a scalar tile; ``print`` (see `debug`), ``len`` of tuples
  and lists, ``range``, ``int``/``float`` of constants.

Every other builtin function is "not supported in tile code".

Names are looked up by the running Python code, so the interpreter
replaces the functions below in the `builtins` module for the duration of
`launch` (a plain function cannot get other builtins without being copied,
and helpers in other modules must see them too).  A replacement behaves
exactly like the original unless the calling thread is interpreting a
kernel and one of its arguments is a tile or array: host code, torch and
the interpreter itself are unaffected.  ``abs`` needs no replacement
(``Tile.__abs__`` is ``ct.abs``), nor do the builtins that are types
(``int``, ``float``, ``bool`` go through ``Tile.__int__``, ...).
"""

import builtins
import contextlib
import threading

from ops.runtime.cutile_internals import DispatchMode
from .errors import KernelTypeError
from .registry import OPS, InterpreterMode
from .values import Array, Tile

_ORIGINAL = {name: getattr(builtins, name)
             for name in ("max", "min", "divmod", "pow", "round", "sum", "any", "all", "sorted")}


def _interpreting():
    return isinstance(DispatchMode.get_current(), InterpreterMode)


def _involves_tiles(args):
    """True if an argument, or an element of a tuple/list argument, is a Tile or Array."""
    for a in args:
        if isinstance(a, (Tile, Array)):
            return True
        if isinstance(a, (tuple, list)) and _ORIGINAL["any"](isinstance(v, (Tile, Array))
                                                             for v in a):
            return True
    return False


def _materialized(args):
    """The arguments with iterators (generator expressions, ``map``, ``iter(...)``) turned into
    lists while a kernel runs, so that tiles inside them are seen: ``sum(t for t in tiles)`` is
    refused like ``sum(tiles)``. Only for the builtins that consume their iterable whole anyway
    (max, min, sum, sorted); any and all stop early, so they check lazily (`_lazily_checked`)."""
    # (the original any: the replacement would call back into this function)
    if not _ORIGINAL["any"](hasattr(a, "__next__") for a in args) or not _interpreting():
        return args
    return tuple(list(a) if hasattr(a, "__next__") else a for a in args)


def _lazily_checked(name, hint, iterable):
    """``iterable``'s items one by one, refusing a tile or array when it comes (any and all keep
    their short-circuit: items after the deciding one are never made)."""
    for item in iterable:
        if isinstance(item, (Tile, Array)):
            raise KernelTypeError(f"{name}() is not supported in tile code{hint}")
        yield item


def _min_max(name, emulation):
    original = _ORIGINAL[name]

    def replacement(*args, **kwargs):
        args = _materialized(args)
        if not (_involves_tiles(args) and _interpreting()):
            return original(*args, **kwargs)
        # The compiler's signature is (x, y, /): no iterable, no key=, no default=.
        if len(args) != 2 or kwargs:
            raise KernelTypeError(
                f"{name}() in tile code takes exactly two positional arguments (tiles or "
                f"scalars); use ct.{'maximum' if name == 'max' else 'minimum'} to combine "
                f"more, or ct.{name}(t, axis) to reduce a tile")
        return OPS[emulation](*args)

    return replacement


def _divmod(x, y):
    if not (_involves_tiles((x, y)) and _interpreting()):
        return _ORIGINAL["divmod"](x, y)
    return OPS["divmod"](x, y)


def _unsupported(name, hint, lazy=False):
    original = _ORIGINAL[name]

    def replacement(*args, **kwargs):
        if lazy and len(args) == 1 and hasattr(args[0], "__next__") and _interpreting():
            return original(_lazily_checked(name, hint, args[0]), **kwargs)
        args = args if lazy else _materialized(args)
        if not (_involves_tiles(args) and _interpreting()):
            return original(*args, **kwargs)
        raise KernelTypeError(f"{name}() is not supported in tile code{hint}")

    return replacement


_REPLACEMENTS = {
    "max": _min_max("max", "maximum"),
    "min": _min_max("min", "minimum"),
    "divmod": _divmod,
    "pow": _unsupported("pow", "; use x ** y or ct.pow(x, y)"),
    "round": _unsupported("round", "; convert with .astype() (rounds to nearest even for "
                                   "float to float, truncates for float to int)"),
    "sum": _unsupported("sum", "; use ct.sum(t, axis) or +"),
    "any": _unsupported("any", "; reduce with ct.max() of a bool tile, or ct.reduce", lazy=True),
    "all": _unsupported("all", "; reduce with ct.min() of a bool tile, or ct.reduce", lazy=True),
    "sorted": _unsupported("sorted", ""),
}

_lock = threading.Lock()
_active = 0


@contextlib.contextmanager
def tile_builtins():
    """Install the replacements while a launch runs (nesting and threads are counted).

    They are installed in Python's ``builtins`` module, so for the launch's duration the whole
    process sees them: each behaves exactly as the original unless the calling thread is
    running a kernel and an argument is a tile or array, but it is another object (it does not
    pickle, and identity checks against the original fail). On the way out only the names that
    still hold a replacement are restored: a name patched by someone else meanwhile is left."""
    global _active
    with _lock:
        if _active == 0:
            for name, fn in _REPLACEMENTS.items():
                setattr(builtins, name, fn)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                for name, fn in _ORIGINAL.items():
                    if getattr(builtins, name) is _REPLACEMENTS.get(name):
                        setattr(builtins, name, fn)
