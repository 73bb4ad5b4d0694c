"""Kernel (a): process dt and take the within-chunk cumulative sum of dt * A.

What one block does
    One block owns one chunk of one batch element for ``BLOCK_H`` consecutive heads. It loads
    the (chunk_size, BLOCK_H) slab of ``dt`` with a transposing load, so the tile arrives as
    (BLOCK_H, chunk_size): one row per head, tokens along the row. It then

      1. processes dt exactly like ``reference.common.process_dt``: add ``dt_bias``, softplus
         where the sum is <= 20, clamp to ``dt_limit``;
      2. zeroes the tokens past the end of the sequence (the padding of the last chunk), so
         they neither decay nor write the state in the later kernels;
      3. takes the running sum of ``dt * A`` along the row, in log2 units (``A * log2(e)``),
         so that every later kernel turns it into a decay with the cheap ``exp2``.

The grid
    ``(nchunks, cdiv(nheads, BLOCK_H), batch)``. Every block is independent: nothing is
    sequential here, the scan runs inside one tile.

Why several heads per block
    ``dt`` is stored (batch, seqlen, nheads): the heads are the contiguous dimension. Reading
    several neighbouring heads per token keeps the global loads wide.

The layout of the outputs
    Both outputs are stored (batch, nheads, nchunks, chunk_size), i.e. (batch, nheads, seqlen
    padded to whole chunks): for one head, the whole sequence is one contiguous run of floats.
    That is the layout the two later kernels want, because every one of their reads is "the
    values of ONE head (or of a few neighbouring heads) over a run of consecutive tokens":
    fwd_pass_state reads a head's whole chunk, compute_out a head's BLOCK_M rows and BLOCK_K
    columns. In (batch, seqlen, nheads) those tokens would lie nheads * 4 bytes apart (a strided
    gather, 4 useful bytes per 32-byte sector); here they are one contiguous (and TMA-friendly)
    segment. Padding each head to whole chunks also lets the readers use chunk-aligned tiles
    without a ragged end (the padding holds dt = 0, which makes those tokens inert). A block of
    this kernel writes its (BLOCK_H, chunk_size) result as BLOCK_H contiguous segments.

Indexing
    Sequence-long arrays are ``ct.IndexedWithInt64`` (64-bit offsets); below 2**31 elements
    ``ops.runtime.launch.fit_index_width`` runs the kernel's 32-bit twin instead (notebook 06).

Tunables (``default_config`` / ``search_space``)
    BLOCK_H (heads per block), LOAD_LAT / STORE_LAT (latency hints on the dt load and the two
    stores; 0 = none), and the compiler hint occupancy (applied with ``kernel.replace_hints``;
    num_ctas is accepted only as None or 1: clusters of CTAs gave wrong results on sm_90). The
    defaults are the values described above; the kernel is a small share of the forward pass (a
    few percent), so its search space is small.
"""
import math

import torch

import cuda.tile as ct

from ops.tuning.configs import resolve_config, unique, with_hints
from ops.runtime.launch import Plan, fit_index_width, run
from ops.kernels.common import (LOG2E, ZERO, ConstBool, ConstInt, cdiv, check_chunk_size, is_pow2_in, latency_hint,
                    new_output, next_pow2, softplus, unread_stand_in)


@ct.kernel
def chunk_cumsum_kernel(
    dt: ct.IndexedWithInt64,         # (batch, seqlen, nheads), any float dtype
    A,                               # (nheads,)
    dt_bias,                         # (nheads,), or a 1-element dummy when HAS_DT_BIAS is False
    dt_out: ct.IndexedWithInt64,     # (batch, nheads, nchunks, CHUNK) float32
    dA_cumsum: ct.IndexedWithInt64,  # (batch, nheads, nchunks, CHUNK) float32, log2 units
    dt_min: float,
    dt_max: float,
    CHUNK: ConstInt,
    BLOCK_H: ConstInt,
    HAS_DT_BIAS: ConstBool,
    DT_SOFTPLUS: ConstBool,
    LOAD_LAT: ConstInt,              # latency hint of the dt load, 1 (low) .. 10 (high); 0 = none
    STORE_LAT: ConstInt,             # latency hint of the two stores; 0 = none
):
    c = ct.bid(0)       # chunk
    hb = ct.bid(1)      # block of BLOCK_H heads
    b = ct.bid(2)       # batch element
    seqlen = dt.shape[1]

    # order=(0, 2, 1) views dt as (batch, nheads, seqlen): the tile comes out (BLOCK_H, CHUNK).
    # Zero padding covers the tokens past seqlen and heads past nheads (both are discarded).
    dtv = ct.load(dt, (b, hb, c), shape=(1, BLOCK_H, CHUNK), order=(0, 2, 1),
                  padding_mode=ZERO, latency=latency_hint(LOAD_LAT))
    dtv = ct.reshape(dtv, (BLOCK_H, CHUNK)).astype(ct.float32)

    if HAS_DT_BIAS:
        bias = ct.load(dt_bias, (hb,), shape=(BLOCK_H,), padding_mode=ZERO)
        dtv = dtv + bias.astype(ct.float32)[:, None]
    if DT_SOFTPLUS:
        dtv = softplus(dtv)             # log1p-accurate for very negative inputs (ops.kernels.common)
    # The clamp always applies: with the default limit (0, inf) it turns negative steps into 0.
    # (The limits are cast because a Python float argument may arrive as a 64-bit scalar.)
    lo = ct.astype(dt_min, ct.float32)
    hi = ct.astype(dt_max, ct.float32)
    dtv = ct.minimum(ct.maximum(dtv, lo), hi)

    # Tokens past the end of the sequence get dt = 0 (after the clamp, which could lift them).
    pos = c * CHUNK + ct.arange(CHUNK, dtype=ct.int32)
    dtv = ct.where(pos[None, :] < seqlen, dtv, 0.0)

    a = ct.load(A, (hb,), shape=(BLOCK_H,), padding_mode=ZERO)
    a_log2 = a.astype(ct.float32) * LOG2E
    dA = ct.cumsum(dtv * a_log2[:, None], axis=1)

    ct.store(dt_out, (b, hb, c, 0), ct.reshape(dtv, (1, BLOCK_H, 1, CHUNK)),
             latency=latency_hint(STORE_LAT))
    ct.store(dA_cumsum, (b, hb, c, 0), ct.reshape(dA, (1, BLOCK_H, 1, CHUNK)),
             latency=latency_hint(STORE_LAT))


# Configs (see ops.tuning.configs) and launching ----------------------------------------------------

def default_config(*, nheads, **_):
    """The default: 16 heads per block (fewer when there are fewer heads), no hints."""
    return dict(BLOCK_H=min(16, next_pow2(nheads)), LOAD_LAT=0, STORE_LAT=0, INDEX64=False,
                occupancy=None, num_ctas=None, num_worker_warps=None)


def search_space(*, nheads, **shape):
    """Heads per block (the width of the dt load and the block count), each with and without a
    load latency hint, and a few hints (17 configs from 16 heads up); the kernel moves
    seqlen * nheads * 12 bytes, a few percent of the forward pass."""
    base = default_config(nheads=nheads, **shape)
    widths = sorted({min(bh, next_pow2(nheads)) for bh in (4, 8, 16, 32)})
    configs = [base]
    for bh in widths:
        for load_lat in (0, 3, 8):
            configs.append({**base, "BLOCK_H": bh, "LOAD_LAT": load_lat})
    configs += [{**base, "STORE_LAT": 8}]
    configs += [{**base, "occupancy": occ} for occ in (1, 2, 4)]
    return unique(configs + [{**configs[0], "INDEX64": True}])


def chunk_cumsum_plan(dt, A, chunk_size, dt_bias=None, dt_softplus=False,
                      dt_limit=(0.0, math.inf), block_h=None, poison=False, config=None):
    """Allocate the outputs and build the launch (an ``ops.runtime.launch.Plan``) without running it.

    ``config``: a dict from ``search_space`` (or part of one; missing keys take
    ``default_config``'s values). ``block_h``, when given, overrides the config's BLOCK_H."""
    check_chunk_size(chunk_size)
    batch, seqlen, nheads = dt.shape
    nchunks = cdiv(seqlen, chunk_size)
    cfg = resolve_config(config, default_config(nheads=nheads))
    block_h = block_h or cfg["BLOCK_H"]
    if not is_pow2_in(block_h, 1, 1024):
        raise ValueError(f"BLOCK_H must be a power of two, got {block_h}")
    shape = (batch, nheads, nchunks, chunk_size)
    dt_out = new_output(shape, torch.float32, dt.device, poison)
    dA_cumsum = new_output(shape, torch.float32, dt.device, poison)
    bias = dt_bias if dt_bias is not None else unread_stand_in(dt.device)
    grid = (nchunks, cdiv(nheads, block_h), batch)
    args = (dt, A, bias, dt_out, dA_cumsum, float(dt_limit[0]), float(dt_limit[1]),
            chunk_size, block_h, dt_bias is not None, bool(dt_softplus),
            cfg["LOAD_LAT"], cfg["STORE_LAT"])
    kernel = with_hints(fit_index_width(chunk_cumsum_kernel, args, cfg["INDEX64"]), cfg)
    return Plan(grid, kernel, args, (dt_out, dA_cumsum))


def chunk_cumsum(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                 poison=False, config=None):
    """dt (b, L, h), A (h,) -> (dt_out, dA_cumsum), both float32 (b, h, nchunks, chunk_size).

    dt_out is the processed step (0 past seqlen); dA_cumsum is the within-chunk cumulative sum
    of dt_out * A times log2(e), i.e. ``reference.chunked.chunk_cumsum``'s result * LOG2E.
    Inputs as ``ops.torch_op.as_kernel_input`` gives them. ``poison=True`` NaN-fills the outputs
    first (for tests). ``config`` picks a variant (see ``search_space``); None is the default.
    """
    return run(chunk_cumsum_plan(dt, A, chunk_size, dt_bias, dt_softplus, dt_limit,
                                 poison=poison, config=config))
