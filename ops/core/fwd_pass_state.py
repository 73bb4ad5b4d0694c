"""Kernel (b) with every option off: each chunk's entry state, and the final state.

One block owns one head of one batch element and its whole (headdim, dstate) state, a float32
tile that stays in registers while the block walks the chunks in order:

    entry[c]  = state
    state     = exp2(dA[last]) * state + (x * w)^T @ B       w[t] = exp2(dA[last] - dA[t]) * dt[t]

The product is one ``ct.mma`` per chunk: (headdim, CHUNK) x (CHUNK, dstate) on the tensor cores.
"""
import torch

import cuda.tile as ct

from ops.runtime.launch import Plan, run
from ops.kernels.common import ConstInt, new_output
from .checks import check_one_group, check_whole_chunks


@ct.kernel
def fwd_pass_state_core_kernel(x, B, dt_out, dA_cumsum, entry_states, final_states,
                               CHUNK: ConstInt, P: ConstInt, N: ConstInt):
    h, b = ct.bid(0), ct.bid(1)                         # head, batch element
    state = ct.zeros((P, N), dtype=ct.float32)
    for c in range(dt_out.shape[2]):                    # the chunks, in order: sequential
        entry = ct.reshape(state, (1, 1, 1, P, N)).astype(entry_states.dtype)
        ct.store(entry_states, (b, c, h, 0, 0), entry)           # the state chunk c starts from
        xt = ct.reshape(ct.load(x, (b, c, h, 0), shape=(1, CHUNK, 1, P)), (CHUNK, P))
        bt = ct.reshape(ct.load(B, (b, c, 0, 0), shape=(1, CHUNK, 1, N)), (CHUNK, N))
        dA = ct.reshape(ct.load(dA_cumsum, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
        dt = ct.reshape(ct.load(dt_out, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
        dA_last = ct.extract(dA, (CHUNK - 1,), shape=(1,))          # decay to the chunk's end
        xw = (xt.astype(ct.float32) * (ct.exp2(dA_last - dA) * dt)[:, None]).astype(xt.dtype)
        chunk_state = ct.mma(ct.transpose(xw), bt, ct.zeros((P, N), dtype=ct.float32))
        state = ct.exp2(dA_last) * state + chunk_state
    ct.store(final_states, (b, h, 0, 0), ct.reshape(state, (1, 1, P, N)))


def fwd_pass_state_core_plan(x, B, dt_out, dA_cumsum, states_dtype=torch.float32, poison=False):
    """The launch (an ``ops.runtime.launch.Plan``, outputs allocated) of ``fwd_pass_state_core``."""
    batch, seqlen, nheads, headdim = x.shape
    dstate, chunk_size = B.shape[3], dt_out.shape[3]
    nchunks = check_whole_chunks(seqlen, chunk_size)
    check_one_group(x, B)
    entry_states = new_output((batch, nchunks, nheads, headdim, dstate), states_dtype, x.device,
                              poison)
    final_states = new_output((batch, nheads, headdim, dstate), torch.float32, x.device, poison)
    args = (x, B, dt_out, dA_cumsum, entry_states, final_states, chunk_size, headdim, dstate)
    return Plan((nheads, batch), fwd_pass_state_core_kernel, args, (entry_states, final_states))


def fwd_pass_state_core(x, B, dt_out, dA_cumsum, states_dtype=torch.float32, poison=False):
    """x (b, L, h, p), B (b, L, 1, n), dt_out and dA_cumsum from ``chunk_cumsum_core`` ->
    (entry_states (b, nchunks, h, p, n) in ``states_dtype``, final_states (b, h, p, n) float32)."""
    return run(fwd_pass_state_core_plan(x, B, dt_out, dA_cumsum, states_dtype, poison))
