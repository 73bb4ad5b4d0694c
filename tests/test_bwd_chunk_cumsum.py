"""ops/bwd_chunk_cumsum.py (through the cumsum and the dt processing) against its specification,
``reference.backward.chunk_cumsum_backward`` in float64.

Tolerance 1e-5 relative in norm: float32 arithmetic (a reverse scan over a chunk, softplus and
sigmoid); observed ~1e-7.
"""
import pytest
import torch

from ops.bwd_chunk_cumsum import bwd_chunk_cumsum, bwd_chunk_cumsum_plan
from reference.backward import chunk_cumsum_backward
from reference.problems import make_problem
from reference.validate import rel_err

from .kernel_helpers import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [
    pytest.param(dict(dt_softplus=True, dt_limit=(0.0, 1.5)), id="softplus-limit"),
    pytest.param(dict(dt_softplus=True, dt_limit=(0.05, 0.5)), id="clamping"),
    pytest.param(dict(), id="plain"),
])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("seqlen, nheads", [(77, 4), (64, 20)], ids=["ragged", "heads-20"])
def test_matches_the_reference(device, options, with_bias, seqlen, nheads):
    kw = make_problem(batch=2, seqlen=seqlen, nheads=nheads, headdim=8, ngroups=1, dstate=16,
                      dtype=torch.float32, seed=9)
    nchunks = -(-seqlen // 16)
    g = torch.Generator().manual_seed(4)
    ddt_out = torch.randn(2, nheads, nchunks, 16, generator=g)
    ddA = torch.randn(2, nheads, nchunks, 16, generator=g)
    bias = kw["dt_bias"] if with_bias else None
    f64 = lambda t: None if t is None else t.double()
    want = chunk_cumsum_backward(ddt_out.double(), ddA.double(), kw["dt"].double(), kw["A"].double(),
                                 16, f64(bias), **options)
    to = lambda t: None if t is None else t.to(device)
    got = bwd_chunk_cumsum(to(ddt_out), to(ddA), to(kw["dt"]), to(kw["A"]), to(bias), poison=True,
                           **options)
    for name, g_, w in zip(("ddt", "dA", "ddt_bias"), got, want, strict=True):
        if w is None:
            assert g_ is None
        else:
            assert g_.dtype == torch.float32 and rel_err(g_.cpu(), w) < 1e-5, name


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_compiles(arch):
    from ops.tools.aot import compile_cubin
    meta = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device="meta")
    plan = bwd_chunk_cumsum_plan(meta(1, 80, 64, 256), meta(1, 80, 64, 256),
                                 meta(1, 16384, 80, dt=torch.bfloat16), meta(80), meta(80),
                                 dt_softplus=True)
    assert compile_cubin(plan.kernel, plan.args, arch)[:4] == b"\x7fELF"
