"""The interpreter's errors (ops/interpreter/errors.py) name the kernel's line."""
import inspect
import sys

import pytest
import torch

import cuda.tile as ct

from ops.interpreter import KernelTypeError
from ops.runtime.launch import launch
from tests.interpreter.helpers import evaluate, randn


def line_of(marker):
    """The line number of the line in this file ending with the comment `# marker`."""
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    return next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(f"# {marker}"))


@ct.kernel
def broken_kernel(a):
    t = ct.load(a, (0,), (4,))
    u = ct.reshape(t, (3, -1))  # BROKEN
    ct.store(a, (0,), u)


def test_errors_name_the_kernel_line_and_tracebacks_point_at_it():
    with pytest.raises(KernelTypeError) as info:
        launch(1, broken_kernel, (randn(8),))
    line = line_of("BROKEN")
    assert str(info.value).startswith(f"test_errors.py:{line} in broken_kernel: ct.reshape")
    frames = [(f.f_code.co_name, lineno) for f, lineno in
              __import__("traceback").walk_tb(info.value.__traceback__)]
    assert ("broken_kernel", line) in frames
    if sys.version_info >= (3, 11):  # exception notes
        assert "block (0, 0, 0)" in "".join(info.value.__notes__)


@ct.kernel
def mixed_dtypes_kernel(a):
    t = ct.load(a, (0,), (4,))
    ct.store(a, (0,), t.astype(ct.bfloat16) + t.astype(ct.float16))  # MIXED


@ct.kernel
def bad_load_kernel(a):
    ct.load(a, (0,), (3,))  # BAD LOAD


def test_errors_name_the_kernel_line_from_every_module_of_the_interpreter():
    # Raised through Tile.__add__ (values), the operation (arithmetic) and
    # promotion (arguments); then through memory and arguments.
    for kernel, marker, name in [(mixed_dtypes_kernel, "MIXED", "mixed_dtypes_kernel"),
                                 (bad_load_kernel, "BAD LOAD", "bad_load_kernel")]:
        with pytest.raises(KernelTypeError) as info:
            launch(1, kernel, (randn(8),))
        assert str(info.value).startswith(f"test_errors.py:{line_of(marker)} in {name}: ")


def test_unsupported_operations_fail_loudly():
    @ct.kernel
    def pack(a):
        ct.pack_to_bytes(ct.load(a, (0,), (4,)))

    with pytest.raises(NotImplementedError, match="ct.pack_to_bytes is not supported"):
        launch(1, pack, (randn(4),))


def test_truth_value_of_a_tile():
    with pytest.raises(KernelTypeError, match="ambiguous.*ct.where"):
        evaluate(lambda t: t if t > 0 else -t, randn(4))
    assert evaluate(lambda t: 1 if ct.sum(t) > 0 else -1, torch.ones(4)) == 1
