"""Kernel (c): the outputs, from the entry states and the quadratic form inside each chunk.

For a token l of chunk c (positions and dA relative to the chunk, dA in log2 units):

    y[l] = exp2(dA[l]) * (C[l] @ entry_state[c]^T)                          (carried in)
         + sum_{s <= l} (C[l] . B[s]) * exp2(dA[l] - dA[s]) * dt[s] * x[s]   (inside the chunk)
         + D * x[l]
    out[l] = y[l] * silu(z[l])

What one block does
    One block computes BLOCK_M consecutive output rows (tokens) of one chunk, for one head and
    one tile of BLOCK_P headdim columns (by default the whole headdim). It keeps a float32
    (BLOCK_M, BLOCK_P) accumulator in registers and

      1. reads the entry state through C: acc = C_rows @ state^T, scaled row-wise by
         exp2(dA[l]);
      2. walks the column tiles (BLOCK_K source tokens each) from the chunk's start up to the
         tile containing its last row (causality: later tokens never contribute). For each
         it forms CB = C_rows @ B_cols^T (a BLOCK_M x BLOCK_K tile that never leaves the chip),
         weights it by the decay exp2(dA[l] - dA[s]) and dt[s], and accumulates
         acc += weights @ x_cols on the tensor cores;
      3. adds D * x, gates with z * sigmoid(z), casts to x's dtype and stores.

    When dstate fits in one tile (DSTATE_TILE == dstate, the default up to 128), the C rows are
    loaded once and reused by every product of the block; larger dstates are split into
    DSTATE_TILE-wide slices that are summed.

The grid
    ``(nheads * cdiv(headdim, BLOCK_P) * cdiv(seqlen, BLOCK_M), batch)``, heads varying
    fastest: blocks that run at the same time work on the same tokens for different heads, so
    the B and C tiles they share (one group serves many heads) come from L2 instead of being
    fetched again from memory for every head. There is one block per row tile of the whole
    sequence, so a partial last chunk simply has fewer row tiles and no block ever loads a
    tile lying entirely past the end. All blocks are independent; the only sequential part is
    the short loop over column tiles inside a block (at most CHUNK / BLOCK_K steps).

Masks
    The causal mask (s > l) and, with seq_idx, the "same sequence" mask are applied to the
    exponent before exp2 (masked entries get -inf, i.e. weight 0) and the kept exponents are
    clamped to <= 0, so nothing overflows however long the chunk or large |A|. With seq_idx, the
    entry state only reaches tokens of the sequence that was running at the chunk's start.

Precision
    16-bit inputs: C, B, the entry state and the weights are rounded to 16 bits for the
    products (as in mamba_ssm), all accumulation is float32. float32 inputs: float32 operands
    throughout (full float32 products, not tf32).
"""
import math

import torch

import cuda.tile as ct

from .chunk_cumsum import new_output
from .fwd_pass_state import check_sizes
from .launch import launch

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO
NEG_INF = -math.inf


# Blocks resident per multiprocessor. This kernel is latency-bound (each column tile is a chain
# load -> product -> exp2 -> product), so several blocks per multiprocessor must overlap: at
# 128K tokens (h=80, p=64, n=128, bf16) 64-row tiles took 10.9 ms with the compiler's default,
# 5.8 ms at 2 and 4.6 ms at 3 blocks per multiprocessor on an H200. Other targets: the default.
OCCUPANCY = ct.ByTarget(sm_90=3)


@ct.kernel(occupancy=OCCUPANCY)
def compute_out_kernel(
    x: ct.IndexedWithInt64,             # (batch, seqlen, nheads, headdim)
    B: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate)
    C: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate)
    dt_out: ct.IndexedWithInt64,        # (batch, nheads, nchunks, CHUNK) float32
    dA_cumsum: ct.IndexedWithInt64,     # (batch, nheads, nchunks, CHUNK) float32, log2 units
    entry_states: ct.IndexedWithInt64,  # (batch, nchunks, nheads, headdim, dstate)
    D,                                  # (nheads,) or (nheads, headdim); unread if not HAS_D
    z: ct.IndexedWithInt64,             # (batch, seqlen, nheads, headdim); unread if not HAS_Z
    seq_idx: ct.IndexedWithInt64,       # (batch, seqlen) int32; unread if not HAS_SEQ_IDX
    out: ct.IndexedWithInt64,           # (batch, seqlen, nheads, headdim), x's dtype
    heads_per_group: int,
    CHUNK: ConstInt,
    BLOCK_M: ConstInt,
    BLOCK_K: ConstInt,
    BLOCK_P: ConstInt,
    DSTATE: ConstInt,
    DSTATE_TILE: ConstInt,
    HAS_D: ConstBool,
    D_HAS_HDIM: ConstBool,
    HAS_Z: ConstBool,
    HAS_SEQ_IDX: ConstBool,
):
    # Arrays that grow with the sequence are IndexedWithInt64 so that element offsets past
    # 2**31 (x of a 512K-token sequence already has more elements than that) are computed in
    # 64 bits; the cost is a few integer instructions per tile.
    nheads = x.shape[2]
    n_ptiles = ct.cdiv(x.shape[3], BLOCK_P)
    tile_id = ct.bid(0)
    b = ct.bid(1)
    h = tile_id % nheads                 # heads vary fastest (see "The grid")
    pi = (tile_id // nheads) % n_ptiles
    row_tile = tile_id // (nheads * n_ptiles)   # BLOCK_M-row tile of the whole sequence
    c = row_tile // (CHUNK // BLOCK_M)   # its chunk ...
    m = row_tile % (CHUNK // BLOCK_M)    # ... and its place in the chunk
    g = h // heads_per_group
    seqlen = x.shape[1]
    NK = DSTATE // DSTATE_TILE          # number of dstate slices (a constant)
    cdtype = C.dtype                     # operand dtype of the C products

    dA_rows = ct.reshape(ct.load(dA_cumsum, (b, h, c, m), shape=(1, 1, 1, BLOCK_M)), (BLOCK_M,))
    rows = m * BLOCK_M + ct.arange(BLOCK_M, dtype=ct.int32)          # positions in the chunk

    # 1. The entry state read through C: (BLOCK_M, dstate) @ (dstate, BLOCK_P).
    acc = ct.zeros((BLOCK_M, BLOCK_P), dtype=ct.float32)
    if NK == 1:
        # C rows stay in registers for the whole block (reused by every CB product below).
        c_rows = ct.reshape(ct.load(C, (b, row_tile, g, 0), shape=(1, BLOCK_M, 1, DSTATE),
                                    padding_mode=ZERO), (BLOCK_M, DSTATE))
        state = ct.load(entry_states, (b, c, h, pi, 0), shape=(1, 1, 1, BLOCK_P, DSTATE))
        state = ct.reshape(state, (BLOCK_P, DSTATE)).astype(cdtype)
        acc = ct.mma(c_rows, ct.transpose(state), acc)
    else:
        for k in range(NK):
            c_k = ct.reshape(ct.load(C, (b, row_tile, g, k), shape=(1, BLOCK_M, 1, DSTATE_TILE),
                                     padding_mode=ZERO), (BLOCK_M, DSTATE_TILE))
            state = ct.load(entry_states, (b, c, h, pi, k), shape=(1, 1, 1, BLOCK_P, DSTATE_TILE))
            state = ct.reshape(state, (BLOCK_P, DSTATE_TILE)).astype(cdtype)
            acc = ct.mma(c_k, ct.transpose(state), acc)

    row_scale = ct.exp2(dA_rows)
    if HAS_SEQ_IDX:
        seq_rows = ct.reshape(ct.load(seq_idx, (b, row_tile), shape=(1, BLOCK_M),
                                      padding_mode=ZERO), (BLOCK_M,))
        # The sequence running when the chunk starts: that of the previous chunk's last token,
        # or 0 before token 0 (the sequence initial_states belongs to).
        prev = ct.load(seq_idx, (b, max(c * CHUNK - 1, 0)), shape=())
        prev = ct.where(c == 0, 0, prev)
        row_scale = ct.where(seq_rows == prev, row_scale, 0.0)
    acc = acc * row_scale[:, None]

    # 2. Inside the chunk: column tiles up to the one holding this tile's last row, and none
    #    that lies entirely past the end of the sequence.
    n_cols = min(ct.cdiv((m + 1) * BLOCK_M, BLOCK_K), ct.cdiv(seqlen - c * CHUNK, BLOCK_K))
    for j in range(n_cols):
        col_tile = c * (CHUNK // BLOCK_K) + j       # BLOCK_K-token tile of the whole sequence
        if NK == 1:
            b_cols = ct.reshape(ct.load(B, (b, col_tile, g, 0), shape=(1, BLOCK_K, 1, DSTATE),
                                        padding_mode=ZERO), (BLOCK_K, DSTATE)).astype(cdtype)
            cb = ct.mma(c_rows, ct.transpose(b_cols), ct.zeros((BLOCK_M, BLOCK_K), dtype=ct.float32))
        else:
            cb = ct.zeros((BLOCK_M, BLOCK_K), dtype=ct.float32)
            for k in range(NK):
                c_k = ct.reshape(ct.load(C, (b, row_tile, g, k),
                                         shape=(1, BLOCK_M, 1, DSTATE_TILE), padding_mode=ZERO),
                                 (BLOCK_M, DSTATE_TILE))
                b_k = ct.reshape(ct.load(B, (b, col_tile, g, k),
                                         shape=(1, BLOCK_K, 1, DSTATE_TILE), padding_mode=ZERO),
                                 (BLOCK_K, DSTATE_TILE)).astype(cdtype)
                cb = ct.mma(c_k, ct.transpose(b_k), cb)

        dA_cols = ct.reshape(ct.load(dA_cumsum, (b, h, c, j), shape=(1, 1, 1, BLOCK_K)),
                             (BLOCK_K,))
        dt_cols = ct.reshape(ct.load(dt_out, (b, h, c, j), shape=(1, 1, 1, BLOCK_K)), (BLOCK_K,))
        cols = j * BLOCK_K + ct.arange(BLOCK_K, dtype=ct.int32)
        keep = rows[:, None] >= cols[None, :]
        if HAS_SEQ_IDX:
            seq_cols = ct.reshape(ct.load(seq_idx, (b, col_tile), shape=(1, BLOCK_K),
                                          padding_mode=ZERO), (BLOCK_K,))
            keep = keep & (seq_rows[:, None] == seq_cols[None, :])
        # Mask before exp2: dropped pairs get -inf (weight 0), kept ones an exponent <= 0.
        expo = ct.where(keep, ct.minimum(dA_rows[:, None] - dA_cols[None, :], 0.0), NEG_INF)
        weights = cb * ct.exp2(expo) * dt_cols[None, :]

        x_cols = ct.reshape(ct.load(x, (b, col_tile, h, pi), shape=(1, BLOCK_K, 1, BLOCK_P),
                                    padding_mode=ZERO), (BLOCK_K, BLOCK_P))
        acc = ct.mma(weights.astype(x.dtype), x_cols, acc)

    # 3. Skip connection and gate, in float32.
    if HAS_D:
        x_rows = ct.reshape(ct.load(x, (b, row_tile, h, pi), shape=(1, BLOCK_M, 1, BLOCK_P),
                                    padding_mode=ZERO), (BLOCK_M, BLOCK_P)).astype(ct.float32)
        if D_HAS_HDIM:
            d = ct.reshape(ct.load(D, (h, pi), shape=(1, BLOCK_P)), (BLOCK_P,)).astype(ct.float32)
            acc = acc + x_rows * d[None, :]
        else:
            d = ct.load(D, (h,), shape=()).astype(ct.float32)
            acc = acc + x_rows * d
    if HAS_Z:
        z_rows = ct.reshape(ct.load(z, (b, row_tile, h, pi), shape=(1, BLOCK_M, 1, BLOCK_P),
                                    padding_mode=ZERO), (BLOCK_M, BLOCK_P)).astype(ct.float32)
        # silu(z) = z * sigmoid(z); for z -> -inf, exp(-z) -> inf and the product -> 0 (no NaN).
        acc = acc * (z_rows / (1.0 + ct.exp(-z_rows)))

    # Rows past seqlen fall outside the array and are dropped by the store.
    ct.store(out, (b, row_tile, h, pi),
             ct.reshape(acc.astype(out.dtype), (1, BLOCK_M, 1, BLOCK_P)))


def pick_tiles(chunk_size, headdim, dstate, block_m=None, block_k=None, block_p=None,
               dstate_tile=None):
    """Defaults for an H200: 64-row and 64-column tiles, the whole headdim, dstate up to 128
    in one slice. With 3 blocks per multiprocessor (OCCUPANCY), 64 x 64 measured fastest
    (4.6 ms at 128K tokens, h=80, p=64, n=128, bf16; 128 x 64 at its best occupancy, 2: 5.5 ms).
    Every tile dimension is a power of two no larger than what it tiles."""
    bm = min(block_m or 64, chunk_size)
    bk = min(block_k or 64, chunk_size)
    bp = min(block_p or headdim, headdim)
    dt_ = min(dstate_tile or 128, dstate)
    return bm, bk, bp, dt_


def compute_out_plan(x, B, C, dt_out, dA_cumsum, entry_states, D=None, z=None, seq_idx=None,
                     block_m=None, block_k=None, block_p=None, dstate_tile=None, poison=False):
    """Allocate the output and build (grid, kernel, args, out) without launching."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    check_sizes(headdim, dstate)
    if nheads % ngroups:
        raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
    chunk_size = dt_out.shape[3]
    bm, bk, bp, dtile = pick_tiles(chunk_size, headdim, dstate, block_m, block_k, block_p,
                                   dstate_tile)

    out = new_output(x.shape, x.dtype, x.device, poison)
    if seq_idx is not None and seq_idx.dtype != torch.int32:
        seq_idx = seq_idx.to(torch.int32)
    # Absent optional tensors are replaced by an input the compiled variant never reads.
    args = (x, B, C, dt_out, dA_cumsum, entry_states,
            D if D is not None else dA_cumsum,
            z if z is not None else x,
            seq_idx if seq_idx is not None else dt_out,
            out,
            nheads // ngroups, chunk_size, bm, bk, bp, dstate, dtile,
            D is not None, D is not None and D.dim() == 2, z is not None, seq_idx is not None)
    grid = (nheads * (-(-headdim // bp)) * (-(-seqlen // bm)), batch)
    return grid, compute_out_kernel, args, out


def compute_out(x, B, C, dt_out, dA_cumsum, entry_states, D=None, z=None, seq_idx=None,
                poison=False):
    """-> out (b, L, h, p) in x's dtype. Inputs must be contiguous; dA_cumsum in log2 units.
    ``poison=True`` NaN-fills the output first (for tests)."""
    grid, kernel, args, out = compute_out_plan(x, B, C, dt_out, dA_cumsum, entry_states, D, z,
                                               seq_idx, poison=poison)
    launch(grid, kernel, args)
    return out
