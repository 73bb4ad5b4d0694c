"""Stage 0: the selective state-space recurrence, one token at a time.

This is the ground truth every other stage is checked against. For each head, the hidden
state ``S`` is a (headdim, dstate) matrix (``S_t`` after token t) and every token does::

    S_t = exp(dt_t * A) * S_{t-1} + dt_t * outer(x_t, B_t)      # decay, then write
    y_t = S_t @ C_t + D * x_t                                    # read, plus a skip
    y_t = y_t * silu(z_t)                                        # optional gate

``exp(dt_t * A)`` lies in (0, 1] because A < 0 and dt >= 0: the state forgets geometrically.

Packed sequences: where ``seq_idx`` changes from one token to the next, a new sequence starts
and the state is reset to zero. ``initial_states`` belongs to the sequence whose id is 0, the
same convention as mamba_ssm (the id "before" token 0 is taken to be 0).
"""
import math

import torch

from .common import apply_skip_and_gate, compute_dtype, expand_groups, process_dt


def ssd_sequential(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                   seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                   return_final_states=False):
    """Token-by-token recurrence. Returns ``out`` (dtype of x) or ``(out, final_states)``.

    Computes in float64 when any input is float64, else float32. final_states is
    (batch, nheads, headdim, dstate) in that compute dtype.
    """
    cdt = compute_dtype(x, dt, A, B, C)
    batch, seqlen, nheads, headdim = x.shape
    dstate = B.shape[-1]
    x_, A_ = x.to(cdt), A.to(cdt)
    dt_ = process_dt(dt.to(cdt), None if dt_bias is None else dt_bias.to(cdt), dt_softplus, dt_limit)
    B_, C_ = expand_groups(B.to(cdt), nheads), expand_groups(C.to(cdt), nheads)

    # The state S of the docstring, (batch, nheads, headdim, dstate)
    if initial_states is not None:
        S = initial_states.to(cdt).clone()
    else:
        S = torch.zeros(batch, nheads, headdim, dstate, dtype=cdt, device=x.device)
    prev_seq = torch.zeros(batch, dtype=torch.long, device=x.device)

    ys = []
    for t in range(seqlen):
        if seq_idx is not None:
            new_seq = seq_idx[:, t].long() != prev_seq                     # (b,)
            S = torch.where(new_seq[:, None, None, None], torch.zeros_like(S), S)
            prev_seq = seq_idx[:, t].long()
        decay = torch.exp(dt_[:, t] * A_)                                   # (b, h)
        write = (dt_[:, t, :, None] * x_[:, t])[..., None] * B_[:, t, :, None, :]   # (b, h, p, n)
        S = decay[:, :, None, None] * S + write
        ys.append(torch.einsum("bhpn,bhn->bhp", S, C_[:, t]))
    y = torch.stack(ys, dim=1)                                              # (b, L, h, p)

    y = apply_skip_and_gate(y, x_, None if D is None else D.to(cdt), None if z is None else z.to(cdt))
    out = y.to(x.dtype)
    return (out, S) if return_final_states else out
