"""Backward kernel: through the within-chunk cumsum and the dt processing.

The forward (``ops/chunk_cumsum.py``) computes dt_out = clamp(softplus(dt + dt_bias), dt_limit)
(0 past the sequence) and dA_cumsum = cumsum(dt_out * A) along each chunk. Given the gradients
of dt_out and of dA_cumsum (natural-log units) from the later steps' backward:

    d(dt_out * A)[t] = sum_{t' >= t} ddA[t']          a cumsum in reverse
    ddt_out'         = ddt_out + that * A
    dA               = sum_t that * dt_out            (per head: a partial per chunk)
    ddt              = ddt_out' where the clamp passed the value, times softplus' = sigmoid
    ddt_bias         = sum_t ddt                      (per head: a partial per chunk)

One block takes one chunk of BLOCK_H heads, as the forward does (the same transposing view of
dt). The per-chunk partials of dA and ddt_bias are summed over chunks and batch on the host, in
a fixed order. ``reference.backward.chunk_cumsum_backward`` is the specification.
"""
import math

import torch

import cuda.tile as ct

from .launch import Plan, fit_index_width, run
from .utils import ZERO, ConstBool, ConstInt, cdiv, new_output, next_pow2, softplus


@ct.kernel
def bwd_chunk_cumsum_kernel(
    ddt_out,                          # (batch, nheads, nchunks, CHUNK) float32
    ddA,                              # (batch, nheads, nchunks, CHUNK) float32, natural units
    dt: ct.IndexedWithInt64,          # (batch, seqlen, nheads), the forward's raw input
    A,                                # (nheads,)
    dt_bias,                          # (nheads,), or a 1-element dummy when HAS_DT_BIAS is False
    ddt: ct.IndexedWithInt64,         # (batch, seqlen, nheads) float32
    dA_parts,                         # (batch, nchunks, nheads) float32
    dbias_parts,                      # (batch, nchunks, nheads) float32
    dt_min: float,
    dt_max: float,
    CHUNK: ConstInt,
    BLOCK_H: ConstInt,
    HAS_DT_BIAS: ConstBool,
    DT_SOFTPLUS: ConstBool,
):
    c, hb, b = ct.bid(0), ct.bid(1), ct.bid(2)
    seqlen = dt.shape[1]
    raw = ct.load(dt, (b, hb, c), shape=(1, BLOCK_H, CHUNK), order=(0, 2, 1), padding_mode=ZERO)
    raw = ct.reshape(raw, (BLOCK_H, CHUNK)).astype(ct.float32)
    if HAS_DT_BIAS:
        raw = raw + ct.load(dt_bias, (hb,), shape=(BLOCK_H,), padding_mode=ZERO).astype(ct.float32)[:, None]
    soft = raw
    slope = ct.full((BLOCK_H, CHUNK), 1.0, dtype=ct.float32)
    if DT_SOFTPLUS:
        # softplus as the forward computes it (identity above 20); its slope is the sigmoid.
        soft = softplus(raw)
        slope = ct.where(raw <= 20.0, 1.0 / (1.0 + ct.exp(-raw)), 1.0)
    lo = ct.astype(dt_min, ct.float32)
    hi = ct.astype(dt_max, ct.float32)
    inside = (ct.arange(CHUNK, dtype=ct.int32) + c * CHUNK)[None, :] < seqlen
    dt_out = ct.where(inside, ct.minimum(ct.maximum(soft, lo), hi), 0.0)
    passed = (soft >= lo) & (soft <= hi) & inside

    g_out = ct.reshape(ct.load(ddt_out, (b, hb, c, 0), shape=(1, BLOCK_H, 1, CHUNK),
                               padding_mode=ZERO), (BLOCK_H, CHUNK))
    g_dA = ct.reshape(ct.load(ddA, (b, hb, c, 0), shape=(1, BLOCK_H, 1, CHUNK),
                              padding_mode=ZERO), (BLOCK_H, CHUNK))
    a = ct.load(A, (hb,), shape=(BLOCK_H,), padding_mode=ZERO).astype(ct.float32)
    dprod = ct.cumsum(g_dA, axis=1, reverse=True)                  # d (dt_out * A)
    g = ct.where(passed, (g_out + dprod * a[:, None]) * slope, 0.0)
    ct.store(ddt, (b, hb, c), ct.reshape(g, (1, BLOCK_H, CHUNK)), order=(0, 2, 1))
    ct.store(dA_parts, (b, c, hb), ct.reshape(ct.sum(dprod * dt_out, axis=1), (1, 1, BLOCK_H)))
    ct.store(dbias_parts, (b, c, hb), ct.reshape(ct.sum(g, axis=1), (1, 1, BLOCK_H)))


def bwd_chunk_cumsum_plan(ddt_out, ddA, dt, A, dt_bias=None, dt_softplus=False,
                          dt_limit=(0.0, math.inf), block_h=None, poison=False):
    """The launch (an ``ops.launch.Plan``; outputs ddt, the per-chunk partials of dA and of
    ddt_bias)."""
    batch, seqlen, nheads = dt.shape
    nchunks, chunk_size = ddt_out.shape[2], ddt_out.shape[3]
    block_h = block_h or min(16, next_pow2(nheads))
    ddt = new_output(dt.shape, torch.float32, dt.device, poison)
    dA_parts = new_output((batch, nchunks, nheads), torch.float32, dt.device, poison)
    dbias_parts = new_output((batch, nchunks, nheads), torch.float32, dt.device, poison)
    bias = dt_bias if dt_bias is not None else torch.zeros(1, dtype=torch.float32, device=dt.device)
    args = (ddt_out, ddA, dt, A, bias, ddt, dA_parts, dbias_parts, float(dt_limit[0]),
            float(dt_limit[1]), chunk_size, block_h, dt_bias is not None, bool(dt_softplus))
    return Plan((nchunks, cdiv(nheads, block_h), batch),
                fit_index_width(bwd_chunk_cumsum_kernel, args), args, (ddt, dA_parts, dbias_parts))


def bwd_chunk_cumsum(ddt_out, ddA, dt, A, dt_bias=None, dt_softplus=False,
                     dt_limit=(0.0, math.inf), poison=False):
    """-> (ddt (b, L, h), dA (h,), ddt_bias (h,) or None), float32, like
    ``reference.backward.chunk_cumsum_backward``."""
    ddt, dA_parts, dbias_parts = run(bwd_chunk_cumsum_plan(ddt_out, ddA, dt, A, dt_bias,
                                                           dt_softplus, dt_limit, poison=poison))
    return ddt, dA_parts.sum((0, 1)), None if dt_bias is None else dbias_parts.sum((0, 1))
