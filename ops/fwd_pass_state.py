"""Kernel (b): every chunk's state, and the pass over chunks that chains them.

The state of one head is a (headdim, dstate) matrix. A chunk adds to it

    chunk_state = sum_t  exp2(dA[last] - dA[t]) * dt[t] * outer(x[t], B[t])
                = (x * w)^T @ B          with w[t] = exp2(dA[last] - dA[t]) * dt[t]

(a (headdim, chunk) x (chunk, dstate) matrix product), and carries in the state it started
from, decayed over the whole chunk:

    entry[c]  = running
    running   = exp2(dA[c, last]) * running + chunk_state[c]

What one block does
    One block owns one (batch, head, headdim tile, dstate tile) slice of the state: a
    (BLOCK_P, BLOCK_N) tile that stays in registers, in float32, for the whole sequence. It walks
    the chunks in order; for each chunk it loads x (CHUNK, BLOCK_P), B (CHUNK, BLOCK_N) and the
    chunk's dt and dA, computes the chunk's state with one ``ct.mma``, writes the running state
    out as that chunk's entry state, and updates the running state. The final running state is
    the final state.

The grid
    ``(cdiv(headdim, BLOCK_P) * cdiv(dstate, BLOCK_N), nheads, batch)``. Blocks are independent
    (state entries never mix across heads, headdim rows or dstate columns); only the loop over
    chunks inside a block is sequential. The loads of chunk c + 1 don't depend on the running
    state, so they can be in flight while chunk c is being folded in.

Parallelism
    That grid is small: batch * nheads * (headdim / BLOCK_P) * (dstate / BLOCK_N) blocks, e.g.
    80 for a 2.7B-sized layer (h=80, p=64, n=128) with 64 x 128 tiles, against 132
    multiprocessors on an H200. Narrower tiles give more blocks but read x once per dstate
    tile and B once per headdim tile; at 128K tokens, 64 x 128 with 16-bit entry states
    measured fastest (2.1 ms, against 2.8-6 ms for 64 x 32..64 and 16..32 x 64..128), and
    64 x 64 with float32 entry states. Each block is latency-bound on its chunk-by-chunk loads
    (~1 TB/s overall); occupancy hints and load latency hints changed nothing, so a faster
    version needs more memory in flight per block (several chunks per iteration) or a parallel
    chunk-state pass ahead of a light sequential one, as mamba_ssm does.

Packed sequences (seq_idx)
    Only tokens of the sequence that the chunk's last token belongs to write the chunk's state,
    and the carried state is dropped (not decayed) when the chunk's last token belongs to a
    different sequence than the one running at the chunk's start (id 0 before token 0, which is
    the sequence ``initial_states`` belongs to).

Precision
    The weighted x is cast back to x's dtype before the product, as mamba_ssm does: 16-bit inputs
    give 16-bit tensor-core operands with a float32 accumulator; float32 inputs give float32
    operands (full float32 products, not tf32).
"""
import torch

import cuda.tile as ct

from .chunk_cumsum import new_output
from .launch import launch

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO


@ct.kernel
def fwd_pass_state_kernel(
    x: ct.IndexedWithInt64,               # (batch, seqlen, nheads, headdim)
    B: ct.IndexedWithInt64,               # (batch, seqlen, ngroups, dstate)
    dt_out: ct.IndexedWithInt64,          # (batch, nheads, nchunks, CHUNK) float32
    dA_cumsum: ct.IndexedWithInt64,       # (batch, nheads, nchunks, CHUNK) float32, log2 units
    initial_states: ct.IndexedWithInt64,  # (batch, nheads, headdim, dstate), unread if not HAS_INIT
    seq_idx: ct.IndexedWithInt64,         # (batch, seqlen) int32, unread if not HAS_SEQ_IDX
    entry_states: ct.IndexedWithInt64,    # (batch, nchunks, nheads, headdim, dstate)
    final_states: ct.IndexedWithInt64,    # (batch, nheads, headdim, dstate) float32
    heads_per_group: int,
    CHUNK: ConstInt,
    BLOCK_P: ConstInt,
    BLOCK_N: ConstInt,
    HAS_INIT: ConstBool,
    HAS_SEQ_IDX: ConstBool,
):
    # Every array that grows with the sequence is IndexedWithInt64: offsets like
    # token * nheads * headdim exceed 2**31 for long sequences, so shapes, strides and tile
    # indices are kept in 64 bits (a few extra integer instructions per tile, nothing per element).
    tile_id = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    n_ptiles = ct.cdiv(x.shape[3], BLOCK_P)
    pi = tile_id % n_ptiles         # neighbouring blocks share the dstate tile, hence B
    ni = tile_id // n_ptiles
    g = h // heads_per_group        # the group whose B this head reads
    seqlen = x.shape[1]
    nchunks = dt_out.shape[2]

    if HAS_INIT:
        running = ct.load(initial_states, (b, h, pi, ni), shape=(1, 1, BLOCK_P, BLOCK_N),
                          padding_mode=ZERO)
        running = ct.reshape(running, (BLOCK_P, BLOCK_N)).astype(ct.float32)
    else:
        running = ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32)
    running_seq = ct.zeros((), dtype=ct.int32)   # id of the sequence the running state belongs to

    for c in range(nchunks):
        # The state this chunk starts from. (Tiles past headdim / dstate are dropped.)
        ct.store(entry_states, (b, c, h, pi, ni),
                 ct.reshape(running, (1, 1, 1, BLOCK_P, BLOCK_N)).astype(entry_states.dtype))

        # The last chunk may be partial: zero padding gives x = B = 0 there (and dt is 0 too).
        xt = ct.load(x, (b, c, h, pi), shape=(1, CHUNK, 1, BLOCK_P), padding_mode=ZERO)
        xt = ct.reshape(xt, (CHUNK, BLOCK_P))
        bt = ct.load(B, (b, c, g, ni), shape=(1, CHUNK, 1, BLOCK_N), padding_mode=ZERO)
        bt = ct.reshape(bt, (CHUNK, BLOCK_N)).astype(x.dtype)
        dA = ct.reshape(ct.load(dA_cumsum, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
        dt = ct.reshape(ct.load(dt_out, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))

        # Decay from each token to the end of the chunk. The exponent is <= 0 for A <= 0;
        # the clamp makes sure exp2 can never overflow whatever the rounding.
        dA_last = ct.extract(dA, (CHUNK - 1,), shape=(1,)).item()
        w = ct.exp2(ct.minimum(dA_last - dA, 0.0)) * dt
        chunk_decay = ct.exp2(dA_last)

        if HAS_SEQ_IDX:
            last_token = min((c + 1) * CHUNK, seqlen) - 1
            seq_last = ct.load(seq_idx, (b, last_token), shape=())
            seq = ct.reshape(ct.load(seq_idx, (b, c), shape=(1, CHUNK), padding_mode=ZERO),
                             (CHUNK,))
            w = ct.where(seq == seq_last, w, 0.0)       # other sequences don't write
            chunk_decay = ct.where(seq_last == running_seq, chunk_decay, 0.0)
            running_seq = seq_last

        # (x * w)^T @ B: a (BLOCK_P, CHUNK) x (CHUNK, BLOCK_N) product on the tensor cores.
        xw = (xt.astype(ct.float32) * w[:, None]).astype(x.dtype)
        chunk_state = ct.mma(ct.transpose(xw), bt, ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32))
        running = chunk_decay * running + chunk_state

    ct.store(final_states, (b, h, pi, ni), ct.reshape(running, (1, 1, BLOCK_P, BLOCK_N)))


def _pow2_in(value, lo, hi):
    return isinstance(value, int) and lo <= value <= hi and value & (value - 1) == 0


def check_sizes(headdim, dstate):
    """headdim and dstate become tile dimensions, which must be powers of two."""
    if not _pow2_in(headdim, 16, 128):
        raise ValueError(f"headdim must be a power of two in [16, 128], got {headdim}")
    if not _pow2_in(dstate, 16, 512):
        raise ValueError(f"dstate must be a power of two in [16, 512], got {dstate}")


def pick_tiles(headdim, dstate, states_dtype, block_p=None, block_n=None):
    """Default tiles for an H200 (see "Parallelism"): 64 headdim rows; 128 dstate columns
    with 16-bit entry states, 64 with float32 ones (twice the bytes to store per chunk)."""
    bp = min(block_p or 64, headdim)
    wide = states_dtype in (torch.bfloat16, torch.float16)
    bn = min(block_n or (128 if wide else 64), dstate)
    return bp, bn


def fwd_pass_state_plan(x, B, dt_out, dA_cumsum, initial_states=None, seq_idx=None,
                        states_dtype=torch.float32, block_p=None, block_n=None, poison=False):
    """Allocate the outputs and build (grid, kernel, args, outputs) without launching."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    check_sizes(headdim, dstate)
    if nheads % ngroups:
        raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
    nchunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    bp, bn = pick_tiles(headdim, dstate, states_dtype, block_p, block_n)

    entry_states = new_output((batch, nchunks, nheads, headdim, dstate), states_dtype, x.device,
                              poison)
    final_states = new_output((batch, nheads, headdim, dstate), torch.float32, x.device, poison)
    if seq_idx is not None and seq_idx.dtype != torch.int32:
        seq_idx = seq_idx.to(torch.int32)
    # Absent optional tensors are replaced by an input the compiled variant never reads.
    args = (x, B, dt_out, dA_cumsum,
            initial_states if initial_states is not None else x,
            seq_idx if seq_idx is not None else dt_out,
            entry_states, final_states,
            nheads // ngroups, chunk_size, bp, bn,
            initial_states is not None, seq_idx is not None)
    grid = ((-(-headdim // bp)) * (-(-dstate // bn)), nheads, batch)
    return grid, fwd_pass_state_kernel, args, (entry_states, final_states)


def fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states=None, seq_idx=None,
                   states_dtype=torch.float32, poison=False):
    """-> (entry_states (b, nchunks, h, p, n), final_states (b, h, p, n) float32).

    dt_out and dA_cumsum come from ``chunk_cumsum`` (dA_cumsum in log2 units). entry_states is
    float32 unless ``states_dtype`` says otherwise (16 bits halves its traffic; compute_out
    rounds it to C's dtype for its product anyway). Inputs must be contiguous.
    ``poison=True`` NaN-fills the outputs first (for tests).
    """
    grid, kernel, args, outs = fwd_pass_state_plan(x, B, dt_out, dA_cumsum, initial_states,
                                                   seq_idx, states_dtype, poison=poison)
    launch(grid, kernel, args)
    return outs
