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
storing them. One function per step, each checked against autograd through its forward step
(tests/reference/test_reference_backward.py), in the layouts of reference/chunked.py:

    gate_and_skip_backward   compute_out_backward   state_passing_backward
    chunk_states_backward    chunk_cumsum_backward  ->  ssd_chunked_backward chains them
"""
import math

import torch
import torch.nn.functional as F

from . import chunked
from .chunked import _chunk
from .common import compute_dtype, expand_groups


def _unchunk(t, seqlen):
    """(b, c, l, ...) -> (b, L, ...), dropping the padding."""
    return t.reshape(t.shape[0], -1, *t.shape[3:])[:, :seqlen]


def _sum_groups(t, ngroups):
    """(b, L, h, n) gradients of B or C as every head read them -> (b, L, g, n)."""
    b, L, h, n = t.shape
    return t.reshape(b, L, ngroups, h // ngroups, n).sum(3)


# Gate and skip ---------------------------------------------------------------------------------

def gate_and_skip_backward(dout, y, x, D=None, z=None):
    """out = (y + D x) * silu(z) -> (dy, dx from the skip (or None), dD, dz)."""
    skip = y if D is None else y + x * (D[:, None] if D.dim() == 1 else D)
    dy, dz, dx, dD = dout, None, None, None
    if z is not None:
        sig = torch.sigmoid(z)
        dz = dout * skip * sig * (1 + z * (1 - sig))                       # d silu(z) / dz
        dy = dout * z * sig
    if D is not None:
        dD = (dy * x).sum((0, 1, 3)) if D.dim() == 1 else (dy * x).sum((0, 1))
        dx = dy * (D[:, None] if D.dim() == 1 else D)
    return dy, dx, dD, dz


# (c) compute_out -------------------------------------------------------------------------------

def compute_out_backward(dy, x, B, C, dt_out, dA_cumsum, entry_states, seq_idx=None):
    """Gradients of ``reference.chunked.compute_out`` (without D and z) for dy (b, L, h, p):
    dx (b, L, h, p), dB and dC as each head read them (b, L, h, n), ddt_out and ddA_cumsum
    (b, h, c, l), dentry (b, c, h, p, n)."""
    seqlen, nheads = x.shape[1], x.shape[2]
    chunk_size = dt_out.shape[3]
    Bc = _chunk(expand_groups(B, nheads), chunk_size)
    Cc = _chunk(expand_groups(C, nheads), chunk_size)
    CB = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc)
    M, w = chunked.output_decays(dA_cumsum, seq_idx)
    xc, dyc = _chunk(x, chunk_size), _chunk(dy, chunk_size)
    # carried in: y += w[l] (C_l . entry), w = exp(dA[l])
    carried = torch.einsum("bclhn,bchpn->bclhp", Cc, entry_states)
    dcarried = dyc * w[..., None]
    ddA = ((dyc * carried).sum(-1) * w).permute(0, 3, 1, 2)
    dCc = torch.einsum("bclhp,bchpn->bclhn", dcarried, entry_states)
    dentry = torch.einsum("bclhp,bclhn->bchpn", dcarried, Cc)
    # inside the chunk: y += G x, G = (C B^T) M dt_s, M = exp(dA[l] - dA[s])
    G = CB * M * dt_out[..., None, :]
    dG = torch.einsum("bclhp,bcshp->bhcls", dyc, xc)
    dxc = torch.einsum("bhcls,bclhp->bcshp", G, dyc)
    dCB = dG * M * dt_out[..., None, :]
    dCc = dCc + torch.einsum("bhcls,bcshn->bclhn", dCB, Bc)
    dBc = torch.einsum("bhcls,bclhn->bcshn", dCB, Cc)
    ddt_out = (dG * CB * M).sum(-2)
    dexp = dG * G
    ddA = ddA + dexp.sum(-1) - dexp.sum(-2)
    return (_unchunk(dxc, seqlen), _unchunk(dBc, seqlen), _unchunk(dCc, seqlen), ddt_out, ddA,
            dentry)


# (b) the pass over chunks, and each chunk's state ----------------------------------------------

def state_passing_backward(dentry, dfinal, entry_states, final_states, dA_cumsum, seq_idx=None):
    """The pass in REVERSE: from entry[c + 1] = a[c] entry[c] + S[c] (entry[nchunks] the final
    state) and the gradients of every entry state (b, c, h, p, n) and of the final state ->
    (dS (b, c, h, p, n), ddA_cumsum (b, h, c, l) at each chunk's last token, dinitial)."""
    a = chunked.chunk_decays(dA_cumsum, seq_idx)
    nchunks = a.shape[2]
    g = torch.zeros_like(final_states) if dfinal is None else dfinal      # d entry[nchunks]
    dS = torch.empty_like(entry_states)
    ddA = torch.zeros_like(dA_cumsum)
    for c in reversed(range(nchunks)):
        dS[:, c] = g
        ddA[..., c, -1] = (g * entry_states[:, c]).sum((-2, -1)) * a[:, :, c]
        g = a[:, :, c, None, None] * g + dentry[:, c]
    return dS, ddA, g


def chunk_states_backward(dS, x, B, dt_out, dA_cumsum, seq_idx=None):
    """Gradients of S[c] = sum_t v[t] outer(x[t], B[t]), v = exp(dA[last] - dA[t]) dt_t (tokens
    of the chunk's last sequence): dx (b, L, h, p), dB per head (b, L, h, n), ddt_out and
    ddA_cumsum (b, h, c, l)."""
    seqlen, nheads = x.shape[1], x.shape[2]
    chunk_size = dt_out.shape[3]
    xc = _chunk(x, chunk_size)
    Bc = _chunk(expand_groups(B, nheads), chunk_size)
    decay = chunked.state_write_decay(dA_cumsum, seq_idx)
    v = decay * dt_out
    dxc = torch.einsum("bchpn,bhcl,bclhn->bclhp", dS, v, Bc)
    dBc = torch.einsum("bchpn,bhcl,bclhp->bclhn", dS, v, xc)
    dv = torch.einsum("bchpn,bclhp,bclhn->bhcl", dS, xc, Bc)
    dexp = dv * v                                   # v ~ exp(dA[last] - dA[t])
    ddA = -dexp
    ddA[..., -1] += dexp.sum(-1)
    return _unchunk(dxc, seqlen), _unchunk(dBc, seqlen), dv * decay, ddA


# (a) chunk_cumsum and dt processing --------------------------------------------------------------

def chunk_cumsum_backward(ddt_out, ddA_cumsum, dt, A, chunk_size, dt_bias=None,
                          dt_softplus=False, dt_limit=(0.0, math.inf)):
    """dA_cumsum = cumsum(dt_out * A) inside each chunk, dt_out = clamp(softplus(dt + dt_bias)):
    -> (ddt (b, L, h), dA (h,), ddt_bias (h,) or None)."""
    raw = dt + dt_bias if dt_bias is not None else dt
    soft = torch.where(raw <= 20.0, F.softplus(raw), raw) if dt_softplus else raw
    dt_out = _chunk(soft.clamp(min=dt_limit[0], max=dt_limit[1]), chunk_size).permute(0, 3, 1, 2)
    dprod = ddA_cumsum.flip(-1).cumsum(-1).flip(-1)                          # a reverse cumsum
    dA = (dprod * dt_out).sum((0, 2, 3))
    ddt_out = ddt_out + dprod * A[:, None, None]
    ddt = _unchunk(ddt_out.permute(0, 2, 3, 1), dt.shape[1])
    # the clamp passes the gradient inside [min, max]; softplus' derivative is the sigmoid
    ddt = ddt * ((soft >= dt_limit[0]) & (soft <= dt_limit[1])).to(ddt.dtype)
    if dt_softplus:
        ddt = ddt * torch.where(raw <= 20.0, torch.sigmoid(raw), torch.ones_like(raw))
    return ddt, dA, None if dt_bias is None else ddt.sum((0, 1))


# All together ------------------------------------------------------------------------------------

def ssd_chunked_backward(dout, dfinal, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                         initial_states=None, seq_idx=None, dt_softplus=False,
                         dt_limit=(0.0, math.inf)):
    """Gradients of ``ssd_chunked``'s (out, final_states) with respect to its inputs.

    ``dout`` (b, L, h, p) and ``dfinal`` (b, h, p, n) (either may be None: zero) are the
    gradients of the loss with respect to the outputs. Returns a dict with dx, ddt, dA, dB, dC
    and, for the inputs given, dD, dz, ddt_bias, dinitial_states, in the compute dtype (float64
    for float64 inputs, else float32). The forward's intermediates are recomputed (steps (a)
    and (b) of ``reference.chunked``)."""
    cdt = compute_dtype(x, dt, A, B, C)
    ngroups = B.shape[2]
    to = lambda t: None if t is None else t.to(cdt)
    x, dt, A, B, C, D, z, dt_bias, initial_states = map(
        to, (x, dt, A, B, C, D, z, dt_bias, initial_states))
    dout = torch.zeros_like(x) if dout is None else dout.to(cdt)
    dfinal = to(dfinal)

    dt_out, dA_cumsum = chunked.chunk_cumsum(dt, A, chunk_size, dt_bias, dt_softplus, dt_limit)
    entry, final = chunked.fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx)
    y = chunked.compute_out(x, B, C, dt_out, dA_cumsum, entry, seq_idx=seq_idx)

    dy, dx, dD, dz = gate_and_skip_backward(dout, y, x, D, z)
    dx_c, dB, dC, ddt_out, ddA, dentry = compute_out_backward(dy, x, B, C, dt_out, dA_cumsum,
                                                              entry, seq_idx)
    dS, ddA_pass, dinitial = state_passing_backward(dentry, dfinal, entry, final, dA_cumsum,
                                                    seq_idx)
    dx_s, dB_s, ddt_s, ddA_s = chunk_states_backward(dS, x, B, dt_out, dA_cumsum, seq_idx)
    ddt, dA, ddt_bias = chunk_cumsum_backward(ddt_out + ddt_s, ddA + ddA_pass + ddA_s, dt, A,
                                              chunk_size, dt_bias, dt_softplus, dt_limit)
    grads = {"dx": dx_c + dx_s + (0 if dx is None else dx), "ddt": ddt, "dA": dA,
             "dB": _sum_groups(dB + dB_s, ngroups), "dC": _sum_groups(dC, ngroups)}
    extra = {"dD": dD, "dz": dz, "ddt_bias": ddt_bias,
             "dinitial_states": dinitial if initial_states is not None else None}
    grads.update({k: v for k, v in extra.items() if v is not None})
    return grads
