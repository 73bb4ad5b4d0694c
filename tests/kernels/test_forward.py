"""The three kernels together: ``kernel_forward`` against the token-by-token recurrence (and,
on a GPU, a sequence long enough to need 64-bit indexing), ``kernel_forward(configs=...)``
against its defaults, and, without running anything, every kernel's search space at the
benchmark's shapes and the hinted kernels' caching.

The runs go through the tile interpreter on the CPU and again on a CUDA GPU under
``@pytest.mark.gpu``; every output buffer of the forward pass is NaN-filled before a kernel
writes it (``ops.forward.POISON_OUTPUTS``), and ``rel_err`` returns inf for any NaN or inf left.

Tolerances against the float64 recurrence (``TOL``), as ||out - ref|| / ||ref||:
  float32 inputs   every kernel computes in float32 throughout, a few ulps (~1e-7) per
                   operation summed over a chunk's tokens and dstate terms; observed <= 2.1e-6
                   for the whole forward pass (H200 and interpreter alike); bound 2e-5.
  16-bit inputs    the products take 16-bit operands (weighted x, CB weights, entry states:
                   bf16 keeps 8 significant bits, fp16 11) and the output is rounded once more:
                   observed <= 2.7e-3 (bf16) and <= 3.1e-4 (fp16), the same on an H200 as in
                   the interpreter; bounds 1e-2 and 2e-3. The final state is float32: half.
``kernel_forward(configs=...)`` against the defaults, float32: 1e-5 (the same float32
operations, summed in another order where a config transposes a product).
"""
import math

import pytest
import torch

import ops.forward
from ops.runtime.cutile_internals import kernel_function, kernel_hints
from ops.forward import KERNELS, kernel_forward
from ops.runtime.launch import fit_index_width
from ops.tools.plans import meta_plan
from reference import chunked
from reference.problems import make_problem
from reference.sequential import ssd_sequential
from reference.validate import rel_err
from tests.kernels.helpers import (DEVICES, DTYPES, OPTIONS, SMALL, TOL, VARIANT_CHUNK,
                                  VARIANT_SIZES, VARIANT_TOL, f64, small_plan, synced, to_device)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(ops.forward, "POISON_OUTPUTS", True)


# Against the recurrence --------------------------------------------------------------------------

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
    ref_out, ref_final = ssd_sequential(**{k: f64(v) for k, v in kw.items()}, **FORWARD_OPTIONS,
                                        return_final_states=True)
    kw = to_device(kw, device)
    out, final = synced(kernel_forward, chunk_size=chunk_size, **kw, **FORWARD_OPTIONS)
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


@pytest.mark.parametrize("name, bad", [("headdim", dict(headdim=260)), ("dstate", dict(dstate=1024)),
                                       ("dstate", dict(dstate=600))])
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
    ref = ssd_sequential(**{k: f64(v) for k, v in kw.items()}, **opts)
    out, final = kernel_forward(chunk_size=256, **kw, **opts)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.gpu_memory
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


# A config per kernel -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_kernel_forward_configs(device):
    """``kernel_forward(configs=...)`` passes each kernel its config; results match the
    defaults'. Unknown kernels or config keys are errors (a typo must not time the default)."""
    kw = make_problem(**VARIANT_SIZES, dtype=torch.float32, D="2d", seq_boundaries=[50, 128],
                      seed=12)
    kw = to_device(kw, device)
    configs = {"chunk_cumsum": dict(BLOCK_H=4, LOAD_LAT=3),
               "fwd_pass_state": dict(SWAP=True, CHUNKS_PER_ITER=2, STORE_LAT=8),
               "compute_out": dict(HEADS_PER_BLOCK=2, SWAP=True, occupancy=2)}
    ref = kernel_forward(chunk_size=VARIANT_CHUNK, **kw, **OPTIONS)
    out = kernel_forward(chunk_size=VARIANT_CHUNK, **kw, **OPTIONS, configs=configs)
    for o, r in zip(out, ref, strict=True):
        assert rel_err(o, r) < VARIANT_TOL[torch.float32]
    with pytest.raises(ValueError, match="unknown kernels"):
        kernel_forward(chunk_size=VARIANT_CHUNK, **kw, configs={"compute": {}})
    with pytest.raises(ValueError, match="unknown config keys"):
        kernel_forward(chunk_size=VARIANT_CHUNK, **kw, configs={"compute_out": {"HEADS": 2}})
    for name in KERNELS:
        # clusters of two CTAs computed wrong results on the H200: refused, not run
        with pytest.raises(ValueError, match="num_ctas must be None or 1"):
            kernel_forward(chunk_size=VARIANT_CHUNK, **kw, configs={name: {"num_ctas": 2}})
        with pytest.raises(ValueError, match="num_worker_warps must be None, 4 or 8"):
            kernel_forward(chunk_size=VARIANT_CHUNK, **kw, configs={name: {"num_worker_warps": 2}})


# Search spaces and hints (no kernel runs) --------------------------------------------------------

@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("dstate", [64, 128, 256, 512])
@pytest.mark.parametrize("seqlen", [1024, 16384, 262144])
def test_search_spaces(name, dstate, seqlen):
    """At the benchmark's shapes (h=80, p=64, g=1, bf16, chunk 256): the default comes first,
    no config repeats, the space stays small, and every config makes a valid plan (built on
    meta tensors as ``ops.forward`` makes it: ``ops.tools.plans.meta_plan``)."""
    module = KERNELS[name]
    shape = dict(batch=1, seqlen=seqlen, nheads=80, headdim=64, ngroups=1, dstate=dstate,
                 chunk_size=256, dtype=torch.bfloat16)
    space = module.search_space(**shape)
    assert space[0] == module.default_config(**shape)
    assert len({tuple(sorted(c.items())) for c in space}) == len(space)
    assert len(space) <= 45
    for config in space:
        grid = meta_plan(name, **shape, config=config).grid
        assert all(isinstance(n, int) and n > 0 for n in grid), config


def test_hinted_kernels_are_cached_and_interpretable():
    """A config's occupancy / num_ctas come back as a kernel made by ``replace_hints``: one
    object per (kernel, hints), so each variant compiles once per process, around the same
    Python function, which is what the interpreter runs (the variant tests run them).

    Small tensors run the 32-bit-indexed twin (``ops.runtime.launch.fit_index_width``): a kernel object
    of its own around the same code. Without a config, chunk_cumsum and fwd_pass_state run that
    twin itself; compute_out's plan gives it the one-head occupancy hint, so its default kernel
    is a hinted one too, also made once."""
    for name, kernel in (("compute_out", KERNELS["compute_out"].compute_out_kernel),
                         ("fwd_pass_state", KERNELS["fwd_pass_state"].fwd_pass_state_kernel),
                         ("chunk_cumsum", KERNELS["chunk_cumsum"].chunk_cumsum_kernel)):
        code = kernel_function(kernel).__code__
        hinted = small_plan(name, dict(occupancy=2, num_ctas=1)).kernel
        assert hinted is small_plan(name, dict(num_ctas=1, occupancy=2)).kernel
        plain = small_plan(name, None)
        assert plain.kernel is small_plan(name, None).kernel
        assert kernel_function(plain.kernel).__code__ is code
        assert hinted is not plain.kernel and kernel_function(hinted).__code__ is code
        twin = fit_index_width(kernel, plain.args)
        if name == "compute_out":
            assert plain.kernel is not twin and "occupancy" in kernel_hints(plain.kernel)
            assert kernel_function(plain.kernel) is kernel_function(twin)
        else:
            assert plain.kernel is twin                     # no hints: the twin itself
