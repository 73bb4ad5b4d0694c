"""The three cuTile kernels, each against its reference step, and all three together against
the token-by-token recurrence.

Every test runs on the CPU through the tile interpreter (``ops.launch`` interprets kernels
whose arguments are CPU tensors), and again on a CUDA GPU under ``@pytest.mark.gpu``.

How the kernels are isolated: each kernel is fed the SAME upstream values as its reference
step. The reference steps run in float64; their outputs are rounded to what the kernel takes
(float32, dA_cumsum times log2(e)) and the reference for the next step is computed from those
rounded values (upcast again), so only the kernel's own rounding is measured.

Every output buffer is NaN-filled before the kernel runs (the launchers' ``poison=True``, and
``ops.forward.POISON_OUTPUTS`` for the whole forward pass), and ``rel_err`` returns inf when any
NaN or inf is left, so an element a kernel forgets to write fails the test.

Tolerances, as ||out - ref|| / ||ref|| against float64:
  float32 inputs   the kernels compute in float32 throughout (float32 tensor-core operands,
                   float32 accumulation): a few ulps (~1e-7) per operation, summed over at most
                   a chunk's tokens and dstate terms; observed <= 2.1e-6 (whole forward pass,
                   H200 and interpreter alike), <= 2.2e-7 per kernel; bound 2e-5.
  16-bit inputs    the products take 16-bit operands: the dt/decay-weighted x, the CB weights
                   and the entry state are rounded to bf16 (8 significant bits, step 2^-8) or
                   fp16 (11 bits), and a 16-bit output is rounded once more: observed
                   <= 2.7e-3 (bf16) and <= 3.1e-4 (fp16), the same on an H200 as in the
                   interpreter; bounds 1e-2 and 2e-3 (the state tests half of that).
"""
import math

import pytest
import torch

from ops.chunk_cumsum import chunk_cumsum
from ops.compute_out import compute_out, compute_out_plan
import ops.forward
from ops.forward import kernel_forward
from ops.launch import launch
from ops.fwd_pass_state import fwd_pass_state, fwd_pass_state_plan
from reference import chunked
from reference.common import LOG2E
from reference.sequential import ssd_sequential
from tests.helpers import make_problem, rel_err

TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]
DEVICES = [pytest.param("cpu", id="interpret"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
OPTIONS = dict(dt_softplus=True, dt_limit=(0.0, 1.5))

# Small problems for the interpreter (headdim and dstate are at least 16: tile dimensions).
SMALL = dict(batch=2, nheads=4, headdim=16, ngroups=2, dstate=32)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(ops.forward, "POISON_OUTPUTS", True)


def _run(launcher, *args, **kwargs):
    """Run a launcher and wait for the GPU, so a failure is reported by the right test."""
    out = launcher(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def _f64(t):
    return None if t is None else (t.double() if t.is_floating_point() else t)


def _upstream(kw, chunk_size):
    """Reference (a) in float64, rounded to the kernels' units: (dt_out, dA_cumsum log2) fp32."""
    dt_out, dA = chunked.chunk_cumsum(kw["dt"].double(), kw["A"].double(), chunk_size,
                                      _f64(kw.get("dt_bias")), **OPTIONS)
    return dt_out.float(), (dA * LOG2E).float()


def _as_ref(dt_k, dA_k):
    """The kernel-unit intermediates, upcast back to the reference's units."""
    return dt_k.double(), dA_k.double() / LOG2E


def _to(kw, device):
    return {k: v.to(device) for k, v in kw.items()}


# (a) chunk_cumsum ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt_dtype", [torch.float32, torch.bfloat16], ids=["dt-fp32", "dt-bf16"])
@pytest.mark.parametrize("problem, chunk_size, options", [
    pytest.param(dict(seqlen=77), 16, OPTIONS, id="ragged-L77-softplus-limit"),
    pytest.param(dict(seqlen=300, nheads=5), 64, dict(dt_softplus=False, dt_limit=(0.0, math.inf)),
                 id="h5-no-softplus-default-limit"),
    pytest.param(dict(seqlen=5, dt_bias=False), 256, dict(dt_softplus=True, dt_limit=(0.05, 0.5)),
                 id="L5-chunk256-no-bias"),
])
def test_chunk_cumsum(device, dt_dtype, problem, chunk_size, options):
    kw = make_problem(**{**SMALL, **problem}, seed=1)
    kw["dt"] = (kw["dt"] * 16 + 4).to(dt_dtype)     # wide range: softplus cut at 20, clamps
    bias = kw.get("dt_bias")
    ref_dt, ref_dA = chunked.chunk_cumsum(kw["dt"].double(), kw["A"].double(), chunk_size,
                                          _f64(bias), **options)
    kw = _to(kw, device)
    dt_out, dA = _run(chunk_cumsum, kw["dt"], kw["A"], chunk_size, dt_bias=kw.get("dt_bias"),
                      poison=True, **options)
    assert dt_out.shape == dA.shape == ref_dt.shape
    assert dt_out.dtype == dA.dtype == torch.float32
    assert rel_err(dt_out, ref_dt) < 1e-6
    assert rel_err(dA, ref_dA * LOG2E) < 1e-6
    seqlen = problem["seqlen"]
    assert (dt_out.flatten(2)[..., seqlen:] == 0).all(), "padding tokens must have dt = 0"


# (b) fwd_pass_state ----------------------------------------------------------------------------

STATE_CASES = [
    pytest.param(dict(seqlen=77), 16, {}, id="ragged-L77-init"),
    pytest.param(dict(seqlen=150, seq_boundaries=[10, 64, 100]), 32, {},
                 id="seq_idx-inside-and-at-chunk-boundary"),
    pytest.param(dict(seqlen=40, seq_boundaries=[0], ngroups=1), 16, {},
                 id="first-id-1-drops-initial-g1"),
    pytest.param(dict(seqlen=9, initial_states=False), 16, {}, id="L9-no-init"),
    pytest.param(dict(seqlen=200, headdim=32, dstate=128), 128, {}, id="chunk128-dstate128"),
    pytest.param(dict(seqlen=70, dstate=64), 16, dict(block_p=16, block_n=16),
                 id="small-tiles-many-blocks"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("problem, chunk_size, tiles", STATE_CASES)
def test_fwd_pass_state(device, dtype, problem, chunk_size, tiles):
    kw = make_problem(**{**SMALL, **problem}, dtype=dtype, seed=2)
    dt_k, dA_k = _upstream(kw, chunk_size)
    dt_r, dA_r = _as_ref(dt_k, dA_k)
    ref_entry, ref_final = chunked.fwd_pass_state(kw["x"].double(), kw["B"].double(), dt_r, dA_r,
                                                  _f64(kw.get("initial_states")), kw.get("seq_idx"))
    kw = _to(kw, device)
    grid, kernel, args, (entry, final) = fwd_pass_state_plan(
        kw["x"], kw["B"], dt_k.to(device), dA_k.to(device), kw.get("initial_states"),
        kw.get("seq_idx"), poison=True, **tiles)
    _run(launch, grid, kernel, args)
    assert entry.shape == ref_entry.shape and final.shape == ref_final.shape
    assert entry.dtype == final.dtype == torch.float32
    # The products round the weighted x to x's dtype; the state itself is float32.
    tol = TOL[dtype] / 2
    assert rel_err(entry, ref_entry) < tol
    assert rel_err(final, ref_final) < tol
    if "initial_states" in kw:
        assert torch.equal(entry[:, 0].cpu(), kw["initial_states"].float().cpu())


def test_fwd_pass_state_launcher_defaults():
    """The public launcher (default tiles, 16-bit entry states on request)."""
    kw = make_problem(**SMALL, seqlen=50, dtype=torch.float32, seed=3)
    dt_k, dA_k = _upstream(kw, 16)
    ref_entry, ref_final = chunked.fwd_pass_state(kw["x"].double(), kw["B"].double(),
                                                  *_as_ref(dt_k, dA_k), kw["initial_states"].double())
    entry, final = fwd_pass_state(kw["x"], kw["B"], dt_k, dA_k, kw["initial_states"],
                                  states_dtype=torch.bfloat16, poison=True)
    assert entry.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert rel_err(entry, ref_entry) < 1e-2 and rel_err(final, ref_final) < 1e-5


# (c) compute_out -------------------------------------------------------------------------------

OUT_CASES = [
    pytest.param(dict(seqlen=77), 16, {}, id="ragged-L77-D1d-z"),
    pytest.param(dict(seqlen=150, seq_boundaries=[10, 64, 100], D="2d"), 32, {},
                 id="seq_idx-inside-and-at-chunk-boundary-D2d"),
    pytest.param(dict(seqlen=40, z=False, D=None, ngroups=1), 16, {}, id="no-D-no-z-g1"),
    pytest.param(dict(seqlen=1), 16, {}, id="L1"),
    pytest.param(dict(seqlen=100, dstate=64), 64, dict(block_m=16, block_k=32, dstate_tile=16),
                 id="dstate-split-4-rows16-cols32"),
    pytest.param(dict(seqlen=130, headdim=32), 64, dict(block_m=32, block_k=16, block_p=16),
                 id="rows32-cols16-headdim-split"),
    pytest.param(dict(seqlen=260, headdim=32, dstate=128), 256, {}, id="chunk256-dstate128"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("problem, chunk_size, tiles", OUT_CASES)
def test_compute_out(device, dtype, problem, chunk_size, tiles):
    kw = make_problem(**{**SMALL, **problem}, dtype=dtype, seed=4)
    dt_k, dA_k = _upstream(kw, chunk_size)
    dt_r, dA_r = _as_ref(dt_k, dA_k)
    entry, _ = chunked.fwd_pass_state(kw["x"].double(), kw["B"].double(), dt_r, dA_r,
                                      _f64(kw.get("initial_states")), kw.get("seq_idx"))
    entry_k = entry.float()
    ref = chunked.compute_out(kw["x"].double(), kw["B"].double(), kw["C"].double(), dt_r, dA_r,
                              entry_k.double(), _f64(kw.get("D")), _f64(kw.get("z")),
                              kw.get("seq_idx"))
    kw = _to(kw, device)
    grid, kernel, args, out = compute_out_plan(
        kw["x"], kw["B"], kw["C"], dt_k.to(device), dA_k.to(device), entry_k.to(device),
        kw.get("D"), kw.get("z"), kw.get("seq_idx"), poison=True, **tiles)
    _run(launch, grid, kernel, args)
    assert out.shape == kw["x"].shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_compute_out_launcher_defaults():
    kw = make_problem(**SMALL, seqlen=50, dtype=torch.float32, seed=5)
    dt_k, dA_k = _upstream(kw, 16)
    dt_r, dA_r = _as_ref(dt_k, dA_k)
    d = {k: _f64(v) for k, v in kw.items()}
    entry, _ = chunked.fwd_pass_state(d["x"], d["B"], dt_r, dA_r, d["initial_states"])
    ref = chunked.compute_out(d["x"], d["B"], d["C"], dt_r, dA_r, entry.float().double(),
                              d["D"], d["z"])
    out = compute_out(kw["x"], kw["B"], kw["C"], dt_k, dA_k, entry.float(), D=kw["D"], z=kw["z"],
                      poison=True)
    assert rel_err(out, ref) < TOL[torch.float32]


# All three: kernel_forward against the recurrence ---------------------------------------------

FORWARD_CASES = [
    pytest.param(dict(seqlen=300, seq_boundaries=[40, 64, 201]), 64,
                 id="ragged-L300-seq_idx-inside-and-at-chunk-boundary"),
    pytest.param(dict(seqlen=150, ngroups=1, D="2d", seq_boundaries=[0, 77]), 32,
                 id="g1-D2d-first-id-1"),
    pytest.param(dict(seqlen=37), 64, id="L-shorter-than-chunk"),
    pytest.param(dict(seqlen=1, ngroups=4), 16, id="L1-g-equals-h"),
    pytest.param(dict(seqlen=100, D=None, z=False, dt_bias=False, initial_states=False), 16,
                 id="no-options"),
    pytest.param(dict(seqlen=140, headdim=32, dstate=128, nheads=2, ngroups=1), 128,
                 id="chunk128-dstate128"),
    pytest.param(dict(seqlen=270, dstate=256, batch=1, nheads=2, ngroups=1), 256,
                 id="chunk256-dstate256-split"),
]
FORWARD_OPTIONS = dict(dt_softplus=True, dt_limit=(0.01, 1.5))


def _forward_check(problem, chunk_size, dtype, device):
    kw = make_problem(**{**SMALL, **problem}, dtype=dtype, seed=6)
    ref_out, ref_final = ssd_sequential(**{k: _f64(v) for k, v in kw.items()}, **FORWARD_OPTIONS,
                                        return_final_states=True)
    kw = _to(kw, device)
    out, final = _run(kernel_forward, chunk_size=chunk_size, **kw, **FORWARD_OPTIONS)
    assert out.dtype == dtype and out.shape == kw["x"].shape
    assert final.dtype == torch.float32 and final.shape == ref_final.shape
    assert rel_err(out, ref_out) < TOL[dtype]
    assert rel_err(final, ref_final) < TOL[dtype] / 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("problem, chunk_size", FORWARD_CASES)
def test_forward_fp32(device, problem, chunk_size):
    _forward_check(problem, chunk_size, torch.float32, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("problem, chunk_size", FORWARD_CASES[:3])
def test_forward_16bit(device, dtype, problem, chunk_size):
    _forward_check(problem, chunk_size, dtype, device)


@pytest.mark.parametrize("name, bad", [("headdim", dict(headdim=24)), ("dstate", dict(dstate=1024)),
                                       ("headdim", dict(headdim=8))])
def test_unsupported_sizes_raise(name, bad):
    kw = make_problem(**{**SMALL, **bad, "seqlen": 20}, dtype=torch.float32)
    with pytest.raises(ValueError, match=name):   # raised before any kernel runs
        kernel_forward(chunk_size=16, **kw)


def test_no_overflow_with_large_decay():
    """|A| * dt summed over a 256-token chunk reaches thousands: exp2 of the cumsum underflows
    to 0 and the masked/clamped differences never overflow, so no NaN or inf appears."""
    kw = make_problem(**SMALL, seqlen=300, dtype=torch.float32, seed=8)
    kw["A"] = kw["A"] * 50
    opts = dict(dt_softplus=True, dt_limit=(0.5, 10.0))
    ref = ssd_sequential(**{k: _f64(v) for k, v in kw.items()}, **opts)
    out, final = kernel_forward(chunk_size=256, **kw, **opts)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert rel_err(out, ref) < TOL[torch.float32]


# Long sequences: 64-bit indexing (GPU only) ----------------------------------------------------

@pytest.mark.gpu
def test_long_sequence_int64_indexing():
    """x has more than 2**31 elements, so offsets into it only fit in 64 bits. Heads are
    independent when ngroups == 1, so the reference is computed for the first and last head
    alone (on the GPU, in float32) and compared with the kernels' full run."""
    torch.manual_seed(0)
    b, L, h, p, n, chunk = 1, (1 << 19) + 77, 80, 64, 16, 256
    assert b * L * h * p > 2 ** 31
    dev, dt16 = "cuda", torch.bfloat16
    x = torch.randn(b, L, h, p, device=dev, dtype=dt16)
    dt = torch.randn(b, L, h, device=dev) * 0.5 - 1.0
    A = -(torch.rand(h, device=dev) + 0.5)
    B = torch.randn(b, L, 1, n, device=dev, dtype=dt16)
    C = torch.randn(b, L, 1, n, device=dev, dtype=dt16)
    D = torch.randn(h, device=dev)
    seq_idx = (torch.arange(L, device=dev) >= L - 1000).to(torch.int32)[None]  # 2 sequences
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf))
    out, final = kernel_forward(x, dt, A, B, C, chunk, D=D, seq_idx=seq_idx, **opts)
    torch.cuda.synchronize()
    for head in (0, h - 1):
        sl = slice(head, head + 1)
        ref_out, ref_final = chunked.ssd_chunked(
            x[:, :, sl].contiguous(), dt[:, :, sl].contiguous(), A[sl], B, C, chunk, D=D[sl],
            seq_idx=seq_idx, return_final_states=True, **opts)
        assert rel_err(out[:, :, sl], ref_out) < TOL[dt16], f"head {head}"
        assert rel_err(out[:, -4096:, sl], ref_out[:, -4096:]) < TOL[dt16], f"head {head} tail"
        assert rel_err(final[:, sl], ref_final) < 1e-2, f"head {head} final state"


def test_index_width_follows_the_tensor_sizes():
    """Launches on tensors under 2**31 elements use the 32-bit-indexed twin of a kernel (the
    compiler only uses TMA loads with 32-bit indices); larger ones keep 64-bit indexing."""
    import cuda.tile as ct
    from ops.compute_out import compute_out_kernel
    from ops.launch import fit_index_width
    small = (torch.empty(4, 8, device="meta"),)
    huge = (torch.empty(2**31, device="meta"),)
    twin = fit_index_width(compute_out_kernel, small)
    assert fit_index_width(compute_out_kernel, huge) is compute_out_kernel
    assert twin is fit_index_width(compute_out_kernel, small) and twin is not compute_out_kernel
    wide = [n for n, a in compute_out_kernel._pyfunc.__annotations__.items() if a is ct.IndexedWithInt64]
    assert wide and not any(a is ct.IndexedWithInt64 for a in twin._pyfunc.__annotations__.values())
    assert twin._pyfunc.__code__ is compute_out_kernel._pyfunc.__code__
