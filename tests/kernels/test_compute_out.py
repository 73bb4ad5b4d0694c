"""Kernel (c), compute_out (notebook 05): against reference (c), every config of its search space
against the default config (also through the 64-bit-indexed kernel on a GPU, and the configs
refused there; with D per head and no z, with persistent blocks, with C B^T from memory and its
chunk_scores step), its ahead-of-time compilation for sm_80, sm_90 and sm_100, and the
32-bit-indexed twin of the kernel.

Every test that runs the kernel runs on the CPU through the tile interpreter, and again on a
CUDA GPU under ``@pytest.mark.gpu``; the output is NaN-poisoned first, so an element the kernel
forgets to write fails.

Against reference (c): the kernel is fed reference (a)'s dt and decay cumsum and reference (b)'s
entry states, rounded to its units (float32, log2), and the reference output is computed in
float64 from those same rounded values, so only the kernel's own rounding counts. ``TOL``,
relative in norm:
  float32 inputs   float32 tensor-core operands and accumulation: a few ulps (~1e-7) per
                   operation, summed over a chunk's tokens and the dstate terms: observed
                   <= 2.2e-7; bound 2e-5.
  16-bit inputs    the CB weights, the dt/decay-weighted x and the entry state are rounded to
                   bf16 (8 significant bits) or fp16 (11 bits) for the products, and the output
                   is rounded to x's dtype once more: observed <= 2.7e-3 (bf16) and <= 3.1e-4
                   (fp16), on an H200 as in the interpreter; bounds 1e-2 and 2e-3.

Variants, against the default config: 1e-5 in float32 (the same float32 operations; a transposed
product sums in another order), 4e-3 in bf16 (the output, the weights and the entry states are
bf16: a last-bit difference before a rounding can move a value by one bf16 step, 2^-8 relative,
but such flips are rare, so the norm of the difference stays far below a step). Besides the
search space at the small shape of ``tests/kernels/helpers.py``: dstate in two slices and headdim
split, for one and several heads per block and both operand orders, and C B^T from memory.

Compilation (``compute_out_plan`` and ``chunk_scores_plan`` on "meta" tensors, as the launcher
builds them): a few input variants, compute_out's first step with C B^T in memory, and one
config of each kind of its search space at a Mamba-2 layer's shape.

compute_out is one kernel, ``compute_out_kernel``: HEADS_PER_BLOCK (1, 2, 4) is a constant, and
its plan applies the sm_90 occupancy hint to one head per block. Launches on tensors under 2**31
elements run its 32-bit-indexed twin.
"""
import pytest
import torch

import cuda.tile as ct
from ops.kernels import compute_out as out_mod
from ops.checks import cdiv
from ops.kernels.compute_out import ONE_HEAD_OCCUPANCY, compute_out, compute_out_kernel, compute_out_plan
from ops.runtime.cutile_internals import kernel_function, kernel_hints
from ops.runtime.launch import fit_index_width, run
from ops.tools.aot import ARCHS
from ops.tools.plans import meta_plan
from reference import chunked
from reference.validate import rel_err
from tests.kernels.helpers import (BATCH, BOTH, DEVICES, DTYPES, HOPPER, NGROUPS, NHEADS, SEQLEN,
                                  TOL, cases, check, compile_kind, compiles, f64, int64_cases,
                                  kind_params, label, meta, meta_inputs, problem, reference_states,
                                  refused_int64, run_out, small_plan, synced, to_device,
                                  variant_shape, with_archs)


def reference_out(up, entry):
    """Reference (c) in float64 from ``up``'s rounded upstream values and ``entry`` states."""
    kw = up.kw
    return chunked.compute_out(kw["x"].double(), kw["B"].double(), kw["C"].double(), up.ref_dt,
                               up.ref_dA, entry.double(), f64(kw.get("D")), f64(kw.get("z")),
                               kw.get("seq_idx"))


# Against reference (c) ---------------------------------------------------------------------------

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
    up = reference_states(problem, chunk_size, dtype, seed=4)
    entry_k = up.entry.float()
    ref = reference_out(up, entry_k)
    kw = to_device(up.kw, device)
    plan = compute_out_plan(kw["x"], kw["B"], kw["C"], up.dt.to(device), up.dA.to(device),
                            entry_k.to(device), kw.get("D"), kw.get("z"), kw.get("seq_idx"),
                            poison=True, **tiles)
    out, = synced(run, plan)
    assert out.shape == kw["x"].shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_compute_out_launcher_defaults():
    up = reference_states(dict(seqlen=50), 16, torch.float32, seed=5)
    kw = up.kw
    ref = reference_out(up, up.entry.float())
    out = compute_out(kw["x"], kw["B"], kw["C"], up.dt, up.dA, up.entry.float(), D=kw["D"],
                      z=kw["z"], poison=True)
    assert rel_err(out, ref) < TOL[torch.float32]


# Against the default config ----------------------------------------------------------------------

# Configs outside the small shape's search space that reach otherwise unvisited code.
OUT_EXTRA = ([dict(DSTATE_TILE=32, HEADS_PER_BLOCK=hb, SWAP=swap)          # dstate in 2 slices
              for hb in (1, 2) for swap in (False, True)]
             + [dict(BLOCK_P=16, HEADS_PER_BLOCK=hb, SWAP=True) for hb in (1, 4)]   # p split
             + [dict(DSTATE_TILE=32, SCORES_IN_MEMORY=True, SWAP=swap) for swap in (False, True)])
# D per head (not per headdim column) and no z: a second set of inputs, for these configs.
OUT_D1_NO_Z = [dict(), dict(SWAP=True), dict(HEADS_PER_BLOCK=2),
               dict(HEADS_PER_BLOCK=4, SWAP=True), dict(SCORES_IN_MEMORY=True),
               dict(SCORES_IN_MEMORY=True, HEADS_PER_BLOCK=2, SWAP=True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name, config", cases(out_mod, OUT_EXTRA))
def test_compute_out_variant(device, dtype_name, config):
    check(run_out, dtype_name, config, device)


def test_compute_out_refuses_tiles_that_fault_with_int64():
    """Refused with a ValueError before any launch (so on the CPU too), with or without
    INDEX64 asked for explicitly; the same tiles with 32-bit indices still run."""
    default = out_mod.default_config(**variant_shape(torch.bfloat16))
    for hb in (2, 4):
        for change, message in (({"BLOCK_M": 32}, "BLOCK_M=32 with HEADS_PER_BLOCK"),
                                ({"num_worker_warps": 8}, "num_worker_warps=8 with HEADS_PER_BLOCK")):
            bad = {**default, **change, "HEADS_PER_BLOCK": hb, "INDEX64": True}
            assert refused_int64(bad)
            with pytest.raises(ValueError, match=message):
                run_out("bf16", "cpu", bad)
    check(run_out, "bf16", {**default, "BLOCK_M": 32, "HEADS_PER_BLOCK": 2}, "cpu")
    check(run_out, "bf16", {**default, "num_worker_warps": 8, "HEADS_PER_BLOCK": 2,
                            "occupancy": 2}, "cpu")
    check(run_out, "bf16", {**default, "num_worker_warps": 8, "INDEX64": True}, "cpu")
    big = dict(batch=1, seqlen=262144, nheads=80, headdim=64, ngroups=1, dstate=512,
               chunk_size=256, dtype=torch.bfloat16)
    assert out_mod.needs_int64(**big) and not out_mod.needs_int64(**dict(big, dstate=256))
    assert not any(refused_int64(c) for c in out_mod.search_space(**big))
    assert any(refused_int64(c) for c in out_mod.search_space(**dict(big, dstate=256)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name, config", int64_cases(out_mod, OUT_EXTRA))
def test_compute_out_variant_int64(dtype_name, config):
    check(run_out, dtype_name, config, "cuda")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", OUT_D1_NO_Z, ids=lambda c: label(c, {}))
def test_compute_out_variant_D_per_head_no_z(device, config):
    check(run_out, "fp32", config, device, "1d", False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hb", [1, 2])
def test_persistent_blocks_loop_over_tiles(device, hb, monkeypatch):
    """PERSISTENT with a grid far smaller than the tiles (one multiprocessor's worth of blocks),
    so that every block loops over many tiles: the same outputs as the default config."""
    monkeypatch.setattr(out_mod, "multiprocessors", lambda device: 1)
    default = out_mod.default_config(**variant_shape(torch.bfloat16))
    config = {**default, "PERSISTENT": True, "HEADS_PER_BLOCK": hb, "occupancy": 2}
    kw, dt_out, dA, entry = problem("bf16", device)
    plan = compute_out_plan(kw["x"], kw["B"], kw["C"], dt_out, dA, entry, D=kw["D"],
                            z=kw.get("z"), seq_idx=kw["seq_idx"], config=config)
    assert plan.grid == (2, 1)                             # 2 blocks for 24 / hb tiles
    check(run_out, "bf16", config, device)


@pytest.mark.parametrize("hb, occupancy, resident", [(1, None, 3), (2, None, 1), (4, None, 1),
                                                     (1, 2, 2), (2, 2, 2), (4, 1, 1)])
def test_persistent_grid_holds_the_blocks_the_register_budget_assumes(hb, occupancy, resident):
    """One count of blocks per multiprocessor serves the register budget (``fits``) and the
    persistent grid: the config's occupancy, else 3 for one head per block (the sm_90 hint),
    else 1. (Before the kernels were merged the persistent grid assumed 2 for several heads.)"""
    shape = dict(batch=1, seqlen=65536, nheads=8, headdim=64, ngroups=1, dstate=128,
                 chunk_size=256, dtype=torch.bfloat16)
    config = {"PERSISTENT": True, "HEADS_PER_BLOCK": hb, "occupancy": occupancy}
    cfg = {**out_mod.default_config(**shape), **config}
    assert out_mod.resident_blocks(cfg) == resident
    plan = meta_plan("compute_out", **shape, config=config)
    assert plan.grid == (132 * resident, 1)          # meta tensors: an H200's 132 multiprocessors


def test_scores_in_memory_plans_their_first_step():
    """With SCORES_IN_MEMORY the plan carries a (batch, nchunks, ngroups, CHUNK, CHUNK) float32
    scores buffer and its ``before`` holds the chunk_scores launch filling it, in the same tiles
    and latency hint as compute_out's; without it, no extra launch."""
    from ops.kernels.common import chunk_scores_kernel
    shape = dict(batch=1, seqlen=1000, nheads=8, headdim=32, ngroups=2, dstate=256, chunk_size=128,
                 dtype=torch.bfloat16)
    assert meta_plan("compute_out", **shape, config=None).before == ()
    cfg = {"SCORES_IN_MEMORY": True, "BLOCK_M": 32, "BLOCK_K": 64, "LOAD_LAT": 3}
    plan = meta_plan("compute_out", **shape, config=cfg)
    (scores_plan,) = plan.before
    B, C, scores = scores_plan.args[:3]
    assert scores_plan.outputs == (scores,) and scores_plan.before == ()
    assert any(a is scores for a in plan.args) and B is plan.args[1] and C is plan.args[2]
    assert scores.shape == (1, 8, 2, 128, 128) and scores.dtype == torch.float32
    # CHUNK, the tiles (BLOCK_M, BLOCK_K), DSTATE, its tile, the latency hint
    assert scores_plan.args[3:] == (128, 32, 64, 256, 128, 3)
    assert scores_plan.grid == (8 * 4 * 2, 2, 1)
    code = kernel_function(chunk_scores_kernel).__code__
    assert kernel_function(scores_plan.kernel).__code__ is code


def test_one_kernel_with_the_one_head_occupancy_hint():
    """One ``@ct.kernel`` for every HEADS_PER_BLOCK; the default config's plan gives it the sm_90
    occupancy hint for one head per block, a two-heads plan with occupancy None none."""
    kernels = [v for v in vars(out_mod).values() if isinstance(v, ct.kernel)]
    assert kernels == [compute_out_kernel]
    # replace_hints keeps a copy of the ct.ByTarget: equal to ONE_HEAD_OCCUPANCY, not the same
    assert kernel_hints(small_plan("compute_out", None).kernel)["occupancy"] == ONE_HEAD_OCCUPANCY
    two_heads = small_plan("compute_out", {"HEADS_PER_BLOCK": 2, "occupancy": None})
    assert "occupancy" not in kernel_hints(two_heads.kernel)
    assert two_heads.kernel is fit_index_width(compute_out_kernel, two_heads.args)


# Ahead-of-time compilation -----------------------------------------------------------------------

OUT_VARIANTS = [
    pytest.param(dict(dtype=torch.bfloat16, chunk=256, p=64, n=128, D="1d", z=True, seq=True,
                      states=torch.bfloat16), id="bf16-chunk256-n128-D1d-z-seq"),
    pytest.param(dict(dtype=torch.float16, chunk=128, p=128, n=256, D="2d", z=False, seq=True,
                      states=torch.float16), id="fp16-chunk128-p128-n256-split-D2d-seq"),
    pytest.param(dict(dtype=torch.float32, chunk=64, p=64, n=64, D=None, z=True, seq=False,
                      states=torch.float32), id="fp32-chunk64-n64-z"),
    pytest.param(dict(dtype=torch.bfloat16, chunk=256, p=32, n=16, D=None, z=False, seq=False,
                      states=torch.bfloat16), id="bf16-chunk256-p32-n16-plain"),
]


@pytest.mark.parametrize("v, arch", with_archs(OUT_VARIANTS))
def test_compile_compute_out(v, arch):
    x, B, dt_out, dA, seq = meta_inputs(v)
    states = meta(BATCH, dt_out.shape[2], NHEADS, v["p"], v["n"], dtype=v["states"])
    D = {None: None, "1d": meta(NHEADS), "2d": meta(NHEADS, v["p"])}[v["D"]]
    z = x if v["z"] else None
    assert compiles(compute_out_plan(x, B, B, dt_out, dA, states, D, z, seq), arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dstate", [128, 256])
def test_compile_chunk_scores(dstate, arch):
    """compute_out's optional first step (SCORES_IN_MEMORY), in the tiles compute_out reads."""
    from ops.kernels.common import chunk_scores_plan
    B = meta(BATCH, SEQLEN, NGROUPS, dstate, dtype=torch.bfloat16)
    scores = meta(BATCH, cdiv(SEQLEN, 256), NGROUPS, 256, 256)
    assert compiles(chunk_scores_plan(B, B, scores, 64, 64, min(dstate, 128)), arch)


# (dstate, kind, which config of the search space, architectures), after the default config
KINDS = [
    (256, "swap", lambda c, d: c["SWAP"] and c["HEADS_PER_BLOCK"] == 1, BOTH),
    (256, "2-heads", lambda c, d: c["HEADS_PER_BLOCK"] == 2 and not c["SWAP"], BOTH),
    (256, "2-heads-swap", lambda c, d: c["HEADS_PER_BLOCK"] == 2 and c["SWAP"], BOTH),
    (128, "4-heads", lambda c, d: c["HEADS_PER_BLOCK"] == 4 and not c["SWAP"], BOTH),
    (128, "4-heads-swap", lambda c, d: c["HEADS_PER_BLOCK"] == 4 and c["SWAP"], BOTH),
    (256, "whole-dstate", lambda c, d: c["DSTATE_TILE"] == 256, HOPPER),
    (128, "latency", lambda c, d: c["LOAD_LAT"] or c["STORE_LAT"], HOPPER),
    (128, "hints", lambda c, d: c["occupancy"] not in (None, d["occupancy"]), HOPPER),
    (256, "scores-in-memory", lambda c, d: c["SCORES_IN_MEMORY"] and not c["SWAP"]
     and c["HEADS_PER_BLOCK"] == 1 and c["occupancy"] is None, BOTH),
    (256, "scores-in-memory-2-heads", lambda c, d: c["SCORES_IN_MEMORY"]
     and c["HEADS_PER_BLOCK"] == 2, HOPPER),
    (128, "persistent", lambda c, d: c["PERSISTENT"] and c["HEADS_PER_BLOCK"] == 1, BOTH),
    (128, "persistent-2-heads", lambda c, d: c["PERSISTENT"] and c["HEADS_PER_BLOCK"] == 2,
     HOPPER),
    (128, "8-worker-warps", lambda c, d: c["num_worker_warps"] == 8 and c["HEADS_PER_BLOCK"] == 2,
     BOTH),
]


@pytest.mark.parametrize("dstate, kind, pick, arch",
                         kind_params("compute_out", KINDS, default_dstates=(128, 256)))
def test_compile_variant_kinds(dstate, kind, pick, arch):
    compile_kind("compute_out", dstate, kind, pick, arch)


# 32- or 64-bit indexing --------------------------------------------------------------------------

def test_index_width_follows_the_tensor_sizes():
    """Launches on tensors under 2**31 elements use the 32-bit-indexed twin of a kernel (the
    compiler only uses TMA loads with 32-bit indices); larger ones keep 64-bit indexing."""
    small = (torch.empty(4, 8, device="meta"),)
    huge = (torch.empty(2**31, device="meta"),)
    twin = fit_index_width(compute_out_kernel, small)
    assert fit_index_width(compute_out_kernel, huge) is compute_out_kernel
    assert twin is fit_index_width(compute_out_kernel, small) and twin is not compute_out_kernel
    wide = kernel_function(compute_out_kernel).__annotations__
    narrow = kernel_function(twin).__annotations__
    assert [n for n, a in wide.items() if a is ct.IndexedWithInt64]
    assert not any(a is ct.IndexedWithInt64 for a in narrow.values())
    assert kernel_function(twin).__code__ is kernel_function(compute_out_kernel).__code__
