"""The backward pass of the chunked algorithm, step by step, in plain PyTorch: the specification
the backward kernels are written against.

The forward (reference/chunked.py) in the order its gradients flow back through it:

  gate and skip     out = (y + D x) * silu(z)
  (c) compute_out   y[l] = sum_{s <= l} G[l, s] x[s]              G = (C_l . B_s) M[l, s] dt_s,
                           + w[l] (C_l . entry[c])                M = exp(dA[l] - dA[s]), masked,
                                                                  w = exp(dA[l]), masked
  (b) state pass    entry[c + 1] = a[c] entry[c] + S[c]           a = exp(dA[last]), masked
      chunk states  S[c] = sum_t v[t] outer(x[t], B[t])           v = exp(dA[last] - dA[t]) dt_t
  (a) chunk_cumsum  dA = cumsum(dt * A) inside each chunk
      dt            dt_out = clamp(softplus(dt + dt_bias), dt_limit)

so the backward runs (c), then the pass over chunks in REVERSE order (the state gradient flows
from the final state back to the initial one), then each chunk's own state, the cumsum (a
reverse cumsum) and the dt processing. Every product is one einsum, as every forward one is.
The masks (causality, packed sequences) are the forward's: a masked pair has no gradient.
Intermediates are recomputed here from the inputs, as a backward kernel may do instead of
storing them.
"""
import math

import torch
import torch.nn.functional as F

from .chunked import _chunk, _pad_to_chunks, seq_idx_at_chunk_ends, seq_idx_before_chunks
from .common import compute_dtype, expand_groups
from .quadratic import decay_mask


def _unchunk(t, seqlen):
    """(b, c, l, ...) -> (b, L, ...), dropping the padding."""
    return t.reshape(t.shape[0], -1, *t.shape[3:])[:, :seqlen]


def _sum_groups(t, ngroups):
    """(b, L, h, n) gradients of B or C as every head read them -> (b, L, g, n)."""
    b, L, h, n = t.shape
    return t.reshape(b, L, ngroups, h // ngroups, n).sum(3)


def ssd_chunked_backward(dout, dfinal, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                         initial_states=None, seq_idx=None, dt_softplus=False,
                         dt_limit=(0.0, math.inf)):
    """Gradients of ``ssd_chunked``'s (out, final_states) with respect to its inputs.

    ``dout`` (b, L, h, p) and ``dfinal`` (b, h, p, n) (either may be None: zero) are the
    gradients of the loss with respect to the outputs. Returns a dict with dx, ddt, dA, dB, dC
    and, for the inputs given, dD, dz, ddt_bias, dinitial_states, in the compute dtype (float64
    for float64 inputs, else float32)."""
    cdt = compute_dtype(x, dt, A, B, C)
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    to = lambda t: None if t is None else t.to(cdt)
    x, dt, A, B, C, D, z, dt_bias = map(to, (x, dt, A, B, C, D, z, dt_bias))
    dout = torch.zeros_like(x) if dout is None else dout.to(cdt)
    dfinal = None if dfinal is None else dfinal.to(cdt)
    grads = {}

    # Forward, recomputed ---------------------------------------------------------------------
    raw = dt + dt_bias if dt_bias is not None else dt
    soft = torch.where(raw <= 20.0, F.softplus(raw), raw) if dt_softplus else raw
    dt_full = soft.clamp(min=dt_limit[0], max=dt_limit[1])                  # (b, L, h)
    dtc = _chunk(dt_full, chunk_size).permute(0, 3, 1, 2)                    # (b, h, c, l)
    dA = torch.cumsum(dtc * A[:, None, None], dim=-1)                        # (b, h, c, l)
    nchunks = dtc.shape[2]
    xc = _chunk(x, chunk_size)                                               # (b, c, l, h, p)
    Bc = _chunk(expand_groups(B, nheads), chunk_size)                        # (b, c, l, h, n)
    Cc = _chunk(expand_groups(C, nheads), chunk_size)

    # (b) chunk states: v = exp(dA[last] - dA) dt, only tokens of the chunk's last sequence
    v_decay = torch.exp(dA[..., -1:] - dA)
    same_end = torch.ones_like(dtc)
    if seq_idx is not None:
        ends = seq_idx_at_chunk_ends(seq_idx, chunk_size)                    # (b, c)
        same_end = (_chunk(seq_idx, chunk_size) == ends[..., None])[:, None].to(cdt)  # (b,1,c,l)
    v = v_decay * dtc * same_end
    S = torch.einsum("bclhp,bhcl,bclhn->bchpn", xc, v, Bc)
    # (b) the pass: a = exp(dA[last]), dropped where a new sequence starts inside the chunk
    a = torch.exp(dA[..., -1])                                               # (b, h, c)
    if seq_idx is not None:
        keep = (seq_idx_at_chunk_ends(seq_idx, chunk_size)
                == seq_idx_before_chunks(seq_idx, chunk_size))               # (b, c)
        a = a * keep[:, None].to(cdt)
    entry = [torch.zeros(batch, nheads, headdim, dstate, dtype=cdt, device=x.device)
             if initial_states is None else initial_states.to(cdt)]
    for c in range(nchunks):
        entry.append(a[:, :, c, None, None] * entry[c] + S[:, c])
    # (c) inside the chunk: G = (C B^T) * M * dt_s; the carried-in term with w = exp(dA[l])
    seq_c = None
    if seq_idx is None:
        M = decay_mask(dA)                                                   # (b, h, c, l, s)
    else:
        seq_c = _pad_to_chunks(seq_idx, chunk_size, value=-1).reshape(batch, nchunks, chunk_size)
        b_, h_, c_, l_ = dA.shape
        M = decay_mask(dA.permute(0, 2, 1, 3).reshape(b_ * c_, h_, l_), seq_c.reshape(b_ * c_, l_))
        M = M.reshape(b_, c_, h_, l_, l_).permute(0, 2, 1, 3, 4)
    CB = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc)
    G = CB * M * dtc[..., None, :]
    w = torch.exp(dA).permute(0, 2, 3, 1)                                    # (b, c, l, h)
    if seq_c is not None:
        running = seq_idx_before_chunks(seq_idx, chunk_size)                 # (b, c)
        w = w * (seq_c == running[..., None])[..., None].to(cdt)
    entries = torch.stack(entry[:-1], dim=1)                                 # (b, c, h, p, n)
    carried = torch.einsum("bclhn,bchpn->bclhp", Cc, entries)
    y = _unchunk(torch.einsum("bhcls,bcshp->bclhp", G, xc) + carried * w[..., None], seqlen)

    # Gate and skip -------------------------------------------------------------------------------
    skip = y if D is None else y + x * (D[:, None] if D.dim() == 1 else D)
    dskip = dout
    if z is not None:
        sig = torch.sigmoid(z)
        grads["dz"] = dout * skip * sig * (1 + z * (1 - sig))               # d silu(z) / dz
        dskip = dout * z * sig
    dx = torch.zeros_like(x)
    if D is not None:
        grads["dD"] = (dskip * x).sum((0, 1, 3)) if D.dim() == 1 else (dskip * x).sum((0, 1))
        dx = dx + dskip * (D[:, None] if D.dim() == 1 else D)

    # (c) compute_out ------------------------------------------------------------------------------
    dy = _chunk(dskip, chunk_size)                                           # (b, c, l, h, p)
    dcarried = dy * w[..., None]
    ddA = (dy * carried).sum(-1).permute(0, 3, 1, 2) * w.permute(0, 3, 1, 2)  # w = exp(dA) ...
    dCc = torch.einsum("bclhp,bchpn->bclhn", dcarried, entries)
    dentries = torch.einsum("bclhp,bclhn->bchpn", dcarried, Cc)
    dG = torch.einsum("bclhp,bcshp->bhcls", dy, xc)
    dxc = torch.einsum("bhcls,bclhp->bcshp", G, dy)
    dCB = dG * M * dtc[..., None, :]
    dCc = dCc + torch.einsum("bhcls,bcshn->bclhn", dCB, Bc)
    dBc = torch.einsum("bhcls,bclhn->bcshn", dCB, Cc)
    ddtc = (dG * CB * M).sum(-2)                                             # over l
    dexp = dG * CB * dtc[..., None, :] * M                                   # M = exp(dA_l - dA_s)
    ddA = ddA + dexp.sum(-1) - dexp.sum(-2)

    # (b) the pass over chunks, in reverse ---------------------------------------------------------
    g = torch.zeros_like(entry[0]) if dfinal is None else dfinal            # d entry[nchunks]
    dS = torch.empty_like(S)
    da = torch.empty_like(a)
    for c in reversed(range(nchunks)):
        dS[:, c] = g
        da[:, :, c] = (g * entry[c]).sum((-2, -1))
        g = a[:, :, c, None, None] * g + dentries[:, c]
    if initial_states is not None:
        grads["dinitial_states"] = g
    ddA[..., -1] += da * a                                                   # a = exp(dA[last]) ...
    # (b) each chunk's own state
    dxc = dxc + torch.einsum("bchpn,bhcl,bclhn->bclhp", dS, v, Bc)
    dBc = dBc + torch.einsum("bchpn,bhcl,bclhp->bclhn", dS, v, xc)
    dv = torch.einsum("bchpn,bclhp,bclhn->bhcl", dS, xc, Bc)
    ddtc = ddtc + dv * v_decay * same_end
    dexp = dv * v                                                            # v ~ exp(dA[last] - dA)
    ddA[..., -1] += dexp.sum(-1)
    ddA = ddA - dexp

    # (a) the cumsum: dA[l] = sum_{l' <= l} dt[l'] A --------------------------------------------------
    dprod = ddA.flip(-1).cumsum(-1).flip(-1)                                 # d (dt * A)
    ddtc = ddtc + dprod * A[:, None, None]
    grads["dA"] = (dprod * dtc).sum((0, 2, 3))
    # dt processing: the clamp passes the gradient inside [min, max], softplus' is the sigmoid
    ddt_full = _unchunk(ddtc.permute(0, 2, 3, 1), seqlen)                    # (b, L, h)
    ddt = ddt_full * ((soft >= dt_limit[0]) & (soft <= dt_limit[1])).to(cdt)
    if dt_softplus:
        ddt = ddt * torch.where(raw <= 20.0, torch.sigmoid(raw), torch.ones_like(raw))
    grads["ddt"] = ddt
    if dt_bias is not None:
        grads["ddt_bias"] = ddt.sum((0, 1))

    grads["dx"] = dx + _unchunk(dxc, seqlen)
    grads["dB"] = _sum_groups(_unchunk(dBc, seqlen), ngroups)
    grads["dC"] = _sum_groups(_unchunk(dCc, seqlen), ngroups)
    return grads
