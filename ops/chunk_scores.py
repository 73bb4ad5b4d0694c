"""An optional first step of kernel (c): C B^T of every chunk, once per group, into memory.

``compute_out`` needs, for each chunk and each head, the chunk x chunk matrix of scores
C[l] . B[s] (the "attention" part of the quadratic form). It does not depend on the head, only on
the head's group, yet by default ``compute_out`` forms it in registers for every head it serves:
80 times per chunk for a layer of 80 heads in one group (40 times with two heads per block). At
dstate 256 that product is most of ``compute_out``'s arithmetic, and it sits in the middle of each
column tile's chain of dependent steps (load B -> C B^T -> exp2 -> weights @ x).

With ``SCORES_IN_MEMORY`` (a compute_out config key), this kernel computes the scores once per
(chunk, group) and stores them in float32; ``compute_out`` then loads a (BLOCK_M, BLOCK_K) tile of
them where it would have computed it, which shortens the chain by one product and replaces the
B tile load (BLOCK_K x dstate) by a smaller one (BLOCK_M x BLOCK_K). The price is one more
launch and nchunks * ngroups * CHUNK^2 * 4 bytes written once and read by every head (from L2
when, as here, the heads of one chunk run at the same time). Whether that pays is measured by
the autotuner; mamba_ssm's Triton forward always takes this route (``_bmm_chunk_fwd``).

The grid is (chunk tiles, ngroups, batch) with one block per (BLOCK_M, BLOCK_K) tile of a chunk's
scores; every tile is written (including those above the diagonal, which compute_out masks), so
the buffer holds no uninitialised values. Rows or columns past the end of the sequence read B and
C as zeros; a tile whose rows or columns all lie past it is written as zeros without loading. The products accumulate in float32 from operands in the inputs' dtype, exactly as
compute_out's own C B^T does, so the two routes agree to the order of float32 summation.
"""
import torch

import cuda.tile as ct

from .launch import Plan, fit_index_width
from .utils import ZERO, ConstInt, cdiv, latency_hint, new_output, tile_size


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
