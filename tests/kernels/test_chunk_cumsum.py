"""Kernel (a), chunk_cumsum (notebook 03): against reference (a), every config of its search
space against the default config, and its ahead-of-time compilation for sm_80, sm_90 and sm_100.

Every test that runs the kernel runs on the CPU through the tile interpreter (``ops.runtime.launch``
interprets kernels whose arguments are CPU tensors), and again on a CUDA GPU under
``@pytest.mark.gpu``. The outputs are NaN-filled before the kernel runs (``poison=True``) and
``rel_err`` returns inf when any NaN or inf is left, so an element the kernel forgets to write
fails the test.

Against reference (a), in float64, relative in norm: dt_out and dA_cumsum are float32 whatever
dt's dtype (a bf16 dt is upcast exactly, as the reference upcasts it), computed in float32: the
softplus, the dt_limit clamp, and a running sum over at most a chunk's tokens, each a few ulps
(~1e-7): bound 1e-6. Padding tokens past seqlen must have dt = 0.

Variants: every config of ``search_space`` at the small shape of ``tests/kernels/helpers.py``
against the default config, with ``VARIANT_TOL`` (1e-5 for float32: the same float32 operations,
at most summed in another order; 4e-3 for the bf16 problem, whose reasons that module states).

Compilation: the arguments are built exactly as the launcher builds them (``chunk_cumsum_plan``
on "meta" tensors), so a type or shape error in any variant, on any architecture, fails here
without a GPU; the last test compiles one config of each kind of its search space at a
Mamba-2 layer's shape (``tests/benchmark/compile_all.py`` compiles all of them).
"""
import math

import pytest
import torch

from ops.kernels import chunk_cumsum as cumsum_mod
from ops.kernels.chunk_cumsum import chunk_cumsum, chunk_cumsum_plan
from ops.tools.aot import ARCHS
from reference import chunked
from reference.common import LOG2E
from reference.problems import make_problem
from reference.validate import rel_err
from tests.kernels.helpers import (BATCH, DEVICES, HOPPER, NHEADS, OPTIONS, SEQLEN, SMALL,
                                  cases, check, compile_kind, compiles, f64, kind_params, meta,
                                  run_cumsum, synced, to_device)


# Against reference (a) ---------------------------------------------------------------------------

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
                                          f64(bias), **options)
    kw = to_device(kw, device)
    dt_out, dA = synced(chunk_cumsum, kw["dt"], kw["A"], chunk_size, dt_bias=kw.get("dt_bias"),
                        poison=True, **options)
    assert dt_out.shape == dA.shape == ref_dt.shape
    assert dt_out.dtype == dA.dtype == torch.float32
    assert rel_err(dt_out, ref_dt) < 1e-6
    assert rel_err(dA, ref_dA * LOG2E) < 1e-6
    seqlen = problem["seqlen"]
    assert (dt_out.flatten(2)[..., seqlen:] == 0).all(), "padding tokens must have dt = 0"


# Against the default config ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name, config", cases(cumsum_mod))
def test_chunk_cumsum_variant(device, dtype_name, config):
    check(run_cumsum, dtype_name, config, device)


# Ahead-of-time compilation -----------------------------------------------------------------------

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
    plan = chunk_cumsum_plan(dt, A, v["chunk"], dt_bias=A if v["bias"] else None,
                             dt_softplus=v["softplus"], dt_limit=(0.0, 2.0))
    assert compiles(plan, arch)


# (dstate, kind, which config of the search space, architectures), after the default config
KINDS = [
    (128, "block_h", lambda c, d: c["BLOCK_H"] != d["BLOCK_H"], HOPPER),
    (128, "latency", lambda c, d: c["LOAD_LAT"] or c["STORE_LAT"], HOPPER),
    (128, "hints", lambda c, d: c["occupancy"], HOPPER),
]


@pytest.mark.parametrize("dstate, kind, pick, arch", kind_params("chunk_cumsum", KINDS))
def test_compile_variant_kinds(dstate, kind, pick, arch):
    compile_kind("chunk_cumsum", dstate, kind, pick, arch)
