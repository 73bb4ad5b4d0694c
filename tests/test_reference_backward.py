"""reference/backward.py against autograd through the token-by-token recurrence, in float64.

The expected gradients are autograd's through ``reference.sequential.ssd_sequential`` (the
loop of notebook 01, which shares no code with the chunked backward), for a random loss
weighting of both outputs. float64 throughout: the two differ only by rounding, 1e-9 relative.
"""
import pytest
import torch

from reference.backward import ssd_chunked_backward
from reference.chunked import ssd_chunked
from reference.problems import make_problem
from reference.sequential import ssd_sequential
from reference.validate import rel_err

INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")

CASES = [
    pytest.param(dict(), dict(dt_softplus=True, dt_limit=(0.0, 1.5)), id="all-options-ragged"),
    pytest.param(dict(seq_boundaries=[16, 37], D="2d"), dict(dt_softplus=True), id="packed-D2d"),
    pytest.param(dict(D=None, z=False, dt_bias=False, initial_states=False, ngroups=1), dict(),
                 id="no-options"),
    pytest.param(dict(seqlen=3, ngroups=4), dict(dt_softplus=True, dt_limit=(0.05, 0.5)),
                 id="L3-clamped"),
]


@pytest.mark.parametrize("problem, options", CASES)
def test_gradients_equal_autograd_through_the_recurrence(problem, options):
    kw = make_problem(**{**dict(batch=2, seqlen=77, nheads=4, headdim=8, ngroups=2, dstate=16),
                         **problem}, dtype=torch.float64, seed=5)
    g = torch.Generator().manual_seed(9)
    dout = torch.randn(kw["x"].shape, generator=g, dtype=torch.float64)
    dfinal = torch.randn(kw["x"].shape[0], kw["x"].shape[2], kw["x"].shape[3], kw["B"].shape[3],
                         generator=g, dtype=torch.float64)

    leaves = {k: v.clone().requires_grad_(True) for k, v in kw.items() if k in INPUTS}
    out, final = ssd_sequential(**{**kw, **leaves}, **options, return_final_states=True)
    torch.autograd.backward([out, final], [dout, dfinal])

    ours = ssd_chunked_backward(dout, dfinal, **kw, chunk_size=16, **options)
    for name, leaf in leaves.items():
        got = ours["d" + name]
        assert got.shape == leaf.shape, name
        assert rel_err(got, leaf.grad) < 1e-9, name
    assert set(ours) == {"d" + name for name in leaves}
    if options.get("dt_limit", (0.0,))[0] > 0:       # the clamp's mask is exercised: some, not all
        assert 0 < float((ours["ddt"] == 0).double().mean()) < 1


def test_the_forward_it_differentiates_is_ssd_chunked():
    """The gradient of a linear function of the outputs equals the function's directional
    derivative: a finite-difference check along x of ssd_chunked itself (float64, central)."""
    kw = make_problem(batch=1, seqlen=40, nheads=2, headdim=8, ngroups=1, dstate=16,
                      dtype=torch.float64, seed=3, seq_boundaries=[20])
    options = dict(dt_softplus=True)
    g = torch.Generator().manual_seed(4)
    dout = torch.randn(kw["x"].shape, generator=g, dtype=torch.float64)
    direction = torch.randn(kw["x"].shape, generator=g, dtype=torch.float64)
    grads = ssd_chunked_backward(dout, None, **kw, chunk_size=16, **options)
    eps = 1e-6
    plus = ssd_chunked(**{**kw, "x": kw["x"] + eps * direction}, chunk_size=16, **options)
    minus = ssd_chunked(**{**kw, "x": kw["x"] - eps * direction}, chunk_size=16, **options)
    numeric = ((plus - minus) * dout).sum() / (2 * eps)
    assert abs(numeric - (grads["dx"] * direction).sum()) < 1e-6 * abs(numeric)
