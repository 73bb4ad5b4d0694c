"""What the kernel modules share: tile-code constants and helpers, size checks, output buffers.

Each kernel module (``chunk_cumsum``, ``fwd_pass_state``, ``chunk_scores``, ``compute_out``)
imports from here and from ``ops.configs``, never from another kernel module (compute_out's
optional first step, ``chunk_scores``, aside).
"""
import math

import torch

import cuda.tile as ct

# Annotations of compile-time constant kernel parameters: each value compiles its own variant.
ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO       # padding of partial tiles that the kernels rely on
NEG_INF = -math.inf
LOG2E = 1.4426950408889634       # exp(v) == exp2(v * LOG2E): decays are kept in log2 units

# An H200's (and H100 SXM's) multiprocessor count: the grid a CPU or meta launch is planned for.
H200_MULTIPROCESSORS = 132


def latency_hint(value):
    """The ``latency=`` argument of a load or store for a LOAD_LAT / STORE_LAT constant.

    0 means no hint (the compiler infers the latency); 1 (low) .. 10 (high) tells it how heavy
    the DRAM traffic behind that access is expected to be, which it weighs when it schedules and
    pipelines the access. Called inside tile code with a constant, so it is evaluated while
    compiling: the compiled kernel contains the hint or nothing."""
    return None if value == 0 else value


# Host-side helpers ------------------------------------------------------------------------------

def cdiv(a, b):
    """ceil(a / b) for positive ints."""
    return -(-a // b)


def next_pow2(n):
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def is_pow2_in(value, lo, hi):
    """Whether ``value`` is an int power of two in [lo, hi]."""
    return (isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
            and value & (value - 1) == 0)


def element_size(dtype):
    """Bytes per element of a torch dtype."""
    return torch.empty((), dtype=dtype).element_size()


def multiprocessors(device=None):
    """The multiprocessor count of ``device`` (a CUDA device; None: the current one if there is a
    GPU). CPU and meta tensors, and machines without a GPU, get an H200's 132, so the interpreter
    and the ahead-of-time compiler see the grid an H200 would."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_MULTIPROCESSORS


def new_output(shape, dtype, device, poison=False):
    """An output buffer for a kernel to fill. ``poison=True`` fills it with NaN first, so an
    element the kernel fails to write shows up in tests; by default it is left uninitialised
    (filling costs a full write of the buffer: ~0.5 ms at 128K tokens on an H200)."""
    if poison:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def as_int32(seq_idx):
    """Sequence ids as the int32 the kernels compare (None stays None)."""
    if seq_idx is not None and seq_idx.dtype != torch.int32:
        return seq_idx.to(torch.int32)
    return seq_idx


# Checks of what the kernels can tile ------------------------------------------------------------

def check_chunk_size(chunk_size):
    """The chunk is a tile dimension: a power of two, at most 256 (the kernels' tiles)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int; got {type(chunk_size).__name__}")
    if not is_pow2_in(chunk_size, 16, 256):
        raise ValueError(f"chunk_size must be a power of two in [16, 256]; got {chunk_size}")


def check_sizes(headdim, dstate):
    """headdim and dstate become tile dimensions, which must be powers of two."""
    if not is_pow2_in(headdim, 16, 128):
        raise ValueError(f"headdim must be a power of two in [16, 128], got {headdim}")
    if not is_pow2_in(dstate, 16, 512):
        raise ValueError(f"dstate must be a power of two in [16, 512], got {dstate}")


def check_groups(nheads, ngroups):
    """Every group serves the same number of heads."""
    if nheads % ngroups:
        raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
