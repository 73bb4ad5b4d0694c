"""Inputs as a Mamba-2 layer passes them: views of larger tensors, read by the kernels in place.

A layer splits one projection per token into z, x, B, C and dt (``ops/mixer.py``), so they are
views whose last dimension is contiguous but whose token stride is the projection's row length.
``ops.torch_op.as_kernel_input`` hands such views to the kernels as they are when they start and
step 16-byte aligned, and copies what the kernels would read slowly or not at all in place (a
strided last dimension, an unaligned base or stride, elements sharing memory).

Each test builds the views from one random parent, runs the forward pass, and checks
  * the outputs against the same call on fresh contiguous copies, bitwise (the kernels read the
    same values, whatever the layout);
  * what each kernel launch received (the launch functions are wrapped): the view's own memory
    (same data pointer, same strides) where it is read in place, a contiguous copy elsewhere.
CPU: the interpreter at small sizes. GPU (``gpu`` marker): the compiled kernels at 2 x 1K tokens,
with projections whose rows give 16-byte aligned strides (read in place), a base that is not
16-byte aligned and a row length that is not a multiple of 16 bytes (copied; and, read in place
regardless, the same results).
"""
import inspect

import pytest
import torch

from ops import mamba_chunk_scan_combined
from ops.runtime.cutile_internals import kernel_function
from ops.forward import kernel_forward
from ops.runtime.launch import INT32_LIMIT, element_reach
from ops.torch_op import as_kernel_input

# The inputs each kernel reads (its parameters of the same names).
READS = {"chunk_cumsum_kernel": ("dt", "A", "dt_bias"),
         "fwd_pass_state_kernel": ("x", "B", "initial_states", "seq_idx"),
         "chunk_scores_kernel": ("B", "C"),
         "compute_out_kernel": ("x", "B", "C", "D", "z", "seq_idx")}
INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")
SMALL = dict(batch=2, seqlen=80, nheads=4, headdim=16, ngroups=2, dstate=16)   # chunk 32


def layer_inputs(batch, seqlen, nheads, headdim, ngroups, dstate, dtype=torch.float32,
                 device="cpu", seed=0, prefix=0, row_pad=0, D=None, z=False, dt_bias=False,
                 initial_states=False, seq_idx=False, requires_grad=False):
    """The inputs of a call, each a view of a larger random tensor (never zeros) as a layer has
    them: z, x, B, C, dt column slices of one (batch, seqlen, row) projection whose row holds
    ``prefix`` columns before them and ``row_pad`` after; A, D, dt_bias slices of parameter
    buffers; initial_states (b, h, p, n) a slice of a wider state; seq_idx an int32 slice of a
    longer row of ids (two packed sequences). ``requires_grad``: the projection's. With the
    defaults every view starts and steps 16-byte aligned (float32 or 16-bit)."""
    g = torch.Generator().manual_seed(seed)
    f = lambda *s: torch.randn(*s, generator=g).to(device)
    d_inner, gn = nheads * headdim, ngroups * dstate
    widths = [prefix, d_inner, d_inner, gn, gn, nheads, row_pad]
    proj = f(batch, seqlen, sum(widths)).to(dtype).requires_grad_(requires_grad)
    _, zv, xv, Bv, Cv, dtv, _ = torch.split(proj, widths, dim=-1)
    kw = dict(x=xv.unflatten(-1, (nheads, headdim)), dt=dtv,
              A=-(torch.rand(nheads + 3, generator=g) * 2 + 0.1).to(device)[3:],
              B=Bv.unflatten(-1, (ngroups, dstate)), C=Cv.unflatten(-1, (ngroups, dstate)))
    if D == "1d":
        kw["D"] = f(2 * nheads)[nheads:]
    elif D == "2d":
        kw["D"] = f(nheads, headdim + 8)[:, 8:]
    if z:
        kw["z"] = zv.unflatten(-1, (nheads, headdim))
    if dt_bias:
        kw["dt_bias"] = (f(nheads + 1) * 0.5)[1:]
    if initial_states:
        kw["initial_states"] = f(batch, nheads, headdim, dstate + 8)[..., 4:4 + dstate]
    if seq_idx:
        ids = (torch.arange(seqlen + 8, device=device) >= 8 + seqlen // 3).to(torch.int32)
        kw["seq_idx"] = ids.expand(batch, -1).clone()[:, 8:]
    views = ("x", "dt", "B", "C", "z", "initial_states", "seq_idx") + (("D",) if D == "2d" else ())
    assert all(not kw[k].is_contiguous() for k in views if k in kw)     # no accidental copies
    return kw


def fresh_copies(kw):
    """The same values in new contiguous tensors of their own."""
    return {k: (torch.empty(v.shape, dtype=v.dtype, device=v.device).copy_(v)
                if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


@pytest.fixture
def launched(monkeypatch):
    """Every kernel launch of the test: a list of (kernel name, {parameter: argument}). Taken
    where the kernels start, the interpreter's and cuTile's ``launch``, so that launches made
    by any path (a plan, a replay of an earlier call) are seen."""
    import cuda.tile as ct
    from ops import interpreter
    seen = []

    def record(kernel, args):
        fn = kernel_function(kernel)
        seen.append((fn.__name__, dict(zip(inspect.signature(fn).parameters, args))))

    def spy(real, on_gpu):
        if on_gpu:
            return lambda stream, grid, kernel, args: (record(kernel, args),
                                                       real(stream, grid, kernel, args))[1]
        return lambda grid, kernel, args: (record(kernel, args), real(grid, kernel, args))[1]

    monkeypatch.setattr(interpreter, "launch", spy(interpreter.launch, False))
    monkeypatch.setattr(ct, "launch", spy(ct.launch, True))
    return seen


def same_memory(arg, view):
    """``arg`` is ``view`` itself as a kernel indexes it: same first element, shape, and stride
    in every dimension that is stepped (size-1 strides are canonicalised)."""
    return (arg.data_ptr() == view.data_ptr() and arg.shape == view.shape
            and arg.dtype == view.dtype
            and all(a == v for n, a, v in zip(view.shape, arg.stride(), view.stride()) if n > 1))


def check_reads(seen, kw, in_place, copied=()):
    """Each kernel that reads an input got the input's own memory (``in_place``) or a contiguous
    copy of it (``copied``); every input named is read by some launch."""
    names = {name for name, _ in seen}
    assert {"chunk_cumsum_kernel", "fwd_pass_state_kernel", "compute_out_kernel"} <= names
    checked = set()
    for name, params in seen:
        for k in READS[name]:
            if k in in_place:
                assert same_memory(params[k], kw[k]), (name, k)
            elif k in copied:
                arg = params[k]
                assert arg.is_contiguous() and arg.data_ptr() != kw[k].data_ptr(), (name, k)
                assert torch.equal(arg, kw[k].to(arg.dtype)), (name, k)
            else:
                continue
            checked.add(k)
    assert checked == set(in_place) | set(copied)


def given(kw):
    return tuple(k for k in INPUTS if kw.get(k) is not None)


# The interpreter ----------------------------------------------------------------------------------

FEATURES = [
    pytest.param(dict(), {}, id="bare"),
    pytest.param(dict(D="1d", z=True, dt_bias=True), dict(dt_softplus=True),
                 id="D-z-dt_bias-softplus"),
    pytest.param(dict(D="2d", initial_states=True), dict(dt_limit=(0.0, 1.5)), id="D2d-initial"),
    pytest.param(dict(D="2d", z=True, dt_bias=True, initial_states=True, seq_idx=True),
                 dict(dt_softplus=True, dt_limit=(0.01, 2.0)), id="all-seq_idx"),
]


@pytest.mark.parametrize("features, options", FEATURES)
def test_views_are_read_in_place(launched, features, options):
    kw = layer_inputs(**SMALL, **features)
    assert not kw["x"].is_contiguous() and kw["x"].stride(1) == kw["dt"].stride(1)
    call = lambda args: mamba_chunk_scan_combined(**args, chunk_size=32, **options,
                                                  return_final_states=True, backend="interpret")
    out, final = call(kw)
    check_reads(launched, kw, in_place=given(kw))
    ref, ref_final = call(fresh_copies(kw))
    assert torch.isfinite(out).all() and torch.equal(out, ref) and torch.equal(final, ref_final)


def test_a_batch_one_slice_with_packed_sequences(launched):
    """Row 1 of a batch-3 projection (stride(0) never stepped, canonicalised without a copy),
    several sequences packed along it (cu_seqlens, varlen states read from the views too)."""
    kw = layer_inputs(**{**SMALL, "batch": 3}, D="1d", z=True, dt_bias=True, initial_states=True)
    kw = {k: (v[1:2] if k in ("x", "dt", "B", "C", "z", "initial_states") else v)
          for k, v in kw.items()}
    cu = torch.tensor([0, 23, 64, 65, 80])
    got = mamba_chunk_scan_combined(**kw, chunk_size=32, cu_seqlens=cu, dt_softplus=True,
                                    return_final_states=True, return_varlen_states=True,
                                    backend="interpret")
    check_reads(launched, kw, in_place=given(kw))
    x_arg = dict(launched)["compute_out_kernel"]["x"]
    assert x_arg.stride(0) <= element_reach(x_arg) and x_arg.stride(0) != kw["x"].stride(0)
    want = mamba_chunk_scan_combined(**fresh_copies(kw), chunk_size=32, cu_seqlens=cu,
                                     dt_softplus=True, return_final_states=True,
                                     return_varlen_states=True, backend="interpret")
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def strided_last_dims(kw):
    """The same values in layouts the kernels do not read in place: a strided last dimension
    (every other column, a transposed array), a broadcast (stride-0) batch dimension."""
    b, L, h, p = kw["x"].shape
    every_other = lambda t: torch.stack([t, t + 1], dim=-1).flatten(-2)[..., ::2]
    transposed = lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)
    out = dict(kw)
    out["x"] = every_other(kw["x"])
    out["z"] = transposed(kw["z"])
    out["dt"] = kw["dt"].transpose(1, 2).contiguous().transpose(1, 2)   # heads L apart
    out["A"] = every_other(kw["A"])
    out["D"] = transposed(kw["D"])
    out["initial_states"] = transposed(kw["initial_states"])
    out["B"] = kw["B"][:1].expand(b, -1, -1, -1)                       # one batch row, broadcast
    out["C"] = transposed(kw["C"])
    out["seq_idx"] = kw["seq_idx"].long()                               # ids become int32
    return out


def test_what_cannot_be_read_in_place_is_copied(launched):
    kw = strided_last_dims(layer_inputs(**SMALL, D="2d", z=True, dt_bias=True,
                                        initial_states=True, seq_idx=True))
    assert kw["x"].stride(-1) == 2 and kw["B"].stride(0) == 0
    out, final = mamba_chunk_scan_combined(**kw, chunk_size=32, dt_softplus=True,
                                           return_final_states=True, backend="interpret")
    copied = ("x", "z", "dt", "A", "D", "initial_states", "B", "C", "seq_idx")
    check_reads(launched, kw, in_place=("dt_bias",), copied=copied)
    ref, ref_final = mamba_chunk_scan_combined(**fresh_copies(kw), chunk_size=32,
                                               dt_softplus=True, return_final_states=True,
                                               backend="interpret")
    assert torch.equal(out, ref) and torch.equal(final, ref_final)


UNALIGNED = [pytest.param(1, 3, id="base-4-bytes-off"),      # rows of 200 floats, bases 4 bytes off
             pytest.param(0, 1, id="row-788-bytes")]         # every token stride 788 bytes


@pytest.mark.parametrize("prefix, row_pad", UNALIGNED)
def test_unaligned_views_are_copied(launched, prefix, row_pad):
    """A projection whose columns do not start, or whose rows do not step, on 16-byte bounds:
    its slices are copied (contiguous copies compile to the fast loads; the views would not),
    the aligned parameter slices are still read in place."""
    kw = layer_inputs(**SMALL, prefix=prefix, row_pad=row_pad, D="2d", z=True, dt_bias=True,
                      initial_states=True, seq_idx=True)
    out, final = mamba_chunk_scan_combined(**kw, chunk_size=32, dt_softplus=True,
                                           return_final_states=True, backend="interpret")
    check_reads(launched, kw, in_place=("A", "D", "dt_bias", "initial_states", "seq_idx"),
                copied=("x", "z", "B", "C", "dt"))
    ref, ref_final = mamba_chunk_scan_combined(**fresh_copies(kw), chunk_size=32,
                                               dt_softplus=True, return_final_states=True,
                                               backend="interpret")
    assert torch.equal(out, ref) and torch.equal(final, ref_final)


def test_which_layouts_are_read_in_place():
    t = torch.randn(2, 5, 3, 8)                   # float32: 16 bytes are 4 elements
    kept = (t[:, 1:4], t[..., 4:8], t.permute(0, 2, 1, 3), t[:, ::2], t[:, :, 1], t[1:, 2:3])
    for view in kept:
        got = as_kernel_input(view)
        assert got.data_ptr() == view.data_ptr() and same_memory(got, view), view.stride()
    copied = (t[..., 1:5],                                  # base 4 bytes off
              torch.randn(6, 7)[:, :4],                     # rows 28 bytes apart
              t[..., ::2], t.transpose(-1, -2),             # last dimension strided
              torch.randn(1, 8).expand(4, 8),               # broadcast: stride 0
              torch.arange(64.0).as_strided((8, 8), (4, 1)))   # overlapping rows
    for view in copied:
        got = as_kernel_input(view)
        assert got.is_contiguous() and got.data_ptr() != view.data_ptr(), view.stride()
        assert torch.equal(got, view)
    # Contiguous tensors are read where they are, whatever their alignment (as they always were).
    unaligned = torch.randn(65)[1:].view(4, 16)
    assert as_kernel_input(unaligned).data_ptr() == unaligned.data_ptr()


def test_contiguous_inputs_keep_the_strides_they_had():
    """Contiguous tensors get the strides the kernels always had (the contiguous ones, also in
    size-1 dimensions), so their compiled code is unchanged; size-1 dimensions of views get at
    most the view's reach, so a view that 32-bit indices reach stays within them."""
    for shape in ((1, 80, 4, 16), (2, 1, 4, 16), (2, 80, 1, 1), (1,), (3, 1)):
        t = torch.randn(shape)
        odd = t.as_strided(shape, tuple(2**33 if n == 1 else s for n, s in zip(shape, t.stride())))
        for u in (t, odd):
            assert as_kernel_input(u).stride() == torch.empty(shape).stride()
            assert as_kernel_input(u).data_ptr() == t.data_ptr()
    # x of a batch-1 slice of a 1.7M-token projection, rows 1288 wide: the view reaches just
    # below 2**31 elements, its parent's row length times seqlen does not.
    L, row = 1667301, 1288
    view = torch.empty(0, device="meta").as_strided((1, L, 8, 64), (2**33, row, 64, 1))
    assert element_reach(view) < INT32_LIMIT <= L * row
    assert as_kernel_input(view).stride() == (element_reach(view), row, 64, 1)


def test_gradients_sliced_from_a_larger_one_reach_the_kernels_with_small_strides(launched):
    """A call made in pieces (``ops.ssd_combined``) gets, in its backward, a batch-1 slice of the
    whole output's gradient, whose stride(0) is that gradient's (past 2**32 at 1M tokens of 80
    heads of 64): never stepped, but a launch refuses a stride past 32 bits. Every tensor a
    backward launch receives has its strides within 2**31, and the gradients are those of the
    same call on fresh tensors, bitwise (the two calls differ only in strides never stepped)."""
    kw = layer_inputs(batch=1, seqlen=80, nheads=4, headdim=16, ngroups=2, dstate=16, D="1d",
                      dt_bias=True, initial_states=True)
    leaves = {k: fresh_copies(kw)[k].requires_grad_() for k in ("x", "dt", "B", "C", "D",
                                                               "dt_bias", "initial_states")}
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(kw["x"].shape, generator=g)
    dfinal = torch.randn(kw["initial_states"].shape, generator=g)
    odd = lambda t: t.as_strided(t.shape, (2**33,) + t.stride()[1:])       # batch 1: not stepped
    grads = []
    for make in (lambda t: t, odd):
        out, final = mamba_chunk_scan_combined(**{**kw, **leaves}, chunk_size=32,
                                               dt_softplus=True, return_final_states=True,
                                               backend="interpret")
        launched.clear()
        torch.autograd.backward((out, final), (make(dout.clone()), make(dfinal.clone())))
        grads.append({k: v.grad for k, v in leaves.items()})
        for v in leaves.values():
            v.grad = None
    assert launched, "the backward launched no kernel"
    for name, args in launched:
        for param, arg in args.items():
            if isinstance(arg, torch.Tensor):
                assert max(arg.stride(), default=0) < INT32_LIMIT, (name, param, arg.stride())
    for k in leaves:
        assert torch.equal(grads[0][k], grads[1][k]), k


def test_kernel_variants_read_views_in_place(launched):
    """Configs whose loads differ (heads per block, transposed products, C B^T from memory,
    persistent blocks, two chunks per iteration, 64-bit indices) on views and on copies."""
    kw = layer_inputs(**SMALL, D="2d", z=True, dt_bias=True, initial_states=True, seq_idx=True)
    for configs in VARIANTS:
        launched.clear()
        got = run_kernels(kw, configs)
        check_reads(launched, kw, in_place=given(kw))
        want = run_kernels(fresh_copies(kw), configs)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), configs


VARIANTS = [
    {"compute_out": {"HEADS_PER_BLOCK": 2}, "fwd_pass_state": {"SWAP": True}},
    {"compute_out": {"SWAP": True, "SCORES_IN_MEMORY": True},
     "fwd_pass_state": {"CHUNKS_PER_ITER": 2}},
    {"compute_out": {"PERSISTENT": True, "HEADS_PER_BLOCK": 2, "SWAP": True},
     "chunk_cumsum": {"BLOCK_H": 2}},
    {name: {"INDEX64": True} for name in ("chunk_cumsum", "fwd_pass_state", "compute_out")},
]


def run_kernels(kw, configs, chunk_size=32, prepare=as_kernel_input):
    """The three kernels on ``kw`` (each input through ``prepare``: by default as
    ``ops.torch_op.forward`` prepares them), with ``configs``."""
    k = {name: None if kw.get(name) is None else prepare(kw[name]) for name in INPUTS}
    return kernel_forward(k["x"], k["dt"], k["A"], k["B"], k["C"], chunk_size, D=k["D"], z=k["z"],
                          dt_bias=k["dt_bias"], initial_states=k["initial_states"],
                          seq_idx=k["seq_idx"], dt_softplus=True, configs=configs)


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_views_under_torch_compile(backend):
    """Traced with fullgraph: through the operator (kernels, no gradient), and differentiated
    through the reference, whose forward torch.compile traces, ``as_kernel_input`` included."""
    torch._dynamo.reset()
    dtype = torch.float32 if backend == "interpret" else torch.float64
    kw = layer_inputs(**SMALL, dtype=dtype, D="2d", z=True, dt_bias=True, initial_states=True,
                      requires_grad=backend == "reference")
    fn = lambda kw: mamba_chunk_scan_combined(**kw, chunk_size=32, dt_softplus=True,
                                              backend=backend)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    if backend == "interpret":
        with torch.no_grad():
            assert torch.equal(compiled(kw), fn(kw))
        return
    grads = [torch.autograd.grad(f(kw).square().sum(), (kw["x"], kw["B"])) for f in (compiled, fn)]
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all() and got.abs().sum() > 0
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_the_mixer_reads_dt_from_its_projection(launched):
    """ops.mixer's dt is a column slice of in_proj's output: read there. (Its x, B, C come out
    of the convolution channel-major, tokens contiguous: those are copied.)"""
    from ops.mixer import Mamba2Mixer
    g = torch.Generator().manual_seed(0)
    m = Mamba2Mixer(d_model=32, d_state=16, headdim=16, ngroups=2, chunk_size=32,
                    backend="interpret", generator=g)
    u = torch.randn(2, 70, 32, generator=g)
    with torch.no_grad():
        y = m(u)
    d_in_proj = m.in_proj.out_features
    dt = dict(launched)["chunk_cumsum_kernel"]["dt"]
    assert dt.stride(1) == d_in_proj and dt.stride(2) == 1          # the projection's own rows
    for name, params in launched:
        for k in READS[name]:
            assert params[k].stride(-1) == 1 or params[k].shape[-1] == 1, (name, k)
    assert torch.isfinite(y).all()


# On a GPU -----------------------------------------------------------------------------------------

GPU_SIZE = dict(batch=2, seqlen=1024, nheads=8, headdim=64, ngroups=2, dstate=128)
# Projection rows of (prefix, z x B C dt = 1544 columns, pad) bf16 elements.
ALIGNED = pytest.param(0, 0, id="aligned")                   # 3088-byte rows, every base aligned
UNALIGNED_GPU = [pytest.param(3, 5, id="unaligned-base"),    # 3104-byte rows, bases 6 bytes off
                 pytest.param(0, 1, id="odd-row")]           # 3090-byte rows


def gpu_inputs(prefix, row_pad, seed, D="1d"):
    kw = layer_inputs(**GPU_SIZE, dtype=torch.bfloat16, device="cuda", seed=seed, prefix=prefix,
                      row_pad=row_pad, D=D, z=True, dt_bias=True, initial_states=True,
                      seq_idx=True)
    assert (kw["x"].stride(1) * 2 % 16 == 0) == (row_pad != 1)
    assert (kw["x"].data_ptr() % 16 == 0) == (prefix == 0)
    return kw


@pytest.mark.gpu
@pytest.mark.parametrize("prefix, row_pad", [ALIGNED] + UNALIGNED_GPU)
def test_views_on_gpu(launched, prefix, row_pad):
    """Aligned views read in place, unaligned ones copied; the results of contiguous copies."""
    kw = gpu_inputs(prefix, row_pad, seed=3)
    call = lambda args: mamba_chunk_scan_combined(**args, chunk_size=256, dt_softplus=True,
                                                  return_final_states=True, backend="cutile")
    with torch.no_grad():
        out, final = call(kw)
        if prefix == row_pad == 0:
            check_reads(launched, kw, in_place=given(kw))
        else:
            check_reads(launched, kw, in_place=("A", "D", "dt_bias", "initial_states", "seq_idx"),
                        copied=("x", "z", "B", "C", "dt"))
        ref, ref_final = call(fresh_copies(kw))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.equal(out, ref) and torch.equal(final, ref_final)


@pytest.mark.gpu
@pytest.mark.parametrize("prefix, row_pad", UNALIGNED_GPU)
def test_unaligned_views_read_in_place_compute_the_same_on_gpu(launched, prefix, row_pad):
    """The kernels given unaligned views directly (the slower loads ``as_kernel_input`` avoids
    by copying) compute what they compute on contiguous copies: correct either way."""
    kw = gpu_inputs(prefix, row_pad, seed=5, D="2d")
    with torch.no_grad():
        got = run_kernels(kw, {}, chunk_size=256, prepare=lambda t: t)
        check_reads(launched, kw, in_place=given(kw))
        want = run_kernels(fresh_copies(kw), {}, chunk_size=256)
    torch.cuda.synchronize()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_kernel_variants_read_views_in_place_on_gpu(launched):
    kw = gpu_inputs(0, 0, seed=4, D="2d")
    for configs in VARIANTS:
        launched.clear()
        with torch.no_grad():
            got = run_kernels(kw, configs, chunk_size=256)
            check_reads(launched, kw, in_place=given(kw))
            want = run_kernels(fresh_copies(kw), configs, chunk_size=256)
        torch.cuda.synchronize()
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), configs
