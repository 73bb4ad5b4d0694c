"""What the core kernels leave out, refused with a clear error before anything launches."""
from ..checks import check_chunk_size, check_tile_sizes


def check_whole_chunks(seqlen, chunk_size):
    """The sequence is a whole number of chunks (no partial last chunk); returns nchunks."""
    check_chunk_size(chunk_size)
    if seqlen % chunk_size:
        raise ValueError(f"the core kernels take whole chunks: seqlen ({seqlen}) must be a "
                         f"multiple of chunk_size ({chunk_size}); ops.kernels.chunk_cumsum etc. take any")
    return seqlen // chunk_size


def check_one_group(x, B):
    """One group of B and C for all heads, and tile-sized headdim and dstate."""
    if B.shape[2] != 1:
        raise ValueError(f"the core kernels take one group (B.shape[2] == 1), got {B.shape[2]}; "
                         f"ops.kernels.fwd_pass_state and ops.kernels.compute_out take any")
    check_tile_sizes(x.shape[3], B.shape[3])
