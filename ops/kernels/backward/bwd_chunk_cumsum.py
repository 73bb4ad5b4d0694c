"""Backward kernel: through the within-chunk cumsum and the dt processing.

The forward (``ops/kernels/chunk_cumsum.py``) computes dt_out = clamp(softplus(dt + dt_bias), dt_limit)
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

Two later steps' terms of ddA sit at each chunk's last token only, and come as partial sums that
no block of theirs could finish without atomics: the state pass' (one per state tile) and, with
the fused token kernel, the chunk's own state's (one per token tile). The block that reads the
chunk's ddA sums them itself (``chunk_ends``: up to two (batch, nheads, nchunks, parts) float32
arrays, each summed over its last axis and added at the chunk's last token, in the order given),
so the host need not: at a small step each host operator costs about as much time as the
kernel (``ops/runtime/tape.py``).

Tunables (``default_config`` / ``search_space``), as the forward's: BLOCK_H, LOAD_LAT (latency
hint of the dt, ddt_out and ddA loads), STORE_LAT (of the ddt store) and the compiler hint
occupancy. The kernel moves ~20 bytes per token and head, a small share of the backward.
"""
import math

import torch

import cuda.tile as ct

from ops.tuning.configs import resolve_config, unique, with_hints
from ops.runtime.launch import Plan, fit_index_width, run
from ops.kernels.common import (ZERO, ConstBool, ConstInt, cdiv, is_pow2_in, latency_hint, new_output,
                    next_pow2, softplus, unread_stand_in)


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
    end_a,                            # (batch, nheads, nchunks, END_A) float32 partials of the
    end_b,                            #   chunk-end terms (END_* 0: none, a dummy), see above
    dt_min: float,
    dt_max: float,
    CHUNK: ConstInt,
    BLOCK_H: ConstInt,
    HAS_DT_BIAS: ConstBool,
    DT_SOFTPLUS: ConstBool,
    LOAD_LAT: ConstInt,               # latency hint of the dt, ddt_out and ddA loads; 0 = none
    STORE_LAT: ConstInt,              # latency hint of the ddt store; 0 = none
    END_A: ConstInt,                  # end_a's parts padded (END_WIDTH; 0: none)
    END_B: ConstInt,
):
    c, hb, b = ct.bid(0), ct.bid(1), ct.bid(2)
    seqlen = dt.shape[1]
    raw = ct.load(dt, (b, hb, c), shape=(1, BLOCK_H, CHUNK), order=(0, 2, 1), padding_mode=ZERO,
                  latency=latency_hint(LOAD_LAT))
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
                               padding_mode=ZERO, latency=latency_hint(LOAD_LAT)),
                       (BLOCK_H, CHUNK))
    g_dA = ct.reshape(ct.load(ddA, (b, hb, c, 0), shape=(1, BLOCK_H, 1, CHUNK),
                              padding_mode=ZERO, latency=latency_hint(LOAD_LAT)),
                      (BLOCK_H, CHUNK))
    last = (ct.arange(CHUNK, dtype=ct.int32) == CHUNK - 1)[None, :]
    if END_A > 0:
        g_dA = g_dA + ct.where(last, chunk_end_sum(end_a, b, hb, c, BLOCK_H, END_A), 0.0)
    if END_B > 0:
        g_dA = g_dA + ct.where(last, chunk_end_sum(end_b, b, hb, c, BLOCK_H, END_B), 0.0)
    a = ct.load(A, (hb,), shape=(BLOCK_H,), padding_mode=ZERO).astype(ct.float32)
    dprod = ct.cumsum(g_dA, axis=1, reverse=True)                  # d (dt_out * A)
    g = ct.where(passed, (g_out + dprod * a[:, None]) * slope, 0.0)
    ct.store(ddt, (b, hb, c), ct.reshape(g, (1, BLOCK_H, CHUNK)), order=(0, 2, 1),
             latency=latency_hint(STORE_LAT))
    ct.store(dA_parts, (b, c, hb), ct.reshape(ct.sum(dprod * dt_out, axis=1), (1, 1, BLOCK_H)))
    ct.store(dbias_parts, (b, c, hb), ct.reshape(ct.sum(g, axis=1), (1, 1, BLOCK_H)))


def chunk_end_sum(parts, b, hb, c, BLOCK_H, WIDTH):
    """The sum of one chunk's partials for BLOCK_H heads, as a (BLOCK_H, 1) column (parts past
    the array's last axis load as zeros)."""
    tile = ct.load(parts, (b, hb, c, 0), shape=(1, BLOCK_H, 1, WIDTH), padding_mode=ZERO)
    return ct.sum(ct.reshape(tile, (BLOCK_H, WIDTH)), axis=1)[:, None]


# Configs and launching -------------------------------------------------------------------------

def default_config(*, nheads, **_):
    """16 heads per block (fewer when there are fewer), no latency hints, four blocks per
    multiprocessor. Left to itself the compiler gives each thread 255 registers, so that one
    block fits where four would; asked for four, it takes 64 at chunk 64 and 128 and 124 at 256,
    with no spills and fewer instructions (sm_90 and sm_100). Every search of the backward's
    kernels on an H100 and an H200 picked four blocks, 1.35-2.15x the compiler's own choice at
    seven shapes (``tests/benchmark/results/autotune_backward_chunk128_h100.json``,
    ``..._h200.json``; ``tests/benchmark/test_backward_claims.py``)."""
    return dict(BLOCK_H=min(16, next_pow2(nheads)), LOAD_LAT=0, STORE_LAT=0, INDEX64=False,
                occupancy=4)


def search_space(*, nheads, **shape):
    """Heads per block (4..32: the width of the transposed dt load and the block count), each
    with and without the long load-latency hint, the store hint, and two blocks per
    multiprocessor or the compiler's own occupancy (at most 12 configs)."""
    base = default_config(nheads=nheads, **shape)
    configs = [base]
    for bh in sorted({min(bh, next_pow2(nheads)) for bh in (4, 8, 16, 32)}):
        configs += [{**base, "BLOCK_H": bh, "LOAD_LAT": lat} for lat in (0, 8)]
    configs += [{**base, "STORE_LAT": 8}, {**base, "occupancy": 2}, {**base, "occupancy": None}]
    return unique(configs)


def bwd_chunk_cumsum_plan(ddt_out, ddA, dt, A, dt_bias=None, dt_softplus=False,
                          dt_limit=(0.0, math.inf), block_h=None, poison=False, config=None,
                          chunk_ends=()):
    """The launch (an ``ops.runtime.launch.Plan``; outputs ddt, the per-chunk partials of dA and of
    ddt_bias). ``config``: a dict from ``search_space`` (or part of one; missing keys take
    ``default_config``'s values); ``block_h``, when given, overrides its BLOCK_H.
    ``chunk_ends``: up to two (batch, nheads, nchunks, parts) float32 arrays whose sums over
    their last axis are terms of ddA at each chunk's last token (see above)."""
    batch, seqlen, nheads = dt.shape
    nchunks, chunk_size = ddt_out.shape[2], ddt_out.shape[3]
    ends = _check_chunk_ends(chunk_ends, (batch, nheads, nchunks))
    cfg = resolve_config(config, default_config(nheads=nheads))
    block_h = block_h or cfg["BLOCK_H"]
    if not is_pow2_in(block_h, 1, 1024):
        raise ValueError(f"BLOCK_H must be a power of two, got {block_h}")
    ddt = new_output(dt.shape, torch.float32, dt.device, poison)
    dA_parts = new_output((batch, nchunks, nheads), torch.float32, dt.device, poison)
    dbias_parts = new_output((batch, nchunks, nheads), torch.float32, dt.device, poison)
    bias = dt_bias if dt_bias is not None else unread_stand_in(dt.device)
    widths = [end_width(e.shape[3]) for e in ends] + [0] * (2 - len(ends))
    ends = list(ends) + [unread_stand_in(dt.device, 4)] * (2 - len(ends))
    args = (ddt_out, ddA, dt, A, bias, ddt, dA_parts, dbias_parts, *ends, float(dt_limit[0]),
            float(dt_limit[1]), chunk_size, block_h, dt_bias is not None, bool(dt_softplus),
            cfg["LOAD_LAT"], cfg["STORE_LAT"], *widths)
    kernel = with_hints(fit_index_width(bwd_chunk_cumsum_kernel, args, cfg["INDEX64"]), cfg)
    return Plan((nchunks, cdiv(nheads, block_h), batch), kernel, args,
                (ddt, dA_parts, dbias_parts))


# The partials of a chunk end load as a tile of at least this many (zeros past the array): the
# counts the backward's other kernels give (their token tiles per chunk times dstate slices,
# their state tiles) are mostly 1 to 8, and each padded width compiles a variant of its own, so
# one width serves them all (a first call compiles once; a search's precompiled candidates are
# the ones it times, whatever the other kernels' configs).
END_WIDTH = 8


def end_width(parts):
    """The tile width that ``parts`` partials of a chunk end load in: END_WIDTH, or the power of
    two above ``parts`` where that is more."""
    return max(END_WIDTH, next_pow2(parts))


def _check_chunk_ends(chunk_ends, chunks):
    """``chunk_ends`` as a tuple of at most two (*chunks, parts) float32 arrays, else an error."""
    ends = tuple(chunk_ends)
    if len(ends) > 2:
        raise ValueError(f"chunk_ends takes at most two arrays of partials, got {len(ends)}")
    for e in ends:
        if (not isinstance(e, torch.Tensor) or e.dim() != 4 or tuple(e.shape[:3]) != chunks
                or e.dtype != torch.float32 or not 1 <= e.shape[3] <= 1024):
            got = (f"{tuple(e.shape)} {e.dtype}" if isinstance(e, torch.Tensor)
                   else type(e).__name__)
            raise ValueError(f"chunk_ends must hold float32 arrays (batch, nheads, nchunks) = "
                             f"{chunks} by 1..1024 parts; got {got}")
    return ends


def bwd_chunk_cumsum(ddt_out, ddA, dt, A, dt_bias=None, dt_softplus=False,
                     dt_limit=(0.0, math.inf), poison=False, config=None, chunk_ends=()):
    """-> (ddt (b, L, h), dA (h,), ddt_bias (h,) or None), float32, like
    ``reference.backward.chunk_cumsum_backward`` given ddA with ``chunk_ends``' sums added at
    each chunk's last token."""
    ddt, dA_parts, dbias_parts = run(bwd_chunk_cumsum_plan(ddt_out, ddA, dt, A, dt_bias,
                                                           dt_softplus, dt_limit, poison=poison,
                                                           config=config,
                                                           chunk_ends=chunk_ends))
    return ddt, dA_parts.sum((0, 1)), None if dt_bias is None else dbias_parts.sum((0, 1))
