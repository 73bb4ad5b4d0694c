"""Training steps taped (``ops.runtime.tape``): an eager step's forward and backward recorded once
as their torch ops and launches, then replayed for calls with the same key.

The taped steps' outputs and gradients must equal, bitwise, those of the same steps run without
the tape (the same kernels and ops in the same order: nothing to tolerate); the untaped runs'
agreement with the recurrence is what tests/api/test_drop_in.py checks. Runs on the CPU
interpreter; the GPU version carries the ``gpu`` marker.
"""
import pytest
import torch

import ops.forward  # noqa: F401  (a process's first call is keyed once the kernels' module is in)
from ops import mamba_chunk_scan_combined
from ops.runtime import tape
from reference.problems import make_problem

LEAVES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


@pytest.fixture
def tape_runs(monkeypatch):
    """The kinds ("forward" or "backward") of the tapes replayed, in order; the tapes start
    empty."""
    runs = []
    original = tape.Tape.run

    def run(self, inputs, owned=False):
        runs.append("backward" if len(inputs) >= 13 else "forward")
        return original(self, inputs, owned)
    monkeypatch.setattr(tape.Tape, "run", run)
    monkeypatch.setattr(tape, "_TAPES", {})
    return runs


def _untaped(monkeypatch):
    """No call is taped from here on (each runs its Python afresh)."""
    import ops.torch_op
    monkeypatch.setattr(ops.torch_op, "taped", lambda key, stamp, fn, inputs, owned=False:
                        tape.taped(None, stamp, fn, inputs, owned))


def _step(kw, seed, chunk_size=32, loss="both", device="cpu", **options):
    """One training step on copies of ``kw``'s tensors: -> [out, final_states, every gradient]."""
    inputs = {k: (v.detach().clone().requires_grad_(k in LEAVES) if v.is_floating_point()
                  else v) for k, v in kw.items()}
    out, final = mamba_chunk_scan_combined(
        **inputs, chunk_size=chunk_size, dt_softplus=True, return_final_states=True,
        backend="interpret" if device == "cpu" else "cutile", **options)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(
        device=out.device, dtype=out.dtype)
    if loss == "out":                                   # final_states' gradient absent (None)
        (out * weights).sum().backward()
    elif loss == "sum":                                 # dout an expanded tensor of ones
        out.sum().backward()
    else:
        ((out * weights).sum() + final.square().sum()).backward()
    return [out.detach(), final.detach()] + [inputs[k].grad for k in LEAVES
                                             if k in inputs and inputs[k].grad is not None]


def _shifted(kw, by):
    return {k: (v + by if v.is_floating_point() and k != "A" else v) for k, v in kw.items()}


CASES = {
    "D 2-d, z, initial states, 2 groups": dict(D="2d", ngroups=2),
    "D 1-d, dt_bias": dict(D="1d", z=False, initial_states=False),
    "no D, bf16, dout of ones": dict(D=None, z=False, initial_states=False,
                                     dtype=torch.bfloat16, loss="sum"),
    "seq_idx, z, no final-state loss": dict(D="1d", initial_states=False, seq_boundaries=[40],
                                            loss="out"),
}


@pytest.mark.parametrize("case", CASES)
def test_taped_training_steps_equal_untaped_ones_bitwise(tape_runs, monkeypatch, case):
    """The first step records, the next ones replay (both passes; with seq_idx the forward,
    whose ids are checked by value, is not taped); every output and gradient equals the untaped
    step's on the same inputs."""
    options = dict(CASES[case])
    loss = options.pop("loss", "both")
    dtype = options.pop("dtype", torch.float32)
    kw = make_problem(**{**dict(batch=2, seqlen=96, nheads=4, headdim=16, ngroups=1, dstate=16,
                                dt_bias=True), **options}, dtype=dtype, seed=5)
    if "seq_idx" in kw:
        kw["seq_idx"] = kw["seq_idx"].to(torch.int32)
    steps = [(kw, 1), (_shifted(kw, 0.25), 2), (_shifted(kw, -0.5), 3)]
    taped = [_step(k, s, loss=loss) for k, s in steps]
    replayed = ["backward"] if "seq_idx" in kw else ["forward", "backward"]
    assert tape_runs == replayed * 2
    _untaped(monkeypatch)
    for (k, s), got in zip(steps, taped):
        want = _step(k, s, loss=loss)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_graph_retained_for_more_backwards_makes_its_intermediates_again(tape_runs):
    """``backward(retain_graph=True)`` on a taped step whose forward kept its intermediates
    (``ops.backward.keeps``): the first backward takes them (its tape replayed) and frees them;
    the second finds none and makes them again (a call of another key: recorded), the third
    replays the second's tape; all give the same gradients."""
    kw = make_problem(batch=1, seqlen=64, nheads=4, headdim=16, ngroups=1, dstate=16, D="1d",
                      dtype=torch.float32, seed=2)

    def loss_of(x):
        out = mamba_chunk_scan_combined(**{**kw, "x": x}, chunk_size=32, dt_softplus=True,
                                        backend="interpret")
        return out.square().sum()
    x = kw["x"].clone().requires_grad_(True)
    loss_of(x).backward()                           # records both tapes
    want = x.grad.clone()
    tape_runs.clear()
    loss = loss_of(x)
    grads = []
    for retain in (True, True, False):
        x.grad = None
        loss.backward(retain_graph=retain)
        grads.append(x.grad.clone())
    assert tape_runs == ["forward", "backward", "backward"]
    assert all(torch.equal(g, want) for g in grads)


def test_nothing_is_kept_under_saved_tensor_hooks(monkeypatch):
    """Under saved-tensor hooks (here offloading to the host; a non-reentrant checkpoint is
    another) a step's forward keeps no intermediates: the hooks see only what is saved, and
    intermediates held beside them would stay where they are. The gradients are those of a
    step that keeps them (bitwise: the backward makes the same values again)."""
    import ops.torch_op
    kept_flags, forward = [], ops.torch_op._eager_forward
    monkeypatch.setattr(ops.torch_op, "_eager_forward",
                        lambda inputs, keep: kept_flags.append(keep) or forward(inputs, keep))
    kw = make_problem(batch=1, seqlen=64, nheads=4, headdim=16, ngroups=1, dstate=16, D="1d",
                      dtype=torch.float32, seed=4)

    def x_grad():
        x = kw["x"].clone().requires_grad_(True)
        out = mamba_chunk_scan_combined(**{**kw, "x": x}, chunk_size=32, dt_softplus=True,
                                        backend="interpret")
        out.square().sum().backward()
        return x.grad
    plain = x_grad()
    with torch.autograd.graph.save_on_cpu():
        hooked = x_grad()
    assert kept_flags == [True, False]
    assert torch.equal(plain, hooked)


def test_a_new_key_records_again(tape_runs, monkeypatch):
    """Other strides or another dtype make another call: recorded afresh (not replayed from a
    tape of another key), and still exact."""
    kw = make_problem(batch=1, seqlen=64, nheads=4, headdim=16, ngroups=1, dstate=16, D="1d",
                      dt_bias=True, dtype=torch.float32, seed=6)
    _step(kw, 1), _step(kw, 1)
    tape_runs.clear()
    strided = dict(kw, x=kw["x"].transpose(1, 2).contiguous().transpose(1, 2))
    half = {k: (v.to(torch.float16) if k in ("x", "B", "C", "z") else v) for k, v in kw.items()}
    for other in (strided, half):
        got = _step(other, 2)
        assert tape_runs == []
        _step(other, 2)
        assert tape_runs == ["forward", "backward"]
        tape_runs.clear()
    got = _step(half, 3)
    _untaped(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(got, _step(half, 3), strict=True))


def test_a_taped_step_dispatches_few_operators(tape_runs):
    """Each operator a step dispatches costs host time on a GPU (about 15 us each on the H200's
    host, against a few microseconds of GPU work at small shapes: PERF_NOTES.md, "An eager
    training step replays its first step's tape"), so the tapes' lengths are held where they
    are: at this shape (bf16, 1-d D, dt_bias; the defaults' launches) the forward makes 5
    operators and 3 launches, the backward (with the forward's intermediates kept:
    ``ops.backward.keeps``) 25 operators (18 of them its kernels' buffers, 5 fixed-order sums of
    partials, 2 conversions of dB and dC to bf16; None, not an empty tensor, for the varlen
    states and the gradients of inputs not given) and 5 launches. A change that adds operators
    to the step fails here and says how many."""
    from collections import Counter
    kw = make_problem(batch=1, seqlen=128, nheads=4, headdim=16, ngroups=1, dstate=16, D="1d",
                      z=False, initial_states=False, dtype=torch.bfloat16, seed=1)
    _step(kw, 1)
    counts = {}
    for key, recorded in tape._TAPES.items():
        kinds = Counter("launch" if step[0] == tape._LAUNCH else "operator"
                        for step in recorded.steps)
        counts[key[1][0]] = (kinds["operator"], kinds["launch"])
    assert counts == {"forward": (5, 3), "backward": (25, 5)}, counts


# The tape itself, on plain torch functions -------------------------------------------------------

def _record(fn, *inputs):
    return tape.taped(("test", fn.__name__), None, fn, inputs)


def test_a_tape_replays_views_in_place_ops_and_conversions(monkeypatch):
    monkeypatch.setattr(tape, "_TAPES", {})

    def fn(a, b):
        s = a.sum(0)
        a2 = a.clone()
        a2[..., -1] += b.sum(-1)                        # select, add_, copy_ into a view
        buf = torch.empty(a.shape, dtype=torch.float64)
        buf.copy_(a2)
        unused = a.t()                                  # a view no one reads: dropped  # noqa: F841
        return [s.to(torch.float16), buf, torch.cat([a, b], 1)]

    a, b = torch.randn(5, 3), torch.randn(5, 4)
    first = _record(fn, a, b)
    recorded = tape._TAPES[("test", "fn")]
    assert isinstance(recorded, tape.Tape) and recorded.usable
    assert "aten.t.default" not in [str(step[1]) for step in recorded.steps]
    a2, b2 = torch.randn(5, 3), torch.randn(5, 4)
    again = _record(fn, a2, b2)
    for got, want in zip(again, fn(a2, b2), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert all(g.data_ptr() != f.data_ptr() for g, f in zip(again, first))


@pytest.mark.parametrize("case", [
    pytest.param((torch.ops.aten.empty.memory_format, ([3, 4],), dict(dtype=torch.bfloat16)),
                 id="empty"),
    pytest.param((torch.ops.aten.empty.memory_format, ([2],),
                  dict(dtype=torch.float64, layout=torch.strided, device=torch.device("cpu"),
                       pin_memory=False, memory_format=torch.contiguous_format)), id="empty-all"),
    pytest.param((torch.ops.aten.new_empty.default, ("t", [0]), dict(dtype=torch.float32)),
                 id="new_empty"),
    pytest.param((torch.ops.aten.new_empty.default, ("t", [2, 2]), {}), id="new_empty-as-t"),
    pytest.param((torch.ops.aten._to_copy.default, ("t",), dict(dtype=torch.float16)),
                 id="to_copy"),
    pytest.param((torch.ops.aten._to_copy.default, ("tt",), dict(dtype=torch.bfloat16)),
                 id="to_copy-strided"),
    pytest.param((torch.ops.aten.sum.dim_IntList, ("t", [0, 2]), {}), id="sum"),
    pytest.param((torch.ops.aten.sum.dim_IntList, ("t", [1], True), dict(dtype=torch.float64)),
                 id="sum-keepdim-dtype"),
    pytest.param((torch.ops.aten.select.int, ("t", -1, 2), {}), id="select"),
    pytest.param((torch.ops.aten.add_.Tensor, ("u", "t"), dict(alpha=3)), id="add_"),
    pytest.param((torch.ops.aten.clone.default, ("tt",), {}), id="clone"),
])
def test_the_replays_bindings_equal_the_operators(case):
    """A tape replays allocations, sums, conversions and views through PyTorch's own bindings
    (cheaper host calls than the operator overloads): each gives what the overload gives on
    the same arguments (shape, strides, dtype, device, values where there are values)."""
    func, args, kwargs = case
    t = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))
    named = lambda: {"t": t, "tt": t.transpose(0, 2), "u": t.clone()}

    def run(call):
        values = named()
        out = call(*[values.get(a, a) if isinstance(a, str) else a for a in args])
        return out, values["u"]
    call = tape._fast_call(func, kwargs)
    assert call is not None
    got, got_u = run(call)
    want, want_u = run(lambda *a: func(*a, **kwargs))
    assert (got.shape, got.stride(), got.dtype, got.device) == (
        want.shape, want.stride(), want.dtype, want.device)
    if func not in (torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default):
        assert torch.equal(got, want) and torch.equal(got_u, want_u)
        assert (got.data_ptr() == t.data_ptr()) == (want.data_ptr() == t.data_ptr())


def test_a_replay_calls_the_operator_where_a_binding_would_differ():
    """Arguments a binding would not pass on (a pinned or channels-last allocation, a
    conversion that moves devices) leave the step to the operator overload."""
    aten = torch.ops.aten
    assert tape._fast_call(aten.empty.memory_format, dict(pin_memory=True)) is None
    assert tape._fast_call(aten.empty.memory_format,
                           dict(memory_format=torch.channels_last)) is None
    assert tape._fast_call(aten._to_copy.default,
                           dict(dtype=torch.float16, device=torch.device("cpu"))) is None
    assert tape._fast_call(aten.sum.dim_IntList, dict(out=None)) is None
    assert tape._fast_call(aten.mm.default, {}) is None


def test_a_tape_that_reads_a_value_or_an_outside_tensor_is_never_replayed(monkeypatch):
    """A step that reads a tensor's value on the host (its later steps could depend on it), or
    uses a tensor made outside the call (it could hold anything), makes the call not
    replayable: every later call runs it afresh."""
    monkeypatch.setattr(tape, "_TAPES", {})
    outside = torch.randn(3)
    calls = []

    def reads_value(a):
        calls.append(1)
        return [a * float(a.sum())]

    def uses_outside(a):
        calls.append(1)
        return [a + outside]

    for fn in (reads_value, uses_outside):
        calls.clear()
        for scale in (1.0, 2.0, 3.0):
            a = torch.full((3,), scale)
            got = _record(fn, a)
            assert torch.equal(got[0], fn(a)[0])
        assert len(calls) == 6                          # every call ran the function
        assert tape.lookup(("test", fn.__name__), None) is tape.NEVER


def test_a_replay_releases_each_intermediate_after_its_last_reader(monkeypatch, collector_off):
    """A replay holds no intermediate past its last use: the tensors a recorded call freed as it
    went (the backward's ``del``), a replay frees at the same point or earlier. Checked by
    watching a large intermediate die while the replay goes on."""
    import weakref
    monkeypatch.setattr(tape, "_TAPES", {})

    def fn(a):
        big = a.repeat(100, 1)
        small = big.sum(0)
        return [small * 2, torch.ones(2)]

    a = torch.randn(4)
    _record(fn, a)
    recorded = tape._TAPES[("test", "fn")]
    refs, alive = [], []

    def watched(step):                  # `big` is made by repeat; is it alive when ones runs?
        func, replayed = step[1], step[-1]          # the operator, and what the replay calls
        if str(func) == "aten.repeat.default":
            def call(*args, **kwargs):
                out = replayed(*args, **kwargs)
                refs.append(weakref.ref(out))
                return out
        elif str(func) == "aten.ones.default":
            def call(*args, **kwargs):
                alive.append(refs[0]() is not None)
                return replayed(*args, **kwargs)
        else:
            return step
        return (*step[:-1], call)
    monkeypatch.setattr(recorded, "steps", [watched(step) for step in recorded.steps])
    with collector_off():
        got = recorded.run((a,))
    assert alive == [False] and torch.equal(got[0], fn(a)[0])


def test_a_launch_taking_a_sequence_of_tensors_replays_with_the_new_ones(monkeypatch):
    """Kernel arguments nested in tuples (at any depth) are the new call's tensors on replay,
    not the recorded call's."""
    from ops.runtime import launch as launch_module
    monkeypatch.setattr(tape, "_TAPES", {})
    seen = []

    def fake_launch(grid, kernel, args, stream=None):
        (pair,), out = args
        seen.append(pair)
        out.copy_(pair[0] + pair[1])
    monkeypatch.setattr(launch_module, "launch", fake_launch)

    def fn(a, b):
        out = torch.empty_like(a)
        return [launch_module.run(launch_module.Plan((1,), "k", (((a, b),), out), (out,)))[0]]

    for scale in (1.0, 2.0, 3.0):
        a, b = torch.full((3,), scale), torch.full((3,), 10.0)
        got, = _record(fn, a, b)
        assert torch.equal(got, a + b) and seen[-1][0] is a
    assert isinstance(tape._TAPES[("test", "fn")], tape.Tape)


def test_an_operator_that_returns_nothing_is_kept(monkeypatch):
    """An operator whose effect is not an output (a device-side check) is replayed, not dropped
    as unread."""
    monkeypatch.setattr(tape, "_TAPES", {})

    def checked(a):
        torch._assert_async((a > 0).all())
        return [a * 2]

    _record(checked, torch.ones(2))
    _record(checked, torch.ones(2))
    with pytest.raises(RuntimeError):
        _record(checked, -torch.ones(2))


@pytest.mark.gpu
def test_taped_training_steps_on_gpu_equal_untaped_ones(tape_runs, monkeypatch):
    """On the GPU (kernels launched on raw stream handles): taped steps bitwise the untaped ones,
    and a replayed step's peak memory no higher than the untaped step's."""
    kw = make_problem(batch=2, seqlen=512, nheads=8, headdim=64, ngroups=1, dstate=128, D="1d",
                      dt_bias=True, dtype=torch.bfloat16, seed=8, device="cuda")
    steps = [(kw, 1), (_shifted(kw, 0.25), 2), (_shifted(kw, -0.5), 3)]

    def peak(k, s):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = _step(k, s, chunk_size=128, device="cuda")
        torch.cuda.synchronize()
        return got, torch.cuda.max_memory_allocated() - base
    taped = [peak(k, s) for k, s in steps]
    assert tape_runs.count("backward") == 2
    _untaped(monkeypatch)
    for (k, s), (got, taped_peak) in zip(steps, taped):
        want, untaped_peak = peak(k, s)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert taped[-1][1] <= untaped_peak


def test_owned_inputs_are_freed_after_their_last_reader(monkeypatch):
    """A replay handed its inputs (``owned=True``) empties the list and holds each input until
    its last reader, and one no step reads not at all (the backward hands its kept
    intermediates over so, and may leave them unread: ``ops.backward._kept_matches``). Seen
    from the operators the replay dispatches: which inputs are still alive at each."""
    import weakref
    from torch.utils._python_dispatch import TorchDispatchMode
    monkeypatch.setattr(tape, "_TAPES", {})

    def fn(handed):                                 # reads a, then b; never c
        a, b, _ = handed
        handed.clear()
        return (torch.mul(a, 2) + torch.mul(b, 3),)

    def call(inputs):
        return tape.taped(("test", "owned"), None, fn, inputs, owned=True)

    call([torch.ones(4), torch.ones(4), torch.ones(4)])              # recorded
    inputs = [torch.full((4,), 2.0), torch.full((4,), 5.0), torch.full((4,), 7.0)]
    refs = [weakref.ref(t) for t in inputs]
    alive = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            alive.append((func.__name__, [r() is not None for r in refs]))
            return func(*args, **(kwargs or {}))

    with Probe():
        got, = call(inputs)
    assert inputs == [] and torch.equal(got, torch.full((4,), 19.0))
    assert [name for name, _ in alive] == ["mul.Tensor", "mul.Tensor", "add.Tensor"]
    # a alive for its multiplication, b for its own, c never once the replay runs
    assert [flags for _, flags in alive] == [[True, True, False], [False, True, False],
                                            [False, False, False]]
    with pytest.raises(TypeError, match="owned inputs must be a list"):
        call(tuple(inputs))
