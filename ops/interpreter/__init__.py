"""A CPU interpreter for cuTile kernels.

`launch(grid, kernel, args)` runs a ``@ct.kernel`` on CPU torch tensors, one
block after another, with every ``cuda.tile`` operation emulated in torch.
It exists so that a kernel can be read, stepped through with ``pdb``,
``print``-debugged and unit-tested on a machine without a GPU.

How the kernel's ``ct.*`` calls reach this package
--------------------------------------------------
Every public cuTile operation (``ct.load``, ``ct.mma``, ...) is a *stub*: a
Python function whose body does nothing, wrapped so that calling it asks
cuTile's current *dispatch mode* what to do.  Outside a compiler the mode is
"refuse" ("device functions can only be called from device code"); the
compiler installs its own mode while it traces a kernel.  The interpreter
installs a third mode, `runner.Interpreter`, whose answer is "run the torch
emulation registered under that operation's name in `registry.OPS`".

We call the kernel's own Python function (``kernel_function(kernel)``)
directly inside that mode.  Compared with copying the function and swapping
its globals, this

* runs the exact object that is launched on the GPU: line numbers,
  tracebacks, ``breakpoint()``, closures and default arguments are simply
  the kernel's own;
* needs no bookkeeping for helper functions, whether they are plain
  functions, ``@ct.function`` helpers, imported with ``from cuda.tile
  import load`` or reached through another module;
* fails loudly for operations we do not emulate: the stub still calls us
  and we raise ``NotImplementedError`` naming it.

The price is that the hook (the dispatch mode) is internal to cuTile; like
every other private name of cuda.tile it is reached through
``ops.runtime.cutile_internals``, which accepts cuda-tile 1.7 only.

Modules
-------
* `registry`: the operation table ``OPS`` (stub name -> emulation) and the
  ``@emulates("name")`` decorator every operation module registers with;
* `errors`: `KernelError` and its subclasses, whose messages start with the
  kernel's source line;
* `dtypes`: how each cuTile dtype is stored in torch, rounding and
  conversion, scalar promotion;
* `values`: `Tile` (with its operators) and `Array`;
* `arguments`: checking and converting the operations' arguments, tile
  promotion, the shared elementwise driver;
* `memory`: ``load``, ``store``, ``num_tiles``; `indexing`: ``gather``, ``scatter``,
  ``Slice``, ``load_advanced_indexing``, ``store_advanced_indexing``; `creation`: ``full``,
  ``zeros``, ``ones``, ``arange``, ``astile``;
* `arithmetic`: elementwise arithmetic, comparisons, bit operations,
  ``where``, unary math, ``astype`` and ``bitcast``;
* `reductions`: reductions and scans, ``reduce`` and ``scan``;
* `mma`: ``mma`` and ``matmul``; `shapes`: reshaping, permuting,
  broadcasting, ``cat``, ``extract``, ``insert``;
* `debug`: ``static_eval``, ``static_assert``, ``static_iter`` (a plain
  Python loop), ``assume_divisible_by``, ``assert_``, ``print``, ``printf``,
  and the ``grid_dependency_control_*`` launch hints (no-ops: launches run
  one after the other to completion);
* `atomics`: ``atomic_add`` ... ``atomic_cas``, lanes applied in C order;
  `views`: ``Array.slice`` and ``Array.tiled_view`` (`views.TiledView`);
  `rawmemory`: ``Array.get_raw_memory`` and the element-offset loads,
  stores and atomics of `rawmemory.RawArrayMemory`;
* `pybuiltins`: Python's ``max``, ``min``, ``divmod``, ... on tiles;
* `runner`: the dispatch mode, ``bid`` / ``num_blocks``, `is_interpreting`
  and `launch`;
* `trace`: what a launch touched (``launch(..., record=True)``): `Trace`,
  one `Access` per load or store, with the block, the kernel line and the
  elements of the argument it read or wrote;
* `work`: how much work launches did (``with count_work() as work:``), per
  kernel: launches, blocks, multiply-adds of ``mma`` / ``matmul``, bytes
  loaded and stored.

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
  with cuTile's own table (``promote_dtypes``), so mixing e.g. bfloat16 and
  float16 is an error here as in the compiler.
* A Python number used as a constant (an operand, ``ct.full``'s fill, a
  stored or atomic value, a padding value) takes the value the compiler's
  own constant encoder gives it (``cutile_internals.constant_float``):
  rounded once from the Python float to the target dtype, so ``bf16_tile *
  c`` sees the bfloat16 nearest ``c`` (not the bfloat16 nearest the float32
  nearest ``c``), and a float8 constant out of range is NaN (e4m3fn) or inf
  (e5m2), where a run-time ``astype`` saturates.

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
so a kernel that lets undetermined padding reach a result is caught.  A
kernel that relies on it anyway (an attention kernel whose partial key tile
is masked only after a product) runs with ``launch(...,
undetermined_padding="gpu")`` or ``MAMBA2_CUTILE_UNDETERMINED_PADDING=gpu``:
padded elements then read as the bit pattern of the integer 1 (float32
1.4e-45, bf16 9.2e-41, fp16 6.0e-8: the smallest positive subnormals; 1 for
integers), what an H200 returned for 1-D partial tiles loaded by ``ct.load``
(through TMA or not) and ``TiledView.load`` whatever lay past the array
(``tests/interpreter/test_padding.py``), and each kernel line that reads
them warns once (``UndeterminedPaddingWarning``).  2-D partial tiles read
other small bit patterns on the H200 (integers up to a few hundred, varying
with the element), which no value reproduces: the results then agree with the
GPU's only where the padded elements do not matter beyond their being finite
and tiny.
``ct.store`` drops out-of-bounds elements.  A tile lying entirely outside
the array, or a partial tile with ``check_bounds=False``, is undefined
behaviour on the GPU and an error here.  Hints (``latency``,
``allow_tma``, memory order/scope) are accepted and ignored.

Recording and running some blocks
---------------------------------
``launch(..., record=True)`` returns a `Trace` of every ``ct.load``,
``ct.store``, gather / scatter and tiled-view access: which block, which
kernel line, which elements of which argument (views mapped back to the
argument), how much of the tile was padding (``trace.summary((2, 0))``
reads ``line 7: load a[32:48, 0:32] (tile 16x32)``; ``ops.tools.picture``
draws it).  ``launch(..., blocks=[(2, 0)])`` runs only the blocks named,
with ``ct.bid`` and ``ct.num_blocks`` as in the whole grid, so one block
can be stepped through or checked alone.

Errors
------
Mistakes the compiler would reject, and undefined behaviour we can detect,
raise `KernelTypeError` / `KernelValueError` (subclasses of TypeError and
ValueError) whose message starts with the kernel's file, line and function,
e.g. ``kernel.py:42 in chunk_cumsum: ct.load shape (48,) must be powers of
two``.  The line is found by walking the stack past every frame in this
package's files and in cuda.tile.

Python builtins
---------------
The compiler implements a few builtins itself: ``max(x, y)`` / ``min(x, y)``
on tiles are ``ct.maximum`` / ``ct.minimum`` (exactly two arguments),
``abs`` is ``ct.abs``, ``divmod`` is ``ct.divmod``; ``pow``, ``round``,
``sum``, ``any``, ``all``, ``sorted`` are refused.  `pybuiltins` installs
the same behaviour for tile arguments while `launch` runs.  ``int()`` and
``float()`` of a one-element tile are accepted here although the compiler
only takes constants.  Tiles inside an iterator (``sum(t for t in tiles)``,
``max(map(f, tiles))``) are seen as in a list, and refused alike.  The
replacements live in Python's ``builtins`` module while a launch runs, so
another thread's code sees them too (they behave as the originals unless
that thread is interpreting a kernel).

float8
------
``float8_e4m3fn`` and ``float8_e5m2`` tiles are stored as torch float8:
they load, store, convert (nearest even, saturating to +-max as sm_90's
``cvt.rn.satfinite`` does) and feed ``ct.mma`` (float16 or float32
accumulator).  cuTile allows no arithmetic on them.  float8_e8m0fnu,
float8_e5m3fnu and float4_e2m1fn raise `UnsupportedOperation`.

Not emulated: the operations marked refused or in progress in
``COVERAGE.md`` (checked by ``tests/interpreter/test_coverage.py``), among
them foreign pointers, unsigned types other than uint8, rounding modes other
than the default, flush-to-zero (ignored) and ``ct.float32(x)``-style dtype
calls.  There is no timing and no concurrency: blocks run one at a
time, x fastest, then y, then z.  Plain Python that the compiler does not
accept runs here unchecked, since a kernel is run as Python, not compiled:
tuple arithmetic such as ``(1,) * n + shape``, or calls into torch or numpy.
Compile a kernel ahead of time (``ops.tools.aot``) to see the compiler's
verdict.
"""

# Every operation module is imported so that registry.OPS is complete.
from . import (  # noqa: F401
    arithmetic, atomics, creation, debug, indexing, memory, mma, rawmemory, reductions, shapes,
    views,
)
from .errors import (
    KernelAssertionError,
    KernelError,
    KernelTypeError,
    KernelValueError,
    UnsupportedOperation,
)
from .memory import UndeterminedPaddingWarning
from .runner import is_interpreting, launch
from .trace import Access, Trace
from .values import Array, Tile
from .work import KernelWork, Work, count_work

__all__ = [
    "Access",
    "Array",
    "KernelWork",
    "KernelAssertionError",
    "KernelError",
    "KernelTypeError",
    "KernelValueError",
    "Tile",
    "Trace",
    "UndeterminedPaddingWarning",
    "UnsupportedOperation",
    "Work",
    "count_work",
    "is_interpreting",
    "launch",
]
