"""The forward pass as a PyTorch custom operator, ``torch.ops.mamba2_cutile.ssd_forward``.

``torch.compile`` cannot trace into the kernels' launches (cuTile's launcher takes its own
stream objects, the interpreter is Python over tiles): to the compiler, the operator is one
opaque call whose outputs' shapes and dtypes its fake implementation gives. Everything that reads
a tensor's values (the seq_idx and cu_seqlens checks) runs inside it, so a compiled model has no
graph break there. ``ops.ssd_combined`` uses the operator when it is traced or a gradient is
needed (its backward is registered below); other eager calls run its work, ``forward``, directly
(the dispatch costs tens of microseconds), and a differentiable reference call is plain PyTorch.

Outputs: ``out`` (b, L, h, p) in x's dtype, ``final_states`` (b, h, p, n) float32 (float64 for
float64 inputs), ``varlen_states`` (nseq, h, p, n) in the same dtype, or (0, h, p, n) when not
asked for.
"""
from typing import Optional

import torch

from .ssd_combined import check_values

Tensor = torch.Tensor


def as_kernel_input(t):
    """``t`` contiguous, with the canonical strides also in its size-1 dimensions (a batch-1
    slice of a longer tensor is "contiguous" but keeps its parent's stride there, which the
    kernels would otherwise index with). Copies only a tensor that is not contiguous."""
    if t is None:
        return None
    t = t.contiguous()
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    strides = tuple(reversed(strides))
    return t if t.stride() == strides else t.as_strided(t.shape, strides)


def forward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, *, chunk_size,
            dt_softplus, dt_min, dt_max, with_varlen, state_dtype, backend):
    """The operator's work, callable directly: -> (out, final_states, varlen_states). Traced
    directly (a differentiable call under torch.compile), it skips the value checks, which
    would need the values at tracing."""
    seq_idx = check_values(x, seq_idx, cu_seqlens, check=not torch.compiler.is_compiling())
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx = (
        as_kernel_input(t) for t in (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx))
    dt_limit = (dt_min, dt_max)
    if backend == "reference":
        from reference import chunked
        from reference.common import compute_dtype
        cdt = compute_dtype(x, dt, A, B, C)
        dt_out, dA_cumsum = chunked.chunk_cumsum(dt.to(cdt), A.to(cdt), chunk_size, dt_bias,
                                                 dt_softplus, dt_limit)
        entry, final_states = chunked.fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx)
        out = chunked.compute_out(x, B, C, dt_out, dA_cumsum, entry, D, z, seq_idx).to(x.dtype)
        exp = torch.exp
    else:
        from .forward import kernel_forward
        out, final_states, (dt_out, dA_cumsum, entry) = kernel_forward(
            x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
            seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit,
            states_dtype=state_dtype or x.dtype, return_intermediates=True)
        exp = torch.exp2                     # the kernels' cumsum is in log2 units
    if with_varlen:
        from .varlen_states import varlen_states
        varlen = varlen_states(x, B, dt_out, dA_cumsum, entry, cu_seqlens, seq_idx, exp=exp)
    else:
        varlen = final_states.new_empty((0,) + tuple(final_states.shape[1:]))
    sdt = states_result_dtype(x)
    return out, final_states.to(sdt), varlen.to(sdt)


def states_result_dtype(x):
    """The dtype of the returned states: float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.custom_op("mamba2_cutile::ssd_forward", mutates_args=())
def ssd_forward(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                z: Optional[Tensor], dt_bias: Optional[Tensor], initial_states: Optional[Tensor],
                seq_idx: Optional[Tensor], cu_seqlens: Optional[Tensor], *, chunk_size: int,
                dt_softplus: bool, dt_min: float, dt_max: float, with_varlen: bool,
                state_dtype: Optional[torch.dtype], backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return forward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                   chunk_size=chunk_size, dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max,
                   with_varlen=with_varlen, state_dtype=state_dtype, backend=backend)


@ssd_forward.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, *, chunk_size,
      dt_softplus, dt_min, dt_max, with_varlen, state_dtype, backend):
    b, _, h, p = x.shape
    n = B.shape[3]
    sdt = states_result_dtype(x)
    nseq = cu_seqlens.shape[0] - 1 if with_varlen else 0
    return (x.new_empty(x.shape), x.new_empty((b, h, p, n), dtype=sdt),
            x.new_empty((nseq, h, p, n), dtype=sdt))


# Autograd: the backward pass in PyTorch -------------------------------------------------------
#
# Until the backward runs as cuTile kernels, the operator's gradients come from the chunked
# algorithm's backward in plain PyTorch (reference/backward.py: recomputes the forward's
# intermediates in float32, or float64 for float64 inputs). The forward stays the kernels'.

def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.options = keyword_only_inputs


def _backward(ctx, dout, dfinal, dvarlen):
    from reference.backward import ssd_chunked_backward
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens = ctx.saved_tensors
    o = ctx.options
    # (varlen states with a gradient are refused before the forward: ops.ssd_combined)
    seq_idx = check_values(x, seq_idx, cu_seqlens, check=False)
    g = ssd_chunked_backward(dout, dfinal, x, dt, A, B, C, o["chunk_size"], D=D, z=z,
                             dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
                             dt_softplus=o["dt_softplus"], dt_limit=(o["dt_min"], o["dt_max"]))
    cast = lambda name, t: None if t is None else g["d" + name].to(t.dtype)
    return (cast("x", x), cast("dt", dt), cast("A", A), cast("B", B), cast("C", C), cast("D", D),
            cast("z", z), cast("dt_bias", dt_bias), cast("initial_states", initial_states),
            None, None)


ssd_forward.register_autograd(_backward, setup_context=_setup_context)
