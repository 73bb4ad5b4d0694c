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


# Each step against autograd through its own forward step (reference.chunked) ---------------------

def _step_problem():
    kw = make_problem(batch=2, seqlen=77, nheads=4, headdim=8, ngroups=2, dstate=16,
                      dtype=torch.float64, seed=6, seq_boundaries=[16, 37])
    from reference import chunked
    dt_out, dA = chunked.chunk_cumsum(kw["dt"], kw["A"], 16, kw["dt_bias"], True, (0.0, 1.5))
    entry, final = chunked.fwd_pass_state(kw["x"], kw["B"], dt_out, dA, kw["initial_states"],
                                          kw["seq_idx"])
    return kw, dt_out, dA, entry, final


def _autograd(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, grad_out)
    return [t.grad for t in leaves]


def _rand_like(t, seed):
    return torch.randn(t.shape, dtype=t.dtype, generator=torch.Generator().manual_seed(seed))


def test_compute_out_backward_step():
    from reference import chunked
    from reference.backward import compute_out_backward
    from reference.common import expand_groups
    kw, dt_out, dA, entry, _ = _step_problem()
    Bh, Ch = expand_groups(kw["B"], 4), expand_groups(kw["C"], 4)
    dy = _rand_like(kw["x"], 1)
    want = _autograd(lambda x, B, C, dt, a, e: chunked.compute_out(x, B, C, dt, a, e,
                                                                   seq_idx=kw["seq_idx"]),
                     (kw["x"], Bh, Ch, dt_out, dA, entry), (dy,))
    got = compute_out_backward(dy, kw["x"], Bh, Ch, dt_out, dA, entry, kw["seq_idx"])
    for name, g, w in zip(("dx", "dB", "dC", "ddt_out", "ddA", "dentry"), got, want, strict=True):
        assert rel_err(g, w) < 1e-12, name


def test_state_passing_and_chunk_states_backward_steps():
    from reference import chunked
    from reference.backward import chunk_states_backward, state_passing_backward
    from reference.common import expand_groups
    kw, dt_out, dA, entry, final = _step_problem()
    S = chunked.chunk_states(kw["x"], kw["B"], dt_out, dA, kw["seq_idx"])
    dentry, dfinal = _rand_like(entry, 2), _rand_like(final, 3)
    want = _autograd(lambda s, a, i: chunked.state_passing(s, a, i, kw["seq_idx"]),
                     (S, dA, kw["initial_states"]), (dentry, dfinal))
    dS, ddA, dinit = state_passing_backward(dentry, dfinal, entry, final, dA, kw["seq_idx"])
    assert rel_err(dS, want[0]) < 1e-12 and rel_err(ddA, want[1]) < 1e-12
    assert rel_err(dinit, want[2]) < 1e-12
    Bh = expand_groups(kw["B"], 4)
    want = _autograd(lambda x, B, dt, a: chunked.chunk_states(x, B, dt, a, kw["seq_idx"]),
                     (kw["x"], Bh, dt_out, dA), (dS,))
    got = chunk_states_backward(dS, kw["x"], Bh, dt_out, dA, kw["seq_idx"])
    for name, g, w in zip(("dx", "dB", "ddt_out", "ddA"), got, want, strict=True):
        assert rel_err(g, w) < 1e-12, name


def test_chunk_cumsum_backward_step():
    from reference import chunked
    from reference.backward import chunk_cumsum_backward
    kw, dt_out, dA, _, _ = _step_problem()
    ddt_out, ddA = _rand_like(dt_out, 4), _rand_like(dA, 5)
    want = _autograd(lambda dt, A, bias: chunked.chunk_cumsum(dt, A, 16, bias, True, (0.0, 1.5)),
                     (kw["dt"], kw["A"], kw["dt_bias"]), (ddt_out, ddA))
    got = chunk_cumsum_backward(ddt_out, ddA, kw["dt"], kw["A"], 16, kw["dt_bias"], True, (0.0, 1.5))
    for name, g, w in zip(("ddt", "dA", "ddt_bias"), got, want, strict=True):
        assert rel_err(g, w) < 1e-12, name
