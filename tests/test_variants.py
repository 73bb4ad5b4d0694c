"""Every config of every kernel's search space computes what the default config computes.

A tuner picks, per shape, whichever config of ``search_space`` runs fastest, so every one of
them must give the default's result. Each kernel is run, for every config of its search space
built for a small shape (plus a few configs outside the space that reach code paths the small
shape's space does not: tiles smaller than headdim / dstate, dstate split into slices, D per
head and no z), on the same inputs as the default config, with its outputs NaN-poisoned first
(an element a variant forgets to write fails), and compared with the default's outputs.

The shape: 170 tokens in chunks of 64 (three chunks, the last one ragged: an odd number, so the
two-chunks-per-iteration loop also runs its single-chunk tail), 8 heads in 2 groups (so 1, 2
and 4 heads per block all divide a group), headdim 32, dstate 64, packed sequences (one
boundary inside a chunk, one on a chunk boundary), initial states, D per headdim column, z.

Tolerances, relative in norm, against the default config:
  float32   the variants perform the same float32 operations; only the order in which a
            product's terms are summed can differ (a transposed product), a few ulps: 1e-5.
  bfloat16  the same, but the outputs (and the weights and entry states, which are tensor-core
            operands) are rounded to bf16 (8 significant bits): a last-bit difference before
            that rounding can move a value by one bf16 step (2^-8 relative). Such flips are
            rare, so the norm of the difference stays far below one step: 4e-3 (as for the
            interpreter-vs-GPU parity tests).

The CPU runs go through the interpreter (every config: under a minute on two cores); the same
comparisons on a CUDA GPU carry the ``gpu`` marker (they compile every config: minutes). The
last tests check the search spaces at the benchmark's shapes and the hinted kernels, without
running anything.
"""
import functools

import pytest
import torch

from ops import chunk_cumsum as cumsum_mod
from ops import compute_out as out_mod
from ops import fwd_pass_state as state_mod
from ops.sass import meta_plan
from tests.helpers import make_problem, rel_err

CHUNK = 64
SMALL = dict(batch=1, seqlen=170, nheads=8, headdim=32, ngroups=2, dstate=64)
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
OPTS = dict(dt_softplus=True, dt_limit=(0.0, 1.5))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Configs outside the small shape's search space that reach otherwise unvisited code.
STATE_EXTRA = [dict(BLOCK_P=16, BLOCK_N=32, SWAP=swap, CHUNKS_PER_ITER=k)   # several p/n tiles
               for swap in (False, True) for k in (1, 2)]
OUT_EXTRA = ([dict(DSTATE_TILE=32, HEADS_PER_BLOCK=hb, SWAP=swap)          # dstate in 2 slices
              for hb in (1, 2) for swap in (False, True)]
             + [dict(BLOCK_P=16, HEADS_PER_BLOCK=hb, SWAP=True) for hb in (1, 4)]   # p split
             + [dict(DSTATE_TILE=32, SCORES_IN_MEMORY=True, SWAP=swap) for swap in (False, True)])
# D per head (not per headdim column) and no z: a second set of inputs, for these configs.
OUT_D1_NO_Z = [dict(), dict(SWAP=True), dict(HEADS_PER_BLOCK=2),
               dict(HEADS_PER_BLOCK=4, SWAP=True), dict(SCORES_IN_MEMORY=True),
               dict(SCORES_IN_MEMORY=True, HEADS_PER_BLOCK=2, SWAP=True)]


def shape(dtype):
    return dict(SMALL, chunk_size=CHUNK, dtype=dtype)


def label(config, default):
    changed = {k: v for k, v in config.items() if default.get(k) != v}
    return "-".join(f"{k}={v}" for k, v in changed.items()) or "default"


def cases(module, extra=()):
    """pytest params (dtype name, config) for every config of the space at the small shape."""
    params = []
    for name, dtype in DTYPES.items():
        default = module.default_config(**shape(dtype))
        configs = module.search_space(**shape(dtype)) + [{**default, **e} for e in extra]
        assert default in configs, "the default config must be part of the search space"
        params += [pytest.param(name, cfg, id=f"{name}-{label(cfg, default)}") for cfg in configs]
    return params


@functools.lru_cache(maxsize=None)
def problem(dtype_name, device, d="2d", z=True):
    """Inputs, and the upstream kernels' outputs (default configs), on ``device``."""
    kw = make_problem(**SMALL, dtype=DTYPES[dtype_name], D=d, z=z, seq_boundaries=[50, 128],
                      seed=11)
    kw = {k: v.to(device) for k, v in kw.items()}
    dt_out, dA = cumsum_mod.chunk_cumsum(kw["dt"], kw["A"], CHUNK, dt_bias=kw["dt_bias"], **OPTS)
    entry, _ = state_mod.fwd_pass_state(kw["x"], kw["B"], dt_out, dA, kw["initial_states"],
                                        kw["seq_idx"], states_dtype=kw["x"].dtype)
    return kw, dt_out, dA, entry


def run_cumsum(dtype_name, device, config):
    kw, *_ = problem(dtype_name, device)
    dt = kw["dt"].to(DTYPES[dtype_name])     # dt may come in any float dtype
    return cumsum_mod.chunk_cumsum(dt, kw["A"], CHUNK, dt_bias=kw["dt_bias"], poison=True,
                                   config=config, **OPTS)


def run_state(dtype_name, device, config):
    kw, dt_out, dA, _ = problem(dtype_name, device)
    return state_mod.fwd_pass_state(kw["x"], kw["B"], dt_out, dA, kw["initial_states"],
                                    kw["seq_idx"], states_dtype=kw["x"].dtype, poison=True,
                                    config=config)


def run_out(dtype_name, device, config, d="2d", z=True):
    kw, dt_out, dA, entry = problem(dtype_name, device, d, z)
    return (out_mod.compute_out(kw["x"], kw["B"], kw["C"], dt_out, dA, entry, D=kw["D"],
                                z=kw.get("z"), seq_idx=kw["seq_idx"], poison=True,
                                config=config),)


@functools.lru_cache(maxsize=None)
def default_result(run, dtype_name, device, *options):
    return run(dtype_name, device, None, *options)


def check(run, dtype_name, config, device, *options):
    """``config``'s outputs against the default config's, output by output."""
    outs = run(dtype_name, device, config, *options)
    if device == "cuda":
        torch.cuda.synchronize()
    refs = default_result(run, dtype_name, device, *options)
    tol = TOL[DTYPES[dtype_name]]
    for out, ref in zip(outs, refs, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert rel_err(out, ref) < tol


DEVICES = [pytest.param("cpu", id="interpret"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name, config", cases(cumsum_mod))
def test_chunk_cumsum_variant(device, dtype_name, config):
    check(run_cumsum, dtype_name, config, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name, config", cases(state_mod, STATE_EXTRA))
def test_fwd_pass_state_variant(device, dtype_name, config):
    check(run_state, dtype_name, config, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name, config", cases(out_mod, OUT_EXTRA))
def test_compute_out_variant(device, dtype_name, config):
    check(run_out, dtype_name, config, device)


def int64_cases(module, extra=()):
    """bf16 cases of ``cases`` through the 64-bit-indexed kernel (INDEX64), the one that runs
    when a tensor reaches 2**31 elements. Tile addressing differs from the 32-bit twin (no TMA),
    so each config is checked on it too; the interpreter does not index, so these are GPU-only."""
    return [pytest.param(name, {**cfg, "INDEX64": True}, id=f"{p.id}-int64")
            for p in cases(module, extra) for name, cfg in [p.values] if name == "bf16"
            and not cfg["INDEX64"] and not refused_int64(cfg)]


def refused_int64(cfg):
    """compute_out with several heads per block and 32-row tiles or eight worker warps: these
    faulted in the 64-bit kernel on an H200, so compute_out_plan refuses them there (tested
    below)."""
    return cfg.get("HEADS_PER_BLOCK", 1) > 1 and (
        cfg.get("BLOCK_M") == 32 or cfg.get("num_worker_warps") == 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name, config", int64_cases(state_mod, STATE_EXTRA))
def test_fwd_pass_state_variant_int64(dtype_name, config):
    check(run_state, dtype_name, config, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name, config", int64_cases(out_mod, OUT_EXTRA))
def test_compute_out_variant_int64(dtype_name, config):
    check(run_out, dtype_name, config, "cuda")


def test_compute_out_refuses_tiles_that_fault_with_int64():
    """Refused with a ValueError before any launch (so on the CPU too), with or without
    INDEX64 asked for explicitly; the same tiles with 32-bit indices still run."""
    default = out_mod.default_config(**shape(torch.bfloat16))
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", OUT_D1_NO_Z, ids=lambda c: label(c, {}))
def test_compute_out_variant_D_per_head_no_z(device, config):
    check(run_out, "fp32", config, device, "1d", False)


# The whole forward pass with a config per kernel -------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_kernel_forward_configs(device):
    """``kernel_forward(configs=...)`` passes each kernel its config; results match the
    defaults'. Unknown kernels or config keys are errors (a typo must not time the default)."""
    from ops.forward import kernel_forward
    kw = make_problem(**SMALL, dtype=torch.float32, D="2d", seq_boundaries=[50, 128], seed=12)
    kw = {k: v.to(device) for k, v in kw.items()}
    configs = {"chunk_cumsum": dict(BLOCK_H=4, LOAD_LAT=3),
               "fwd_pass_state": dict(SWAP=True, CHUNKS_PER_ITER=2, STORE_LAT=8),
               "compute_out": dict(HEADS_PER_BLOCK=2, SWAP=True, occupancy=2)}
    ref = kernel_forward(chunk_size=CHUNK, **kw, **OPTS)
    out = kernel_forward(chunk_size=CHUNK, **kw, **OPTS, configs=configs)
    for o, r in zip(out, ref, strict=True):
        assert rel_err(o, r) < TOL[torch.float32]
    with pytest.raises(ValueError, match="unknown kernels"):
        kernel_forward(chunk_size=CHUNK, **kw, configs={"compute": {}})
    with pytest.raises(ValueError, match="unknown config keys"):
        kernel_forward(chunk_size=CHUNK, **kw, configs={"compute_out": {"HEADS": 2}})
    for name in ("chunk_cumsum", "fwd_pass_state", "compute_out"):
        # clusters of two CTAs computed wrong results on the H200: refused, not run
        with pytest.raises(ValueError, match="num_ctas must be None or 1"):
            kernel_forward(chunk_size=CHUNK, **kw, configs={name: {"num_ctas": 2}})
        with pytest.raises(ValueError, match="num_worker_warps must be None, 4 or 8"):
            kernel_forward(chunk_size=CHUNK, **kw, configs={name: {"num_worker_warps": 2}})


# Search spaces and hints (no kernel runs) --------------------------------------------------------

def _plan(shape, module, config):
    """Build (without running) ``module``'s launch for ``config`` at ``shape``, on meta tensors
    (``ops.sass.meta_plan``: the launch as ``ops.forward`` makes it)."""
    return meta_plan(module.__name__.rsplit(".", 1)[-1], **shape, config=config)


@pytest.mark.parametrize("module", [cumsum_mod, state_mod, out_mod],
                         ids=["chunk_cumsum", "fwd_pass_state", "compute_out"])
@pytest.mark.parametrize("dstate", [64, 128, 256, 512])
@pytest.mark.parametrize("seqlen", [1024, 16384, 262144])
def test_search_spaces(module, dstate, seqlen):
    """At the benchmark's shapes (h=80, p=64, g=1, bf16, chunk 256): the default comes first,
    no config repeats, the space stays small, and every config makes a valid plan."""
    shape = dict(batch=1, seqlen=seqlen, nheads=80, headdim=64, ngroups=1, dstate=dstate,
                 chunk_size=256, dtype=torch.bfloat16)
    space = module.search_space(**shape)
    assert space[0] == module.default_config(**shape)
    assert len({tuple(sorted(c.items())) for c in space}) == len(space)
    assert len(space) <= 45
    for config in space:
        grid, kernel, args, _ = _plan(shape, module, config)
        assert all(isinstance(n, int) and n > 0 for n in grid), config


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hb", [1, 2])
def test_persistent_blocks_loop_over_tiles(device, hb, monkeypatch):
    """PERSISTENT with a grid far smaller than the tiles (one multiprocessor's worth of blocks),
    so that every block loops over many tiles: the same outputs as the default config."""
    monkeypatch.setattr(out_mod, "multiprocessors", lambda device: 1)
    default = out_mod.default_config(**shape(torch.bfloat16))
    config = {**default, "PERSISTENT": True, "HEADS_PER_BLOCK": hb, "occupancy": 2}
    kw, dt_out, dA, entry = problem("bf16", device)
    grid = out_mod.compute_out_plan(kw["x"], kw["B"], kw["C"], dt_out, dA, entry, D=kw["D"],
                                    z=kw.get("z"), seq_idx=kw["seq_idx"], config=config)[0]
    assert grid == (2, 1)                                  # 2 blocks for 24 / hb tiles
    check(run_out, "bf16", config, device)


def test_scores_in_memory_plans_their_first_step():
    """With SCORES_IN_MEMORY the plan carries a (batch, nchunks, ngroups, CHUNK, CHUNK) float32
    scores buffer and ``prerequisites`` returns the chunk_scores launch filling it, in the same
    tiles and latency hint as compute_out's; without it, no extra launch."""
    from ops.chunk_scores import chunk_scores_kernel
    shape = dict(batch=1, seqlen=1000, nheads=8, headdim=32, ngroups=2, dstate=256, chunk_size=128,
                 dtype=torch.bfloat16)
    assert out_mod.prerequisites(_plan(shape, out_mod, None)[2]) == []
    cfg = {"SCORES_IN_MEMORY": True, "BLOCK_M": 32, "BLOCK_K": 64, "LOAD_LAT": 3}
    args = _plan(shape, out_mod, cfg)[2]
    (grid, kernel, sargs), = out_mod.prerequisites(args)
    B, C, scores = sargs[:3]
    assert scores is args[out_mod._ARG_SCORES] and B is args[1] and C is args[2]
    assert scores.shape == (1, 8, 2, 128, 128) and scores.dtype == torch.float32
    assert sargs[3:] == (128, 32, 64, 256, 128, 3)        # CHUNK, tiles, DSTATE, its tile, latency
    assert grid == (8 * 4 * 2, 2, 1)
    assert kernel._pyfunc.__code__ is chunk_scores_kernel._pyfunc.__code__


def test_hinted_kernels_are_cached_and_interpretable():
    """A config's occupancy / num_ctas come back as a kernel made by ``replace_hints``: one
    object per (kernel, hints), so each variant compiles once per process, around the same
    Python function, which is what the interpreter runs (the variant tests above run them)."""
    shape = dict(SMALL, chunk_size=CHUNK, dtype=torch.float32)
    for module, kernel in ((out_mod, out_mod.compute_out_kernel),
                           (state_mod, state_mod.fwd_pass_state_kernel),
                           (cumsum_mod, cumsum_mod.chunk_cumsum_kernel)):
        hinted = _plan(shape, module, dict(occupancy=2, num_ctas=1))[1]
        assert hinted is _plan(shape, module, dict(num_ctas=1, occupancy=2))[1]
        # Small tensors run the 32-bit-indexed twin (ops.launch.fit_index_width): a kernel
        # object of its own around the same code, which is what the interpreter runs.
        plain = _plan(shape, module, None)[1]               # no hints: the twin itself
        assert plain is _plan(shape, module, None)[1] and plain._pyfunc.__code__ is kernel._pyfunc.__code__
        assert hinted is not plain and hinted._pyfunc.__code__ is kernel._pyfunc.__code__
