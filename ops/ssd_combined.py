"""The public entry point: a drop-in for mamba_ssm's ``mamba_chunk_scan_combined``.

It checks its inputs (a bad shape or dtype raises at once, naming the argument) and runs one of
the backends; traced, through a PyTorch custom operator (``ops.torch_op``), so that
``torch.compile`` traces a model calling it without a graph break:

    "reference"  the chunked PyTorch reference (reference/chunked.py), any device;
                 differentiated by autograd itself
    "interpret"  the three cuTile kernels, executed on the CPU by the ops/interpreter/ package
    "cutile"     the three cuTile kernels, compiled and launched on a CUDA GPU
    "auto"       "cutile" for CUDA tensors on a GPU cuTile supports (and sizes the kernels take:
                 headdim in [1, 256], dstate in [1, 512]), else "reference"

Gradients: the kernel backends' forward is differentiable through the custom operator, whose
backward runs the backward kernels (ops/backward.py); the reference backend is differentiated by
autograd itself.

A kernel backend's eager call whose tensors would reach 2**31 elements (a million tokens of 80
heads, say) runs as calls on pieces that stay 32-bit indexed, joined ("In pieces" below).
"""
import contextlib
import functools

import torch

from ops.inputs import check_values
from ops.runtime import replay
from ops.torch_op import EagerAutograd, forward, replay_key, ssd_forward
from ops.tuning.compute_chunk import smallest_chunk
from .checks import check_chunk_size, check_sizes

BACKENDS = ("auto", "reference", "interpret", "cutile")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what the kernels accept for x, B, C, z
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)    # the stored entry states


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False,
                              state_dtype=None, backend="auto"):
    """Mamba-2's SSD forward pass over a whole sequence (mamba_ssm 2.3's signature and returns).

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
        cu_seqlens: optional (nseq + 1,) integer boundaries of sequences packed in one row
            (b == 1): 0, then each sequence's end, the last one L. With seq_idx, the ids must
            change exactly there; without it, the sequences are made independent as if seq_idx
            numbered them 0, 1, ... (mamba_ssm leaves that to the caller).
        dt_softplus: apply softplus to dt + dt_bias (where it is at most 20).
        dt_limit: (min, max) clamp applied to the processed dt, always.
        return_final_states: also return the state after the last token, (b, h, p, n) float32.
        return_varlen_states: also return each packed sequence's final state, (nseq, h, p, n)
            float32 (needs cu_seqlens).
        state_dtype: the dtype the kernels store the chunks' entry states in (float32, bfloat16
            or float16; default x's dtype). The reference backend keeps them in its own.
        backend: "auto", "reference", "interpret" or "cutile".

    Returns:
        out (b, L, h, p) in x's dtype; with return_final_states (out, final_states); with
        return_varlen_states (out, varlen_states); with both (out, final_states, varlen_states).
    """
    tensors = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    replay_key = known = None
    grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)
    if cu_seqlens is None and not return_varlen_states and not grad:
        # A call like an earlier eager one replays its launches (ops/runtime/replay.py): the checks
        # below passed for the same shapes and options then, and the configs are the same.
        if (isinstance(seq_idx, torch.Tensor) and seq_idx.dtype in _OTHER_INTEGERS
                and not torch.compiler.is_compiling()):
            seq_idx = seq_idx.to(torch.int32)      # as the kernels would: the replay's input
        replay_key, stamp = _replay_key(tensors + (seq_idx,), chunk_size, dt_softplus, dt_limit,
                                        state_dtype, backend)
        known = replay_key is not None and replay.lookup(replay_key, stamp)
        if known and known is not replay.NEVER:
            if seq_idx is not None:
                check_values(x, seq_idx, None)
            out, final_states = known.run(tensors + (seq_idx,))
            return (out, final_states) if return_final_states else out
    _check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                  cu_seqlens, dt_limit, return_varlen_states, state_dtype)
    resolved = _resolve_backend(backend, x, B)
    if resolved != "reference" and x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"backend={resolved!r} takes x, B, C, z in float32, bfloat16 or float16; "
                        f"got {x.dtype} (float64 works with backend='reference')")
    wants_grad = grad                          # (computed before the checks, for the replay)
    if wants_grad and return_varlen_states and resolved != "reference":
        raise NotImplementedError(
            "gradients through return_varlen_states are not implemented for the kernel "
            "backends: compute the varlen states under torch.no_grad(), or use backend='reference'")
    pieces = None
    if (resolved != "reference" and seq_idx is None and cu_seqlens is None
            and not torch.compiler.is_compiling()):
        pieces = _pieces(x, dt, B, C, z, chunk_size)
    if pieces is not None:
        # past 32-bit indexing: rows apart, each row's tokens in segments ("In pieces" below)
        out, final_states = _in_pieces(*pieces, x, dt, A, B, C, chunk_size, D, z, dt_bias,
                                       initial_states, grad, dict(
                                           dt_softplus=dt_softplus, dt_limit=dt_limit,
                                           state_dtype=state_dtype, backend=resolved))
        return (out, final_states) if return_final_states else out
    options = dict(chunk_size=chunk_size, dt_softplus=bool(dt_softplus),
                   dt_min=float(dt_limit[0]), dt_max=float(dt_limit[1]),
                   with_varlen=bool(return_varlen_states), state_dtype=state_dtype)
    if wants_grad and resolved == "reference":
        # Plain PyTorch, differentiated by autograd itself.
        out, final_states, varlen_states = forward(
            *tensors, seq_idx, cu_seqlens, backend="reference", **options)
    elif (wants_grad and not torch.compiler.is_compiling()
          and all(t is None or type(t) in replay.PLAIN
                  for t in tensors + (seq_idx, cu_seqlens))):
        # Eager with a gradient: the operator's work and its backward, without its dispatch.
        out, final_states, varlen_states = EagerAutograd.use().apply(
            *tensors, seq_idx, cu_seqlens, dict(backend=resolved, **options))
    elif wants_grad or torch.compiler.is_compiling() or type(x) is not torch.Tensor:
        # Traced (torch.compile, export, fake tensors), or a gradient of a tensor subclass: the
        # custom operator, opaque to the tracer, with its backward registered (ops.torch_op).
        out, final_states, varlen_states = ssd_forward(
            *tensors, seq_idx, cu_seqlens, backend=resolved, **options)
    else:
        # Eager: the operator's work without its dispatch (tens of microseconds per call),
        # recorded for replay where it can be.
        record = replay_key is not None and known is None and resolved != "reference"
        with replay.Recording(replay_key, stamp, tensors + (seq_idx,)) if record else _NO_RECORDING as rec:
            out, final_states, varlen_states = forward(
                *tensors, seq_idx, cu_seqlens, backend=resolved, **options)
        if record:
            rec.keep((out, final_states))
    if return_varlen_states:
        return (out, final_states, varlen_states) if return_final_states else (out, varlen_states)
    return (out, final_states) if return_final_states else out


_NO_RECORDING = contextlib.nullcontext()


# Sequence-id dtypes converted to the kernels' int32 before a call is keyed for replay.
_OTHER_INTEGERS = (torch.int64, torch.int16, torch.int8, torch.uint8)


# In pieces ------------------------------------------------------------------------------------
#
# A tensor the kernels index past 2**31 elements makes them index in 64 bits, and 64-bit-indexed
# arrays cost the kernels the TMA copy engine (ops/runtime/launch.py, "32- or 64-bit indexing"):
# on the H200 a 1M-token forward (80 heads of 64 x 128, bf16) took 58 ms, against 6.8 ms for
# 256K tokens (tests/benchmark/results/context_parallel_1gpu_h200.csv). Rows are independent,
# and a row's scan continues across a split of its tokens given the state at the split: so a
# kernel backend's call whose tensors would reach 2**31 elements runs as calls on pieces that do
# not -- groups of whole rows, or a row's tokens in segments, each segment starting from the
# previous one's final state (float32, as returned) -- and joins their outputs. The same
# function, rounded differently: a segment's chunks start where the call's would (its length is
# a multiple of 256, so of the chunk), but a piece may compute at another chunk than the whole
# call (ops/tuning/compute_chunk.py: at 128 where its entry states stay under 2**31), and the
# state handed across a segment boundary is float32 where a single call stores it in the state
# dtype. Gradients flow through the joins and the handed states like any autograd graph. Not
# with seq_idx or cu_seqlens (the sequences' ids would have to be renumbered per segment):
# those calls index in 64 bits.

PIECE_LIMIT = 2 ** 31


def _elements_per_token(x, dt, B, C, z, low):
    """For sizing a call's pieces: the most elements per token of what its kernels index -- the
    inputs as laid out (a view's stride along the sequence: what indexing it reaches,
    ``ops.runtime.launch.element_reach``), x-sized outputs and gradients, B and C, the chunks'
    entry states and their gradient (h p n / chunk per token, at chunk ``low`` or more), and
    per group C B^T (chunk per token, 256 at most) and the backward's partials of dB, dC and
    d(C B^T), one per split of a group's heads (at most ``_max_splits()`` by default: a config
    that splits a group's heads further may still take a piece's backward to 64-bit indexing,
    slower, as exact)."""
    _, _, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    splits = min(_max_splits(), max(1, nheads // ngroups))
    strides = [t.stride(1) for t in (x, dt, B, C, z) if t is not None and t.shape[1] > 1]
    return max(nheads * headdim * max(1, -(-dstate // low)),
               splits * ngroups * max(dstate, 256), *strides)


@functools.lru_cache(maxsize=None)
def _max_splits():
    # (the backward's kernels, imported at the first call that needs them)
    from ops.kernels.backward.bwd_compute_out import MAX_SPLITS
    return MAX_SPLITS


def _pieces(x, dt, B, C, z, chunk_size):
    """(rows per piece, tokens per segment) for a call whose tensors would reach ``PIECE_LIMIT``
    elements, else None: whole rows while a row fits, else one row in segments of equal length,
    a multiple of 256 (so of every chunk: at most 256, powers of two). A row's chunks count as
    whole chunks (the states of a last chunk cut short take a whole chunk's room)."""
    batch, seqlen = x.shape[:2]
    padded = -(-seqlen // 256) * 256
    if batch * padded * _elements_per_token(x, dt, B, C, z, 16) < PIECE_LIMIT:
        return None                               # (most calls stop here, at the least chunk)
    per_token = _elements_per_token(x, dt, B, C, z, smallest_chunk(chunk_size))
    if batch * padded * per_token < PIECE_LIMIT:
        return None
    if padded * per_token < PIECE_LIMIT:
        return (PIECE_LIMIT - 1) // (padded * per_token), seqlen
    most = (PIECE_LIMIT - 1) // per_token // 256 * 256
    if most < 256:
        return None
    count = -(-seqlen // most)                     # (at least two: a row does not fit)
    return 1, -(-seqlen // count // 256) * 256


def _in_pieces(rows, segment, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, grad,
               options):
    """(out, final_states) of the call, made by calls on pieces of ``rows`` rows and
    ``segment`` tokens (``_pieces``). Without a gradient the output is written into one buffer
    piece by piece; with one, joined by ``torch.cat`` (whose backward hands each piece its
    slice of the gradient, without a full-size buffer per piece)."""
    batch, seqlen = x.shape[:2]
    by_rows = [min(rows, batch - i) for i in range(0, batch, rows)]
    by_tokens = [min(segment, seqlen - i) for i in range(0, seqlen, segment)]
    # (one piece along a dimension: the tensor itself, no split node, whose backward would copy
    # the whole gradient once more)
    split = lambda t, sizes, dim: ([t] * len(sizes) if t is None or len(sizes) == 1
                                   else t.split(sizes, dim))
    out = None if grad else x.new_empty(x.shape)
    row_outs, finals, first = [], [], 0
    for xr, dtr, Br, Cr, zr, state in zip(*(split(t, by_rows, 0)
                                            for t in (x, dt, B, C, z, initial_states))):
        pieces, start = [], 0
        for xs, dts, Bs, Cs, zs in zip(*(split(t, by_tokens, 1) for t in (xr, dtr, Br, Cr, zr))):
            y, state = mamba_chunk_scan_combined(
                xs, dts, A, Bs, Cs, chunk_size, D=D, z=zs, dt_bias=dt_bias,
                initial_states=state, return_final_states=True, **options)
            if out is None:
                pieces.append(y)
            else:
                out[first:first + xs.shape[0], start:start + xs.shape[1]] = y
            start += xs.shape[1]
            del y
        if out is None:
            row_outs.append(torch.cat(pieces, 1) if len(pieces) > 1 else pieces[0])
        finals.append(state)
        first += xr.shape[0]
    if out is None:
        out = torch.cat(row_outs, 0) if len(row_outs) > 1 else row_outs[0]
    return out, torch.cat(finals, 0) if len(finals) > 1 else finals[0]


def _replay_key(tensors, chunk_size, dt_softplus, dt_limit, state_dtype, backend):
    """(the replay key of an eager call, the autotuner it was made under), or (None, None)
    where the call is not replayed (ops.runtime.replay): as ``ops.torch_op.replay_key`` says,
    and also where the options are of unusual types (they are checked afresh)."""
    if type(dt_limit) is not tuple or not all(type(v) in (int, float) for v in dt_limit):
        return None, None
    return replay_key(tensors, (chunk_size, type(chunk_size), bool(dt_softplus), dt_limit,
                                state_dtype, backend))


def cutile_supported(device):
    """True if cuTile can run on this CUDA device (compute capability 8.0 or newer)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _cutile_runs_on(device.index if device.index is not None else torch.cuda.current_device())


@torch.compiler.assume_constant_result
def _cutile_runs_on(index):
    # A constant to torch.compile (asked once, at tracing), and cached for eager calls: the
    # driver query costs more than a small forward pass's kernels.
    return _cutile_runs_on_device(index)


@functools.lru_cache(maxsize=None)
def _cutile_runs_on_device(index):
    try:
        import cuda.tile  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(index)[0] >= 8


def kernels_take(headdim, dstate):
    """Whether the kernels take these sizes (their own check: headdim <= 256, dstate <= 512)."""
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


def _need_integer(name, t):
    _need_tensor(name, t)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor; got {t.dtype}")


def _need_float(name, t, allowed=KERNEL_DTYPES + (torch.float64,)):
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must be a floating tensor ({names}); got {t.dtype}")


def _check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                  dt_limit, return_varlen_states, state_dtype):
    """Shapes, dtypes and devices: what can be checked without reading a tensor's values (so
    torch.compile traces it). The values of seq_idx and cu_seqlens are checked where the
    forward runs (``check_values``)."""
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
        _need_integer("seq_idx", seq_idx)
        if seq_idx.shape != (b, L):
            raise _shape_error("seq_idx", (b, L), seq_idx)

    if cu_seqlens is not None:
        _need_integer("cu_seqlens", cu_seqlens)
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be 1-d with nseq + 1 >= 2 entries (0, then each "
                             f"sequence's end); got shape {tuple(cu_seqlens.shape)}")
        if b != 1:
            raise ValueError(f"cu_seqlens packs sequences along one row: x must have batch 1; got "
                             f"batch {b}")
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens (the packed sequences' bounds)")
    if state_dtype is not None and state_dtype not in STATE_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in STATE_DTYPES)
        raise TypeError(f"state_dtype must be None or one of {names}; got {state_dtype!r}")

    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise TypeError(f"dt_limit must be a pair of numbers (min, max); got {dt_limit!r}") from None
    if not lo <= hi:                    # false for NaN too (and traceable as a symbolic float)
        raise ValueError(f"dt_limit must satisfy min <= max with no NaN; got {dt_limit!r}")

    tensors = {"dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias,
               "initial_states": initial_states, "seq_idx": seq_idx, "cu_seqlens": cu_seqlens}
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"all tensors must be on one device: x is on {x.device}, {name} on {t.device}")

