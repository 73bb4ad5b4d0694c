"""The whole forward pass as three kernel launches.

    (a) chunk_cumsum     dt -> processed dt and the within-chunk cumsum of dt * A (log2 units)
    (b) fwd_pass_state   chunk states and the pass over chunks -> entry states, final state
    (c) compute_out      entry states + the quadratic form inside each chunk -> outputs

The same code runs on both backends: ``ops.launch.launch`` compiles and launches on CUDA
tensors and interprets on CPU tensors. Inputs arrive checked and contiguous from
``ops.ssd_combined.mamba_chunk_scan_combined``.
"""
import math

import torch

from .chunk_cumsum import chunk_cumsum
from .compute_out import compute_out
from .fwd_pass_state import check_sizes, fwd_pass_state

# Tests set this to NaN-fill every output buffer before the kernels write it, so an element a
# kernel misses shows up; left off, the buffers are uninitialised (no extra memory traffic).
POISON_OUTPUTS = False


def kernel_forward(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                   initial_states=None, seq_idx=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf)):
    """-> (out (b, L, h, p) in x's dtype, final_states (b, h, p, n) float32)."""
    check_sizes(headdim=x.shape[3], dstate=B.shape[3])   # before anything runs
    if seq_idx is not None and seq_idx.dtype != torch.int32:
        seq_idx = seq_idx.to(torch.int32)   # ids are small; the kernels compare int32
    dt_out, dA_cumsum = chunk_cumsum(dt, A, chunk_size, dt_bias=dt_bias,
                                     dt_softplus=dt_softplus, dt_limit=dt_limit,
                                     poison=POISON_OUTPUTS)
    # Entry states are stored in x's dtype: compute_out rounds them to C's (== x's) dtype for
    # its product anyway, so 16-bit storage changes nothing but halves the traffic (mamba_ssm
    # does the same). The final state stays float32.
    entry_states, final_states = fwd_pass_state(x, B, dt_out, dA_cumsum,
                                                initial_states=initial_states, seq_idx=seq_idx,
                                                states_dtype=x.dtype, poison=POISON_OUTPUTS)
    out = compute_out(x, B, C, dt_out, dA_cumsum, entry_states, D=D, z=z, seq_idx=seq_idx,
                      poison=POISON_OUTPUTS)
    return out, final_states
