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

import contextlib
import inspect
import threading
import types
from typing import NamedTuple

import torch

import cuda.tile as ct

from ops.runtime.cutile_internals import kernel_function, kernel_hints


def _tensors(args):
    """All torch tensors among the kernel arguments (looking inside tuples/lists)."""
    for value in args:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _tensors(value)


def _device_type(args):
    """'cuda' or 'cpu' for the tensors in `args` (or 'cpu' when there are none)."""
    types = set()
    for t in _tensors(args):
        types.add(t.device.type)
    if len(types) > 1:
        raise ValueError(f"kernel arguments mix devices: {sorted(types)}; "
                         "move all tensors to one device")
    device = types.pop() if types else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"cannot launch a kernel on {device} tensors; use cpu or cuda")
    return device


def launch(grid, kernel, args, stream=None):
    """Run `kernel` over `grid` (an int or a tuple of up to 3 ints) with `args`.

    CUDA tensors go to ``ct.launch`` on the current stream; CPU tensors to
    the interpreter.  Mixing devices raises ValueError. ``stream``: a CUDA stream the
    caller has already looked up for CUDA tensors (a launch then skips the device checks).
    """
    if stream is not None:
        ct.launch(stream, grid, kernel, tuple(args))
        return
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    args = tuple(args)
    if _device_type(args) == "cuda":
        ct.launch(torch.cuda.current_stream(), grid, kernel, args)
    else:
        from ops import interpreter  # only CPU launches load cuda.tile's private modules
        interpreter.launch(grid, kernel, args)


def kernel_source(kernel):
    """The Python source of a ``@ct.kernel`` (the decorated object wraps the function)."""
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
    if t.is_contiguous():
        return t.numel()
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


# Stand-ins ---------------------------------------------------------------------------------------

def unread_stand_in(device, ndim=1):
    """A one-element tensor (of ``ndim`` dimensions, the rank the kernel declares for the
    argument) passed for an absent optional tensor argument whose kernel flag is off (the
    kernel never reads it). Marked as such, so that re-used plans and replays
    (``PlanTemplate``, ``ops.runtime.replay``) keep it as it is; any other tensor they do not
    know must be computed afresh for each call."""
    t = torch.zeros((1,) * ndim, dtype=torch.float32, device=device)
    t.unread_stand_in = True
    return t


def is_unread_stand_in(t):
    return getattr(t, "unread_stand_in", False)


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


# While a call is recorded for replay (``ops.runtime.replay.Recording``, ``ops.runtime.tape.Tape``),
# ``RECORDER.plans`` takes the plans ``run`` launches, in order (``append``; per thread: another
# thread's calls are not this call's).
RECORDER = threading.local()


def run(plan, stream=None):
    """Launch ``plan`` (after the launches it needs); returns its outputs. ``stream``: see
    ``launch``."""
    for step in plan.before:
        run(step, stream)
    recorded = getattr(RECORDER, "plans", None)
    if recorded is None:
        launch(plan.grid, plan.kernel, plan.args, stream)
        return plan.outputs
    # a tape (ops.runtime.tape) records the call's torch ops, not the interpreter's inside a launch
    with getattr(recorded, "pause", contextlib.nullcontext)():
        launch(plan.grid, plan.kernel, plan.args, stream)
    recorded.append(plan)
    return plan.outputs


# Re-using a plan ----------------------------------------------------------------------------------
#
# Building a plan (checks, configs, the index width, the argument tuple) costs tens of microseconds
# of Python per kernel, as much as a small launch's GPU time. Calls with tensors of the same
# shapes, dtypes and strides build the same plan but for the tensors, so ``PlanTemplate`` records
# where each tensor of a plan comes from, and rebuilds the plan for new tensors.

class PlanTemplate:
    """A plan with its tensors replaced by their origin: one of the ``inputs`` it was built from,
    an output buffer (allocated afresh at each ``bind``), or a stand-in the kernel never reads
    (``ops.runtime.launch.unread_stand_in``, kept as it is). ``usable`` is False for a plan holding any other
    tensor, whose values would have to be recomputed: such a plan must be built every time."""

    def __init__(self, plan, inputs):
        self.usable = True
        self._inputs = {id(t): i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
        self._buffers = []          # (shape, dtype, device) of each output buffer
        self._made = {}
        self._node = self._record(plan)
        del self._inputs, self._made

    def _outputs_of(self, plan):
        for step in plan.before:
            yield from self._outputs_of(step)
        yield from plan.outputs

    def _record(self, plan):
        for out in self._outputs_of(plan):
            if id(out) not in self._made:
                self._made[id(out)] = len(self._buffers)
                self._buffers.append((tuple(out.shape), out.dtype, out.device))
        return (plan.grid, plan.kernel, tuple(self._slot(a) for a in plan.args),
                tuple(self._slot(o) for o in plan.outputs),
                tuple(self._record(step) for step in plan.before))

    def _slot(self, value):
        if not isinstance(value, torch.Tensor):
            return ("value", value)
        if id(value) in self._inputs:
            return ("input", self._inputs[id(value)])
        if id(value) in self._made:
            return ("buffer", self._made[id(value)])
        if not is_unread_stand_in(value):              # computed from the inputs: not re-usable
            self.usable = False
        return ("value", value)

    def bind(self, inputs):
        """The plan for ``inputs`` (tensors like the template's, in the same positions)."""
        fresh = [torch.empty(shape, dtype=dtype, device=device)
                 for shape, dtype, device in self._buffers]
        pick = {"input": inputs.__getitem__, "buffer": fresh.__getitem__, "value": lambda v: v}
        return _build(self._node, pick)


def _build(node, pick):
    """A recorded node as a ``Plan``, its tensors taken through ``pick``. A module-level function:
    a recursive closure inside ``bind`` would be a reference cycle (the function and its own
    cell) holding every fresh buffer of the plan until the garbage collector ran, so that
    intermediates a caller had dropped (a forward's entry states) stayed allocated through
    the backward's peak."""
    grid, kernel, args, outputs, before = node
    return Plan(grid, kernel, tuple(pick[k](v) for k, v in args),
                tuple(pick[k](v) for k, v in outputs), tuple(_build(b, pick) for b in before))


def tensor_key(values):
    """What a plan depends on in ``values`` (tensors and others): each tensor's shape, dtype,
    strides and device, which tensors are the same object, and every other value as it is."""
    # Called on every eager call: torch.Size is already a hashable tuple, and the first
    # position of each object tells aliasing apart without a dict.
    ids = [id(v) for v in values]
    return tuple((v.shape, v.dtype, v.stride(), v.device, ids.index(ids[i]))
                 if isinstance(v, torch.Tensor) else v for i, v in enumerate(values))
