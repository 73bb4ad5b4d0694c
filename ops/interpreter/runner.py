"""Running a kernel: the interpreter's dispatch mode, ct.bid / ct.num_blocks, and `launch`."""

import functools
import typing

import torch

import cuda.tile as ct

from ops.runtime.cutile_internals import DispatchMode, ScalarAnnotation, is_stub, kernel_function, stub_name
from .arguments import as_int
from .dtypes import compute, to_dtype
from . import memory, trace
from .work import COUNTING
from .errors import KernelTypeError, UnsupportedOperation
from .pybuiltins import tile_builtins
from .registry import OPS, InterpreterMode, emulates
from .values import Array, Tile


class Interpreter(InterpreterMode):
    """cuTile dispatch mode active while a kernel runs on the CPU.

    cuTile's stubs call `call_tile_function_from_host` with themselves as
    `func`; we answer with the emulation registered for that stub.
    """

    def __init__(self, grid):
        self.grid = grid
        self.block = (0, 0, 0)

    def call_tile_function_from_host(self, func, args, kwargs):
        if not is_stub(func):
            # A user helper decorated with @ct.function: run its Python body.
            return func.__wrapped__(*args, **kwargs)
        name = stub_name(func)
        emulation = None if name is None else OPS.get(name)
        if emulation is None:
            raise UnsupportedOperation(
                f"ct.{func.__qualname__} is not supported by the CPU interpreter")
        return emulation(*args, **kwargs)


def is_interpreting():
    """True while a kernel runs inside the CPU interpreter (on this thread)."""
    return isinstance(DispatchMode.get_current(), Interpreter)


def _launch_state():
    mode = DispatchMode.get_current()
    assert isinstance(mode, Interpreter)
    return mode


def _grid_axis(op, axis):
    axis = as_int(op, axis, "axis")
    if axis not in (0, 1, 2):
        raise KernelTypeError(f"{op}: axis must be 0, 1 or 2, got {axis}")
    return axis


@emulates("bid")
def bid(axis):
    return _launch_state().block[_grid_axis("ct.bid", axis)]


@emulates("num_blocks")
def num_blocks(axis):
    return _launch_state().grid[_grid_axis("ct.num_blocks", axis)]


@functools.lru_cache(maxsize=None)
def _parameter_kinds(pyfunc):
    """For each parameter: "constant", or the cuTile dtype its scalars take."""
    hints = typing.get_type_hints(pyfunc, include_extras=True)
    kinds = []
    for name in pyfunc.__code__.co_varnames[:pyfunc.__code__.co_argcount]:
        metadata = getattr(hints.get(name), "__metadata__", ())
        if any(isinstance(m, ct.ConstantAnnotation) for m in metadata):
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
        return Tile(to_dtype(torch.tensor(value, dtype=compute(dtype)), dtype), dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_kernel_argument(v, scalar_dtype) for v in value)
    raise TypeError(f"unsupported kernel argument of type {type(value).__name__}")


def _normalize_grid(grid):
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    if not 1 <= len(grid) <= 3 or not all(isinstance(g, int) and g > 0 for g in grid):
        raise ValueError(f"grid must be 1 to 3 positive ints, got {grid}")
    return grid + (1,) * (3 - len(grid))


def _selected_blocks(blocks, grid):
    """The blocks to run, in grid order: all of them, or those of ``blocks`` (each an int or
    a tuple of up to 3 ints, missing axes 0), checked against the grid."""
    if blocks is None:
        return ((x, y, z) for z in range(grid[2]) for y in range(grid[1]) for x in range(grid[0]))
    example = "e.g. blocks=[3] or blocks=[(2, 0), (3, 1)]"
    if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__"):
        raise ValueError(f"blocks must be None or an iterable of block indices ({example}), "
                         f"got {blocks!r}")
    selected = set()
    for value in blocks:
        try:
            block = trace.normalize_block(value)
        except ValueError:
            raise ValueError(f"blocks: {value!r} is not a block index; each is an int or a "
                             f"tuple of up to 3 ints ({example})") from None
        if not all(0 <= b < g for b, g in zip(block, grid)):
            raise ValueError(f"blocks: block {value!r} is outside the grid {grid}")
        selected.add(block)
    return sorted(selected, key=trace.grid_order)


def launch(grid, kernel, args, *, undetermined_padding=None, record=False, blocks=None):
    """Run a ``@ct.kernel`` on CPU tensors, block by block, in the calling thread.

    Arguments mirror ``ct.launch(stream, grid, kernel, args)`` without the
    stream.  Array arguments must be CPU tensors; results are written into
    them in place.  ``undetermined_padding``: what elements of a partial tile
    loaded with ``PaddingMode.UNDETERMINED`` read as -- "nan" (the default:
    NaN, or an integer's most negative value) or "gpu" (what an H200 returned,
    with an ``UndeterminedPaddingWarning`` naming the kernel line); None takes
    ``$MAMBA2_CUTILE_UNDETERMINED_PADDING``, else "nan".

    ``record=True`` returns a `trace.Trace`: which elements of which argument
    each block loaded and stored, from which kernel line (otherwise None is
    returned, and the operations pay one check for it).  ``blocks`` runs only
    some blocks, to look at one in isolation: an iterable of block indices,
    each an int or a tuple of up to 3 ints (missing axes 0); they run in grid
    order, and ``ct.bid`` / ``ct.num_blocks`` answer as in the full grid.  A
    block outside the grid is a ValueError.  Elements that only the skipped
    blocks write keep their old values.
    """
    if not isinstance(kernel, ct.kernel):
        raise TypeError(f"expected a @ct.kernel, got {type(kernel).__name__}")
    grid = _normalize_grid(grid)
    pyfunc = kernel_function(kernel)
    kinds = _parameter_kinds(pyfunc)
    if len(args) > len(kinds):
        raise TypeError(f"{pyfunc.__name__} takes {len(kinds)} arguments, got {len(args)}")
    selected = _selected_blocks(blocks, grid)
    call_args = [value if kind == "constant" else _kernel_argument(value, kind)
                 for value, kind in zip(args, kinds)]
    recorder = None
    if record:
        code = pyfunc.__code__
        tensors = {i: v for i, v in enumerate(args) if isinstance(v, torch.Tensor)}
        recorder = trace.Recorder(trace.Trace(
            grid=grid, arg_names=list(code.co_varnames[:code.co_argcount]),
            arg_shapes={i: tuple(v.shape) for i, v in tensors.items()},
            kernel=pyfunc.__name__, filename=code.co_filename), tensors,
            {i: a for i, a in enumerate(call_args) if isinstance(a, Array)})
    work = COUNTING.get()
    if work is not None:
        work.launch(f"{pyfunc.__module__}.{pyfunc.__qualname__}")
    mode = Interpreter(grid)
    # tile_builtins: max(tile, tile) and friends behave as the compiler makes them.
    with torch.no_grad(), mode.as_current(), tile_builtins(), \
            memory.undetermined_padding(undetermined_padding), \
            trace.recording(recorder):
        for block in selected:
            mode.block = block
            if work is not None:
                work.block()
            if recorder:
                recorder.block = block
                recorder.trace.blocks.append(block)
            try:
                pyfunc(*call_args)
            except Exception as e:
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(f"(CPU interpreter: block {mode.block} of grid {grid})")
                raise
    return recorder.trace if recorder else None
