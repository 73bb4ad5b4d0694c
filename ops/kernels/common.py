"""What the kernel modules share: tile-code constants and helpers, size checks, output buffers,
the tile functions more than one kernel calls, and the chunk scores kernel that both compute_outs
may launch first.

Each kernel module (``chunk_cumsum``, ``fwd_pass_state``, ``compute_out`` and the backward ones
under ``backward/``) imports from here, from ``ops.tuning.configs`` and from ``ops.runtime``,
never from another kernel module. The size checks and integer helpers live in
``ops.checks`` (no cuda.tile needed, so the public entry point's input checks run without it)
and are re-exported here.
"""
import math

import torch

import cuda.tile as ct

from ops.checks import (cdiv, check_chunk_size, check_groups, check_sizes,  # noqa: F401
                        is_pow2_in, next_pow2, tile_size)
from ops.runtime.launch import Plan, fit_index_width, unread_stand_in  # noqa: F401

# Annotations of compile-time constant kernel parameters: each value compiles its own variant.
ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO       # padding of partial tiles that the kernels rely on
NEG_INF = -math.inf
LOG2E = 1.4426950408889634       # exp(v) == exp2(v * LOG2E): decays are kept in log2 units

# An H200's (and H100 SXM's) multiprocessor count: the grid a CPU or meta launch is planned for.
H200_MULTIPROCESSORS = 132


def latency_hint(value):
    """The ``latency=`` argument of a load or store for a LOAD_LAT / STORE_LAT constant.

    0 means no hint (the compiler infers the latency); 1 (low) .. 10 (high) tells it how heavy
    the DRAM traffic behind that access is expected to be, which it weighs when it schedules and
    pipelines the access. Called inside tile code with a constant, so it is evaluated while
    compiling: the compiled kernel contains the hint or nothing."""
    return None if value == 0 else value


# Host-side helpers ------------------------------------------------------------------------------

def element_size(dtype):
    """Bytes per element of a torch dtype."""
    return torch.empty((), dtype=dtype).element_size()


def multiprocessors(device=None):
    """The multiprocessor count of ``device`` (a CUDA device; None: the current one if there is a
    GPU). CPU and meta tensors, and machines without a GPU, get an H200's 132, so the interpreter
    and the ahead-of-time compiler see the grid an H200 would."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_MULTIPROCESSORS


def sum_splits(parts):
    """The sum over the leading axis of a kernel's partials, one per split of the work (a
    group's heads split over blocks: no atomics), in a fixed order; with one split, that one
    (a view, no operator run)."""
    return parts[0] if parts.shape[0] == 1 else parts.sum(0)


def new_output(shape, dtype, device, poison=False):
    """An output buffer for a kernel to fill. ``poison=True`` fills it with NaN first, so an
    element the kernel fails to write shows up in tests; by default it is left uninitialised
    (filling costs a full write of the buffer)."""
    if poison:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def as_int32(seq_idx):
    """Sequence ids as the int32 the kernels compare (None stays None)."""
    if seq_idx is not None and seq_idx.dtype != torch.int32:
        return seq_idx.to(torch.int32)
    return seq_idx


def softplus(v):
    """softplus(v) = log(1 + exp(v)) of a float32 tile, inside a kernel (the identity above 20,
    as mamba_ssm's threshold).

    For very negative v, 1 + exp(v) rounds to 1 and the plain log would return 0 instead of
    ~exp(v); the correction u / ((1 + u) - 1) restores log1p's accuracy (Goldberg's trick).
    Above 20, softplus(v) == v in float32 and exp could overflow, so those values pass through."""
    u = ct.exp(ct.minimum(v, 20.0))
    w = 1.0 + u
    log1p_u = ct.where(w == 1.0, u, ct.log(w) * (u / (w - 1.0)))
    return ct.where(v <= 20.0, log1p_u, v)


# Tile code shared by the forward and backward kernels ----------------------------------------

def load_state(initial_states, b, h, pi, ni, BLOCK_P, BLOCK_N, SWAP, LOAD_LAT):
    """One head's initial state tile as float32: (BLOCK_P, BLOCK_N), or (BLOCK_N, BLOCK_P) when
    SWAP (order=(0, 1, 3, 2) views the (b, h, headdim, dstate) array as (b, h, dstate, headdim))."""
    if SWAP:
        t = ct.load(initial_states, (b, h, ni, pi), shape=(1, 1, BLOCK_N, BLOCK_P),
                    order=(0, 1, 3, 2), padding_mode=ZERO, latency=latency_hint(LOAD_LAT))
        return ct.reshape(t, (BLOCK_N, BLOCK_P)).astype(ct.float32)
    t = ct.load(initial_states, (b, h, pi, ni), shape=(1, 1, BLOCK_P, BLOCK_N),
                padding_mode=ZERO, latency=latency_hint(LOAD_LAT))
    return ct.reshape(t, (BLOCK_P, BLOCK_N)).astype(ct.float32)


def chunk_tokens(array, b, h, c, i, BLOCK_T):
    """Tile i (BLOCK_T tokens) of chunk c of head h of a (batch, nheads, nchunks, CHUNK) array."""
    return ct.reshape(ct.load(array, (b, h, c, i), shape=(1, 1, 1, BLOCK_T)), (BLOCK_T,))


def sequence_ids(seq_idx, b, tile, BLOCK_T, HAS_SEQ_IDX):
    """The sequence ids of token tile ``tile``: (BLOCK_T,) int32 (0 past seqlen); zeros, unread,
    without seq_idx."""
    if HAS_SEQ_IDX:
        ids = ct.reshape(ct.load(seq_idx, (b, tile), shape=(1, BLOCK_T), padding_mode=ZERO),
                         (BLOCK_T,))
    else:
        ids = ct.zeros((BLOCK_T,), dtype=ct.int32)
    return ids


def carried_weight(dA_rows, seq_idx, b, c, tile, CHUNK, BLOCK_T, HAS_SEQ_IDX):
    """w = exp2(dA) of the rows of token tile ``tile`` of chunk c, 0 for tokens of another
    sequence than the one running at the chunk's start (that of the previous chunk's last token,
    0 before token 0)."""
    w = ct.exp2(dA_rows)
    if HAS_SEQ_IDX:
        prev = ct.load(seq_idx, (b, max(c * CHUNK - 1, 0)), shape=())
        prev = ct.where(c == 0, 0, prev)
        w = ct.where(sequence_ids(seq_idx, b, tile, BLOCK_T, True) == prev, w, 0.0)
    return w


def entry_gradient(dy, C, dA_cumsum, seq_idx, b, c, h, g, pi, ni, CHUNK, BLOCK_T, BLOCK_P,
                   BLOCK_N, HAS_SEQ_IDX, BF16_OPERANDS, acc, LOAD_LAT=0):
    """Tile (pi, ni) of dentry[c] for head h (of group g): the sum over the chunk's tokens of
    w[l] outer(dy[l], C[l]), (BLOCK_P, BLOCK_N) float32, over BLOCK_T-token tiles in order (the
    tiles past seqlen skipped), added to ``acc`` (the products' accumulator: zeros for dentry
    alone). ``bwd_entry_kernel``'s work, and ``bwd_pass_state``'s with FUSE_ENTRY, whose walk
    may hand its carried gradient in as ``acc``. LOAD_LAT: the latency hint of the dy and C
    loads (0: none)."""
    TILES = CHUNK // BLOCK_T
    valid = min(TILES, ct.cdiv(dy.shape[1] - c * CHUNK, BLOCK_T))
    op = dy.dtype if BF16_OPERANDS else ct.float32
    for t in range(valid):
        tile = c * TILES + t
        dA_t = chunk_tokens(dA_cumsum, b, h, c, t, BLOCK_T)
        w_t = carried_weight(dA_t, seq_idx, b, c, tile, CHUNK, BLOCK_T, HAS_SEQ_IDX)
        dy_t = ct.reshape(ct.load(dy, (b, tile, h, pi), shape=(1, BLOCK_T, 1, BLOCK_P),
                                  padding_mode=ZERO, latency=latency_hint(LOAD_LAT)),
                          (BLOCK_T, BLOCK_P))
        c_t = ct.reshape(ct.load(C, (b, tile, g, ni), shape=(1, BLOCK_T, 1, BLOCK_N),
                                 padding_mode=ZERO, latency=latency_hint(LOAD_LAT)),
                         (BLOCK_T, BLOCK_N))
        w_dy = (dy_t.astype(ct.float32) * w_t[:, None]).astype(op)
        acc = ct.mma(ct.transpose(w_dy), c_t.astype(op), acc)
    return acc


def entry_read_dtype(x_dtype, stored_dtype):
    """The dtype the backward kernels read the entry states in: as stored when that is x's dtype
    or float32; other stored dtypes (fp16 states of bf16 inputs, 16-bit states of float32 ones)
    are widened, exactly, to float32 (``ops.backward`` widens them so)."""
    return stored_dtype if stored_dtype in (x_dtype, torch.float32) else torch.float32


def state_tiles(headdim, dstate, states_dtype, block_p=None, block_n=None):
    """Default tiles for an H200 (see ``fwd_pass_state``'s "Parallelism"): 64 headdim rows;
    128 dstate columns with 16-bit entry states, 64 with float32 ones (twice the bytes to store
    per chunk). A headdim or dstate that is not a power of two is tiled as ``tile_size``
    (zero-padded)."""
    bp = min(block_p or 64, tile_size(headdim))
    wide = states_dtype in (torch.bfloat16, torch.float16)
    bn = min(block_n or (128 if wide else 64), tile_size(dstate))
    return bp, bn


# The chunk scores kernel: compute_out's and bwd_compute_out's optional first launch -------------
#
# An optional first step of kernel (c): C B^T of every chunk, once per group, into memory.
#
# ``compute_out`` needs, for each chunk and each head, the chunk x chunk matrix of scores
# C[l] . B[s] (the "attention" part of the quadratic form). It does not depend on the head, only on
# the head's group, yet by default ``compute_out`` forms it in registers for every head it serves:
# 80 times per chunk for a layer of 80 heads in one group (40 times with two heads per block). At
# dstate 256 that product is most of ``compute_out``'s arithmetic, and it sits in the middle of each
# column tile's chain of dependent steps (load B -> C B^T -> exp2 -> weights @ x).
#
# With ``SCORES_IN_MEMORY`` (a compute_out config key), this kernel computes the scores once per
# (chunk, group) and stores them in float32; ``compute_out`` then loads a (BLOCK_M, BLOCK_K) tile of
# them where it would have computed it, which shortens the chain by one product and replaces the
# B tile load (BLOCK_K x dstate) by a smaller one (BLOCK_M x BLOCK_K). The price is one more
# launch and nchunks * ngroups * CHUNK^2 * 4 bytes written once and read by every head (from L2
# when, as here, the heads of one chunk run at the same time). Whether that pays is measured by
# the autotuner (what it found: PERF_NOTES.md, "A committed table of tuned configs"); mamba_ssm's
# Triton forward always takes this route (``_bmm_chunk_fwd``).
#
# The grid is (chunk tiles, ngroups, batch) with one block per (BLOCK_M, BLOCK_K) tile of a chunk's
# scores; every tile is written (including those above the diagonal, which compute_out masks), so
# the buffer holds no uninitialised values. Rows or columns past the end of the sequence read B and
# C as zeros; a tile whose rows or columns all lie past it is written as zeros without loading. The products accumulate in float32 from operands in the inputs' dtype, exactly as
# compute_out's own C B^T does, so the two routes agree to the order of float32 summation.

@ct.kernel
def chunk_scores_kernel(
    B: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate)
    C: ct.IndexedWithInt64,             # (batch, seqlen, ngroups, dstate)
    scores: ct.IndexedWithInt64,        # (batch, nchunks, ngroups, CHUNK, CHUNK) float32
    CHUNK: ConstInt,
    BLOCK_M: ConstInt,
    BLOCK_K: ConstInt,
    DSTATE: ConstInt,
    DSTATE_TILE: ConstInt,
    LOAD_LAT: ConstInt,
):
    tile_id = ct.bid(0)
    g = ct.bid(1)
    b = ct.bid(2)
    n_m, n_k = CHUNK // BLOCK_M, CHUNK // BLOCK_K
    j = tile_id % n_k                    # column tile (source tokens s) within the chunk
    m = (tile_id // n_k) % n_m           # row tile (output tokens l) within the chunk
    c = tile_id // (n_k * n_m)
    row_tile = c * n_m + m               # the same tiles in units of the whole sequence
    col_tile = c * n_k + j
    lat = latency_hint(LOAD_LAT)
    acc = ct.zeros((BLOCK_M, BLOCK_K), dtype=ct.float32)
    seqlen = B.shape[1]
    # A tile of rows or columns wholly past the sequence (the last chunk's) is zeros: its loads
    # would lie entirely outside the arrays (undefined behaviour), so they are not made.
    if row_tile * BLOCK_M < seqlen and col_tile * BLOCK_K < seqlen:
        for k in range(DSTATE // DSTATE_TILE):
            c_k = ct.reshape(ct.load(C, (b, row_tile, g, k), shape=(1, BLOCK_M, 1, DSTATE_TILE),
                                     padding_mode=ZERO, latency=lat), (BLOCK_M, DSTATE_TILE))
            b_k = ct.reshape(ct.load(B, (b, col_tile, g, k), shape=(1, BLOCK_K, 1, DSTATE_TILE),
                                     padding_mode=ZERO, latency=lat), (BLOCK_K, DSTATE_TILE))
            acc = ct.mma(c_k, ct.transpose(b_k.astype(c_k.dtype)), acc)
    ct.store(scores, (b, c, g, m, j), ct.reshape(acc, (1, 1, 1, BLOCK_M, BLOCK_K)))


def new_scores(B, chunk_size, poison=False):
    """The (batch, nchunks, ngroups, CHUNK, CHUNK) float32 buffer the kernel fills."""
    batch, seqlen, ngroups, _ = B.shape
    nchunks = cdiv(seqlen, chunk_size)
    return new_output((batch, nchunks, ngroups, chunk_size, chunk_size), torch.float32, B.device,
                      poison)


def chunk_scores_plan(B, C, scores, block_m, block_k, dstate_tile, load_lat=0):
    """The ``Plan`` filling ``scores`` (from ``new_scores``, its one output) with C B^T per chunk
    and group, in (block_m, block_k) tiles (those compute_out reads them in)."""
    batch, _, ngroups, dstate = B.shape
    dstate = tile_size(dstate)            # a dstate that is not a power of two: zero-padded
    nchunks, chunk_size = scores.shape[1], scores.shape[3]
    if chunk_size % block_m or chunk_size % block_k or dstate % dstate_tile:
        raise ValueError(f"tiles ({block_m}, {block_k}, dstate tile {dstate_tile}) must divide the "
                         f"chunk ({chunk_size}) and dstate ({dstate})")
    args = (B, C, scores, chunk_size, block_m, block_k, dstate, dstate_tile, load_lat)
    grid = (nchunks * (chunk_size // block_m) * (chunk_size // block_k), ngroups, batch)
    return Plan(grid, fit_index_width(chunk_scores_kernel, args), args, (scores,))
