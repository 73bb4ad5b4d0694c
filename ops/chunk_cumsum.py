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
    several neighbouring heads per token keeps the global loads wide. The outputs are written
    (batch, nheads, nchunks, chunk_size), where each head's chunk is contiguous.
"""
import math

import torch

import cuda.tile as ct

from .launch import launch

LOG2E = 1.4426950408889634  # exp(v) == exp2(v * LOG2E)

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]


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
):
    # Large arrays are annotated IndexedWithInt64: their shapes, strides and tile indices are
    # 64-bit, so offsets such as token * nheads * headdim cannot overflow for long sequences.
    c = ct.bid(0)       # chunk
    hb = ct.bid(1)      # block of BLOCK_H heads
    b = ct.bid(2)       # batch element
    seqlen = dt.shape[1]

    # order=(0, 2, 1) views dt as (batch, nheads, seqlen): the tile comes out (BLOCK_H, CHUNK).
    # Zero padding covers the tokens past seqlen and heads past nheads (both are discarded).
    dtv = ct.load(dt, (b, hb, c), shape=(1, BLOCK_H, CHUNK), order=(0, 2, 1),
                  padding_mode=ct.PaddingMode.ZERO)
    dtv = ct.reshape(dtv, (BLOCK_H, CHUNK)).astype(ct.float32)

    if HAS_DT_BIAS:
        bias = ct.load(dt_bias, (hb,), shape=(BLOCK_H,), padding_mode=ct.PaddingMode.ZERO)
        dtv = dtv + bias.astype(ct.float32)[:, None]
    if DT_SOFTPLUS:
        # softplus(v) = log(1 + exp(v)). For very negative v, 1 + exp(v) rounds to 1 and the
        # plain log would return 0 instead of ~exp(v); the correction u / ((1 + u) - 1) restores
        # log1p's accuracy (Goldberg's trick). Above 20, softplus(v) == v in float32 and exp
        # could overflow, so those values pass through unchanged.
        u = ct.exp(ct.minimum(dtv, 20.0))
        w = 1.0 + u
        log1p_u = ct.where(w == 1.0, u, ct.log(w) * (u / (w - 1.0)))
        dtv = ct.where(dtv <= 20.0, log1p_u, dtv)
    # The clamp always applies: with the default limit (0, inf) it turns negative steps into 0.
    # (The limits are cast because a Python float argument may arrive as a 64-bit scalar.)
    lo = ct.astype(dt_min, ct.float32)
    hi = ct.astype(dt_max, ct.float32)
    dtv = ct.minimum(ct.maximum(dtv, lo), hi)

    # Tokens past the end of the sequence get dt = 0 (after the clamp, which could lift them).
    pos = c * CHUNK + ct.arange(CHUNK, dtype=ct.int32)
    dtv = ct.where(pos[None, :] < seqlen, dtv, 0.0)

    a = ct.load(A, (hb,), shape=(BLOCK_H,), padding_mode=ct.PaddingMode.ZERO)
    a_log2 = a.astype(ct.float32) * LOG2E
    dA = ct.cumsum(dtv * a_log2[:, None], axis=1)

    ct.store(dt_out, (b, hb, c, 0), ct.reshape(dtv, (1, BLOCK_H, 1, CHUNK)))
    ct.store(dA_cumsum, (b, hb, c, 0), ct.reshape(dA, (1, BLOCK_H, 1, CHUNK)))


def new_output(shape, dtype, device, poison=False):
    """An output buffer for a kernel to fill. ``poison=True`` fills it with NaN first, so an
    element the kernel fails to write shows up in tests; by default it is left uninitialised
    (filling costs a full write of the buffer: ~0.5 ms at 128K tokens on an H200)."""
    if poison:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _next_pow2(n):
    return 1 << max(0, (int(n) - 1).bit_length())


def check_chunk_size(chunk_size):
    if not (isinstance(chunk_size, int) and 16 <= chunk_size <= 256
            and chunk_size & (chunk_size - 1) == 0):
        raise ValueError(f"chunk_size must be a power of two in [16, 256], got {chunk_size!r}")


def chunk_cumsum_plan(dt, A, chunk_size, dt_bias=None, dt_softplus=False,
                      dt_limit=(0.0, math.inf), block_h=None, poison=False):
    """Allocate the outputs and build (grid, kernel, args, outputs) without launching."""
    check_chunk_size(chunk_size)
    batch, seqlen, nheads = dt.shape
    nchunks = -(-seqlen // chunk_size)
    if block_h is None:
        block_h = min(16, _next_pow2(nheads))
    shape = (batch, nheads, nchunks, chunk_size)
    dt_out = new_output(shape, torch.float32, dt.device, poison)
    dA_cumsum = new_output(shape, torch.float32, dt.device, poison)
    bias = dt_bias if dt_bias is not None else torch.zeros(1, dtype=torch.float32, device=dt.device)
    grid = (nchunks, -(-nheads // block_h), batch)
    args = (dt, A, bias, dt_out, dA_cumsum, float(dt_limit[0]), float(dt_limit[1]),
            chunk_size, block_h, dt_bias is not None, bool(dt_softplus))
    return grid, chunk_cumsum_kernel, args, (dt_out, dA_cumsum)


def chunk_cumsum(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                 poison=False):
    """dt (b, L, h), A (h,) -> (dt_out, dA_cumsum), both float32 (b, h, nchunks, chunk_size).

    dt_out is the processed step (0 past seqlen); dA_cumsum is the within-chunk cumulative sum
    of dt_out * A times log2(e), i.e. ``reference.chunked.chunk_cumsum``'s result * LOG2E.
    Inputs must be contiguous. ``poison=True`` NaN-fills the outputs first (for tests).
    """
    grid, kernel, args, outs = chunk_cumsum_plan(dt, A, chunk_size, dt_bias, dt_softplus, dt_limit,
                                                 poison=poison)
    launch(grid, kernel, args)
    return outs
