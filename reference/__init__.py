"""Pure-PyTorch reference stages of the Mamba-2 SSD forward pass (any device, float64-capable).

    sequential.ssd_sequential   stage 0: the token-by-token recurrence (ground truth)
    quadratic.ssd_quadratic     the quadratic dual form y = (M o C B^T)(dt x)
    chunked.ssd_chunked         the chunked matmul formulation, in the steps the kernels implement
    backward.ssd_chunked_backward   its backward pass, step by step (the reverse pass over chunks)
"""
from .chunked import ssd_chunked
from .quadratic import ssd_quadratic
from .sequential import ssd_sequential

__all__ = ["ssd_sequential", "ssd_quadratic", "ssd_chunked"]
