"""Shared by the tests: random problems (reference/problems.py) and the error measure."""
from reference.problems import make_problem, packed_seq_idx  # noqa: F401
from reference.validate import rel_err  # noqa: F401  (NaN/inf anywhere gives inf: never passes)
