"""ops/kernels/backward/bwd_compute_out.py (the gradients of compute_out) against its specification,
``reference.backward.compute_out_backward`` in float64, every config of its search space against
the default, reproducibility, the input checks, and its ahead-of-time compilation.

The kernels take dA_cumsum in log2 units (as the forward kernels store it) and return ddA_cumsum
in natural-log units, like the reference. The reference's dB and dC are per head; they are
summed over each group's heads (``_sum_groups``) to compare with the kernel's (b, L, g, n).
Every output is NaN-poisoned first, so an element the kernels miss fails.

Tolerances, relative in norm:
  float32 inputs   float32 operands and accumulation: a few ulps per operation, summed over a
                   chunk's tokens and the dstate / headdim terms: observed <= 1e-6; bound 1e-5.
  float16 inputs   the same (the products with computed operands take float32 ones; C B^T and
                   dy x^T take the float16 inputs exactly): bound 1e-5, with dy scaled by 1e3
                   as under loss scaling.
  bfloat16 inputs  G, dC B^T, w dy and the entry state are rounded to bf16 (8 significant bits)
                   as tensor-core operands: dx, dB, dC and dentry observed ~2e-3, bound 1e-2.
                   ddt and ddA come from the exact-operand products C B^T and dy x^T (and, for
                   ddA, dy times the entry state, exact when that is bf16 itself): bound 1e-5;
                   with float32 entry states ddA takes the bf16-rounded state: 1e-2.
Variants against the default (every config of ``search_space`` at one small shape): float32
1e-5 (other tile boundaries sum in another order), bfloat16 4e-3 (as in tests/kernels/helpers.py:
a last-bit difference before a bf16 rounding can move an operand by one step, rarely).
"""
import pytest
import torch

from ops.kernels.backward import bwd_compute_out as mod
from ops.kernels.backward.bwd_compute_out import bwd_compute_out, bwd_compute_out_plan
from reference import chunked
from reference.backward import _sum_groups, compute_out_backward
from reference.common import LOG2E
from reference.problems import make_problem
from reference.validate import rel_err

from .helpers import DEVICES, space_cases

NAMES = ("dx", "dB", "dC", "ddt_out", "ddA_cumsum", "dentry")


def problem(dtype, seqlen=77, chunk=32, headdim=16, dstate=32, nheads=4, ngroups=2,
            seq=(20, 32), entry_dtype=None, dy_scale=1.0, seed=3):
    """Inputs as the kernels take them (dt_out, dA_cumsum float32, log2; entry states rounded to
    ``entry_dtype``, x's by default) and the reference's gradients in float64 from those same
    values."""
    kw = make_problem(batch=2, seqlen=seqlen, nheads=nheads, headdim=headdim, ngroups=ngroups,
                      dstate=dstate, dtype=dtype, seed=seed,
                      seq_boundaries=list(seq) if seq else None)
    dt_out, dA = chunked.chunk_cumsum(kw["dt"].double(), kw["A"].double(), chunk,
                                      kw["dt_bias"].double(), True, (0.0, 1.5))
    dt_out, dA = dt_out.float(), dA.float()
    entry, _ = chunked.fwd_pass_state(kw["x"].double(), kw["B"].double(), dt_out.double(),
                                      dA.double(), kw["initial_states"].double(), kw.get("seq_idx"))
    entry = entry.to(entry_dtype or dtype)
    g = torch.Generator().manual_seed(seed + 1)
    dy = (torch.randn(kw["x"].shape, generator=g) * dy_scale).to(dtype)
    inputs = dict(dy=dy, x=kw["x"], B=kw["B"], C=kw["C"], dt_out=dt_out,
                  dA_cumsum=(dA.double() * LOG2E).float(), entry_states=entry,
                  seq_idx=kw.get("seq_idx"))
    f64 = lambda t: t.double()
    want = list(compute_out_backward(f64(dy), f64(kw["x"]), f64(kw["B"]), f64(kw["C"]),
                                     f64(dt_out), f64(dA), f64(entry), kw.get("seq_idx")))
    want[1], want[2] = _sum_groups(want[1], ngroups), _sum_groups(want[2], ngroups)
    return inputs, want


def on(inputs, device):
    return {k: None if v is None else v.to(device) for k, v in inputs.items()}


def tolerance(dtype, name, entry_dtype):
    if dtype != torch.bfloat16 or name == "ddt_out":
        return 1e-5
    if name == "ddA_cumsum" and entry_dtype != torch.float32:
        return 1e-5
    return 1e-2


# (problem, config): the small shapes' default is one head per block (few blocks), so the cases
# also take a block of two heads summing in registers, alone (the whole group: dB and dC written
# directly) and as one of two partials per group; 16-token tiles with two tiles of the last
# chunk wholly past the sequence (their ddt and ddA written as zeros).
CASES = [
    pytest.param(dict(), {}, id="packed-ragged-g2"),
    pytest.param(dict(seq=None, seqlen=64, ngroups=1), dict(HEADS_PER_BLOCK=2),
                 id="whole-chunks-g1-two-partials-of-two-heads"),
    pytest.param(dict(headdim=24, dstate=40, seq=(5, 50)), {}, id="odd-sizes"),
    pytest.param(dict(seqlen=150, chunk=64, seq=(10, 64, 100)),
                 dict(BLOCK_T=16, HEADS_PER_BLOCK=2, ENTRY_BLOCK_N=16),
                 id="chunk64-tiles16-seq-in-and-at-chunks-whole-group"),
    pytest.param(dict(seqlen=1, chunk=16), {}, id="L1"),
    # C B^T from memory: several tiles per chunk (row and column tiles differ), the whole group
    # of two heads in a block, tiles wholly past the sequence in the last chunk
    pytest.param(dict(seqlen=150, chunk=64, seq=(10, 64, 100)),
                 dict(BLOCK_T=16, HEADS_PER_BLOCK=2, SCORES_IN_MEMORY=True, PAIRS=False),
                 id="scores-in-memory-tiles16-whole-group"),
    pytest.param(dict(seqlen=77), dict(BLOCK_T=16, SCORES_IN_MEMORY=True, PAIRS=False),
                 id="scores-in-memory-packed-ragged-head-partials"),
    # the token kernel alone, as first written (both roles of each tile, C B^T in registers)
    pytest.param(dict(seqlen=150, chunk=64, seq=(10, 64, 100)),
                 dict(BLOCK_T=16, HEADS_PER_BLOCK=2, PAIRS=False),
                 id="token-kernel-alone-tiles16-seq-whole-group"),
    # the pair kernel first, the token work fused in one launch after it: several pairs per
    # chunk, pairs wholly past the sequence, its heads in two splits (their d(C B^T) partials
    # added) and the token kernel's in one, and the other way round
    pytest.param(dict(seqlen=150, chunk=64, seq=(10, 64, 100)),
                 dict(BLOCK_T=16, HEADS_PER_BLOCK=2, PAIRS=True, PAIR_HEADS_PER_BLOCK=1,
                      SPLIT_DX=False),
                 id="pairs-fused-tiles16-seq-two-pair-splits"),
    pytest.param(dict(seqlen=77), dict(PAIRS=True, PAIR_HEADS_PER_BLOCK=2, SPLIT_DX=False),
                 id="pairs-fused-packed-ragged-one-tile-per-chunk"),
    pytest.param(dict(seq=None, seqlen=64, ngroups=1), dict(BLOCK_T=16, SPLIT_DX=False),
                 id="pairs-fused-whole-chunks-g1"),
    # after the pair kernel (the default), the states' products and dB, dC in one launch, dx,
    # ddt and ddA in another with one head per block: several tiles per chunk, tiles past the
    # sequence, packed sequences; head splits; the dx launch and the pair kernel at hints
    pytest.param(dict(seqlen=150, chunk=64, seq=(10, 64, 100)),
                 dict(BLOCK_T=16, HEADS_PER_BLOCK=1, PAIRS=True, SPLIT_DX=True),
                 id="split-dx-tiles16-seq-head-partials"),
    pytest.param(dict(seq=None, seqlen=64, ngroups=1),
                 dict(HEADS_PER_BLOCK=4, DX_OCCUPANCY=2, DX_WORKER_WARPS=8, PAIR_OCCUPANCY=2,
                      PAIR_WORKER_WARPS=4),
                 id="split-dx-whole-group-of-four-hints"),
    # two heads per dx block (a whole group of two), tiles past the sequence, packed sequences
    pytest.param(dict(seqlen=150, chunk=64, seq=(10, 64, 100)),
                 dict(BLOCK_T=16, DX_HEADS_PER_BLOCK=2), id="split-dx-two-heads-per-dx-block"),
    # the dx launch's loads before its loop and in the loop's order, one and two heads per dx
    # block, head splits of the states launch, tiles past the sequence
    pytest.param(dict(seqlen=150, chunk=64, seq=(10, 64, 100)),
                 dict(BLOCK_T=16, HEADS_PER_BLOCK=1, DX_HEADS_PER_BLOCK=1, DX_LOADS_FIRST=True),
                 id="split-dx-loads-first-one-head"),
    pytest.param(dict(seqlen=150, chunk=64, seq=(10, 64, 100)),
                 dict(BLOCK_T=16, DX_HEADS_PER_BLOCK=2, DX_LOADS_FIRST=False),
                 id="split-dx-loads-in-order-two-heads"),
    # the states launch over dstate slices (two of 16 columns, four of 16 at dstate 64), with
    # head splits, with one and two heads per dx block
    pytest.param(dict(seqlen=150, chunk=64, seq=(10, 64, 100)),
                 dict(BLOCK_T=16, HEADS_PER_BLOCK=1, STATES_SLICES=2, DX_HEADS_PER_BLOCK=1),
                 id="split-dx-two-dstate-slices-head-partials"),
    pytest.param(dict(seqlen=150, chunk=64, seq=(10, 64, 100), dstate=64),
                 dict(BLOCK_T=16, STATES_SLICES=4), id="split-dx-four-dstate-slices"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case, config", CASES)
def test_matches_the_reference(device, dtype, case, config):
    dy_scale = 1e3 if dtype == torch.float16 else 1.0
    inputs, want = problem(dtype, dy_scale=dy_scale, **case)
    got = bwd_compute_out(**on(inputs, device), poison=True, config=config)
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape, name
        assert rel_err(g, w) < tolerance(dtype, name, dtype), name


# The token kernel's optional terms: the chunk states' gradients (dS) and the skip (D) ------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("D_dims", [1, 2], ids=["D-1d", "D-2d"])
@pytest.mark.parametrize("case, config", [
    CASES[0], CASES[3], *(c for c in CASES if c.id in (
        "scores-in-memory-tiles16-whole-group", "token-kernel-alone-tiles16-seq-whole-group",
        "pairs-fused-tiles16-seq-two-pair-splits", "split-dx-tiles16-seq-head-partials",
        "split-dx-whole-group-of-four-hints", "split-dx-two-heads-per-dx-block",
        "split-dx-loads-first-one-head", "split-dx-loads-in-order-two-heads",
        "split-dx-two-dstate-slices-head-partials", "split-dx-four-dstate-slices"))])
def test_fused_states_and_skip_match_the_reference(device, dtype, D_dims, case, config):
    """With dS and D the token kernel's outputs are compute_out's gradients plus
    ``chunk_states_backward``'s (dx, dB, ddt_out, ddA_cumsum; ddA at each chunk's last token
    with its tile sums ddA_tiles added) plus the skip's (dx += D dy; dD = sum dy x), all in
    float64; dx comes in x's dtype (float32 for float16, whose dy is loss-scaled). dS is given as ``ops/backward.py`` stores it (bf16 for bf16
    inputs) and the reference takes those values. Tolerances: float32 and float16 1e-5 (float32
    products), bf16 1e-2 for every output (dS, x
    and B enter the states' products in bf16, and dx is rounded to bf16)."""
    from ops.runtime.launch import run
    from reference.backward import chunk_states_backward
    dy_scale = 1e3 if dtype == torch.float16 else 1.0
    # float16 under loss scaling: dx would overflow float16, so it comes in float32 there
    dx_dtype = torch.float32 if dtype == torch.float16 else dtype
    inputs, want = problem(dtype, dy_scale=dy_scale, **case)
    x, dy = inputs["x"], inputs["dy"]
    b, L, h, p = x.shape
    nchunks = inputs["dt_out"].shape[2]
    g = torch.Generator().manual_seed(11)
    dS = torch.randn(b, nchunks, h, p, inputs["B"].shape[3], generator=g)
    dS = dS.to(torch.bfloat16) if dtype == torch.bfloat16 else dS
    D = torch.randn((h,) if D_dims == 1 else (h, p), generator=g)
    f64 = lambda t: t.double()
    states = chunk_states_backward(f64(dS), f64(x), f64(inputs["B"]), f64(inputs["dt_out"]),
                                   f64(inputs["dA_cumsum"]) / LOG2E, inputs["seq_idx"])
    D_full = f64(D)[:, None] if D_dims == 1 else f64(D)
    ngroups = inputs["B"].shape[2]
    expected = dict(dx=want[0] + states[0] + f64(dy) * D_full,
                    dB=want[1] + _sum_groups(states[1], ngroups), dC=want[2],
                    ddt_out=want[3] + states[2], ddA_cumsum=want[4] + states[3],
                    dD=(f64(dy) * f64(x)).sum((0, 1, 3) if D_dims == 1 else (0, 1)))
    dx, dB_parts, dC_parts, ddt, ddA, ddA_tiles, dD_parts, _ = run(bwd_compute_out_plan(
        **on(inputs, device), poison=True, config=config, dS=dS.to(device), D=D.to(device),
        dx_dtype=dx_dtype))
    assert dx.dtype == dx_dtype
    ddA = ddA.clone()
    ddA[..., -1] += ddA_tiles.sum(-1)
    dD = dD_parts.sum((0, 1))
    got = dict(dx=dx, dB=dB_parts.sum(0), dC=dC_parts.sum(0), ddt_out=ddt, ddA_cumsum=ddA,
               dD=dD.sum(-1) if D_dims == 1 else dD)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for name, w in expected.items():
        assert got[name].shape == w.shape, name
        err = rel_err(got[name].cpu().double(), w)
        assert err < tol, (name, err)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", [dict(DX_LOADS_FIRST=False), dict(DX_LOADS_FIRST=True)],
                         ids=["loads-in-order", "loads-first"])
def test_skip_without_the_states_terms(device, config):
    """D without dS (the chunk states' gradients in a kernel of their own, FUSE_STATES=False):
    compute_out's gradients plus the skip's, dD's partials written by the dx launch, tiles past
    the sequence included. float32 inputs, float32 products: 1e-5."""
    from ops.runtime.launch import run
    inputs, want = problem(torch.float32, seqlen=150, chunk=64, seq=(10, 64, 100))
    x, dy = inputs["x"], inputs["dy"]
    D = torch.randn(x.shape[2], x.shape[3], generator=torch.Generator().manual_seed(5))
    dx, _, _, ddt, ddA, ddA_tiles, dD_parts, _ = run(bwd_compute_out_plan(
        **on(inputs, device), poison=True, config=dict(BLOCK_T=16, **config), D=D.to(device)))
    assert ddA_tiles is None
    expected = dict(dx=want[0] + dy.double() * D.double(), ddt=want[3], ddA=want[4],
                    dD=(dy.double() * x.double()).sum((0, 1)))
    got = dict(dx=dx, ddt=ddt, ddA=ddA, dD=dD_parts.sum((0, 1)))
    for name, w in expected.items():
        assert rel_err(got[name].cpu().double(), w) < 1e-5, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [True, False], ids=["dS-D", "D-only"])
@pytest.mark.parametrize("config", [
    pytest.param(dict(BLOCK_T=16, HEADS_PER_BLOCK=1, STATES_SLICES=2, DX_HEADS_PER_BLOCK=1),
                 id="head-partials-two-slices"),
    pytest.param(dict(BLOCK_T=16, DX_HEADS_PER_BLOCK=2), id="two-dx-heads")])
def test_split_launches_as_two_plans_equal_one(device, fused, config):
    """SPLIT_DX's two launches run as two plans (``launches="states"``, then ``"dx"`` given the
    first's outputs and no entry states, as ``ops/backward.py`` runs them to free the entry
    states before dx exists) give the one plan's outputs bitwise: the same launches on the
    same values. Outputs NaN-poisoned; bf16, packed sequences, tiles past the sequence."""
    from ops.runtime.launch import run
    inputs, _ = problem(torch.bfloat16, seqlen=150, chunk=64, seq=(10, 64, 100))
    inputs = on(inputs, device)
    b, L, h, p = inputs["x"].shape
    g = torch.Generator().manual_seed(13)
    extra = dict(D=torch.randn(h, generator=g).to(device), dx_dtype=torch.bfloat16)
    if fused:
        nchunks, n = inputs["dt_out"].shape[2], inputs["B"].shape[3]
        extra["dS"] = torch.randn(b, nchunks, h, p, n, generator=g).to(torch.bfloat16).to(device)
    one = run(bwd_compute_out_plan(**inputs, poison=True, config=config, launches="tokens",
                                   **extra))
    dB_parts, dC_parts, ddA_tiles, *states = run(bwd_compute_out_plan(
        **inputs, poison=True, config=config, launches="states", **extra))
    assert len(states) == 5 and (ddA_tiles is None) == (not fused)
    dx, ddt, ddA, dD_parts = run(bwd_compute_out_plan(
        **{**inputs, "entry_states": None}, poison=True, config=config, launches="dx",
        states=states, **extra))
    two = (dx, dB_parts, dC_parts, ddt, ddA, ddA_tiles, dD_parts)
    for name, a, c in zip(("dx", "dB", "dC", "ddt", "ddA", "ddA_tiles", "dD"), one, two,
                          strict=True):
        assert (a is None) == (c is None), name
        assert a is None or torch.equal(a, c), name


def test_optional_terms_are_checked():
    inputs, _ = problem(torch.bfloat16)
    b, L, h, p = inputs["x"].shape
    nchunks, n = inputs["dt_out"].shape[2], inputs["B"].shape[3]
    with pytest.raises(ValueError, match="dS must be"):
        bwd_compute_out_plan(**inputs, dS=torch.zeros(b, nchunks, h, p, n + 1))
    with pytest.raises(TypeError, match="dS must be contiguous"):
        bwd_compute_out_plan(**inputs, dS=torch.zeros(b, nchunks, h, p, n, dtype=torch.float16))
    with pytest.raises(ValueError, match="D must be"):
        bwd_compute_out_plan(**inputs, D=torch.zeros(h + 1))
    with pytest.raises(TypeError, match="dx_dtype"):
        bwd_compute_out_plan(**inputs, dx_dtype=torch.float16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_float32_entry_states(device, dtype):
    inputs, want = problem(dtype, entry_dtype=torch.float32)
    got = bwd_compute_out(**on(inputs, device), poison=True)
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert rel_err(g, w) < tolerance(dtype, name, torch.float32), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hb", [1, 2], ids=["head-partials", "whole-group"])
def test_bitwise_reproducible(device, hb):
    inputs, _ = problem(torch.bfloat16, seqlen=150, chunk=64)
    config = dict(BLOCK_T=32, HEADS_PER_BLOCK=hb)
    first = bwd_compute_out(**on(inputs, device), poison=True, config=config)
    second = bwd_compute_out(**on(inputs, device), poison=True, config=config)
    for name, a, b in zip(NAMES, first, second, strict=True):
        assert torch.equal(a, b), name


# Every config of the search space at one small shape, against the default ------------------------

VARIANT = dict(seqlen=150, chunk=64, seq=(10, 64, 100))
VARIANT_SHAPE = dict(batch=2, seqlen=150, chunk_size=64, headdim=16, dstate=32, nheads=4,
                     ngroups=2)


def variant_cases():
    space, params = space_cases(mod, VARIANT_SHAPE)
    assert {c["HEADS_PER_BLOCK"] for c in space} == {1, 2}, "both ways of summing dB and dC"
    assert {c["SCORES_IN_MEMORY"] for c in space} == {False, True}, "both ways to get C B^T"
    return params


def test_scores_in_memory_by_default_where_it_was_faster():
    """C B^T is read from memory by default where dstate's tile is 128 (faster on the H200 at
    dstate 128, slower at 64, level at 256: ``mod.scores_in_memory``), and the search space
    holds the other way at every dstate."""
    for dstate, want in ((16, False), (64, False), (96, True), (128, True), (256, False)):
        shape = dict(VARIANT_SHAPE, dstate=dstate)
        assert mod.default_config(**shape)["SCORES_IN_MEMORY"] is want, dstate
        assert {c["SCORES_IN_MEMORY"] for c in mod.search_space(**shape)} == {False, True}


def test_states_fused_after_the_pair_kernel_else_but_at_dstate_256_from_16k_tokens():
    """After the pair kernel (the default) the token kernel always does bwd_chunk_states' work
    too; without it, except at dstate 256 from 16K tokens (batch x seqlen), where the H200
    measured the unfused path faster (``mod.fuse_states``). The search space holds the other
    way at every shape."""
    for dstate, batch, seqlen, want in ((128, 1, 65536, True), (64, 8, 2048, True),
                                        (256, 1, 4096, True), (256, 1, 16384, False),
                                        (256, 8, 2048, False), (200, 1, 65536, False),
                                        (512, 1, 65536, True), (256, 1, None, False)):
        tokens = None if seqlen is None else batch * seqlen
        assert mod.fuse_states(dstate, tokens) is want, (dstate, tokens)
        assert mod.fuse_states(dstate, tokens, pairs=True) is True
        shape = dict(VARIANT_SHAPE, dstate=dstate, batch=batch, seqlen=seqlen)
        assert mod.default_config(**shape)["FUSE_STATES"] is True, shape
        assert {c["FUSE_STATES"] for c in mod.search_space(**shape)} == {False, True}
        # a config that turns the pair kernel off gets the token kernel's own rule, unless it
        # sets FUSE_STATES itself
        assert mod.resolved_config(dict(PAIRS=False), **shape)["FUSE_STATES"] is want, shape
        assert mod.resolved_config(dict(PAIRS=False, FUSE_STATES=True), **shape)["FUSE_STATES"]


def test_the_pair_kernel_runs_first_by_default_with_fewer_larger_blocks():
    """PAIRS by default (faster on the H200 at every shape timed but one, level there); the
    search space holds the token kernel alone. At the 2.7B training shape the pair kernel takes
    40 heads per block (its 384 pair blocks per head block times 2: ~6 per multiprocessor),
    the token kernel 20 (its target of 6 blocks per multiprocessor takes more splits)."""
    shape = dict(chunk_size=128, headdim=64, dstate=128, nheads=80, ngroups=1, batch=8,
                 seqlen=2048)
    cfg = mod.default_config(**shape)
    assert cfg["PAIRS"] is True and cfg["PAIR_HEADS_PER_BLOCK"] == 40
    assert cfg["HEADS_PER_BLOCK"] == 20
    assert {c["PAIRS"] for c in mod.search_space(**shape)} == {False, True}
    assert {c["PAIR_HEADS_PER_BLOCK"] for c in mod.search_space(**shape)} == {20, 40, 80}


def test_dx_in_a_launch_of_its_own_after_the_pair_kernel_by_default():
    """SPLIT_DX by default, the dx launch as ``mod.dx_config`` says: up to dstate's tile 128 two
    heads per block (one where a group's heads are odd) at two blocks per multiprocessor (four
    for one head), the loads first; beyond, one head per block, two blocks of eight worker
    warps, the loads in order (faster on the H200 each where measured). The states launch over
    slices of 128 dstate columns. A config turning the pair kernel off gets the token kernel
    alone (SPLIT_DX follows PAIRS unless set; set with PAIRS off, it is refused); the search
    space holds the fused token kernel after the pair kernel, the dx launch the other way and
    the other number of slices."""
    small = dict(DX_OCCUPANCY=2, DX_WORKER_WARPS=None, DX_HEADS_PER_BLOCK=2, DX_LOADS_FIRST=True)
    odd = dict(DX_OCCUPANCY=4, DX_WORKER_WARPS=None, DX_HEADS_PER_BLOCK=1, DX_LOADS_FIRST=True)
    large = dict(DX_OCCUPANCY=2, DX_WORKER_WARPS=8, DX_HEADS_PER_BLOCK=1, DX_LOADS_FIRST=False)
    for dstate, dx, slices in ((16, small, 1), (64, small, 1), (128, small, 1), (256, large, 2),
                               (512, large, 4)):
        shape = dict(VARIANT_SHAPE, dstate=dstate, nheads=8, ngroups=2)
        cfg = mod.default_config(**shape)
        assert cfg["SPLIT_DX"] is True and cfg["PAIRS"] is True, dstate
        assert {k: cfg[k] for k in dx} == dx and cfg["STATES_SLICES"] == slices, dstate
        if dx is small:
            odd_cfg = mod.default_config(**dict(shape, nheads=6))       # 3 heads per group
            assert {k: odd_cfg[k] for k in odd} == odd
        space = mod.search_space(**shape)
        assert len(space) <= 16
        assert {(c["PAIRS"], c["SPLIT_DX"]) for c in space} == {
            (True, True), (True, False), (False, False)}, dstate
        split = [c for c in space if c["SPLIT_DX"]]
        assert {c["DX_HEADS_PER_BLOCK"] for c in split} == {1, 2}, dstate
        assert {c["STATES_SLICES"] for c in split} == (
            {1} if dstate == 16 else {slices, 2 if slices == 1 else 1}), dstate
        assert mod.resolved_config(dict(PAIRS=False), **shape)["SPLIT_DX"] is False
        with pytest.raises(ValueError, match="SPLIT_DX needs the pair kernel"):
            mod.resolved_config(dict(PAIRS=False, SPLIT_DX=True), **shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name, config", variant_cases())
def test_variant_matches_the_default(device, dtype_name, config):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    inputs, _ = problem(dtype, **VARIANT)
    inputs = on(inputs, device)
    want = bwd_compute_out(**inputs, poison=True)
    got = bwd_compute_out(**inputs, poison=True, config=config)
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert rel_err(g, w) < (1e-5 if dtype == torch.float32 else 4e-3), name


# Input checks ------------------------------------------------------------------------------------

def test_refuses_bad_inputs():
    from ops.runtime.launch import run
    inputs, _ = problem(torch.float32, seqlen=40)
    bad = [
        (dict(dy=inputs["dy"].to(torch.bfloat16)), TypeError, "dy"),
        (dict(B=inputs["B"].double()), TypeError, "B"),
        (dict(x=inputs["x"].double(), dy=inputs["dy"].double(), B=inputs["B"].double(),
              C=inputs["C"].double()), TypeError, "x"),
        (dict(C=inputs["C"][:, :, :1]), ValueError, "C"),
        (dict(dt_out=inputs["dt_out"].double()), TypeError, "dt_out"),
        (dict(dA_cumsum=inputs["dA_cumsum"][..., :16]), ValueError, "dA_cumsum"),
        (dict(entry_states=inputs["entry_states"][:, :1]), ValueError, "entry_states"),
        (dict(entry_states=inputs["entry_states"].half()), TypeError, "entry_states"),
        (dict(seq_idx=inputs["seq_idx"][:, :5]), ValueError, "seq_idx"),
        (dict(x=inputs["x"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "x"),
    ]
    for change, error, name in bad:
        with pytest.raises(error, match=name):
            bwd_compute_out_plan(**{**inputs, **change})
    with pytest.raises(ValueError, match="HEADS_PER_BLOCK"):
        bwd_compute_out_plan(**inputs, config=dict(HEADS_PER_BLOCK=3))
    with pytest.raises(ValueError, match="BLOCK_T"):
        bwd_compute_out_plan(**inputs, config=dict(BLOCK_T=64))     # more than the chunk (32)
    with pytest.raises(ValueError, match="unknown config keys"):
        bwd_compute_out_plan(**inputs, config=dict(BLOCK_M=32))
    with pytest.raises(ValueError, match="SPLIT_DX needs the pair kernel"):
        bwd_compute_out_plan(**inputs, config=dict(SPLIT_DX=True, PAIRS=False))
    with pytest.raises(ValueError, match="DX_WORKER_WARPS"):
        bwd_compute_out_plan(**inputs, config=dict(SPLIT_DX=True, DX_WORKER_WARPS=6))
    with pytest.raises(ValueError, match="DX_OCCUPANCY"):
        bwd_compute_out_plan(**inputs, config=dict(SPLIT_DX=True, DX_OCCUPANCY=0))
    with pytest.raises(ValueError, match="PAIR_OCCUPANCY"):
        bwd_compute_out_plan(**inputs, config=dict(PAIR_OCCUPANCY=True))
    with pytest.raises(ValueError, match="PAIR_WORKER_WARPS"):
        bwd_compute_out_plan(**inputs, config=dict(PAIR_WORKER_WARPS=2))
    with pytest.raises(TypeError, match="PAIRS must be True or False"):
        bwd_compute_out_plan(**inputs, config=dict(PAIRS="no"))
    with pytest.raises(TypeError, match="PAIR_HEADS_PER_BLOCK must be an int"):
        bwd_compute_out_plan(**inputs, config=dict(PAIR_HEADS_PER_BLOCK=2.0))
    with pytest.raises(TypeError, match="DX_HEADS_PER_BLOCK must be an int"):
        bwd_compute_out_plan(**inputs, config=dict(DX_HEADS_PER_BLOCK=True))
    with pytest.raises(ValueError, match="DX_HEADS_PER_BLOCK"):
        bwd_compute_out_plan(**inputs, config=dict(DX_HEADS_PER_BLOCK=3))
    for slices in (3, 4, 0):                        # dstate 32: at most two slices of 16
        with pytest.raises(ValueError, match="STATES_SLICES must be a power of two"):
            bwd_compute_out_plan(**inputs, config=dict(STATES_SLICES=slices))
    for slices in (True, 2.0, None):
        with pytest.raises(TypeError, match="STATES_SLICES must be an int"):
            bwd_compute_out_plan(**inputs, config=dict(STATES_SLICES=slices))
    # the split launches as two plans: only with SPLIT_DX, the states' outputs with "dx" alone
    with pytest.raises(ValueError, match="launches must be"):
        bwd_compute_out_plan(**inputs, launches="token")
    with pytest.raises(ValueError, match="needs SPLIT_DX"):
        bwd_compute_out_plan(**inputs, launches="states", config=dict(SPLIT_DX=False))
    with pytest.raises(ValueError, match="states .* goes with launches='dx'"):
        bwd_compute_out_plan(**inputs, launches="dx")
    states = run(bwd_compute_out_plan(**inputs, launches="states"))[3:]
    with pytest.raises(ValueError, match="states .* goes with launches='dx'"):
        bwd_compute_out_plan(**inputs, launches="tokens", states=states)
    with pytest.raises(ValueError, match="states must be the five tensors"):
        bwd_compute_out_plan(**inputs, launches="dx", states=states[:4])
    with pytest.raises(ValueError, match=r"states\[0\] must be the states' ddt terms"):
        bwd_compute_out_plan(**inputs, launches="dx", states=states,     # one slice, not two
                             config=dict(STATES_SLICES=2))
    with pytest.raises(ValueError, match=r"states\[3\] must be dG's column sums"):
        bwd_compute_out_plan(**inputs, launches="dx",
                             states=(*states[:3], states[3][:, :1], states[4]))
    with pytest.raises(TypeError, match="entry_states must be a torch.Tensor"):
        bwd_compute_out_plan(**{**inputs, "entry_states": None}, launches="states")


# Ahead-of-time compilation (both kernels) ------------------------------------------------------

def meta(*shape, dt=torch.float32):
    return torch.empty(shape, dtype=dt, device="meta")


def meta_plan(headdim=64, dstate=128, dtype=torch.bfloat16, seqlen=16384, nheads=80, ngroups=1,
              chunk=256, seq=True, config=None, fused=True):
    """The launch at a Mamba-2 layer of a ~2.7B model (by default), on meta tensors; ``fused``:
    with dS and D, as ``ops/backward.py`` launches it (dx in x's dtype)."""
    nchunks = -(-seqlen // chunk)
    x = meta(1, seqlen, nheads, headdim, dt=dtype)
    B = meta(1, seqlen, ngroups, dstate, dt=dtype)
    states = meta(1, nchunks, nheads, headdim, dstate, dt=dtype)
    dS = meta(1, nchunks, nheads, headdim, dstate,            # as ops/backward.py stores it
              dt=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    extra = dict(dS=dS, D=meta(nheads), dx_dtype=dtype) if fused else {}
    return bwd_compute_out_plan(x, x, B, B, meta(1, nheads, nchunks, chunk),
                                meta(1, nheads, nchunks, chunk), states,
                                meta(1, seqlen, dt=torch.int32) if seq else None, config=config,
                                **extra)


COMPILE = [pytest.param(dict(), arch, id=f"layer-{arch}") for arch in ("sm_80", "sm_90", "sm_100")]
COMPILE += [pytest.param(dict(headdim=48, dstate=40, dtype=torch.float16, seq=False, ngroups=2,
                              config=dict(HEADS_PER_BLOCK=1)), "sm_90", id="odd-fp16-heads1-sm_90"),
            pytest.param(dict(config=dict(INDEX64=True)), "sm_90", id="layer-int64-sm_90"),
            pytest.param(dict(fused=False), "sm_90", id="layer-unfused-sm_90"),
            pytest.param(dict(config=dict(SCORES_IN_MEMORY=True)), "sm_90",
                         id="layer-scores-in-memory-sm_90")]
COMPILE += [pytest.param(dict(chunk=128, config=dict(SPLIT_DX=False)), arch,
                         id=f"layer-pairs-fused-{arch}") for arch in ("sm_80", "sm_90", "sm_100")]
COMPILE += [pytest.param(dict(chunk=128), arch, id=f"layer-split-dx-{arch}")
            for arch in ("sm_80", "sm_90", "sm_100")]
COMPILE += [pytest.param(dict(chunk=128, dstate=256), arch, id=f"layer-split-dx-dstate256-{arch}")
            for arch in ("sm_90", "sm_100")]          # two dstate slices, one dx head per block
COMPILE += [pytest.param(dict(chunk=128, config=dict(DX_HEADS_PER_BLOCK=1, DX_LOADS_FIRST=False,
                                                     STATES_SLICES=2)), "sm_90",
                         id="layer-split-dx-one-head-in-order-two-slices-sm_90")]


@pytest.mark.parametrize("shape, arch", COMPILE)
def test_compiles(shape, arch):
    from ops.tools.aot import compile_cubin
    plan = meta_plan(**shape)
    for step in plan.before + (plan,):
        assert compile_cubin(step.kernel, step.args, arch)[:4] == b"\x7fELF"
