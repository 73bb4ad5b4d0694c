"""The final state of each packed sequence (``return_varlen_states``), from the forward's
intermediates.

With several sequences packed along one row (batch 1) and ``cu_seqlens`` their boundaries,
sequence k covers tokens [s, e] with s = cu_seqlens[k], e = cu_seqlens[k + 1] - 1, and ends in
chunk c = e // chunk. Its final state is what the chunked algorithm knows at token e:

    decay(c, e) * entry_state[c]        if the sequence was already running when chunk c started,
                                        or it is the first sequence and its id is 0 (chunk 0's
                                        entry state is the initial state, which belongs to
                                        sequence id 0, as in the outputs)
  + sum over tokens t of chunk c with s <= t <= e of decay(t, e) * dt[t] * outer(x[t], B[t])

where decay(t, e) is the decay from token t to token e inside the chunk (``exp`` or ``exp2`` of
the difference of the within-chunk cumulative sums). A token enters at most one sum, that of its
own sequence, and only if it lies in that sequence's last chunk: the work is at most one pass
over the tokens, done here with PyTorch's batched matrix products, a group of sequences at a time.
"""
import torch

# Sequences per group: bounds the gathered (group, chunk, heads, headdim + dstate) operands.
GATHER_BUDGET = 1 << 26          # elements


def varlen_states(x, B, dt_out, dA_cumsum, entry_states, cu_seqlens, seq_idx=None, exp=torch.exp):
    """Each sequence's final state, (nseq, h, p, n) float32 (float64 for float64 inputs).

    x (1, L, h, p), B (1, L, g, n); dt_out, dA_cumsum (1, h, nchunks, chunk) from
    ``chunk_cumsum`` (``exp`` turns a difference of dA_cumsum into a decay: ``torch.exp`` for
    natural-log units, ``torch.exp2`` for the kernels' log2 units); entry_states
    (1, nchunks, h, p, n); cu_seqlens (nseq + 1,) integer, checked by the caller; seq_idx
    (1, L), the ids the forward ran with (None: the first sequence is id 0)."""
    _, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    chunk = dt_out.shape[3]
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    starts = cu_seqlens[:-1].long()
    ends = cu_seqlens[1:].long() - 1                                  # last token of each
    nseq = ends.shape[0]
    out = torch.empty(nseq, h, p, n, dtype=cdt, device=x.device)
    group = max(1, GATHER_BUDGET // (chunk * h * (p + n)))
    pos = torch.arange(chunk, device=x.device)
    # Whether the first sequence owns the initial state (a tensor: no synchronisation).
    first_owns = (torch.ones((), dtype=torch.bool, device=x.device) if seq_idx is None
                  else seq_idx[0, 0] == 0)
    for first in range(0, nseq, group):
        s, e = starts[first:first + group], ends[first:first + group]
        c, last = e // chunk, e % chunk                                 # (k,)
        tokens = (c * chunk)[:, None] + pos                             # (k, chunk)
        inside = (pos <= last[:, None]) & (tokens >= s[:, None])        # the sequence's tokens
        tokens = tokens.clamp(max=L - 1)
        xk = x[0, tokens].to(cdt)                                        # (k, chunk, h, p)
        bk = B[0, tokens].to(cdt).repeat_interleave(h // g, dim=2)      # (k, chunk, h, n)
        dA = dA_cumsum[0][:, c].to(cdt).transpose(0, 1)                  # (k, h, chunk)
        dt = dt_out[0][:, c].to(cdt).transpose(0, 1)
        dA_end = dA.gather(2, last[:, None, None].expand(-1, h, 1))      # (k, h, 1)
        # Masked before the exponential, so a token after e (a positive exponent) never reaches it.
        expo = torch.where(inside[:, None, :], dA_end - dA, float("-inf"))
        w = exp(expo) * dt                                               # (k, h, chunk)
        states = torch.einsum("khc,kchp,kchn->khpn", w, xk, bk)
        is_first = torch.arange(first, first + len(s), device=x.device) == 0
        carried = (s < c * chunk) | (is_first & first_owns)
        decay = exp(dA_end[..., 0]) * carried[:, None]                   # (k, h)
        states += decay[..., None, None] * entry_states[0, c].to(cdt)
        out[first:first + group] = states
    return out
