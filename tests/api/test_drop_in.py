"""The entry point as a model uses it: torch.compile, autograd, views, mamba_ssm's whole
signature (cu_seqlens, return_varlen_states, state_dtype) and its return convention.

Everything here runs on the CPU (backends "interpret" and "reference"); the GPU versions carry the
``gpu`` marker. Expected values come from ``reference.sequential.ssd_sequential`` in float64, run
sequence by sequence for packed inputs: never from the code under test. Tolerances are those of
tests/api/test_api.py (float32 kernels: 2e-5 relative in norm; reference float64: 1e-10).
"""
import pytest
import torch

from ops import mamba_chunk_scan_combined
from ops.runtime.launch import INT32_LIMIT, element_reach
from ops.torch_op import as_kernel_input
from reference.problems import make_problem
from reference.sequential import ssd_sequential
from reference.validate import rel_err
from tests.kernels.helpers import DEVICES

OPTIONS = dict(dt_softplus=True, dt_limit=(0.0, 1.5))
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
CPU_BACKENDS = [pytest.param("interpret", torch.float32, id="interpret"),
                pytest.param("reference", torch.float64, id="reference")]
ARGS = ("x", "dt", "A", "B", "C")


def f64(kw):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in kw.items()}


def problem(dtype, **kw):
    return make_problem(**{**dict(batch=1, seqlen=100, nheads=4, headdim=16, ngroups=2, dstate=16,
                                  D="2d"), **kw}, dtype=dtype, seed=7)


# torch.compile -----------------------------------------------------------------------------------

class TinyMixer(torch.nn.Module):
    """A projection in, the scan, a projection out: the scan between traced torch ops."""

    def __init__(self, width, dtype, backend):
        super().__init__()
        self.inp = torch.nn.Linear(width, width, dtype=dtype)
        self.out = torch.nn.Linear(width, width, dtype=dtype)
        self.backend = backend

    def forward(self, x, dt, A, B, C, D, seq_idx):
        b, L, h, p = x.shape
        x = self.inp(x.reshape(b, L, h * p)).reshape(b, L, h, p)
        y, final = mamba_chunk_scan_combined(x, dt, A, B, C, 32, D=D, seq_idx=seq_idx,
                                             dt_softplus=True, return_final_states=True,
                                             backend=self.backend)
        return self.out(y.reshape(b, L, h * p)), final


@pytest.mark.parametrize("backend, dtype", CPU_BACKENDS)
def test_compiles_with_no_graph_break(backend, dtype):
    torch._dynamo.reset()
    kw = problem(dtype, seq_boundaries=[40])
    model = TinyMixer(4 * 16, dtype, backend)
    args = [kw[k] for k in ARGS] + [kw["D"], kw["seq_idx"]]
    with torch.no_grad():
        eager = model(*args)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(*args)
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(e, c)


def test_the_operator_has_a_fake_for_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode
    kw = problem(torch.float32)
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) for k, v in kw.items()}
        out, final, varlen = torch.ops.mamba2_cutile.ssd_forward(
            *[fake[k] for k in ARGS], None, None, None, None, None, None, chunk_size=32,
            dt_softplus=True, dt_min=0.0, dt_max=float("inf"), with_varlen=False,
            state_dtype=None, backend="interpret")
    assert out.shape == kw["x"].shape and out.dtype == torch.float32
    assert final.shape == (1, 4, 16, 16) and varlen.shape == (0, 4, 16, 16)


# Autograd ----------------------------------------------------------------------------------------

LEAVES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def _grads(fn, kw, dtype):
    """Gradients of a fixed random weighting of (out, final_states) for every float input."""
    weights = torch.randn(kw["x"].shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(3))
    inputs = {k: (v.detach().to(dtype).clone().requires_grad_(k in LEAVES)
                  if v.is_floating_point() else v) for k, v in kw.items()}
    out, final = fn(inputs)
    ((out * weights.to(out.dtype)).sum() + final.square().sum()).backward()
    return {k: inputs[k].grad for k in LEAVES}


def test_kernel_backends_give_the_recurrences_gradients():
    """The kernels' forward, differentiated through the custom operator's registered backward
    (the backward kernels, ops/backward.py): every input's gradient against autograd through the
    float64 recurrence (2e-5, float32's tolerance of the forward)."""
    kw = problem(torch.float32, seq_boundaries=[40])
    ours = _grads(lambda i: mamba_chunk_scan_combined(**i, chunk_size=32, **OPTIONS,
                                                      return_final_states=True,
                                                      backend="interpret"), kw, torch.float32)
    expected = _grads(lambda i: ssd_sequential(**i, **OPTIONS, return_final_states=True), kw,
                      torch.float64)
    for name in LEAVES:
        assert ours[name].dtype == torch.float32 and rel_err(ours[name], expected[name]) < 2e-5, name
    with torch.no_grad():                              # inference: no graph kept
        out = mamba_chunk_scan_combined(**kw, chunk_size=32, backend="interpret")
    assert out.grad_fn is None


def test_a_compiled_training_step_equals_eager():
    torch._dynamo.reset()
    kw = problem(torch.float32, seq_boundaries=[40])

    def step(inputs):
        out = mamba_chunk_scan_combined(**inputs, chunk_size=32, **OPTIONS, backend="interpret")
        return out.square().sum()

    def grads(fn):
        inputs = {k: (v.detach().clone().requires_grad_(k in ("x", "dt", "B", "C"))
                      if v.is_floating_point() else v) for k, v in kw.items()}
        fn(inputs).backward()
        return [inputs[k].grad for k in ("x", "dt", "B", "C")]

    for e, c in zip(grads(step), grads(torch.compile(step, backend="aot_eager", fullgraph=True)),
                    strict=True):
        assert torch.equal(e, c)


def test_no_gradient_through_varlen_states():
    """Refused when the call is made, eagerly and compiled (a backward could only drop it)."""
    kw = problem(torch.float32)
    kw["x"] = kw["x"].clone().requires_grad_(True)
    call = lambda x: mamba_chunk_scan_combined(**{**kw, "x": x}, chunk_size=32,
                                               cu_seqlens=torch.tensor(BOUNDS),
                                               return_varlen_states=True, backend="interpret")
    with pytest.raises(NotImplementedError, match="return_varlen_states"):
        call(kw["x"])
    torch._dynamo.reset()
    with pytest.raises(Exception, match="return_varlen_states"):
        torch.compile(call, backend="aot_eager", fullgraph=True)(kw["x"])
    with torch.no_grad():                              # without a gradient: fine
        assert call(kw["x"])[1].shape == (4, 4, 16, 16)


def test_gradients_come_back_in_each_inputs_dtype():
    """bf16 inputs through the operator: each gradient in its input's dtype, finite; inputs that
    do not require a gradient get none."""
    kw = problem(torch.bfloat16, seq_boundaries=[40])
    wants = ("x", "B", "dt_bias")
    inputs = {k: (v.clone().requires_grad_(k in wants) if v.is_floating_point() else v)
              for k, v in kw.items()}
    out = mamba_chunk_scan_combined(**inputs, chunk_size=32, **OPTIONS, backend="interpret")
    out.float().square().sum().backward()
    for k, v in inputs.items():
        if k in wants:
            assert v.grad.dtype == v.dtype and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0, k
        elif v.is_floating_point():
            assert v.grad is None, k


def test_reference_backend_gives_the_recurrences_gradients():
    kw = problem(torch.float64, seqlen=40, seq_boundaries=[17])
    ours = _grads(lambda i: mamba_chunk_scan_combined(**i, chunk_size=16, **OPTIONS,
                                                      return_final_states=True),   # auto: reference
                  kw, torch.float64)
    expected = _grads(lambda i: ssd_sequential(**i, **OPTIONS, return_final_states=True), kw,
                      torch.float64)
    for name in LEAVES:
        assert ours[name] is not None and rel_err(ours[name], expected[name]) < 1e-9, name


# Views -------------------------------------------------------------------------------------------

def test_size_one_dimensions_with_huge_strides_are_normalised():
    kw = problem(torch.float32)
    ref = mamba_chunk_scan_combined(**kw, chunk_size=32, backend="interpret")
    # A batch-1 slice of a longer sequence keeps its parent's stride(0): here 2**33, as in a
    # slice of a 1M-token, 80-head tensor (never stepped, so the storage can stay small).
    odd = dict(kw)
    for k in ("x", "B", "C", "z", "dt"):
        t = kw[k]
        odd[k] = t.as_strided(t.shape, (2**33,) + t.stride()[1:])
        assert odd[k].is_contiguous() and element_reach(odd[k]) == t.numel()
    assert as_kernel_input(odd["x"]).stride() == kw["x"].stride()
    assert torch.equal(mamba_chunk_scan_combined(**odd, chunk_size=32, backend="interpret"), ref)


def test_index_width_follows_the_reach_of_strided_views():
    from ops.kernels.chunk_cumsum import chunk_cumsum_kernel
    from ops.runtime.launch import fit_index_width
    wide = torch.empty(4, device="meta").as_strided((2, 2), (2**31, 1))   # rows 2**31 apart
    assert wide.numel() == 4 and element_reach(wide) == 2**31 + 2 > INT32_LIMIT
    assert element_reach(torch.empty(3, 5)) == 15 and element_reach(torch.empty(0, 5)) == 0
    assert fit_index_width(chunk_cumsum_kernel, (wide,)) is chunk_cumsum_kernel        # 64-bit
    assert fit_index_width(chunk_cumsum_kernel, (torch.empty(2, 2),)) is not chunk_cumsum_kernel


@pytest.mark.parametrize("backend, dtype", CPU_BACKENDS)
def test_slices_of_a_larger_tensor(backend, dtype):
    """x, B, C as column slices of one projection (as a Mamba-2 layer splits its in_proj)."""
    kw = problem(dtype)
    x, B, C = kw["x"], kw["B"], kw["C"]
    b, L = x.shape[:2]
    packed = torch.cat([x.reshape(b, L, -1), B.reshape(b, L, -1), C.reshape(b, L, -1)], dim=-1)
    px = packed[..., :x[0, 0].numel()].unflatten(-1, x.shape[2:])
    pB = packed[..., x[0, 0].numel():x[0, 0].numel() + B[0, 0].numel()].unflatten(-1, B.shape[2:])
    pC = packed[..., -C[0, 0].numel():].unflatten(-1, C.shape[2:])
    assert not px.is_contiguous()
    ref = mamba_chunk_scan_combined(**kw, chunk_size=32, backend=backend)
    out = mamba_chunk_scan_combined(**{**kw, "x": px, "B": pB, "C": pC}, chunk_size=32,
                                    backend=backend)
    assert torch.equal(out, ref)


# mamba_ssm's signature ---------------------------------------------------------------------------

SIGNATURE = ("x", "dt", "A", "B", "C", "chunk_size", "D", "z", "dt_bias", "initial_states",
             "seq_idx", "cu_seqlens", "dt_softplus", "dt_limit", "return_final_states",
             "return_varlen_states", "state_dtype", "backend")


def test_positional_order_is_mamba_ssms():
    import inspect
    assert tuple(inspect.signature(mamba_chunk_scan_combined).parameters) == SIGNATURE
    kw = problem(torch.float32)
    positional = [kw[k] for k in ARGS] + [32, kw["D"], kw["z"], kw["dt_bias"], kw["initial_states"],
                                          None, None, True, (0.0, 1.5), True]
    by_name = mamba_chunk_scan_combined(**kw, chunk_size=32, **OPTIONS, return_final_states=True)
    for a, b in zip(mamba_chunk_scan_combined(*positional), by_name, strict=True):
        assert torch.equal(a, b)


BOUNDS = [0, 23, 64, 65, 100]        # inside a chunk, exactly at one, a 1-token sequence, the end


def per_sequence_reference(kw, bounds):
    """Each packed sequence run alone through the float64 recurrence (the initial state belongs
    to the first): the outputs, concatenated, and each sequence's final state."""
    outs, finals = [], []
    for k, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = {n: (v[:, s:e] if v.dim() > 1 and v.shape[1] == kw["x"].shape[1] and n != "D" else v)
                for n, v in f64(kw).items() if n != "seq_idx"}
        if k > 0:
            part.pop("initial_states", None)
        y, final = ssd_sequential(**part, **OPTIONS, return_final_states=True)
        outs.append(y)
        finals.append(final[0])
    return torch.cat(outs, dim=1), torch.stack(finals)


@pytest.mark.parametrize("backend, dtype", CPU_BACKENDS)
@pytest.mark.parametrize("with_seq_idx", [True, False], ids=["seq_idx", "cu_seqlens-only"])
def test_varlen_states_are_each_sequences_final_state(backend, dtype, with_seq_idx):
    kw = problem(dtype)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    if with_seq_idx:
        kw["seq_idx"] = torch.repeat_interleave(torch.arange(4), torch.tensor(BOUNDS).diff())[None]
    out, final, varlen = mamba_chunk_scan_combined(**kw, chunk_size=32, cu_seqlens=cu, **OPTIONS,
                                                   return_final_states=True,
                                                   return_varlen_states=True, backend=backend)
    ref_out, ref_varlen = per_sequence_reference(kw, BOUNDS)
    assert varlen.shape == (4, 4, 16, 16)
    assert varlen.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rel_err(out, ref_out) < TOL[dtype]
    assert rel_err(varlen, ref_varlen) < TOL[dtype]
    assert rel_err(final[0], ref_varlen[-1]) < TOL[dtype]      # the last sequence's is the final


def test_return_convention():
    kw = problem(torch.float32)
    cu = torch.tensor(BOUNDS)
    run = lambda **o: mamba_chunk_scan_combined(**kw, chunk_size=32, cu_seqlens=cu, **o)
    out = run()
    assert isinstance(out, torch.Tensor)
    assert [t.shape[0] for t in run(return_final_states=True)] == [1, 1]
    assert [t.shape[0] for t in run(return_varlen_states=True)] == [1, 4]
    assert [t.shape[0] for t in run(return_final_states=True, return_varlen_states=True)] == [1, 1, 4]


def test_state_dtype_is_the_stored_entry_states_dtype():
    """compute_out rounds the entry states to x's dtype for its product, so the outputs do not
    depend on state_dtype; the varlen states read the stored entry states as they are, so with
    bf16 inputs float32 storage brings them closer to the float64 recurrence."""
    kw = problem(torch.bfloat16)
    cu = torch.tensor(BOUNDS)
    ref_out, ref_varlen = per_sequence_reference(kw, BOUNDS)
    results = {}
    for state_dtype in (None, torch.bfloat16, torch.float16, torch.float32):
        out, varlen = mamba_chunk_scan_combined(**kw, chunk_size=32, **OPTIONS, cu_seqlens=cu,
                                                return_varlen_states=True,
                                                state_dtype=state_dtype, backend="interpret")
        assert rel_err(out, ref_out) < 1e-2 and rel_err(varlen, ref_varlen) < 1e-2
        results[state_dtype] = out, rel_err(varlen, ref_varlen)
    assert torch.equal(results[None][0], results[torch.float32][0])
    assert results[torch.float32][1] < results[torch.bfloat16][1] == results[None][1]


def _packed(**changes):
    kw = problem(torch.float32)
    kw.update(chunk_size=32, cu_seqlens=torch.tensor(BOUNDS))
    kw.update(changes)
    return kw


BAD = [
    pytest.param(dict(cu_seqlens=torch.tensor([0.0, 100.0])), TypeError, "cu_seqlens must be an integer tensor", id="float"),
    pytest.param(dict(cu_seqlens=torch.tensor([[0, 100]])), ValueError, "cu_seqlens must be 1-d", id="2d"),
    pytest.param(dict(cu_seqlens=torch.tensor([0])), ValueError, "cu_seqlens must be 1-d with nseq", id="one-entry"),
    pytest.param(dict(cu_seqlens=torch.tensor([1, 50, 100])), ValueError, "cu_seqlens must start at 0", id="start"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 50, 99])), ValueError, r"end at seqlen \(100\)", id="end"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 60, 50, 100])), ValueError, "cu_seqlens must be increasing", id="decreasing"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 50, 50, 100])), ValueError, "at least one token", id="empty-sequence"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 50, 100]),
                      seq_idx=torch.tensor([[0] * 40 + [1] * 60])), ValueError, "seq_idx and cu_seqlens disagree", id="vs-seq_idx"),
    pytest.param(dict(cu_seqlens=None, return_varlen_states=True), ValueError, "return_varlen_states=True needs cu_seqlens", id="varlen-without"),
    pytest.param(dict(state_dtype=torch.int8), TypeError, "state_dtype must be None or one of", id="state_dtype"),
    pytest.param(dict(state_dtype="bf16"), TypeError, "state_dtype must be None or one of", id="state_dtype-str"),
]


@pytest.mark.parametrize("changes, exc, message", BAD)
@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_bad_packing_raises_naming_the_argument(changes, exc, message, backend):
    with pytest.raises(exc, match=message):
        mamba_chunk_scan_combined(**_packed(**changes), backend=backend)


def test_cu_seqlens_needs_batch_one():
    kw = make_problem(dtype=torch.float32, batch=2, seqlen=40)
    with pytest.raises(ValueError, match="x must have batch 1; got batch 2"):
        mamba_chunk_scan_combined(**kw, chunk_size=16, cu_seqlens=torch.tensor([0, 40]))


# On a GPU ----------------------------------------------------------------------------------------

def gpu_problem(dtype=torch.bfloat16, **kw):
    return {k: v.cuda() for k, v in problem(dtype, **kw).items()}


@pytest.mark.gpu
def test_compiles_with_inductor_on_gpu():
    torch._dynamo.reset()
    kw = gpu_problem(seq_boundaries=[40])
    model = TinyMixer(4 * 16, torch.bfloat16, "cutile").cuda()
    args = [kw[k] for k in ARGS] + [kw["D"], kw["seq_idx"]]
    with torch.no_grad():
        eager = model(*args)
        compiled = torch.compile(model, backend="inductor", fullgraph=True)(*args)
    torch.cuda.synchronize()
    # Inductor may fuse the projections differently: the scan's inputs can differ in the last
    # bf16 bit, so compare as bf16 results of one computation (4e-3, as the parity tests).
    for e, c in zip(eager, compiled, strict=True):
        assert rel_err(c, e) < 4e-3


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    kw = gpu_problem(seq_boundaries=[40])
    call = lambda: mamba_chunk_scan_combined(**kw, chunk_size=32, **OPTIONS,
                                             return_final_states=True, backend="cutile")
    from tests.benchmark import capture_graph
    with torch.no_grad():
        eager = call()
        graph, captured = capture_graph(call)
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    for e, c in zip(eager, captured, strict=True):
        assert torch.equal(e, c)


@pytest.mark.gpu
def test_cuda_graph_replays_a_training_step():
    """Forward and backward through the operator, captured in one CUDA graph (as a model's whole
    training step is) and replayed onto NaN-filled gradients: bitwise the eager step's gradients
    (the backward has no atomics and no host synchronisation)."""
    kw = gpu_problem(seq_boundaries=[40])
    leaves = {k: (v.detach().requires_grad_() if v.is_floating_point() else v)
              for k, v in kw.items()}
    dout = torch.randn(kw["x"].shape, device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(5)).to(kw["x"].dtype)

    def step():
        for t in leaves.values():
            t.grad = None
        out = mamba_chunk_scan_combined(**leaves, chunk_size=32, **OPTIONS, backend="cutile")
        out.backward(dout)
        return [t.grad for t in leaves.values() if t.is_floating_point()]

    eager = [g.clone() for g in step()]
    from tests.benchmark import capture_graph
    graph, captured = capture_graph(step)
    for g in captured:
        g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert len(captured) == len(eager) >= 7
    for e, c in zip(eager, captured, strict=True):
        assert torch.equal(e, c)


@pytest.mark.gpu
def test_replayed_calls_on_gpu_equal_fresh_ones(monkeypatch):
    from ops.runtime import replay
    runs = _replayed_runs(monkeypatch)
    kw = gpu_problem(seq_boundaries=[40])
    kw["seq_idx"] = kw["seq_idx"].to(torch.int32)
    others = [{k: (v * scale if k in ("x", "B") else v) for k, v in kw.items()}
              for scale in (0.5, -1.0, 2.0)]
    call = lambda kw: mamba_chunk_scan_combined(**kw, chunk_size=32, **OPTIONS,
                                                return_final_states=True, backend="cutile")
    with torch.no_grad():
        call(kw), call(kw)
        # back to back, no synchronisation: each call's intermediates are the kept buffers the
        # next call overwrites (ops.runtime.replay keeps them per stream)
        replayed = [call(o) for o in others]
        assert len(runs) >= 3
        replay._REPLAYS.clear()
        monkeypatch.setattr(replay.Replay, "run", lambda self, inputs: pytest.fail("replayed"))
        fresh = []
        for o in others:
            replay._REPLAYS.clear()                # each planned and launched afresh
            fresh.append(call(o))
    torch.cuda.synchronize()
    for r, f in zip(replayed, fresh, strict=True):
        assert torch.equal(r[0], f[0]) and torch.equal(r[1], f[1])


@pytest.mark.gpu
@pytest.mark.parametrize("with_seq_idx", [True, False], ids=["seq_idx", "cu_seqlens-only"])
def test_varlen_states_on_gpu(with_seq_idx):
    kw = gpu_problem(torch.float32)
    cu = torch.tensor(BOUNDS, dtype=torch.int32, device="cuda")
    if with_seq_idx:
        kw["seq_idx"] = torch.repeat_interleave(torch.arange(4), torch.tensor(BOUNDS).diff())[None].cuda()
    out, varlen = mamba_chunk_scan_combined(**kw, chunk_size=32, cu_seqlens=cu, **OPTIONS,
                                            return_varlen_states=True, backend="cutile")
    ref_out, ref_varlen = per_sequence_reference({k: v.cpu() for k, v in kw.items()}, BOUNDS)
    assert rel_err(out.cpu(), ref_out) < TOL[torch.float32]
    assert rel_err(varlen.cpu(), ref_varlen) < TOL[torch.float32]


@pytest.mark.gpu
def test_a_slice_of_a_million_token_tensor():
    """x[:, -65536:] of a 1M-token, 80-head layer: "contiguous", with stride(0) = 5.4e9."""
    if torch.cuda.mem_get_info()[0] < 24 * 2**30:
        pytest.skip("needs 24 GiB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(5)
    big = dict(x=torch.randn(1, 2**20, 80, 64, device="cuda", dtype=torch.bfloat16, generator=g),
               dt=torch.randn(1, 2**20, 80, device="cuda", generator=g) * 0.5 - 1,
               B=torch.randn(1, 2**20, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g),
               C=torch.randn(1, 2**20, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g))
    sliced = {k: v[:, -65536:] for k, v in big.items()}
    assert sliced["x"].is_contiguous() and sliced["x"].stride(0) == 2**20 * 80 * 64
    A = -torch.rand(80, device="cuda", generator=g) - 0.1
    with torch.no_grad():
        out = mamba_chunk_scan_combined(**sliced, A=A, chunk_size=256, dt_softplus=True,
                                        backend="cutile")
        # The same values in fresh tensors of their own (canonical strides).
        fresh = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda").copy_(v)
                 for k, v in sliced.items()}
        del big, sliced
        ref = mamba_chunk_scan_combined(**fresh, A=A, chunk_size=256, dt_softplus=True,
                                        backend="cutile")
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.equal(out, ref)


# Host time: plans re-used ----------------------------------------------------------------------

def test_repeated_calls_reuse_their_plans_and_stay_exact(monkeypatch):
    from ops import forward
    forward._PLANS.clear()
    first, second = problem(torch.float32), make_problem(batch=1, seqlen=100, nheads=4, headdim=16,
                                                         ngroups=2, dstate=16, D="2d",
                                                         dtype=torch.float32, seed=8)
    run = lambda kw: mamba_chunk_scan_combined(**kw, chunk_size=32, **OPTIONS,
                                               return_final_states=True, backend="interpret")
    run(first)
    assert len(forward._PLANS) == 3                    # one per kernel
    cached = run(second)
    assert len(forward._PLANS) == 3                    # the same plans, for new tensors
    monkeypatch.setattr(forward, "POISON_OUTPUTS", True)   # planned afresh, outputs poisoned
    fresh = run(second)
    for a, b in zip(cached, fresh, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(cached[0], run(first)[0])


def test_a_plan_holding_a_computed_tensor_is_never_reused():
    from ops.runtime.launch import Plan, PlanTemplate
    from ops.runtime.launch import unread_stand_in
    x = torch.ones(4)
    out = torch.empty(4)
    stand_in, derived, derived_scalar = unread_stand_in("cpu"), x * 2, x[:1] * 2
    assert PlanTemplate(Plan((1,), None, (x, out, stand_in), (out,)), (x,)).usable
    for computed in (derived, derived_scalar):         # one element or many: computed afresh
        assert not PlanTemplate(Plan((1,), None, (x, out, computed), (out,)), (x,)).usable
    bound = PlanTemplate(Plan((1,), None, (x, out, 3), (out,)), (x,)).bind((torch.zeros(4),))
    assert bound.args[0].sum() == 0 and bound.args[1] is bound.outputs[0] and bound.args[2] == 3


def test_a_re_used_plans_buffers_are_freed_when_dropped(collector_off):
    """The buffers of a plan re-built for new tensors (``PlanTemplate.bind``) die with their last
    reference, not at the next garbage collection: an intermediate the caller drops (a forward's
    entry states, which the backward recomputes) must not stay allocated through a training
    step's backward, as it did while ``bind`` built plans with a recursive closure (a reference
    cycle holding every buffer of the plan). Checked with the collector off."""
    import weakref
    from ops.runtime.launch import Plan, PlanTemplate
    x, mid, out = torch.ones(4), torch.empty(4), torch.empty(4)
    first = Plan((1,), None, (x, mid), (mid,))
    template = PlanTemplate(Plan((1,), None, (x, mid, out), (out,), (first,)), (x,))
    with collector_off():
        bound = template.bind((torch.ones(4),))
        intermediate, result = weakref.ref(bound.before[0].outputs[0]), bound.outputs[0]
        del bound
        assert intermediate() is None and result.shape == (4,)


@pytest.mark.parametrize("device", DEVICES)
def test_calls_leave_no_tensor_in_a_reference_cycle(device, collector_off):
    """Every tensor a call makes is freed with its last reference: none waits in a reference
    cycle for the garbage collector (until it runs, a GPU keeps such a tensor allocated;
    ``bind``'s recursive closure once held a forward's entry states through the backward). A
    training step with D, z, dt_bias, initial states, seq_idx and dt_limit, and an eager call,
    each after a first call (plans re-used, the eager call replayed), then again; any tensor
    left in a cycle is listed."""
    import gc
    kw = make_problem(batch=2, seqlen=96, nheads=4, headdim=16, ngroups=2, dstate=16, D="1d",
                      z=True, initial_states=True, seq_boundaries=[40], seed=2,
                      dtype=torch.bfloat16, device=device)
    leaves = {k: v.detach().requires_grad_(True) if v.is_floating_point() else v
              for k, v in kw.items()}
    call = dict(chunk_size=32, **OPTIONS, backend="interpret" if device == "cpu" else "cutile")

    def train():
        out, final = mamba_chunk_scan_combined(**leaves, **call, return_final_states=True)
        (out.float().sum() + final.sum()).backward()

    def infer():
        with torch.no_grad():
            mamba_chunk_scan_combined(**{k: v.detach() for k, v in leaves.items()}, **call)

    for fn in (train, infer):
        fn()                                          # first calls: plans built, replay recorded
        for _ in range(2):
            with collector_off(gc.DEBUG_SAVEALL):     # what a collection finds is kept, listed
                fn()
                gc.collect()
                cycled = [tuple(o.shape) for o in gc.garbage if isinstance(o, torch.Tensor)]
            assert cycled == [], (fn.__name__, cycled)


# Host time: eager calls replayed ---------------------------------------------------------------

def _replayed_runs(monkeypatch):
    """Count the calls that ``ops.runtime.replay`` replays (the wrapped ``Replay.run``)."""
    from ops.runtime import replay
    runs = []
    original = replay.Replay.run
    monkeypatch.setattr(replay.Replay, "run", lambda self, inputs: runs.append(1) or original(self, inputs))
    return runs


def _run(kw, **options):
    return mamba_chunk_scan_combined(**kw, chunk_size=32, **{**OPTIONS, **options},
                                     return_final_states=True, backend="interpret")


def test_an_eager_call_like_an_earlier_one_is_replayed_exactly(monkeypatch):
    from ops.runtime import replay
    runs = _replayed_runs(monkeypatch)
    first = problem(torch.float32, seq_boundaries=[40])
    second = {k: (v + 0.25 if v.is_floating_point() and k != "A" else v) for k, v in first.items()}
    _run(first), _run(first)                       # the second is recorded (or replayed)
    replay._REPLAYS.clear()
    runs.clear()
    recorded = _run(first)
    assert not runs                                # recorded, not replayed
    out1 = _run(first)
    out2 = _run(second)
    assert len(runs) == 2
    kept = out1[0].clone()
    replay._REPLAYS.clear()
    monkeypatch.setattr(replay.Replay, "run", lambda self, inputs: pytest.fail("replayed"))
    expected2 = _run(second)                       # planned and launched afresh
    for a, b in zip(recorded + out2, out1 + expected2, strict=True):
        assert torch.equal(a, b)
    assert out1[0].data_ptr() != out2[0].data_ptr() and torch.equal(out1[0], kept)


def test_a_replayed_call_still_checks_seq_idx(monkeypatch):
    runs = _replayed_runs(monkeypatch)
    kw = problem(torch.float32, seq_boundaries=[40])
    kw["seq_idx"] = kw["seq_idx"].to(torch.int32)  # int32: used as it is, so replayable
    _run(kw), _run(kw), _run(kw)
    assert runs
    bad = dict(kw, seq_idx=kw["seq_idx"].flip(1).contiguous())
    with pytest.raises(ValueError, match="non-decreasing"):
        _run(bad)


@pytest.mark.parametrize("change", ["dtype", "strides", "option", "chunk type", "int64 seq_idx",
                                    "poisoned", "search"])
def test_calls_that_differ_or_cannot_be_replayed_are_run_afresh(monkeypatch, change):
    from ops import forward
    from ops.runtime import replay
    kw = problem(torch.float32, seq_boundaries=[40])
    kw["seq_idx"] = kw["seq_idx"].to(torch.int32)
    _run(kw), _run(kw)                             # recorded
    runs = _replayed_runs(monkeypatch)
    options = {}
    if change == "dtype":
        kw = {k: (v.to(torch.float16) if k in ("x", "B", "C", "z") else v) for k, v in kw.items()}
    elif change == "strides":
        kw["x"] = kw["x"].transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "option":
        options = dict(dt_softplus=False)
    elif change == "chunk type":
        with pytest.raises(TypeError, match="chunk_size must be an int"):
            mamba_chunk_scan_combined(**kw, chunk_size=32.0, **OPTIONS, backend="interpret")
        assert not runs
        return
    elif change == "int64 seq_idx":               # converted to int32 first: the same call
        kw["seq_idx"] = kw["seq_idx"].long()
    elif change == "poisoned":
        monkeypatch.setattr(forward, "POISON_OUTPUTS", True)
    elif change == "search":
        monkeypatch.setenv("MAMBA2_CUTILE_AUTOTUNE", "1")
    if change in ("poisoned", "search"):
        replay._REPLAYS.clear()
    expected = ssd_sequential(**f64(kw), **{**OPTIONS, **options}, return_final_states=True)
    for i in range(3):
        out = _run(kw, **options)
        assert rel_err(out[0], expected[0]) < (4e-3 if change == "dtype" else TOL[torch.float32])
        if change == "search":                    # the first call may search: not recorded
            assert (bool(replay._REPLAYS), bool(runs)) == (i >= 1, i >= 2)
    # new keys: recorded, then replayed; under a search, from the key's second call
    assert bool(runs) == (change in ("dtype", "strides", "option", "int64 seq_idx", "search"))
    if change == "poisoned":
        assert not replay._REPLAYS


def test_under_a_search_each_tuner_skips_a_calls_first_recording(monkeypatch):
    """With MAMBA2_CUTILE_AUTOTUNE=1 a key's first call may search (its candidates' launches
    must not be recorded), so its second call is recorded and its third replayed; a new tuner,
    whose memo of answers is empty, starts the count again."""
    from ops.tuning import autotune
    from ops.runtime import replay
    runs = _replayed_runs(monkeypatch)
    monkeypatch.setenv("MAMBA2_CUTILE_AUTOTUNE", "1")
    replay._REPLAYS.clear()
    kw = problem(torch.float32)
    expected = _run(kw)
    _run(kw)
    assert replay._REPLAYS and not runs
    monkeypatch.setattr(autotune, "_TUNER", None)
    _run(kw)
    assert not runs                               # the old recording's tuner is gone: run afresh
    _run(kw), _run(kw)
    assert len(runs) == 1
    for a, b in zip(_run(kw), expected, strict=True):
        assert torch.equal(a, b)


def test_a_batch_one_slice_is_restrided_in_each_replay(monkeypatch):
    """x[:, -64:] of a longer batch-1 tensor keeps the parent's stride in its size-1 batch
    dimension; the kernels get it restrided (as_kernel_input), and so does every replay."""
    from ops.runtime import replay
    runs = _replayed_runs(monkeypatch)
    long = [problem(torch.float32, seqlen=100) for _ in range(2)]
    long[1] = {k: (v * 0.5 if k in ("x", "C") else v) for k, v in long[0].items()}
    sliced = [{k: (v[:, -64:] if v.dim() == 4 else v) for k, v in kw.items()}
              for kw in long]
    sliced = [dict(kw, dt=kw["dt"][:, -64:]) for kw in sliced]
    x = sliced[0]["x"]
    assert x.is_contiguous() and x.stride(0) == 100 * x.stride(1) != x.numel()
    _run(sliced[0]), _run(sliced[0])
    runs.clear()
    replayed = _run(sliced[1])
    assert runs and any(r.restrided for r in replay._REPLAYS.values())
    replay._REPLAYS.clear()
    monkeypatch.setattr(replay.Replay, "run", lambda self, inputs: pytest.fail("replayed"))
    fresh = _run({k: v.clone() for k, v in sliced[1].items()})
    for a, b in zip(replayed, fresh, strict=True):
        assert torch.equal(a, b)


def test_a_replay_never_keeps_a_computed_one_element_tensor(monkeypatch):
    """Sequence ids of a one-token call converted from int64, and one one-element view passed
    as both D and dt_bias (restrided once, for two inputs): each call must use its own values."""
    from ops.runtime import replay
    base = problem(torch.float32, batch=1, seqlen=1, nheads=1, ngroups=1, D="1d")
    base["initial_states"] = torch.randn(1, 1, 16, 16)
    for ids in ([[0]], [[1]], [[0]]):
        kw = dict(base, seq_idx=torch.tensor(ids))                      # int64
        got = _run(kw)
        replay._REPLAYS.clear()
        fresh = _run(dict(kw, seq_idx=kw["seq_idx"].clone()))
        for a, b in zip(got, fresh, strict=True):
            assert torch.equal(a, b)
    replay._REPLAYS.clear()
    for value in (0.5, -2.0, 3.0):
        shared = torch.tensor([value, 9.0])[::2]                        # one element, stride 2
        kw = dict(base, D=shared, dt_bias=shared)
        got = _run(kw)
        expected = ssd_sequential(**f64(kw), **OPTIONS, return_final_states=True)
        assert rel_err(got[0], expected[0]) < TOL[torch.float32]


def test_a_changed_autotune_mode_or_dt_limit_is_a_new_call(monkeypatch):
    from ops.runtime import replay
    runs = _replayed_runs(monkeypatch)
    kw = problem(torch.float32)
    lo, hi = torch.tensor(0.0), torch.tensor(1.5)
    _run(kw, dt_limit=(lo, hi)), _run(kw, dt_limit=(lo, hi))
    hi.fill_(0.05)                                      # a bound changed in place
    got, _ = _run(kw, dt_limit=(lo, hi))
    expected = ssd_sequential(**f64(kw), dt_softplus=True, dt_limit=(0.0, 0.05))
    assert not runs and rel_err(got, expected) < TOL[torch.float32]
    monkeypatch.setenv("MAMBA2_CUTILE_AUTOTUNE", "0")           # (the tests' setting)
    _run(kw), _run(kw)
    runs.clear()
    monkeypatch.setenv("MAMBA2_CUTILE_AUTOTUNE", "table")
    _run(kw)
    assert not runs and {k[1][-1] for k in replay._REPLAYS} >= {"off", "table"}


def test_a_call_that_needs_a_gradient_is_not_replayed(monkeypatch):
    runs = _replayed_runs(monkeypatch)
    kw = problem(torch.float32)
    _run(kw), _run(kw)
    runs.clear()
    kw = dict(kw, x=kw["x"].clone().requires_grad_())
    out, _ = _run(kw)
    assert out.grad_fn is not None and not runs


# Any size -----------------------------------------------------------------------------------------
# headdim and dstate that are not powers of two (or are below 16) are computed in tiles padded to
# the next power of two (at least 16): zero-padded loads, dropped stores.

ODD_SIZES = [(1, 1), (8, 24), (48, 40), (96, 16), (12, 130), (256, 16)]


@pytest.mark.parametrize("headdim, dstate", ODD_SIZES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_any_headdim_and_dstate(headdim, dstate, dtype):
    kw = make_problem(batch=1, seqlen=70, nheads=4, headdim=headdim, ngroups=2, dstate=dstate,
                      D="2d", dtype=dtype, seed=2, seq_boundaries=[33])
    out, final = mamba_chunk_scan_combined(**kw, chunk_size=32, **OPTIONS, return_final_states=True,
                                           backend="interpret")
    ref, ref_final = ssd_sequential(**f64(kw), **OPTIONS, return_final_states=True)
    tol = {torch.float32: 2e-5, torch.bfloat16: 1e-2}[dtype]     # as tests/api/test_api.py
    assert rel_err(out, ref) < tol and rel_err(final, ref_final) < tol


@pytest.mark.parametrize("name", ["fwd_pass_state", "compute_out"])
def test_every_config_at_an_odd_size_computes_the_default(name):
    """Every config of the search space at headdim 48, dstate 40 (padded to 64 and 64) gives the
    default config's result on the interpreter (float32: 1e-5, summation order only)."""
    from ops.kernels import chunk_cumsum, compute_out, fwd_pass_state
    from ops.forward import KERNELS
    kw = make_problem(batch=1, seqlen=100, nheads=4, headdim=48, ngroups=2, dstate=40, D="2d",
                      dtype=torch.float32, seed=4, seq_boundaries=[40])
    dt, dA = chunk_cumsum.chunk_cumsum(kw["dt"], kw["A"], 32, dt_bias=kw["dt_bias"], **OPTIONS)
    entry, _ = fwd_pass_state.fwd_pass_state(kw["x"], kw["B"], dt, dA, kw["initial_states"],
                                             kw["seq_idx"])
    if name == "fwd_pass_state":
        run = lambda cfg: fwd_pass_state.fwd_pass_state(
            kw["x"], kw["B"], dt, dA, kw["initial_states"], kw["seq_idx"], poison=True, config=cfg)
    else:
        run = lambda cfg: (compute_out.compute_out(kw["x"], kw["B"], kw["C"], dt, dA, entry,
                                                   D=kw["D"], z=kw["z"], seq_idx=kw["seq_idx"],
                                                   poison=True, config=cfg),)
    space = KERNELS[name].search_space(batch=1, seqlen=100, nheads=4, headdim=48, ngroups=2,
                                       dstate=40, chunk_size=32, dtype=torch.float32,
                                       states_dtype=torch.float32)
    default = run(None)
    assert len(space) > 5
    for cfg in space:
        for got, want in zip(run(cfg), default, strict=True):
            assert rel_err(got, want) < 1e-5, cfg


@pytest.mark.parametrize("name", ["chunk_cumsum", "fwd_pass_state", "compute_out"])
@pytest.mark.parametrize("headdim, dstate", [(48, 40), (8, 24)], ids=lambda v: str(v))
def test_odd_sizes_compile_for_hopper(name, headdim, dstate):
    from ops.tools.aot import compile_cubin
    from ops.tools.plans import meta_plan
    plan = meta_plan(name, batch=1, seqlen=4096, nheads=8, headdim=headdim, ngroups=1,
                     dstate=dstate, chunk_size=256)
    assert compile_cubin(plan.kernel, plan.args, "sm_90")[:4] == b"\x7fELF"


@pytest.mark.gpu
@pytest.mark.parametrize("headdim, dstate", ODD_SIZES, ids=lambda v: str(v))
def test_any_headdim_and_dstate_on_gpu(headdim, dstate):
    kw = {k: v.cuda() for k, v in make_problem(batch=1, seqlen=300, nheads=4, headdim=headdim,
                                                ngroups=2, dstate=dstate, D="2d",
                                                dtype=torch.bfloat16, seed=2,
                                                seq_boundaries=[130]).items()}
    with torch.no_grad():
        out, final = mamba_chunk_scan_combined(**kw, chunk_size=64, **OPTIONS,
                                               return_final_states=True, backend="cutile")
    ref, ref_final = ssd_sequential(**f64({k: v.cpu() for k, v in kw.items()}), **OPTIONS,
                                    return_final_states=True)
    assert rel_err(out.cpu(), ref) < 1e-2 and rel_err(final.cpu(), ref_final) < 1e-2


# Found in review ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, dtype", CPU_BACKENDS)
def test_the_first_sequence_owns_the_initial_state_only_as_id_zero(backend, dtype):
    """Ids that start at 5: the initial state belongs to no sequence (id 0 does not occur), in
    the outputs and the varlen states alike, wherever the first sequence ends."""
    for bounds in ([0, 23, 64, 100], [0, 40, 64, 100]):
        kw = problem(dtype)
        kw["seq_idx"] = torch.repeat_interleave(torch.arange(3), torch.tensor(bounds).diff())[None] + 5
        out, varlen = mamba_chunk_scan_combined(**kw, chunk_size=32, cu_seqlens=torch.tensor(bounds),
                                                **OPTIONS, return_varlen_states=True, backend=backend)
        alone = {k: v for k, v in kw.items() if k != "initial_states"}
        ref_out, ref_varlen = per_sequence_reference(alone, bounds)
        assert rel_err(out, ref_out) < TOL[dtype] and rel_err(varlen, ref_varlen) < TOL[dtype], bounds


def test_compiles_with_dynamic_shapes_and_the_default_dt_limit():
    torch._dynamo.reset()
    kw = problem(torch.float32)
    fn = lambda x, dt, A, B, C: mamba_chunk_scan_combined(x, dt, A, B, C, 32, backend="interpret")
    args = [kw[k] for k in ARGS]
    with torch.no_grad():
        assert torch.equal(torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)(*args),
                           fn(*args))


def test_a_differentiable_call_with_seq_idx_compiles():
    torch._dynamo.reset()
    kw = problem(torch.float64, seq_boundaries=[40])
    kw["x"] = kw["x"].clone().requires_grad_(True)
    fn = lambda kw: mamba_chunk_scan_combined(**kw, chunk_size=32, **OPTIONS, backend="reference")
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(kw)
    assert rel_err(compiled, fn(kw)) < 1e-12
    compiled.sum().backward()
    assert kw["x"].grad is not None and torch.isfinite(kw["x"].grad).all()


def test_the_parallel_compile_worker_runs_a_candidate(monkeypatch):
    """``python -m ops.tools.tune search``'s worker: one candidate config of one kernel, the others
    at their defaults (on the CPU, through the interpreter)."""
    from ops.tuning.autotune import ENV_SWITCH
    from ops.forward import KERNELS
    from ops.tools.tune import _launch_one
    monkeypatch.delenv(ENV_SWITCH, raising=False)     # the worker sets it: restored afterwards
    shape = dict(batch=1, seqlen=64, nheads=4, headdim=16, ngroups=1, dstate=16, chunk_size=32)
    space = KERNELS["compute_out"].search_space(**shape, dtype=torch.float32,
                                                 states_dtype=torch.float32)
    assert _launch_one("compute_out", shape, "float32", "D", space[-1], device="cpu") == (True, "")
    ok, message = _launch_one("compute_out", shape, "float32", "D", {"HEADS_PER_BLOCK": 3},
                              device="cpu")
    assert not ok and message.startswith("ValueError: HEADS_PER_BLOCK (3) must be 1, 2 or 4")


def test_the_parallel_compile_worker_runs_a_backward_candidate(monkeypatch):
    """``python -m ops.tools.tune search --backward``: a worker runs one backward pass with one
    candidate of one backward kernel (the chain's others at their own choices), and the search
    lists the chain's candidates: the chunk states' kernel only where the chain runs it."""
    from ops.backward import chain_space
    from ops.tuning.autotune import ENV_SWITCH
    from ops.tools.tune import _candidates, _launch_one
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    shape = dict(batch=1, seqlen=64, nheads=4, headdim=16, ngroups=1, dstate=16, chunk_size=32)
    sizes = dict(shape, dtype=torch.float32, states_dtype=torch.float32)
    for name in ("bwd_compute_out", "bwd_pass_state", "bwd_chunk_cumsum"):
        config = chain_space(name, sizes)[1][-1]
        assert _launch_one(name, shape, "float32", "D", config, device="cpu") == (True, ""), name
    ok, message = _launch_one("bwd_chunk_cumsum", shape, "float32", "D", {"BLOCK_H": 3},
                              device="cpu")
    assert not ok and "BLOCK_H must be a power of two" in message
    names = {n for n, _ in _candidates(shape, torch.float32, with_backward=True)}
    assert names == {"chunk_cumsum", "fwd_pass_state", "compute_out", "bwd_compute_out",
                     "bwd_pass_state", "bwd_chunk_cumsum"}
    assert {n for n, _ in _candidates(shape, torch.float32, with_backward=False)} == {
        "chunk_cumsum", "fwd_pass_state", "compute_out"}


def test_a_backward_only_search_runs_the_forward_at_the_tables_configs(monkeypatch, tmp_path):
    """``search --backward-only``: the candidates are the backward chain's alone, and the
    forward's kernels run the committed table's configs for the shape on that GPU (at the 2.7B
    training shape, chunk 128, the table's compute_out: two heads per block, persistent), the
    defaults on a GPU the table does not know and whose compute capability is unknown (none
    to borrow by: ``autotune.Table.choice``)."""
    import json

    from ops.forward import KERNELS
    from ops.tuning import autotune
    from ops.tools.tune import TABLE_PATH, _candidates, table_configs
    shape = dict(batch=8, seqlen=2048, nheads=80, headdim=64, ngroups=1, dstate=128,
                 chunk_size=128)
    bf = torch.bfloat16
    names = {n for n, _ in _candidates(shape, bf, with_backward=True, with_forward=False)}
    assert names == {"bwd_compute_out", "bwd_pass_state", "bwd_chunk_cumsum"}
    with open(TABLE_PATH) as f:
        entry, = [e for e in json.load(f)["entries"] if e["kernel"] == "compute_out"
                  and e["shape"] == dict({k: str(v) for k, v in shape.items()},
                                         dtype="bfloat16", states_dtype="bfloat16",
                                         features="D")]
    monkeypatch.setenv(autotune.ENV_CACHE, str(tmp_path / "cache.json"))     # an empty cache
    monkeypatch.setattr(autotune, "_TUNER", None)
    monkeypatch.setattr(autotune.Autotuner, "_device_name", lambda self: entry["device"])
    on_h200 = table_configs(shape, bf, "D")
    assert on_h200["compute_out"] == entry["config"] and entry["config"]["HEADS_PER_BLOCK"] == 2
    monkeypatch.setattr(autotune, "_TUNER", None)
    monkeypatch.setattr(autotune.Autotuner, "_device_name", lambda self: "another GPU")
    sizes = dict(shape, dtype=bf, states_dtype=bf)
    assert table_configs(shape, bf, "D") == {name: module.default_config(**sizes)
                                              for name, module in KERNELS.items()}


def test_the_parallel_compile_worker_never_searches(monkeypatch):
    """The search switches the tuner on in its own process before it spawns the next shape's
    workers, which inherit that: a worker must still run the other kernels at their defaults, not
    search them while its siblings share the GPU."""
    import ops.forward as forward
    from ops.tuning.autotune import ENV_SWITCH, mode
    from ops.tools.tune import _launch_one
    monkeypatch.setenv(ENV_SWITCH, "1")
    modes = []
    monkeypatch.setattr(forward, "kernel_forward", lambda **kw: modes.append(mode()))
    shape = dict(batch=1, seqlen=64, nheads=4, headdim=16, ngroups=1, dstate=16, chunk_size=32)
    assert _launch_one("compute_out", shape, "float32", "D", {}, device="cpu") == (True, "")
    assert modes == ["off"]


def test_an_unused_outputs_gradient_is_not_materialised(monkeypatch):
    """An eager loss of out alone hands the backward no final-state gradient (None, not a
    tensor of zeros the size of the final states, alive through the backward's peak), and one of
    the final states alone no output gradient."""
    import ops.torch_op as torch_op
    seen = []
    real = torch_op._gradients
    monkeypatch.setattr(torch_op, "_gradients", lambda ctx, dout, dfinal, eager: (
        seen.append((dout is None, dfinal is None)) or real(ctx, dout, dfinal, eager)))
    kw = problem(torch.float32)
    x = kw["x"].clone().requires_grad_(True)
    call = lambda x: mamba_chunk_scan_combined(**{**kw, "x": x}, chunk_size=32, **OPTIONS,
                                               return_final_states=True, backend="interpret")
    out, final = call(x)
    out.square().sum().backward()
    out, final = call(x)
    final.sum().backward()
    assert seen == [(False, True), (True, False)]


@pytest.mark.parametrize("case, kept", [
    (dict(dstate=16), True),
    (dict(dstate=64), False),                                  # states larger than x
    (dict(dstate=16, state_dtype=torch.bfloat16), False),      # widened to float32 to be read
    (dict(dstate=16, wanted=("D",)), False),                   # no backward kernel runs
    (dict(dstate=16, setting="0"), False),                     # MAMBA2_CUTILE_KEEP_INTERMEDIATES
    (dict(dstate=16, wanted=("x", "B", "z")), True),           # dz: compute_out again, on them
], ids=["kept", "larger-states", "bf16-states-of-float32", "only-D", "switched-off", "dz"])
def test_a_training_steps_forward_keeps_its_intermediates_where_it_should(monkeypatch, case,
                                                                          kept):
    """An eager training step's forward keeps dt_out, dA_cumsum and the entry states for the
    backward (``ops.backward.keeps``) where the states take no more memory than x and are read
    as stored (dstate 16 at chunk 32 here), the backward runs the kernels, and the setting
    allows it; that backward then runs no chunk_cumsum or fwd_pass_state. Otherwise the
    backward makes them again. Either way the gradients equal bitwise those of a backward that
    recomputes them (the same kernels and configs give the same values)."""
    import ops.backward
    import ops.runtime.launch as launch_module
    import ops.torch_op
    from ops.runtime.cutile_internals import kernel_function
    from ops.runtime import tape
    monkeypatch.setattr(ops.torch_op, "taped", lambda key, stamp, fn, inputs, owned=False:
                        tape.taped(None, stamp, fn, inputs, owned))      # never recorded
    if "setting" in case:
        monkeypatch.setenv(ops.backward.KEEP_ENV, case["setting"])
    kw = make_problem(batch=1, seqlen=64, nheads=4, headdim=16, ngroups=1,
                      dstate=case["dstate"], D="1d", dtype=torch.float32, seed=7)
    dout = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(8))
    wanted = case.get("wanted", ("x", "dt", "A", "B", "C", "D", "dt_bias"))
    names, given = [], []
    real_launch, real_work = launch_module.launch, ops.backward.backward_work
    monkeypatch.setattr(launch_module, "launch", lambda grid, kernel, args, *rest: (
        names.append(kernel_function(kernel).__name__), real_launch(grid, kernel, args, *rest))[1])
    monkeypatch.setattr(ops.backward, "backward_work", lambda *a, kept=None, **k: (
        given.append(kept is not None), real_work(*a, kept=kept, **k))[1])

    def step():
        leaves = {k: v.clone().requires_grad_(k in wanted) for k, v in kw.items()}
        out = mamba_chunk_scan_combined(**leaves, chunk_size=32, **OPTIONS, backend="interpret",
                                        state_dtype=case.get("state_dtype"))
        names.clear(), given.clear()
        out.backward(dout)
        return {k: v.grad for k, v in leaves.items() if v.grad is not None}, list(names)
    grads, launched = step()
    assert given == [kept]
    recomputes = {"chunk_cumsum_kernel", "fwd_pass_state_kernel"} & set(launched)
    assert bool(recomputes) == (not kept and wanted != ("D",)), launched
    assert ("compute_out_kernel" in launched) == ("z" in wanted)        # y, for dz
    monkeypatch.setattr(ops.backward, "keeps", lambda x, entry: False)
    again, _ = step()
    assert given == [False]
    assert grads.keys() == again.keys() and all(torch.equal(grads[k], again[k]) for k in grads)


def test_intermediates_of_another_chunk_are_not_used():
    """Kept intermediates that do not fit this backward (another chunk: the compute chunk's
    mode changed between the passes; another dtype) are left aside, and the backward makes its
    own: the same gradients as without them."""
    from ops.backward import kernel_backward
    from ops.forward import kernel_forward
    kw = make_problem(batch=1, seqlen=64, nheads=4, headdim=16, ngroups=1, dstate=16,
                      dtype=torch.float32, seed=7)
    dout = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(1))
    args = (dout, None, kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 32)
    want = kernel_backward(*args)
    _, _, at_16 = kernel_forward(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 16,
                                 return_intermediates=True)
    _, _, at_32 = kernel_forward(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 32,
                                 return_intermediates=True)
    for kept in (at_16, (*at_32[:2], at_32[2].double()), at_32[:2], ("not", "tensors", 3)):
        got = kernel_backward(*args, kept=kept)
        assert all(torch.equal(got[k], want[k]) for k in want)
    got = kernel_backward(*args, kept=at_32)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_autograd_grad_and_checkpointing_give_the_same_gradients():
    """torch.autograd.grad, the call inside torch.utils.checkpoint (recomputed in the backward)
    and torch.func.grad give loss.backward()'s gradients bitwise."""
    from torch.utils.checkpoint import checkpoint
    kw = problem(torch.float32, seq_boundaries=[40])
    x = kw["x"].clone().requires_grad_(True)
    B = kw["B"].clone().requires_grad_(True)
    run = lambda x, B: mamba_chunk_scan_combined(**{**kw, "x": x, "B": B}, chunk_size=32,
                                                 **OPTIONS, backend="interpret").square().sum()
    run(x, B).backward()
    expected = (x.grad.clone(), B.grad.clone())
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(run(x, B), (x, B)), expected))
    x.grad = B.grad = None
    checkpoint(run, x, B, use_reentrant=False).backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(B.grad, expected[1])
    # torch.func's transforms too (under one, the eager path is an autograd.Function with
    # setup_context: ops.torch_op.TransformableEagerAutograd)
    got = torch.func.grad(run, argnums=(0, 1))(kw["x"], kw["B"])
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # a gradient of the gradient is refused, never silently wrong
    g, = torch.autograd.grad(run(x, B), x, create_graph=True)
    with pytest.raises(RuntimeError):
        g.square().sum().backward()
