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

Layouts
    dt and the decay cumsum come from chunk_cumsum as (batch, nheads, nchunks, CHUNK), i.e. one
    contiguous run of (padded) tokens per head, so the block's reads of them -- BLOCK_M rows and
    BLOCK_K columns of one head, or of HEADS_PER_BLOCK neighbouring heads -- are contiguous
    segments rather than gathers with a stride of nheads.

Sharing C B^T between heads (HEADS_PER_BLOCK)
    C B^T does not depend on the head, only on its group, yet with one head per block it is
    recomputed for every head: nheads / ngroups times (80x for a 2.7B layer). At dstate 256
    that product is about twice the rest of the block's arithmetic. HEADS_PER_BLOCK (HB) > 1
    gives a block HB consecutive heads of one group: it forms each (BLOCK_M, BLOCK_K) C B^T tile
    once and uses it for the HB heads through 3-d tiles with the heads as a leading axis -- the
    weights (HB, BLOCK_M, BLOCK_K), x columns (HB, BLOCK_K, BLOCK_P) and the accumulator
    (HB, BLOCK_M, BLOCK_P) -- and one 2-d ``ct.mma`` per head. Neighbouring heads are adjacent
    in x's (batch, seqlen, nheads, headdim) layout (and in the entry states' and dt's), so their
    tiles are read with one load each, whose ``order=`` puts the heads axis first. The grid
    shrinks by HB; each block does ~HB times the work with one C B^T instead of HB. It is one
    kernel either way: HB is a constant, and the helpers below give 2-d tiles for one head
    (exactly the code a one-head kernel would have) and 3-d ones for several.

Operand order (SWAP)
    ``SWAP=True`` computes every product transposed: C B^T as B_cols @ C_rows^T, the
    accumulator as (BLOCK_P, BLOCK_M) += x_cols^T @ weights^T and the entry-state product as
    state @ C_rows^T; the epilogue works in that orientation and the store writes it back
    through ``order=``. The result is the same up to rounding. What changes is which tile is
    the tensor cores' first operand: on Hopper (wgmma) only the first operand may come from
    registers (the weights are computed in registers), on Blackwell (tcgen05) the first may
    come from tensor memory while the second must be in shared memory, and the instruction
    shape (M = the first operand's rows) differs too. Which order is faster is measured.

Persistent blocks (PERSISTENT)
    Instead of one block per tile, a grid of only as many blocks as the GPU holds at once, each
    looping over every num_blocks-th tile (in the same heads-fastest order, so blocks working at
    the same time still share their B and C tiles through L2). A block's next tile can start
    while its previous store drains, and no tail of half-empty waves is left; whether that beats
    the hardware's own block scheduling is measured.

C B^T from memory (SCORES_IN_MEMORY)
    Instead of forming each C B^T tile in registers, the block loads it from a buffer that
    ``ops/kernels/common.py`` fills beforehand, once per chunk and group (the plan's ``before``
    holds that launch; ``ops.runtime.launch.run`` makes it first). The column loop then has one product instead of two.

Indexing
    Sequence-long arrays are ``ct.IndexedWithInt64`` (64-bit offsets); below 2**31 elements
    ``ops.runtime.launch.fit_index_width`` runs the kernel's 32-bit twin instead (notebook 06).

Tunables (``default_config`` / ``search_space``)
    Tiles (BLOCK_M, BLOCK_K, BLOCK_P, DSTATE_TILE), HEADS_PER_BLOCK, SWAP, SCORES_IN_MEMORY,
    PERSISTENT, LOAD_LAT / STORE_LAT (latency hints on the x, B, C, z and entry-state loads and on the output
    store; 0 = none), and the compiler hints occupancy and num_worker_warps
    (``kernel.replace_hints``; num_ctas > 1 is refused: it faulted on sm_90). The default config
    is the kernel described first, with the tiles and occupancy measured fastest for it
    (``pick_tiles``, ``ONE_HEAD_OCCUPANCY``).

Precision
    16-bit inputs: C, B, the entry state and the weights are rounded to 16 bits for the
    products (as in mamba_ssm), all accumulation is float32. float32 inputs: float32 operands
    throughout (full float32 products, not tf32).
"""
import torch

import cuda.tile as ct

from ops.tuning.configs import resolve_config, unique, with_hints
from ops.runtime.launch import Plan, fit_index_width, run
from ops.kernels.common import (chunk_scores_plan, new_scores, NEG_INF, ZERO, ConstBool, ConstInt, as_int32, cdiv, check_groups, check_sizes,
                    element_size, latency_hint, multiprocessors, new_output, tile_size)


# Blocks resident per multiprocessor with one head per block, unless the config says otherwise.
# This kernel is latency-bound (each column tile is a chain load -> product -> exp2 -> product),
# so several blocks per multiprocessor must overlap: on the H200, 3 is far faster than the
# compiler's own choice and best at dstate 128 (notebook 06, "Knob 2: occupancy"; the occupancy
# candidates in ``tests/benchmark/results/autotune_h200.json.gz``, checked by
# ``tests/benchmark/test_tuning_claims.py``; PERF_NOTES.md, "compute_out at three blocks per
# multiprocessor by default"). Other targets, and several heads per block: the compiler's choice.
ONE_HEAD_OCCUPANCY = ct.ByTarget(sm_90=3)


# Helpers called from the kernel. Plain functions are compiled into the kernel that calls them;
# their Constant arguments stay compile-time constants. With HB (HEADS_PER_BLOCK) == 1 every
# per-head tile is two-dimensional; with HB > 1 it gets a leading axis of HB heads.

def along_rows(v, SWAP):
    """A per-output-row (token l) vector, shaped to broadcast over the product tiles: the rows
    are the second-to-last axis of (.., BLOCK_M, n) tiles, the last axis of the transposed
    (SWAP) ones (.., n, BLOCK_M)."""
    return ct.expand_dims(v, -2) if SWAP else ct.expand_dims(v, -1)


def along_cols(v, SWAP):
    """A per-column vector (source token s, or headdim column), shaped the other way."""
    return ct.expand_dims(v, -1) if SWAP else ct.expand_dims(v, -2)


def rows_by_cols(rows_op, cols_op, acc, SWAP):
    """rows_op (M, K) @ cols_op^T (K, N) + acc -> (M, N); with SWAP the transposed product
    cols_op @ rows_op^T + acc -> (N, M): the same numbers, the operands' roles exchanged."""
    if SWAP:
        return ct.mma(cols_op, ct.transpose(rows_op), acc)
    return ct.mma(rows_op, ct.transpose(cols_op), acc)


def head(t, i):
    """Head i of an (HB, m, n) tile, as an (m, n) tile."""
    _, m, n = t.shape
    return ct.reshape(ct.extract(t, (i, 0, 0), shape=(1, m, n)), (m, n))


def per_head_mma(a, b, acc, HB, SHARED_A, TRANSPOSE_A):
    """acc[i] + a[i] @ b[i] for every head i < HB (``SHARED_A``: ``a`` is one 2-d tile used for
    every head; ``TRANSPOSE_A``: use a[i]^T). For one head, a plain 2-d product.

    One batched (3-d) ``ct.mma`` computes the same, but for sm_90 the compiler lowers batched
    products to warp-level mma.sync, while two-dimensional ones become warpgroup wgmma. So the
    heads are HB two-dimensional products: the loop has a constant trip count and is unrolled
    (for sm_90 this compiles to HGMMA, where the batched form gave HMMA)."""
    if HB == 1:
        acc = ct.mma(ct.transpose(a) if TRANSPOSE_A else a, b, acc)
    else:
        _, m, n = acc.shape
        for i in range(HB):
            a_i = a if SHARED_A else head(a, i)
            if TRANSPOSE_A:
                a_i = ct.transpose(a_i)
            acc_i = ct.mma(a_i, head(b, i), head(acc, i))
            acc = ct.insert(acc, (i, 0, 0), ct.reshape(acc_i, (1, m, n)))
    return acc


def state_product(c_rows, state, acc, HB, SWAP):
    """acc + C_rows @ state^T for every head: c_rows (BLOCK_M, K), state (BLOCK_P, K) or
    (HB, BLOCK_P, K) -> the accumulator's (BLOCK_M, BLOCK_P) or (HB, BLOCK_M, BLOCK_P). With SWAP
    and several heads the transposed product state @ C_rows^T is ONE 2-d product,
    (HB * BLOCK_P, K) @ (K, BLOCK_M): the heads simply stack as more rows."""
    if HB == 1:
        acc = rows_by_cols(c_rows, state, acc, SWAP)
    elif SWAP:
        _, bp, k = state.shape
        bm = c_rows.shape[0]
        flat = ct.mma(ct.reshape(state, (HB * bp, k)), ct.transpose(c_rows),
                      ct.reshape(acc, (HB * bp, bm)))
        acc = ct.reshape(flat, (HB, bp, bm))
    else:
        acc = per_head_mma(c_rows, ct.permute(state, (0, 2, 1)), acc, HB, True, False)
    return acc


def head_tokens(array, b, hb, c, j, HB, N):
    """Tile j (N tokens) of chunk c of heads hb * HB .. hb * HB + HB - 1 of a (batch, nheads,
    nchunks, CHUNK) array such as dA_cumsum: (N,) for one head, (HB, N) for several. The heads'
    runs are contiguous segments of that layout."""
    t = ct.load(array, (b, hb, c, j), shape=(1, HB, 1, N))
    return ct.reshape(t, (N,) if HB == 1 else (HB, N))


def load_tokens(array, b, index, hb, pi, HB, BLOCK_T, BLOCK_P, SWAP, LOAD_LAT):
    """BLOCK_T tokens (tile ``index`` of the sequence) x BLOCK_P headdim columns of the HB heads
    of a (batch, seqlen, nheads, headdim) array: (BLOCK_T, BLOCK_P), or (BLOCK_P, BLOCK_T) with
    SWAP, with a leading axis of HB heads when HB > 1. order= views the array with the heads
    axis first ((batch, nheads, seqlen, headdim), or (batch, nheads, headdim, seqlen)), so one
    load brings all HB heads, each already as the matrix the product or the epilogue wants."""
    if SWAP:
        t = ct.load(array, (b, hb, pi, index), shape=(1, HB, BLOCK_P, BLOCK_T),
                    order=(0, 2, 3, 1), padding_mode=ZERO, latency=latency_hint(LOAD_LAT))
        tile = ct.reshape(t, (BLOCK_P, BLOCK_T) if HB == 1 else (HB, BLOCK_P, BLOCK_T))
    elif HB == 1:
        t = ct.load(array, (b, index, hb, pi), shape=(1, BLOCK_T, 1, BLOCK_P), padding_mode=ZERO,
                    latency=latency_hint(LOAD_LAT))
        tile = ct.reshape(t, (BLOCK_T, BLOCK_P))
    else:
        t = ct.load(array, (b, hb, index, pi), shape=(1, HB, BLOCK_T, BLOCK_P),
                    order=(0, 2, 1, 3), padding_mode=ZERO, latency=latency_hint(LOAD_LAT))
        tile = ct.reshape(t, (HB, BLOCK_T, BLOCK_P))
    return tile


def store_tokens(out, b, index, hb, pi, tile, HB, BLOCK_T, BLOCK_P, SWAP, STORE_LAT):
    """Write ``tile`` (in ``load_tokens``' orientation) as BLOCK_T tokens of the HB heads, through
    the same views as the loads. Rows past seqlen fall outside the array and are dropped."""
    if SWAP:
        ct.store(out, (b, hb, pi, index), ct.reshape(tile, (1, HB, BLOCK_P, BLOCK_T)),
                 order=(0, 2, 3, 1), latency=latency_hint(STORE_LAT))
    elif HB == 1:
        ct.store(out, (b, index, hb, pi), ct.reshape(tile, (1, BLOCK_T, 1, BLOCK_P)),
                 latency=latency_hint(STORE_LAT))
    else:
        ct.store(out, (b, hb, index, pi), ct.reshape(tile, (1, HB, BLOCK_T, BLOCK_P)),
                 order=(0, 2, 1, 3), latency=latency_hint(STORE_LAT))


def load_states(entry_states, b, c, hb, pi, k, dtype, HB, BLOCK_P, WIDTH, LOAD_LAT, PADDED):
    """Slice k (WIDTH dstate columns) of the HB heads' entry states of chunk c, in ``dtype``:
    (BLOCK_P, WIDTH), or (HB, BLOCK_P, WIDTH); the heads are adjacent in (batch, nchunks,
    nheads, headdim, dstate). PADDED: the tile may reach past headdim or dstate (sizes that
    are not powers of two), so the load pads with zeros (0 * padding must stay 0)."""
    if PADDED:
        t = ct.load(entry_states, (b, c, hb, pi, k), shape=(1, 1, HB, BLOCK_P, WIDTH),
                    padding_mode=ZERO, latency=latency_hint(LOAD_LAT))
    else:
        t = ct.load(entry_states, (b, c, hb, pi, k), shape=(1, 1, HB, BLOCK_P, WIDTH),
                    latency=latency_hint(LOAD_LAT))
    return ct.reshape(t, (BLOCK_P, WIDTH) if HB == 1 else (HB, BLOCK_P, WIDTH)).astype(dtype)


def skip_factor(D, hb, pi, HB, BLOCK_P, D_HAS_HDIM, SWAP, PADDED):
    """D of the HB heads as float32, shaped to multiply the accumulator's x rows: one value per
    head, or one per head and headdim column (D_HAS_HDIM; zero-padded past headdim if PADDED)."""
    if D_HAS_HDIM and PADDED:
        d = ct.load(D, (hb, pi), shape=(HB, BLOCK_P), padding_mode=ZERO)
        if HB == 1:
            d = ct.reshape(d, (BLOCK_P,))
        factor = along_cols(d.astype(ct.float32), SWAP)
    elif D_HAS_HDIM:
        d = ct.load(D, (hb, pi), shape=(HB, BLOCK_P))
        if HB == 1:
            d = ct.reshape(d, (BLOCK_P,))
        factor = along_cols(d.astype(ct.float32), SWAP)
    elif HB == 1:
        factor = ct.load(D, (hb,), shape=()).astype(ct.float32)
    else:
        factor = ct.load(D, (hb,), shape=(HB,)).astype(ct.float32)[:, None, None]
    return factor


def cb_tile(scores, B, C, c_rows, b, c, g, m, j, row_tile, col_tile, BLOCK_M, BLOCK_K, DSTATE,
            DSTATE_TILE, SWAP, SCORES_IN_MEMORY, LOAD_LAT):
    """C_rows @ B_cols^T for row tile m and column tile j of chunk c (group g), float32,
    (BLOCK_M, BLOCK_K) or transposed with SWAP; shared by the block's heads. With
    SCORES_IN_MEMORY it is loaded from the buffer chunk_scores filled (through a transposing
    order= with SWAP); otherwise it is formed on the tensor cores, from the resident C rows when
    dstate is one slice (``c_rows``; None otherwise), else slice by slice."""
    if SCORES_IN_MEMORY:
        if SWAP:
            t = ct.load(scores, (b, c, g, j, m), shape=(1, 1, 1, BLOCK_K, BLOCK_M),
                        order=(0, 1, 2, 4, 3), latency=latency_hint(LOAD_LAT))
            cb = ct.reshape(t, (BLOCK_K, BLOCK_M))
        else:
            t = ct.load(scores, (b, c, g, m, j), shape=(1, 1, 1, BLOCK_M, BLOCK_K),
                        latency=latency_hint(LOAD_LAT))
            cb = ct.reshape(t, (BLOCK_M, BLOCK_K))
    else:
        if SWAP:
            cb = ct.zeros((BLOCK_K, BLOCK_M), dtype=ct.float32)
        else:
            cb = ct.zeros((BLOCK_M, BLOCK_K), dtype=ct.float32)
        if DSTATE == DSTATE_TILE:
            b_cols = ct.reshape(ct.load(B, (b, col_tile, g, 0), shape=(1, BLOCK_K, 1, DSTATE),
                                        padding_mode=ZERO, latency=latency_hint(LOAD_LAT)),
                                (BLOCK_K, DSTATE)).astype(C.dtype)
            cb = rows_by_cols(c_rows, b_cols, cb, SWAP)
        else:
            for k in range(DSTATE // DSTATE_TILE):
                c_k = load_c_rows(C, b, row_tile, g, k, BLOCK_M, DSTATE_TILE, LOAD_LAT)
                b_k = ct.reshape(ct.load(B, (b, col_tile, g, k),
                                         shape=(1, BLOCK_K, 1, DSTATE_TILE), padding_mode=ZERO,
                                         latency=latency_hint(LOAD_LAT)),
                                 (BLOCK_K, DSTATE_TILE)).astype(C.dtype)
                cb = rows_by_cols(c_k, b_k, cb, SWAP)
    return cb


def load_c_rows(C, b, row_tile, g, k, BLOCK_M, WIDTH, LOAD_LAT):
    """Slice k (WIDTH dstate columns) of the block's BLOCK_M rows of C: (BLOCK_M, WIDTH)."""
    t = ct.load(C, (b, row_tile, g, k), shape=(1, BLOCK_M, 1, WIDTH), padding_mode=ZERO,
                latency=latency_hint(LOAD_LAT))
    return ct.reshape(t, (BLOCK_M, WIDTH))


@ct.kernel
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
    scores: ct.IndexedWithInt64,        # (batch, nchunks, ngroups, CHUNK, CHUNK) float32 C B^T;
                                        # unread if not SCORES_IN_MEMORY (ops/kernels/common.py)
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
    SWAP: ConstBool,                    # transposed products (see "Operand order")
    SCORES_IN_MEMORY: ConstBool,        # read C B^T tiles from ``scores`` instead of forming them
    LOAD_LAT: ConstInt,                 # latency hint of the x, B, C, z, state loads; 0 = none
    STORE_LAT: ConstInt,                # latency hint of the output store; 0 = none
    HEADS_PER_BLOCK: ConstInt,          # HB heads of one group per block (divides heads_per_group)
    PERSISTENT: ConstBool,              # a fixed grid of blocks, each looping over tiles
    PADDED: ConstBool,                  # tiles reach past headdim or dstate (not powers of two)
):
    """One (row tile, p tile, head block) per block, or with PERSISTENT as many blocks as fit on
    the GPU at once, each taking every num_blocks-th tile (see "Persistent blocks")."""
    if PERSISTENT:
        total = (head_blocks(x, HEADS_PER_BLOCK) * ct.cdiv(x.shape[3], BLOCK_P)
                 * ct.cdiv(x.shape[1], BLOCK_M))
        for tile_id in range(ct.bid(0), total, ct.num_blocks(0)):
            output_tile(tile_id, x, B, C, dt_out, dA_cumsum, entry_states, D, z, seq_idx, out,
                        scores, heads_per_group, CHUNK, BLOCK_M, BLOCK_K, BLOCK_P, DSTATE,
                        DSTATE_TILE, HAS_D, D_HAS_HDIM, HAS_Z, HAS_SEQ_IDX, SWAP,
                        SCORES_IN_MEMORY, LOAD_LAT, STORE_LAT, HEADS_PER_BLOCK, PADDED)
    else:
        output_tile(ct.bid(0), x, B, C, dt_out, dA_cumsum, entry_states, D, z, seq_idx, out,
                    scores, heads_per_group, CHUNK, BLOCK_M, BLOCK_K, BLOCK_P, DSTATE,
                    DSTATE_TILE, HAS_D, D_HAS_HDIM, HAS_Z, HAS_SEQ_IDX, SWAP, SCORES_IN_MEMORY,
                    LOAD_LAT, STORE_LAT, HEADS_PER_BLOCK, PADDED)


def head_blocks(x, HB):
    """How many blocks of HB heads x's heads make. (One head is written apart here and below, for
    ``g``: no division or product by 1, so the one-head code is exactly that of a one-head kernel.)"""
    return x.shape[2] if HB == 1 else x.shape[2] // HB


def output_tile(tile_id, x, B, C, dt_out, dA_cumsum, entry_states, D, z, seq_idx, out, scores,
                heads_per_group, CHUNK, BLOCK_M, BLOCK_K, BLOCK_P, DSTATE, DSTATE_TILE, HAS_D,
                D_HAS_HDIM, HAS_Z, HAS_SEQ_IDX, SWAP, SCORES_IN_MEMORY, LOAD_LAT, STORE_LAT, HB,
                PADDED):
    """The work of one tile of compute_out_kernel (its body, for one ``tile_id``): BLOCK_M rows
    of one chunk, BLOCK_P headdim columns, HB heads. What does not depend on the head (C, B,
    C B^T, the masks) is computed once for the HB heads (see "Sharing C B^T between heads")."""
    n_hblocks = head_blocks(x, HB)
    n_ptiles = ct.cdiv(x.shape[3], BLOCK_P)
    b = ct.bid(1)
    hb = tile_id % n_hblocks             # head blocks vary fastest (see "The grid")
    pi = (tile_id // n_hblocks) % n_ptiles
    row_tile = tile_id // (n_hblocks * n_ptiles)   # BLOCK_M-row tile of the whole sequence
    c = row_tile // (CHUNK // BLOCK_M)   # its chunk ...
    m = row_tile % (CHUNK // BLOCK_M)    # ... and its place in the chunk
    g = hb // heads_per_group if HB == 1 else (hb * HB) // heads_per_group
    seqlen = x.shape[1]
    NK = DSTATE // DSTATE_TILE          # number of dstate slices (a constant)
    cdtype = C.dtype                     # operand dtype of the C products

    dA_rows = head_tokens(dA_cumsum, b, hb, c, m, HB, BLOCK_M)       # (BLOCK_M,) / (HB, BLOCK_M)
    rows = m * BLOCK_M + ct.arange(BLOCK_M, dtype=ct.int32)          # positions in the chunk

    # 1. The entry state read through C: (BLOCK_M, dstate) @ (dstate, BLOCK_P) for each head.
    #    (With SWAP, every (BLOCK_M, BLOCK_P) tile below is held transposed.)
    if SWAP:
        acc_shape = (BLOCK_P, BLOCK_M) if HB == 1 else (HB, BLOCK_P, BLOCK_M)
    else:
        acc_shape = (BLOCK_M, BLOCK_P) if HB == 1 else (HB, BLOCK_M, BLOCK_P)
    acc = ct.zeros(acc_shape, dtype=ct.float32)
    if NK == 1:
        # C rows stay in registers for the whole block (reused by every CB product below).
        c_rows = load_c_rows(C, b, row_tile, g, 0, BLOCK_M, DSTATE, LOAD_LAT)
        state = load_states(entry_states, b, c, hb, pi, 0, cdtype, HB, BLOCK_P, DSTATE, LOAD_LAT,
                            PADDED)
        acc = state_product(c_rows, state, acc, HB, SWAP)
    else:
        c_rows = None                    # C is read slice by slice, also in the products below
        for k in range(NK):
            c_k = load_c_rows(C, b, row_tile, g, k, BLOCK_M, DSTATE_TILE, LOAD_LAT)
            state = load_states(entry_states, b, c, hb, pi, k, cdtype, HB, BLOCK_P, DSTATE_TILE,
                                LOAD_LAT, PADDED)
            acc = state_product(c_k, state, acc, HB, SWAP)

    row_scale = ct.exp2(dA_rows)
    if HAS_SEQ_IDX:
        seq_rows = ct.reshape(ct.load(seq_idx, (b, row_tile), shape=(1, BLOCK_M),
                                      padding_mode=ZERO), (BLOCK_M,))
        # The sequence running when the chunk starts: that of the previous chunk's last token,
        # or 0 before token 0 (the sequence initial_states belongs to).
        prev = ct.load(seq_idx, (b, max(c * CHUNK - 1, 0)), shape=())
        prev = ct.where(c == 0, 0, prev)
        row_scale = ct.where(seq_rows == prev, row_scale, 0.0)
    acc = acc * along_rows(row_scale, SWAP)

    # 2. Inside the chunk: column tiles up to the one holding this tile's last row, and none
    #    that lies entirely past the end of the sequence.
    n_cols = min(ct.cdiv((m + 1) * BLOCK_M, BLOCK_K), ct.cdiv(seqlen - c * CHUNK, BLOCK_K))
    for j in range(n_cols):
        col_tile = c * (CHUNK // BLOCK_K) + j       # BLOCK_K-token tile of the whole sequence
        # cb = C_rows @ B_cols^T, (BLOCK_M, BLOCK_K) (transposed with SWAP), once for all heads.
        cb = cb_tile(scores, B, C, c_rows, b, c, g, m, j, row_tile, col_tile, BLOCK_M, BLOCK_K,
                     DSTATE, DSTATE_TILE, SWAP, SCORES_IN_MEMORY, LOAD_LAT)
        dA_cols = head_tokens(dA_cumsum, b, hb, c, j, HB, BLOCK_K)
        dt_cols = head_tokens(dt_out, b, hb, c, j, HB, BLOCK_K)
        cols = j * BLOCK_K + ct.arange(BLOCK_K, dtype=ct.int32)
        keep = along_rows(rows, SWAP) >= along_cols(cols, SWAP)          # shared by the heads
        if HAS_SEQ_IDX:
            seq_cols = ct.reshape(ct.load(seq_idx, (b, col_tile), shape=(1, BLOCK_K),
                                          padding_mode=ZERO), (BLOCK_K,))
            keep = keep & (along_rows(seq_rows, SWAP) == along_cols(seq_cols, SWAP))
        # Mask before exp2: dropped pairs get -inf (weight 0), kept ones an exponent <= 0.
        expo = ct.where(keep, ct.minimum(along_rows(dA_rows, SWAP) - along_cols(dA_cols, SWAP),
                                         0.0), NEG_INF)
        weights = (cb * ct.exp2(expo) * along_cols(dt_cols, SWAP)).astype(x.dtype)

        x_cols = load_tokens(x, b, col_tile, hb, pi, HB, BLOCK_K, BLOCK_P, False, LOAD_LAT)
        if SWAP:
            acc = per_head_mma(x_cols, weights, acc, HB, False, True)    # (P, K) @ (K, M)
        else:
            acc = per_head_mma(weights, x_cols, acc, HB, False, False)   # (M, K) @ (K, P)

    # 3. Skip connection and gate, in float32.
    if HAS_D:
        x_rows = load_tokens(x, b, row_tile, hb, pi, HB, BLOCK_M, BLOCK_P, SWAP,
                             LOAD_LAT).astype(ct.float32)
        acc = acc + x_rows * skip_factor(D, hb, pi, HB, BLOCK_P, D_HAS_HDIM, SWAP, PADDED)
    if HAS_Z:
        z_rows = load_tokens(z, b, row_tile, hb, pi, HB, BLOCK_M, BLOCK_P, SWAP,
                             LOAD_LAT).astype(ct.float32)
        # silu(z) = z * sigmoid(z); for z -> -inf, exp(-z) -> inf and the product -> 0 (no NaN).
        acc = acc * (z_rows / (1.0 + ct.exp(-z_rows)))

    store_tokens(out, b, row_tile, hb, pi, acc.astype(out.dtype), HB, BLOCK_M, BLOCK_P, SWAP,
                 STORE_LAT)


# Configs and launching -------------------------------------------------------------------------

def pick_tiles(chunk_size, headdim, dstate, block_m=None, block_k=None, block_p=None,
               dstate_tile=None):
    """Defaults for an H200: 64-row and 64-column tiles, the whole headdim, dstate up to 128
    in one slice. With 3 blocks per multiprocessor (ONE_HEAD_OCCUPANCY), 64 x 64 is the fastest
    pair, and 128-row tiles are slower even at their own best occupancy (the tile candidates in
    ``tests/benchmark/results/autotune_h200.json.gz``; notebook 06).
    Every tile dimension is a power of two no larger than what it tiles."""
    bm = min(block_m or 64, chunk_size)
    bk = min(block_k or 64, chunk_size)
    bp = min(block_p or min(tile_size(headdim), 128), tile_size(headdim))
    dt_ = min(dstate_tile or 128, tile_size(dstate))
    return bm, bk, bp, dt_


def default_config(*, chunk_size, headdim, dstate, **_):
    """The kernel described first: ``pick_tiles``' tiles, one head per block, natural operand order, no
    latency hints, 3 blocks per multiprocessor on sm_90 (``occupancy_hint``)."""
    bm, bk, bp, dtile = pick_tiles(chunk_size, headdim, dstate)
    return dict(BLOCK_M=bm, BLOCK_K=bk, BLOCK_P=bp, DSTATE_TILE=dtile, HEADS_PER_BLOCK=1, INDEX64=False,
                SWAP=False, SCORES_IN_MEMORY=False, PERSISTENT=False, LOAD_LAT=0, STORE_LAT=0,
                occupancy=None, num_ctas=None, num_worker_warps=None)


def block_footprint(cfg, *, dstate, dtype=torch.bfloat16, **_):
    """(float32-register words, shared-memory bytes) a block needs, roughly.

    Registers: the accumulator (HB x BLOCK_M x BLOCK_P), the weights and their exponent
    (HB x BLOCK_M x BLOCK_K), the C B^T tile (BLOCK_M x BLOCK_K), and the C rows when they stay
    resident (one dstate slice). Shared memory: the tensor-core operands of one column step
    (B and x columns) twice (the next step's loads in flight), plus the C rows and the states."""
    hb, bm, bk, bp = (cfg[k] for k in ("HEADS_PER_BLOCK", "BLOCK_M", "BLOCK_K", "BLOCK_P"))
    dtile, es = cfg["DSTATE_TILE"], element_size(dtype)
    resident_c = bm * dtile * es // 4 if dtile == tile_size(dstate) else 0
    words = hb * bm * bp + hb * bm * bk + bm * bk + resident_c
    smem = es * (bm * dtile + hb * bp * dtile + 2 * (bk * dtile + hb * bk * bp))
    return words, smem


REGISTER_WORDS = 64 * 1024     # 32-bit registers per multiprocessor (sm_80 .. sm_100)


def occupancy_hint(cfg):
    """The occupancy hint the kernel compiles with: the config's, else ``ONE_HEAD_OCCUPANCY``
    (3 on sm_90) for one head per block, else none (the compiler's choice)."""
    if cfg["occupancy"] is not None:
        return cfg["occupancy"]
    return ONE_HEAD_OCCUPANCY if cfg["HEADS_PER_BLOCK"] == 1 else None


def resident_blocks(cfg):
    """Blocks per multiprocessor a config is planned for (``fits``, the persistent grid): its
    occupancy, else 3 for one head per block (the sm_90 hint), else 1 (the compiler's choice is
    not known ahead, so the register budget assumes one)."""
    return cfg["occupancy"] or (3 if cfg["HEADS_PER_BLOCK"] == 1 else 1)


def fits(cfg, soft=False, **shape):
    """Prune what obviously cannot run: more than 32K float32 words of live tiles per block
    (128 KiB: 255 registers x 128 threads), ``occupancy`` blocks needing more than the
    multiprocessor's 64K registers, or one block's operands exceeding the 227 KiB of shared
    memory. ``soft=True`` asks instead whether it runs WELL, keeping a quarter of the register
    file for operands in flight, addresses and temporaries: the default, 16K words at occupancy
    3, uses 168 registers and does not spill on sm_90, while two heads of 64 x 64 (24K words) at
    occupancy 2 already spill a little. Blocks per multiprocessor: ``resident_blocks``."""
    words, smem = block_footprint(cfg, **shape)
    occ = resident_blocks(cfg)
    budget = REGISTER_WORDS * 3 // 4 if soft else REGISTER_WORDS
    return words <= 32 * 1024 and words * occ <= budget and smem <= 227 * 1024


def heads_per_block_options(nheads, ngroups):
    """1, 2, 4 where they divide the heads of a group (a block never spans two groups)."""
    per_group = nheads // ngroups
    return [hb for hb in (1, 2, 4) if per_group % hb == 0 and nheads % hb == 0]


def search_space(*, chunk_size, headdim, dstate, nheads, ngroups=1, dtype=torch.bfloat16,
                 **shape):
    """Variants worth timing (about 35-40 for realistic shapes; the default comes first).

    The core is HEADS_PER_BLOCK x SWAP x tiles (BLOCK_M, BLOCK_K in 32..128), each at the
    highest occupancy (<= 3) its estimated register footprint allows (two heads: also one
    less); around the default and the two-heads variant: other occupancies, latency hints and
    C B^T read from memory (SCORES_IN_MEMORY); eight worker warps for one, two and four heads;
    for dstate > 128 also the whole dstate in one slice (C rows resident)."""
    kw = dict(chunk_size=chunk_size, headdim=headdim, dstate=dstate, dtype=dtype)
    base = default_config(**kw)

    def best_occupancy(cfg):
        for occ in (3, 2, 1):
            if fits({**cfg, "occupancy": occ}, soft=True, **kw):
                return occ
        return None

    tiles = [(base["BLOCK_M"], base["BLOCK_K"])]
    for bm, bk in ((128, 64), (64, 32), (32, 64), (32, 32)):
        if bm <= chunk_size and bk <= chunk_size and (bm, bk) not in tiles:
            tiles.append((bm, bk))
    heads = heads_per_block_options(nheads, ngroups)

    configs = [base]
    for hb in heads:
        for swap in (False, True):
            for bm, bk in tiles:
                # 32 x 32 tiles only pay off with four heads' work per block; 128 rows only
                # with one head (more would not fit).
                if (bm * bk == 32 * 32 and hb < 4) or (bm == 128 and hb > 1):
                    continue
                cfg = {**base, "HEADS_PER_BLOCK": hb, "SWAP": swap, "BLOCK_M": bm, "BLOCK_K": bk}
                occ = best_occupancy(cfg)
                if occ is None:
                    continue
                if hb == 1:
                    # 3 is the plan's hint on sm_90 (occupancy_hint): keep None for it.
                    configs.append({**cfg, "occupancy": None if occ == 3 else occ})
                elif hb == 2:
                    # The compiler's register allocation is harder to predict here (it picks
                    # 128..384 threads), so also try one block fewer per multiprocessor.
                    configs += [{**cfg, "occupancy": o} for o in (occ, occ - 1) if o >= 1]
                else:
                    # Four heads at one block fewer: 384 threads that spill hundreds of
                    # registers on sm_90 (tests/benchmark/compile_all.py), not worth timing.
                    configs.append({**cfg, "occupancy": occ})
    anchors = [base] + ([{**base, "HEADS_PER_BLOCK": 2, "occupancy": best_occupancy(
        {**base, "HEADS_PER_BLOCK": 2})}] if 2 in heads else [])
    for anchor in anchors:
        one_head = anchor["HEADS_PER_BLOCK"] == 1
        configs += [{**anchor, "occupancy": occ} for occ in ((2, 4) if one_head else (1, 2))]
        configs += [{**anchor, "LOAD_LAT": ll, "STORE_LAT": sl}
                    for ll, sl in (((3, 0), (8, 0), (0, 8)) if one_head else ((8, 0), (0, 8)))]
        if dstate > 128:
            configs.append({**anchor, "DSTATE_TILE": tile_size(dstate)})
    kept = [c for c in configs if fits(c, **kw)]
    # C B^T from memory (ops/kernels/common.py) instead of in registers: one head per block in
    # both operand orders, and two heads per block.
    scored = [{**base, "SCORES_IN_MEMORY": True}, {**base, "SCORES_IN_MEMORY": True, "SWAP": True}]
    if 2 in heads:
        scored.append({**base, "SCORES_IN_MEMORY": True, "HEADS_PER_BLOCK": 2, "occupancy": 2})
    kept += [c for c in scored if fits(c, **kw)]
    # Persistent blocks (a grid of resident blocks looping over the tiles) for the default and
    # for two heads per block.
    steady = [{**base, "PERSISTENT": True}]
    if 2 in heads:
        steady.append({**base, "PERSISTENT": True, "HEADS_PER_BLOCK": 2, "occupancy": 2})
    kept += [c for c in steady if fits(c, **kw)]
    # Eight worker warps instead of the compiler's four: each block's tiles are split over more
    # threads, so each needs fewer registers. On sm_90 two heads per block then need 80 registers
    # per thread instead of 128 (the cap), and four heads spill less (python -m ops.tools.sass).
    # Blocks of 384 threads: at most two per multiprocessor at that register count.
    wide = [{**base, "occupancy": 2}]
    if 2 in heads:
        wide += [{**base, "HEADS_PER_BLOCK": 2, "occupancy": o} for o in (2, 1)]
        wide += [{**base, "HEADS_PER_BLOCK": 2, "SWAP": True, "occupancy": 2}]
    if 4 in heads:
        wide += [{**base, "HEADS_PER_BLOCK": 4, "occupancy": 1}]
    kept += [{**c, "num_worker_warps": 8} for c in wide if fits(c, **kw)]
    if needs_int64(chunk_size=chunk_size, headdim=headdim, dstate=dstate, nheads=nheads,
                   ngroups=ngroups, **shape):
        kept = [c for c in kept if not int64_fault(c)]       # compute_out_plan refuses them
    return unique(kept + [{**kept[0], "INDEX64": True}])


def int64_fault(cfg):
    """Why ``cfg`` cannot run in the 64-bit-indexed kernel, or None. Several heads per block
    with 32-row tiles, or with eight worker warps, fault there (misaligned address, then a lost
    CUDA context) on an H200 with cuda-tile 1.7.0: seen at 256K tokens x dstate 512 and
    reproduced at small size by the variant tests (tests/kernels/test_compute_out.py). The same configs
    run correctly with 32-bit indices."""
    if cfg.get("HEADS_PER_BLOCK", 1) == 1:
        return None
    if cfg.get("BLOCK_M") == 32:
        return "BLOCK_M=32"
    if cfg.get("num_worker_warps") == 8:
        return "num_worker_warps=8"
    return None


def needs_int64(*, batch=1, seqlen, chunk_size, headdim, dstate, nheads, ngroups=1, **_):
    """Whether some tensor of the call reaches 2**31 elements, so the kernel runs with 64-bit
    indices (``ops.runtime.launch.fit_index_width``): x / out, B / C, or the entry states."""
    nchunks = cdiv(seqlen, chunk_size)
    sizes = (batch * seqlen * nheads * headdim, batch * seqlen * ngroups * dstate,
             batch * nchunks * nheads * headdim * dstate)
    return max(sizes) >= 2**31


def compute_out_plan(x, B, C, dt_out, dA_cumsum, entry_states, D=None, z=None, seq_idx=None,
                     block_m=None, block_k=None, block_p=None, dstate_tile=None, poison=False,
                     config=None):
    """Allocate the output and build the launch (an ``ops.runtime.launch.Plan``, outputs ``(out,)``)
    without running it; with SCORES_IN_MEMORY its ``before`` holds the chunk_scores launch
    that fills the C B^T buffer (in the same tiles).

    ``config``: a dict from ``search_space`` (or part of one; missing keys take
    ``default_config``'s values for this shape). ``block_*`` / ``dstate_tile``, when given,
    override the config's tiles. The plan's kernel is ``compute_out_kernel`` (or its 32-bit
    twin) with the config's compiler hints."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    check_sizes(headdim, dstate)
    check_groups(nheads, ngroups)
    chunk_size = dt_out.shape[3]
    cfg = resolve_config(config, default_config(chunk_size=chunk_size, headdim=headdim,
                                                dstate=dstate))
    bm, bk, bp, dtile = pick_tiles(chunk_size, headdim, dstate, block_m or cfg["BLOCK_M"],
                                   block_k or cfg["BLOCK_K"], block_p or cfg["BLOCK_P"],
                                   dstate_tile or cfg["DSTATE_TILE"])
    hb = cfg["HEADS_PER_BLOCK"]
    if hb not in heads_per_block_options(nheads, ngroups):
        raise ValueError(f"HEADS_PER_BLOCK ({hb}) must be 1, 2 or 4 and divide the "
                         f"{nheads // ngroups} heads of a group")

    out = new_output(x.shape, x.dtype, x.device, poison)
    seq_idx = as_int32(seq_idx)
    before = ()
    if cfg["SCORES_IN_MEMORY"]:
        scores = new_scores(B, chunk_size, poison)
        before = (chunk_scores_plan(B, C, scores, bm, bk, dtile, load_lat=cfg["LOAD_LAT"]),)
    # Absent optional tensors are replaced by an input the compiled variant never reads.
    args = (x, B, C, dt_out, dA_cumsum, entry_states,
            D if D is not None else dA_cumsum,
            z if z is not None else x,
            seq_idx if seq_idx is not None else dt_out,
            out,
            scores if before else dA_cumsum,
            nheads // ngroups, chunk_size, bm, bk, bp, tile_size(dstate), dtile,
            D is not None, D is not None and D.dim() == 2, z is not None, seq_idx is not None,
            bool(cfg["SWAP"]), bool(before), cfg["LOAD_LAT"], cfg["STORE_LAT"], hb,
            bool(cfg["PERSISTENT"]), headdim % bp != 0 or dstate != tile_size(dstate))
    tiles = (nheads // hb) * cdiv(headdim, bp) * cdiv(seqlen, bm)
    if cfg["PERSISTENT"]:
        # As many blocks as are resident at once: no tail wave.
        tiles = min(tiles, multiprocessors(x.device) * resident_blocks(cfg))
    sized = fit_index_width(compute_out_kernel, args, cfg["INDEX64"])
    fault = int64_fault(cfg) if sized is compute_out_kernel else None
    if fault:
        raise ValueError(f"{fault} with HEADS_PER_BLOCK={hb} is not supported with 64-bit "
                         f"indexing (INDEX64, or a tensor of 2**31 elements or more): it faults "
                         f"on sm_90 (see int64_fault); use one head per block, or BLOCK_M=64 "
                         f"and the default worker warps")
    kernel = with_hints(sized, {**cfg, "occupancy": occupancy_hint(cfg)})
    return Plan((tiles, batch), kernel, args, (out,), before)


def compute_out(x, B, C, dt_out, dA_cumsum, entry_states, D=None, z=None, seq_idx=None,
                poison=False, config=None):
    """-> out (b, L, h, p) in x's dtype. Inputs as ``ops.torch_op.as_kernel_input`` gives them;
    dA_cumsum in log2 units. ``poison=True`` NaN-fills the output first (for tests). ``config``
    picks a variant (see ``search_space``); None is ``default_config``."""
    out, = run(compute_out_plan(x, B, C, dt_out, dA_cumsum, entry_states, D, z, seq_idx,
                                poison=poison, config=config))
    return out
