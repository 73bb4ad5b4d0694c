"""Random test problems in mamba_ssm's shapes, shared by the tests and the notebooks."""
import torch


def packed_seq_idx(batch, seqlen, boundaries, device="cpu"):
    """seq_idx (batch, seqlen) with a new sequence starting at each position in ``boundaries``."""
    seq = torch.zeros(batch, seqlen, dtype=torch.int32, device=device)
    for start in boundaries:
        seq[:, start:] += 1
    return seq


def make_problem(batch=2, seqlen=77, nheads=4, headdim=8, ngroups=2, dstate=16, dtype=torch.float64,
                 seed=0, D="1d", z=True, dt_bias=True, initial_states=True, seq_boundaries=None,
                 device="cpu"):
    """Fresh random inputs (never zeros) in mamba_ssm's shapes, as a dict of keyword arguments.

    dt is drawn around 0 so that softplus, the clamp and negative steps all matter; A in
    [-2.1, -0.1] so the state decays noticeably within a few dozen tokens but not to nothing.
    """
    g = torch.Generator().manual_seed(seed)
    f = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    kw = dict(
        x=f(batch, seqlen, nheads, headdim).to(dtype),
        dt=(f(batch, seqlen, nheads) * 0.5 - 0.5),
        A=-(torch.rand(nheads, generator=g, dtype=torch.float64) * 2 + 0.1),
        B=f(batch, seqlen, ngroups, dstate).to(dtype),
        C=f(batch, seqlen, ngroups, dstate).to(dtype),
    )
    if D == "1d":
        kw["D"] = f(nheads)
    elif D == "2d":
        kw["D"] = f(nheads, headdim)
    if z:
        kw["z"] = f(batch, seqlen, nheads, headdim).to(dtype)
    if dt_bias:
        kw["dt_bias"] = f(nheads) * 0.5
    if initial_states:
        kw["initial_states"] = f(batch, nheads, headdim, dstate)
    if seq_boundaries is not None:
        kw["seq_idx"] = packed_seq_idx(batch, seqlen, seq_boundaries)
    if dtype != torch.float64:      # 16/32-bit problems keep the small tensors in float32
        for k in ("dt", "A", "D", "dt_bias", "initial_states"):
            if k in kw:
                kw[k] = kw[k].float()
    return {k: v.to(device) for k, v in kw.items()}
