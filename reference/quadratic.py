"""The quadratic ("attention-like") dual form of the same recurrence.

Unrolling the recurrence of ``sequential.py`` from a zero state gives, for every pair of
tokens ``j <= i``::

    y_i = sum_j  (C_i . B_j) * exp(a_{j+1} + ... + a_i) * dt_j * x_j,      a_k = dt_k * A

so ``y = (M o C B^T) (dt x)`` where the decay mask ``M[i, j] = exp(cumsum(a)_i - cumsum(a)_j)``
below the diagonal and 0 above it: a 1-semiseparable mask. This is masked attention with a
decaying mask instead of a softmax. For L tokens it costs O(L^2) instead of O(L), but it is
made of matrix products, which is what the chunked algorithm exploits inside each chunk.
"""
import math

import torch

from .common import apply_skip_and_gate, compute_dtype, expand_groups, process_dt


def decay_mask(a_cumsum, seq_idx=None):
    """M[..., i, j] = exp(a_cumsum[..., i] - a_cumsum[..., j]) for j <= i (same sequence), else 0.

    The mask is applied to the exponent (as -inf) rather than to the result, so the upper
    triangle, where the difference is positive and could overflow, never reaches ``exp``.
    """
    n = a_cumsum.shape[-1]
    diff = a_cumsum[..., :, None] - a_cumsum[..., None, :]
    keep = torch.ones(n, n, dtype=torch.bool, device=a_cumsum.device).tril()
    if seq_idx is not None:                      # seq_idx: (b, n), a_cumsum: (b, h, n)
        keep = keep & (seq_idx[:, None, :, None] == seq_idx[:, None, None, :])
    return torch.exp(diff.masked_fill(~keep, -math.inf))


def ssd_quadratic(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                  seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                  return_final_states=False):
    """Same arguments and results as ``ssd_sequential``, computed as one masked matrix product."""
    cdt = compute_dtype(x, dt, A, B, C)
    nheads = x.shape[2]
    x_ = x.to(cdt)
    dt_ = process_dt(dt.to(cdt), None if dt_bias is None else dt_bias.to(cdt), dt_softplus, dt_limit)
    B_, C_ = expand_groups(B.to(cdt), nheads), expand_groups(C.to(cdt), nheads)

    a_cumsum = torch.cumsum(dt_ * A.to(cdt), dim=1).transpose(1, 2)          # (b, h, L)
    mask = decay_mask(a_cumsum, seq_idx)                                     # M: (b, h, L, L)
    scores = torch.einsum("bihn,bjhn->bhij", C_, B_) * mask                 # (M o C B^T)
    y = torch.einsum("bhij,bjh,bjhp->bihp", scores, dt_, x_)                 # times dt x

    # A state carried in from before token 0 decays by exp(cumsum_i) on its way to token i,
    # and only the sequence with id 0 inherits it.
    first_seq = None if seq_idx is None else (seq_idx == 0)                 # (b, L)
    if initial_states is not None:
        h0 = initial_states.to(cdt)
        carry = torch.einsum("bihn,bhpn->bihp", C_, h0) * torch.exp(a_cumsum).transpose(1, 2)[..., None]
        if first_seq is not None:
            carry = carry * first_seq[:, :, None, None]
        y = y + carry

    y = apply_skip_and_gate(y, x_, None if D is None else D.to(cdt), None if z is None else z.to(cdt))
    out = y.to(x.dtype)
    if not return_final_states:
        return out

    # The final state is the last row of the same unrolled sum, read before C is applied.
    last = mask[:, :, -1, :]                                                # (b, h, L)
    final = torch.einsum("bhj,bjh,bjhp,bjhn->bhpn", last, dt_, x_, B_)
    if initial_states is not None:
        keep = torch.exp(a_cumsum[:, :, -1])                                 # (b, h)
        if first_seq is not None:
            keep = keep * first_seq[:, -1, None]
        final = final + keep[:, :, None, None] * h0
    return out, final
