"""A minimal Mamba-2 mixer on ``torch.nn``, with the SSD scan as a pluggable function.

    mixer = Mamba2Mixer(d_model=768, d_state=128, headdim=64)            # this project's scan
    mixer = Mamba2Mixer(768, scan=mamba_ssm_scan)                       # any function with
                                                                          # mamba_ssm's signature
    y = mixer(u)                                                          # u (batch, L, d_model)

The layer of a Mamba-2 block, as the Mamba-2 paper describes it:

  1. one input projection gives, per token, the gate z, the SSM input x, B and C, and dt;
  2. x, B and C pass through a causal depthwise convolution (kernel ``d_conv``) and SiLU;
  3. the SSD scan: y = SSM(x, dt, A, B, C) + D * x, with dt + dt_bias through softplus and
     A = -exp(A_log) per head;
  4. a gated RMS norm, rmsnorm(y * silu(z)) * weight over each group's channels, and the
     output projection.

Only the scan runs in cuTile; the rest is PyTorch. The convolution does not reset between
sequences packed in one row, so the mixer takes whole rows (no ``seq_idx``). Parameters are
initialised as Mamba-2's reference code does in spirit (dt in [dt_min, dt_max] log-uniformly
through its inverse softplus, A in [1, 16]), from the module's own generator if one is given.

Context parallelism: given a ``process_group``, every rank of it runs the layer on its own
contiguous slice of the sequence (rank order is sequence order) and gets its slice of the
output. Only two steps look past a token's own position: the convolution, which reads the
``d_conv - 1`` inputs before each token (for a slice's first tokens they live on the previous
rank: ``ops.context_parallel.previous_tokens`` fetches them), and the scan
(``ops.context_parallel.context_parallel_chunk_scan``). The projections and the norm are per
token. The parameters' gradients are each rank's share: sum them over the group (an
all-reduce, as data parallelism does over its own).
"""
import math

import torch
from torch import nn
from torch.nn import functional as F

from .context_parallel import context_parallel_chunk_scan, previous_tokens
from .ssd_combined import mamba_chunk_scan_combined


class GatedRMSNorm(nn.Module):
    """rmsnorm(y * silu(z)) * weight, computed in float32, normalised over each group of
    ``width // groups`` channels (Mamba-2 normalises each group of heads apart)."""

    def __init__(self, width, groups=1, eps=1e-5, **factory):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(width, **factory))

    def forward(self, y, z):
        v = y.float() * F.silu(z.float())
        v = v.unflatten(-1, (self.groups, -1))
        v = (v * torch.rsqrt(v.square().mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (v * self.weight.float()).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """The Mamba-2 layer; ``process_group`` (a ``torch.distributed`` group, e.g.
    ``torch.distributed.group.WORLD``) makes it context parallel over that group's ranks, each
    passing its slice of the sequence; None (the default): one process, whole rows."""

    def __init__(self, d_model, d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1,
                 chunk_size=256, dt_min=0.001, dt_max=0.1, dt_limit=(0.0, float("inf")),
                 scan=None, backend="auto", generator=None, device=None, dtype=None,
                 process_group=None):
        super().__init__()
        if process_group is not None and scan is not None:
            raise ValueError("process_group runs this project's scan context parallel; it cannot "
                             "split a scan given as scan= (pass one or the other)")
        self.process_group = process_group
        factory = dict(device=device, dtype=dtype)
        self.d_inner = expand * d_model
        if self.d_inner % headdim:
            raise ValueError(f"expand * d_model ({self.d_inner}) must be a multiple of headdim ({headdim})")
        self.nheads, self.headdim, self.ngroups, self.d_state = self.d_inner // headdim, headdim, ngroups, d_state
        if self.nheads % ngroups:
            raise ValueError(f"ngroups ({ngroups}) must divide the number of heads ({self.nheads})")
        self.chunk_size, self.dt_limit, self.backend = chunk_size, dt_limit, backend
        self.scan = scan or mamba_chunk_scan_combined
        conv_dim = self.d_inner + 2 * ngroups * d_state
        self.in_proj = nn.Linear(d_model, self.d_inner + conv_dim + self.nheads, bias=False, **factory)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1,
                                **factory)
        # dt_bias = softplus^-1(dt) with dt log-uniform in [dt_min, dt_max]; A in [1, 16].
        g = generator
        dt = torch.exp(torch.rand(self.nheads, generator=g) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter((dt + torch.log(-torch.expm1(-dt))).to(device))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.nheads).uniform_(1, 16, generator=g)).to(device))
        self.D = nn.Parameter(torch.ones(self.nheads, device=device))
        self.norm = GatedRMSNorm(self.d_inner, groups=ngroups, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False, **factory)
        if generator is not None:            # the linear and conv weights from the same generator
            for w in (self.in_proj.weight, self.conv1d.weight, self.out_proj.weight):
                bound = 1 / math.sqrt(w[0].numel())
                with torch.no_grad():
                    w.copy_(torch.empty(w.shape).uniform_(-bound, bound, generator=g))
            with torch.no_grad():
                self.conv1d.bias.copy_(torch.empty(conv_dim).uniform_(-0.1, 0.1, generator=g))

    def forward(self, u):
        """u (batch, L, d_model) -> (batch, L, d_model); with a process_group, L is this rank's
        slice of the sequence (every rank of the group calls it, and runs the backward)."""
        b, L, _ = u.shape
        gs = self.ngroups * self.d_state
        z, xBC, dt = torch.split(self.in_proj(u), [self.d_inner, self.d_inner + 2 * gs, self.nheads],
                                 dim=-1)
        if self.process_group is None:
            xBC = self.conv1d(xBC.transpose(1, 2))[..., :L]
        else:
            # the same causal convolution, its left padding replaced by the tokens before the slice
            before = previous_tokens(xBC, self.conv1d.kernel_size[0] - 1, self.process_group)
            xBC = F.conv1d(torch.cat([before, xBC], dim=1).transpose(1, 2), self.conv1d.weight,
                           self.conv1d.bias, groups=self.conv1d.groups)
        xBC = F.silu(xBC.transpose(1, 2))
        x, B, C = torch.split(xBC, [self.d_inner, gs, gs], dim=-1)
        A = -torch.exp(self.A_log.float())
        if self.process_group is None:
            scan, options = self.scan, ({"backend": self.backend}
                                        if self.scan is mamba_chunk_scan_combined else {})
        else:
            scan, options = context_parallel_chunk_scan, dict(backend=self.backend,
                                                              process_group=self.process_group)
        y = scan(x.reshape(b, L, self.nheads, self.headdim), dt, A,
                 B.reshape(b, L, self.ngroups, self.d_state),
                 C.reshape(b, L, self.ngroups, self.d_state), self.chunk_size, D=self.D,
                 dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit, **options)
        return self.out_proj(self.norm(y.reshape(b, L, self.d_inner), z))
