"""Ahead-of-time compilation of every kernel variant, for sm_80, sm_90 and sm_100, on any machine.

The arguments are built exactly as the launchers build them (their ``*_plan`` functions, fed
tensors on the "meta" device), so this compiles what runs: a type or shape error in any
variant, on any architecture, fails here without a GPU. See ``ops/aot.py``.
"""
import pytest
import torch

from ops.aot import ARCHS, compile_cubin
from ops.chunk_cumsum import chunk_cumsum_plan
from ops.compute_out import compute_out_plan
from ops.fwd_pass_state import fwd_pass_state_plan


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

