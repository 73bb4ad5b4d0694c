"""Every reference stage against the token-by-token recurrence, in float64.

Float64 leaves only reassociation error (sums taken in another order), far below 1e-10, so
any real mistake (a wrong mask, an off-by-one in a chunk boundary) shows up immediately.
"""
import math

import pytest
import torch

from reference import chunked
from reference.chunked import ssd_chunked
from reference.common import process_dt
from reference.problems import make_problem, packed_seq_idx
from reference.quadratic import ssd_quadratic
from reference.sequential import ssd_sequential
from reference.validate import rel_err

TOL = 1e-10

CASES = [
    pytest.param(dict(), 16, id="all-options-ragged-L77-g2"),
    pytest.param(dict(seq_boundaries=[20, 32, 50]), 16, id="packed-inside-and-at-chunk-boundary"),
    pytest.param(dict(seq_boundaries=[0]), 16, id="packed-first-id-1-drops-initial-state"),
    pytest.param(dict(seqlen=64, ngroups=1, D="2d"), 32, id="L-multiple-of-chunk-D2d"),
    pytest.param(dict(seqlen=5, ngroups=4), 16, id="L-shorter-than-chunk-g-equals-h"),
    pytest.param(dict(seqlen=1), 16, id="L1"),
    pytest.param(dict(D=None, z=False, dt_bias=False, initial_states=False), 16, id="no-options"),
    pytest.param(dict(seqlen=300, headdim=4, dstate=8, seq_boundaries=[100, 255, 256]), 128, id="chunk128-packed"),
]
OPTIONS = dict(dt_softplus=True, dt_limit=(0.05, 1.5))


@pytest.mark.parametrize("problem, chunk_size", CASES)
def test_quadratic_and_chunked_match_sequential(problem, chunk_size):
    kw = make_problem(**problem)
    y0, h0 = ssd_sequential(**kw, **OPTIONS, return_final_states=True)
    yq, hq = ssd_quadratic(**kw, **OPTIONS, return_final_states=True)
    yc, hc = ssd_chunked(**kw, chunk_size=chunk_size, **OPTIONS, return_final_states=True)
    assert rel_err(yq, y0) < TOL and rel_err(hq, h0) < TOL
    assert rel_err(yc, y0) < TOL and rel_err(hc, h0) < TOL


@pytest.mark.parametrize("softplus, limit", [(False, (0.0, math.inf)), (True, (0.0, math.inf)),
                                             (True, (0.1, 0.6)), (False, (-1.0, 1.0))])
def test_options_change_the_answer(softplus, limit):
    """Guard against an option being silently ignored: each setting gives a different output."""
    kw = make_problem(seed=3)
    base = ssd_sequential(**kw)
    y = ssd_sequential(**kw, dt_softplus=softplus, dt_limit=limit)
    changed = softplus or limit != (0.0, math.inf)
    assert (rel_err(y, base) > 1e-3) == changed


def test_process_dt_matches_definition():
    dt = torch.tensor([-30.0, -1.0, 0.0, 0.5, 19.9, 20.0, 20.5, 50.0], dtype=torch.float64)
    out = process_dt(dt, dt_softplus=True, dt_limit=(0.001, 30.0))
    expect = [math.log1p(math.exp(v)) if v <= 20 else v for v in dt.tolist()]
    expect = [min(max(v, 0.001), 30.0) for v in expect]
    assert torch.allclose(out, torch.tensor(expect, dtype=torch.float64), rtol=1e-12, atol=0)
    # Without softplus the default limit still clamps negatives to 0 (mamba_ssm does the same).
    assert process_dt(dt).min().item() == 0.0


@pytest.mark.parametrize("seq_boundaries", [None, [10, 40]])
def test_chunk_steps_against_the_recurrence(seq_boundaries):
    """Each chunked step on its own: (a) the cumsum, (b) entry states are the recurrence's state
    at every chunk boundary, and the final state."""
    chunk_size, L = 16, 70
    kw = make_problem(seqlen=L, seq_boundaries=seq_boundaries, seed=7)
    opts = dict(dt_bias=kw["dt_bias"], dt_softplus=True, dt_limit=(0.0, 2.0))
    dt_out, dA = chunked.chunk_cumsum(kw["dt"], kw["A"], chunk_size, **opts)
    nchunks = chunked.nchunks_of(L, chunk_size)
    assert dt_out.shape == dA.shape == (2, 4, nchunks, chunk_size)

    # (a) cumsum restarts in every chunk; padding tokens have dt = 0 and keep the sum flat.
    dt_full = process_dt(kw["dt"], **opts)
    for c in range(nchunks):
        seg = dt_full[:, c * chunk_size:(c + 1) * chunk_size].transpose(1, 2)
        n = seg.shape[-1]
        expect = torch.cumsum(seg * kw["A"][:, None], dim=-1)
        assert torch.allclose(dA[:, :, c, :n], expect, rtol=1e-12, atol=1e-12)
        assert (dt_out[:, :, c, n:] == 0).all() and (dA[:, :, c, n:] == dA[:, :, c, n - 1:n]).all()

    # (b) the entry state of chunk c is the recurrence's state after token c*chunk_size - 1.
    entry, final = chunked.fwd_pass_state(kw["x"], kw["B"], dt_out, dA, kw["initial_states"], kw.get("seq_idx"))
    seq_opts = dict(A=kw["A"], initial_states=kw["initial_states"], return_final_states=True, **opts)
    for c in range(1, nchunks):
        t = c * chunk_size
        sub = {k: kw[k][:, :t] for k in ("x", "dt", "B", "C")}
        if "seq_idx" in kw:
            sub["seq_idx"] = kw["seq_idx"][:, :t]
        _, h = ssd_sequential(**sub, **seq_opts)
        assert rel_err(entry[:, c], h) < TOL
    assert rel_err(entry[:, 0], kw["initial_states"]) < TOL
    _, h_end = ssd_sequential(**{k: v for k, v in kw.items() if k not in ("D", "z", "dt_bias", "A",
                                                                       "initial_states")}, **seq_opts)
    assert rel_err(final, h_end) < TOL

    # (c) outputs from those entry states match the recurrence (before the final cast).
    y = chunked.compute_out(kw["x"], kw["B"], kw["C"], dt_out, dA, entry, kw["D"], kw["z"], kw.get("seq_idx"))
    y0 = ssd_sequential(**kw, dt_softplus=True, dt_limit=(0.0, 2.0))
    assert rel_err(y, y0) < TOL


def test_packed_sequences_equal_separate_runs():
    """Packing two sequences in one row with seq_idx gives the same outputs as running them apart."""
    kw = make_problem(batch=1, seqlen=50, initial_states=False, seed=11)
    kw["seq_idx"] = packed_seq_idx(1, 50, [23])
    y = ssd_chunked(**kw, chunk_size=16)
    for lo, hi in ((0, 23), (23, 50)):
        part = {k: (v[:, lo:hi] if k in ("x", "dt", "B", "C", "z") else v) for k, v in kw.items() if k != "seq_idx"}
        assert rel_err(y[:, lo:hi], ssd_sequential(**part)) < TOL


def test_decay_forgets():
    """A sanity check of the model itself: an impulse at t=0 fades as exp(cumsum(dt*A))."""
    L = 40
    x = torch.zeros(1, L, 1, 1, dtype=torch.float64)
    x[0, 0] = 1.0
    dt = torch.full((1, L, 1), 0.1, dtype=torch.float64)
    A = torch.tensor([-1.0], dtype=torch.float64)
    B = C = torch.ones(1, L, 1, 1, dtype=torch.float64)
    y = ssd_sequential(x, dt, A, B, C)[0, :, 0, 0]
    expect = 0.1 * torch.exp(-0.1 * torch.arange(L, dtype=torch.float64))
    assert torch.allclose(y, expect, rtol=1e-12)
