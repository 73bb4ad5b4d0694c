"""Compile-time helpers, hints and debugging: static_eval, static_assert,
static_iter, assume_divisible_by, assert_, print, printf and the
grid_dependency_control_* launch hints."""

import builtins
import re
import sys

import torch

from .arguments import as_tile, require_tile
from .errors import KernelAssertionError, KernelTypeError, KernelValueError
from .registry import emulates
from .values import format_nested


@emulates("static_eval", "ensure_constant")
def static_eval(expr, /):
    # Python has already evaluated the argument; there is nothing more to do.
    return expr


@emulates("static_assert")
def static_assert(condition, message=None, /):
    if not condition:
        raise KernelAssertionError(f"static assertion failed: {'' if message is None else message}")


@emulates("assume_divisible_by")
def assume_divisible_by(x, divisor):
    # A false promise is undefined behaviour on the GPU, so check it here.
    if int(x) % divisor:
        raise KernelValueError(f"ct.assume_divisible_by: {int(x)} is not divisible by {divisor}")
    return x


@emulates("assert_")
def assert_(cond, /, message=None):
    cond = require_tile("ct.assert_", cond)
    if not bool(torch.all(cond._t)):
        raise KernelAssertionError(f"ct.assert_ failed: {message or ''}")


@emulates("print")
def print_(*args, sep=" ", end="\n"):
    builtins.print(*args, sep=sep, end=end)


_PRINTF_SPEC = re.compile(r"%([-+ #0]*\d*(?:\.\d+)?)(?:hh|h|ll|l|z|j|t|L)?([diuoxXeEfFgGaA%])")


@emulates("printf")
def printf(format, *args):
    """C printf: each conversion formats one tile, element by element."""
    values = iter(args)

    def convert(match):
        flags, conversion = match.groups()
        if conversion == "%":
            return "%"
        tile = as_tile(next(values))
        spec = "%" + flags + {"i": "d", "u": "d", "a": "e", "A": "E"}.get(conversion, conversion)
        return format_nested(tile._t.tolist(), lambda v: spec % v)

    sys.stdout.write(_PRINTF_SPEC.sub(convert, format))


@emulates("static_iter")
def static_iter(iterable):
    # The compiler inlines the loop body once per item of the iterable; a plain
    # Python loop runs the same body with the same bindings.  ct.static_iter is a
    # host stub whose body returns the iterable, and cuda.tile calls that body
    # directly outside the compiler, so this entry documents the decision more
    # than it runs.  Not checked: the compiler's limit of 1000 items and its ban
    # on break / continue / return inside the loop.
    return iterable


@emulates("grid_dependency_control_wait", "grid_dependency_control_launch_dependents")
def grid_dependency_control(*args, **kwargs):
    # Programmatic dependent launch: "wait for the preceding kernel to finish" and
    # "let the next kernel start scheduling".  Launches here run one after the
    # other to completion, so the preceding kernel's writes are always visible
    # and there is nothing to wait for or to release: both are no-ops.
    if args or kwargs:
        raise KernelTypeError("ct.grid_dependency_control_*: takes no arguments")
