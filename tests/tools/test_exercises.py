"""The graded exercises (``notebooks/exercises/``, graders in ``ops/tools/grader.py``) prove
themselves: every grader fails on its blank skeleton, with a readable message naming the exercise
and a hint, and passes on its solution. The kernels are taken from the notebooks' own cells (the
cell that starts with ``# EXERCISE: <name>``), so what is tested is what a learner sees.
"""
import json
import pathlib

import pytest

import cuda.tile as ct
from ops.tools import grader
from ops.tools.grader import EXERCISES, check
from ops.kernels.common import LOG2E

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
# Skeletons: the warm-up notebook and the "your turn" cells of the tutorial; solutions apart.
SKELETON_NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb")) + sorted(NOTEBOOK_DIR.glob("exercises/*.ipynb"))
SOLUTION_NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("exercises/solutions/*.ipynb"))


def exercise_cells(path):
    """{exercise name: cell source} of a notebook's exercise cells."""
    cells = {}
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"])
        for line in source.splitlines():
            if line.startswith("# EXERCISE: "):
                cells[line.removeprefix("# EXERCISE: ").strip()] = source
    return cells


def graded(source, name):
    """Run an exercise cell with ``grade`` recording its verdict instead of printing it."""
    results = []
    recording = lambda n, kernel: results.append(check(n, kernel)) or results[-1]
    namespace = {"ct": ct, "ConstInt": ct.Constant[int], "math": __import__("math"),
                 "LOG2E": LOG2E}                  # what the notebooks' setup cells define
    source = source.replace("from ops.tools.grader import grade\n", "")
    exec(compile(source, f"<exercise {name}>", "exec"), {**namespace, "grade": recording})
    assert len(results) == 1 and results[0].name == name
    return results[0]


SKELETONS = {n: s for nb in SKELETON_NOTEBOOKS for n, s in exercise_cells(nb).items()}
SOLUTIONS = {n: s for nb in SOLUTION_NOTEBOOKS for n, s in exercise_cells(nb).items()}


def test_every_exercise_has_a_skeleton_and_a_solution():
    assert set(SKELETONS) == set(SOLUTIONS) == set(EXERCISES)
    assert len(EXERCISES) >= 9


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_grader_fails_the_blank_skeleton(name):
    result = graded(SKELETONS[name], name)
    assert not result.passed
    assert result.message.startswith(f"FAIL {name}") and "hint: " in result.message


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_grader_passes_the_solution(name):
    result = graded(SOLUTIONS[name], name)
    assert result.passed, result.message


def test_wrong_values_and_errors_are_reported_with_the_element():
    @ct.kernel
    def transpose_forgot_order(a, out, TM: ct.Constant[int], TN: ct.Constant[int]):
        i, j = ct.bid(0), ct.bid(1)
        ct.store(out, (i, j), ct.load(a, (i, j), shape=(TM, TN)))

    @ct.kernel
    def add_vectors_off_by_one(a, b, c, TILE: ct.Constant[int]):
        i = ct.bid(0)
        ct.store(c, (i,), ct.load(a, (i,), shape=(TILE,)) + ct.load(b, (i,), shape=(TILE,)) + 1.0)

    @ct.kernel
    def add_vectors_bad_tile(a, b, c, TILE: ct.Constant[int]):
        ct.store(c, (0,), ct.load(a, (0,), shape=(48,)))

    wrong = check("add_vectors", add_vectors_off_by_one)
    assert not wrong and wrong.message.startswith("FAIL add_vectors (input 256): out[0] is ")
    assert "expected" in wrong.message
    error = check("add_vectors", add_vectors_bad_tile)
    assert "raised KernelTypeError: ct.load shape (48,) must be powers of two" in error.message
    outside = check("transpose", transpose_forgot_order)
    assert "raised KernelValueError" in outside.message and "outside the array" in outside.message
    with pytest.raises(ValueError, match="unknown exercise 'nope'"):
        check("nope", add_vectors_bad_tile)
    assert grader.grade("add_vectors", add_vectors_off_by_one).passed is False
