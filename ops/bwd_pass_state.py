"""Backward kernel: the pass over chunks in reverse, the gradient of every chunk's state.

The forward pass over chunks (``ops/fwd_pass_state.py``) is

    entry[c + 1] = a[c] * entry[c] + S[c]      a[c] = exp2(dA[c, last]), 0 where a new
                                                sequence starts inside chunk c
    entry[nchunks] = the final state

so the gradients flow the other way: with g the gradient of entry[c + 1] (that of the final
state for the last chunk),

    dS[c]     = g
    d a[c]    = sum(g * entry[c])               -> the gradient of dA[c, last]: d a[c] * a[c]
    g         <- a[c] * g + dentry[c]           (dentry: what compute_out's backward gives)

and the g left after chunk 0 is the gradient of the initial state. As in the forward, one block
owns one (batch, head, headdim tile, dstate tile) slice and keeps its float32 tile of g in
registers while it walks the chunks, here from the last to the first; blocks are independent.

The sum over the state for d a[c] spans the block's tile only: each block writes its partial
sum, and the host adds the tiles' partials (a fixed order: the result is bitwise reproducible,
no atomics). ``reference.backward.state_passing_backward`` is the specification.
"""
import torch

import cuda.tile as ct

from .fwd_pass_state import load_state, pick_tiles
from .launch import Plan, fit_index_width, run
from .utils import ZERO, ConstBool, ConstInt, as_int32, cdiv, new_output


def chunk_state_tile(array, b, c, h, pi, ni, BLOCK_P, BLOCK_N):
    """Tile (pi, ni) of chunk c of a (batch, nchunks, nheads, headdim, dstate) array as float32
    (zero-padded); ``fwd_pass_state.load_state`` reads the (batch, nheads, ...) ones."""
    t = ct.load(array, (b, c, h, pi, ni), shape=(1, 1, 1, BLOCK_P, BLOCK_N), padding_mode=ZERO)
    return ct.reshape(t, (BLOCK_P, BLOCK_N)).astype(ct.float32)


@ct.kernel
def bwd_pass_state_kernel(
    dentry: ct.IndexedWithInt64,       # (batch, nchunks, nheads, headdim, dstate)
    dfinal,                            # (batch, nheads, headdim, dstate); unread if not HAS_DFINAL
    entry: ct.IndexedWithInt64,        # (batch, nchunks, nheads, headdim, dstate), the forward's
    dA_cumsum: ct.IndexedWithInt64,    # (batch, nheads, nchunks, CHUNK) float32, log2 units
    seq_idx: ct.IndexedWithInt64,      # (batch, seqlen) int32; unread if not HAS_SEQ_IDX
    dS: ct.IndexedWithInt64,           # (batch, nchunks, nheads, headdim, dstate) float32
    da_parts,                          # (batch, nheads, nchunks, tiles) float32
    dinitial,                          # (batch, nheads, headdim, dstate) float32
    CHUNK: ConstInt,
    BLOCK_P: ConstInt,
    BLOCK_N: ConstInt,
    HAS_DFINAL: ConstBool,
    HAS_SEQ_IDX: ConstBool,
):
    tile_id, h, b = ct.bid(0), ct.bid(1), ct.bid(2)
    n_ptiles = ct.cdiv(entry.shape[3], BLOCK_P)
    pi, ni = tile_id % n_ptiles, tile_id // n_ptiles
    nchunks = dA_cumsum.shape[2]
    if HAS_DFINAL:
        g = load_state(dfinal, b, h, pi, ni, BLOCK_P, BLOCK_N, False, 0)
    else:
        g = ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32)
    for i in range(nchunks):
        c = nchunks - 1 - i                                   # the chunks, last first
        ct.store(dS, (b, c, h, pi, ni), ct.reshape(g, (1, 1, 1, BLOCK_P, BLOCK_N)))
        dA = ct.reshape(ct.load(dA_cumsum, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
        a = ct.exp2(ct.extract(dA, (CHUNK - 1,), shape=(1,)).item())
        if HAS_SEQ_IDX:
            seqlen = seq_idx.shape[1]
            seq_end = ct.load(seq_idx, (b, min((c + 1) * CHUNK, seqlen) - 1), shape=())
            seq_start = ct.load(seq_idx, (b, max(c * CHUNK - 1, 0)), shape=())
            seq_start = ct.where(c == 0, 0, seq_start)       # id 0 before token 0
            a = ct.where(seq_end == seq_start, a, 0.0)
        e = chunk_state_tile(entry, b, c, h, pi, ni, BLOCK_P, BLOCK_N)
        ct.store(da_parts, (b, h, c, tile_id), ct.sum(g * e) * a)
        g = a * g + chunk_state_tile(dentry, b, c, h, pi, ni, BLOCK_P, BLOCK_N)
    ct.store(dinitial, (b, h, pi, ni), ct.reshape(g, (1, 1, BLOCK_P, BLOCK_N)))


def bwd_pass_state_plan(dentry, dfinal, entry, dA_cumsum, seq_idx=None, block_p=None,
                        block_n=None, poison=False):
    """The launch (an ``ops.launch.Plan``; outputs dS, the per-tile partials of d dA[last],
    dinitial). ``dfinal`` may be None (a zero gradient)."""
    batch, nchunks, nheads, headdim, dstate = entry.shape
    chunk_size = dA_cumsum.shape[3]
    bp, bn = pick_tiles(headdim, dstate, entry.dtype, block_p, block_n)
    tiles = cdiv(headdim, bp) * cdiv(dstate, bn)
    dS = new_output(entry.shape, torch.float32, entry.device, poison)
    da_parts = new_output((batch, nheads, nchunks, tiles), torch.float32, entry.device, poison)
    dinitial = new_output((batch, nheads, headdim, dstate), torch.float32, entry.device, poison)
    seq_idx = as_int32(seq_idx)
    args = (dentry, dfinal if dfinal is not None else dinitial, entry, dA_cumsum,
            seq_idx if seq_idx is not None else dA_cumsum, dS, da_parts, dinitial,
            chunk_size, bp, bn, dfinal is not None, seq_idx is not None)
    return Plan((tiles, nheads, batch), fit_index_width(bwd_pass_state_kernel, args), args,
                (dS, da_parts, dinitial))


def bwd_pass_state(dentry, dfinal, entry, dA_cumsum, seq_idx=None, poison=False):
    """-> (dS (b, c, h, p, n) float32, d dA_cumsum at each chunk's last token (b, h, c) float32,
    in natural-log units like ``reference.backward.state_passing_backward``'s, dinitial
    (b, h, p, n) float32). ``dA_cumsum`` in the kernels' log2 units."""
    dS, da_parts, dinitial = run(bwd_pass_state_plan(dentry, dfinal, entry, dA_cumsum, seq_idx,
                                                     poison=poison))
    return dS, da_parts.sum(-1), dinitial
