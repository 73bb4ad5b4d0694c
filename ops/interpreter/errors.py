"""The interpreter's errors, whose messages start with the kernel's source line."""

import os
import sys

import cuda.tile as ct

# Frames in these places are the interpreter's or cuTile's, never the kernel's.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
CUDA_TILE_DIR = os.path.dirname(os.path.abspath(ct.__file__))


def kernel_frame():
    """(file, line, function) of the innermost frame outside the interpreter and cuTile.

    When an operation runs, the Python stack is: kernel line -> cuTile's stub wrapper -> the
    interpreter's modules.  Skipping the frames of every file of this package and of cuTile
    leaves the kernel's (or its helper's) line.
    """
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if (not filename.startswith(PACKAGE_DIR + os.sep)
                and not filename.startswith(CUDA_TILE_DIR)):
            return filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return "<kernel>", 0, "<kernel>"


def kernel_location():
    """'file.py:LINE in function' of the kernel line running (``kernel_frame``)."""
    filename, line, function = kernel_frame()
    if filename == "<kernel>":
        return "<kernel>"
    return f"{os.path.basename(filename)}:{line} in {function}"


class KernelError(Exception):
    """Base of the interpreter's errors; the message starts with the kernel line."""

    def __init__(self, message):
        super().__init__(f"{kernel_location()}: {message}")


class KernelTypeError(KernelError, TypeError):
    """Something the cuTile compiler would reject (shape, dtype, rank)."""


class KernelValueError(KernelError, ValueError):
    """A run-time value that is undefined behaviour on the GPU."""


class KernelAssertionError(KernelError, AssertionError):
    """A failed ``ct.assert_`` or ``ct.static_assert``."""


class UnsupportedOperation(KernelError, NotImplementedError):
    """A cuTile feature the CPU interpreter does not emulate."""
