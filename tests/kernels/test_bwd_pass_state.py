"""ops/kernels/backward/bwd_pass_state.py (the reverse pass over chunks) against its specification,
``reference.backward.state_passing_backward`` in float64.

The kernel takes dA_cumsum in log2 units (as the forward kernels store it) and returns the
gradient of dA_cumsum at each chunk's last token in natural-log units, like the reference.
Tolerances, relative in norm: float32 1e-5 (a float32 recurrence over a few chunks; observed
~1e-7), bf16 entry states 1e-5 as well (they are read as they are, exactly, into float32).
"""
import pytest
import torch

from ops.kernels.backward import bwd_pass_state as mod
from ops.kernels.backward.bwd_pass_state import bwd_pass_state, bwd_pass_state_plan
from reference import chunked
from reference.backward import state_passing_backward
from reference.common import LOG2E
from reference.problems import make_problem
from reference.validate import rel_err

from .helpers import DEVICES


def problem(headdim=16, dstate=32, seq=True, entry_dtype=torch.float32, seed=6):
    kw = make_problem(batch=2, seqlen=77, nheads=4, headdim=headdim, ngroups=2, dstate=dstate,
                      dtype=torch.float32, seed=seed, seq_boundaries=[16, 37] if seq else None)
    dt_out, dA = chunked.chunk_cumsum(kw["dt"], kw["A"], 16, kw["dt_bias"], True, (0.0, 1.5))
    entry, final = chunked.fwd_pass_state(kw["x"], kw["B"], dt_out, dA, kw["initial_states"],
                                          kw.get("seq_idx"))
    g = torch.Generator().manual_seed(seed)
    dentry, dfinal = torch.randn(entry.shape, generator=g), torch.randn(final.shape, generator=g)
    return dict(dentry=dentry, dfinal=dfinal, entry=entry.to(entry_dtype), final=final, dA=dA,
                seq_idx=kw.get("seq_idx"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [
    pytest.param(dict(), id="packed"),
    pytest.param(dict(seq=False), id="one-sequence"),
    pytest.param(dict(headdim=48, dstate=40), id="odd-sizes"),
    pytest.param(dict(entry_dtype=torch.bfloat16), id="bf16-entry"),
    pytest.param(dict(headdim=64, dstate=256), id="several-tiles"),
])
@pytest.mark.parametrize("with_dfinal", [True, False], ids=["dfinal", "no-dfinal"])
def test_matches_the_reference(device, case, with_dfinal):
    p = problem(**case)
    dfinal = p["dfinal"] if with_dfinal else None
    ref_dfinal = None if dfinal is None else dfinal.double()
    want = state_passing_backward(p["dentry"].double(), ref_dfinal, p["entry"].double(),
                                  p["final"].double(), p["dA"].double(), p["seq_idx"])
    to = lambda t: None if t is None else t.to(device)
    got = bwd_pass_state(to(p["dentry"]), to(dfinal), to(p["entry"]), to((p["dA"] * LOG2E).float()),
                         to(p["seq_idx"]), poison=True)
    for g, w in zip(got, (want[0], want[1][..., -1], want[2]), strict=True):
        assert g.dtype == torch.float32 and rel_err(g.cpu(), w) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [
    pytest.param(dict(), id="packed"),
    pytest.param(dict(seq=False, dtype=torch.bfloat16), id="one-sequence-bf16"),
    pytest.param(dict(headdim=48, dstate=40, seqlen=70), id="odd-sizes-ragged"),
    pytest.param(dict(headdim=64, dstate=256, block_t=16), id="several-tiles-token-tiles"),
])
def test_fused_entry_matches_the_reference(device, case):
    """FUSE_ENTRY: dentry formed in the walk from dy and C, against the float64 reference of
    both steps (compute_out's dentry, then the pass). Tolerances: float32 1e-5 as above; bf16
    operands 5e-3 (w dy rounded to bf16 for the product, 2**-9 relative per element; observed
    1.6e-3)."""
    from reference.backward import compute_out_backward
    dtype, seqlen = case.get("dtype", torch.float32), case.get("seqlen", 77)
    kw = make_problem(batch=2, seqlen=seqlen, nheads=4, headdim=case.get("headdim", 16),
                      ngroups=2, dstate=case.get("dstate", 32), dtype=torch.float32, seed=9,
                      seq_boundaries=None if case.get("seq") is False else [16, 37])
    seq_idx = kw.get("seq_idx")
    dt_out, dA = chunked.chunk_cumsum(kw["dt"], kw["A"], 16, kw["dt_bias"], True, (0.0, 1.5))
    entry, final = chunked.fwd_pass_state(kw["x"], kw["B"], dt_out, dA, kw["initial_states"],
                                          seq_idx)
    g = torch.Generator().manual_seed(9)
    dy = torch.randn(kw["x"].shape, generator=g).to(dtype)
    dfinal = torch.randn(final.shape, generator=g)
    C = kw["C"].to(dtype)
    dentry = compute_out_backward(dy.double(), kw["x"].double(), kw["B"].double(), C.double(),
                                  dt_out.double(), dA.double(), entry.double(), seq_idx)[-1]
    want = state_passing_backward(dentry, dfinal.double(), entry.double(), final.double(),
                                  dA.double(), seq_idx)
    to = lambda t: None if t is None else t.to(device)
    config = dict(FUSE_ENTRY=True, ENTRY_BLOCK_T=case.get("block_t", 64))
    got = bwd_pass_state(None, to(dfinal), to(entry), to((dA * LOG2E).float()), to(seq_idx),
                         poison=True, config=config, dy=to(dy), C=to(C))
    tol = 5e-3 if dtype == torch.bfloat16 else 1e-5
    for g_, w in zip(got, (want[0], want[1][..., -1], want[2]), strict=True):
        assert rel_err(g_.cpu(), w) < tol, rel_err(g_.cpu(), w)


def test_fused_entry_checks_its_inputs():
    p = problem()
    args = (p["dentry"], p["dfinal"], p["entry"], (p["dA"] * LOG2E).float(), p["seq_idx"])
    dy = torch.randn(2, 77, 4, 16)
    C = torch.randn(2, 77, 2, 32)
    fused = dict(FUSE_ENTRY=True)
    with pytest.raises(ValueError, match="pass both"):
        bwd_pass_state(*args, config=fused, dy=dy)
    with pytest.raises(ValueError, match="dy must be"):
        bwd_pass_state(*args, config=fused, dy=dy[:, :, :2], C=C)
    with pytest.raises(ValueError, match="C must be"):
        bwd_pass_state(*args, config=fused, dy=dy, C=C[..., :16])
    with pytest.raises(ValueError, match="chunks of 16"):
        bwd_pass_state(*args, config=fused, dy=dy[:, :40], C=C[:, :40])
    with pytest.raises(ValueError, match="contiguous"):
        bwd_pass_state(*args, config=fused, dy=dy.transpose(0, 1).contiguous().transpose(0, 1),
                       C=C)
    with pytest.raises(ValueError, match="ENTRY_BLOCK_T"):
        bwd_pass_state(*args, config=dict(FUSE_ENTRY=True, ENTRY_BLOCK_T=24), dy=dy, C=C)
    with pytest.raises(ValueError, match="dentry is required"):
        bwd_pass_state(None, *args[1:])


@pytest.mark.parametrize("arch, walk", [(arch, False) for arch in ("sm_80", "sm_90", "sm_100")]
                         + [("sm_90", True), ("sm_100", True)])
def test_fused_entry_compiles(arch, walk):
    """At a ~2.7B layer (80 heads of 64 x 128, one group), bf16, chunk 256; ``walk``: with
    ``walk_config``'s keys and no dinitial (a layer without initial states), as the backward
    runs it."""
    from ops.tools.aot import compile_cubin
    meta = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device="meta")
    bf = torch.bfloat16
    config = (mod.walk_config(headdim=64, dstate=128, chunk_size=256, dtype=bf) if walk
              else dict(FUSE_ENTRY=True))
    plan = bwd_pass_state_plan(None, meta(1, 80, 64, 128), meta(1, 64, 80, 64, 128, dt=bf),
                               meta(1, 80, 64, 256), meta(1, 16384, dt=torch.int32),
                               config=config, ds_dtype=bf,
                               dy=meta(1, 16384, 80, 64, dt=bf), C=meta(1, 16384, 1, 128, dt=bf),
                               with_dinitial=not walk)
    assert compile_cubin(plan.kernel, plan.args, arch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fuse", [False, True], ids=["dentry", "fused-entry"])
def test_without_dinitial_the_walk_stops_at_chunk_0(device, fuse):
    """``with_dinitial=False`` (a layer without initial states): the same dS and partials of
    d dA[last], bit for bit, and no dinitial (the walk skips chunk 0's dentry, which only
    dinitial reads)."""
    p = problem()
    from ops.runtime.launch import run
    dy = torch.randn(2, 77, 4, 16, generator=torch.Generator().manual_seed(2))
    C = torch.randn(2, 77, 2, 32, generator=torch.Generator().manual_seed(3))
    on = lambda t: None if t is None else t.to(device)
    extra = dict(config=dict(FUSE_ENTRY=True, ENTRY_BLOCK_T=16), dy=on(dy), C=on(C)) if fuse else {}
    args = (None if fuse else on(p["dentry"]), on(p["dfinal"]), on(p["entry"]),
            on((p["dA"] * LOG2E).float()), on(p["seq_idx"]))
    full = run(bwd_pass_state_plan(*args, poison=True, **extra))
    short = run(bwd_pass_state_plan(*args, poison=True, with_dinitial=False, **extra))
    assert short[2] is None and full[2] is not None and torch.isfinite(full[2]).all()
    assert torch.equal(short[0], full[0]) and torch.equal(short[1], full[1])


def test_walk_config_by_tile_width():
    """The backward's keys: FUSE_ENTRY everywhere; 64-column tiles at two blocks per
    multiprocessor with LOAD_LAT 8 only where the default tile is 128 columns wide (16-bit entry
    states, dstate's tile 128 and up); each chunk's product in one piece only where dstate's
    tile is 64, the chunk 128 and the entry states read in bf16 (bf16 inputs and states: fp16
    and float32 inputs were not timed, and spill with it); nothing else changed; a caller's
    config still wins; the chunk must be given."""
    from ops.backward import backward_config
    narrowed = {"FUSE_ENTRY": True, "BLOCK_N": 64, "occupancy": 2, "LOAD_LAT": 8}
    whole = {"FUSE_ENTRY": True, "ENTRY_BLOCK_T": 128}
    for dtype in (torch.bfloat16, torch.float16):
        for dstate in (100, 128, 200, 256, 512):          # dstate's tile 128 and up
            for chunk in (None, 64, 128, 256):
                assert mod.walk_config(headdim=64, dstate=dstate, chunk_size=chunk,
                                       dtype=dtype) == narrowed
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for dstate in (16, 32, 40, 64):
            for chunk in (None, 64, 128, 256):
                one_piece = dtype == torch.bfloat16 and dstate > 32 and chunk == 128
                assert mod.walk_config(headdim=64, dstate=dstate, chunk_size=chunk, dtype=dtype
                                       ) == (whole if one_piece else {"FUSE_ENTRY": True})
    for dstate in (64, 256):
        assert mod.walk_config(headdim=64, dstate=dstate, chunk_size=128,
                               dtype=torch.float32) == {"FUSE_ENTRY": True}
        for states in (torch.float32, torch.float16):     # read as float32
            assert mod.walk_config(headdim=64, dstate=dstate, chunk_size=128, dtype=torch.bfloat16,
                                   states_dtype=states) == {"FUSE_ENTRY": True}
    assert mod.walk_config(headdim=64, dstate=64, chunk_size=128, dtype=torch.bfloat16,
                           states_dtype=torch.bfloat16) == whole
    with pytest.raises(TypeError, match="chunk_size"):
        mod.walk_config(headdim=64, dstate=64, dtype=torch.bfloat16)
    shape = dict(headdim=64, dstate=128, chunk_size=128, dtype=torch.bfloat16)
    assert backward_config(None, "bwd_pass_state", **shape) == narrowed
    assert backward_config({"bwd_pass_state": {"BLOCK_N": 32}}, "bwd_pass_state",
                           **shape) == {**narrowed, "BLOCK_N": 32}
    at64 = dict(shape, dstate=64)
    assert backward_config(None, "bwd_pass_state", **at64) == whole
    assert backward_config({"bwd_pass_state": {"ENTRY_BLOCK_T": 64}}, "bwd_pass_state",
                           **at64) == {**whole, "ENTRY_BLOCK_T": 64}
    assert backward_config(None, "bwd_chunk_cumsum", **shape) == {}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_compiles(arch):
    from ops.tools.aot import compile_cubin
    meta = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device="meta")
    entry = meta(1, 64, 80, 64, 128, dt=torch.bfloat16)
    plan = bwd_pass_state_plan(meta(1, 64, 80, 64, 128), meta(1, 80, 64, 128), entry,
                               meta(1, 80, 64, 256), meta(1, 16384, dt=torch.int32))
    assert compile_cubin(plan.kernel, plan.args, arch)[:4] == b"\x7fELF"


def test_bf16_ds_is_the_float32_ds_rounded():
    """ds_dtype=bf16 (the backward's choice for bf16 inputs): the float32 dS rounded once, the
    other outputs unchanged bit for bit."""
    p = problem()
    args = (p["dentry"], p["dfinal"], p["entry"], (p["dA"] * LOG2E).float(), p["seq_idx"])
    f32 = bwd_pass_state(*args, poison=True)
    bf16 = bwd_pass_state(*args, poison=True, ds_dtype=torch.bfloat16)
    assert bf16[0].dtype == torch.bfloat16 and torch.equal(bf16[0], f32[0].to(torch.bfloat16))
    assert torch.equal(bf16[1], f32[1]) and torch.equal(bf16[2], f32[2])


# Every config of the search space at one small shape, against the default ------------------------
#
# Other tiles change only the order in which d dA[last]'s per-tile partials are added (float32,
# a few ulps: 1e-6); dS and dinitial are the same recurrence per element, bit for bit.

SPACE_SHAPE = dict(batch=2, nheads=4, headdim=64, dstate=256, dtype=torch.float32)


@pytest.mark.parametrize("config", mod.search_space(**SPACE_SHAPE)[1:],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_variant_matches_the_default(config):
    p = problem(headdim=64, dstate=256)
    args = (p["dentry"], p["dfinal"], p["entry"], (p["dA"] * LOG2E).float(), p["seq_idx"])
    want = bwd_pass_state(*args, poison=True)
    got = bwd_pass_state(*args, poison=True, config=config)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert rel_err(got[1], want[1]) < 1e-6


def test_search_space():
    space = mod.search_space(**SPACE_SHAPE)
    assert space[0] == mod.default_config(**SPACE_SHAPE) and len(space) < 20
    layer = mod.search_space(**LAYER)
    tiles = {(c["BLOCK_P"], c["BLOCK_N"]) for c in layer}
    assert len(layer) < 20 and tiles >= {(64, 128), (32, 64)}
    with pytest.raises(ValueError, match="unknown config keys"):
        meta_plan(dict(BLOCK_T=16))


LAYER = dict(batch=8, nheads=80, headdim=64, dstate=128, dtype=torch.bfloat16)


def meta_plan(config=None, ds_dtype=torch.float32, batch=1, nchunks=64):
    meta = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device="meta")
    entry = meta(batch, nchunks, 80, 64, 128, dt=torch.bfloat16)
    return bwd_pass_state_plan(meta(batch, nchunks, 80, 64, 128), meta(batch, 80, 64, 128),
                               entry, meta(batch, 80, nchunks, 256),
                               meta(batch, nchunks * 256, dt=torch.int32), config=config,
                               ds_dtype=ds_dtype)


@pytest.mark.parametrize("config", mod.search_space(**LAYER),
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_search_space_compiles_for_sm_90(config):
    """At batch 8 x 2K tokens of a ~2.7B layer, bf16 dS (as the backward launches it)."""
    from ops.tools.aot import compile_cubin
    plan = meta_plan(config, torch.bfloat16, batch=8, nchunks=8)
    assert compile_cubin(plan.kernel, plan.args, "sm_90")[:4] == b"\x7fELF"


def test_the_search_space_starts_from_the_tiles_the_plan_runs():
    """bf16 states of float32 inputs reach the kernel widened to float32 (ops.backward): the
    search space's first config is then the float32 tiles the plan picks for them."""
    shape = dict(headdim=64, dstate=128, dtype=torch.float32, states_dtype=torch.bfloat16)
    # what bwd_pass_state_plan resolves for the float32 entry states it is given
    runs = mod.default_config(headdim=64, dstate=128, dtype=torch.float32)
    assert mod.search_space(**shape)[0] == mod.default_config(**shape) == runs


# The walk as the backward runs it (FUSE_ENTRY), and the variants of walk_space ----------------
#
# Each variant reorders float32 sums only: the dentry product's over tokens (one product a chunk
# or one a 64-token tile, the decayed gradient added by the tensor cores or after) and the
# partials of d dA[last] (one a tile, or one a headdim row of it, added later in order).

WALK = dict(batch=1, nheads=4, headdim=64, dstate=128, chunk_size=128, dtype=torch.bfloat16,
            states_dtype=torch.bfloat16)


def walk_inputs(seed=11):
    """bf16 dy, C and entry states as the backward has them: 1 x 300 tokens (three chunks of
    128, the last short) x 4 heads in 2 groups, two sequences packed, float32 dfinal."""
    kw = make_problem(batch=1, seqlen=300, nheads=4, headdim=64, ngroups=2, dstate=128,
                      dtype=torch.float32, seed=seed, seq_boundaries=[150])
    dt_out, dA = chunked.chunk_cumsum(kw["dt"], kw["A"], 128, kw["dt_bias"], True, (0.0, 1.5))
    entry, final = chunked.fwd_pass_state(kw["x"], kw["B"], dt_out, dA, kw["initial_states"],
                                          kw["seq_idx"])
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    return dict(dentry=None, dfinal=torch.randn(final.shape, generator=g), entry=entry.to(bf),
                dA_cumsum=(dA * LOG2E).float(), seq_idx=kw["seq_idx"],
                dy=torch.randn(kw["x"].shape, generator=g).to(bf), C=kw["C"].to(bf))


@pytest.mark.parametrize("config", mod.walk_space(**WALK)[1:],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_walk_variant_matches_the_chains_own(config):
    """Every variant of ``walk_space`` against the chain's own config (its first), dS in float32
    to see the sums' order: dS, d dA[last] and dinitial within 1e-5 relative (observed under
    1e-6)."""
    p = walk_inputs()
    want = bwd_pass_state(**p, poison=True, config=mod.walk_space(**WALK)[0])
    got = bwd_pass_state(**p, poison=True, config=config)
    for g_, w in zip(got, want, strict=True):
        assert g_.shape == w.shape and rel_err(g_, w) < 1e-5, rel_err(g_, w)


def test_walk_space():
    """The chain's own config first; every key of the variants reaches the space, the narrow
    tiles only where they give more blocks; no config past MAX_PARTS partials."""
    space = mod.walk_space(**WALK)
    assert space[0] == {**mod.default_config(**WALK), **mod.walk_config(**WALK)}
    assert all(c["FUSE_ENTRY"] for c in space) and len(space) == len(mod.unique(space)) < 24
    for key, value in (("ENTRY_BLOCK_T", 128), ("CARRY_ACC", True), ("ROW_PARTS", True),
                       ("ENTRY_LAT", 8), ("BLOCK_N", 32)):
        assert any(c[key] == value for c in space), key
    at64 = mod.walk_space(**{**WALK, "dstate": 64, "batch": 1, "nheads": 80})
    assert {c["BLOCK_N"] for c in at64} == {64, 32, 16}
    # at dstate 64 the whole chunk is the chain's own; the 64-token tiles are still timed
    assert at64[0]["ENTRY_BLOCK_T"] == 128 and space[0]["ENTRY_BLOCK_T"] == 64
    assert [c for c in at64 if c["ENTRY_BLOCK_T"] != 128] == [{**at64[0], "ENTRY_BLOCK_T": 64}]
    # row partials: headdim 64's rows times dstate's column tiles, whatever the row tile; at
    # dstate 256 in 64-column tiles 256 of them (the limit), at 512 over it
    at256 = mod.walk_space(**{**WALK, "dstate": 256})
    assert any(c["ROW_PARTS"] for c in at256)
    assert all(not c["ROW_PARTS"] or 64 * (256 // c["BLOCK_N"]) <= mod.MAX_PARTS for c in at256)
    assert not any(c["ROW_PARTS"] for c in mod.walk_space(**{**WALK, "dstate": 512}))


def test_row_parts_past_the_limit_are_refused():
    p = walk_inputs()
    with pytest.raises(ValueError, match="ROW_PARTS with 64 x 16 tiles"):
        bwd_pass_state(**{**p, "entry": torch.zeros(1, 3, 4, 64, 1024, dtype=torch.bfloat16),
                          "dfinal": None, "C": torch.zeros(1, 300, 2, 1024, dtype=torch.bfloat16)},
                       config=dict(FUSE_ENTRY=True, ROW_PARTS=True, BLOCK_N=16))


def walk_meta_plan(config, dstate):
    """The walk at a 1 x 16K-token layer of 80 heads (64 x dstate, one group), bf16, chunk 128,
    without dinitial: as the backward launches it."""
    meta = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")
    return bwd_pass_state_plan(None, None, meta(1, 128, 80, 64, dstate),
                               meta(1, 80, 128, 128, dt=torch.float32), None, config=config,
                               ds_dtype=torch.bfloat16, dy=meta(1, 16384, 80, 64),
                               C=meta(1, 16384, 1, dstate), with_dinitial=False)


WALK_16K = dict(WALK, nheads=80, dstate=64)


@pytest.mark.parametrize("config", mod.walk_space(**WALK_16K),
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_walk_space_compiles_for_sm_90(config):
    from ops.tools.aot import compile_cubin
    plan = walk_meta_plan(config, 64)
    assert compile_cubin(plan.kernel, plan.args, "sm_90")[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch, spilled", [("sm_90", 0), ("sm_100", 0), ("sm_80", 48)])
def test_the_chains_walk_at_dstate_64_forms_the_whole_chunk(arch, spilled):
    """``walk_config`` at dstate 64 and chunk 128 with bf16 inputs (each chunk's product in one
    piece), as the backward runs it (``ops.backward.pass_config``), compiled at the 16K-token
    layer above: no register spilled for Hopper and Blackwell; for sm_80 48 bytes a thread each
    way (``walk_config``'s docstring), where the 64-token tiles spill none."""
    states = torch.bfloat16
    from ops.backward import pass_config
    from ops.tools.sass import sass_report
    meta = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")

    def report(config):
        plan = bwd_pass_state_plan(None, None, meta(1, 128, 80, 64, 64, dt=states),
                                   meta(1, 80, 128, 128, dt=torch.float32), None, config=config,
                                   ds_dtype=torch.bfloat16, dy=meta(1, 16384, 80, 64),
                                   C=meta(1, 16384, 1, 64), with_dinitial=False)
        return sass_report(plan.kernel, plan.args, arch)

    config = pass_config(None, headdim=64, dstate=64, chunk_size=128, dtype=states)
    assert config["ENTRY_BLOCK_T"] == 128 and config["FUSE_ENTRY"]
    whole = report(config)
    assert whole.spill_load_bytes == whole.spill_store_bytes == spilled, whole
    if spilled:
        tiles = report({**config, "ENTRY_BLOCK_T": 64})
        assert tiles.spill_load_bytes == tiles.spill_store_bytes == 0, tiles


@pytest.mark.parametrize("arch", ["sm_80", "sm_100"])
@pytest.mark.parametrize("dstate", [64, 128])
def test_the_walks_new_keys_compile(arch, dstate):
    """The four keys together (``walk_space``'s), on the chain's tiles and on 32 columns."""
    from ops.tools.aot import compile_cubin
    together = dict(ENTRY_BLOCK_T=128, ENTRY_LAT=8, CARRY_ACC=True, ROW_PARTS=True)
    base = mod.walk_space(**dict(WALK_16K, dstate=dstate))[0]
    for config in ({**base, **together}, {**base, **together, "BLOCK_N": 32}):
        plan = walk_meta_plan(config, dstate)
        assert compile_cubin(plan.kernel, plan.args, arch)[:4] == b"\x7fELF"
