"""The three kernels with every option off: the first versions to read and write.

Each is the production kernel of ``ops/`` cut down to its idea: no dt processing, no ``seq_idx``,
``D``, ``z`` or initial state, whole chunks (the sequence a multiple of the chunk), one group
of B and C, one block per chunk (or per head), 32-bit indices, no tuning knobs. They compute
the same intermediates in the same layouts as ``ops.kernels.chunk_cumsum``, ``ops.kernels.fwd_pass_state`` and
``ops.kernels.compute_out``, so each can be checked against ``reference.chunked`` and against the
production kernel, and each body fits on a screen:

    chunk_cumsum     dt -> dt_out, dA_cumsum (log2 units)       one block per (chunk, heads)
    fwd_pass_state   -> entry states, final state              one block per (head, batch)
    compute_out      -> outputs                                one block per (chunk, head)

``core_forward`` chains them. They run on CPU tensors through the interpreter and on a GPU.
"""
from .chunk_cumsum import chunk_cumsum_core
from .compute_out import compute_out_core
from .fwd_pass_state import fwd_pass_state_core
from .forward import core_forward

__all__ = ["chunk_cumsum_core", "fwd_pass_state_core", "compute_out_core", "core_forward"]
