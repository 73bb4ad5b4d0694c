"""The exercises' grader: runs a learner's kernel on the CPU interpreter and says PASS, or what is
wrong, where, and in which block.

    from ops.tools.grader import grade, hint, picture
    grade("add_vectors", add_vectors)              # PASS, or FAIL: which element, which block,
                                                   # what that block read, your line
    hint("add_vectors")                            # a nudge; hint(..., full=True): the recipe
    grade("add_vectors", add_vectors, problem=3, block=15)   # one problem, one block: print() in
                                                   # the kernel prints once
    picture("add_vectors", add_vectors, problem=3) # what each block loaded and stored

The exercises (``ops.tools.exercises``) say how to make each problem's inputs, the launch, the
spec and the tolerance. For every problem, in order, the grader poisons every output with NaN,
launches the kernel through the interpreter recording each block's loads and stores
(``ops.interpreter.Trace``), and compares with the spec. The first problem that fails ends the
grading, and the FAIL says

* which problem (its label says what it stresses, and so names the likely mistake),
* the first wrong element, what it holds and what was expected,
* which block stored it, and what that block loaded and stored, line by line (a NaN that came
  from padding a block read with the default ``padding_mode`` is named as such); or, for an
  element no block stored, where the blocks did store,
* when the wrong output is exactly what a known mistake gives (the exercise's ``mistakes``: exp
  for exp2, the wrong axis, natural-log units...), that mistake; when a float32 output holds only
  16-bit numbers, the question whether it was summed in 16 bits,
* for an error inside the kernel: the block, the learner's own line (``line 5 of the cell`` in a
  notebook, whose cells number their lines from 1) with its text, and the interpreter's message.

No hint is printed with a FAIL: a learner asks for one (``hint``), first a nudge, then, asked
again with ``full=True``, the recipe.

Bad calls (an unknown exercise, an undecorated function, a missing or unexpected ``grid=``, a
problem or block that does not exist) raise ValueError/TypeError naming the argument.
"""
import dataclasses
import linecache
import math
import os
import re
import sys
import sysconfig

import torch

import cuda.tile as ct
from ops import interpreter
from ops.interpreter.trace import normalize_block
from ops.runtime.cutile_internals import kernel_function

from .exercises import EXERCISES

_SKIP_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                   for m in (sys.modules["ops"], ct, torch))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


@dataclasses.dataclass
class Result:
    """A verdict. True when it passed. ``launches``: (args, Trace) of each launch of the last
    problem run; ``output``: (launch number, argument position) of the output a FAIL is about."""
    name: str
    passed: bool
    message: str
    problem: int = 0
    launches: list = dataclasses.field(default_factory=list)
    output: tuple = None
    never_written: bool = False     # the FAIL is about an element no block stored

    def __bool__(self):
        return self.passed

    def picture(self, **kwargs):
        """What each block of the launch that wrote the failing output loaded and stored
        (``ops.tools.picture.draw``)."""
        if not self.launches:
            raise ValueError(f"{self.name}: nothing was launched, so there is nothing to draw")
        from .picture import draw
        launch, arg = self.output or (len(self.launches) - 1, None)
        args, trace = self.launches[launch]
        return draw(trace, _last_tensor(args) if arg is None else arg, **kwargs)


def _last_tensor(args):
    """The position of a launch's last tensor argument: its last output, in every exercise."""
    return max(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))


class _UsageError(Exception):
    """A mistake in the call to the grader, not in the kernel: re-raised as it is."""


class _Runner:
    """The launch the exercises call: records a Trace per launch; runs only ``block`` if given."""

    def __init__(self, block, grid_function, several):
        self.block, self.grid_function, self.launches = block, grid_function, []
        self.several = several      # several kernels: messages name the kernel of a block
        self.ranks = []             # each launch's grid rank, as the exercise gave it
        self.current = None         # (kernel name, grid rank) of the launch running

    def __call__(self, grid, kernel, args):
        if not isinstance(kernel, ct.kernel):
            raise _UsageError(TypeError(
                f"the kernel must be a @ct.kernel function, got {type(kernel).__name__} "
                f"{getattr(kernel, '__name__', '')!r}: is @ct.kernel missing above its def?"))
        full = self._grid(grid)
        rank = 1 if isinstance(grid, int) else len(grid)
        self.current = (getattr(kernel_function(kernel), "__name__", "kernel"), rank)
        grid = full
        blocks = None
        if self.block is not None:
            value = tuple(self.block) if isinstance(self.block, list) else self.block
            try:
                block = normalize_block(value)
            except ValueError:
                block = None
            if block is None or not all(0 <= b < g for b, g in zip(block, grid)):
                raise _UsageError(ValueError(
                    f"block={self.block!r} is not a block of this launch's grid {grid}"))
            blocks = [block]
            self.ran_block = block
        trace = interpreter.launch(grid, kernel, args, record=True, blocks=blocks)
        self.launches.append((tuple(args), trace))
        self.ranks.append(rank)

    def _grid(self, grid):
        grid = (grid,) if isinstance(grid, int) else grid
        ok = (isinstance(grid, tuple) and 1 <= len(grid) <= 3
              and all(isinstance(g, int) and g > 0 for g in grid))
        if not ok:
            who = (f"your grid function {getattr(self.grid_function, '__name__', '')} returned"
                   if self.grid_function else "the grid is")
            raise _KernelMistake(f"{who} {grid!r}: a grid is a positive int or a tuple of 1 to 3 "
                                 f"positive ints (ct.cdiv rounds up)")
        return grid + (1,) * (3 - len(grid))

    def find(self, tensor):
        """(launch number, argument position) of the last launch that stored into ``tensor``,
        else of the last that had it as an argument, or None."""
        found = None
        for n in range(len(self.launches) - 1, -1, -1):
            for pos, arg in enumerate(self.launches[n][0]):
                if arg is tensor:
                    if self.launches[n][1].stores(arg=pos):
                        return n, pos
                    found = found or (n, pos)
        return found


class _KernelMistake(Exception):
    """A mistake of the learner's that is not an exception inside the kernel (a bad grid)."""


def _exercise(name):
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; the exercises are: {', '.join(EXERCISES)}")
    return EXERCISES[name]


def _check_call(name, kernel, grid, problem, block):
    ex = _exercise(name)
    if ex.kernels:
        if not (isinstance(kernel, (tuple, list)) and len(kernel) == len(ex.kernels)):
            raise TypeError(f"{name}: kernel must be a tuple of {len(ex.kernels)} @ct.kernel "
                            f"functions, ({', '.join(ex.kernels)}), got {type(kernel).__name__}")
        if ex.given and all(k is g for k, g in zip(kernel, ex.given())):
            raise ValueError(f"{name}: these are the course's own kernels (ops/core/); the "
                             f"exercise is to write yours")
    if ex.learner_grid and not callable(grid):
        raise TypeError(f"{name}: pass your grid function as grid=, e.g. grade({name!r}, "
                        f"kernel, grid={ex.learner_grid.split('(')[0]}) (it is "
                        f"{ex.learner_grid} -> the grid)")
    if not ex.learner_grid and grid is not None:
        raise TypeError(f"{name}: this exercise gives the grid; grid= is not taken")
    if problem is not None and (not isinstance(problem, int) or isinstance(problem, bool)
                                or not 1 <= problem <= len(ex.problems)):
        raise ValueError(f"problem must be an int from 1 to {len(ex.problems)}, got {problem!r}")
    if block is not None and not isinstance(block, (int, tuple, list)):
        raise TypeError(f"block must be an int or a tuple of ints, got {type(block).__name__}")
    return ex


def _is_learner_file(filename):
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    return not path.startswith(_SKIP_DIRS) and not path.startswith(_STDLIB)


def _where(filename, line):
    """'line 5 of the cell' in a notebook, else 'file.py:5'."""
    if re.search(r"ipykernel_\d+[/\\]\d+\.py$", filename) or filename.startswith("<ipython-input"):
        return f"line {line} of the cell"
    if filename.startswith("<"):
        return f"line {line} of {filename}"
    return f"{os.path.basename(filename)}:{line}"


def _source_line(filename, line):
    return linecache.getline(filename, line).strip()


def _learner_line(exc):
    """(filename, line) of the innermost frame of the learner's code in the exception's traceback."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if _is_learner_file(filename):
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def _block_text(block, rank=3):
    """(3, 1, 0) -> '(3, 1)' for a launch whose grid has 2 axes: as the exercise wrote the grid."""
    block = tuple(block[:rank])
    return f"({block[0]},)" if len(block) == 1 else str(block)


def _error_message(exc, runner):
    text = str(exc).splitlines()[0] if str(exc) else ""
    text = re.sub(r"^\S+:\d+ in \w+: ", "", text)    # the interpreter's own location prefix
    block = None
    kernel, rank = runner.current or ("", 3)
    for note in getattr(exc, "__notes__", ()):
        m = re.search(r"block \((\d+), (\d+), (\d+)\) of grid", note)
        if m:
            block = _block_text([int(v) for v in m.groups()], rank)
    if block and runner.several:
        block += f" of {kernel}"
    where = _learner_line(exc)
    lines = [f"{'block ' + block + ' ' if block else ''}raised {type(exc).__name__}"
             + (f" at {_where(*where)}:" if where else ":")]
    if where and _source_line(*where):
        lines.append(f"      {_source_line(*where)}")
    lines.append(f"  {text}")
    return "\n".join(lines)


def _first_wrong(out, ref, tol, only=None):
    """(index, got, expected) of the first element outside the tolerance, or None. ``only``: a
    bool mask of the elements to compare."""
    out, ref = out.double(), ref.double()
    bad = ~(torch.abs(out - ref) <= tol * (1 + torch.abs(ref)))
    bad &= ~(torch.isinf(ref) & (out == ref))
    if only is not None:
        bad &= only
    if not bool(bad.any()):
        return None
    index = tuple(int(i) for i in bad.nonzero()[0])
    return index, out[index].item(), ref[index].item()


def _sixteen_bit(out, ref):
    """True when a float32 output holds only 16-bit floats (all finite values of either kind)
    while the expected values do not: the mark of a 16-bit accumulator or an early rounding."""
    if out.dtype != torch.float32 or not bool(torch.isfinite(out).all()):
        return False
    for dtype in (torch.float16, torch.bfloat16):
        if bool((out.to(dtype).float() == out).all()) and not bool((ref.to(dtype).float() == ref).all()):
            return True
    return False


def _index_text(index):
    return "[" + ", ".join(map(str, index)) + "]"


def _diagnosis(runner, found, index, got, writers):
    """What the trace says about a wrong element: who stored it (``writers``), what that block
    did."""
    if found is None:
        return []
    launch, pos = found
    trace, rank = runner.launches[launch][1], runner.ranks[launch]
    name, grid = trace.arg_names[pos], trace.grid
    lines = []
    if not writers:
        stores = trace.stores(arg=pos)
        nblocks = math.prod(grid)
        if not stores:
            lines.append(f"no block stored anything into {name} (the grid "
                         f"{_block_text(grid, rank)} ran {nblocks} block{'s' * (nblocks > 1)})")
        else:
            lines.append(f"no block stored {name}{_index_text(index)}; the grid "
                         f"{_block_text(grid, rank)} ran {nblocks} block{'s' * (nblocks > 1)}, which "
                         f"stored:")
            for access in stores[:4]:
                lines.append(f"    block {_block_text(access.block, rank)}: {trace.region(access)}")
            if len(stores) > 4:
                lines.append(f"    ... and {len(stores) - 4} more stores")
        return lines
    block = writers[-1]
    kernel = f" of {trace.kernel}" if runner.several else ""
    lines.append(f"block {_block_text(block, rank)}{kernel} stored it; that block:")
    lines += ["    " + line for line in _shorten(trace.summary(block).splitlines())]
    if isinstance(got, float) and math.isnan(got):
        for access in trace.loads(block=block):
            if access.padded and access.padding_mode == "UNDETERMINED":
                lines.append(f"  its load at line {access.line} read {access.padded} padding "
                             f"element{'s' * (access.padded > 1)} of {access.name} with the "
                             f"default padding_mode (UNDETERMINED: NaN here, anything on a GPU)")
    return lines


def _shorten(lines, keep=4):
    """The first and last ``keep`` lines of a long list (a loop's loads), the rest counted."""
    if len(lines) <= 2 * keep + 1:
        return lines
    return lines[:keep] + [f"... {len(lines) - 2 * keep} more lines ..."] + lines[-keep:]


def _problem_text(ex, k):
    return f"problem {k + 1} of {len(ex.problems)} ({ex.problems[k]})"


def _run_problem(ex, name, kernel, grid, k, block):
    """-> (None or a FAIL message, runner, the output found, whether the element is one no
    block stored) for problem k (0-based)."""
    gen = torch.Generator().manual_seed(1000 + k)
    inputs = ex.inputs(gen, k)
    outputs = [torch.full(shape, math.nan, dtype=dtype) for shape, dtype in ex.outputs(*inputs)]
    runner = _Runner(block, grid, several=bool(ex.kernels))
    head = f"FAIL {name}, {_problem_text(ex, k)}"
    try:
        ex.launch(kernel, inputs, outputs, runner, grid)
    except _UsageError as e:
        raise e.args[0] from None
    except _KernelMistake as e:
        return f"{head}: {e}", runner, None, False
    except Exception as e:      # the learner's kernel (or grid function) failed: say where
        return f"{head}: {_error_message(e, runner)}", runner, None, False
    expected = ex.spec(*inputs)
    for k_out, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        found = runner.find(out)
        only = None
        if block is not None:
            if found is None:
                continue
            launch, pos = found
            trace = runner.launches[launch][1]
            stored = [a.elements for a in trace.stores(arg=pos)]
            if not stored:
                continue
            only = torch.stack(stored).any(0)
        wrong = _first_wrong(out, ref, ex.tol, only)
        if wrong is None:
            continue
        index, got, want = wrong
        trace = runner.launches[found[0]][1] if found else None
        label = (trace.arg_names[found[1]] if found
                 else "out" if len(outputs) == 1 else f"output {k_out}")
        writers = trace.writers(found[1], index) if found else []
        never_written = math.isnan(got) and not writers
        what = "never written (still NaN)" if never_written else f"{got:.6g}"
        lines = [f"{head}: {label}{_index_text(index)} is {what}, expected {want:.6g}"]
        lines += ["  " + line for line in _diagnosis(runner, found, index, got, writers)]
        for text, alternative in ex.mistakes:
            if _first_wrong(out, alternative(*inputs)[k_out], ex.tol, only) is None:
                lines.append(f"  {label} matches a known mistake: {text}")
        if _sixteen_bit(out, ref):
            lines.append(f"  every value in {label} is a float16 (or bfloat16) number, and the "
                         f"expected ones are not: was it summed or rounded in 16 bits?")
        return "\n".join(lines), runner, found, never_written
    return None, runner, None, False


def check(name, kernel, *, grid=None, problem=None, block=None):
    """Grade ``kernel`` for exercise ``name`` -> Result (nothing printed).

    ``grid``: your grid function, for the exercises that ask for one. ``problem``: run only
    that problem (1, 2, ...). ``block``: run only that block (an int or a tuple), and compare only
    the elements it stored: a ``print`` in the kernel then prints once per launch."""
    ex = _check_call(name, kernel, grid, problem, block)
    problems = range(len(ex.problems)) if problem is None else [problem - 1]
    runner = None
    for k in problems:
        message, runner, found, never_written = _run_problem(ex, name, kernel, grid, k, block)
        if message is not None:
            return Result(name, False, message + f"\n  hint({name!r}) for a nudge", k + 1,
                          runner.launches, found, never_written)
    if block is not None:
        k = problems[0]
        lines = [f"block {block!r} of {_problem_text(ex, k)}: every element it stored is right "
                 f"(the other blocks did not run)"]
        for n, (_, trace) in enumerate(runner.launches):
            lines.append(f"  launch {n + 1}, block {_block_text(runner.ran_block, runner.ranks[n])}:")
            lines += ["    " + line for line in trace.summary(runner.ran_block).splitlines()]
        return Result(name, True, "\n".join(lines), k + 1, runner.launches)
    scope = (f"{len(ex.problems)} problems" if problem is None
             else _problem_text(ex, problems[0]))
    return Result(name, True, f"PASS {name}: {scope}, every element within {ex.tol:g}",
                  problems[-1] + 1, runner.launches)


def _in_notebook():
    shell = sys.modules.get("IPython")
    try:
        return shell is not None and type(shell.get_ipython()).__name__ == "ZMQInteractiveShell"
    except Exception:
        return False


def grade(name, kernel, *, grid=None, problem=None, block=None):
    """Grade ``kernel`` for exercise ``name``, print the verdict and return the Result (see
    ``check``). In a notebook, a FAIL on an element no block stored also draws where the blocks
    did store (``Result.picture``)."""
    result = check(name, kernel, grid=grid, problem=problem, block=block)
    print(result.message)
    if (result.never_written and result.launches[result.output[0]][1].stores(arg=result.output[1])
            and _in_notebook()):
        from IPython.display import display
        import matplotlib.pyplot as plt
        figure = result.picture()
        display(figure)
        plt.close(figure)
    return result


def hint(name, full=False):
    """Print exercise ``name``'s nudge, or with ``full=True`` its recipe."""
    ex = _exercise(name)
    if full:
        print(f"{name}, the recipe: {ex.recipe}")
    else:
        print(f"{name}, a nudge: {ex.nudge}\n  (still stuck? hint({name!r}, full=True) gives the "
              f"recipe)")


def picture(name, kernel, *, grid=None, problem=1, arg=None, **kwargs):
    """Run problem ``problem`` of exercise ``name`` and draw what each block loaded and stored
    of the kernel argument ``arg`` (a position or a parameter name; default: the last output)
    -> a matplotlib Figure (``ops.tools.picture.draw``)."""
    ex = _check_call(name, kernel, grid, problem, None)
    message, runner, _, _ = _run_problem(ex, name, kernel, grid, problem - 1, None)
    if not runner.launches:
        raise ValueError(f"{name}: the kernel did not launch: {message}")
    from .picture import draw
    args, trace = runner.launches[-1]
    return draw(trace, _last_tensor(args) if arg is None else arg, **kwargs)
