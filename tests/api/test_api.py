"""The public entry point: numerics per dtype, the backends' contract, and bad-input errors."""
import pytest
import torch

from ops import mamba_chunk_scan_combined
from reference.sequential import ssd_sequential
from reference.problems import make_problem
from reference.validate import rel_err

# Tolerances for ||out - ref|| / ||ref|| against a float64 recurrence fed the SAME (already
# rounded) inputs, so only the computation's own rounding counts. The reference backend
# computes in float32; a 16-bit output is then rounded once more: bf16 keeps 8 significant
# bits (relative step 2^-8 = 3.9e-3, ~1e-3 in norm), fp16 keeps 11 (2^-11 = 4.9e-4).
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
OPTIONS = dict(dt_softplus=True, dt_limit=(0.0, 1.5))


def _upcast(kw):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in kw.items()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("problem", [
    pytest.param(dict(), id="all-options-ragged"),
    pytest.param(dict(seq_boundaries=[5, 32, 60], D="2d"), id="packed-D2d"),
    pytest.param(dict(seqlen=3, ngroups=1), id="L3"),
])
def test_reference_backend_matches_recurrence(dtype, problem):
    kw = make_problem(dtype=dtype, **problem)
    out, final = mamba_chunk_scan_combined(**kw, chunk_size=16, **OPTIONS, return_final_states=True,
                                           backend="reference")
    assert out.dtype == dtype and out.shape == kw["x"].shape
    assert final.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    y0, h0 = ssd_sequential(**_upcast(kw), **OPTIONS, return_final_states=True)
    assert rel_err(out, y0) < TOL[dtype]
    assert rel_err(final, h0) < TOL[torch.float32 if dtype != torch.float64 else dtype]


def test_return_forms_and_auto_backend_on_cpu():
    kw = make_problem(dtype=torch.float32)
    out = mamba_chunk_scan_combined(**kw, chunk_size=32)
    assert isinstance(out, torch.Tensor)
    out2, final = mamba_chunk_scan_combined(**kw, chunk_size=32, return_final_states=True)
    assert torch.equal(out, out2) and final.shape == kw["initial_states"].shape


def test_non_contiguous_inputs_are_handled():
    kw = make_problem(dtype=torch.float32, seed=5)
    ref = mamba_chunk_scan_combined(**kw, chunk_size=16)
    # Same values, transposed storage: (b, h, L, p) memory viewed as (b, L, h, p).
    strided = dict(kw)
    strided["x"] = kw["x"].transpose(1, 2).contiguous().transpose(1, 2)
    strided["B"] = kw["B"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided["x"].is_contiguous()
    assert torch.equal(mamba_chunk_scan_combined(**strided, chunk_size=16), ref)


def test_backend_errors():
    kw = make_problem(dtype=torch.float32)
    with pytest.raises(ValueError, match="backend must be one of"):
        mamba_chunk_scan_combined(**kw, chunk_size=16, backend="triton")
    with pytest.raises(ValueError, match="backend='cutile' needs CUDA tensors"):
        mamba_chunk_scan_combined(**kw, chunk_size=16, backend="cutile")
    with pytest.raises(TypeError, match="float64 works with backend='reference'"):
        mamba_chunk_scan_combined(**make_problem(), chunk_size=16, backend="interpret")


def _bad(**changes):
    kw = make_problem(dtype=torch.float32, batch=2, seqlen=20, nheads=4, headdim=8, ngroups=2, dstate=16)
    kw.update(changes)
    kw.setdefault("chunk_size", 16)
    return kw


g = torch.Generator().manual_seed(1)
r = lambda *s, dtype=torch.float32: torch.randn(*s, generator=g).to(dtype)

BAD = [
    pytest.param(dict(x=r(2, 20, 4)), ValueError, r"x must have shape \(batch, seqlen, nheads, headdim\)", id="x-rank"),
    pytest.param(dict(x=r(2, 20, 4, 8).to(torch.int32)), TypeError, "x must be a floating tensor", id="x-int"),
    pytest.param(dict(x=[1.0]), TypeError, "x must be a torch.Tensor", id="x-not-tensor"),
    pytest.param(dict(dt=r(2, 20, 3)), ValueError, r"dt must have shape \(2, 20, 4\)", id="dt-shape"),
    pytest.param(dict(A=r(4, 1)), ValueError, r"A must have shape \(4,\)", id="A-shape"),
    pytest.param(dict(B=r(2, 20, 3, 16), C=r(2, 20, 3, 16)), ValueError, "ngroups .3.* must divide nheads .4", id="groups"),
    pytest.param(dict(B=r(2, 19, 2, 16)), ValueError, r"B must have shape \(2, 20, ngroups, dstate\)", id="B-seqlen"),
    pytest.param(dict(C=r(2, 20, 2, 8)), ValueError, "C must have shape", id="C-shape"),
    pytest.param(dict(C=r(2, 20, 2, 16, dtype=torch.bfloat16)), TypeError, "B and C must have the same dtype", id="BC-dtype"),
    pytest.param(dict(B=r(2, 20, 2, 16, dtype=torch.float16), C=r(2, 20, 2, 16, dtype=torch.float16)), TypeError,
                 "must have x's dtype", id="BC-vs-x-dtype"),
    pytest.param(dict(chunk_size=48), ValueError, "chunk_size must be a power of two in", id="chunk-not-pow2"),
    pytest.param(dict(chunk_size=512), ValueError, "chunk_size must be a power of two in", id="chunk-too-big"),
    pytest.param(dict(chunk_size=8), ValueError, "chunk_size must be a power of two in", id="chunk-too-small"),
    pytest.param(dict(chunk_size=64.0), TypeError, "chunk_size must be an int", id="chunk-float"),
    pytest.param(dict(D=r(4, 7)), ValueError, r"D must have shape \(4,\) or \(4, 8\)", id="D-shape"),
    pytest.param(dict(z=r(2, 20, 4, 7)), ValueError, "z must have shape", id="z-shape"),
    pytest.param(dict(z=r(2, 20, 4, 8, dtype=torch.bfloat16)), TypeError, "z must have x's dtype", id="z-dtype"),
    pytest.param(dict(dt_bias=r(5)), ValueError, r"dt_bias must have shape \(4,\)", id="dt_bias-shape"),
    pytest.param(dict(initial_states=r(2, 4, 8, 15)), ValueError, r"initial_states must have shape \(2, 4, 8, 16\)", id="init-shape"),
    pytest.param(dict(seq_idx=r(2, 20)), TypeError, "seq_idx must be an integer tensor", id="seq-float"),
    pytest.param(dict(seq_idx=torch.zeros(2, 19, dtype=torch.int32)), ValueError, r"seq_idx must have shape \(2, 20\)", id="seq-shape"),
    pytest.param(dict(seq_idx=torch.tensor([[0] * 10 + [1] * 10, [1] * 10 + [0] * 10], dtype=torch.int32)), ValueError,
                 "non-decreasing", id="seq-decreasing"),
    pytest.param(dict(seq_idx=torch.full((2, 20), -1, dtype=torch.int32)), ValueError, "non-negative", id="seq-negative"),
    pytest.param(dict(dt_limit=(1.0, 0.5)), ValueError, "dt_limit must satisfy min <= max", id="dt_limit-order"),
    pytest.param(dict(dt_limit=(0.0, float("nan"))), ValueError, "no NaN", id="dt_limit-nan"),
    pytest.param(dict(dt_limit=0.5), TypeError, "dt_limit must be a pair", id="dt_limit-scalar"),
]


@pytest.mark.parametrize("changes, exc, message", BAD)
def test_bad_input_raises_naming_the_argument(changes, exc, message):
    with pytest.raises(exc, match=message):
        mamba_chunk_scan_combined(**_bad(**changes))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_mixed_devices_raise():
    kw = _bad()
    kw["dt"] = kw["dt"].cuda()
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        mamba_chunk_scan_combined(**kw)


def test_mixed_devices_raise_on_meta():
    """The device check works without a GPU too: a 'meta' tensor is on another device."""
    kw = _bad()
    kw["A"] = kw["A"].to("meta")
    with pytest.raises(ValueError, match="A on meta"):
        mamba_chunk_scan_combined(**kw)


def test_kernel_backends_reject_sizes_out_of_range():
    """Any headdim in [1, 256] and dstate in [1, 512] runs (tests/api/test_drop_in.py); beyond, the
    kernel backends refuse, naming the size, and "auto" falls back to the reference."""
    kw = make_problem(dtype=torch.float32, headdim=260, dstate=16, seqlen=20)
    with pytest.raises(ValueError, match=r"headdim \(x.shape\[3\]\) must be an integer in \[1, 256\], got 260"):
        mamba_chunk_scan_combined(**kw, chunk_size=16, backend="interpret")
    out = mamba_chunk_scan_combined(**kw, chunk_size=16)
    assert out.shape == kw["x"].shape and torch.isfinite(out).all()
    kw = make_problem(dtype=torch.float32, headdim=16, dstate=520, seqlen=20)
    with pytest.raises(ValueError, match=r"dstate \(B.shape\[3\]\) must be an integer in \[1, 512\], got 520"):
        mamba_chunk_scan_combined(**kw, chunk_size=16, backend="interpret")


def test_interpret_backend_matches_reference_backend():
    kw = make_problem(dtype=torch.float32, headdim=16, seq_boundaries=[30], D="2d", seed=2)
    a, fa = mamba_chunk_scan_combined(**kw, chunk_size=32, **OPTIONS, return_final_states=True, backend="interpret")
    b, fb = mamba_chunk_scan_combined(**kw, chunk_size=32, **OPTIONS, return_final_states=True, backend="reference")
    assert rel_err(a, b) < TOL[torch.float32] and rel_err(fa, fb) < TOL[torch.float32]


def test_reference_backend_needs_no_cuda_tile():
    """Without cuda-tile the reference backend (and "auto", which falls back to it) still runs:
    the input checks need no cuda.tile (ops.checks), only the kernel backends do."""
    import subprocess
    import sys
    code = """
import sys
sys.modules["cuda.tile"] = None          # importing cuda.tile now raises ImportError
import torch
from ops import mamba_chunk_scan_combined
from reference.problems import make_problem
kw = make_problem(batch=1, seqlen=20, nheads=2, headdim=4, ngroups=1, dstate=8, seed=3)
for backend in ("reference", "auto"):
    out = mamba_chunk_scan_combined(chunk_size=16, **kw, backend=backend)
    assert out.shape == kw["x"].shape and bool(torch.isfinite(out).all())
print("ran without cuda.tile:", "cuda.tile" not in [m for m, v in sys.modules.items() if v])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ran without cuda.tile: True"
