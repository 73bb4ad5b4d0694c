"""ops/bwd_chunk_states.py (the gradients of each chunk's own state) against its specification,
``reference.backward.chunk_states_backward`` in float64.

Tolerances, relative in norm: float32 inputs 1e-5 (float32 products over a chunk; observed
~1e-7); bfloat16 inputs 1e-2 (dS is rounded to bf16 as a tensor-core operand, 8 bits, as the
forward's products round theirs).
"""
import pytest
import torch

from ops.bwd_chunk_states import bwd_chunk_states, bwd_chunk_states_plan
from reference import chunked
from reference.backward import chunk_states_backward
from reference.common import LOG2E
from reference.problems import make_problem
from reference.validate import rel_err

from .kernel_helpers import DEVICES

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-5}


def problem(dtype, headdim=16, dstate=32, seq=True, seqlen=77):
    kw = make_problem(batch=2, seqlen=seqlen, nheads=4, headdim=headdim, ngroups=2, dstate=dstate,
                      dtype=dtype, seed=8, seq_boundaries=[16, 37] if seq else None)
    dt_out, dA = chunked.chunk_cumsum(kw["dt"], kw["A"], 16, kw["dt_bias"], True, (0.0, 1.5))
    nchunks = dt_out.shape[2]
    dS = torch.randn(2, nchunks, 4, headdim, dstate, generator=torch.Generator().manual_seed(2))
    return kw, dt_out.float(), dA.float(), dS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", [pytest.param(dict(), id="packed-ragged"),
                                  pytest.param(dict(seq=False, seqlen=64), id="whole-chunks"),
                                  pytest.param(dict(headdim=48, dstate=40), id="odd-sizes")])
def test_matches_the_reference(device, dtype, case):
    kw, dt_out, dA, dS = problem(dtype, **case)
    if dtype == torch.float16:
        dS = dS * 1e5                                   # as under loss scaling
    f64 = lambda t: None if t is None else (t.double() if t.is_floating_point() else t)
    want = chunk_states_backward(dS.double(), f64(kw["x"]), f64(kw["B"]), dt_out.double(),
                                 dA.double(), kw.get("seq_idx"))
    to = lambda t: None if t is None else t.to(device)
    got = bwd_chunk_states(to(dS), to(kw["x"]), to(kw["B"]), to(dt_out), to(dA * LOG2E),
                           to(kw.get("seq_idx")), poison=True)
    for name, g, w in zip(("dx", "dB", "ddt_out", "ddA"), got, want, strict=True):
        assert g.dtype == torch.float32 and rel_err(g.cpu(), w) < TOL[dtype], name


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_compiles(arch):
    from ops.tools.aot import compile_cubin
    meta = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device="meta")
    plan = bwd_chunk_states_plan(meta(1, 64, 80, 64, 128), meta(1, 16384, 80, 64, dt=torch.bfloat16),
                                 meta(1, 16384, 1, 128, dt=torch.bfloat16), meta(1, 80, 64, 256),
                                 meta(1, 80, 64, 256), meta(1, 16384, dt=torch.int32))
    assert compile_cubin(plan.kernel, plan.args, arch)[:4] == b"\x7fELF"
