"""Backward kernel: the gradients of every chunk's own state.

Each chunk's state is S[c] = sum_t v[t] outer(x[t], B[t]) with v[t] = exp2(dA[last] - dA[t])
dt[t] (only the tokens of the sequence the chunk's last token belongs to). Given its gradient
dS[c] (``ops/bwd_pass_state.py``), for the tokens t of chunk c:

    dx[t]  = v[t] * (B[t] @ dS^T)           a (CHUNK, dstate) x (dstate, headdim) product
    dB[t]  = v[t] * (x[t] @ dS)             a (CHUNK, headdim) x (headdim, dstate) product
    dv[t]  = sum((x @ dS)[t] * B[t])        -> d dt[t] = dv[t] * exp2(dA[last] - dA[t]),
                                               d dA[t] = -dv[t] v[t], d dA[last] += sum(dv v)

One block takes one chunk of one head with the whole (headdim, dstate) state; the two products
run on the tensor cores (bfloat16 inputs: bf16 operands, float32 accumulation; float16 inputs
use float32 operands, since a loss-scaled dS overflows float16's range). dB is returned per
head, (batch, seqlen, nheads, dstate) float32, for a sum over each group's heads in a fixed
order by the caller (reproducible, no atomics). ``reference.backward.chunk_states_backward``
is the specification. (The whole state in one block: fine for the usual 64 x 128; the largest
sizes compile slowly and would want state tiles.)
"""
import torch

import cuda.tile as ct

from .launch import Plan, fit_index_width, run
from .utils import ZERO, ConstBool, ConstInt, as_int32, new_output, tile_size


@ct.kernel
def bwd_chunk_states_kernel(
    dS: ct.IndexedWithInt64,           # (batch, nchunks, nheads, headdim, dstate) float32
    x: ct.IndexedWithInt64,            # (batch, seqlen, nheads, headdim)
    B: ct.IndexedWithInt64,            # (batch, seqlen, ngroups, dstate)
    dt_out: ct.IndexedWithInt64,       # (batch, nheads, nchunks, CHUNK) float32
    dA_cumsum: ct.IndexedWithInt64,    # (batch, nheads, nchunks, CHUNK) float32, log2 units
    seq_idx: ct.IndexedWithInt64,      # (batch, seqlen) int32; unread if not HAS_SEQ_IDX
    dx: ct.IndexedWithInt64,           # (batch, seqlen, nheads, headdim) float32
    dB: ct.IndexedWithInt64,           # (batch, seqlen, nheads, dstate) float32, per head
    ddt: ct.IndexedWithInt64,          # (batch, nheads, nchunks, CHUNK) float32
    ddA: ct.IndexedWithInt64,          # (batch, nheads, nchunks, CHUNK) float32, natural units
    heads_per_group: int,
    CHUNK: ConstInt,
    P: ConstInt,                       # headdim and dstate tiles (powers of two, zero-padded)
    N: ConstInt,
    HAS_SEQ_IDX: ConstBool,
    F32_OPERANDS: ConstBool,           # float32 products (float16 inputs)
):
    c, h, b = ct.bid(0), ct.bid(1), ct.bid(2)
    g = h // heads_per_group
    s = ct.reshape(ct.load(dS, (b, c, h, 0, 0), shape=(1, 1, 1, P, N), padding_mode=ZERO),
                   (P, N))
    xt = ct.reshape(ct.load(x, (b, c, h, 0), shape=(1, CHUNK, 1, P), padding_mode=ZERO),
                    (CHUNK, P))
    bt = ct.reshape(ct.load(B, (b, c, g, 0), shape=(1, CHUNK, 1, N), padding_mode=ZERO),
                    (CHUNK, N))
    dA = ct.reshape(ct.load(dA_cumsum, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
    dt = ct.reshape(ct.load(dt_out, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
    dA_last = ct.extract(dA, (CHUNK - 1,), shape=(1,)).item()
    decay = ct.exp2(ct.minimum(dA_last - dA, 0.0))
    if HAS_SEQ_IDX:
        seqlen = x.shape[1]
        seq_last = ct.load(seq_idx, (b, min((c + 1) * CHUNK, seqlen) - 1), shape=())
        seq = ct.reshape(ct.load(seq_idx, (b, c), shape=(1, CHUNK), padding_mode=ZERO), (CHUNK,))
        decay = ct.where(seq == seq_last, decay, 0.0)
    v = decay * dt
    # The two products, with x's dtype (or float32) operands and float32 accumulators.
    if F32_OPERANDS:
        s_op, b_op, x_op = s, bt.astype(ct.float32), xt.astype(ct.float32)
    else:
        s_op, b_op, x_op = s.astype(x.dtype), bt.astype(x.dtype), xt
    b_ds = ct.mma(b_op, ct.transpose(s_op), ct.zeros((CHUNK, P), dtype=ct.float32))
    x_ds = ct.mma(x_op, s_op, ct.zeros((CHUNK, N), dtype=ct.float32))
    ct.store(dx, (b, c, h, 0), ct.reshape(b_ds * v[:, None], (1, CHUNK, 1, P)))
    ct.store(dB, (b, c, h, 0), ct.reshape(x_ds * v[:, None], (1, CHUNK, 1, N)))
    dv = ct.sum(x_ds * bt.astype(ct.float32), axis=1)                 # (CHUNK,)
    ct.store(ddt, (b, h, c, 0), ct.reshape(dv * decay, (1, 1, 1, CHUNK)))
    # d dA: -dv v at each token, and their sum at the last one (natural-log units).
    dvv = dv * v
    last = ct.arange(CHUNK, dtype=ct.int32) == CHUNK - 1
    grad_dA = ct.where(last, ct.sum(dvv) - dvv, -dvv)
    ct.store(ddA, (b, h, c, 0), ct.reshape(grad_dA, (1, 1, 1, CHUNK)))


def bwd_chunk_states_plan(dS, x, B, dt_out, dA_cumsum, seq_idx=None, poison=False):
    """The launch (an ``ops.launch.Plan``; outputs dx, dB per head, ddt_out, ddA_cumsum)."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    nchunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    dx = new_output(x.shape, torch.float32, x.device, poison)
    dB = new_output((batch, seqlen, nheads, dstate), torch.float32, x.device, poison)
    ddt = new_output(dt_out.shape, torch.float32, x.device, poison)
    ddA = new_output(dt_out.shape, torch.float32, x.device, poison)
    seq_idx = as_int32(seq_idx)
    args = (dS, x, B, dt_out, dA_cumsum, seq_idx if seq_idx is not None else dt_out, dx, dB,
            ddt, ddA, nheads // ngroups, chunk_size, tile_size(headdim), tile_size(dstate),
            seq_idx is not None, x.dtype == torch.float16)
    return Plan((nchunks, nheads, batch), fit_index_width(bwd_chunk_states_kernel, args), args,
                (dx, dB, ddt, ddA))


def bwd_chunk_states(dS, x, B, dt_out, dA_cumsum, seq_idx=None, poison=False):
    """-> (dx (b, L, h, p), dB per head (b, L, h, n), ddt_out and ddA_cumsum (b, h, c, l), the
    latter in natural-log units), all float32, like ``reference.backward.chunk_states_backward``
    (whose dB is per head too). ``dA_cumsum`` in the kernels' log2 units."""
    return run(bwd_chunk_states_plan(dS, x, B, dt_out, dA_cumsum, seq_idx, poison))
