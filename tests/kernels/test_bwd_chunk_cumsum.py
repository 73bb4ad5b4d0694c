"""ops/kernels/backward/bwd_chunk_cumsum.py (through the cumsum and the dt processing) against its specification,
``reference.backward.chunk_cumsum_backward`` in float64.

Tolerance 1e-5 relative in norm: float32 arithmetic (a reverse scan over a chunk, softplus and
sigmoid); observed ~1e-7.
"""
import pytest
import torch

from ops.kernels.backward import bwd_chunk_cumsum as mod
from ops.kernels.backward.bwd_chunk_cumsum import bwd_chunk_cumsum, bwd_chunk_cumsum_plan
from reference.backward import chunk_cumsum_backward
from reference.problems import make_problem
from reference.validate import rel_err

from .helpers import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [
    pytest.param(dict(dt_softplus=True, dt_limit=(0.0, 1.5)), id="softplus-limit"),
    pytest.param(dict(dt_softplus=True, dt_limit=(0.05, 0.5)), id="clamping"),
    pytest.param(dict(), id="plain"),
])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("seqlen, nheads", [(77, 4), (64, 20)], ids=["ragged", "heads-20"])
def test_matches_the_reference(device, options, with_bias, seqlen, nheads):
    kw = make_problem(batch=2, seqlen=seqlen, nheads=nheads, headdim=8, ngroups=1, dstate=16,
                      dtype=torch.float32, seed=9)
    nchunks = -(-seqlen // 16)
    g = torch.Generator().manual_seed(4)
    ddt_out = torch.randn(2, nheads, nchunks, 16, generator=g)
    ddA = torch.randn(2, nheads, nchunks, 16, generator=g)
    bias = kw["dt_bias"] if with_bias else None
    f64 = lambda t: None if t is None else t.double()
    want = chunk_cumsum_backward(ddt_out.double(), ddA.double(), kw["dt"].double(), kw["A"].double(),
                                 16, f64(bias), **options)
    to = lambda t: None if t is None else t.to(device)
    got = bwd_chunk_cumsum(to(ddt_out), to(ddA), to(kw["dt"]), to(kw["A"]), to(bias), poison=True,
                           **options)
    for name, g_, w in zip(("ddt", "dA", "ddt_bias"), got, want, strict=True):
        if w is None:
            assert g_ is None
        else:
            assert g_.dtype == torch.float32 and rel_err(g_.cpu(), w) < 1e-5, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("widths", [(3,), (4, 5), (1, 16)], ids=["one", "two-ragged", "two"])
def test_chunk_end_partials_are_summed_in(device, widths):
    """``chunk_ends``: partial sums of ddA's terms at each chunk's last token, summed by the
    kernel where it reads ddA (widths not a power of two load padded with zeros), give the
    reference's gradients for ddA with those sums added there first (in float64)."""
    kw = make_problem(batch=2, seqlen=77, nheads=20, headdim=8, ngroups=1, dstate=16,
                      dtype=torch.float32, seed=9)
    g = torch.Generator().manual_seed(5)
    ddt_out, ddA = torch.randn(2, 20, 5, 16, generator=g), torch.randn(2, 20, 5, 16, generator=g)
    ends = [torch.randn(2, 20, 5, w, generator=g) for w in widths]
    ddA_full = ddA.double().clone()
    for e in ends:
        ddA_full[..., -1] += e.double().sum(-1)
    options = dict(dt_softplus=True, dt_limit=(0.0, 1.5))
    want = chunk_cumsum_backward(ddt_out.double(), ddA_full, kw["dt"].double(),
                                 kw["A"].double(), 16, kw["dt_bias"].double(), **options)
    to = lambda t: t.to(device)
    got = bwd_chunk_cumsum(to(ddt_out), to(ddA), to(kw["dt"]), to(kw["A"]), to(kw["dt_bias"]),
                           poison=True, chunk_ends=[to(e) for e in ends], **options)
    for name, g_, w in zip(("ddt", "dA", "ddt_bias"), got, want, strict=True):
        assert rel_err(g_.cpu(), w) < 1e-5, name
    plain = bwd_chunk_cumsum(to(ddt_out), to(ddA), to(kw["dt"]), to(kw["A"]), to(kw["dt_bias"]),
                             **options)
    assert rel_err(plain[1].cpu(), want[1]) > 1e-3          # the partials matter here
    # one padded width for the usual counts (one compiled variant), wider where needed
    assert [mod.end_width(n) for n in (1, 3, 8, 9, 16)] == [8, 8, 8, 16, 16]


def test_chunk_ends_are_checked():
    args = meta_args(1, 4096)
    ok = torch.empty(1, 80, 16, 2, device="meta")
    for bad, match in (((ok, ok, ok), "at most two"),
                       ((torch.empty(1, 80, 15, 2, device="meta"),), r"\(1, 80, 16\)"),
                       ((ok.to(torch.bfloat16),), "float32"),
                       ((ok[..., :0],), "1..1024 parts"),
                       (("x",), "got str")):
        with pytest.raises(ValueError, match=match):
            bwd_chunk_cumsum_plan(*args, chunk_ends=bad)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_compiles(arch):
    from ops.tools.aot import compile_cubin
    meta = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device="meta")
    plan = bwd_chunk_cumsum_plan(meta(1, 80, 64, 256), meta(1, 80, 64, 256),
                                 meta(1, 16384, 80, dt=torch.bfloat16), meta(80), meta(80),
                                 dt_softplus=True, chunk_ends=(meta(1, 80, 64, 4),
                                                               meta(1, 80, 64, 2)))
    assert compile_cubin(plan.kernel, plan.args, arch)[:4] == b"\x7fELF"


# Every config of the search space at one small shape, against the default ------------------------
#
# Each token's ddt is computed by one block whatever the config (the same float32 operations):
# bit for bit. dA and ddt_bias sum a chunk's tokens inside a (BLOCK_H, CHUNK) tile, whose
# reduction order may follow the tile's shape: a few float32 ulps, 1e-6.

SHAPE = dict(nheads=20)
LAYER = dict(nheads=80)


@pytest.mark.parametrize("config", mod.search_space(**SHAPE)[1:],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_variant_matches_the_default(config):
    kw = make_problem(batch=2, seqlen=77, nheads=20, headdim=8, ngroups=1, dstate=16,
                      dtype=torch.float32, seed=9)
    g = torch.Generator().manual_seed(4)
    ddt_out, ddA = torch.randn(2, 20, 5, 16, generator=g), torch.randn(2, 20, 5, 16, generator=g)
    args = (ddt_out, ddA, kw["dt"], kw["A"], kw["dt_bias"], True, (0.05, 0.5))
    want = bwd_chunk_cumsum(*args, poison=True)
    got = bwd_chunk_cumsum(*args, poison=True, config=config)
    assert torch.equal(got[0], want[0])
    for g_, w in zip(got[1:], want[1:], strict=True):
        assert rel_err(g_, w) < 1e-6


def test_search_space():
    for shape in (SHAPE, LAYER):
        space = mod.search_space(**shape)
        assert space[0] == mod.default_config(**shape) and len(space) < 20
    with pytest.raises(ValueError, match="BLOCK_H"):
        bwd_chunk_cumsum_plan(*meta_args(), config=dict(BLOCK_H=12))


def meta_args(batch=1, seqlen=16384):
    meta = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device="meta")
    nchunks = seqlen // 256
    return (meta(batch, 80, nchunks, 256), meta(batch, 80, nchunks, 256),
            meta(batch, seqlen, 80, dt=torch.bfloat16), meta(80), meta(80))


@pytest.mark.parametrize("config", mod.search_space(**LAYER),
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_search_space_compiles_for_sm_90(config):
    from ops.tools.aot import compile_cubin
    plan = bwd_chunk_cumsum_plan(*meta_args(8, 2048), dt_softplus=True, config=config)
    assert compile_cubin(plan.kernel, plan.args, "sm_90")[:4] == b"\x7fELF"
