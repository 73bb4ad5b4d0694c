"""Calls past 32-bit indexing run in pieces (``ops.ssd_combined``, "In pieces"): groups of rows,
or one row's tokens in segments chained through their final states, joined.

On the CPU the limit is lowered (``PIECE_LIMIT``) so that small problems split; the pieces'
result is compared with the same call made whole, on the interpreter's kernels, float32.
Tolerances: 1e-5 relative for outputs and final states, 2e-5 for gradients (float32: the state
handed across a segment boundary is the float32 final state a whole call would also keep in
float32 here; what differs is the order of a few sums, as in tests/api/test_api.py's float32
bounds). ``_pieces``' arithmetic is checked at the real limit on a 1M-token layer's shapes.
"""
import pytest
import torch

import ops.ssd_combined as api
from ops import mamba_chunk_scan_combined
from reference.problems import make_problem
from reference.validate import rel_err

OPTIONS = dict(dt_softplus=True, dt_limit=(0.0, 1.5), backend="interpret")
LEAVES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def meta(*shape):
    return torch.empty(shape, device="meta")


def pieces(batch, seqlen, nheads, headdim, ngroups, dstate, chunk, dt=None):
    """``_pieces`` for a call of these sizes (meta tensors; ``dt`` as given, else contiguous)."""
    x, B = meta(batch, seqlen, nheads, headdim), meta(batch, seqlen, ngroups, dstate)
    dt = meta(batch, seqlen, nheads) if dt is None else dt
    return api._pieces(x, dt, B, B, None, chunk)


def test_the_pieces_of_a_million_token_layer():
    """At the real limit (2**31 elements): 80 heads of 64 x 128 at a caller's chunk 256 (the
    kernels may compute at 128 there: entry states of x's size per token). A row of 1M tokens
    takes three segments, each a multiple of 256; one row of 256K fits whole, two rows go one
    by one; eight rows of 64K go six and two; dstate 256 doubles the states per token."""
    rows, segment = pieces(1, 1 << 20, 80, 64, 1, 128, 256)
    assert rows == 1 and segment % 256 == 0 and 3 * segment >= 1 << 20 > 2 * segment
    assert segment * 80 * 64 < 2**31
    assert pieces(1, 1 << 18, 80, 64, 1, 128, 256) is None
    assert pieces(2, 1 << 18, 80, 64, 1, 128, 256) == (1, 1 << 18)
    assert pieces(8, 1 << 16, 80, 64, 1, 128, 256) == (6, 1 << 16)
    rows, segment = pieces(1, 1 << 20, 80, 64, 1, 256, 256)
    assert segment * 80 * 64 * 2 < 2**31 and 6 * segment >= 1 << 20
    # a caller's chunk of 64 (computed at 64): states twice x's size per token at dstate 128
    rows, segment = pieces(1, 1 << 20, 80, 64, 1, 128, 64)
    assert segment * 80 * 64 * 2 < 2**31


def test_what_bounds_a_piece():
    """Besides x and the states: a row's last chunk cut short still takes a whole chunk's
    states (1000 tokens at chunk 64 are 16 chunks: 500 rows go 409 at a time, not 419); an
    input passed as a view reaches as far as its stride along the sequence (dt as the mixer
    cuts it from the input projection: 10576 elements a token, twice x's); B and C with as many
    groups as heads; C B^T per chunk and group, and the backward's partials per split of a
    group's heads."""
    rows, _ = pieces(500, 1000, 80, 64, 1, 64, 64)
    assert rows * 1024 * 80 * 64 < 2**31 and rows == 409
    _, plain = pieces(1, 1 << 20, 80, 64, 1, 128, 256)
    _, viewed = pieces(1, 1 << 20, 80, 64, 1, 128, 256,
                       dt=torch.empty(1, 1 << 20, 10576, device="meta")[..., :80])
    assert viewed * 10576 < 2**31 < plain * 10576
    _, grouped = pieces(1, 1 << 20, 64, 8, 64, 256, 256)                    # B: 16384 a token
    assert grouped * 64 * 256 < 2**31
    # 80 heads in 20 groups: the backward's partials, four head splits of each group's
    # (g x max(n, chunk)) a token, reach four times what B does
    _, split = pieces(1, 1 << 20, 80, 64, 20, 128, 256)
    assert split * 4 * 20 * 256 < 2**31 and split <= 2**31 // (80 * 64) // 4


def _call(kw, grad):
    leaves = {k: (v.detach().clone().requires_grad_(grad and k in LEAVES)
                  if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out, final = mamba_chunk_scan_combined(**leaves, chunk_size=32, return_final_states=True,
                                           **OPTIONS)
    grads = {}
    if grad:
        g = torch.Generator().manual_seed(9)
        w_out, w_final = torch.randn(out.shape, generator=g), torch.randn(final.shape, generator=g)
        ((out * w_out).sum() + (final * w_final).sum()).backward()
        grads = {k: leaves[k].grad for k in LEAVES if k in leaves}
    return out.detach(), final.detach(), grads


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("batch, seqlen, expect, calls", [
    (1, 700, (1, 512), [(1, 512), (1, 188)]),          # one row, segments of 512 and 188
    (2, 700, (1, 512), [(1, 512), (1, 188)] * 2),      # each row so
    (3, 200, (2, 200), [(2, 200), (1, 200)]),          # whole rows, pieces of two and one
], ids=["segments", "rows-in-segments", "rows"])
def test_pieces_give_the_whole_calls_result(monkeypatch, grad, batch, seqlen, expect, calls):
    """The limit lowered to 3 x 2**17: the backward's partials of d(C B^T), two head splits of
    256 a token here, make a row of 700 tokens (768 in whole chunks of 256) too long and one of
    200 (256) fit three times."""
    kw = make_problem(batch=batch, seqlen=seqlen, nheads=2, headdim=8, ngroups=1, dstate=16,
                      dtype=torch.float32, seed=4)
    whole = _call(kw, grad)
    from ops.runtime import replay, tape
    monkeypatch.setattr(replay, "_REPLAYS", {})      # (a replay keys on the shapes, not the limit)
    monkeypatch.setattr(tape, "_TAPES", {})
    monkeypatch.setattr(api, "PIECE_LIMIT", 3 * 2**17)
    assert api._pieces(kw["x"], kw["dt"], kw["B"], kw["C"], kw["z"], 32) == expect
    made, inner = [], api.mamba_chunk_scan_combined

    def counted(x, *args, **kwargs):
        made.append(tuple(x.shape[:2]))
        return inner(x, *args, **kwargs)
    monkeypatch.setattr(api, "mamba_chunk_scan_combined", counted)
    split = _call(kw, grad)
    assert made == calls
    for name, a, b in (("out", split[0], whole[0]), ("final states", split[1], whole[1])):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5, name
    assert split[2].keys() == whole[2].keys() == (set(LEAVES) if grad else set())
    for name in split[2]:
        assert rel_err(split[2][name], whole[2][name]) < 2e-5, name


def test_sequence_ids_keep_a_call_whole(monkeypatch):
    """With seq_idx the call is not split (the ids would need renumbering per segment): it
    runs whole, 64-bit indexed where it must be."""
    kw = make_problem(batch=1, seqlen=700, nheads=2, headdim=8, ngroups=1, dstate=16,
                      dtype=torch.float32, seed=5, seq_boundaries=[100, 400])
    monkeypatch.setattr(api, "PIECE_LIMIT", 3 * 2**16)
    monkeypatch.setattr(api, "_in_pieces", lambda *a: pytest.fail("split a call with seq_idx"))
    out = mamba_chunk_scan_combined(**kw, chunk_size=32, **OPTIONS)
    assert out.shape == kw["x"].shape and torch.isfinite(out).all()


def _past_the_limit_on_the_gpu(requires_grad=False):
    """1 x (2**19 + 4096) tokens x 80 heads of 64 (bf16, dstate 16): x has more than 2**31
    elements, so the call runs in segments, 32-bit indexed."""
    torch.manual_seed(0)
    b, L, h, p, n = 1, (1 << 19) + 4096, 80, 64, 16
    assert b * L * h * p > 2**31
    x = torch.randn(b, L, h, p, device="cuda", dtype=torch.bfloat16)
    dt = torch.randn(b, L, h, device="cuda") * 0.5 - 1.0
    A = -(torch.rand(h, device="cuda") + 0.5)
    B, C = (torch.randn(b, L, 1, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    D = torch.randn(h, device="cuda")
    assert api._pieces(x, dt, B, C, None, 256) is not None
    return [t.requires_grad_(requires_grad) for t in (x, dt, A, B, C, D)]


@pytest.mark.gpu
@pytest.mark.gpu_memory
def test_a_call_past_two_to_the_31_elements_on_the_gpu():
    """On the GPU at the real limit: the pieces' output and final state against the same kernels
    run whole (``kernel_forward``, 64-bit indexed): bf16's bound, 1e-2 (the whole run stores the
    entry state at a segment boundary in bf16, the pieces hand it over in float32)."""
    from ops.forward import kernel_forward
    x, dt, A, B, C, D = _past_the_limit_on_the_gpu()
    out, final = mamba_chunk_scan_combined(x, dt, A, B, C, 256, D=D, dt_softplus=True,
                                           return_final_states=True)
    whole, whole_final = kernel_forward(x, dt, A, B, C, 256, D=D, dt_softplus=True)
    assert rel_err(out, whole) < 1e-2 and rel_err(final, whole_final) < 1e-2


@pytest.mark.gpu
@pytest.mark.gpu_memory
def test_gradients_past_two_to_the_31_elements_on_the_gpu():
    """The same call's gradients, for a random dout (each segment's backward gets a slice of it
    whose stride(0) is past 32 bits) and dfinal, against the kernels' backward run whole
    (``kernel_backward``, 64-bit indexed): 2e-2, bf16's bound as above, doubled for the
    gradients' longer chains of bf16 operands."""
    from ops.backward import kernel_backward
    leaves = _past_the_limit_on_the_gpu(requires_grad=True)
    x, dt, A, B, C, D = leaves
    out, final = mamba_chunk_scan_combined(x, dt, A, B, C, 256, D=D, dt_softplus=True,
                                           return_final_states=True)
    dout, dfinal = torch.randn_like(out), torch.randn_like(final)
    got = torch.autograd.grad((out, final), leaves, (dout, dfinal))
    del out, final
    with torch.no_grad():
        want = kernel_backward(dout, dfinal, *(t.detach() for t in (x, dt, A, B, C)), 256,
                               D=D.detach(), dt_softplus=True)
    for name, g in zip(("dx", "ddt", "dA", "dB", "dC", "dD"), got, strict=True):
        assert rel_err(g.float(), want[name]) < 2e-2, name
