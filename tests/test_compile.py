"""Ahead-of-time compilation of every kernel variant, for sm_80, sm_90 and sm_100, on any machine.

The arguments are built exactly as the launchers build them (their ``*_plan`` functions, fed
tensors on the "meta" device), so this compiles what runs: a type or shape error in any
variant, on any architecture, fails here without a GPU. See ``ops/aot.py``. The last test
compiles the tuning configs (``search_space``) at a realistic shape: the defaults and one
config of each kind; ``tests/benchmark/compile_all.py`` compiles all of them.
"""
import pytest
import torch

from ops import chunk_cumsum as cumsum_mod
from ops import compute_out as out_mod
from ops import fwd_pass_state as state_mod
from ops.aot import ARCHS, compile_cubin
from ops.chunk_cumsum import chunk_cumsum_plan
from ops.compute_out import compute_out_plan
from ops.fwd_pass_state import fwd_pass_state_plan
from ops.sass import meta_plan


def with_archs(variants):
    """The first variant on every architecture, the others on sm_90 only (keeps the file fast:
    a compute_out compile takes seconds)."""
    return [pytest.param(v.values[0], arch, id=f"{v.id}-{arch}")
            for i, v in enumerate(variants) for arch in (ARCHS if i == 0 else ["sm_90"])]


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


# Problem shape for every variant: only dtypes, sizes that are compile-time constants
# (chunk, headdim, dstate, tiles) and flags matter; the sequence length does not.
BATCH, SEQLEN, NHEADS, NGROUPS = 2, 1000, 8, 2


def _intermediates(chunk, nheads=NHEADS):
    nchunks = -(-SEQLEN // chunk)
    return meta(BATCH, nheads, nchunks, chunk), meta(BATCH, nheads, nchunks, chunk)


# (a) chunk_cumsum ------------------------------------------------------------------------------

CUMSUM_VARIANTS = [
    pytest.param(dict(dt_dtype=torch.float32, chunk=256, bias=True, softplus=True),
                 id="dt-fp32-chunk256-bias-softplus"),
    pytest.param(dict(dt_dtype=torch.bfloat16, chunk=64, bias=False, softplus=False),
                 id="dt-bf16-chunk64-plain"),
    pytest.param(dict(dt_dtype=torch.float16, chunk=128, bias=True, softplus=False),
                 id="dt-fp16-chunk128-bias"),
]


@pytest.mark.parametrize("v, arch", [pytest.param(v.values[0], a, id=f"{v.id}-{a}")
                                     for v in CUMSUM_VARIANTS for a in ARCHS])
def test_compile_chunk_cumsum(v, arch):
    dt = meta(BATCH, SEQLEN, NHEADS, dtype=v["dt_dtype"])
    A = meta(NHEADS)
    grid, kernel, args, _ = chunk_cumsum_plan(dt, A, v["chunk"], dt_bias=A if v["bias"] else None,
                                              dt_softplus=v["softplus"], dt_limit=(0.0, 2.0))
    assert len(compile_cubin(kernel, args, arch)) > 0


# (b) fwd_pass_state ----------------------------------------------------------------------------

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
    x = meta(BATCH, SEQLEN, NHEADS, v["p"], dtype=v["dtype"])
    B = meta(BATCH, SEQLEN, NGROUPS, v["n"], dtype=v["dtype"])
    dt_out, dA = _intermediates(v["chunk"])
    init = meta(BATCH, NHEADS, v["p"], v["n"]) if v["init"] else None
    seq = meta(BATCH, SEQLEN, dtype=torch.int32) if v["seq"] else None
    grid, kernel, args, _ = fwd_pass_state_plan(x, B, dt_out, dA, init, seq, states_dtype=v["states"])
    assert len(compile_cubin(kernel, args, arch)) > 0


# (c) compute_out -------------------------------------------------------------------------------

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
    x = meta(BATCH, SEQLEN, NHEADS, v["p"], dtype=v["dtype"])
    B = meta(BATCH, SEQLEN, NGROUPS, v["n"], dtype=v["dtype"])
    dt_out, dA = _intermediates(v["chunk"])
    states = meta(BATCH, dt_out.shape[2], NHEADS, v["p"], v["n"], dtype=v["states"])
    D = {None: None, "1d": meta(NHEADS), "2d": meta(NHEADS, v["p"])}[v["D"]]
    z = x if v["z"] else None
    seq = meta(BATCH, SEQLEN, dtype=torch.int32) if v["seq"] else None
    grid, kernel, args, _ = compute_out_plan(x, B, B, dt_out, dA, states, D, z, seq)
    assert len(compile_cubin(kernel, args, arch)) > 0



@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dstate", [128, 256])
def test_compile_chunk_scores(dstate, arch):
    """compute_out's optional first step (SCORES_IN_MEMORY), in the tiles compute_out reads."""
    from ops.chunk_scores import chunk_scores_plan
    B = meta(BATCH, SEQLEN, NGROUPS, dstate, dtype=torch.bfloat16)
    scores = meta(BATCH, -(-SEQLEN // 256), NGROUPS, 256, 256)
    _, kernel, args = chunk_scores_plan(B, B, scores, 64, 64, min(dstate, 128))
    assert len(compile_cubin(kernel, args, arch)) > 0


# Tuning variants at a realistic shape ----------------------------------------------------------
#
# A Mamba-2 layer of a ~2.7B model (batch 1, 16K tokens, 80 heads of 64, one group, bf16, chunks
# of 256), launched as ops.forward does. Every config of every search space compiles there (for
# sm_90, ``tests/benchmark/compile_all.py`` checks them all, with registers and spills: minutes);
# CI compiles the defaults and one config of each kind of variant: for sm_90 and sm_100 where
# the kind changes the code's structure (operand order, heads per block, two chunks per
# iteration), for sm_90 only where it changes hints (latency, occupancy, clusters).

LAYER = dict(batch=1, seqlen=16384, nheads=80, headdim=64, ngroups=1, chunk_size=256,
             dtype=torch.bfloat16)
BOTH, HOPPER = ["sm_90", "sm_100"], ["sm_90"]


def layer_plan(name, dstate, config):
    """(kernel, args) of one launch of kernel ``name`` at LAYER with ``dstate`` and ``config``,
    as ``ops.forward`` makes it (``ops.sass.meta_plan``)."""
    _, kernel, args, _ = meta_plan(name, **LAYER, dstate=dstate, config=config)
    return kernel, args


# (kernel, dstate, kind, which config of the search space, architectures)
KINDS = [
    ("chunk_cumsum", 128, "default", lambda c, d: c == d, BOTH),
    ("chunk_cumsum", 128, "block_h", lambda c, d: c["BLOCK_H"] != d["BLOCK_H"], HOPPER),
    ("chunk_cumsum", 128, "latency", lambda c, d: c["LOAD_LAT"] or c["STORE_LAT"], HOPPER),
    ("chunk_cumsum", 128, "hints", lambda c, d: c["occupancy"], HOPPER),
    ("fwd_pass_state", 128, "default", lambda c, d: c == d, BOTH),
    ("fwd_pass_state", 256, "default", lambda c, d: c == d, HOPPER),
    ("fwd_pass_state", 128, "swap", lambda c, d: c["SWAP"] and c["CHUNKS_PER_ITER"] == 1, BOTH),
    ("fwd_pass_state", 128, "2-chunks", lambda c, d: c["CHUNKS_PER_ITER"] == 2 and not c["SWAP"],
     BOTH),
    ("fwd_pass_state", 128, "swap-2-chunks", lambda c, d: c["CHUNKS_PER_ITER"] == 2 and c["SWAP"],
     HOPPER),
    ("fwd_pass_state", 128, "latency", lambda c, d: c["LOAD_LAT"] and c["STORE_LAT"], HOPPER),
    ("fwd_pass_state", 128, "hints", lambda c, d: c["occupancy"], HOPPER),
    ("compute_out", 128, "default", lambda c, d: c == d, BOTH),
    ("compute_out", 256, "default", lambda c, d: c == d, HOPPER),
    ("compute_out", 256, "swap", lambda c, d: c["SWAP"] and c["HEADS_PER_BLOCK"] == 1, BOTH),
    ("compute_out", 256, "2-heads", lambda c, d: c["HEADS_PER_BLOCK"] == 2 and not c["SWAP"],
     BOTH),
    ("compute_out", 256, "2-heads-swap", lambda c, d: c["HEADS_PER_BLOCK"] == 2 and c["SWAP"],
     BOTH),
    ("compute_out", 128, "4-heads", lambda c, d: c["HEADS_PER_BLOCK"] == 4 and not c["SWAP"],
     BOTH),
    ("compute_out", 128, "4-heads-swap", lambda c, d: c["HEADS_PER_BLOCK"] == 4 and c["SWAP"],
     BOTH),
    ("compute_out", 256, "whole-dstate", lambda c, d: c["DSTATE_TILE"] == 256, HOPPER),
    ("compute_out", 128, "latency", lambda c, d: c["LOAD_LAT"] or c["STORE_LAT"], HOPPER),
    ("compute_out", 128, "hints", lambda c, d: c["occupancy"] not in (None, d["occupancy"]), HOPPER),
    ("compute_out", 256, "scores-in-memory", lambda c, d: c["SCORES_IN_MEMORY"] and not c["SWAP"]
     and c["HEADS_PER_BLOCK"] == 1 and c["occupancy"] is None, BOTH),
    ("compute_out", 256, "scores-in-memory-2-heads", lambda c, d: c["SCORES_IN_MEMORY"]
     and c["HEADS_PER_BLOCK"] == 2, HOPPER),
    ("compute_out", 128, "persistent", lambda c, d: c["PERSISTENT"] and c["HEADS_PER_BLOCK"] == 1,
     BOTH),
    ("compute_out", 128, "persistent-2-heads", lambda c, d: c["PERSISTENT"] and c["HEADS_PER_BLOCK"] == 2,
     HOPPER),
    ("compute_out", 128, "8-worker-warps", lambda c, d: c["num_worker_warps"] == 8 and c["HEADS_PER_BLOCK"] == 2,
     BOTH),
    ("fwd_pass_state", 128, "8-worker-warps", lambda c, d: c["num_worker_warps"] == 8, HOPPER),
]
MODULES = {"chunk_cumsum": cumsum_mod, "fwd_pass_state": state_mod, "compute_out": out_mod}


@pytest.mark.parametrize("name, dstate, kind, pick, arch", [
    pytest.param(name, n, kind, pick, arch, id=f"{name}-n{n}-{kind}-{arch}")
    for name, n, kind, pick, archs in KINDS for arch in archs])
def test_compile_variant_kinds(name, dstate, kind, pick, arch):
    module = MODULES[name]
    shape = dict(LAYER, dstate=dstate)
    default = module.default_config(**shape)
    space = module.search_space(**shape)
    assert space[0] == default, "the default config comes first in the search space"
    config = next((c for c in space if pick(c, default)), None)
    assert config is not None, f"no {kind!r} config in the search space"
    kernel, args = layer_plan(name, dstate, config)
    assert len(compile_cubin(kernel, args, arch)) > 0
