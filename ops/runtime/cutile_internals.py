"""Every private name of cuda.tile that this project uses, behind small documented functions.

cuTile's public API covers writing, compiling and launching kernels.  The CPU interpreter
(``ops.interpreter``) and the kernel tools need a little more: the Python function behind a
``@ct.kernel``, the compiler options it was declared with, the hook through which the ``ct.*``
stubs are dispatched, and cuTile's dtype predicates and promotion table.  Those live in
cuda.tile's private modules, which may change in any release, so they are reached from this
module only, and it refuses a cuda-tile outside the range it was written against.

Exports:

* `check_version(version)`: raises ImportError unless cuda-tile `version` is supported; it is
  called at import with the installed ``cuda.tile.__version__``.
* `kernel_function(kernel)`: the Python function a ``@ct.kernel`` was made from.
* `kernel_hints(kernel)`: the compiler options (``occupancy=``, ...) set on a kernel, as a dict
  that ``ct.kernel(function, **hints)`` accepts.
* `DispatchMode`: the base class of cuTile's dispatch modes.  A stub (``ct.load``, ...) called
  outside the compiler asks ``DispatchMode.get_current()`` to run it through
  ``call_tile_function_from_host(func, args, kwargs)``; ``mode.as_current()`` installs a mode.
* `is_stub(func)`, `stub_name(func)` and `stub_module`: which functions are cuTile's API stubs,
  and their names in the stub module (``"load"``, ``"Tile.item"``).
* `ScalarAnnotation`: the metadata of scalar kernel parameters (``x: ct.Scalar[ct.float16]``).
* `is_arithmetic`, `is_boolean`, `is_float`, `is_integral`, `is_signed`: predicates on cuTile
  dtypes; `promote_dtypes(a, b, force_float=False)`: cuTile's promotion table (raises
  ``ct.TileError`` for pairs it does not promote implicitly).
* `constant_float(value, dtype)`: the value a Python number takes as a constant of float dtype
  `dtype` in compiled code, computed by the compiler's own encoder: one rounding to nearest
  even from the Python float (torch's float64 -> bfloat16 / float16 conversions round twice,
  through float32), overflow to inf, or to NaN in float8_e4m3fn, which has no infinity.
"""

import importlib
import re

import cuda.tile as ct

SUPPORTED_RANGE = ">=1.7,<1.8"
_MINIMUM, _LIMIT = (1, 7), (1, 8)


def check_version(version):
    """Raise ImportError unless cuda-tile `version` (a string such as "1.7.0") is supported."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or not _MINIMUM <= tuple(map(int, match.groups())) < _LIMIT:
        raise ImportError(
            f"cuda-tile {version} is installed, but this project supports cuda-tile "
            f"{SUPPORTED_RANGE} only: it relies on cuTile internals (the CPU interpreter's "
            f"dispatch hook, kernel attributes) that change between releases. Install a "
            f"supported version: pip install 'cuda-tile{SUPPORTED_RANGE}'")


check_version(ct.__version__)

# What only the CPU interpreter needs is imported on first use (after the version check): the GPU
# path (kernel_function, kernel_hints) then depends on no private module of cuda.tile.
_LAZY = {
    "stub_module": ("cuda.tile._stub", None),
    "ScalarAnnotation": ("cuda.tile._stub", "ScalarAnnotation"),
    "DispatchMode": ("cuda.tile._dispatch_mode", "DispatchMode"),
    **{name: ("cuda.tile._datatype", name) for name in (
        "is_arithmetic", "is_boolean", "is_float", "is_integral", "is_signed", "promote_dtypes")},
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    value = importlib.import_module(module_name)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value          # later look-ups find it directly
    return value


def constant_float(value, dtype):
    """The value of Python number ``value`` as a compiled constant of float dtype ``dtype``."""
    from cuda.tile._bytecode.float import float_from_bits, float_to_bits
    from cuda.tile._datatype import dtype_simple_bytecode_type
    simple = dtype_simple_bytecode_type(dtype)
    return float_from_bits(float_to_bits(float(value), simple), simple)


def _require_kernel(kernel):
    if not isinstance(kernel, ct.kernel):
        raise TypeError(f"expected a @ct.kernel, got {type(kernel).__name__}")
    return kernel


def kernel_function(kernel):
    """The Python function behind a ``@ct.kernel``: its code, globals, annotations, source."""
    return _require_kernel(kernel)._pyfunc


def kernel_hints(kernel):
    """The compiler options set on a ``@ct.kernel`` (those not None), e.g. {"opt_level": 3}."""
    options = vars(_require_kernel(kernel)._compiler_options)
    return {name: value for name, value in options.items() if value is not None}


def is_stub(func):
    """True for a cuTile API stub (``ct.load``, ...), False for a ``@ct.function`` helper."""
    return getattr(func, "_cutile_python_stub", None) is not None


def stub_name(func):
    """The name of API stub `func` in `stub_module` ("load", "Tile.item"), or None for a stub
    defined elsewhere in cuda.tile."""
    return func.__qualname__ if func.__module__ == __getattr__("stub_module").__name__ else None
