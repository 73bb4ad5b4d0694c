"""One entry point for launching the project's cuTile kernels on a GPU or a CPU.

Every wrapper in ``ops/`` calls ``launch(grid, kernel, args)``.  Where the
tensor arguments live decides how the kernel runs:

* CUDA tensors: compiled and run on the GPU with ``ct.launch`` on torch's
  current stream;
* CPU tensors: executed by the CPU interpreter (``ops.interpreter``), which
  emulates every ``ct`` operation in torch, block by block.

So the same wrapper, given CPU inputs, gives a kernel you can step through
with pdb on a laptop.
"""

import torch

import cuda.tile as ct

from ops import interpreter


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


def interpreting(args):
    """True when ``launch(grid, kernel, args)`` would use the CPU interpreter."""
    return _device_type(args) == "cpu"


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
        interpreter.launch(grid, kernel, args)


def kernel_source(kernel):
    """The Python source of a ``@ct.kernel`` (the decorated object wraps the function)."""
    import inspect
    return inspect.getsource(getattr(kernel, "_pyfunc", kernel))
