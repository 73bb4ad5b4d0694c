"""Small pieces shared by every reference stage.

Shapes follow mamba_ssm's ``mamba_chunk_scan_combined``::

    x  (batch, seqlen, nheads, headdim)      dt (batch, seqlen, nheads)
    A  (nheads,)                             B, C (batch, seqlen, ngroups, dstate)

Heads are split evenly among groups: head ``i`` reads group ``i // (nheads // ngroups)``.
"""
import math

import torch

LOG2E = 1.4426950408889634  # log2(e): exp(v) == exp2(v * LOG2E)


def compute_dtype(*tensors):
    """float64 if any input is float64, else float32: the references never compute in 16 bits."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """The step size each token actually uses, exactly as mamba_ssm computes it.

    ``dt + dt_bias``, then softplus where that sum is at most 20 (above it softplus(v) == v to
    float precision, and skipping it avoids exp overflow), then always a clamp to ``dt_limit``.
    The default limit (0, inf) therefore turns negative steps into 0 when softplus is off.
    """
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = torch.where(dt <= 20.0, torch.nn.functional.softplus(dt), dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def expand_groups(BC, nheads):
    """(b, L, g, n) -> (b, L, h, n): give every head its group's B or C."""
    ngroups = BC.shape[2]
    return BC.repeat_interleave(nheads // ngroups, dim=2)


def apply_skip_and_gate(y, x, D=None, z=None):
    """y + D*x, then the SiLU gate ``* z * sigmoid(z)``; every tensor is (b, L, h, p)."""
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * torch.nn.functional.silu(z)
    return y
