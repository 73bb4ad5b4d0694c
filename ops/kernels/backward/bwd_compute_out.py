"""Backward kernels: the gradients of compute_out (kernel (c)), without D and z.

The forward (``ops/kernels/compute_out.py``) computes, for a token l of chunk c (dA in log2 units):

    y[l] = w[l] (C[l] @ entry[c]^T) + sum_{s <= l} G[l, s] x[s]
    G[l, s] = (C[l] . B[s]) M[l, s] dt[s],  M[l, s] = exp2(dA[l] - dA[s])   (0 for s > l or
                                                                             another sequence)
    w[l] = exp2(dA[l])                                 (0 unless l belongs to the sequence
                                                        running at the chunk's start)

so, with dG[l, s] = dy[l] . x[s] and dCB = dG M dt (``reference.backward.compute_out_backward``):

    dx[s]     = sum_l G[l, s] dy[l]                     dB[s] = sum_l dCB[l, s] C[l]
    dC[l]     = sum_s dCB[l, s] B[s] + w[l] (dy[l] @ entry)
    ddt[s]    = sum_l dG[l, s] (C[l] . B[s]) M[l, s]
    ddA[t]    = sum_s (dG G)[t, s] - sum_l (dG G)[l, t] + w[t] (dy[t] . (C[t] @ entry^T))
    dentry[c] = sum_l w[l] outer(dy[l], C[l])

ddA is the gradient of dA_cumsum in natural-log units (exp2 of log2 values is exp of natural
ones: the same factors), like the reference's and the other backward kernels'.

The token kernel and the entry kernel (the token kernel alone, as first written; the pair
kernel below goes in front of it by default)
    The gradients of the tokens (dx, dB, dC, ddt, ddA) and that of the entry state (dentry) want
    different blocks. Each token's gradients sum over the chunk's other tokens; dentry sums over
    all the chunk's tokens for one head, a (headdim, dstate) result per head. Holding both in one
    block would mean the whole chunk per block (too many registers at chunk 256) or partial
    dentry sums added across blocks (atomics, not reproducible). So:

    ``bwd_compute_out_kernel``  one block per (BLOCK_T-token tile of the sequence, block of heads
        of one group, batch), grid axis 0 the tiles times the head blocks, head blocks fastest
        (blocks running together read the same B and C tiles, from L2). Its tile t of chunk c
        plays both roles of the quadratic form: as the SOURCE tokens s (the column tile: dx, dB,
        ddt and the column sums of dG G, summed over the row tiles i >= t) and as the TARGET
        tokens l (the row tile: dC and the row sums of dG G, summed over the column tiles
        j <= t), plus the carried-in terms of its rows. Alone (PAIRS=False), every (BLOCK_T,
        BLOCK_T) tile of C B^T, dG, the decays and G is formed in registers and never leaves the
        chip (the forward's way; with SCORES_IN_MEMORY the C B^T tiles are read instead, from
        the buffer ``ops/kernels/common.py`` fills once per chunk and group); the diagonal pair
        is formed once per role. A block's work is the same for every tile (n - t column steps
        + t + 1 row steps, n tiles per chunk), so blocks are balanced.
        All outputs of a token tile are complete in one block: ddA's row sums, column sums and
        carried term are added in registers, nothing is written twice.

        Given dS (``ops/backward.py`` passes it, after the pass over the states), the same block
        also adds the gradients through its chunk's own state, ``ops/kernels/backward/bwd_chunk_states.py``'s two
        products per head (WITH_STATES): it holds the tile's x and B already. Given D, it adds
        the skip's D dy to dx and writes the tile's sum of dy x for dD (WITH_SKIP). dx is then
        complete and written once, in its final dtype: no float32 dx for a second kernel to
        add into, and no elementwise passes over x-sized tensors on the host. Fused, the
        backward takes less time than with bwd_chunk_states launched after it (FUSE_STATES=False)
        except where ``fuse_states`` says
        (``tests/benchmark/results/bwd_compute_out_configs_h200.csv``; PERF_NOTES.md, "The token
        kernel does three steps in one block").

    ``bwd_entry_kernel``  one block per (dentry tile (BLOCK_P, BLOCK_N), chunk, head, batch):
        the product (w dy)^T @ C over the chunk's token tiles, accumulated in registers.

The pair kernel first (PAIRS, the default)
    Of the token kernel's products, dB and dC's (dCB^T C and dCB B, (BLOCK_T, BLOCK_T) x
    (BLOCK_T, dstate) per tile pair) are the largest, and it forms them once per head. But B
    and C are the group's, so both are linear in the sum over the group's heads of dCB:

        dB[s] = sum_h sum_l dCB_h[l, s] C[l] = sum_l (sum_h dCB_h)[l, s] C[l]     (dC alike)

    ``bwd_pairs_kernel`` runs first, one block per (tile pair (i, j) of a chunk, i >= j, block
    of PAIR_HEADS_PER_BLOCK heads of one group, batch); grid axis 0 is chunk x row tile x
    column tile x head blocks, head blocks fastest (the blocks of a pair with j > i, above the
    diagonal, or wholly past the sequence, exit at once). It forms the pair's C B^T once (and
    stores it for the token kernel), then for each of its heads in order dG = dy_i x_j^T and
    the decays, and writes that head's two sums of dG G (per column: ddt's and, times dt,
    ddA's; per row: ddA's) and adds dCB into a (BLOCK_T, BLOCK_T) float32 sum over its heads,
    written once: the head-split partials (pair splits x b, c, g, CHUNK, CHUNK). The token
    kernel then forms only G (for dx) per head and pair, reads the sums, and its first head
    block of each group adds the pair partials in order and makes dB and dC's quadratic part
    with two products per pair instead of two per head and pair: 80 times fewer at a 2.7B
    layer. dy_i x_j^T is formed once, by the pair kernel, where the token kernel alone forms it
    twice (once per role); the decays are formed in both kernels, once each. No atomics:
    every sum runs in a fixed order.
    A training step's scan ran 1.11-1.21x faster with it than without (each at its own best
    FUSE_STATES) at every shape timed but 1 x 4K x dstate 64, where it is level
    (``tests/benchmark/results/bwd_pairs_h200.csv``; at 1 x 64K x dstate 256 against the
    unfused token kernel, ``bwd_pairs_fuse_h200.csv``; PERF_NOTES.md, "The pair kernel").
    Its buffers (``ops.backward.memory_accounting`` counts them): C B^T, the d(C B^T)
    partials and the (b, h, c, CHUNK / BLOCK_T, CHUNK) row and column sums, all float32.

Split dx (SPLIT_DX, with the pair kernel: the default)
    After the pair kernel, the token kernel's block still holds the (BLOCK_T, dstate) dB and dC
    accumulators through its whole loop over heads, which is what keeps it at one block per
    multiprocessor; dx, ddt and ddA need none of them. SPLIT_DX gives each half a launch of its
    own: ``bwd_token_states_kernel`` (the token kernel's blocks and head loop) makes the states'
    products (dy @ entry, x @ dS) into dB and dC, and each head's states' terms of ddt and ddA
    into two (b, h, c, CHUNK) float32 buffers, and adds the quadratic dB and dC;
    ``bwd_token_dx_kernel``, one block per (token tile, DX_HEADS_PER_BLOCK heads of a group, one
    after the other), then forms G for dx, adds v (B dS^T) and D dy, and completes ddt and ddA
    from the pair kernel's sums and those buffers.
    Its blocks hold no dstate-wide accumulator and run several per multiprocessor
    (``dx_config``). A training step's scan took 8-18% less time split than fused at the 2.7B
    and 8B shapes, 16K x dstate 128 and 64K x dstate 256, and was level at 4K x dstate 64
    (``tests/benchmark/results/bwd_split_dx_h200.csv``, and against the fused default of then
    ``bwd_token_variants_h200.csv``, which also holds two things not kept: 32-token tiles for
    the split launches, and loading the next head's entry state and dS a head ahead in the fused
    token kernel, both slower). At the 130M shape, whose eager step is close to host-bound,
    the two runs disagree (split faster in one, slower in the other).
    The states launch's block still holds dB and dC's (BLOCK_T, dstate) accumulators and per
    head a (headdim, dstate) entry state and dS: at dstate 256 that made it the step's longest
    kernel by far, stalled on memory. STATES_SLICES gives each block one slice of dstate's
    columns (``states_slices``: 128 each): every product of the launch is a sum over headdim or
    over tokens, so a slice's dB and dC columns need no other slice, and only the two dot
    products over dstate (ddA's carried term, and dv, which gives ddt's and ddA's terms) become
    partial sums, kept one per slice (the two buffers get a leading slice axis, ddA_tiles a
    tile per slice) and added in order by the dx launch and the host.
    The buffers it adds (``ops.backward.memory_accounting`` counts them): the two (slices, b, h,
    c, CHUNK) float32 terms, and ddA_tiles' last axis times the slices.

dB and dC across the heads of a group (deterministic, no atomics)
    B and C are shared by the heads of a group, so their gradients are sums over those heads. A
    block loops over HEADS_PER_BLOCK heads of one group in order and sums their contributions in
    registers. With all the heads of its group (``default_heads_per_block`` for long sequences)
    a block writes dB and dC (batch, seqlen, ngroups, dstate) directly; when that leaves too
    few blocks to keep the GPU busy (``BLOCKS_PER_SM``) the heads are split into
    ``heads_per_group / HEADS_PER_BLOCK`` blocks per group, each writing a partial, which the
    host adds in a fixed order (one ``sum`` over a small leading axis). Either way the result is
    bitwise reproducible. (Per-head outputs summed on the host would cost nheads / ngroups times
    the memory traffic of dB and dC: 80x for a 2.7B layer.)

Ragged and packed sequences
    Token loads pad with zeros past seqlen (x, dy, B and C of padding tokens are 0, so are their
    contributions) and stores past it are dropped; a block only walks tiles inside the sequence.
    ddt and ddA are (batch, nheads, nchunks, CHUNK): the blocks of tiles lying wholly past the
    end write their zeros. The causal and same-sequence masks are applied to the exponent before
    exp2 (masked pairs get -inf), as in the forward, and w is 0 for tokens of a sequence that
    starts inside the chunk.

Sizes
    headdim and dstate are padded to ``ops.kernels.common.tile_size`` (powers of two, at least 16): the
    loads pad with zeros and the stores drop the padding. The token kernel holds one head's
    (headdim, dstate) entry state and the (BLOCK_T, dstate) dB and dC accumulators: fine for the
    usual 64 x 128 at BLOCK_T = 64; beyond 64 x 256 (= 128 x 128) the default takes BLOCK_T =
    32, and the largest sizes (256 x 512) compile but spill in the fused token kernel (the split
    launches' states launch takes dstate in slices: "Split dx").

Precision
    Every product accumulates in float32. C B^T and dG = dy x^T take the inputs as they are
    (exact operands). The products with computed operands (G, dCB, w dy) and the entry state
    take bfloat16 operands for bfloat16 inputs (as the forward's weights), float32 ones for
    float32 and float16 inputs (a loss-scaled gradient overflows float16's range, as in
    ``ops/kernels/backward/bwd_chunk_states.py``).
"""
import torch

import cuda.tile as ct

from ops.tuning.configs import group_divisors, resolve_config, token_tiling, unique, with_hints
from ops.runtime.launch import Plan, fit_index_width, run
from ops.kernels.common import (latency_hint, sum_splits, carried_weight, chunk_scores_plan, chunk_tokens, entry_gradient, new_scores, sequence_ids, NEG_INF, ZERO, ConstBool, ConstInt, as_int32, cdiv, check_groups,
                    check_sizes, multiprocessors, new_output, tile_size, unread_stand_in)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# Helpers called from the kernels (compiled into them).

def token_rows(array, b, tile, h, BLOCK_T, WIDTH, LOAD_LAT=0, k=0):
    """Token tile ``tile`` (BLOCK_T tokens of the sequence) of head or group h of a (batch,
    seqlen, heads, width) array: (BLOCK_T, WIDTH), zero-padded past seqlen and width; columns
    k * WIDTH .. (k + 1) * WIDTH - 1 (slice k of the width)."""
    t = ct.load(array, (b, tile, h, k), shape=(1, BLOCK_T, 1, WIDTH), padding_mode=ZERO,
                latency=latency_hint(LOAD_LAT))
    return ct.reshape(t, (BLOCK_T, WIDTH))


def decays(dA_rows, dA_cols, row_pos, col_pos, seq_rows, seq_cols, HAS_SEQ_IDX):
    """M (rows, cols) = exp2(dA[l] - dA[s]) for kept pairs (s <= l, one sequence), else 0. The
    mask goes on the exponent (-inf), and kept exponents are clamped to <= 0: no overflow."""
    keep = row_pos[:, None] >= col_pos[None, :]
    if HAS_SEQ_IDX:
        keep = keep & (seq_rows[:, None] == seq_cols[None, :])
    return ct.exp2(ct.where(keep, ct.minimum(dA_rows[:, None] - dA_cols[None, :], 0.0), NEG_INF))


def times_transposed(a, b, acc):
    """acc + a @ b^T (float32 accumulator)."""
    return ct.mma(a, ct.transpose(b), acc)


def score_tile(scores, c_rows, b_cols, b, c, g, i, j, BLOCK_T, SCORES_IN_MEMORY, LOAD_LAT=0):
    """The (BLOCK_T, BLOCK_T) tile (i, j) of chunk c's C B^T: C[rows] @ B[cols]^T formed here, or
    read from the ``scores`` chunk_scores filled (SCORES_IN_MEMORY: once per group, not once per
    head)."""
    if SCORES_IN_MEMORY:
        return stored_score_tile(scores, b, c, g, i, j, BLOCK_T, LOAD_LAT)
    return times_transposed(c_rows, b_cols, ct.zeros((BLOCK_T, BLOCK_T), dtype=ct.float32))


def stored_score_tile(scores, b, c, g, i, j, BLOCK_T, LOAD_LAT=0):
    """The (BLOCK_T, BLOCK_T) tile (i, j) of chunk c's C B^T for group g, read from ``scores``
    (chunk_scores' or the pair kernel's)."""
    t = ct.load(scores, (b, c, g, i, j), shape=(1, 1, 1, BLOCK_T, BLOCK_T),
                latency=latency_hint(LOAD_LAT))
    return ct.reshape(t, (BLOCK_T, BLOCK_T))


def pair_source_step(dy_i, dA_cumsum, seq_idx, scores, cols, dx_acc, ddt_acc, b, h, c, g, i,
                     t, row_tile, pos_t, seq_t, dA_t, dt_t, BLOCK_T, HAS_SEQ_IDX, op, LOAD_LAT):
    """One row tile i >= t of token tile t as the source tokens, after the pair kernel: dx_acc
    plus G^T dy_i (G from the stored C B^T and the decays; dy_i: row tile i of head h's dy),
    ddt_acc plus the pair kernel's column sums of dG G for the pair (i, t)."""
    dA_i = chunk_tokens(dA_cumsum, b, h, c, i, BLOCK_T)
    pos_i = i * BLOCK_T + ct.arange(BLOCK_T, dtype=ct.int32)
    seq_i = sequence_ids(seq_idx, b, row_tile, BLOCK_T, HAS_SEQ_IDX)
    cb = stored_score_tile(scores, b, c, g, i, t, BLOCK_T, LOAD_LAT)
    m = decays(dA_i, dA_t, pos_i, pos_t, seq_i, seq_t, HAS_SEQ_IDX)
    ddt_acc = ddt_acc + ct.reshape(
        ct.load(cols, (b, h, c, i, t), shape=(1, 1, 1, 1, BLOCK_T)), (BLOCK_T,))
    G = cb * m * dt_t[None, :]
    dx_acc = ct.mma(ct.transpose(G.astype(op)), dy_i.astype(op), dx_acc)
    return dx_acc, ddt_acc


def pair_row_sums(rows, grad_dA, ddt_acc, dt_t, b, h, c, t, BLOCK_T):
    """grad_dA of token tile t, after the pair kernel: minus the column sums of dG G (dt times
    ddt's), plus the pair kernel's row sums over the column tiles j <= t."""
    grad_dA = grad_dA - ddt_acc * dt_t
    for j in range(t + 1):
        grad_dA = grad_dA + ct.reshape(
            ct.load(rows, (b, h, c, j, t), shape=(1, 1, 1, 1, BLOCK_T)), (BLOCK_T,))
    return grad_dA


def head_state(states, b, c, h, P, N, k=0):
    """Head h's (P, N) state of chunk c from a (batch, nchunks, nheads, headdim, dstate) array,
    zero-padded past headdim and dstate, in the array's dtype (dstate columns k * N ..
    (k + 1) * N - 1: slice k)."""
    return ct.reshape(ct.load(states, (b, c, h, 0, k), shape=(1, 1, 1, P, N), padding_mode=ZERO),
                      (P, N))


def own_state_weights(dA_cumsum, dA_t, dt_t, seq_idx, seq_t, seqlen, b, h, c, CHUNK, BLOCK_T,
                      HAS_SEQ_IDX):
    """(decay, v) of a token tile for chunk c's own state S[c] = sum_s v[s] outer(x[s], B[s]):
    decay = exp2(dA[last] - dA) for the tokens of the sequence the chunk's last token belongs to
    (0 for the others), v = decay dt."""
    keep = ct.full((BLOCK_T,), 1.0, dtype=ct.float32)
    if HAS_SEQ_IDX:
        seq_last = ct.load(seq_idx, (b, min((c + 1) * CHUNK, seqlen) - 1), shape=())
        keep = ct.where(seq_t == seq_last, 1.0, 0.0)
    dA_last = ct.load(dA_cumsum, (b, h, c, CHUNK - 1), shape=())
    decay = ct.exp2(ct.minimum(dA_last - dA_t, 0.0)) * keep
    return decay, decay * dt_t


def carried_terms(entry_states, seq_idx, dy_t, c_t, dA_t, dC_acc, b, c, h, tile, CHUNK, BLOCK_T,
                  P, N, HAS_SEQ_IDX, op, k=0):
    """Token tile ``tile``'s terms through the state carried into chunk c, for head h: dC_acc
    plus w (dy @ entry), and ddA's carried term w (dy . (C @ entry^T)) (w: ``carried_weight``);
    over dstate slice k (N columns: c_t and dC_acc are that slice's, the term a partial sum)."""
    state = head_state(entry_states, b, c, h, P, N, k).astype(op)
    dy_state = ct.mma(dy_t.astype(op), state, ct.zeros((BLOCK_T, N), dtype=ct.float32))
    w_t = carried_weight(dA_t, seq_idx, b, c, tile, CHUNK, BLOCK_T, HAS_SEQ_IDX)
    dC_acc = dC_acc + dy_state * w_t[:, None]
    return dC_acc, w_t * ct.sum(dy_state * c_t.astype(ct.float32), axis=1)


def own_state_terms(dS, ddA_tiles, x_t, b_t, decay, v, dB_acc, grad_dA, b, c, h, t, BLOCK_T, P,
                    N, op, k=0, SLICES=1):
    """Token tile t's terms through chunk c's own state S[c] = sum_s v[s] outer(x[s], B[s]) for
    head h (``own_state_weights``' decay and v), as ``bwd_chunk_states`` computes them: dB_acc
    plus (x dS) v, ddt's term dv decay with dv = (x dS) . B, grad_dA minus dv v; the tile's
    sum(dv v), ddA's term at the chunk's last token, is stored in ``ddA_tiles`` (at t * SLICES +
    k). Returns those three and dS[c] for h as operands (for dx's term v (B dS^T)). Over dstate
    slice k of SLICES (N columns: b_t and dB_acc are that slice's, dv a partial sum)."""
    ds = head_state(dS, b, c, h, P, N, k).astype(op)
    x_ds = ct.mma(x_t.astype(op), ds, ct.zeros((BLOCK_T, N), dtype=ct.float32))
    dB_acc = dB_acc + x_ds * v[:, None]
    dv = ct.sum(x_ds * b_t.astype(ct.float32), axis=1)
    dvv = dv * v
    ct.store(ddA_tiles, (b, h, c, t * SLICES + k), ct.sum(dvv))
    return dB_acc, dv * decay, grad_dA - dvv, ds


def dcb_tile(dcb_parts, batch, b, c, g, i, j, BLOCK_T, LOAD_LAT):
    """Tile (i, j) of chunk c's d(C B^T) for group g of batch row b (of ``batch``): the pair
    kernel's head-split partials added in order, (BLOCK_T, BLOCK_T) float32. The partials are
    (splits * batch, nchunks, ngroups, CHUNK, CHUNK), split s of row b at s * batch + b: five
    axes, not six, because a tensor of more than five is not copied with TMA: with six, the
    states launch loaded these tiles with per-thread cp.async (``LDGSTS``), and compiled for
    sm_90 to 6616 instructions against 4176 with five (``ops.tools.sass.pipeline_launches`` at
    1 x 2K tokens x 80 heads, dstate 128, chunk 128; ``tests/tools/test_sass.py``)."""
    acc = ct.zeros((BLOCK_T, BLOCK_T), dtype=ct.float32)
    for s in range(dcb_parts.shape[0] // batch):
        t = ct.load(dcb_parts, (s * batch + b, c, g, i, j), shape=(1, 1, 1, BLOCK_T, BLOCK_T),
                    latency=latency_hint(LOAD_LAT))
        acc = acc + ct.reshape(t, (BLOCK_T, BLOCK_T))
    return acc


def group_quadratic(dcb_parts, B, C, dB_acc, dC_acc, b, c, g, t, valid, TILES, BLOCK_T, N, op,
                    LOAD_LAT, k=0):
    """dB_acc and dC_acc plus token tile t's quadratic-form terms for group g, from the pair
    kernel's d(C B^T) summed over the group's heads (its head splits added in order): dB over
    the row tiles i >= t, dC over the column tiles j <= t. Once per group, not once per head.
    Over dstate slice k (N columns)."""
    batch = B.shape[0]
    for i in range(t, valid):
        d_it = dcb_tile(dcb_parts, batch, b, c, g, i, t, BLOCK_T, LOAD_LAT).astype(op)
        c_i = token_rows(C, b, c * TILES + i, g, BLOCK_T, N, LOAD_LAT, k)
        dB_acc = ct.mma(ct.transpose(d_it), c_i.astype(op), dB_acc)
    for j in range(t + 1):
        d_tj = dcb_tile(dcb_parts, batch, b, c, g, t, j, BLOCK_T, LOAD_LAT).astype(op)
        b_j = token_rows(B, b, c * TILES + j, g, BLOCK_T, N, LOAD_LAT, k)
        dC_acc = ct.mma(d_tj, b_j.astype(op), dC_acc)
    return dB_acc, dC_acc


@ct.kernel
def bwd_compute_out_kernel(
    dy: ct.IndexedWithInt64,            # (batch, seqlen, nheads, headdim), x's dtype
    x: ct.IndexedWithInt64,             # (batch, seqlen, nheads, headdim)
    B: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate), x's dtype
    C: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate), x's dtype
    dt_out: ct.IndexedWithInt64,        # (batch, nheads, nchunks, CHUNK) float32
    dA_cumsum: ct.IndexedWithInt64,     # (batch, nheads, nchunks, CHUNK) float32, log2 units
    entry_states: ct.IndexedWithInt64,  # (batch, nchunks, nheads, headdim, dstate)
    seq_idx: ct.IndexedWithInt64,       # (batch, seqlen) int32; unread if not HAS_SEQ_IDX
    dx: ct.IndexedWithInt64,            # (batch, seqlen, nheads, headdim) float32
    dB: ct.IndexedWithInt64,            # (splits, batch, seqlen, ngroups, dstate) float32
    dC: ct.IndexedWithInt64,            # (splits, batch, seqlen, ngroups, dstate) float32
    ddt: ct.IndexedWithInt64,           # (batch, nheads, nchunks, CHUNK) float32
    ddA: ct.IndexedWithInt64,           # (batch, nheads, nchunks, CHUNK) float32, natural units
    dS: ct.IndexedWithInt64,            # (batch, nchunks, nheads, headdim, dstate) float32 or
                                        # x's dtype; unread unless WITH_STATES
    ddA_tiles: ct.IndexedWithInt64,     # (batch, nheads, nchunks, CHUNK // BLOCK_T) float32;
                                        # unwritten unless WITH_STATES
    D: ct.IndexedWithInt64,             # (nheads,) or (nheads, headdim); unread unless WITH_SKIP
    dD: ct.IndexedWithInt64,            # (batch, token tiles, nheads, headdim or 1) partials;
                                        # unwritten unless WITH_SKIP
    scores: ct.IndexedWithInt64,        # (batch, nchunks, ngroups, CHUNK, CHUNK) float32 C B^T
                                        # (ops/kernels/common.py, or bwd_pairs_kernel with
                                        # PAIRS); unread unless SCORES_IN_MEMORY
    dcb_parts: ct.IndexedWithInt64,     # (pair splits * batch, nchunks, ngroups, CHUNK, CHUNK)
                                        # float32, bwd_pairs_kernel's; unread unless PAIRS
    cols: ct.IndexedWithInt64,          # (batch, nheads, nchunks, TILES, CHUNK) float32 and
    rows: ct.IndexedWithInt64,          # the same: bwd_pairs_kernel's sums; unread unless PAIRS
    heads_per_group: int,
    heads_per_block: int,               # divides heads_per_group; splits = their ratio
    CHUNK: ConstInt,
    BLOCK_T: ConstInt,                  # token tile (rows and columns of the quadratic form)
    P: ConstInt,                        # headdim and dstate tiles (powers of two, zero-padded)
    N: ConstInt,
    HAS_SEQ_IDX: ConstBool,
    BF16_OPERANDS: ConstBool,           # 16-bit operands for the computed ones (bf16 inputs)
    WITH_STATES: ConstBool,             # add the gradients through the chunk's own state (dS)
    WITH_SKIP: ConstBool,               # add the skip's dx (D dy) and write dD's partials
    SCORES_IN_MEMORY: ConstBool,        # read C B^T tiles from ``scores`` instead of forming them
    PAIRS: ConstBool,                   # the pair kernel ran: take d(C B^T) and the sums from it
    LOAD_LAT: ConstInt,                 # latency hint of the tile loads (0: none)
):
    splits = heads_per_group // heads_per_block
    head_blocks = dB.shape[3] * splits
    hblock = ct.bid(0) % head_blocks
    tile = ct.bid(0) // head_blocks                  # token tile of the whole (chunked) sequence
    b = ct.bid(1)
    g, split = hblock // splits, hblock % splits
    first_head = g * heads_per_group + split * heads_per_block
    TILES = CHUNK // BLOCK_T
    c, t = tile // TILES, tile % TILES               # its chunk, and its place in the chunk
    seqlen = x.shape[1]
    valid = min(TILES, ct.cdiv(seqlen - c * CHUNK, BLOCK_T))   # tiles of the chunk in the sequence
    op = x.dtype if BF16_OPERANDS else ct.float32    # operand dtype of the computed products

    if t >= valid:
        # Past the end of the sequence: only ddt and ddA (whole chunks) are there, all zero.
        zero = ct.zeros((1, 1, 1, BLOCK_T), dtype=ct.float32)
        for k in range(heads_per_block):
            ct.store(ddt, (b, first_head + k, c, t), zero)
            ct.store(ddA, (b, first_head + k, c, t), zero)
            if WITH_STATES:
                ct.store(ddA_tiles, (b, first_head + k, c, t), ct.zeros((), dtype=ct.float32))
            if WITH_SKIP:
                store_skip_partial(dD, D, b, tile, first_head + k,
                                   ct.zeros((P,), dtype=ct.float32), P)
    else:
        pos_t = t * BLOCK_T + ct.arange(BLOCK_T, dtype=ct.int32)    # positions in the chunk
        c_t = token_rows(C, b, tile, g, BLOCK_T, N)
        b_t = token_rows(B, b, tile, g, BLOCK_T, N)
        seq_t = sequence_ids(seq_idx, b, tile, BLOCK_T, HAS_SEQ_IDX)
        dB_acc = ct.zeros((BLOCK_T, N), dtype=ct.float32)
        dC_acc = ct.zeros((BLOCK_T, N), dtype=ct.float32)
        for k in range(heads_per_block):                # the group's heads, in order
            h = first_head + k
            dA_t = chunk_tokens(dA_cumsum, b, h, c, t, BLOCK_T)
            dt_t = chunk_tokens(dt_out, b, h, c, t, BLOCK_T)
            dy_t = token_rows(dy, b, tile, h, BLOCK_T, P, LOAD_LAT)
            x_t = token_rows(x, b, tile, h, BLOCK_T, P, LOAD_LAT)

            # Carried in, for the rows: dy @ entry gives dC's term and (read through C) ddA's.
            dC_acc, grad_dA = carried_terms(entry_states, seq_idx, dy_t, c_t, dA_t, dC_acc, b, c,
                                            h, tile, CHUNK, BLOCK_T, P, N, HAS_SEQ_IDX, op)

            # Tile t as the source tokens s: the row tiles i >= t of the chunk.
            dx_acc = ct.zeros((BLOCK_T, P), dtype=ct.float32)
            ddt_acc = ct.zeros((BLOCK_T,), dtype=ct.float32)
            for i in range(t, valid):
                row_tile = c * TILES + i
                if PAIRS:
                    # G only: dG's sums come from the pair kernel, d(C B^T) from its head sums
                    dx_acc, ddt_acc = pair_source_step(
                        token_rows(dy, b, row_tile, h, BLOCK_T, P, LOAD_LAT), dA_cumsum, seq_idx,
                        scores, cols, dx_acc, ddt_acc, b, h, c, g, i, t, row_tile, pos_t, seq_t,
                        dA_t, dt_t, BLOCK_T, HAS_SEQ_IDX, op, LOAD_LAT)
                else:
                    c_i = token_rows(C, b, row_tile, g, BLOCK_T, N)
                    dy_i = token_rows(dy, b, row_tile, h, BLOCK_T, P)
                    dA_i = chunk_tokens(dA_cumsum, b, h, c, i, BLOCK_T)
                    pos_i = i * BLOCK_T + ct.arange(BLOCK_T, dtype=ct.int32)
                    seq_i = sequence_ids(seq_idx, b, row_tile, BLOCK_T, HAS_SEQ_IDX)
                    cb = score_tile(scores, c_i, b_t, b, c, g, i, t, BLOCK_T, SCORES_IN_MEMORY)
                    dG = times_transposed(dy_i, x_t, ct.zeros((BLOCK_T, BLOCK_T), dtype=ct.float32))
                    m = decays(dA_i, dA_t, pos_i, pos_t, seq_i, seq_t, HAS_SEQ_IDX)
                    dG_m = dG * m
                    ddt_acc = ddt_acc + ct.sum(dG_m * cb, axis=0)
                    dcb = dG_m * dt_t[None, :]                                # d(C B^T)
                    grad_dA = grad_dA - ct.sum(dcb * cb, axis=0)         # column sums of dG G
                    G = cb * m * dt_t[None, :]
                    dx_acc = ct.mma(ct.transpose(G.astype(op)), dy_i.astype(op), dx_acc)
                    dB_acc = ct.mma(ct.transpose(dcb.astype(op)), c_i.astype(op), dB_acc)

            if PAIRS:
                # the column sums of dG G are dt times ddt's; the row sums, the pair kernel's
                grad_dA = pair_row_sums(rows, grad_dA, ddt_acc, dt_t, b, h, c, t, BLOCK_T)
            else:
                # Tile t as the target tokens l: the column tiles j <= t.
                for j in range(t + 1):
                    col_tile = c * TILES + j
                    b_j = token_rows(B, b, col_tile, g, BLOCK_T, N)
                    x_j = token_rows(x, b, col_tile, h, BLOCK_T, P)
                    dA_j = chunk_tokens(dA_cumsum, b, h, c, j, BLOCK_T)
                    dt_j = chunk_tokens(dt_out, b, h, c, j, BLOCK_T)
                    pos_j = j * BLOCK_T + ct.arange(BLOCK_T, dtype=ct.int32)
                    seq_j = sequence_ids(seq_idx, b, col_tile, BLOCK_T, HAS_SEQ_IDX)
                    cb = score_tile(scores, c_t, b_j, b, c, g, t, j, BLOCK_T, SCORES_IN_MEMORY)
                    dG = times_transposed(dy_t, x_j, ct.zeros((BLOCK_T, BLOCK_T), dtype=ct.float32))
                    m_dt = (decays(dA_t, dA_j, pos_t, pos_j, seq_t, seq_j, HAS_SEQ_IDX)
                            * dt_j[None, :])
                    dcb = dG * m_dt
                    grad_dA = grad_dA + ct.sum(dcb * cb, axis=1)         # row sums of dG G
                    dC_acc = ct.mma(dcb.astype(op), b_j.astype(op), dC_acc)

            if WITH_STATES:
                # Through the chunk's own state (ops/kernels/backward/bwd_chunk_states.py's work)
                decay, v = own_state_weights(dA_cumsum, dA_t, dt_t, seq_idx, seq_t, seqlen, b, h,
                                             c, CHUNK, BLOCK_T, HAS_SEQ_IDX)
                dB_acc, state_ddt, grad_dA, ds = own_state_terms(
                    dS, ddA_tiles, x_t, b_t, decay, v, dB_acc, grad_dA, b, c, h, t, BLOCK_T, P,
                    N, op)
                ddt_acc = ddt_acc + state_ddt
                b_ds = ct.mma(b_t.astype(op), ct.transpose(ds),
                              ct.zeros((BLOCK_T, P), dtype=ct.float32))
                dx_acc = dx_acc + b_ds * v[:, None]
            if WITH_SKIP:
                # out = y + D x: dx gets D dy, dD gets this tile's sum of dy x
                dy_f32 = dy_t.astype(ct.float32)
                dx_acc = dx_acc + dy_f32 * skip_weight(D, h, P)[None, :]
                store_skip_partial(dD, D, b, tile, h,
                                   ct.sum(dy_f32 * x_t.astype(ct.float32), axis=0), P)
            ct.store(dx, (b, tile, h, 0), ct.reshape(dx_acc, (1, BLOCK_T, 1, P)).astype(dx.dtype))
            ct.store(ddt, (b, h, c, t), ct.reshape(ddt_acc, (1, 1, 1, BLOCK_T)))
            ct.store(ddA, (b, h, c, t), ct.reshape(grad_dA, (1, 1, 1, BLOCK_T)))
        if PAIRS and split == 0:
            dB_acc, dC_acc = group_quadratic(dcb_parts, B, C, dB_acc, dC_acc, b, c, g, t, valid,
                                             TILES, BLOCK_T, N, op, LOAD_LAT)
        ct.store(dB, (split, b, tile, g, 0), ct.reshape(dB_acc, (1, 1, BLOCK_T, 1, N)))
        ct.store(dC, (split, b, tile, g, 0), ct.reshape(dC_acc, (1, 1, BLOCK_T, 1, N)))


@ct.kernel
def bwd_pairs_kernel(
    dy: ct.IndexedWithInt64,            # (batch, seqlen, nheads, headdim), x's dtype
    x: ct.IndexedWithInt64,             # (batch, seqlen, nheads, headdim)
    B: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate), x's dtype
    C: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate), x's dtype
    dt_out: ct.IndexedWithInt64,        # (batch, nheads, nchunks, CHUNK) float32
    dA_cumsum: ct.IndexedWithInt64,     # (batch, nheads, nchunks, CHUNK) float32, log2 units
    seq_idx: ct.IndexedWithInt64,       # (batch, seqlen) int32; unread if not HAS_SEQ_IDX
    scores: ct.IndexedWithInt64,        # (batch, nchunks, ngroups, CHUNK, CHUNK) float32 C B^T
    dcb_parts: ct.IndexedWithInt64,     # (splits * batch, nchunks, ngroups, CHUNK, CHUNK)
                                        # float32: split s of batch row b at s * batch + b
    cols: ct.IndexedWithInt64,          # (batch, nheads, nchunks, TILES, CHUNK) float32
    rows: ct.IndexedWithInt64,          # (batch, nheads, nchunks, TILES, CHUNK) float32
    heads_per_group: int,
    heads_per_block: int,               # divides heads_per_group; splits = their ratio
    CHUNK: ConstInt,
    BLOCK_T: ConstInt,
    P: ConstInt,
    N: ConstInt,
    HAS_SEQ_IDX: ConstBool,
    LOAD_LAT: ConstInt,                 # latency hint of the tile loads (0: none)
):
    splits = heads_per_group // heads_per_block
    head_blocks = dcb_parts.shape[2] * splits
    hblock = ct.bid(0) % head_blocks
    pair = ct.bid(0) // head_blocks
    b = ct.bid(1)
    g, split = hblock // splits, hblock % splits
    first_head = g * heads_per_group + split * heads_per_block
    TILES = CHUNK // BLOCK_T
    j = pair % TILES                                 # the source tokens' tile (columns)
    i = (pair // TILES) % TILES                      # the target tokens' tile (rows), i >= j
    c = pair // (TILES * TILES)
    valid = min(TILES, ct.cdiv(x.shape[1] - c * CHUNK, BLOCK_T))
    if j <= i and i < valid:
        row_tile, col_tile = c * TILES + i, c * TILES + j
        cb = times_transposed(token_rows(C, b, row_tile, g, BLOCK_T, N, LOAD_LAT),
                              token_rows(B, b, col_tile, g, BLOCK_T, N, LOAD_LAT),
                              ct.zeros((BLOCK_T, BLOCK_T), dtype=ct.float32))
        if split == 0:
            ct.store(scores, (b, c, g, i, j), ct.reshape(cb, (1, 1, 1, BLOCK_T, BLOCK_T)))
        pos_i = i * BLOCK_T + ct.arange(BLOCK_T, dtype=ct.int32)
        pos_j = j * BLOCK_T + ct.arange(BLOCK_T, dtype=ct.int32)
        seq_i = sequence_ids(seq_idx, b, row_tile, BLOCK_T, HAS_SEQ_IDX)
        seq_j = sequence_ids(seq_idx, b, col_tile, BLOCK_T, HAS_SEQ_IDX)
        acc = ct.zeros((BLOCK_T, BLOCK_T), dtype=ct.float32)
        for k in range(heads_per_block):                 # the heads, in order
            h = first_head + k
            dA_i = chunk_tokens(dA_cumsum, b, h, c, i, BLOCK_T)
            dA_j = chunk_tokens(dA_cumsum, b, h, c, j, BLOCK_T)
            dt_j = chunk_tokens(dt_out, b, h, c, j, BLOCK_T)
            dG = times_transposed(token_rows(dy, b, row_tile, h, BLOCK_T, P, LOAD_LAT),
                                  token_rows(x, b, col_tile, h, BLOCK_T, P, LOAD_LAT),
                                  ct.zeros((BLOCK_T, BLOCK_T), dtype=ct.float32))
            dG_m = dG * decays(dA_i, dA_j, pos_i, pos_j, seq_i, seq_j, HAS_SEQ_IDX)
            dG_cb = dG_m * cb
            ct.store(cols, (b, h, c, i, j),
                     ct.reshape(ct.sum(dG_cb, axis=0), (1, 1, 1, 1, BLOCK_T)))
            ct.store(rows, (b, h, c, j, i),
                     ct.reshape(ct.sum(dG_cb * dt_j[None, :], axis=1), (1, 1, 1, 1, BLOCK_T)))
            acc = acc + dG_m * dt_j[None, :]
        ct.store(dcb_parts, (split * x.shape[0] + b, c, g, i, j),
                 ct.reshape(acc, (1, 1, 1, BLOCK_T, BLOCK_T)))


@ct.kernel
def bwd_token_states_kernel(
    dy: ct.IndexedWithInt64,            # (batch, seqlen, nheads, headdim), x's dtype
    x: ct.IndexedWithInt64,             # (batch, seqlen, nheads, headdim)
    B: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate), x's dtype
    C: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate), x's dtype
    dt_out: ct.IndexedWithInt64,        # (batch, nheads, nchunks, CHUNK) float32
    dA_cumsum: ct.IndexedWithInt64,     # (batch, nheads, nchunks, CHUNK) float32, log2 units
    entry_states: ct.IndexedWithInt64,  # (batch, nchunks, nheads, headdim, dstate)
    seq_idx: ct.IndexedWithInt64,       # (batch, seqlen) int32; unread if not HAS_SEQ_IDX
    dB: ct.IndexedWithInt64,            # (splits, batch, seqlen, ngroups, dstate) float32
    dC: ct.IndexedWithInt64,            # (splits, batch, seqlen, ngroups, dstate) float32
    state_ddt: ct.IndexedWithInt64,     # (SLICES, batch, nheads, nchunks, CHUNK) float32: the
    state_ddA: ct.IndexedWithInt64,     # states' terms of ddt and ddA per dstate slice, for
                                        # bwd_token_dx_kernel
    dS: ct.IndexedWithInt64,            # (batch, nchunks, nheads, headdim, dstate); unread
                                        # unless WITH_STATES
    ddA_tiles: ct.IndexedWithInt64,     # (batch, nheads, nchunks, CHUNK // BLOCK_T * SLICES)
                                        # float32; unwritten unless WITH_STATES
    dcb_parts: ct.IndexedWithInt64,     # (pair splits * batch, nchunks, ngroups, CHUNK, CHUNK)
    heads_per_group: int,
    heads_per_block: int,
    CHUNK: ConstInt,
    BLOCK_T: ConstInt,
    P: ConstInt,
    N: ConstInt,                        # the dstate columns of one slice
    HAS_SEQ_IDX: ConstBool,
    BF16_OPERANDS: ConstBool,
    WITH_STATES: ConstBool,
    LOAD_LAT: ConstInt,
    SLICES: ConstInt,                   # dstate slices, one per block (STATES_SLICES)
):
    splits = heads_per_group // heads_per_block
    head_blocks = dB.shape[3] * splits
    k = ct.bid(0) % SLICES                          # the slice: slices fastest
    hblock = (ct.bid(0) // SLICES) % head_blocks
    tile = ct.bid(0) // (SLICES * head_blocks)
    b = ct.bid(1)
    g, split = hblock // splits, hblock % splits
    first_head = g * heads_per_group + split * heads_per_block
    TILES = CHUNK // BLOCK_T
    c, t = tile // TILES, tile % TILES
    valid = min(TILES, ct.cdiv(x.shape[1] - c * CHUNK, BLOCK_T))
    op = x.dtype if BF16_OPERANDS else ct.float32
    if t >= valid:
        # past the sequence: ddA_tiles' zeros here, ddt's and ddA's in bwd_token_dx_kernel
        if WITH_STATES:
            for i in range(heads_per_block):
                ct.store(ddA_tiles, (b, first_head + i, c, t * SLICES + k),
                         ct.zeros((), dtype=ct.float32))
    else:
        c_t = token_rows(C, b, tile, g, BLOCK_T, N, LOAD_LAT, k)
        b_t = token_rows(B, b, tile, g, BLOCK_T, N, LOAD_LAT, k)
        seq_t = sequence_ids(seq_idx, b, tile, BLOCK_T, HAS_SEQ_IDX)
        dB_acc = ct.zeros((BLOCK_T, N), dtype=ct.float32)
        dC_acc = ct.zeros((BLOCK_T, N), dtype=ct.float32)
        for i in range(heads_per_block):                # the group's heads, in order
            h = first_head + i
            dA_t = chunk_tokens(dA_cumsum, b, h, c, t, BLOCK_T)
            dy_t = token_rows(dy, b, tile, h, BLOCK_T, P, LOAD_LAT)
            # Carried in, for the rows: dy @ entry gives dC's term and (read through C) ddA's.
            dC_acc, grad_dA = carried_terms(entry_states, seq_idx, dy_t, c_t, dA_t, dC_acc, b, c,
                                            h, tile, CHUNK, BLOCK_T, P, N, HAS_SEQ_IDX, op, k)
            grad_dt = ct.zeros((BLOCK_T,), dtype=ct.float32)
            if WITH_STATES:
                # Through the chunk's own state: x dS, for dB and for the write weights' dv.
                dt_t = chunk_tokens(dt_out, b, h, c, t, BLOCK_T)
                decay, v = own_state_weights(dA_cumsum, dA_t, dt_t, seq_idx, seq_t, x.shape[1],
                                             b, h, c, CHUNK, BLOCK_T, HAS_SEQ_IDX)
                x_t = token_rows(x, b, tile, h, BLOCK_T, P, LOAD_LAT)
                dB_acc, grad_dt, grad_dA, _ = own_state_terms(
                    dS, ddA_tiles, x_t, b_t, decay, v, dB_acc, grad_dA, b, c, h, t, BLOCK_T, P,
                    N, op, k, SLICES)
            ct.store(state_ddt, (k, b, h, c, t), ct.reshape(grad_dt, (1, 1, 1, 1, BLOCK_T)))
            ct.store(state_ddA, (k, b, h, c, t), ct.reshape(grad_dA, (1, 1, 1, 1, BLOCK_T)))
        if split == 0:
            dB_acc, dC_acc = group_quadratic(dcb_parts, B, C, dB_acc, dC_acc, b, c, g, t, valid,
                                             TILES, BLOCK_T, N, op, LOAD_LAT, k)
        ct.store(dB, (split, b, tile, g, k), ct.reshape(dB_acc, (1, 1, BLOCK_T, 1, N)))
        ct.store(dC, (split, b, tile, g, k), ct.reshape(dC_acc, (1, 1, BLOCK_T, 1, N)))


def states_term(terms, b, h, c, t, BLOCK_T, SLICES):
    """Token tile t of chunk c, head h, of ``bwd_token_states_kernel``'s (SLICES, batch, nheads,
    nchunks, CHUNK) per-slice terms, its dstate slices added in order: (BLOCK_T,)."""
    acc = ct.reshape(ct.load(terms, (0, b, h, c, t), shape=(1, 1, 1, 1, BLOCK_T)), (BLOCK_T,))
    for k in range(1, SLICES):
        acc = acc + ct.reshape(ct.load(terms, (k, b, h, c, t), shape=(1, 1, 1, 1, BLOCK_T)),
                               (BLOCK_T,))
    return acc


def dx_zero_tile(ddt, ddA, D, dD, b, h, c, t, tile, zero, P, WITH_SKIP):
    """Token tile t of chunk c lies wholly past the sequence: head h's ddt and ddA there (whole
    chunks) are zero, and so is its dD partial."""
    ct.store(ddt, (b, h, c, t), zero)
    ct.store(ddA, (b, h, c, t), zero)
    if WITH_SKIP:
        store_skip_partial(dD, D, b, tile, h, ct.zeros((P,), dtype=ct.float32), P)


def own_state_dx(B, dS, dA_cumsum, dA_t, dt_t, seq_idx, seq_t, seqlen, b, h, g, c, tile, CHUNK,
                 BLOCK_T, P, N, HAS_SEQ_IDX, op, LOAD_LAT):
    """Token tile ``tile``'s (BLOCK_T, P) term of dx through chunk c's own state, for head h:
    v (B dS^T) (v: ``own_state_weights``' write weights)."""
    _, v = own_state_weights(dA_cumsum, dA_t, dt_t, seq_idx, seq_t, seqlen, b, h, c, CHUNK,
                             BLOCK_T, HAS_SEQ_IDX)
    b_t = token_rows(B, b, tile, g, BLOCK_T, N, LOAD_LAT).astype(op)
    ds = head_state(dS, b, c, h, P, N).astype(op)
    return ct.mma(b_t, ct.transpose(ds), ct.zeros((BLOCK_T, P), dtype=ct.float32)) * v[:, None]


def skip_weight(D, h, P):
    """Head h's D as a float32 row to scale its (BLOCK_T, P) tiles by: D is (nheads,) or
    (nheads, headdim), as the caller gave it (a rank known when compiling: each compiles its own
    code), in any float dtype. A 1-d D is read as one scalar per head, a (1,) row that
    broadcasts over P, with no (nheads, headdim) copy made first."""
    if D.ndim == 1:
        return ct.load(D, (h,), shape=(1,)).astype(ct.float32)
    row = ct.load(D, (h, 0), shape=(1, P), padding_mode=ZERO)
    return ct.reshape(row, (P,)).astype(ct.float32)


def store_skip_partial(dD, D, b, tile, h, part, P):
    """Head h's partial of dD for token tile ``tile``: ``part``, the tile's (P,) sum of dy x,
    stored as it is for a 2-d D, and summed over P too for a 1-d D (one number per head: its
    partials are (batch, token tiles, nheads, 1), headdim times fewer bytes to write and sum)."""
    if D.ndim == 1:
        ct.store(dD, (b, tile, h, 0), ct.reshape(ct.sum(part), (1, 1, 1, 1)))
    else:
        ct.store(dD, (b, tile, h, 0), ct.reshape(part, (1, 1, 1, P)))


def skip_terms(D, dD, x, dx_acc, dy_t, b, tile, h, BLOCK_T, P, LOAD_LAT):
    """The skip out = y + D x for head h's token tile ``tile``: dx_acc plus D dy, returned, and
    dD's partial, the tile's sum of dy x, written."""
    d_h = skip_weight(D, h, P)
    x_t = token_rows(x, b, tile, h, BLOCK_T, P, LOAD_LAT)
    store_skip_partial(dD, D, b, tile, h,
                       ct.sum(dy_t.astype(ct.float32) * x_t.astype(ct.float32), axis=0), P)
    return dx_acc + dy_t.astype(ct.float32) * d_h[None, :]


def dx_head_tile(dy, x, B, dt_out, dA_cumsum, seq_idx, dx, ddt, ddA, state_ddt, state_ddA, dS,
                 D, dD, scores, cols, rows, b, h, g, c, t, tile, valid, pos_t, seq_t, CHUNK,
                 BLOCK_T, P, N, HAS_SEQ_IDX, op, WITH_STATES, WITH_SKIP, LOAD_LAT,
                 SLICES):
    """``bwd_token_dx_kernel``'s work for one head h of token tile t (chunk c): dx, ddt and ddA
    of the tile's tokens, and dD's partial, written."""
    TILES = CHUNK // BLOCK_T
    dA_t = chunk_tokens(dA_cumsum, b, h, c, t, BLOCK_T)
    dt_t = chunk_tokens(dt_out, b, h, c, t, BLOCK_T)
    # Tile t as the source tokens s: G for dx, the pair kernel's sums for ddt.
    dx_acc = ct.zeros((BLOCK_T, P), dtype=ct.float32)
    ddt_acc = ct.zeros((BLOCK_T,), dtype=ct.float32)
    for i in range(t, valid):
        dx_acc, ddt_acc = pair_source_step(
            token_rows(dy, b, c * TILES + i, h, BLOCK_T, P, LOAD_LAT), dA_cumsum, seq_idx,
            scores, cols, dx_acc, ddt_acc, b, h, c, g, i, t, c * TILES + i, pos_t, seq_t, dA_t,
            dt_t, BLOCK_T, HAS_SEQ_IDX, op, LOAD_LAT)
    # ddA: the states' terms (carried in, own state), minus the column sums of dG G (dt
    # times ddt's), plus the row sums
    grad_dA = pair_row_sums(rows, states_term(state_ddA, b, h, c, t, BLOCK_T, SLICES), ddt_acc,
                            dt_t, b, h, c, t, BLOCK_T)
    ddt_acc = ddt_acc + states_term(state_ddt, b, h, c, t, BLOCK_T, SLICES)
    if WITH_STATES:
        # through the chunk's own state: dx gets v (B dS^T)
        dx_acc = dx_acc + own_state_dx(B, dS, dA_cumsum, dA_t, dt_t, seq_idx, seq_t, x.shape[1],
                                       b, h, g, c, tile, CHUNK, BLOCK_T, P, N, HAS_SEQ_IDX, op,
                                       LOAD_LAT)
    if WITH_SKIP:
        # out = y + D x: dx gets D dy, dD gets this tile's sum of dy x
        dx_acc = skip_terms(D, dD, x, dx_acc, token_rows(dy, b, tile, h, BLOCK_T, P, LOAD_LAT),
                            b, tile, h, BLOCK_T, P, LOAD_LAT)
    ct.store(dx, (b, tile, h, 0), ct.reshape(dx_acc, (1, BLOCK_T, 1, P)).astype(dx.dtype))
    ct.store(ddt, (b, h, c, t), ct.reshape(ddt_acc, (1, 1, 1, BLOCK_T)))
    ct.store(ddA, (b, h, c, t), ct.reshape(grad_dA, (1, 1, 1, BLOCK_T)))


def dx_head_tile_loads_first(dy, x, B, dt_out, dA_cumsum, seq_idx, dx, ddt, ddA, state_ddt,
                             state_ddA, dS, D, dD, scores, cols, rows, b, h, g, c, t, tile,
                             valid, pos_t, seq_t, CHUNK, BLOCK_T, P, N, HAS_SEQ_IDX, op,
                             WITH_STATES, WITH_SKIP, LOAD_LAT, SLICES):
    """``dx_head_tile``'s work in another order (DX_LOADS_FIRST): every load that does not wait
    for the loop over row tiles -- the states launch's terms, B and dS for v (B dS^T), D, the
    tile's own dy -- is issued before the loop, and the terms they give start dx's
    accumulator, so that a block waits on memory once rather than once per step. The diagonal
    step (i = t) takes the tile's dy loaded for D dy."""
    TILES = CHUNK // BLOCK_T
    dA_t = chunk_tokens(dA_cumsum, b, h, c, t, BLOCK_T)
    dt_t = chunk_tokens(dt_out, b, h, c, t, BLOCK_T)
    dy_t = token_rows(dy, b, tile, h, BLOCK_T, P, LOAD_LAT)
    from_states_dA = states_term(state_ddA, b, h, c, t, BLOCK_T, SLICES)
    from_states_dt = states_term(state_ddt, b, h, c, t, BLOCK_T, SLICES)
    dx_acc = ct.zeros((BLOCK_T, P), dtype=ct.float32)
    if WITH_STATES:
        # through the chunk's own state: dx gets v (B dS^T)
        dx_acc = own_state_dx(B, dS, dA_cumsum, dA_t, dt_t, seq_idx, seq_t, x.shape[1], b, h, g,
                              c, tile, CHUNK, BLOCK_T, P, N, HAS_SEQ_IDX, op, LOAD_LAT)
    if WITH_SKIP:
        # out = y + D x: dx gets D dy, dD gets this tile's sum of dy x
        dx_acc = skip_terms(D, dD, x, dx_acc, dy_t, b, tile, h, BLOCK_T, P, LOAD_LAT)
    # Tile t as the source tokens s: G for dx, the pair kernel's sums for ddt.
    dx_acc, ddt_acc = pair_source_step(
        dy_t, dA_cumsum, seq_idx, scores, cols, dx_acc, ct.zeros((BLOCK_T,), dtype=ct.float32),
        b, h, c, g, t, t, tile, pos_t, seq_t, dA_t, dt_t, BLOCK_T, HAS_SEQ_IDX, op, LOAD_LAT)
    for i in range(t + 1, valid):
        dx_acc, ddt_acc = pair_source_step(
            token_rows(dy, b, c * TILES + i, h, BLOCK_T, P, LOAD_LAT), dA_cumsum, seq_idx,
            scores, cols, dx_acc, ddt_acc, b, h, c, g, i, t, c * TILES + i, pos_t, seq_t, dA_t,
            dt_t, BLOCK_T, HAS_SEQ_IDX, op, LOAD_LAT)
    grad_dA = pair_row_sums(rows, from_states_dA, ddt_acc, dt_t, b, h, c, t, BLOCK_T)
    ct.store(dx, (b, tile, h, 0), ct.reshape(dx_acc, (1, BLOCK_T, 1, P)).astype(dx.dtype))
    ct.store(ddt, (b, h, c, t), ct.reshape(ddt_acc + from_states_dt, (1, 1, 1, BLOCK_T)))
    ct.store(ddA, (b, h, c, t), ct.reshape(grad_dA, (1, 1, 1, BLOCK_T)))


def dx_head(dy, x, B, dt_out, dA_cumsum, seq_idx, dx, ddt, ddA, state_ddt, state_ddA, dS, D, dD,
            scores, cols, rows, b, h, g, c, t, tile, valid, pos_t, seq_t, CHUNK, BLOCK_T, P, N,
            HAS_SEQ_IDX, op, WITH_STATES, WITH_SKIP, LOAD_LAT, SLICES, LOADS_FIRST):
    """One head's work in ``bwd_token_dx_kernel``: ``dx_head_tile_loads_first`` with
    LOADS_FIRST, else ``dx_head_tile``."""
    if LOADS_FIRST:
        dx_head_tile_loads_first(dy, x, B, dt_out, dA_cumsum, seq_idx, dx, ddt, ddA, state_ddt,
                                 state_ddA, dS, D, dD, scores, cols, rows, b, h, g, c, t, tile,
                                 valid, pos_t, seq_t, CHUNK, BLOCK_T, P, N, HAS_SEQ_IDX, op,
                                 WITH_STATES, WITH_SKIP, LOAD_LAT, SLICES)
    else:
        dx_head_tile(dy, x, B, dt_out, dA_cumsum, seq_idx, dx, ddt, ddA, state_ddt, state_ddA,
                     dS, D, dD, scores, cols, rows, b, h, g, c, t, tile, valid, pos_t, seq_t,
                     CHUNK, BLOCK_T, P, N, HAS_SEQ_IDX, op, WITH_STATES, WITH_SKIP, LOAD_LAT,
                     SLICES)


@ct.kernel
def bwd_token_dx_kernel(
    dy: ct.IndexedWithInt64,            # (batch, seqlen, nheads, headdim), x's dtype
    x: ct.IndexedWithInt64,             # (batch, seqlen, nheads, headdim)
    B: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate), x's dtype
    dt_out: ct.IndexedWithInt64,        # (batch, nheads, nchunks, CHUNK) float32
    dA_cumsum: ct.IndexedWithInt64,     # (batch, nheads, nchunks, CHUNK) float32, log2 units
    seq_idx: ct.IndexedWithInt64,       # (batch, seqlen) int32; unread if not HAS_SEQ_IDX
    dx: ct.IndexedWithInt64,            # (batch, seqlen, nheads, headdim)
    ddt: ct.IndexedWithInt64,           # (batch, nheads, nchunks, CHUNK) float32
    ddA: ct.IndexedWithInt64,           # (batch, nheads, nchunks, CHUNK) float32, natural units
    state_ddt: ct.IndexedWithInt64,     # bwd_token_states_kernel's terms of ddt and ddA,
    state_ddA: ct.IndexedWithInt64,     # (SLICES, batch, nheads, nchunks, CHUNK) float32
    dS: ct.IndexedWithInt64,            # unread unless WITH_STATES
    D: ct.IndexedWithInt64,             # (nheads,) or (nheads, headdim); unread unless WITH_SKIP
    dD: ct.IndexedWithInt64,            # (batch, token tiles, nheads, headdim or 1) float32
    scores: ct.IndexedWithInt64,        # (batch, nchunks, ngroups, CHUNK, CHUNK) float32 C B^T
    cols: ct.IndexedWithInt64,          # (batch, nheads, nchunks, TILES, CHUNK) float32
    rows: ct.IndexedWithInt64,          # (batch, nheads, nchunks, TILES, CHUNK) float32
    heads_per_group: int,
    CHUNK: ConstInt,
    BLOCK_T: ConstInt,
    P: ConstInt,
    N: ConstInt,
    HAS_SEQ_IDX: ConstBool,
    BF16_OPERANDS: ConstBool,
    WITH_STATES: ConstBool,
    WITH_SKIP: ConstBool,
    LOAD_LAT: ConstInt,
    HEADS: ConstInt,                    # heads per block, of one group, one after the other
    LOADS_FIRST: ConstBool,             # dx_head_tile_loads_first's order
    SLICES: ConstInt,                   # the states launch's dstate slices (its terms' first axis)
):
    # One head per block (dx_config's at dstate 256 and up, or where a group's heads are odd) is
    # written without the loop over heads: as a loop of one, its in-order path compiled for sm_90
    # to more instructions (2240 against 2208) and a third more shared memory (44416 B against
    # 33920: ``ops.tools.sass.sass_report``).
    if HEADS == 1:
        first_head = ct.bid(0) % x.shape[2]
        tile = ct.bid(0) // x.shape[2]
    else:
        head_blocks = x.shape[2] // HEADS
        first_head = (ct.bid(0) % head_blocks) * HEADS
        tile = ct.bid(0) // head_blocks
    b = ct.bid(1)
    g = first_head // heads_per_group
    TILES = CHUNK // BLOCK_T
    c, t = tile // TILES, tile % TILES
    valid = min(TILES, ct.cdiv(x.shape[1] - c * CHUNK, BLOCK_T))
    op = x.dtype if BF16_OPERANDS else ct.float32
    if t >= valid:
        # Past the end of the sequence: only ddt and ddA (whole chunks) are there, all zero.
        zero = ct.zeros((1, 1, 1, BLOCK_T), dtype=ct.float32)
        if HEADS == 1:
            dx_zero_tile(ddt, ddA, D, dD, b, first_head, c, t, tile, zero, P, WITH_SKIP)
        else:
            for k in range(HEADS):
                dx_zero_tile(ddt, ddA, D, dD, b, first_head + k, c, t, tile, zero, P,
                             WITH_SKIP)
    else:
        pos_t = t * BLOCK_T + ct.arange(BLOCK_T, dtype=ct.int32)
        seq_t = sequence_ids(seq_idx, b, tile, BLOCK_T, HAS_SEQ_IDX)
        if HEADS == 1:
            dx_head(dy, x, B, dt_out, dA_cumsum, seq_idx, dx, ddt, ddA, state_ddt, state_ddA, dS,
                    D, dD, scores, cols, rows, b, first_head, g, c, t, tile, valid, pos_t, seq_t,
                    CHUNK, BLOCK_T, P, N, HAS_SEQ_IDX, op, WITH_STATES, WITH_SKIP, LOAD_LAT,
                    SLICES, LOADS_FIRST)
        else:
            for k in range(HEADS):                  # the heads, in order
                dx_head(dy, x, B, dt_out, dA_cumsum, seq_idx, dx, ddt, ddA, state_ddt,
                        state_ddA, dS, D, dD, scores, cols, rows, b, first_head + k, g, c, t,
                        tile, valid, pos_t, seq_t, CHUNK, BLOCK_T, P, N, HAS_SEQ_IDX, op,
                        WITH_STATES, WITH_SKIP, LOAD_LAT, SLICES, LOADS_FIRST)


@ct.kernel
def bwd_entry_kernel(
    dy: ct.IndexedWithInt64,            # (batch, seqlen, nheads, headdim), x's dtype
    C: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate)
    dA_cumsum: ct.IndexedWithInt64,     # (batch, nheads, nchunks, CHUNK) float32, log2 units
    seq_idx: ct.IndexedWithInt64,       # (batch, seqlen) int32; unread if not HAS_SEQ_IDX
    dentry: ct.IndexedWithInt64,        # (batch, nchunks, nheads, headdim, dstate) float32
    heads_per_group: int,
    CHUNK: ConstInt,
    BLOCK_T: ConstInt,
    BLOCK_P: ConstInt,
    BLOCK_N: ConstInt,
    HAS_SEQ_IDX: ConstBool,
    BF16_OPERANDS: ConstBool,
):
    nheads = dy.shape[2]
    n_ptiles = ct.cdiv(dy.shape[3], BLOCK_P)
    n_tiles = n_ptiles * ct.cdiv(C.shape[3], BLOCK_N)
    state_tile = ct.bid(0) % n_tiles
    pi, ni = state_tile % n_ptiles, state_tile // n_ptiles
    h = (ct.bid(0) // n_tiles) % nheads
    c = ct.bid(0) // (n_tiles * nheads)
    b = ct.bid(1)
    acc = entry_gradient(dy, C, dA_cumsum, seq_idx, b, c, h, h // heads_per_group, pi, ni,
                         CHUNK, BLOCK_T, BLOCK_P, BLOCK_N, HAS_SEQ_IDX, BF16_OPERANDS,
                         ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32))
    ct.store(dentry, (b, c, h, pi, ni), ct.reshape(acc, (1, 1, 1, BLOCK_P, BLOCK_N)))


# Configs and launching -------------------------------------------------------------------------

# The token kernel's block holds many live tiles (the dB, dC and dx accumulators, the tile's B
# and C, the (BLOCK_T, BLOCK_T) products): with eight worker warps it spills far less than at the
# compiler's own warp count, with fewer instructions (``python -m ops.tools.sass`` shows both),
# and the compiler's count (at two blocks per multiprocessor) runs slower
# (``tests/benchmark/results/bwd_compute_out_configs_h200.csv``; PERF_NOTES.md, "Heads per block").
WORKER_WARPS = 8


def default_block_t(chunk_size, headdim, dstate):
    """64-token tiles, 32 beyond a 64 x 256 (= 128 x 128) state (the block holds (BLOCK_T,
    dstate) dB and dC accumulators and (headdim, dstate) states); never more than the chunk.

    At 64 x 128, 32-token tiles take about twice the time of 64-token ones
    (``tests/benchmark/results/bwd_compute_out_configs_h200.csv``, the ``BLOCK_T`` rows). Beyond
    that size only the compiled code was compared: 64-token tiles spill less than 32-token ones
    up to 64 x 256 and 128 x 128, and more beyond, which sets the threshold (the spill counts of
    each: ``python -m ops.tools.sass``)."""
    big = tile_size(headdim) * tile_size(dstate) > 64 * 256
    return min(32 if big else 64, chunk_size)


# Blocks wanted per multiprocessor. One block is resident per multiprocessor (its registers and
# shared memory: ``python -m ops.tools.sass``), and a block walks its heads one after the other,
# so more, shorter blocks finish the last wave sooner: at the 2.7B training shape fewer heads per
# block than all 80 run faster, down to about 20
# (``tests/benchmark/results/bwd_compute_out_configs_h200.csv``, the ``HEADS_PER_BLOCK`` rows;
# PERF_NOTES.md, "Heads per block"). Each split adds a (b, L, g, n) float32 partial of dB and of
# dC, so the target stops at ~6 blocks per multiprocessor, and at MAX_SPLITS partials: at 1 x 4K
# x 80 heads (64 token tiles), 6 blocks per multiprocessor would take 16 splits, whose partials
# would be a large part of that backward's peak (``ops.backward.memory_accounting`` counts them);
# the limit of 4 itself is untimed.
BLOCKS_PER_SM = 6
MAX_SPLITS = 4
# The pair kernel's blocks (``default_heads_per_block`` with this target): its blocks are
# short (one pair), and at the 2.7B training shape 40 heads per block (~6 blocks per
# multiprocessor) took less time than 20 and 10 (``bwd_pairs_variants_h200.csv``).
PAIR_BLOCKS_PER_SM = 4
# Its occupancy hint: the compiler's own choice keeps one block (130 KB of shared memory at 64 x
# 128) per multiprocessor; asking for two took 1.4-3% less time for a whole training step at five
# of the six shapes timed (the model shapes, 16K x dstate 128, 64K x dstate 256) and was level
# at 4K x dstate 64; four took more at two of them (``bwd_split_dx_h200.csv``).
PAIR_OCCUPANCY = 2
# The pair kernel runs first by default (module docstring, "The pair kernel first"), and after
# it the token work in two launches (module docstring, "Split dx").
PAIRS_DEFAULT = True
SPLIT_DX_DEFAULT = True


def default_heads_per_block(*, nheads, ngroups, blocks_per_head_block, device=None,
                            blocks_per_sm=BLOCKS_PER_SM):
    """The largest divisor of a group's heads that gives ``blocks_per_sm`` blocks per
    multiprocessor (all the heads of a group, dB and dC written directly, for long sequences;
    else partials summed on the host) in at most ``MAX_SPLITS`` splits of a group; else the
    most splits allowed (one head per block when a group has few heads)."""
    wanted = blocks_per_sm * multiprocessors(device)
    per_group = nheads // ngroups
    allowed = [hb for hb in sorted(group_divisors(nheads, ngroups), reverse=True)
               if per_group // hb <= MAX_SPLITS] or [1]
    for hb in allowed:
        if blocks_per_head_block * ngroups * (per_group // hb) >= wanted:
            return hb
    return allowed[-1]


def scores_in_memory(dstate):
    """Whether C B^T is read from memory by default: ``ops/kernels/common.py`` forms it once per
    chunk and group before the token kernel, and every head of the group reads it, instead of
    each head forming it again. The rule, from a training step's scan timed off and on side by
    side (``tests/benchmark/results/bwd_scores_in_memory_h200.csv``; the backward alone in
    ``bwd_compute_out_variants_h200.csv``; PERF_NOTES.md, "C B^T from memory where dstate's tile
    is 128"): at dstate 128 on is faster wherever the GPU, not the host, sets the step's time; at
    dstate 64 it is slower (forming C B^T costs half as much there, and reading it back does not
    pay); at dstate 256 the backward alone is about the same either way, so it stays off; smaller
    dstates are untimed and kept off, as at 64. The buffer, (b, chunks, g, CHUNK, CHUNK)
    float32, lives while the token kernel runs and raises the backward's peak by its size
    (``ops.backward.memory_accounting`` counts it)."""
    return tile_size(dstate) == 128


def fuse_states(dstate, tokens=None, pairs=False):
    """Whether the token kernel does ``bwd_chunk_states``' work too by default (FUSE_STATES).
    After the pair kernel (``pairs``), always: the token kernel then holds no dG and no
    quadratic dB/dC work, and fused it took less time at 1 x 64K x dstate 256, the one shape
    timed where the rule without it unfuses (``tests/benchmark/results/bwd_pairs_fuse_h200.csv``).
    Without it: yes,
    except where dstate's tile is 256 from 16K tokens (batch x seqlen; None: a long
    sequence). There the fused kernel spills (its register count: ``python -m ops.tools.sass``)
    and the backward alone takes less time unfused; at dstate 128 it takes more
    (``tests/benchmark/results/bwd_compute_out_variants_h200.csv``; PERF_NOTES.md, "The token
    kernel does three steps in one block"). Unfusing costs memory: dx in float32 until the end,
    and ``bwd_chunk_states``' dB partials (``ops.backward.memory_accounting`` counts both).
    Shorter sequences and dstate 512 are untimed unfused, so they stay fused."""
    if pairs:
        return True
    long = tokens is None or tokens >= 16384
    return not (tile_size(dstate) == 256 and long)


def dx_config(dstate, heads_per_group):
    """``bwd_token_dx_kernel``'s keys with SPLIT_DX (DX_OCCUPANCY, DX_WORKER_WARPS,
    DX_HEADS_PER_BLOCK, DX_LOADS_FIRST), by dstate's tile:
        up to 128   two heads of a group per block at two blocks per multiprocessor (one head
                    at four blocks where a group's heads are odd in number), at the compiler's
                    warp count, the loads that do not wait for the loop issued before it
                    (``dx_head_tile_loads_first``). A training step's scan took 4-5% less time
                    than with one head per block at four blocks in the loop's order (the rule
                    before) at the 2.7B, 8B and 130M training shapes and 16K x dstate 128; the
                    two heads alone or the loads first alone saved less
                    (``tests/benchmark/results/bwd_dx_slices_h200.csv``). The eager small shapes
                    (the 4K prefill, 4K x dstate 64) moved more between rounds than that.
        256 and up  one head per block, two blocks of eight worker warps, the loads in the loop's
                    order: at 64K x dstate 256 the rule above took 13% more time, and one head at
                    four blocks 9-10% more (same file).
    Dstate 512 is untimed and goes with 256. The kernel holds no dstate-wide accumulator, so
    its registers grow with dstate only through B's tile and dS (``python -m ops.tools.sass``)."""
    if tile_size(dstate) >= 256:
        return dict(DX_OCCUPANCY=2, DX_WORKER_WARPS=8, DX_HEADS_PER_BLOCK=1, DX_LOADS_FIRST=False)
    two = heads_per_group % 2 == 0
    return dict(DX_OCCUPANCY=2 if two else 4, DX_WORKER_WARPS=None,
                DX_HEADS_PER_BLOCK=2 if two else 1, DX_LOADS_FIRST=True)


def states_slices(dstate):
    """STATES_SLICES, ``bwd_token_states_kernel``'s blocks per token tile and head block: dstate
    cut into slices of 128 columns (one up to 128). Its block holds (BLOCK_T, columns) dB and dC
    accumulators and per head a (headdim, columns) entry state and dS, so at dstate 256 whole
    only one block of eight warps fits on a multiprocessor, waiting on its loads. Two slices took
    a 64K x dstate 256 training step's scan from 17.6 to 12.2 ms, four 13% more than two; at
    dstate 128 two slices of 64 took 9-12% more time at the 2.7B, 8B and 130M training shapes
    and 16K tokens (``tests/benchmark/results/bwd_dx_slices_h200.csv``; the sliced launch's
    counters in ``ncu_fwd_bwd_h200.txt``). The slices share only inputs that span no dstate
    column (dy, x, the pair kernel's d(C B^T) tiles, dA, dt), read once per slice; ddt's and ddA's
    terms through the states become one partial per slice, added in order by the dx launch."""
    return max(1, tile_size(dstate) // 128)


def default_config(*, chunk_size, headdim, dstate, nheads=1, ngroups=1, batch=1, seqlen=None,
                   **_):
    """``default_block_t``'s tiles, ``default_heads_per_block`` (seqlen None: a long sequence,
    all heads of a group per block), the dentry kernel's tiles of the whole (padded) headdim and
    up to 128 dstate columns, eight worker warps for the token kernel (``WORKER_WARPS``), and
    FUSE_STATES (``fuse_states``): ``ops/backward.py`` lets the token kernel do
    ``bwd_chunk_states``' work too (False: it launches that kernel after this one), except at
    dstate 256 from 16K tokens without the pair kernel.
    PAIRS (``PAIRS_DEFAULT``): the pair kernel first, with PAIR_HEADS_PER_BLOCK heads per block
    (``default_heads_per_block`` at ``PAIR_BLOCKS_PER_SM``), at two blocks per multiprocessor
    (``PAIR_OCCUPANCY``) and the compiler's warp count (PAIR_WORKER_WARPS None); it forms C B^T
    itself, so SCORES_IN_MEMORY then has no effect.
    SPLIT_DX (``SPLIT_DX_DEFAULT``, module docstring "Split dx"): after the pair kernel, the
    token work in two launches. The dx launch as ``dx_config`` says (heads per block, hints, the
    order of its loads). The states launch takes the token kernel's tiles, heads per block and
    hints (occupancy, num_worker_warps): one block of eight worker warps (two blocks of four
    took 10-25% more time at the 2.7B and 8B shapes, 16K x dstate 128 and 64K x dstate 256:
    ``bwd_split_dx_h200.csv``), one per ``states_slices`` slice of dstate.
    LOAD_LAT 0: no latency hint on the tile loads (3, 6 and 10 took longer at the 2.7B shape).
    SCORES_IN_MEMORY where dstate's tile is 128 (``scores_in_memory``), else off: the token
    kernel forms each head's C B^T tiles itself."""
    bt = default_block_t(chunk_size, headdim, dstate)
    if seqlen is None:
        hb = nheads // ngroups
    else:
        tiles = cdiv(seqlen, chunk_size) * (chunk_size // bt)
        hb = default_heads_per_block(nheads=nheads, ngroups=ngroups,
                                     blocks_per_head_block=batch * tiles)
    if seqlen is None:
        phb = nheads // ngroups
    else:
        pairs = cdiv(seqlen, chunk_size) * pairs_per_chunk(chunk_size // bt)
        phb = default_heads_per_block(nheads=nheads, ngroups=ngroups,
                                      blocks_per_head_block=batch * pairs,
                                      blocks_per_sm=PAIR_BLOCKS_PER_SM)
    return dict(BLOCK_T=bt, HEADS_PER_BLOCK=hb, ENTRY_BLOCK_P=min(tile_size(headdim), 128),
                ENTRY_BLOCK_N=min(tile_size(dstate), 128), INDEX64=False, occupancy=None,
                num_worker_warps=WORKER_WARPS,
                FUSE_STATES=fuse_states(dstate, None if seqlen is None else batch * seqlen,
                                        PAIRS_DEFAULT),
                SCORES_IN_MEMORY=scores_in_memory(dstate), PAIRS=PAIRS_DEFAULT,
                PAIR_HEADS_PER_BLOCK=phb, PAIR_OCCUPANCY=PAIR_OCCUPANCY, PAIR_WORKER_WARPS=None,
                LOAD_LAT=0, SPLIT_DX=SPLIT_DX_DEFAULT and PAIRS_DEFAULT,
                **dx_config(dstate, nheads // ngroups), STATES_SLICES=states_slices(dstate))


FLAGS = ("PAIRS", "SPLIT_DX", "FUSE_STATES", "SCORES_IN_MEMORY", "INDEX64", "DX_LOADS_FIRST")


def launch_hints(cfg, prefix):
    """The compiler hints of one launch from its config keys ``{prefix}OCCUPANCY`` (None or
    1..32 blocks per multiprocessor) and ``{prefix}WORKER_WARPS`` (None, 4 or 8), checked, as
    ``with_hints`` takes them."""
    occ, warps = cfg[prefix + "OCCUPANCY"], cfg[prefix + "WORKER_WARPS"]
    if occ is not None and (isinstance(occ, bool) or not isinstance(occ, int)
                            or not 1 <= occ <= 32):
        raise ValueError(f"{prefix}OCCUPANCY must be None or an int in 1..32, got {occ!r}")
    if warps is not None and (isinstance(warps, bool) or warps not in (4, 8)):
        raise ValueError(f"{prefix}WORKER_WARPS must be None, 4 or 8, got {warps!r}")
    return dict(occupancy=occ, num_worker_warps=warps)


def resolved_config(config, **shape):
    """``config`` (a dict of some of ``default_config``'s keys, or None) over the default for
    ``shape``, checked; FUSE_STATES and SPLIT_DX, where ``config`` does not set them, follow the
    config's PAIRS (``fuse_states``; SPLIT_DX needs the pair kernel): a config that turns the
    pair kernel off gets the token kernel alone at its own best FUSE_STATES.
    ``bwd_compute_out_plan``, ``ops.backward.kernel_backward`` and its ``memory_accounting`` all
    take a config through here."""
    cfg = resolve_config(config, default_config(**shape))
    for key in FLAGS:
        if not isinstance(cfg[key], bool):
            raise TypeError(f"{key} must be True or False, got {cfg[key]!r}")
    for key in ("PAIR_HEADS_PER_BLOCK", "DX_HEADS_PER_BLOCK"):
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int):
            raise TypeError(f"{key} must be an int, got {cfg[key]!r}")
    if cfg["DX_HEADS_PER_BLOCK"] not in group_divisors(shape.get("nheads", 1),
                                                        shape.get("ngroups", 1)):
        raise ValueError(f"DX_HEADS_PER_BLOCK ({cfg['DX_HEADS_PER_BLOCK']}) must divide the "
                         f"{shape.get('nheads', 1) // shape.get('ngroups', 1)} heads of a group")
    if "FUSE_STATES" not in (config or {}):
        seqlen = shape.get("seqlen")
        tokens = None if seqlen is None else shape.get("batch", 1) * seqlen
        cfg["FUSE_STATES"] = fuse_states(shape["dstate"], tokens, cfg["PAIRS"])
    if "SPLIT_DX" not in (config or {}):
        cfg["SPLIT_DX"] = SPLIT_DX_DEFAULT and cfg["PAIRS"]
    elif cfg["SPLIT_DX"] and not cfg["PAIRS"]:
        raise ValueError("SPLIT_DX needs the pair kernel (PAIRS=True)")
    slices, n = cfg["STATES_SLICES"], tile_size(shape["dstate"])
    if isinstance(slices, bool) or not isinstance(slices, int):
        raise TypeError(f"STATES_SLICES must be an int, got {slices!r}")
    if slices < 1 or slices & (slices - 1) or n // slices < 16:
        raise ValueError(f"STATES_SLICES must be a power of two leaving at least 16 columns of "
                         f"dstate's tile of {n} to a slice, got {slices}")
    for prefix in ("PAIR_", "DX_"):
        launch_hints(cfg, prefix)
    return cfg


def launch_slices(cfg):
    """The dstate slices a resolved config's states launch runs (STATES_SLICES with SPLIT_DX;
    without it there is no states launch, and one)."""
    return cfg["STATES_SLICES"] if cfg["SPLIT_DX"] else 1


def pairs_per_chunk(tiles):
    """The (row tile, column tile) pairs of a chunk's causal quadratic form: row >= column."""
    return tiles * (tiles + 1) // 2


def search_space(*, chunk_size, headdim, dstate, nheads=1, ngroups=1, **shape):
    """Variants worth timing (the default first, at most 16): the other token tile (32 or 64),
    one head per block (per-head partials of dB and dC: more, smaller blocks), half and all of a
    group's heads, the compiler's worker warps at two blocks per multiprocessor (at its own
    occupancy it took over 1.2x the default's time at the three model training shapes:
    ``tests/benchmark/results/bwd_pairs_h200.csv``), smaller dentry
    tiles, the chunk states' gradients the other way than the default (in a kernel of their
    own, or fused), the token kernel alone (no pair kernel) with C B^T read from memory or
    formed per head (alone and with one head per block) and at the default's, the pair kernel
    with the token work fused (SPLIT_DX the other way), the dx launch as ``dx_config`` sets it
    for the other side of dstate 128, the states launch over the other number of dstate slices
    (one, or two where the default has one), and the pair kernel's heads per block halved and
    doubled."""
    base = default_config(chunk_size=chunk_size, headdim=headdim, dstate=dstate, nheads=nheads,
                          ngroups=ngroups, **shape)
    configs = [base]
    for bt in (64, 32):
        if bt <= chunk_size and bt != base["BLOCK_T"]:
            configs.append({**base, "BLOCK_T": bt})
    per_group = nheads // ngroups
    for hb in sorted({1, max(1, per_group // 2), per_group} - {base["HEADS_PER_BLOCK"]}):
        configs.append({**base, "HEADS_PER_BLOCK": hb})
    configs.append({**base, "num_worker_warps": None, "occupancy": 2})
    configs.append({**base, "ENTRY_BLOCK_P": min(base["ENTRY_BLOCK_P"], 32),
                    "ENTRY_BLOCK_N": min(base["ENTRY_BLOCK_N"], 64)})
    configs.append({**base, "FUSE_STATES": not base["FUSE_STATES"]})
    # the token kernel alone, C B^T either way (from memory, once per group:
    # ops/kernels/common.py; or formed per head), the other way alone and with one head per block
    alone = resolved_config(dict(PAIRS=False), chunk_size=chunk_size, headdim=headdim,
                            dstate=dstate, nheads=nheads, ngroups=ngroups, **shape)
    other = not base["SCORES_IN_MEMORY"]
    configs += [alone, {**alone, "SCORES_IN_MEMORY": other},
                {**alone, "SCORES_IN_MEMORY": other, "HEADS_PER_BLOCK": 1}]
    # with the pair kernel: the token work fused, or split with the dx launch or the states
    # launch the other way; the pair kernel's heads per block halved and doubled
    pairs = {**base, "PAIRS": True}
    configs.append({**pairs, "SPLIT_DX": not base["SPLIT_DX"]})
    split = {**pairs, "SPLIT_DX": True}
    configs.append({**split, **dx_config(128 if tile_size(dstate) >= 256 else 256, per_group)})
    slices = 1 if base["STATES_SLICES"] > 1 else 2
    if tile_size(dstate) // slices >= 16:
        configs.append({**split, "STATES_SLICES": slices})
    phb = base["PAIR_HEADS_PER_BLOCK"]
    for other_phb in (phb // 2, phb * 2):
        if other_phb in group_divisors(nheads, ngroups):
            configs.append({**pairs, "PAIR_HEADS_PER_BLOCK": other_phb})
    return unique(configs)


def _check_inputs(dy, x, B, C, dt_out, dA_cumsum, entry_states, seq_idx):
    tensors = dict(dy=dy, x=x, B=B, C=C, dt_out=dt_out, dA_cumsum=dA_cumsum,
                   entry_states=entry_states)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) and not (name == "entry_states" and t is None):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, seqlen, nheads, headdim), got shape {tuple(x.shape)}")
    batch, seqlen, nheads, headdim = x.shape
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    for name in ("dy", "B", "C"):
        if tensors[name].dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {tensors[name].dtype}")
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    if B.dim() != 4 or B.shape[:2] != (batch, seqlen):
        raise ValueError(f"B must be (batch, seqlen, ngroups, dstate) = ({batch}, {seqlen}, ., .), "
                         f"got shape {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    ngroups, dstate = B.shape[2], B.shape[3]
    check_sizes(headdim, dstate)
    check_groups(nheads, ngroups)
    if dt_out.dim() != 4 or dt_out.shape[:2] != (batch, nheads):
        raise ValueError(f"dt_out must be (batch, nheads, nchunks, chunk_size) with batch {batch} "
                         f"and nheads {nheads}, got shape {tuple(dt_out.shape)}")
    nchunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    if chunk_size < 16 or chunk_size & (chunk_size - 1) or cdiv(seqlen, chunk_size) != nchunks:
        raise ValueError(f"dt_out's chunks ({nchunks} of {chunk_size}) must be a power of two "
                         f">= 16 covering seqlen {seqlen} exactly")
    for name in ("dt_out", "dA_cumsum"):
        if tensors[name].dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {tensors[name].dtype}")
    if dA_cumsum.shape != dt_out.shape:
        raise ValueError(f"dA_cumsum must have dt_out's shape {tuple(dt_out.shape)}, "
                         f"got {tuple(dA_cumsum.shape)}")
    # (None: the dx launch alone, which reads no entry state)
    if entry_states is not None and entry_states.shape != (batch, nchunks, nheads, headdim,
                                                           dstate):
        raise ValueError(f"entry_states must be (batch, nchunks, nheads, headdim, dstate) = "
                         f"{(batch, nchunks, nheads, headdim, dstate)}, got "
                         f"{tuple(entry_states.shape)}")
    if entry_states is not None and entry_states.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"entry_states must be float32 or x's dtype {x.dtype}, got "
                        f"{entry_states.dtype}")
    if seq_idx is not None:
        if not isinstance(seq_idx, torch.Tensor) or seq_idx.is_floating_point():
            raise TypeError("seq_idx must be an integer torch.Tensor")
        if seq_idx.shape != (batch, seqlen):
            raise ValueError(f"seq_idx must be (batch, seqlen) = ({batch}, {seqlen}), got "
                             f"{tuple(seq_idx.shape)}")
    for name, t in {**tensors, "seq_idx": seq_idx}.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def bwd_compute_out_plan(dy, x, B, C, dt_out, dA_cumsum, entry_states, seq_idx=None,
                         poison=False, config=None, launches="both", dS=None, D=None,
                         dx_dtype=torch.float32, states=None):
    """The launch (an ``ops.runtime.launch.Plan``). With ``launches="both"`` (the default) its
    ``before`` holds the dentry kernel's launch, then with PAIRS the pair kernel's (and with
    SPLIT_DX the states kernel's: the plan's own launch is then ``bwd_token_dx_kernel``), else
    with SCORES_IN_MEMORY the chunk_scores launch; its outputs are dx, the head-split partials
    of dB and dC (splits, b, L, g, n), ddt_out, ddA_cumsum, ddA_tiles, dD's partials and
    dentry. The other values of ``launches`` give parts of it (below). ``config``: a dict from
    ``search_space`` (or part of one; missing keys take ``default_config``'s values for this
    shape, FUSE_STATES following PAIRS: ``resolved_config``).

    ``launches="entry"`` gives the dentry kernel's plan alone (outputs (dentry,)), ``"tokens"``
    the token kernel's alone (outputs all but dentry, none allocated for it): ``ops/backward.py``
    runs the pass over the states between the two, so that dentry is freed before the token
    kernel's dx is allocated. With SPLIT_DX the token work's two launches can run as two plans
    too: ``"states"`` gives the pair kernel's and the states launch's (outputs dB's and dC's
    partials, ddA_tiles, then what the dx launch reads: the states' ddt and ddA terms, C B^T,
    dG's column and row sums), ``"dx"`` the dx launch's alone (outputs dx, ddt_out, ddA_cumsum,
    dD's partials), given those five as ``states``; ``entry_states`` may then be None (the dx
    launch reads none). ``ops/backward.py`` runs them so: the entry states, d(C B^T)'s partials
    and dB's and dC's are gone before dx is allocated.

    The token kernel's optional terms (``ops/backward.py`` passes them):
        dS (b, c, h, p, n), float32 or x's dtype: the chunk states' gradients. The token kernel
            then adds the gradients through each chunk's own state (``ops/kernels/backward/bwd_chunk_states.py``'s
            work): dx, dB, ddt_out and ddA_cumsum complete but for ddA_cumsum at each chunk's
            last token, whose term sum(dv v) per token tile is ddA_tiles (b, h, c, CHUNK /
            BLOCK_T * slices): with SPLIT_DX one partial per token tile t and dstate slice k of
            the states launch, at t * STATES_SLICES + k (one slice otherwise); its sum over the
            last axis is the term. Without dS, ddA_tiles is None.
        D (h,) or (h, p): the skip out = y + D x. dx then includes D dy, and dD's partials are
            (b, token tiles, h, p) float32 for a 2-d D, (b, token tiles, h, 1) for a 1-d D (summed
            over p in the kernel), each tile's sum of dy x: sum them over the first two axes (and
            the last, for a 1-d D). Without D, None.
        dx_dtype: dx's dtype (x's for the operator: complete dx rounded once from float32)."""
    if launches not in ("both", "entry", "tokens", "states", "dx"):
        raise ValueError(f"launches must be 'both', 'entry', 'tokens', 'states' or 'dx', got "
                         f"{launches!r}")
    if (launches == "dx") != (states is not None):
        raise ValueError("states (the states launch's outputs) goes with launches='dx', and "
                         "only with it")
    if states is not None and (not isinstance(states, (tuple, list)) or len(states) != 5):
        raise ValueError("states must be the five tensors after dB's and dC's partials and "
                         "ddA_tiles in the outputs of launches='states'")
    if entry_states is None and launches != "dx":
        raise TypeError("entry_states must be a torch.Tensor, got NoneType")
    _check_inputs(dy, x, B, C, dt_out, dA_cumsum, entry_states, seq_idx)
    _check_optional(x, B, dt_out, dS, D, dx_dtype)
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    nchunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    cfg = resolved_config(config, chunk_size=chunk_size, headdim=headdim, dstate=dstate,
                          nheads=nheads, ngroups=ngroups, batch=batch, seqlen=seqlen)
    bt, hb = token_tiling(cfg, chunk_size, nheads, ngroups)
    if launches in ("states", "dx") and not cfg["SPLIT_DX"]:
        raise ValueError(f"launches={launches!r} needs SPLIT_DX (the token work in two launches)")
    bp, bn = cfg["ENTRY_BLOCK_P"], cfg["ENTRY_BLOCK_N"]
    for name, v, size in (("ENTRY_BLOCK_P", bp, headdim), ("ENTRY_BLOCK_N", bn, dstate)):
        if v < 16 or v & (v - 1) or v > tile_size(size):
            raise ValueError(f"{name} ({v}) must be a power of two in [16, {tile_size(size)}]")
    splits = (nheads // ngroups) // hb
    device = x.device
    seq_idx = as_int32(seq_idx)
    seq_arg = seq_idx if seq_idx is not None else dt_out     # never read without seq_idx
    bf16 = x.dtype == torch.bfloat16
    entry_plan = None
    if launches in ("both", "entry"):
        dentry = new_output(entry_states.shape, torch.float32, device, poison)
        entry_args = (dy, C, dA_cumsum, seq_arg, dentry, nheads // ngroups, chunk_size, bt, bp,
                      bn, seq_idx is not None, bf16)
        entry_plan = Plan((nchunks * nheads * cdiv(headdim, bp) * cdiv(dstate, bn), batch),
                          fit_index_width(bwd_entry_kernel, entry_args, cfg["INDEX64"]),
                          entry_args, (dentry,))
        if launches == "entry":
            return entry_plan
    tiles = nchunks * (chunk_size // bt)
    slices = launch_slices(cfg)
    stand_in = lambda t, ndim: t if t is not None else unread_stand_in(device, ndim)
    ds_arg = stand_in(dS, 5)                    # one stand-in for both split launches
    dx = ddt = ddA = dD_parts = None
    if launches != "states":            # the dx launch's outputs (the fused token kernel's too)
        dx = new_output(x.shape, dx_dtype, device, poison)
        ddt = new_output(dt_out.shape, torch.float32, device, poison)
        ddA = new_output(dt_out.shape, torch.float32, device, poison)
        if D is not None:
            # (a 1-d D's partials are summed over headdim in the kernel: store_skip_partial)
            dD_parts = new_output((batch, tiles, nheads, headdim if D.dim() == 2 else 1),
                                  torch.float32, device, poison)
            # read as given, (h,) or (h, p) (skip_terms); other dtypes than the kernels' as float32
            D = (D if D.dtype in (torch.float32, torch.bfloat16, torch.float16)
                 else D.float()).contiguous()
    dx_launch = lambda state_ddt, state_ddA, scores, cols, rows: _dx_launch(
        cfg, (dy, x, B, dt_out, dA_cumsum, seq_arg, dx, ddt, ddA, state_ddt, state_ddA, ds_arg,
              stand_in(D, 2), stand_in(dD_parts, 4), scores, cols, rows),
        nheads // ngroups, chunk_size, bt, headdim, dstate, seq_idx is not None, bf16,
        dS is not None, D is not None, slices, tiles * nheads)
    if launches == "dx":
        # the states launch has run (launches="states"): its outputs the dx launch reads
        terms = (slices, *dt_out.shape)
        sums = (batch, nheads, nchunks, chunk_size // bt, chunk_size)
        want = (("the states' ddt terms", terms), ("the states' ddA terms", terms),
                ("C B^T", (batch, nchunks, ngroups, chunk_size, chunk_size)),
                ("dG's column sums", sums), ("dG's row sums", sums))
        for i, (t, (what, shape)) in enumerate(zip(states, want)):
            if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape
                    or t.dtype != torch.float32 or t.device != x.device):
                raise ValueError(f"states[{i}] must be {what}: a float32 {shape} tensor on "
                                 f"{x.device}, as launches='states' made it with this config, "
                                 f"got {getattr(t, 'shape', type(t).__name__)}")
        grid, kernel, args = dx_launch(*states)
        return Plan((grid, batch), kernel, args, (dx, ddt, ddA, dD_parts))
    dB_parts = new_output((splits, batch, seqlen, ngroups, dstate), torch.float32, device, poison)
    dC_parts = new_output((splits, batch, seqlen, ngroups, dstate), torch.float32, device, poison)
    ddA_tiles = None
    if dS is not None:          # sum(dv v) per token tile (and dstate slice of the states launch)
        ddA_tiles = new_output((batch, nheads, nchunks, chunk_size // bt * slices), torch.float32,
                               device, poison)
    scores, before = None, ()
    pair_outputs = (None, None, None)
    if cfg["PAIRS"]:
        # the pair kernel: C B^T (read by the token kernel), d(C B^T) summed over heads, dG's sums
        phb = cfg["PAIR_HEADS_PER_BLOCK"]
        if phb not in group_divisors(nheads, ngroups):
            raise ValueError(f"PAIR_HEADS_PER_BLOCK ({phb}) must divide the "
                             f"{nheads // ngroups} heads of a group")
        psplits = (nheads // ngroups) // phb
        scores = new_scores(B, chunk_size, poison)
        # (five axes: split s of batch row b at s * batch + b; see dcb_tile)
        dcb_parts = new_output((psplits * batch, nchunks, ngroups, chunk_size, chunk_size),
                               torch.float32, device, poison)
        sums = (batch, nheads, nchunks, chunk_size // bt, chunk_size)
        cols = new_output(sums, torch.float32, device, poison)
        rows = new_output(sums, torch.float32, device, poison)
        pair_args = (dy, x, B, C, dt_out, dA_cumsum, seq_arg, scores, dcb_parts, cols, rows,
                     nheads // ngroups, phb, chunk_size, bt, tile_size(headdim),
                     tile_size(dstate), seq_idx is not None, cfg["LOAD_LAT"])
        pair_grid = (nchunks * (chunk_size // bt) ** 2 * ngroups * psplits, batch)
        pair_kernel = with_hints(fit_index_width(bwd_pairs_kernel, pair_args, cfg["INDEX64"]),
                                 launch_hints(cfg, "PAIR_"))
        before = (Plan(pair_grid, pair_kernel, pair_args, (scores, dcb_parts, cols, rows)),)
        pair_outputs = (dcb_parts, cols, rows)
    elif cfg["SCORES_IN_MEMORY"]:
        # C B^T once per (chunk, group), in the token kernel's tiles
        scores = new_scores(B, chunk_size, poison)
        before = (chunk_scores_plan(B, C, scores, bt, bt, min(tile_size(dstate), 128)),)
    grid = (tiles * ngroups * splits, batch)
    if cfg["SPLIT_DX"]:
        # two launches after the pair kernel: the states' products and dB, dC over each block's
        # heads (a block per dstate slice); then dx, ddt and ddA with DX_HEADS_PER_BLOCK heads
        state_ddt = new_output((slices, *dt_out.shape), torch.float32, device, poison)
        state_ddA = new_output((slices, *dt_out.shape), torch.float32, device, poison)
        dcb_parts, cols, rows = pair_outputs
        states_args = (dy, x, B, C, dt_out, dA_cumsum, entry_states, seq_arg, dB_parts, dC_parts,
                       state_ddt, state_ddA, ds_arg, stand_in(ddA_tiles, 4), dcb_parts,
                       nheads // ngroups, hb, chunk_size, bt, tile_size(headdim),
                       tile_size(dstate) // slices, seq_idx is not None, bf16, dS is not None,
                       cfg["LOAD_LAT"], slices)
        states_kernel = with_hints(fit_index_width(bwd_token_states_kernel, states_args,
                                                   cfg["INDEX64"]), cfg)
        carried = (state_ddt, state_ddA, scores, cols, rows)
        states_plan = Plan((grid[0] * slices, batch), states_kernel, states_args,
                           (dB_parts, dC_parts, ddA_tiles, *carried))
        if launches == "states":
            return states_plan._replace(before=before)
        before = before + (states_plan,)
        dx_grid, kernel, args = dx_launch(*carried)
        grid = (dx_grid, batch)
    else:
        args = (dy, x, B, C, dt_out, dA_cumsum, entry_states, seq_arg, dx, dB_parts, dC_parts,
                ddt, ddA, ds_arg, stand_in(ddA_tiles, 4), stand_in(D, 2),
                stand_in(dD_parts, 4),
                entry_states if scores is None else scores,      # (never read without scores)
                *(stand_in(t, 5) for t in pair_outputs),
                nheads // ngroups, hb, chunk_size, bt, tile_size(headdim),
                tile_size(dstate), seq_idx is not None, bf16, dS is not None, D is not None,
                scores is not None, cfg["PAIRS"], cfg["LOAD_LAT"])
        kernel = with_hints(fit_index_width(bwd_compute_out_kernel, args, cfg["INDEX64"]), cfg)
    outputs = (dx, dB_parts, dC_parts, ddt, ddA, ddA_tiles, dD_parts)
    if launches == "tokens":
        return Plan(grid, kernel, args, outputs, before)
    return Plan(grid, kernel, args, outputs + (dentry,), (entry_plan,) + before)


def _dx_launch(cfg, tensors, heads_per_group, chunk_size, bt, headdim, dstate, has_seq, bf16,
               has_ds, has_d, slices, heads_tiles):
    """(the number of blocks, the kernel, its arguments) of SPLIT_DX's dx launch on
    ``tensors`` (``bwd_token_dx_kernel``'s tensor arguments, in order): one block per token tile
    and DX_HEADS_PER_BLOCK heads of a group (``heads_tiles``: token tiles x heads)."""
    args = (*tensors, heads_per_group, chunk_size, bt, tile_size(headdim), tile_size(dstate),
            has_seq, bf16, has_ds, has_d, cfg["LOAD_LAT"], cfg["DX_HEADS_PER_BLOCK"],
            cfg["DX_LOADS_FIRST"], slices)
    kernel = with_hints(fit_index_width(bwd_token_dx_kernel, args, cfg["INDEX64"]),
                        launch_hints(cfg, "DX_"))
    return heads_tiles // cfg["DX_HEADS_PER_BLOCK"], kernel, args


def _check_optional(x, B, dt_out, dS, D, dx_dtype):
    batch, _, nheads, headdim = x.shape
    if dS is not None:
        want = (batch, dt_out.shape[2], nheads, headdim, B.shape[3])
        if not isinstance(dS, torch.Tensor) or tuple(dS.shape) != want:
            raise ValueError(f"dS must be a (batch, nchunks, nheads, headdim, dstate) = {want} "
                             f"tensor, got {getattr(dS, 'shape', type(dS).__name__)}")
        ok = (torch.float32, x.dtype) if x.dtype == torch.bfloat16 else (torch.float32,)
        if dS.dtype not in ok or not dS.is_contiguous():
            raise TypeError(f"dS must be contiguous, one of {ok} for {x.dtype} inputs, got "
                            f"{dS.dtype}")
    if D is not None and (not isinstance(D, torch.Tensor)
                          or tuple(D.shape) not in ((nheads,), (nheads, headdim))):
        raise ValueError(f"D must be a ({nheads},) or ({nheads}, {headdim}) tensor, got "
                         f"{getattr(D, 'shape', type(D).__name__)}")
    if dx_dtype not in (torch.float32, x.dtype):
        raise TypeError(f"dx_dtype must be float32 or x's dtype {x.dtype}, got {dx_dtype}")


def bwd_compute_out(dy, x, B, C, dt_out, dA_cumsum, entry_states, seq_idx=None, poison=False,
                    config=None):
    """-> (dx (b, L, h, p), dB and dC (b, L, g, n), summed over each group's heads, ddt_out and
    ddA_cumsum (b, h, c, l), the latter in natural-log units, dentry (b, c, h, p, n)), all
    float32, like ``reference.backward.compute_out_backward`` (whose dB and dC are per head: sum
    them with ``reference.backward._sum_groups``). ``dA_cumsum`` in the kernels' log2 units;
    ``poison=True`` NaN-fills the outputs first (for tests)."""
    dx, dB_parts, dC_parts, ddt, ddA, _, _, dentry = run(bwd_compute_out_plan(
        dy, x, B, C, dt_out, dA_cumsum, entry_states, seq_idx, poison, config))
    # The head splits' partials, added in a fixed order (one split: the kernel's own sums).
    dB, dC = sum_splits(dB_parts), sum_splits(dC_parts)
    return dx, dB, dC, ddt, ddA, dentry
