"""The core kernels (``ops/core/``: every option off), each against its reference step and all
three against the chunked reference; compiled for sm_80/90/100.

As for the production kernels (``tests/kernels/helpers.py``), each kernel is fed the reference's
own upstream values rounded to the kernel's units (float32, dA_cumsum in log2 units), so only its
own rounding is measured, every output is NaN-poisoned first, and the tolerances are
``kernel_helpers.TOL``'s: float32 throughout for float32 inputs (bound 2e-5, against a few ulps
per operation); 16-bit tensor-core operands for bf16 / fp16 inputs (bounds 1e-2 / 2e-3, half of
that for the float32 states). The problems have what the core kernels take: positive (already
processed) dt, whole chunks, one group, no D, z, seq_idx or initial state.
"""
import pytest
import torch
import torch.nn.functional as F

from ops.core import core_forward
from ops.core.chunk_cumsum import chunk_cumsum_core, chunk_cumsum_core_plan
from ops.core.compute_out import compute_out_core, compute_out_core_plan
from ops.core.fwd_pass_state import fwd_pass_state_core, fwd_pass_state_core_plan
from ops.tools.aot import ARCHS, compile_cubin
from reference import chunked
from reference.common import LOG2E
from reference.problems import make_problem
from reference.validate import rel_err
from tests.kernels.helpers import DEVICES, DTYPES, TOL, meta, synced, to_device

CORE = dict(D=None, z=False, dt_bias=False, initial_states=False, ngroups=1)
CASES = [
    pytest.param(dict(batch=2, seqlen=128, nheads=4, headdim=16, dstate=32), 32, id="chunk32"),
    pytest.param(dict(batch=1, seqlen=128, nheads=2, headdim=32, dstate=64), 64, id="chunk64-n64"),
    pytest.param(dict(batch=1, seqlen=16, nheads=8, headdim=16, dstate=16), 16, id="one-chunk-h8"),
]


def core_problem(sizes, dtype, seed):
    """A problem the core kernels take, and reference (a) in float64 from its positive dt."""
    kw = make_problem(**sizes, **CORE, dtype=dtype, seed=seed)
    kw["dt"] = F.softplus(kw["dt"])                     # processed steps: positive
    return kw


def upstream_on(device, sizes, chunk_size, dtype, seed):
    """A core problem on ``device``, with reference (a) rounded to the kernels' units (float32,
    log2) on ``device``, and reference (b) computed from those in float64 (on the CPU)."""
    kw = core_problem(sizes, dtype, seed)
    dt_ref, dA_ref = chunked.chunk_cumsum(kw["dt"].double(), kw["A"].double(), chunk_size)
    dt_k, dA_k = dt_ref.float(), (dA_ref * LOG2E).float()
    entry, final = chunked.fwd_pass_state(kw["x"].double(), kw["B"].double(), dt_k.double(),
                                          dA_k.double() / LOG2E)
    return to_device(kw, device), dt_k, dA_k, entry, final


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes, chunk_size", CASES)
def test_chunk_cumsum_core(device, sizes, chunk_size):
    kw = core_problem(sizes, torch.float32, seed=21)
    ref_dt, ref_dA = chunked.chunk_cumsum(kw["dt"].double(), kw["A"].double(), chunk_size)
    kw = to_device(kw, device)
    dt_out, dA = synced(chunk_cumsum_core, kw["dt"], kw["A"], chunk_size, poison=True)
    assert dt_out.shape == dA.shape == ref_dt.shape and dA.dtype == torch.float32
    assert rel_err(dt_out, ref_dt) < 1e-6
    assert rel_err(dA, ref_dA * LOG2E) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes, chunk_size", CASES)
def test_fwd_pass_state_core(device, dtype, sizes, chunk_size):
    kw, dt_k, dA_k, ref_entry, ref_final = upstream_on(device, sizes, chunk_size, dtype, seed=22)
    entry, final = synced(fwd_pass_state_core, kw["x"], kw["B"], dt_k.to(device),
                          dA_k.to(device), poison=True)
    assert entry.shape == ref_entry.shape and final.shape == ref_final.shape
    assert rel_err(entry, ref_entry) < TOL[dtype] / 2
    assert rel_err(final, ref_final) < TOL[dtype] / 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes, chunk_size", CASES)
def test_compute_out_core(device, dtype, sizes, chunk_size):
    kw, dt_k, dA_k, entry, _ = upstream_on(device, sizes, chunk_size, dtype, seed=23)
    entry_k = entry.float()
    ref = chunked.compute_out(*(kw[k].double().cpu() for k in ("x", "B", "C")), dt_k.double(),
                              dA_k.double() / LOG2E, entry_k.double())
    out = synced(compute_out_core, kw["x"], kw["B"], kw["C"], dt_k.to(device), dA_k.to(device),
                 entry_k.to(device), poison=True)
    assert out.shape == kw["x"].shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes, chunk_size", CASES)
def test_core_forward_against_the_chunked_reference(device, dtype, sizes, chunk_size):
    kw = core_problem(sizes, dtype, seed=24)
    ref_out, ref_final = chunked.ssd_chunked(*(kw[k].double() for k in ("x", "dt", "A", "B", "C")),
                                             chunk_size, return_final_states=True)
    kw = to_device(kw, device)
    out, final = synced(core_forward, kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], chunk_size,
                        poison=True)
    assert out.dtype == dtype and final.dtype == torch.float32
    assert rel_err(out, ref_out) < TOL[dtype]
    assert rel_err(final, ref_final) < TOL[dtype] / 2


@pytest.mark.parametrize("bad, message", [
    (dict(seqlen=100), "seqlen \\(100\\) must be a multiple of chunk_size \\(32\\)"),
    (dict(ngroups=2), "one group"),
    (dict(headdim=24), "headdim must be a power of two"),
])
def test_what_the_core_kernels_leave_out_is_refused(bad, message):
    sizes = {**dict(batch=1, seqlen=64, nheads=2, headdim=16, dstate=16), **CORE, **bad}
    kw = make_problem(**sizes, dtype=torch.float32, seed=25)
    with pytest.raises(ValueError, match=message):
        core_forward(kw["x"], F.softplus(kw["dt"]), kw["A"], kw["B"], kw["C"], 32)


def core_plans(dtype, chunk, headdim, dstate):
    """The three core launches on meta tensors (batch 2, 8 chunks, 8 heads)."""
    b, h, L = 2, 8, 8 * chunk
    x = meta(b, L, h, headdim, dtype=dtype)
    B = meta(b, L, 1, dstate, dtype=dtype)
    dt_out, dA = meta(b, h, L // chunk, chunk), meta(b, h, L // chunk, chunk)
    states = meta(b, L // chunk, h, headdim, dstate, dtype=dtype)
    return {"chunk_cumsum": chunk_cumsum_core_plan(meta(b, L, h), meta(h), chunk),
            "fwd_pass_state": fwd_pass_state_core_plan(x, B, dt_out, dA, dtype),
            "compute_out": compute_out_core_plan(x, B, B, dt_out, dA, states)}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype, chunk, headdim, dstate", [
    pytest.param(torch.bfloat16, 64, 64, 128, id="bf16-chunk64-p64-n128"),
    pytest.param(torch.float32, 32, 32, 64, id="fp32-chunk32-p32-n64"),
])
def test_core_kernels_compile(dtype, chunk, headdim, dstate, arch):
    for name, plan in core_plans(dtype, chunk, headdim, dstate).items():
        assert compile_cubin(plan.kernel, plan.args, arch)[:4] == b"\x7fELF", name
