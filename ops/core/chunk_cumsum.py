"""Kernel (a) with every option off: the within-chunk cumulative sum of dt * A.

One block takes one chunk of BLOCK_H heads. ``dt`` is stored (batch, seqlen, nheads); the load
views it through ``order=(0, 2, 1)`` as (batch, nheads, seqlen), so the tile arrives as
(BLOCK_H, CHUNK): one row per head, tokens along the row, ready for ``ct.cumsum`` along axis 1.
The sum is kept in log2 units (``A * log2(e)``), so that the later kernels decay with ``exp2``.
"""
import torch

import cuda.tile as ct

from ops.runtime.launch import Plan, run
from ops.kernels.common import LOG2E, ConstInt, new_output
from .checks import check_whole_chunks


@ct.kernel
def chunk_cumsum_core_kernel(dt, A, dt_out, dA_cumsum, CHUNK: ConstInt, BLOCK_H: ConstInt):
    c, hb, b = ct.bid(0), ct.bid(1), ct.bid(2)          # chunk, block of heads, batch element
    # A (1, BLOCK_H, CHUNK) tile of dt seen as (batch, nheads, seqlen); tiles keep the array's rank.
    dtv = ct.load(dt, (b, hb, c), shape=(1, BLOCK_H, CHUNK), order=(0, 2, 1))
    dtv = ct.reshape(dtv, (BLOCK_H, CHUNK)).astype(ct.float32)
    a = ct.load(A, (hb,), shape=(BLOCK_H,)).astype(ct.float32) * LOG2E
    dA = ct.cumsum(dtv * a[:, None], axis=1)            # running sum along each head's tokens
    # Both outputs are (batch, nheads, nchunks, CHUNK): each head's chunk is one contiguous run.
    ct.store(dt_out, (b, hb, c, 0), ct.reshape(dtv, (1, BLOCK_H, 1, CHUNK)))
    ct.store(dA_cumsum, (b, hb, c, 0), ct.reshape(dA, (1, BLOCK_H, 1, CHUNK)))


def chunk_cumsum_core_plan(dt, A, chunk_size, block_h=None, poison=False):
    """The launch (an ``ops.runtime.launch.Plan``, outputs allocated) of ``chunk_cumsum_core``."""
    batch, seqlen, nheads = dt.shape
    nchunks = check_whole_chunks(seqlen, chunk_size)
    if block_h is None:
        block_h = next(bh for bh in (16, 8, 4, 2, 1) if nheads % bh == 0)
    if nheads % block_h:
        raise ValueError(f"block_h ({block_h}) must divide nheads ({nheads})")
    shape = (batch, nheads, nchunks, chunk_size)
    dt_out = new_output(shape, torch.float32, dt.device, poison)
    dA_cumsum = new_output(shape, torch.float32, dt.device, poison)
    grid = (nchunks, nheads // block_h, batch)
    args = (dt, A, dt_out, dA_cumsum, chunk_size, block_h)
    return Plan(grid, chunk_cumsum_core_kernel, args, (dt_out, dA_cumsum))


def chunk_cumsum_core(dt, A, chunk_size, block_h=None, poison=False):
    """dt (b, L, h) (already processed: positive steps), A (h,) -> (dt_out, dA_cumsum), float32
    (b, h, L / chunk_size, chunk_size), dA_cumsum in log2 units. L must be a multiple of
    chunk_size and h of ``block_h`` (default: the largest power of two <= 16 dividing h).
    ``poison=True`` NaN-fills the outputs first (for tests)."""
    return run(chunk_cumsum_core_plan(dt, A, chunk_size, block_h, poison))
