"""ops/kernels/backward/bwd_chunk_states.py (the gradients of each chunk's own state) against its specification,
``reference.backward.chunk_states_backward`` in float64, accumulating into given buffers, every
config of its search space against the default, and its ahead-of-time compilation.

The reference's dB is per head; it is summed over each group's heads (``_sum_groups``) to
compare with the kernel's (b, L, g, n). Every output is NaN-poisoned first.

Tolerances, relative in norm: float32 inputs 1e-5 (float32 products over a chunk; observed
~1e-7); bfloat16 inputs 1e-2 (dS is rounded to bf16 as a tensor-core operand, 8 bits, as the
forward's products round theirs). Variants against the default: float32 1e-5 (other token tiles
and head splits sum dB and the last token's d dA in another order, a few ulps), bfloat16 4e-3
(a last-bit difference before the bf16 rounding of an output moves it by one step, rarely; as
in tests/kernels/helpers.py).
"""
import pytest
import torch

from ops.kernels.backward import bwd_chunk_states as mod
from ops.kernels.backward.bwd_chunk_states import bwd_chunk_states, bwd_chunk_states_plan
from reference import chunked
from reference.backward import _sum_groups, chunk_states_backward
from reference.common import LOG2E
from reference.problems import make_problem
from reference.validate import rel_err

from .helpers import DEVICES, space_cases

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-5}
NAMES = ("dx", "dB", "ddt_out", "ddA")


def problem(dtype, headdim=16, dstate=32, seq=True, seqlen=77, nheads=4, ngroups=2, chunk=16):
    kw = make_problem(batch=2, seqlen=seqlen, nheads=nheads, headdim=headdim, ngroups=ngroups,
                      dstate=dstate, dtype=dtype, seed=8, seq_boundaries=[16, 37] if seq else None)
    dt_out, dA = chunked.chunk_cumsum(kw["dt"], kw["A"], chunk, kw["dt_bias"], True, (0.0, 1.5))
    nchunks = dt_out.shape[2]
    dS = torch.randn(2, nchunks, nheads, headdim, dstate,
                     generator=torch.Generator().manual_seed(2))
    return kw, dt_out.float(), dA.float(), dS


def run_kernel(kw, dt_out, dA, dS, device, **options):
    to = lambda t: None if t is None else t.to(device)
    return bwd_chunk_states(to(dS), to(kw["x"]), to(kw["B"]), to(dt_out), to(dA * LOG2E),
                            to(kw.get("seq_idx")), poison=True, **options)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", [pytest.param(dict(), id="packed-ragged"),
                                  pytest.param(dict(seq=False, seqlen=64), id="whole-chunks"),
                                  pytest.param(dict(headdim=48, dstate=40), id="odd-sizes"),
                                  pytest.param(dict(chunk=32, nheads=6, ngroups=2),
                                               id="token-tiles-of-a-chunk")])
def test_matches_the_reference(device, dtype, case):
    kw, dt_out, dA, dS = problem(dtype, **case)
    if dtype == torch.float16:
        dS = dS * 1e5                                   # as under loss scaling
    f64 = lambda t: None if t is None else (t.double() if t.is_floating_point() else t)
    dx, dB, ddt, ddA = chunk_states_backward(dS.double(), f64(kw["x"]), f64(kw["B"]),
                                             dt_out.double(), dA.double(), kw.get("seq_idx"))
    want = (dx, _sum_groups(dB, kw["B"].shape[2]), ddt, ddA)
    # chunk 32 at the default's 64-token tiles is one tile; 16-token tiles split it in two
    config = dict(BLOCK_T=16) if case.get("chunk") == 32 else None
    got = run_kernel(kw, dt_out, dA, dS, device, config=config)
    assert got[1].shape == kw["B"].shape, "dB summed over each group's heads: (b, L, g, n)"
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert g.dtype == torch.float32 and rel_err(g.cpu(), w) < TOL[dtype], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_accumulates_into_given_buffers(device, dtype):
    """accumulate=(dx, ddt, ddA): the kernel's contributions added to them in place, exactly the
    float32 sum of the separate outputs and the buffers (one rounding either way); with bf16
    inputs, dS in bf16 gives the bits of dS in float32 (the products round it to bf16 anyway)."""
    kw, dt_out, dA, dS = problem(dtype)
    alone = run_kernel(kw, dt_out, dA, dS, device)
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(t.shape, generator=g).to(device) for t in (alone[0], alone[2], alone[3])]
    buffers = [t.clone() for t in base]
    if dtype == torch.bfloat16:
        dS = dS.to(torch.bfloat16)
    got = run_kernel(kw, dt_out, dA, dS, device, accumulate=tuple(buffers))
    for buf, out in zip(buffers, (got[0], got[2], got[3]), strict=True):
        assert out.data_ptr() == buf.data_ptr()
    # ddA's last-token term (the token tiles' sums) is added by the wrapper after the kernel's
    # own accumulation: one more float32 rounding there, the other tokens bit for bit on the
    # interpreter. On a GPU the compiler fuses the last product and the add into one FMA (one
    # rounding fewer than product-then-sum): a few float32 ulps, 1e-6.
    same = torch.equal if device == "cpu" else (lambda a, b: rel_err(a, b) < 1e-6)
    assert same(got[0], alone[0] + base[0]) and same(got[2], alone[2] + base[1])
    assert torch.equal(got[1], alone[1])
    assert same(got[3][..., :-1], alone[3][..., :-1] + base[2][..., :-1])
    assert rel_err(got[3][..., -1], alone[3][..., -1] + base[2][..., -1]) < 1e-6


def test_shared_accumulators_are_refused():
    """The kernel reads an accumulator and writes it back: one sharing memory with another
    argument would be read after a write, so the plan refuses it."""
    kw, dt_out, dA, dS = problem(torch.float32)
    alone = run_kernel(kw, dt_out, dA, dS, "cpu")
    dx, ddt = torch.zeros_like(alone[0]), torch.zeros_like(alone[2])
    for accumulate in ((dx, ddt, ddt), (dx, ddt, dt_out)):      # twice ddt; ddA is an input
        with pytest.raises(ValueError, match="sharing no memory"):
            run_kernel(kw, dt_out, dA, dS, "cpu", accumulate=accumulate)


# Every config of the search space at one small shape, against the default ------------------------

VARIANT = dict(seqlen=150, chunk=64, nheads=8, ngroups=2, headdim=16, dstate=32)
VARIANT_SHAPE = dict(batch=2, seqlen=150, chunk_size=64, headdim=16, dstate=32, nheads=8,
                     ngroups=2)


def variant_cases():
    space, params = space_cases(mod, VARIANT_SHAPE)
    assert len(space) < 20
    assert {c["HEADS_PER_BLOCK"] for c in space} >= {1, 4}, "per-head blocks and whole groups"
    assert {c["BLOCK_T"] for c in space} == {32, 64}
    return params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name, config", variant_cases())
def test_variant_matches_the_default(device, dtype_name, config):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    kw, dt_out, dA, dS = problem(dtype, **VARIANT)
    want = run_kernel(kw, dt_out, dA, dS, device)
    got = run_kernel(kw, dt_out, dA, dS, device, config=config)
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert rel_err(g, w) < (1e-5 if dtype == torch.float32 else 4e-3), name


def test_refuses_bad_configs_and_inputs():
    kw, dt_out, dA, dS = problem(torch.float32, chunk=32)
    args = (dS, kw["x"], kw["B"], dt_out, dA, kw.get("seq_idx"))
    with pytest.raises(ValueError, match="HEADS_PER_BLOCK"):
        bwd_chunk_states_plan(*args, config=dict(HEADS_PER_BLOCK=3))
    with pytest.raises(ValueError, match="BLOCK_T"):
        bwd_chunk_states_plan(*args, config=dict(BLOCK_T=64))        # more than the chunk
    with pytest.raises(ValueError, match="unknown config keys"):
        bwd_chunk_states_plan(*args, config=dict(BLOCK_M=32))
    with pytest.raises(TypeError, match="dS"):
        bwd_chunk_states_plan(dS.to(torch.bfloat16), *args[1:])     # float32 inputs
    with pytest.raises(ValueError, match="accumulator dx"):
        bwd_chunk_states_plan(*args, accumulate=(kw["x"].double(), dt_out, dt_out))


# Ahead-of-time compilation ------------------------------------------------------------------------

def meta(*s, dt=torch.float32):
    return torch.empty(s, dtype=dt, device="meta")


def meta_plan(config=None, ds_dtype=torch.float32, accumulate=False, seqlen=16384, batch=1):
    """The launch at a Mamba-2 layer of a ~2.7B model (80 heads of 64, dstate 128, chunk 256)."""
    nchunks = seqlen // 256
    x = meta(batch, seqlen, 80, 64, dt=torch.bfloat16)
    acc = (meta(batch, seqlen, 80, 64), meta(batch, 80, nchunks, 256),
           meta(batch, 80, nchunks, 256)) if accumulate else None
    return bwd_chunk_states_plan(meta(batch, nchunks, 80, 64, 128, dt=ds_dtype), x,
                                 meta(batch, seqlen, 1, 128, dt=torch.bfloat16),
                                 meta(batch, 80, nchunks, 256), meta(batch, 80, nchunks, 256),
                                 meta(batch, seqlen, dt=torch.int32), config=config,
                                 accumulate=acc)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_compiles(arch):
    from ops.tools.aot import compile_cubin
    plan = meta_plan()
    assert compile_cubin(plan.kernel, plan.args, arch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("case", [
    pytest.param(dict(dtype=torch.float16), id="fp16"),
    pytest.param(dict(dtype=torch.float32, seq_idx=False), id="fp32-no-seq_idx"),
    pytest.param(dict(config=dict(BLOCK_T=16), headdim=48, dstate=40), id="tiles16-odd-sizes"),
    pytest.param(dict(config=dict(INDEX64=True)), id="int64")])
def test_other_variants_compile_for_sm_90(case):
    """The launches the search-space test leaves out: other dtypes (fp16 takes float32
    operands), no seq_idx, 16-token tiles at sizes that are not powers of two, 64-bit indices."""
    from ops.tools.aot import compile_cubin
    dtype, p, n = case.get("dtype", torch.bfloat16), case.get("headdim", 64), case.get("dstate", 128)
    x = meta(1, 1024, 8, p, dt=dtype)
    plan = bwd_chunk_states_plan(meta(1, 4, 8, p, n), x, meta(1, 1024, 1, n, dt=dtype),
                                 meta(1, 8, 4, 256), meta(1, 8, 4, 256),
                                 meta(1, 1024, dt=torch.int32) if case.get("seq_idx", True) else None,
                                 config=case.get("config"))
    assert compile_cubin(plan.kernel, plan.args, "sm_90")[:4] == b"\x7fELF"


SPACE_SHAPE = dict(batch=8, seqlen=2048, chunk_size=256, headdim=64, dstate=128, nheads=80,
                   ngroups=1, dtype=torch.bfloat16)


@pytest.mark.parametrize("config", mod.search_space(**SPACE_SHAPE),
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_search_space_compiles_for_sm_90(config):
    """As the backward launches it: bf16 dS, accumulating into compute_out's buffers."""
    from ops.tools.aot import compile_cubin
    plan = meta_plan(config, torch.bfloat16, True, seqlen=2048, batch=8)
    assert compile_cubin(plan.kernel, plan.args, "sm_90")[:4] == b"\x7fELF"
