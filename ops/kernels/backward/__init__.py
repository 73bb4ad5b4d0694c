"""The backward kernels, run by ``ops.backward`` in the forward's steps' reverse order:

    bwd_pass_state    the states' gradient, carried from the last chunk to the first
    bwd_compute_out   the token kernel: the gradients of x, B, C, dt and D from the outputs'
    bwd_chunk_states  the chunk states' part of those gradients (fused into the token kernel
                      by default)
    bwd_chunk_cumsum  dt's and A's gradients through the cumulative sum
"""
