"""Kernel (c) with every option off: the outputs of one chunk of one head per block.

    y[l] = exp2(dA[l]) * C[l] @ entry_state^T                          carried in
         + sum_{s <= l} (C[l] . B[s]) * exp2(dA[l] - dA[s]) * dt[s] * x[s]   inside the chunk

Both terms are ``ct.mma`` products. The chunk x chunk matrix C B^T is formed, masked (causality)
and weighted in registers, and never written to memory: that is the fusion.
"""
import math

import cuda.tile as ct

from ops.runtime.launch import Plan, run
from ops.kernels.common import ConstInt, new_output
from .checks import check_one_group, check_whole_chunks


@ct.kernel
def compute_out_core_kernel(x, B, C, dt_out, dA_cumsum, entry_states, out,
                            CHUNK: ConstInt, P: ConstInt, N: ConstInt):
    c, h, b = ct.bid(0), ct.bid(1), ct.bid(2)          # chunk, head, batch element
    c_rows = ct.reshape(ct.load(C, (b, c, 0, 0), shape=(1, CHUNK, 1, N)), (CHUNK, N))
    b_rows = ct.reshape(ct.load(B, (b, c, 0, 0), shape=(1, CHUNK, 1, N)), (CHUNK, N))
    x_rows = ct.reshape(ct.load(x, (b, c, h, 0), shape=(1, CHUNK, 1, P)), (CHUNK, P))
    state = ct.reshape(ct.load(entry_states, (b, c, h, 0, 0), shape=(1, 1, 1, P, N)), (P, N))
    dA = ct.reshape(ct.load(dA_cumsum, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
    dt = ct.reshape(ct.load(dt_out, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
    # Carried in: the entry state read through C, each row decayed from the chunk's start.
    acc = ct.zeros((CHUNK, P), dtype=ct.float32)
    acc = ct.mma(c_rows, ct.transpose(state.astype(C.dtype)), acc)
    acc = acc * ct.exp2(dA)[:, None]
    # Inside the chunk: (C B^T, causal, decayed, times dt) @ x.
    cb = ct.mma(c_rows, ct.transpose(b_rows), ct.zeros((CHUNK, CHUNK), dtype=ct.float32))
    pos = ct.arange(CHUNK, dtype=ct.int32)
    expo = ct.where(pos[:, None] >= pos[None, :], dA[:, None] - dA[None, :], -math.inf)
    weights = (cb * ct.exp2(expo) * dt[None, :]).astype(x.dtype)
    acc = ct.mma(weights, x_rows, acc)
    ct.store(out, (b, c, h, 0), ct.reshape(acc.astype(out.dtype), (1, CHUNK, 1, P)))


def compute_out_core_plan(x, B, C, dt_out, dA_cumsum, entry_states, poison=False):
    """The launch (an ``ops.runtime.launch.Plan``, output allocated) of ``compute_out_core``."""
    batch, seqlen, nheads, headdim = x.shape
    dstate, chunk_size = B.shape[3], dt_out.shape[3]
    nchunks = check_whole_chunks(seqlen, chunk_size)
    check_one_group(x, B)
    out = new_output(x.shape, x.dtype, x.device, poison)
    args = (x, B, C, dt_out, dA_cumsum, entry_states, out, chunk_size, headdim, dstate)
    return Plan((nchunks, nheads, batch), compute_out_core_kernel, args, (out,))


def compute_out_core(x, B, C, dt_out, dA_cumsum, entry_states, poison=False):
    """x (b, L, h, p), B and C (b, L, 1, n), the intermediates of the two core kernels before ->
    out (b, L, h, p) in x's dtype."""
    out, = run(compute_out_core_plan(x, B, C, dt_out, dA_cumsum, entry_states, poison))
    return out
