"""The operation table: every module of the interpreter registers its emulations here; and the
kind of dispatch mode a kernel runs under on the interpreter."""
from ops.runtime.cutile_internals import DispatchMode

# Stub name (its name in cuTile's stub module: "load", "Tile.item") -> emulation.
OPS = {}


def emulates(*names):
    """Register the decorated function as the emulation of ``ct.<name>``."""
    def register(fn):
        for name in names:
            OPS[name] = fn
        return fn
    return register


class InterpreterMode(DispatchMode):
    """What every dispatch mode of the interpreter is (``runner.Interpreter``): the Python
    builtins that tile code calls (``pybuiltins``) ask whether one is active."""
