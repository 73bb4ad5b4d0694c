"""One entry point for launching the project's cuTile kernels on a GPU or a CPU.

Every kernel module builds its launch as a ``Plan`` (grid, kernel, arguments,
output buffers, and the launches it needs first) and its wrapper runs it with
``run(plan)``, which calls ``launch(grid, kernel, args)``.  Where the tensor
arguments live decides how the kernel runs:

* CUDA tensors: compiled and run on the GPU with ``ct.launch`` on torch's
  current stream;
* CPU tensors: executed by the CPU interpreter (``ops.interpreter``, imported
  by the first CPU launch only), which emulates every ``ct`` operation in
  torch, block by block.

So the same wrapper, given CPU inputs, gives a kernel you can step through
with pdb on a laptop.
"""

import types
from typing import NamedTuple

import torch

import cuda.tile as ct

from ops.cutile_internals import kernel_function, kernel_hints


def _tensors(args):
    """All torch tensors among the kernel arguments (looking inside tuples/lists)."""
    for value in args:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _tensors(value)


def _device_type(args):
    """'cuda' or 'cpu' for the tensors in `args` (or 'cpu' when there are none)."""
    types = {t.device.type for t in _tensors(args)}
    if len(types) > 1:
        raise ValueError(f"kernel arguments mix devices: {sorted(types)}; "
                         "move all tensors to one device")
    device = types.pop() if types else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"cannot launch a kernel on {device} tensors; use cpu or cuda")
    return device


def launch(grid, kernel, args):
    """Run `kernel` over `grid` (an int or a tuple of up to 3 ints) with `args`.

    CUDA tensors go to ``ct.launch`` on the current stream; CPU tensors to
    the interpreter.  Mixing devices raises ValueError.
    """
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    args = tuple(args)
    if _device_type(args) == "cuda":
        ct.launch(torch.cuda.current_stream(), grid, kernel, args)
    else:
        from ops import interpreter  # only CPU launches need it
        interpreter.launch(grid, kernel, args)


def kernel_source(kernel):
    """The Python source of a ``@ct.kernel`` (the decorated object wraps the function)."""
    import inspect
    return inspect.getsource(kernel_function(kernel) if isinstance(kernel, ct.kernel) else kernel)


# 32- or 64-bit indexing -------------------------------------------------------------------------
#
# The kernels annotate their sequence-long arrays ``ct.IndexedWithInt64`` so that element offsets
# past 2**31 (x of a 512K-token, 80-head layer) are computed in 64 bits. That costs more than a few
# integer instructions: the compiler does not use the TMA copy engine for 64-bit-indexed arrays
# (it falls back to cp.async loads; see ``python -m ops.tools.sass``). So every launch whose tensors are
# all small enough runs a twin of the kernel with the annotation removed: same function, same
# source lines, 32-bit indices.

INT32_LIMIT = 2**31
_INT32_TWINS = {}


def _int32_twin(kernel):
    f = kernel_function(kernel)
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__qualname__, g.__module__, g.__doc__ = f.__qualname__, f.__module__, f.__doc__
    g.__kwdefaults__ = f.__kwdefaults__
    g.__annotations__ = {k: v for k, v in f.__annotations__.items() if v is not ct.IndexedWithInt64}
    return ct.kernel(g, **kernel_hints(kernel))


def element_reach(t):
    """One past the largest element offset from ``t``'s first element that indexing ``t`` can
    reach: ``numel`` for a contiguous tensor, more for a strided view (size-1 dimensions, whose
    stride is never stepped, do not count)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))


def fit_index_width(kernel, args, force_int64=False):
    """``kernel`` itself if indexing some tensor argument can reach an element offset of 2**31
    or more (``element_reach``; or ``force_int64``, a config option, so the autotuner can compare
    both), else its 32-bit-indexed twin (built once per kernel)."""
    if force_int64 or any(element_reach(t) >= INT32_LIMIT for t in _tensors(args)):
        return kernel
    if kernel not in _INT32_TWINS:
        _INT32_TWINS[kernel] = _int32_twin(kernel)
    return _INT32_TWINS[kernel]


# Plans ---------------------------------------------------------------------------------------------

class Plan(NamedTuple):
    """One kernel launch, built but not run: what every kernel module's ``*_plan`` returns.

    ``outputs`` are the buffers the launch fills; ``before`` holds the plans that must run first
    (compute_out's C B^T from memory needs ``chunk_scores``)."""
    grid: tuple
    kernel: object
    args: tuple
    outputs: tuple
    before: tuple = ()


def run(plan):
    """Launch ``plan`` (after the launches it needs); returns its outputs."""
    for step in plan.before:
        run(step)
    launch(plan.grid, plan.kernel, plan.args)
    return plan.outputs
