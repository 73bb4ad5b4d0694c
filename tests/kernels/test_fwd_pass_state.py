"""Kernel (b), fwd_pass_state (notebook 04): against reference (b), every config of its search
space against the default config (also through the 64-bit-indexed kernel, on a GPU), and its
ahead-of-time compilation for sm_80, sm_90 and sm_100.

Every test that runs the kernel runs on the CPU through the tile interpreter, and again on a
CUDA GPU under ``@pytest.mark.gpu``; the outputs are NaN-poisoned first, so a state the kernel
forgets to write fails.

Against reference (b): the kernel is fed reference (a)'s dt and decay cumsum rounded to its
units (float32, log2), and the reference states are computed in float64 from those same rounded
values (``tests.kernels.helpers.reference_states``), so only the kernel's own rounding counts.
The states are float32 (entry states in 16 bits only on request), so half of ``TOL``, relative
in norm:
  float32 inputs   float32 products and accumulation, a few ulps (~1e-7) per operation summed
                   over a chunk's tokens: observed <= 2.2e-7; bound 1e-5.
  16-bit inputs    the products round the dt/decay-weighted x to x's dtype, bf16 (8 significant
                   bits) or fp16 (11 bits), before the float32 accumulation: bounds 5e-3 (bf16)
                   and 1e-3 (fp16). The launcher test stores bf16 entry states: 1e-2.

Variants: every config of ``search_space`` at the small shape of ``tests/kernels/helpers.py``,
and configs with tiles smaller than headdim and dstate (several tiles per head), against the
default config: 1e-5 in float32 (the same float32 operations, only summed in another order),
4e-3 in bf16 (a last-bit difference can flip one bf16 rounding step of a stored entry state;
rare, so the norm stays far below a step). On a GPU the bf16 cases run again through the
64-bit-indexed kernel (INDEX64: no TMA, so other addressing).

Compilation: the arguments are built as the launcher builds them (``fwd_pass_state_plan`` on
"meta" tensors), so a type or shape error in any variant fails here without a GPU; then the
default and one config of each kind of the search space at a Mamba-2 layer's shape.
"""
import pytest
import torch

from ops.kernels import fwd_pass_state as state_mod
from ops.kernels.fwd_pass_state import fwd_pass_state, fwd_pass_state_plan
from ops.runtime.launch import run
from reference.validate import rel_err
from tests.kernels.helpers import (BATCH, BOTH, DEVICES, DTYPES, HOPPER, NHEADS, TOL, cases, check,
                                  compile_kind, compiles, int64_cases, kind_params, meta,
                                  meta_inputs, reference_states, run_state, synced, to_device,
                                  with_archs)


# Against reference (b) ---------------------------------------------------------------------------

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
    # SPLIT: every chunk's own state formed first, then the light pass; with packed sequences
    # (the write mask and the dropped carry both move to the two kernels) and initial states
    pytest.param(dict(seqlen=150, seq_boundaries=[10, 64, 100]), 32,
                 dict(config=dict(SPLIT=True)), id="split-seq_idx-init"),
    pytest.param(dict(seqlen=77), 16, dict(config=dict(SPLIT=True, BLOCK_P=16, BLOCK_N=16)),
                 id="split-ragged-small-tiles"),
    pytest.param(dict(seqlen=50, headdim=24, dstate=40), 16,
                 dict(config=dict(SPLIT=True, BLOCK_P=16, BLOCK_N=32)),
                 id="split-odd-sizes-partial-state-tiles"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("problem, chunk_size, tiles", STATE_CASES)
def test_fwd_pass_state(device, dtype, problem, chunk_size, tiles):
    up = reference_states(problem, chunk_size, dtype, seed=2)
    kw = to_device(up.kw, device)
    plan = fwd_pass_state_plan(kw["x"], kw["B"], up.dt.to(device), up.dA.to(device),
                               kw.get("initial_states"), kw.get("seq_idx"), poison=True, **tiles)
    entry, final = synced(run, plan)
    assert entry.shape == up.entry.shape and final.shape == up.final.shape
    assert entry.dtype == final.dtype == torch.float32
    # The products round the weighted x to x's dtype; the state itself is float32.
    tol = TOL[dtype] / 2
    assert rel_err(entry, up.entry) < tol
    assert rel_err(final, up.final) < tol
    if "initial_states" in kw:
        assert torch.equal(entry[:, 0].cpu(), kw["initial_states"].float().cpu())


def test_fwd_pass_state_launcher_defaults():
    """The public launcher (default tiles, 16-bit entry states on request)."""
    up = reference_states(dict(seqlen=50), 16, torch.float32, seed=3)
    kw = up.kw
    entry, final = fwd_pass_state(kw["x"], kw["B"], up.dt, up.dA, kw["initial_states"],
                                  states_dtype=torch.bfloat16, poison=True)
    assert entry.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert rel_err(entry, up.entry) < 1e-2 and rel_err(final, up.final) < 1e-5


# Against the default config ----------------------------------------------------------------------

# Configs outside the small shape's search space that reach otherwise unvisited code.
STATE_EXTRA = [dict(BLOCK_P=16, BLOCK_N=32, SWAP=swap, CHUNKS_PER_ITER=k)   # several p/n tiles
               for swap in (False, True) for k in (1, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name, config", cases(state_mod, STATE_EXTRA))
def test_fwd_pass_state_variant(device, dtype_name, config):
    check(run_state, dtype_name, config, device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name, config", int64_cases(state_mod, STATE_EXTRA))
def test_fwd_pass_state_variant_int64(dtype_name, config):
    check(run_state, dtype_name, config, "cuda")


# Ahead-of-time compilation -----------------------------------------------------------------------

STATE_VARIANTS = [
    pytest.param(dict(dtype=torch.bfloat16, chunk=256, p=64, n=128, init=True, seq=True,
                      states=torch.bfloat16), id="bf16-chunk256-n128-init-seq-states16"),
    pytest.param(dict(dtype=torch.bfloat16, chunk=256, p=64, n=128, init=False, seq=False,
                      states=torch.float32), id="bf16-chunk256-n128-plain"),
    pytest.param(dict(dtype=torch.float16, chunk=128, p=128, n=256, init=True, seq=False,
                      states=torch.float16), id="fp16-chunk128-p128-n256-init"),
    pytest.param(dict(dtype=torch.float32, chunk=64, p=64, n=64, init=False, seq=True,
                      states=torch.float32), id="fp32-chunk64-n64-seq"),
    pytest.param(dict(dtype=torch.float32, chunk=256, p=32, n=512, init=True, seq=True,
                      states=torch.float32), id="fp32-chunk256-p32-n512-init-seq"),
]


@pytest.mark.parametrize("v, arch", with_archs(STATE_VARIANTS))
def test_compile_fwd_pass_state(v, arch):
    x, B, dt_out, dA, seq = meta_inputs(v)
    init = meta(BATCH, NHEADS, v["p"], v["n"]) if v["init"] else None
    assert compiles(fwd_pass_state_plan(x, B, dt_out, dA, init, seq, states_dtype=v["states"]),
                    arch)


# (dstate, kind, which config of the search space, architectures), after the default config
KINDS = [
    (128, "swap", lambda c, d: c["SWAP"] and c["CHUNKS_PER_ITER"] == 1, BOTH),
    (128, "2-chunks", lambda c, d: c["CHUNKS_PER_ITER"] == 2 and not c["SWAP"], BOTH),
    (128, "swap-2-chunks", lambda c, d: c["CHUNKS_PER_ITER"] == 2 and c["SWAP"], HOPPER),
    (128, "latency", lambda c, d: c["LOAD_LAT"] and c["STORE_LAT"], HOPPER),
    (128, "hints", lambda c, d: c["occupancy"], HOPPER),
    (128, "8-worker-warps", lambda c, d: c["num_worker_warps"] == 8, HOPPER),
    (128, "split", lambda c, d: c["SPLIT"] and not c["LOAD_LAT"], BOTH),
]


@pytest.mark.parametrize("dstate, kind, pick, arch",
                         kind_params("fwd_pass_state", KINDS, default_dstates=(128, 256)))
def test_compile_variant_kinds(dstate, kind, pick, arch):
    compile_kind("fwd_pass_state", dstate, kind, pick, arch)
