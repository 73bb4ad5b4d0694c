"""The public forward pass: a drop-in for mamba_ssm's ``mamba_chunk_scan_combined`` (forward only).

It checks its inputs (a bad shape or dtype raises at once, naming the argument), makes them
contiguous, and hands them to one of the backends:

    "reference"  the chunked PyTorch reference (reference/chunked.py), any device
    "interpret"  the three cuTile kernels, executed on the CPU by the ops/interpreter/ package
    "cutile"     the three cuTile kernels, compiled and launched on a CUDA GPU
    "auto"       "cutile" for CUDA tensors on a GPU cuTile supports (and sizes the kernels take:
                 headdim and dstate powers of two, in [16, 128] and [16, 512]), else "reference"
"""
import math

import torch

from .checks import check_chunk_size, check_sizes

BACKENDS = ("auto", "reference", "interpret", "cutile")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what the kernels accept for x, B, C, z


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, dt_softplus=False,
                              dt_limit=(0.0, float("inf")), return_final_states=False,
                              backend="auto"):
    """Mamba-2's SSD forward pass over a whole sequence.

    Args (shapes as in mamba_ssm; b batch, L seqlen, h heads, p headdim, g groups, n dstate):
        x: (b, L, h, p) float32, bfloat16 or float16 (float64 with backend="reference").
        dt: (b, L, h) step sizes, before dt_bias/softplus.
        A: (h,) decay rates (negative in Mamba-2).
        B, C: (b, L, g, n), one dtype, same as x; g must divide h.
        chunk_size: a power of two in [16, 256].
        D: optional skip connection, (h,) or (h, p).
        z: optional gate, same shape as x; the output is multiplied by silu(z) after D.
        dt_bias: optional (h,), added to dt.
        initial_states: optional (b, h, p, n) state before token 0 (it belongs to sequence id 0).
        seq_idx: optional (b, L) integer sequence ids, non-negative and non-decreasing along L;
            the state resets where the id changes (several sequences packed in one row).
        dt_softplus: apply softplus to dt + dt_bias (where it is at most 20).
        dt_limit: (min, max) clamp applied to the processed dt, always.
        return_final_states: also return the state after the last token, (b, h, p, n) float32.
        backend: "auto", "reference", "interpret" or "cutile".

    Returns:
        out (b, L, h, p) in x's dtype, or (out, final_states).
    """
    args = _check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                         dt_limit, backend)
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx = args
    backend = _resolve_backend(backend, x, B)

    if backend == "reference":
        from reference.chunked import ssd_chunked
        out, final_states = ssd_chunked(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                        initial_states=initial_states, seq_idx=seq_idx,
                                        dt_softplus=dt_softplus, dt_limit=dt_limit,
                                        return_final_states=True)
    else:
        if x.dtype not in KERNEL_DTYPES:
            raise TypeError(f"backend={backend!r} takes x, B, C, z in float32, bfloat16 or float16; "
                            f"got {x.dtype} (float64 works with backend='reference')")
        from .forward import kernel_forward
        out, final_states = kernel_forward(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                           initial_states=initial_states, seq_idx=seq_idx,
                                           dt_softplus=dt_softplus, dt_limit=dt_limit)
    return (out, final_states) if return_final_states else out


def cutile_supported(device):
    """True if cuTile can run on this CUDA device (compute capability 8.0 or newer)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import cuda.tile  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def kernels_take(headdim, dstate):
    """Whether the kernels tile these sizes (their own check: powers of two in range)."""
    try:
        check_sizes(headdim, dstate)
    except ValueError:
        return False
    return True


def _resolve_backend(backend, x, B):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "auto":
        # cutile_supported first: it is the check that copes with cuda.tile being absent.
        fits = (cutile_supported(x.device) and x.dtype in KERNEL_DTYPES
                and kernels_take(x.shape[3], B.shape[3]))
        return "cutile" if fits else "reference"
    if backend == "interpret" and x.device.type != "cpu":
        raise ValueError(f"backend='interpret' runs the kernels on the CPU; the inputs are on {x.device} "
                         "(move them with .cpu(), or use backend='cutile')")
    if backend == "cutile" and not cutile_supported(x.device):
        raise ValueError(f"backend='cutile' needs CUDA tensors on a GPU of compute capability >= 8.0 "
                         f"with cuda-tile installed; the inputs are on {x.device} "
                         "(use backend='interpret' to run the kernels on the CPU)")
    return backend


# Input checks ---------------------------------------------------------------------------------

def _shape_error(name, expected, tensor):
    return ValueError(f"{name} must have shape {expected}; got {tuple(tensor.shape)}")


def _need_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")


def _need_float(name, t, allowed=KERNEL_DTYPES + (torch.float64,)):
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must be a floating tensor ({names}); got {t.dtype}")


def _check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit, backend):
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        _need_tensor(name, t)
    if x.dim() != 4:
        raise _shape_error("x", "(batch, seqlen, nheads, headdim)", x)
    b, L, h, p = x.shape
    if min(b, L, h, p) < 1:
        raise ValueError(f"x must have no empty dimension; got shape {tuple(x.shape)}")
    if B.dim() != 4 or B.shape[:2] != (b, L):
        raise _shape_error("B", f"({b}, {L}, ngroups, dstate)", B)
    g, n = B.shape[2:]
    if g < 1 or n < 1:
        raise ValueError(f"B must have ngroups >= 1 and dstate >= 1; got shape {tuple(B.shape)}")
    if h % g != 0:
        raise ValueError(f"ngroups ({g}, from B.shape[2]) must divide nheads ({h}, from x.shape[2])")
    if C.shape != B.shape:
        raise _shape_error("C", f"{tuple(B.shape)} (the shape of B)", C)
    if dt.shape != (b, L, h):
        raise _shape_error("dt", (b, L, h), dt)
    if A.shape != (h,):
        raise _shape_error("A", (h,), A)

    _need_float("x", x)
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C)):
        _need_float(name, t)
    if C.dtype != B.dtype:
        raise TypeError(f"B and C must have the same dtype; got B {B.dtype}, C {C.dtype}")
    if B.dtype != x.dtype:
        raise TypeError(f"B and C must have x's dtype ({x.dtype}); got {B.dtype}")

    check_chunk_size(chunk_size)

    if D is not None:
        _need_tensor("D", D)
        _need_float("D", D)
        if D.shape not in ((h,), (h, p)):
            raise _shape_error("D", f"({h},) or ({h}, {p})", D)
    if z is not None:
        _need_tensor("z", z)
        if z.shape != x.shape:
            raise _shape_error("z", f"{tuple(x.shape)} (the shape of x)", z)
        if z.dtype != x.dtype:
            raise TypeError(f"z must have x's dtype ({x.dtype}); got {z.dtype}")
    if dt_bias is not None:
        _need_tensor("dt_bias", dt_bias)
        _need_float("dt_bias", dt_bias)
        if dt_bias.shape != (h,):
            raise _shape_error("dt_bias", (h,), dt_bias)
    if initial_states is not None:
        _need_tensor("initial_states", initial_states)
        _need_float("initial_states", initial_states)
        if initial_states.shape != (b, h, p, n):
            raise _shape_error("initial_states", (b, h, p, n), initial_states)
    if seq_idx is not None:
        _need_tensor("seq_idx", seq_idx)
        if seq_idx.dtype.is_floating_point or seq_idx.dtype.is_complex or seq_idx.dtype == torch.bool:
            raise TypeError(f"seq_idx must be an integer tensor; got {seq_idx.dtype}")
        if seq_idx.shape != (b, L):
            raise _shape_error("seq_idx", (b, L), seq_idx)

    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise TypeError(f"dt_limit must be a pair of numbers (min, max); got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit must satisfy min <= max with no NaN; got {dt_limit!r}")

    tensors = {"dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias,
               "initial_states": initial_states, "seq_idx": seq_idx}
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"all tensors must be on one device: x is on {x.device}, {name} on {t.device}")

    if seq_idx is not None and L > 1:
        # One small reduction; a decreasing id would silently mix sequences.
        if bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
            raise ValueError("seq_idx must be non-decreasing along the sequence (packed sequences in order)")
    if seq_idx is not None and bool((seq_idx[:, 0] < 0).any()):
        raise ValueError("seq_idx must be non-negative")

    # The kernels index with strides of contiguous tensors; copies are cheap next to the work.
    fix = lambda t: None if t is None else t.contiguous()
    return tuple(fix(t) for t in (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx))
