"""The backward pass through the backward kernels (ops/backward.py), as autograd reaches it:
``loss.backward()`` through ``mamba_chunk_scan_combined`` with backend="interpret" (CPU) or
"cutile" (``gpu`` marker).

Expected gradients come from autograd through the float64 token-by-token recurrence
(``reference.sequential.ssd_sequential``), never from the code under test. Every test spies on the
launches (``ops.runtime.launch.launch``) and disables the PyTorch backward (``ssd_chunked_backward``
raises), so a gradient can only come from the kernels; outputs are NaN-poisoned first
(``ops.forward.POISON_OUTPUTS``), so an element a kernel misses fails.

The loss weights the output with fixed random weights and adds the final state's square sum, so
both output gradients (dout, dfinal) are non-zero.

Tolerances, relative in norm:
  float32 inputs   float32 kernels (forward recompute and backward) against float64: observed
                   <= 2.5e-6 (dA and ddt_bias, sums over every token; ~3e-7 elsewhere); bound
                   2e-5, float32's tolerance of the forward (tests/api/test_api.py).
  bfloat16 inputs  x, B, C, z in bf16 (dt, A, D, dt_bias, initial states float32), against float64
                   autograd at the same (bf16-valued) inputs: the forward and backward products
                   take bf16 operands (8 significant bits), the entry states are stored in bf16,
                   dy is rounded to bf16 for the kernels, and the gradients of bf16 inputs are
                   returned in bf16; observed <= 4e-3; bound 1e-2, the forward's bf16 bound.
  bf16 states      float32 inputs, entry states stored in bf16 (state_dtype): the forward's own
                   rounding of the states, seen by dC and dz: observed 3e-4; bound 1e-3.
"""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree
import torch.utils._python_dispatch

import ops.forward
import ops.runtime.launch
from ops.runtime import tape
import reference.backward
from ops import mamba_chunk_scan_combined
from ops.runtime.cutile_internals import kernel_function
from reference.problems import make_problem
from reference.sequential import ssd_sequential
from reference.validate import rel_err

LEAVES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
# dt_limit clamps ~10% of the processed steps from below and ~9% from above at these inputs.
OPTIONS = dict(dt_softplus=True, dt_limit=(0.2, 0.9))
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
# By default bwd_compute_out runs the pair kernel, then the token work in two launches (SPLIT_DX);
# bwd_chunk_states' work is fused into the first of them (FUSE_STATES), and dentry's into the
# pass over the states (FUSE_ENTRY, ops.backward.BACKWARD_DEFAULTS)
BACKWARD_KERNELS = {"bwd_pairs_kernel", "bwd_token_states_kernel", "bwd_token_dx_kernel",
                    "bwd_pass_state_kernel", "bwd_chunk_cumsum_kernel"}
FORWARD_KERNELS = {"chunk_cumsum_kernel", "fwd_pass_state_kernel"}


@pytest.fixture
def launched(monkeypatch):
    """The names of the kernels launched during a test; the PyTorch backward disabled; every
    kernel output NaN-filled before it is written."""
    names = []
    real = ops.runtime.launch.launch

    def spy(grid, kernel, args, stream=None):
        names.append(kernel_function(kernel).__name__)
        return real(grid, kernel, args, stream)

    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch backward ran instead of the kernels")

    monkeypatch.setattr(ops.runtime.launch, "launch", spy)
    monkeypatch.setattr(reference.backward, "ssd_chunked_backward", refuse)
    monkeypatch.setattr(ops.forward, "POISON_OUTPUTS", True)
    return names


def problem(dtype=torch.float32, batch=2, seqlen=80, D="2d", seq=None, device="cpu", **kw):
    return make_problem(**{**dict(batch=batch, seqlen=seqlen, nheads=4, headdim=16, ngroups=2,
                                  dstate=16, D=D, seed=1, seq_boundaries=seq), **kw},
                        dtype=dtype, device=device)


def weights(kw):
    return torch.randn(kw["x"].shape, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(3)).to(kw["x"].device)


def gradients(fn, kw, leaves=LEAVES, loss="both"):
    """Gradients of a loss of (out, final_states) for the inputs named in ``leaves``: "both"
    weights out with fixed random weights and adds final's square sum; "sum" is out.sum() (its
    gradient an expanded tensor of ones); "final" reads only the final state (out unused)."""
    inputs = {k: (v.detach().clone().requires_grad_(k in leaves) if v.is_floating_point() else v)
              for k, v in kw.items()}
    out, final = fn(inputs)
    value = {"both": (out * weights(kw).to(out.dtype)).sum() + final.square().sum(),
             "sum": out.sum(), "final": final.square().sum()}[loss]
    value.backward()
    return {k: inputs[k].grad for k in leaves}


def kernels(backend="interpret", **extra):
    return lambda i: mamba_chunk_scan_combined(**i, chunk_size=32, **OPTIONS, **extra,
                                               return_final_states=True, backend=backend)


def recurrence(i):
    return ssd_sequential(**i, **OPTIONS, return_final_states=True)


def float64(kw):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in kw.items()}


def assert_close(ours, expected, inputs, tol):
    for name, g in ours.items():
        assert g is not None and g.dtype == inputs[name].dtype, name
        if expected[name] is None:           # the loss does not reach it (D, z without out)
            assert not g.any(), name
        else:
            assert rel_err(g, expected[name]) < tol, (name, rel_err(g, expected[name]))


# float32 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("D, seq", [("1d", None), ("2d", [20, 64])],
                         ids=["D-1d", "D-2d-packed-at-and-inside-chunks"])
def test_every_gradient_equals_the_recurrences(launched, D, seq):
    kw = problem(D=D, seq=seq)
    ours = gradients(kernels(), kw)
    assert BACKWARD_KERNELS <= set(launched)
    expected = gradients(recurrence, float64(kw))
    assert_close(ours, expected, kw, TOL[torch.float32])
    # Where the clamp bound the processed step, dt and dt_bias get nothing through it (a margin
    # keeps float32's and float64's rounding on one side of the bound).
    soft = F.softplus(kw["dt"].double() + kw["dt_bias"].double())
    lo, hi = OPTIONS["dt_limit"]
    clamped = (soft < lo - 1e-4) | (soft > hi + 1e-4)
    assert clamped.float().mean() > 0.1
    inside = (soft > lo + 1e-4) & (soft < hi - 1e-4)
    assert (ours["dt"][clamped] == 0).all() and (ours["dt"][inside] != 0).all()


def test_bitwise_reproducible(launched):
    kw = problem(seq=[20, 64])
    first = gradients(kernels(), kw)
    second = gradients(kernels(), kw)
    for name in LEAVES:
        assert torch.equal(first[name], second[name]), name


def test_cu_seqlens_gives_seq_idx_gradients(launched):
    """cu_seqlens alone (the backward derives seq_idx from it, as the forward does) gives the
    gradients of the same packing given as seq_idx, bitwise, and the recurrence's."""
    kw = problem(batch=1, seq=[20, 64])
    seq_idx = kw.pop("seq_idx")
    with_ids = gradients(kernels(seq_idx=seq_idx), kw)
    bounds = torch.tensor([0, 20, 64, 80], dtype=torch.int32)
    with_bounds = gradients(kernels(cu_seqlens=bounds), kw)
    for name in LEAVES:
        assert torch.equal(with_ids[name], with_bounds[name]), name
    expected = gradients(lambda i: recurrence({**i, "seq_idx": seq_idx}), float64(kw))
    assert_close(with_bounds, expected, kw, TOL[torch.float32])


@pytest.mark.parametrize("loss", ["sum", "final"], ids=["expanded-dout", "out-unused"])
def test_either_output_alone(launched, loss):
    """out.sum() (autograd passes an expanded tensor of ones as dout) and a loss of the final
    state alone (dout materialised as zeros; D and z get zero gradients, where autograd through
    the recurrence gives none)."""
    kw = problem(seq=[20, 64])
    ours = gradients(kernels(), kw, loss=loss)
    expected = gradients(recurrence, float64(kw), loss=loss)
    assert_close(ours, expected, kw, TOL[torch.float32])


def test_only_the_wanted_gradients_are_computed(launched):
    """D and z alone: their gradients, and no backward kernel; D alone needs no kernel at all
    beyond the forward's own launches (dD reads dout, z and x only)."""
    kw = problem(seq=[20, 64])
    ours = gradients(kernels(), kw, leaves=("D", "z"))
    assert not BACKWARD_KERNELS & set(launched)
    expected = gradients(recurrence, float64(kw), leaves=("D", "z"))
    assert_close(ours, expected, kw, TOL[torch.float32])
    D = kw["D"].clone().requires_grad_(True)
    out, final = kernels()({**kw, "D": D})
    forward_launches = len(launched)
    ((out * weights(kw)).sum() + final.square().sum()).backward()
    assert len(launched) == forward_launches
    assert rel_err(D.grad, expected["D"]) < TOL[torch.float32]


# bfloat16 -----------------------------------------------------------------------------------------

def test_bfloat16_inputs(launched):
    kw = problem(torch.bfloat16, seq=[20, 64])
    ours = gradients(kernels(), kw)
    assert BACKWARD_KERNELS <= set(launched)
    expected = gradients(recurrence, float64(kw))
    assert_close(ours, expected, kw, TOL[torch.bfloat16])


def test_bfloat16_entry_states_of_float32_inputs(launched):
    """The stored states (bf16) are widened exactly to float32 for the backward kernels, which
    take float32 states with float32 inputs."""
    kw = problem(seq=[20, 64])
    ours = gradients(kernels(state_dtype=torch.bfloat16), kw)
    expected = gradients(recurrence, float64(kw))
    assert_close(ours, expected, kw, 1e-3)


# GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype, chunk", [(torch.float32, 256), (torch.bfloat16, 256),
                                          (torch.bfloat16, 128)],
                         ids=["fp32", "bf16", "bf16-chunk128"])
def test_on_gpu(launched, dtype, chunk):
    """The same through the compiled kernels: batch 2 x 512 tokens (three packed sequences,
    one boundary inside a chunk), 8 heads of 64 x 64, chunk 256 (Mamba-2's own; and 128, where
    the pass over the states forms each chunk's product in one piece, ``walk_config``),
    against autograd through the float64 recurrence on the GPU. Bounds twice the CPU ones'
    margin (float32 1e-4, bf16 2e-2): the sums run over 256-token chunks and 64-wide states,
    eight times the CPU shapes' chunk."""
    kw = problem(dtype, batch=2, seqlen=512, nheads=8, headdim=64, dstate=64, seq=[100, 256],
                 device="cuda")
    fn = lambda i: mamba_chunk_scan_combined(**i, chunk_size=chunk, **OPTIONS,
                                             return_final_states=True, backend="cutile")
    ours = gradients(fn, kw)
    assert BACKWARD_KERNELS <= set(launched)
    expected = gradients(recurrence, float64(kw))
    assert_close(ours, expected, kw, 1e-4 if dtype == torch.float32 else 2e-2)
    again = gradients(fn, kw)
    for name in LEAVES:
        assert torch.equal(ours[name], again[name]), name


# Configs by kernel name ---------------------------------------------------------------------------

def test_backward_kernels_take_configs_by_name(launched):
    """``kernel_backward``'s configs reach each backward kernel: other tiles, head splits and
    hints than the defaults, the chunk states' gradients in their own kernel
    (``FUSE_STATES=False``: bwd_chunk_states then runs) and C B^T from memory
    (``SCORES_IN_MEMORY`` without the pair kernel: chunk_scores runs first) and the pair kernel's
    heads in other splits, give the default's gradients (float32:
    other tile and head splits sum dB, d dA[last], dA and ddt_bias in another order, a few ulps:
    1e-5). An unknown kernel's name is refused."""
    from ops.backward import kernel_backward
    kw = problem(seq=[20, 64])
    dout = weights(kw).float()
    args = (dout, None, kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 32)
    opts = dict(D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"], initial_states=kw["initial_states"],
                seq_idx=kw["seq_idx"], **OPTIONS)
    want = kernel_backward(*args, **opts)
    assert "bwd_chunk_states_kernel" not in launched and "bwd_pairs_kernel" in launched
    configs = {"bwd_compute_out": dict(BLOCK_T=16, HEADS_PER_BLOCK=1, FUSE_STATES=False,
                                       SCORES_IN_MEMORY=True, PAIRS=False),
               "bwd_pass_state": dict(BLOCK_P=16, BLOCK_N=16, LOAD_LAT=8),
               "bwd_chunk_states": dict(BLOCK_T=16, HEADS_PER_BLOCK=1, LOAD_LAT=8),
               "bwd_chunk_cumsum": dict(BLOCK_H=2, STORE_LAT=8)}
    got = kernel_backward(*args, **opts, configs=configs)
    assert {"bwd_chunk_states_kernel", "chunk_scores_kernel"} <= set(launched)
    assert set(got) == set(want)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-5, name
    launched.clear()
    pairs = {"bwd_compute_out": dict(BLOCK_T=16, PAIR_HEADS_PER_BLOCK=1)}
    got = kernel_backward(*args, **opts, configs=pairs)
    assert "bwd_pairs_kernel" in launched and "chunk_scores_kernel" not in launched
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-5, name
    launched.clear()
    got = kernel_backward(*args, **opts, configs={"bwd_compute_out": dict(SPLIT_DX=False)})
    assert {"bwd_pairs_kernel", "bwd_compute_out_kernel"} <= set(launched)
    assert not {"bwd_token_states_kernel", "bwd_token_dx_kernel"} & set(launched)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-5, name
    launched.clear()
    got = kernel_backward(*args, **opts, configs={"bwd_compute_out": dict(FUSE_STATES=False)})
    assert {"bwd_token_states_kernel", "bwd_token_dx_kernel", "bwd_chunk_states_kernel"} <= set(
        launched)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-5, name
    with pytest.raises(ValueError, match="unknown config keys"):
        kernel_backward(*args, **opts, configs={"bwd_chunk_states": dict(BLOCK_M=16)})
    with pytest.raises(ValueError, match="unknown kernels"):
        kernel_backward(*args, **opts, configs={"bwd_chunk_state": {}})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pass_forming_dentry_itself_gives_the_same_gradients(launched, dtype):
    """The pass' FUSE_ENTRY (dentry formed in the walk, no entry launch: the default) against
    compute_out's entry launch then the walk reading its dentry (FUSE_ENTRY=False): the same
    products over the same token tiles, so the same gradients up to the float32 sums' order
    inside a product (1e-6), with packed sequences, initial states, z and a ragged end, at the
    default token tile and at 16, and with the walk's other keys (``walk_space``: the whole
    chunk in one product, its loads' hint, the carried gradient as its accumulator, and d a[c]'s
    partials per row, which bwd_chunk_cumsum then sums: 16 a chunk here, one 16 x 16 tile). A
    config given for the pass without FUSE_ENTRY keeps it."""
    from ops.backward import kernel_backward
    # A sequence starting at token 40, inside chunk 1: chunk 0's state carries into chunk 1's
    # first tokens. A twentieth of the usual A: a chunk's decay is then e^-0.3 .. e^-3, not
    # e^-60, so the pass' term of dA at chunk 0's end counts in dA and ddt.
    kw = problem(dtype, seq=[40], seqlen=77)
    kw["A"] = kw["A"] / 20
    dout = weights(kw).to(dtype)
    args = (dout, None, kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 32)
    opts = dict(D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"], initial_states=kw["initial_states"],
                seq_idx=kw["seq_idx"], **OPTIONS)
    want = kernel_backward(*args, **opts, configs={"bwd_pass_state": dict(FUSE_ENTRY=False)})
    assert "bwd_entry_kernel" in launched
    together = dict(ENTRY_BLOCK_T=32, ENTRY_LAT=8, CARRY_ACC=True, ROW_PARTS=True)
    for config in (None, dict(ENTRY_BLOCK_T=16), together):
        launched.clear()
        got = kernel_backward(*args, **opts, configs={"bwd_pass_state": config})
        assert "bwd_entry_kernel" not in launched and "bwd_pass_state_kernel" in launched
        assert set(got) == set(want)
        for name in want:
            assert rel_err(got[name], want[name]) < 1e-6, name


# Memory ---------------------------------------------------------------------------------------

class LiveTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of the storages created (by any op) while it is active and still referenced by
    a tensor, and their largest total: the host-visible allocations, as a GPU's caching
    allocator sees them (the interpreter's own tile temporaries, made while ``paused``, are left
    out: a GPU kernel allocates nothing). Storages of the op's own inputs (views, in-place ops
    of tensors made before) are not new."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak, self.paused, self.at_peak = {}, 0, 0, False, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            leaves = lambda v: [t for t in torch.utils._pytree.tree_leaves(v)
                                if isinstance(t, torch.Tensor)]
            inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs))}
            for t in leaves(out):
                self._track(t, inputs)
        return out

    @classmethod
    def around_launches(cls, monkeypatch):
        """A tracker paused during every ``ops.runtime.launch.launch`` (the interpreter's temporaries).
        A replayed inference call (``ops.runtime.replay``) launches through the interpreter directly
        and is not paused: count training steps (a replayed step's tape launches through
        ``launch`` on a CPU) or the backward alone."""
        tracker, real = cls(), ops.runtime.launch.launch

        def paused(*args, **kwargs):
            tracker.paused = True
            try:
                return real(*args, **kwargs)
            finally:
                tracker.paused = False

        monkeypatch.setattr(ops.runtime.launch, "launch", paused)
        return tracker

    def _track(self, t, inputs):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or (key in inputs and key not in self.live):
            return
        if key not in self.live:
            self.live[key] = [storage.nbytes(), 0, tuple(t.shape), t.dtype]
            self.current += storage.nbytes()
            if self.current > self.peak:
                self.peak = self.current
                self.at_peak = {k: (v[2], v[3], v[0]) for k, v in self.live.items()}
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]


UNFUSED = {"bwd_compute_out": dict(FUSE_STATES=False)}
ENTRY_LAUNCH = {"bwd_pass_state": dict(FUSE_ENTRY=False)}
PAIRS = {"bwd_compute_out": dict(PAIRS=True, BLOCK_T=16)}
SPLIT_DX = {"bwd_compute_out": dict(SPLIT_DX=True)}
SLICES = {"bwd_compute_out": dict(SPLIT_DX=True, STATES_SLICES=2)}   # dstate 32: two of 16


@pytest.mark.parametrize("z, initial_states, dstate, ngroups, chunk, configs", [
    (False, False, 32, 2, 64, None), (False, True, 32, 2, 64, None), (True, False, 32, 2, 64, None),
    (True, True, 32, 2, 64, None), (False, False, 128, 8, 64, None),
    (False, False, 32, 2, 64, UNFUSED), (True, True, 32, 2, 64, UNFUSED),
    (False, False, 64, 1, 64, UNFUSED), (False, False, 64, 1, 16, ENTRY_LAUNCH),
    (False, False, 64, 1, 16, None), (True, True, 32, 2, 64, ENTRY_LAUNCH),
    (False, False, 32, 1, 64, PAIRS), (True, True, 32, 2, 64, SPLIT_DX),
    (True, True, 32, 2, 64, SLICES)],
    ids=["no-z", "no-z-initial", "z", "z-initial", "no-z-scores-in-memory-g8", "no-z-unfused",
         "z-initial-unfused", "unfused-g1-chunk-states-peak", "chunk16-entry-launch-pass-peak",
         "chunk16-entry-in-pass", "z-initial-entry-launch", "pairs-g1", "z-initial-split-dx",
         "z-initial-states-slices"])
def test_peak_memory_follows_the_accounting(monkeypatch, z, initial_states, dstate, ngroups,
                                            chunk, configs):
    """The tensors alive at once in one backward (bf16, 4 chunks of 64, 8 heads of 32 x dstate,
    D, dt_bias) never exceed ``ops.backward.memory_accounting``'s peak, which they reach within 10%
    (the accounting is not loose). The gate's slices are made small so that the full-size
    tensors, not the slices' temporaries, are what is measured: with slices of a whole batch
    element this CPU count is not exact (storages freed and made again at one address), and the
    GPU test below measures the allocator itself. The pair kernel (the default) stores C B^T,
    its d(C B^T) partials and its sums of dG G for the token kernel, which all count in the
    token kernel's step; at dstate 128 with eight heads in eight groups that step is the peak. ``FUSE_STATES=False``: the token kernel's float32 dx, then
    bwd_chunk_states' launch (with one group of eight heads its dB partials make its step the
    peak), counted as the accounting does for that config. At 16-token chunks the states
    outweigh the tokens: with compute_out's entry launch (``FUSE_ENTRY=False``) the pass over
    them is the peak, with dentry; with the pass forming dentry itself (the default) there is
    no dentry, and the token kernel's step is the peak."""
    import ops.backward as bwd
    monkeypatch.setattr(bwd, "SLICE_ELEMENTS", 1024)
    shape = dict(batch=2, seqlen=256, nheads=8, headdim=32, ngroups=ngroups, dstate=dstate,
                 chunk_size=chunk)
    kw = make_problem(**{k: v for k, v in shape.items() if k != "chunk_size"}, D="1d", z=z,
                      initial_states=initial_states, seed=1, dtype=torch.bfloat16)
    dout = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tracker = LiveTensors.around_launches(monkeypatch)
    gc.collect()       # earlier tests' garbage, collected mid-count, would free reused addresses
    with tracker:
        grads = bwd.kernel_backward(dout, None, kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"],
                                    chunk, D=kw["D"], z=kw.get("z"), dt_bias=kw["dt_bias"],
                                    initial_states=kw.get("initial_states"),
                                    input_dtypes=True, configs=configs, **OPTIONS)
    assert grads["dx"].dtype == torch.bfloat16 and grads["dB"].shape == kw["B"].shape
    step, bound = bwd.memory_accounting(**shape, dtype=torch.bfloat16, z=z,
                                        initial_states=initial_states, configs=configs)["peak"]
    described = sorted(tracker.at_peak.values(), key=lambda v: -v[2])
    assert tracker.peak <= bound, (tracker.peak, bound, step, described)
    assert tracker.peak >= 0.9 * bound, (tracker.peak, bound, step, described)


def trainable(kw):
    """A problem's tensors as a training step's leaves: the float ones detached, requiring
    gradients where the op gives one (not seq_idx)."""
    return {k: (v.detach().requires_grad_(k in ("x", "dt", "A", "B", "C", "D", "dt_bias"))
                if v.is_floating_point() else v) for k, v in kw.items()}


@pytest.mark.parametrize("taped", ["recorded", "replayed"])
def test_a_training_steps_forward_leaves_only_its_output_to_the_backward(monkeypatch,
                                                                         collector_off, taped):
    """A whole step through autograd, as training runs it, on its second call (the forward's
    plans then re-used, ``ops.runtime.launch.PlanTemplate.bind``), its host work recorded on
    a tape or replayed from one (``ops.runtime.tape``): the tensors alive at once are the
    backward's own peak, measured alone on the same inputs (recomputing the intermediates),
    plus the forward's output, and nothing more. The forward keeps its intermediates
    (``ops.backward.keeps``) and hands them over: if the autograd node or the tape held them
    through the backward, the entry states would be alive through the dx launch, past the
    backward's own peak (at this shape and config: one split of each group's heads, so that the
    head splits' partials, gone before the dx launch, weigh less than dx, which comes after).
    And that stays under ``memory_accounting``'s peak plus the output. With the garbage
    collector off, so that a reference cycle holding the forward's entry and final states (as
    ``bind`` once made) counts where a GPU's step would feel it, through the backward's peak.
    A recording tape keeps the launches' one-element stand-ins (``unread_stand_in``, 4 bytes
    each) from the launch that made them: a few bytes are allowed for them."""
    import ops.backward as bwd
    monkeypatch.setattr(bwd, "SLICE_ELEMENTS", 1024)
    shape = dict(batch=2, seqlen=256, nheads=8, headdim=64, ngroups=2, dstate=32)
    config = {"HEADS_PER_BLOCK": 4, "PAIR_HEADS_PER_BLOCK": 4}
    chosen = bwd.tuned_config
    monkeypatch.setattr(bwd, "tuned_config", lambda name, *args: (
        config if name == "bwd_compute_out" else chosen(name, *args)))
    kw = make_problem(**shape, D="1d", z=False, initial_states=False, seed=1,
                      dtype=torch.bfloat16)
    leaves = trainable(kw)
    dout = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def step():
        for t in leaves.values():
            t.grad = None
        out = mamba_chunk_scan_combined(**leaves, chunk_size=64, backend="interpret", **OPTIONS)
        out.backward(dout)

    def backward_alone():
        return bwd.kernel_backward(dout, None, kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 64,
                                   D=kw["D"], dt_bias=kw["dt_bias"], input_dtypes=True, **OPTIONS)

    step()                                             # plans built: the next step re-uses them
    backward_alone()
    if taped == "recorded":
        tape.clear()                                   # the measured step records afresh
    alone, whole = (LiveTensors.around_launches(monkeypatch) for _ in range(2))
    with collector_off():
        with alone:
            backward_alone()
        with whole:
            step()
    out_bytes = kw["x"].numel() * kw["x"].element_size()
    described = sorted(whole.at_peak.values(), key=lambda v: -v[2])
    stand_ins = 64
    assert whole.peak <= alone.peak + out_bytes + stand_ins, (whole.peak, alone.peak + out_bytes,
                                                              described)
    _, bound = bwd.memory_accounting(**shape, chunk_size=64, dtype=torch.bfloat16,
                                     configs={"bwd_compute_out": config})["peak"]
    assert 0.9 * (out_bytes + bound) <= whole.peak <= out_bytes + bound + stand_ins


def test_the_accounting_of_kept_intermediates():
    """With the forward's intermediates kept (``kept=True``), handed over to the backward (not
    held by the autograd node), every step holds what it holds when the backward recomputes
    them, but for the recompute's final state, which is not made: the entry states are gone
    after compute_out's states launch either way, and the peak is the same. With SPLIT_DX (the
    default) the peak is compute_out's states launch, and dx is allocated for the dx launch
    only after the entry states, d(C B^T)'s partials and dB's and dC's partials are gone."""
    import ops.backward as bwd
    shape = dict(batch=8, seqlen=2048, nheads=80, headdim=64, ngroups=1, dstate=128,
                 chunk_size=128)
    made, kept = bwd.memory_accounting(**shape), bwd.memory_accounting(**shape, kept=True)
    assert "final state" in made["recompute"] and "final state" not in kept["recompute"]
    assert {k: v for k, v in kept.items() if k != "recompute"} == {
        k: v for k, v in made.items() if k != "recompute"}
    assert kept["peak"] == made["peak"] and made["peak"][0] == "compute_out's states launch"
    states, dx = made["compute_out's states launch"], made["compute_out's dx launch"]
    assert "entry states" in states and "dx (x's dtype)" not in states
    assert not {"entry states", "d(C B^T) partials", "dB, dC partials"} & dx.keys()
    assert "dx (x's dtype)" in dx
    # a 1-d D's partials of dD are headdim times smaller than a 2-d D's
    parts = lambda d: bwd.memory_accounting(**shape, D=d)["compute_out's dx launch"]["dD partials"]
    assert parts(2) == 64 * parts(1)


def test_the_walk_runs_walk_configs_keys_for_the_chunk_it_computes_at(monkeypatch):
    """``kernel_backward`` runs the pass over the states with ``walk_config``'s keys for the
    chunk it is given (the one the kernels compute at): at dstate 64 and chunk 128 with bf16
    inputs each chunk's product in one piece, the config ``chain_space`` names the chain's own
    (so that a table or a search that finds it is not taken for another); 64-token tiles at
    chunk 64 and with float32 inputs. The one-piece walk's gradients equal the 64-token tiles'
    to bf16 rounding (the product's sums in another order)."""
    import ops.backward as bwd
    seen = []
    real = bwd.bwd_pass_state_plan
    monkeypatch.setattr(bwd, "bwd_pass_state_plan",
                        lambda *a, **k: seen.append(k["config"]) or real(*a, **k))
    for dtype, chunk, block_t in ((torch.bfloat16, 128, 128), (torch.bfloat16, 64, 64),
                                  (torch.float32, 128, 64)):
        kw = problem(dtype, batch=1, seqlen=160, nheads=2, ngroups=1, dstate=64)
        args = (weights(kw).to(dtype), None, kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], chunk)
        opts = dict(D=kw["D"], dt_bias=kw["dt_bias"], **OPTIONS)
        got = bwd.kernel_backward(*args, **opts)
        assert seen[-1]["ENTRY_BLOCK_T"] == block_t and seen[-1]["FUSE_ENTRY"], (dtype, chunk)
        own, _ = bwd.chain_space("bwd_pass_state", dict(
            batch=1, seqlen=160, nheads=2, headdim=16, ngroups=1, dstate=64, chunk_size=chunk,
            dtype=dtype, states_dtype=dtype))
        assert seen[-1] == own
        if block_t == 128:
            tiles = bwd.kernel_backward(*args, **opts,
                                        configs={"bwd_pass_state": {"ENTRY_BLOCK_T": 64}})
            assert seen[-1]["ENTRY_BLOCK_T"] == 64
            for name in got:
                assert rel_err(got[name].float(), tiles[name].float()) < 1e-2, name


def test_the_accounting_counts_the_pass_partials_the_plan_makes():
    """The pass' partials of d dA[last] as ``memory_accounting`` counts them are the bytes of
    the buffer ``bwd_pass_state_plan`` allocates, one a state tile by default and one a row of
    it with ROW_PARTS (64 x 32 tiles of a 64 x 128 state: 4 tiles, 256 rows a chunk)."""
    import ops.backward as bwd
    from ops.kernels.backward.bwd_pass_state import bwd_pass_state_plan
    shape = dict(batch=2, seqlen=2048, nheads=8, headdim=64, ngroups=1, dstate=128,
                 chunk_size=128)
    meta = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")
    for config in ({}, {"ROW_PARTS": True, "BLOCK_N": 32}, {"ROW_PARTS": True}):
        counted = bwd.memory_accounting(**shape, configs={"bwd_pass_state": config})
        config = bwd.pass_config({"bwd_pass_state": config}, headdim=64, dstate=128,
                                 chunk_size=128, dtype=torch.bfloat16)
        plan = bwd_pass_state_plan(None, None, meta(2, 16, 8, 64, 128),
                                   meta(2, 8, 16, 128, dt=torch.float32), None, config=config,
                                   ds_dtype=torch.bfloat16, dy=meta(2, 2048, 8, 64),
                                   C=meta(2, 2048, 1, 128), with_dinitial=False)
        made = plan.outputs[1]
        assert counted["pass_state"]["d dA[last] partials"] == made.numel() * 4
        assert made.shape[-1] == {False: 2, True: 2 * 64}[config["ROW_PARTS"]] * (
            64 // config["BLOCK_N"])


@pytest.mark.gpu
def test_peak_memory_on_gpu():
    """One forward + backward (autograd, as a training step runs it) at batch 2 x 2K tokens, 16
    heads of 64 x 128, 1 group, bf16, a caller's chunk 256 (computed at 128 on an H200:
    ``ops/tuning/compute_chunk.py``), D, dt_bias, softplus: the memory allocated beyond the inputs and
    dout stays under the forward's output and its gradients (out, the gradients of x, B, C, dt
    in bf16) plus ``ops.backward.memory_accounting``'s peak at the chunk computed, plus 8 MiB
    for the allocator's rounding and the small tensors (before: dB per head, dx's float32
    partials, dy in float32: ~4x that)."""
    shape = dict(batch=2, seqlen=2048, nheads=16, headdim=64, ngroups=1, dstate=128)
    kw = make_problem(**shape, D="1d", z=False, initial_states=False, seed=1,
                      dtype=torch.bfloat16, device="cuda")
    leaves = trainable(kw)
    dout = torch.randn_like(kw["x"])

    def step():
        out = mamba_chunk_scan_combined(**leaves, chunk_size=256, dt_softplus=True,
                                        backend="cutile")
        out.backward(dout)

    step()                                           # compile and tune outside the measurement
    for t in leaves.values():
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    from ops.backward import memory_accounting
    from ops.tuning.compute_chunk import kernel_chunk
    chunk = kernel_chunk(256, kw["x"], kw["B"])      # 128 on an H200 (ops/tuning/compute_chunk.py)
    # the forward keeps its intermediates for the backward (ops.backward.keeps: bf16 states of
    # dstate 128 at chunk 128 take x's memory)
    _, backward = memory_accounting(**shape, chunk_size=chunk, dtype=torch.bfloat16,
                                    kept=shape["dstate"] <= chunk)["peak"]
    outputs = 2 * kw["x"].numel() * 2 + 2 * kw["B"].numel() * 2 + kw["dt"].numel() * 2
    bound = backward + outputs + 8 * 2**20
    assert peak <= bound, (peak / 2**20, bound / 2**20)
