"""A kernel's launch built on meta tensors: shapes and dtypes, no memory, no GPU.

What a kernel compiles to depends on its constant arguments (tiles, flags, the chunk, headdim,
dstate) and its tensors' dtypes, ranks and strides, never on their values. So a launch planned
on "meta" tensors at any size -- a 16K-token layer on a laptop -- is enough for ``ops.tools.aot``
to compile it and ``ops.tools.sass`` to read its machine code, and for tests to check a config's
grid and kernel without running anything.

    from ops.tools.plans import meta_plan, representative_plan
    plan = meta_plan("compute_out", batch=1, seqlen=4096, nheads=8, headdim=64, ngroups=1,
                     dstate=128, chunk_size=256, config={"HEADS_PER_BLOCK": 2})
    kernel, args = representative_plan("fwd_pass_state", dstate=256)
"""
import inspect

import torch

from ..checks import cdiv
from ..forward import KERNELS

# A Mamba-2 layer of a ~2.7B model at a long context: batch 1, 16K tokens, 80 heads of 64,
# dstate 128, one group, bf16, chunks of 256. Only dtypes, sizes that are compile-time
# constants (chunk, headdim, dstate, tiles) and flags change the code; the tensors are "meta".
SHAPE = dict(batch=1, seqlen=16384, nheads=80, headdim=64, dstate=128, ngroups=1, chunk=256)


def plan_function(name):
    """The ``*_plan`` function of kernel ``name`` (a key of ``ops.forward.KERNELS``)."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; choose from {', '.join(KERNELS)}")
    return getattr(KERNELS[name], f"{name}_plan")


def plan_options(name):
    """The keyword arguments of a kernel's ``*_plan`` function (tile sizes and the like)."""
    return [p for p in inspect.signature(plan_function(name)).parameters.values()
            if p.default is not inspect.Parameter.empty]


def meta_plan(name, *, batch, seqlen, nheads, headdim, ngroups, dstate, chunk_size,
              dtype=torch.bfloat16, **options):
    """The ``Plan`` of one launch of kernel ``name`` at the given shape, built on meta tensors,
    as ``ops.forward`` makes it: dt bias and softplus on, entry states in x's dtype, D per head,
    no z (Mamba-2 gates in its norm). ``options`` go to the ``*_plan`` function, e.g.
    ``block_m=128`` or ``config={...}``."""
    plan = plan_function(name)
    nchunks = cdiv(seqlen, chunk_size)

    def meta(*shape, dt=torch.float32):
        return torch.empty(shape, dtype=dt, device="meta")

    x = meta(batch, seqlen, nheads, headdim, dt=dtype)
    B = meta(batch, seqlen, ngroups, dstate, dt=dtype)
    dt_out = meta(batch, nheads, nchunks, chunk_size)
    dA = meta(batch, nheads, nchunks, chunk_size)
    if name == "chunk_cumsum":
        A = meta(nheads)
        options = {"dt_bias": A, "dt_softplus": True, **options}
        return plan(meta(batch, seqlen, nheads, dt=dtype), A, chunk_size, **options)
    if name == "fwd_pass_state":
        return plan(x, B, dt_out, dA, **{"states_dtype": dtype, **options})
    states = meta(batch, nchunks, nheads, headdim, dstate, dt=dtype)
    return plan(x, B, B, dt_out, dA, states, **{"D": meta(nheads), **options})


def representative_plan(name, dtype=torch.bfloat16, dstate=None, **options):
    """(kernel, args) of one launch of kernel ``name`` at ``SHAPE`` (``dstate``, when given,
    replacing its 128): ``meta_plan`` at that layer."""
    layer = {k: v for k, v in SHAPE.items() if k != "chunk"}
    layer.update(chunk_size=SHAPE["chunk"], dstate=dstate or SHAPE["dstate"])
    plan = meta_plan(name, dtype=dtype, **layer, **options)
    return plan.kernel, plan.args
