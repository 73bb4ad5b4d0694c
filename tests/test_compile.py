"""Ahead-of-time compilation of every kernel variant, for sm_80, sm_90 and sm_100, on any machine.

cuTile compiles a kernel separately for every combination of constant parameters (tile sizes,
feature flags) and argument dtypes. This file builds the arguments exactly as the launchers do
(each launcher's ``*_plan`` function, fed tensors on the "meta" device, which have shapes and
dtypes but no memory), turns them into a kernel signature and compiles it to a cubin. So a type
or shape error in any variant shows up here, without a GPU.

The signature mirrors what a launch would use: every tensor becomes an array with its dtype
and rank, 64-bit indices where the kernel parameter is annotated ``ct.IndexedWithInt64``,
non-negative strides and no aliasing; Python ints become int32 scalars, Python floats float32
scalars (the kernels cast float scalars explicitly, so a 64-bit one works too); constants
(``ct.Constant``) are passed by value.
"""
import inspect
import io
import typing

import pytest
import torch

import cuda.tile as ct
from cuda.tile import compilation as cc

from ops.chunk_cumsum import chunk_cumsum_plan
from ops.compute_out import compute_out_plan
from ops.fwd_pass_state import fwd_pass_state_plan

ARCHS = ["sm_80", "sm_90", "sm_100"]
CT_DTYPE = {torch.float32: ct.float32, torch.float16: ct.float16, torch.bfloat16: ct.bfloat16,
            torch.float64: ct.float64, torch.int32: ct.int32, torch.int64: ct.int64}


def _index_dtype(annotation):
    if typing.get_origin(annotation) is typing.Annotated:
        for meta in annotation.__metadata__:
            if isinstance(meta, ct.ArrayAnnotation):
                return meta.index_dtype
    return ct.int32


def _is_constant(annotation):
    return (typing.get_origin(annotation) is typing.Annotated
            and any(isinstance(m, ct.ConstantAnnotation) for m in annotation.__metadata__))


def signature_of(kernel, args):
    """The KernelSignature a launch of ``kernel`` with ``args`` compiles."""
    params = inspect.signature(kernel._annotated_function.pyfunc).parameters.values()
    constraints = []
    for param, arg in zip(params, args, strict=True):
        if _is_constant(param.annotation):
            constraints.append(arg)
        elif isinstance(arg, torch.Tensor):
            constraints.append(cc.ArrayConstraint(
                CT_DTYPE[arg.dtype], arg.dim(), index_dtype=_index_dtype(param.annotation),
                stride_lower_bound_incl=0, alias_groups=[], may_alias_internally=False))
        elif isinstance(arg, bool):
            raise TypeError(f"{param.name}: a bool kernel argument should be a ct.Constant")
        elif isinstance(arg, int):
            constraints.append(cc.ScalarConstraint(ct.int32))
        elif isinstance(arg, float):
            constraints.append(cc.ScalarConstraint(ct.float32))
        else:
            raise TypeError(f"{param.name}: unexpected argument {arg!r}")
    return cc.KernelSignature(constraints, calling_convention=cc.CallingConvention.cutile_python_v1())


def compile_cubin(kernel, args, arch):
    buf = io.BytesIO()
    cc.export_kernel(kernel, [signature_of(kernel, args)], buf, gpu_code=arch,
                     output_format="cubin")
    assert len(buf.getvalue()) > 0


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
    compile_cubin(kernel, args, arch)


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
    compile_cubin(kernel, args, arch)


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
    compile_cubin(kernel, args, arch)

