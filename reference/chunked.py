"""The chunked matmul formulation, split into the steps the three kernels implement.

The sequence is cut into chunks of ``chunk_size`` tokens (the last one may be partial and is
padded with tokens that have ``dt = 0``, which neither decay nor write the state). Then:

  (a) ``chunk_cumsum``  within each chunk, the running sum of ``dt * A``: the log of how much
                        the state decays from the chunk's start to each token;
  (b) ``fwd_pass_state`` each chunk's own contribution to the state (a matrix product), then a
                        short sequential pass over chunks giving the state every chunk starts
                        from ("entry state") and the final state;
  (c) ``compute_out``   outputs = the quadratic form inside the chunk (diagonal block)
                        + the entry state read through C (off-diagonal blocks) + D x, gated by z.

Only (b)'s pass over chunks is sequential, and it has L / chunk_size steps instead of L.
Everything else is batched matrix products: what tensor cores are for.

Layouts of the intermediates (the kernels use the same ones):

    dt_out, dA_cumsum   (batch, nheads, nchunks, chunk_size)          processed dt; 0 past seqlen
    entry_states        (batch, nchunks, nheads, headdim, dstate)     state before each chunk
    final_states        (batch, nheads, headdim, dstate)

Units: ``dA_cumsum`` here is in natural-log units (decay = exp(dA_cumsum)). The kernels store
it pre-multiplied by log2(e) so they can use the cheaper exp2; compare with ``* LOG2E``.
Packed sequences (``seq_idx``) follow mamba_ssm: a token only sees earlier tokens with the same
id, a chunk's state only collects tokens of the sequence its last token belongs to, and the
entry state of a chunk only reaches tokens of the sequence that was running at its start.
"""
import math

import torch
import torch.nn.functional as F

from .common import apply_skip_and_gate, compute_dtype, expand_groups, process_dt
from .quadratic import decay_mask


def nchunks_of(seqlen, chunk_size):
    return -(-seqlen // chunk_size)


def _pad_to_chunks(t, chunk_size, dim=1, value=0):
    """Pad dimension ``dim`` (the sequence) up to a multiple of chunk_size."""
    pad = nchunks_of(t.shape[dim], chunk_size) * chunk_size - t.shape[dim]
    if pad == 0:
        return t
    widths = [0, 0] * (t.dim() - dim - 1) + [0, pad]
    return F.pad(t, widths, value=value)


def _chunk(t, chunk_size):
    """(b, L, ...) -> (b, nchunks, chunk_size, ...), zero-padded."""
    t = _pad_to_chunks(t, chunk_size)
    return t.reshape(t.shape[0], -1, chunk_size, *t.shape[2:])


def seq_idx_at_chunk_ends(seq_idx, chunk_size):
    """(b, L) -> (b, nchunks): the sequence id of each chunk's last real token."""
    seqlen = seq_idx.shape[1]
    ends = torch.arange(1, nchunks_of(seqlen, chunk_size) + 1, device=seq_idx.device) * chunk_size
    return seq_idx[:, ends.clamp(max=seqlen) - 1]


def seq_idx_before_chunks(seq_idx, chunk_size):
    """(b, L) -> (b, nchunks): the id of the sequence running when each chunk starts (0 before token 0)."""
    ends = seq_idx_at_chunk_ends(seq_idx, chunk_size)
    return F.pad(ends[:, :-1], (1, 0), value=0)


# (a) ------------------------------------------------------------------------------------------

def chunk_cumsum(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """dt (b, L, h), A (h,) -> dt_out, dA_cumsum, both (b, h, nchunks, chunk_size).

    ``dA_cumsum[..., t] = sum_{s <= t} dt_out[..., s] * A`` within each chunk, natural-log units.
    Padding tokens past seqlen get dt_out = 0, so the cumsum stays flat there.
    """
    cdt = compute_dtype(dt, A)
    dt_out = process_dt(dt.to(cdt), None if dt_bias is None else dt_bias.to(cdt), dt_softplus, dt_limit)
    dt_out = _chunk(dt_out, chunk_size).permute(0, 3, 1, 2)         # (b, h, c, l)
    dA_cumsum = torch.cumsum(dt_out * A.to(cdt)[:, None, None], dim=-1)
    return dt_out.contiguous(), dA_cumsum.contiguous()


# (b) ------------------------------------------------------------------------------------------

def chunk_states(x, B, dt_out, dA_cumsum, seq_idx=None):
    """Each chunk's state if it had started from zero: (b, nchunks, h, p, n).

    ``sum_t exp(dA_cumsum[last] - dA_cumsum[t]) * dt_t * outer(x_t, B_t)``: every token's write,
    decayed from its position to the end of the chunk. One matrix product per chunk and head.
    """
    chunk_size = dt_out.shape[-1]
    cdt = dA_cumsum.dtype
    xc = _chunk(x.to(cdt), chunk_size)                                   # (b, c, l, h, p)
    Bc = _chunk(expand_groups(B.to(cdt), x.shape[2]), chunk_size)       # (b, c, l, h, n)
    weight = state_write_decay(dA_cumsum, seq_idx) * dt_out             # (b, h, c, l)
    return torch.einsum("bclhp,bhcl,bclhn->bchpn", xc, weight, Bc)


def state_write_decay(dA_cumsum, seq_idx=None):
    """exp(dA_cumsum[last] - dA_cumsum[t]) (b, h, c, l): how much token t's write to the state
    decays by the chunk's end; 0 for tokens of another sequence than the chunk's last token's."""
    chunk_size = dA_cumsum.shape[-1]
    decay = torch.exp(dA_cumsum[..., -1:] - dA_cumsum)
    if seq_idx is not None:
        same = _chunk(seq_idx, chunk_size) == seq_idx_at_chunk_ends(seq_idx, chunk_size)[..., None]
        decay = decay * same[:, None]                                    # (b, 1, c, l)
    return decay


def chunk_decays(dA_cumsum, seq_idx=None):
    """exp(dA_cumsum[c, last]) (b, h, c): how much the carried state decays over chunk c; 0 where
    a new sequence starts inside the chunk (the carried state is dropped there)."""
    decay = torch.exp(dA_cumsum[..., -1])
    if seq_idx is not None:
        chunk_size = dA_cumsum.shape[-1]
        same = seq_idx_at_chunk_ends(seq_idx, chunk_size) == seq_idx_before_chunks(seq_idx, chunk_size)
        decay = decay * same[:, None]
    return decay


def state_passing(states, dA_cumsum, initial_states=None, seq_idx=None):
    """The only sequential step: walk the chunks in order.

    ``entry[c] = running``;  ``running = exp(dA_cumsum[c, last]) * running + states[c]``.
    Returns (entry_states (b, c, h, p, n), final_states (b, h, p, n)). Where a new sequence
    starts inside chunk c, the carried state is dropped instead of decayed.
    """
    batch, nchunks, nheads, headdim, dstate = states.shape
    running = (torch.zeros_like(states[:, 0]) if initial_states is None
               else initial_states.to(states.dtype).clone())
    chunk_decay = chunk_decays(dA_cumsum, seq_idx)                       # (b, h, c)
    entry = []
    for c in range(nchunks):
        entry.append(running)
        running = chunk_decay[:, :, c, None, None] * running + states[:, c]
    return torch.stack(entry, dim=1), running


def fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states=None, seq_idx=None):
    """(b) as the kernel computes it: chunk states and the pass over chunks, together."""
    states = chunk_states(x, B, dt_out, dA_cumsum, seq_idx)
    return state_passing(states, dA_cumsum, initial_states, seq_idx)


# (c) ------------------------------------------------------------------------------------------

def compute_out(x, B, C, dt_out, dA_cumsum, entry_states, D=None, z=None, seq_idx=None):
    """Outputs (b, L, h, p) in the compute dtype (float32 or float64), before casting to x's dtype.

    diagonal block:  y_l  = sum_{s <= l} (C_l . B_s) exp(dA_cumsum[l] - dA_cumsum[s]) dt_s x_s
    entry state:     y_l += exp(dA_cumsum[l]) * (entry_state @ C_l)
    """
    chunk_size = dt_out.shape[-1]
    cdt = dA_cumsum.dtype
    seqlen, nheads = x.shape[1], x.shape[2]
    xc = _chunk(x.to(cdt), chunk_size)                                   # (b, c, l, h, p)
    Bc = _chunk(expand_groups(B.to(cdt), nheads), chunk_size)           # (b, c, s, h, n)
    Cc = _chunk(expand_groups(C.to(cdt), nheads), chunk_size)           # (b, c, l, h, n)

    # Diagonal block: C B^T, the decay mask, and dt x, all within one chunk.
    mask, carried_decay = output_decays(dA_cumsum, seq_idx)
    scores = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc) * mask
    y = torch.einsum("bhcls,bhcs,bcshp->bclhp", scores, dt_out, xc)

    # Off-diagonal blocks: the state each chunk starts from, decayed to each token, read by C.
    carry = torch.einsum("bclhn,bchpn->bclhp", Cc, entry_states.to(cdt))
    carry = carry * carried_decay[..., None]
    y = (y + carry).reshape(x.shape[0], -1, nheads, x.shape[3])[:, :seqlen]

    return apply_skip_and_gate(y, x.to(cdt), None if D is None else D.to(cdt),
                               None if z is None else z.to(cdt))


def output_decays(dA_cumsum, seq_idx=None):
    """The decays of (c): M (b, h, c, l, s) = exp(dA_cumsum[l] - dA_cumsum[s]) for s <= l of one
    sequence, else 0 (the diagonal block's mask), and exp(dA_cumsum[l]) (b, c, l, h), 0 for tokens
    of another sequence than the one running at the chunk's start (the carried-in term's)."""
    b, h, c, l = dA_cumsum.shape
    carried = torch.exp(dA_cumsum).permute(0, 2, 3, 1)
    if seq_idx is None:
        return decay_mask(dA_cumsum), carried
    seq_c = _pad_to_chunks(seq_idx, l, value=-1).reshape(b, c, l)
    # decay_mask takes seq ids as (batch, n): fold the chunks into the batch.
    mask = decay_mask(dA_cumsum.permute(0, 2, 1, 3).reshape(b * c, h, l), seq_c.reshape(b * c, l))
    running = seq_idx_before_chunks(seq_idx, l)                          # (b, c)
    carried = carried * (seq_c == running[..., None])[..., None]
    return mask.reshape(b, c, h, l, l).permute(0, 2, 1, 3, 4), carried


# All together ---------------------------------------------------------------------------------

def ssd_chunked(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False):
    """The full forward pass, step by step. Same results as ``ssd_sequential``."""
    cdt = compute_dtype(x, dt, A, B, C)
    dt_out, dA_cumsum = chunk_cumsum(dt.to(cdt), A.to(cdt), chunk_size, dt_bias, dt_softplus, dt_limit)
    entry_states, final_states = fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx)
    y = compute_out(x, B, C, dt_out, dA_cumsum, entry_states, D, z, seq_idx)
    out = y.to(x.dtype)
    return (out, final_states) if return_final_states else out
