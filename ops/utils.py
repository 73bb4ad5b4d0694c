"""What the kernel modules share: tile-code constants and helpers, size checks, output buffers.

Each kernel module (``chunk_cumsum``, ``fwd_pass_state``, ``chunk_scores``, ``compute_out``)
imports from here and from ``ops.configs``, never from another kernel module (compute_out's
optional first step, ``chunk_scores``, aside). The size checks and integer helpers live in
``ops.checks`` (no cuda.tile needed, so the public entry point's input checks run without it)
and are re-exported here.
"""
import math

import torch

import cuda.tile as ct

from .checks import (cdiv, check_chunk_size, check_groups, check_sizes,  # noqa: F401
                     is_pow2_in, next_pow2, tile_size)

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


def unread_stand_in(device, ndim=1):
    """A one-element tensor (of ``ndim`` dimensions, the rank the kernel declares for the
    argument) passed for an absent optional tensor argument whose kernel flag is off (the
    kernel never reads it). Marked as such, so that re-used plans and replays
    (``ops.launch.PlanTemplate``, ``ops.replay``) keep it as it is; any other tensor they do not
    know must be computed afresh for each call."""
    t = torch.zeros((1,) * ndim, dtype=torch.float32, device=device)
    t.unread_stand_in = True
    return t


def is_unread_stand_in(t):
    return getattr(t, "unread_stand_in", False)


def as_int32(seq_idx):
    """Sequence ids as the int32 the kernels compare (None stays None)."""
    if seq_idx is not None and seq_idx.dtype != torch.int32:
        return seq_idx.to(torch.int32)
    return seq_idx


def softplus(v):
    """softplus(v) = log(1 + exp(v)) of a float32 tile, inside a kernel (the identity above 20,
    as mamba_ssm's threshold).

    For very negative v, 1 + exp(v) rounds to 1 and the plain log would return 0 instead of
    ~exp(v); the correction u / ((1 + u) - 1) restores log1p's accuracy (Goldberg's trick).
    Above 20, softplus(v) == v in float32 and exp could overflow, so those values pass through."""
    u = ct.exp(ct.minimum(v, 20.0))
    w = 1.0 + u
    log1p_u = ct.where(w == 1.0, u, ct.log(w) * (u / (w - 1.0)))
    return ct.where(v <= 20.0, log1p_u, v)
