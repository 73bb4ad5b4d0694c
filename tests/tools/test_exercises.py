"""The graded exercises (``notebooks/exercises/``, the "your turn" cells of notebooks 03-05; graders
in ``ops/tools/grader.py``, specs in ``ops/tools/exercises.py``) prove themselves:

* every grader fails its blank skeleton, passes its solution, and fails every plausible wrong
  answer of ``wrong_answers.py`` with a message that names the mistake;
* the committed skeleton notebooks show no verdict and no hint before the learner runs a cell;
* a FAIL names the problem, the element, the block that stored it and what that block did, or
  the learner's own line; hints come only when asked, the nudge before the recipe;
* one problem or one block can be run alone, and a ``print`` in the kernel then prints once;
* bad calls raise ValueError/TypeError naming the argument.

The kernels are taken from the notebooks' own cells (the cell with a line ``# EXERCISE: <name>``),
so what is tested is what a learner sees.
"""
import json
import linecache
import math
import pathlib

import pytest
import torch

import cuda.tile as ct
from ops.kernels.common import LOG2E
from ops.tools import grader
from ops.tools.exercises import EXERCISES
from ops.tools.grader import check

from . import wrong_answers

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
# Skeletons: the exercise notebooks and the "your turn" cells of the tutorial; solutions apart.
SKELETON_NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb")) + sorted(NOTEBOOK_DIR.glob("exercises/*.ipynb"))
SOLUTION_NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("exercises/solutions/*.ipynb"))
ConstInt = ct.Constant[int]


def exercise_cells(path):
    """{exercise name: cell} of a notebook's exercise cells."""
    cells = {}
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"])
        for line in source.splitlines():
            if line.startswith("# EXERCISE: "):
                cells[line.removeprefix("# EXERCISE: ").strip()] = cell
    return cells


def graded(source, name):
    """Run an exercise cell with ``grade`` recording its verdict instead of printing it."""
    results = []

    def recording(n, kernel, **kwargs):
        results.append(check(n, kernel, **kwargs))
        return results[-1]

    namespace = {"ct": ct, "ConstInt": ConstInt, "math": math, "LOG2E": LOG2E}
    source = "\n".join(line for line in source.splitlines()
                       if not line.startswith("from ops.tools.grader import"))
    exec(compile(source, f"<exercise {name}>", "exec"), {**namespace, "grade": recording})
    assert len(results) == 1 and results[0].name == name
    return results[0]


SKELETONS = {n: c for nb in SKELETON_NOTEBOOKS for n, c in exercise_cells(nb).items()}
SOLUTIONS = {n: c for nb in SOLUTION_NOTEBOOKS for n, c in exercise_cells(nb).items()}


def test_every_exercise_has_a_skeleton_a_solution_and_a_wrong_answer():
    assert set(SKELETONS) == set(SOLUTIONS) == set(EXERCISES)
    assert len(EXERCISES) >= 14
    assert {w[0] for w in wrong_answers.WRONG} == set(EXERCISES)


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_grader_fails_the_blank_skeleton(name):
    result = graded("".join(SKELETONS[name]["source"]), name)
    assert not result.passed
    assert result.message.startswith(f"FAIL {name}, problem 1 of ")
    assert result.message.endswith(f"hint({name!r}) for a nudge")


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_grader_passes_the_solution(name):
    result = graded("".join(SOLUTIONS[name]["source"]), name)
    assert result.passed, result.message


@pytest.mark.parametrize("case", wrong_answers.WRONG, ids=lambda c: f"{c[0]}-{getattr(c[1], '__name__', 'tuple')}"
                         if not isinstance(c, str) else c)
def test_the_grader_fails_a_plausible_wrong_answer_and_names_the_mistake(case):
    name, kernel, grid, words = case
    result = check(name, kernel, grid=grid)
    assert not result.passed
    assert words in result.message, result.message


@pytest.mark.parametrize("name", sorted(SKELETONS))
def test_committed_skeletons_show_no_verdict_and_no_hint(name):
    """What a learner opens shows nothing that spoils the exercise: no FAIL, no hint, no recipe."""
    cell = SKELETONS[name]
    assert cell["outputs"] == [], f"{name}: its skeleton cell was committed with outputs"
    source = "".join(cell["source"])
    assert "# NBVAL_IGNORE_OUTPUT" in source
    for text in (EXERCISES[name].recipe, EXERCISES[name].nudge):
        assert text not in source


def test_a_fail_carries_no_hint_and_hints_come_when_asked(capsys):
    result = check("add_vectors", wrong_answers.add_vectors_element_index)
    ex = EXERCISES["add_vectors"]
    assert ex.nudge not in result.message and ex.recipe not in result.message
    grader.hint("add_vectors")
    nudge = capsys.readouterr().out
    assert ex.nudge in nudge and ex.recipe not in nudge and "full=True" in nudge
    grader.hint("add_vectors", full=True)
    assert ex.recipe in capsys.readouterr().out
    for e in EXERCISES.values():
        assert e.nudge and e.recipe and e.nudge != e.recipe


def test_a_kernel_error_names_the_block_and_the_learners_line():
    error = check("add_vectors", wrong_answers.add_vectors_element_index)
    lines = error.message.splitlines()
    assert lines[0].startswith("FAIL add_vectors, problem 1 of 3 (n = 256: four whole tiles): "
                               "block (1,) raised KernelValueError at wrong_answers.py:")
    assert lines[1].strip().startswith("ct.store(c, (i * TILE,)")      # the learner's line
    assert "lies entirely outside the array of shape (256,)" in lines[2]


def test_in_a_notebook_the_line_is_counted_from_the_cell():
    """IPython names a cell's code after a file in ipykernel_<pid>/; its lines count from the cell."""
    filename = "/tmp/ipykernel_4242/1234567.py"
    source = ("@ct.kernel\n"
              "def bad_tile(a, b, c, TILE: ConstInt):\n"
              "    ct.store(c, (0,), ct.load(a, (0,), shape=(48,)))\n")
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"ct": ct, "ConstInt": ConstInt}
    exec(compile(source, filename, "exec"), namespace)
    message = check("add_vectors", namespace["bad_tile"]).message
    assert "raised KernelTypeError at line 3 of the cell:" in message
    assert "ct.store(c, (0,), ct.load(a, (0,), shape=(48,)))" in message
    assert "ct.load shape (48,) must be powers of two" in message


def test_an_element_nobody_stored_says_where_the_blocks_did_store():
    message = check("row_sums", wrong_answers.row_sums_right,
                    grid=wrong_answers.row_sums_grid_floor).message
    assert "out[48] is never written (still NaN)" in message
    assert "no block stored out[48]; the grid (3,) ran 3 blocks, which stored:" in message
    assert "block (2,): out[32:48]" in message


def test_a_nan_from_default_padding_is_named():
    message = check("matmul_k", wrong_answers.matmul_k_default_padding).message
    assert "block (0, 0) stored it; that block:" in message
    assert "load a[0:16, 192:200] (tile 16x32, 24 columns padded: UNDETERMINED)" in message
    assert "padding elements of a with the default padding_mode (UNDETERMINED" in message


def test_one_problem_and_one_block_run_alone_and_print_once(capsys):
    @ct.kernel
    def add_vectors(a, b, c, TILE: ConstInt):
        i = ct.bid(0)
        print("block", i)
        ct.store(c, (i,), ct.load(a, (i,), shape=(TILE,)) + ct.load(b, (i,), shape=(TILE,)))

    result = check("add_vectors", add_vectors, problem=3, block=15)
    assert capsys.readouterr().out == "block 15\n"
    assert result.passed and result.problem == 3
    assert result.message.startswith("block 15 of problem 3 of 3 (n = 1000: a partial last tile): "
                                     "every element it stored is right")
    assert "store c[960:1000] (tile 64, 24 elements dropped)" in result.message
    whole = check("add_vectors", add_vectors, problem=2)
    assert whole.passed and whole.message.startswith("PASS add_vectors: problem 2 of 3")
    capsys.readouterr()


def test_one_block_of_a_wrong_kernel_fails_on_its_own_elements():
    result = check("row_sums", wrong_answers.row_sums_default_padding, grid=wrong_answers.row_sums_grid,
                   problem=2, block=1)
    assert not result.passed and "out[16] is nan" in result.message


def test_blocks_are_named_with_the_grids_own_axes_and_kernel():
    """A 2-d grid's block is (i, j) even when the grid is (1, 1); in a chain of kernels the block's
    kernel is named, for an error as for a wrong element."""
    error = check("matmul", wrong_answers.matmul_fp16_acc)
    assert "block (0, 0) stored it" in error.message
    chain = check("ssd_forward", (wrong_answers.chunk_cumsum_core_kernel,
                                  wrong_answers.ssd_states_no_decay,
                                  wrong_answers.compute_out_core_kernel))
    assert "stored it" in chain.message and " of ssd_states_no_decay stored it" in chain.message


def test_a_grid_function_that_returns_no_grid_is_named():
    result = check("row_sums", wrong_answers.row_sums_right, grid=lambda M, N: (M / 16,))
    assert "your grid function <lambda> returned (2.0,)" in result.message


@pytest.mark.parametrize("call, error, words", [
    (lambda: check("nope", wrong_answers.add_vectors_element_index), ValueError, "unknown exercise 'nope'"),
    (lambda: check("add_vectors", lambda a: a), TypeError, "must be a @ct.kernel"),
    (lambda: check("row_sums", wrong_answers.row_sums_right), TypeError, "grid=row_sums_grid"),
    (lambda: check("add_vectors", wrong_answers.add_vectors_element_index, grid=lambda n: 1),
     TypeError, "grid= is not taken"),
    (lambda: check("add_vectors", wrong_answers.add_vectors_element_index, problem=4), ValueError,
     "problem must be an int from 1 to 3"),
    (lambda: check("add_vectors", wrong_answers.add_vectors_element_index, block=99), ValueError,
     "block=99 is not a block of this launch's grid"),
    (lambda: check("ssd_forward", wrong_answers.ssd_states_no_decay), TypeError, "a tuple of 3 @ct.kernel"),
    (lambda: grader.hint("nope"), ValueError, "unknown exercise 'nope'"),
    (lambda: check("ssd_forward", EXERCISES["ssd_forward"].given()), ValueError,
     "these are the course's own kernels"),
])
def test_bad_calls_are_named(call, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        call()


def test_the_picture_of_a_failing_run_and_of_an_exercise():
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    result = check("row_sums", wrong_answers.row_sums_right, grid=wrong_answers.row_sums_grid_floor)
    figure = result.picture()
    assert [ax.get_title(loc="left") for ax in figure.axes] == ["block 0", "block 1", "block 2"]
    figure = grader.picture("row_sums", wrong_answers.row_sums_right, grid=wrong_answers.row_sums_grid,
                            problem=3)
    assert figure.axes


def test_every_problem_is_random_and_labelled():
    """Inputs never zeros, each problem labelled, the same problems every run (seeded)."""
    for name, ex in EXERCISES.items():
        assert len(ex.problems) >= 2 and all(ex.problems)
        for k in range(len(ex.problems)):
            first = ex.inputs(torch.Generator().manual_seed(k), k)
            again = ex.inputs(torch.Generator().manual_seed(k), k)
            for a, b in zip(first, again):
                assert torch.equal(a, b)
                assert bool((a != 0).any()), f"{name} problem {k + 1}: an input of zeros"
