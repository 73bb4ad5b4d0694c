"""Debugging inside kernels (ops/interpreter/debug.py): print, printf, breakpoint(), assertions."""
import sys

import pytest
import torch

import cuda.tile as ct

from ops.interpreter import KernelValueError
from ops.runtime.launch import launch
from tests.interpreter.helpers import evaluate, randn


def test_print_and_printf_inside_kernels(capsys):
    @ct.kernel
    def chatty(a):
        t = ct.load(a, (0,), (4,))
        print("block", ct.bid(0), t)
        print(f"{t:.1f}")
        ct.print("sum:", ct.sum(t.astype(ct.int32)))
        ct.printf("%d|%5.2f\n", ct.bid(0), t)

    launch(2, chatty, (torch.tensor([1.0, 2.5, -3.0, 4.0]),))
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == ["block 0 [1.000000, 2.500000, -3.000000, 4.000000]",
                         "[1.0, 2.5, -3.0, 4.0]", "sum: 4", "0|[ 1.00,  2.50, -3.00,  4.00]"]
    assert lines[4].startswith("block 1")


def test_breakpoint_sees_kernel_locals(monkeypatch):
    seen = {}

    def hook(*args, **kwargs):  # what pdb would be handed
        frame = sys._getframe(1)
        seen.update(name=frame.f_code.co_name, t=frame.f_locals["t"])

    monkeypatch.setattr(sys, "breakpointhook", hook)

    @ct.kernel
    def stop_here(a):
        t = ct.load(a, (0,), (4,))  # noqa: F841 (the breakpoint hook reads it)
        breakpoint()

    x = randn(4, seed=38)
    launch(1, stop_here, (x,))
    assert seen["name"] == "stop_here" and torch.equal(seen["t"]._t, x)


def test_static_and_runtime_assertions():
    with pytest.raises(AssertionError, match="static assertion failed: need 8"):
        evaluate(lambda t: ct.static_assert(t.shape[0] == 8, "need 8"), randn(4))
    with pytest.raises(AssertionError, match="ct.assert_ failed: positive"):
        evaluate(lambda t: ct.assert_(t > 0, "positive"), -torch.ones(4))
    with pytest.raises(KernelValueError, match="not divisible by 16"):
        evaluate(lambda t: ct.assume_divisible_by(t.shape[0] + 2, 16), randn(4))
    assert evaluate(lambda t: ct.static_eval(t.shape[0] * 2), randn(4)) == 8
    assert evaluate(lambda t: sum(i for i in ct.static_iter(range(3))), randn(4)) == 3
