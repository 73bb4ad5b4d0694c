"""The forward pass as a PyTorch custom operator, ``torch.ops.mamba2_cutile.ssd_forward``.

``torch.compile`` cannot trace into the kernels' launches (cuTile's launcher takes its own
stream objects, the interpreter is Python over tiles): to the compiler, the operator is one
opaque call whose outputs' shapes and dtypes its fake implementation gives. Everything that reads
a tensor's values (the seq_idx and cu_seqlens checks) runs inside it, so a compiled model has no
graph break there. ``ops.ssd_combined`` uses the operator when it is traced (its backward is
registered below); eager calls run its work, ``forward``, directly (the dispatch costs tens of
microseconds): through ``EagerAutograd`` when a gradient is needed, and a differentiable
reference call is plain PyTorch.

Outputs: ``out`` (b, L, h, p) in x's dtype, ``final_states`` (b, h, p, n) float32 (float64 for
float64 inputs), ``varlen_states`` (nseq, h, p, n) in the same dtype, or (0, h, p, n) when not
asked for.
"""
import sys
from typing import Optional

import torch

from ops.inputs import as_kernel_input, check_values
from ops.runtime import replay
from ops.runtime.tape import taped
from ops.tuning import autotune, compute_chunk
from ops.tuning.compute_chunk import kernel_chunk
from ops.varlen_states import varlen_states
from reference import chunked
from reference.backward import ssd_chunked_backward
from reference.common import compute_dtype

Tensor = torch.Tensor


def forward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, *, chunk_size,
            dt_softplus, dt_min, dt_max, with_varlen, state_dtype, backend, keep=False,
            placeholder=True):
    """The operator's work, callable directly: -> (out, final_states, varlen_states). Traced
    directly (a differentiable call under torch.compile), it skips the value checks, which
    would need the values at tracing. ``keep``: a training step's forward, which also returns
    the kernels' intermediates (dt_out, dA_cumsum, entry states) for the backward where
    ``ops.backward.keeps`` says so (three more results). ``placeholder``: without
    ``with_varlen``, varlen_states is an empty tensor, as the operator's schema needs (else
    None: one allocation fewer for an eager step)."""
    seq_idx = check_values(x, seq_idx, cu_seqlens, check=not torch.compiler.is_compiling())
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx = (
        as_kernel_input(t) for t in (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx))
    dt_limit = (dt_min, dt_max)
    if backend == "reference":
        cdt = compute_dtype(x, dt, A, B, C)
        dt_out, dA_cumsum = chunked.chunk_cumsum(dt.to(cdt), A.to(cdt), chunk_size, dt_bias,
                                                 dt_softplus, dt_limit)
        entry, final_states = chunked.fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx)
        out = chunked.compute_out(x, B, C, dt_out, dA_cumsum, entry, D, z, seq_idx).to(x.dtype)
        exp = torch.exp
    else:
        from ops.forward import kernel_forward        # cuda.tile: the reference runs without it
        # the chunk the kernels compute with: the caller's, or where the H200 measured another
        # faster, that one (the same function; ops/tuning/compute_chunk.py)
        out, final_states, (dt_out, dA_cumsum, entry) = kernel_forward(
            x, dt, A, B, C, kernel_chunk(chunk_size, x, B), D=D, z=z, dt_bias=dt_bias,
            initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
            dt_limit=dt_limit, states_dtype=state_dtype or x.dtype, return_intermediates=True)
        exp = torch.exp2                     # the kernels' cumsum is in log2 units
    if with_varlen:
        varlen = varlen_states(x, B, dt_out, dA_cumsum, entry, cu_seqlens, seq_idx, exp=exp)
    elif placeholder:
        varlen = final_states.new_empty((0,) + tuple(final_states.shape[1:]))
    else:
        varlen = None
    sdt = states_result_dtype(x)
    results = (out, final_states.to(sdt), None if varlen is None else varlen.to(sdt))
    if keep and backend != "reference":
        from ops.backward import keeps
        if keeps(x, entry):
            return results + (dt_out, dA_cumsum, entry)
    return results


def states_result_dtype(x):
    """The dtype of the returned states: float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.custom_op("mamba2_cutile::ssd_forward", mutates_args=())
def ssd_forward(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                z: Optional[Tensor], dt_bias: Optional[Tensor], initial_states: Optional[Tensor],
                seq_idx: Optional[Tensor], cu_seqlens: Optional[Tensor], *, chunk_size: int,
                dt_softplus: bool, dt_min: float, dt_max: float, with_varlen: bool,
                state_dtype: Optional[torch.dtype], backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return forward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                   chunk_size=chunk_size, dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max,
                   with_varlen=with_varlen, state_dtype=state_dtype, backend=backend)


@ssd_forward.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, *, chunk_size,
      dt_softplus, dt_min, dt_max, with_varlen, state_dtype, backend):
    b, _, h, p = x.shape
    n = B.shape[3]
    sdt = states_result_dtype(x)
    nseq = cu_seqlens.shape[0] - 1 if with_varlen else 0
    return (x.new_empty(x.shape), x.new_empty((b, h, p, n), dtype=sdt),
            x.new_empty((nseq, h, p, n), dtype=sdt))


# Eager calls recorded once and replayed ---------------------------------------------------------
#
# Replay keys of eager calls made while a search may run (MAMBA2_CUTILE_AUTOTUNE=1), each with
# the tuner it ran under. A key's first call may search, launching every candidate, so it is not
# recorded; ops.forward memoises the answers per exact shape on that tuner, so from the key's
# second call on nothing is searched, and the call is recorded, then replayed, as in the table
# mode (a replayed call costs tens of microseconds of host time, a dispatched one hundreds).
_SEARCHED = {}


def replay_key(tensors, options):
    """(the key of an eager call on ``tensors`` with ``options`` (a tuple), the autotuner it was
    made under), or (None, None) where the call is not replayed (``ops.runtime.replay``: an
    inference call's launches; ``ops.runtime.tape``: a training step's forward and backward):
    it may search for configs (a key's first call in the search mode), or the outputs are
    poisoned (tests), or a torch.func transform wraps the tensors, or a tensor is traced, of a
    subclass or needs a gradient (``replay.call_key``). The autotuning mode and the compute chunk's
    (ops/tuning/compute_chunk.py) are part of the key: switching either changes the launches."""
    forward_module = sys.modules.get("ops.forward")    # None until a kernel backend has run
    if (forward_module is None or forward_module.POISON_OUTPUTS
            or torch._C._are_functorch_transforms_active()):  # wrapped tensors, no storage
        return None, None
    how = autotune.mode()                       # the configs a call takes depend on it
    # the chunk the kernels compute with depends on compute_chunk's mode, as the configs on `how`
    key = replay.call_key(tensors, options + (compute_chunk.mode(), how))
    tuner = autotune.tuner()
    if how == "search" and key is not None:
        try:
            first = _SEARCHED.get(key) is not tuner
        except TypeError:                       # an unhashable option: never replayed
            return None, None
        if first:
            _SEARCHED[key] = tuner
            return None, None
    return key, tuner


# Autograd ---------------------------------------------------------------------------------------
#
# The kernel backends' gradients come from the backward kernels (ops/backward.py: they recompute
# the forward's intermediates with the forward kernels, from the saved inputs), through their own
# opaque operator so that torch.compile traces this backward too. The reference backend's
# operator (traced or not) differentiates the chunked algorithm in plain PyTorch
# (reference/backward.py, float32, or float64 for float64 inputs).

def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.options = keyword_only_inputs
    # An output the loss does not use (final_states, most often) comes back as None, not as a
    # tensor of zeros (the size of the final states, alive through the backward's peak).
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dfinal, dvarlen):
    return _gradients(ctx, dout, dfinal, eager=False)


def _gradients(ctx, dout, dfinal, eager):
    """The gradients of the inputs ``ctx`` saved, and None for seq_idx and cu_seqlens: through
    the backward operator, or (``eager``) its work called directly."""
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens = ctx.saved_tensors
    # the forward's intermediates where an eager forward kept them (``EagerAutograd``), taken:
    # this backward frees them after their last reader; a second backward through a graph
    # retained (``retain_graph=True``) finds none and makes them again
    kept, ctx.kept = getattr(ctx, "kept", None) or [], None
    inputs = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    o = ctx.options
    # (varlen states with a gradient are refused before the forward: ops.ssd_combined)
    wanted = [t is not None and need for t, need in zip(inputs, ctx.needs_input_grad)]
    if o["backend"] == "reference":
        seq_idx = check_values(x, seq_idx, cu_seqlens, check=False)
        g = ssd_chunked_backward(dout, dfinal, x, dt, A, B, C, o["chunk_size"], D=D, z=z,
                                 dt_bias=dt_bias, initial_states=initial_states,
                                 seq_idx=seq_idx, dt_softplus=o["dt_softplus"],
                                 dt_limit=(o["dt_min"], o["dt_max"]))
        grads = [g.get("d" + name) for name in _GRAD_NAMES]
    else:
        # The operator takes the inputs as saved and prepares them as the forward does
        # (as_kernel_input, seq_idx from cu_seqlens, int32).
        from ops.backward import backward_op, backward_work   # cuda.tile, as kernel_forward
        args = (dout, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens)
        options = dict(chunk_size=o["chunk_size"], dt_softplus=o["dt_softplus"],
                       dt_min=o["dt_min"], dt_max=o["dt_max"], state_dtype=o["state_dtype"],
                       wanted=wanted)
        if not eager:
            grads = backward_op(*args, **options)
        else:
            # an eager backward's host work is taped (ops.runtime.tape), but with cu_seqlens,
            # whose values make the sequence ids
            key = stamp = None
            handed = [*args, *kept]             # the tape, then backward_work, empty it
            del kept
            if cu_seqlens is None:
                key, stamp = replay_key(handed, ("backward", tuple(o.items()), tuple(wanted)))
            grads = taped(key, stamp, lambda a: backward_work(
                *a[:len(args)], kept=_taken(a, len(args)), placeholders=False, **options),
                handed, owned=True)
    return tuple((g if g.dtype == t.dtype else g.to(t.dtype)) if want else None
                 for g, t, want in zip(grads, inputs, wanted, strict=True)) + (None, None)


def _taken(handed, n):
    """The items of the list ``handed`` after its first ``n``, as a list of their own (None if
    there are none), removed from ``handed``: the taker holds the only reference."""
    tail = handed[n:]
    del handed[n:]
    return tail or None


_GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


ssd_forward.register_autograd(_backward, setup_context=_setup_context)


def _eager_forward(inputs, keep):
    *tensors, options = inputs
    seq_idx, cu_seqlens = tensors[9:]
    key = stamp = None
    if seq_idx is None and cu_seqlens is None and not options["with_varlen"]:
        # no sequence ids to check: the call's host work is taped (ops.runtime.tape)
        key, stamp = replay_key(tensors, ("forward", tuple(options.items()), keep))
    return taped(key, stamp, lambda *t: forward(*t, **options, keep=keep, placeholder=False),
                 tensors)


def _save_inputs(ctx, inputs):
    """The inputs saved for the backward."""
    *tensors, ctx.options = inputs
    ctx.save_for_backward(*tensors)
    ctx.set_materialize_grads(False)      # as the operator's (_setup_context)


def _saved_tensors_hooked():
    """Whether saved-tensor hooks are in force (activation checkpointing, offloading to the
    host: ``torch.autograd.graph.saved_tensors_hooks``); where PyTorch cannot say, True."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


class EagerAutograd(torch.autograd.Function):
    """The operator's forward and backward for eager calls that need a gradient, without the
    custom operators' dispatch: the same work (``forward``, then ``ops.backward.backward_work``,
    the backward operator's), with less host time per training step (PERF_NOTES.md, "Eager
    training steps go through a plain torch.autograd.Function"); at small shapes the host, not
    the GPU, sets a step's time. It saves the same inputs and, where ``ops.backward.keeps``
    says so and no saved-tensor hooks are in force, holds the forward's intermediates
    (``forward``'s ``keep``) for the backward, which takes them from the node and frees each
    after its last reader (``_gradients``; ``ops.backward``, "Memory"). Traced
    calls (torch.compile) and tensor subclasses take the operator. ``options``: the operator's
    keyword arguments, as a dict.

    The forward takes ``ctx`` and saves the inputs itself: a Function with ``setup_context``
    has its arguments bound to ``forward``'s signature by ``inspect`` on every call (about
    13 us of host time on a CPU host), which only torch.func's transforms need; under one,
    ``mamba_chunk_scan_combined`` applies ``TransformableEagerAutograd`` instead (``use``)."""

    # forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, options)
    @staticmethod
    def forward(ctx, *inputs):
        # the intermediates are kept only for a backward that runs the kernels (a gradient of
        # x, dt, A, B, C, dt_bias or initial_states), and where the setting allows it
        from ops.backward import KERNEL_INPUT_POSITIONS, keeping     # cuda.tile, as the kernels
        # (not under saved-tensor hooks: what they do with saved tensors, drop them for a
        # checkpoint's recompute or move them to the host, would not reach these)
        needs = ctx.needs_input_grad
        keep = (any(needs[i] for i in KERNEL_INPUT_POSITIONS) and keeping()
                and not _saved_tensors_hooked())
        out, final_states, varlen_states, *kept = _eager_forward(inputs, keep)
        _save_inputs(ctx, inputs)
        # held by the node, not saved: the backward takes them (_gradients) and frees each
        # after its last reader (the entry states after bwd_compute_out's states launch)
        ctx.kept = kept
        return out, final_states, varlen_states

    @staticmethod
    @torch.autograd.function.once_differentiable     # as the operator: no double backward
    def backward(ctx, dout, dfinal, dvarlen):
        # traced by compiled autograd: through the opaque backward operator
        return _gradients(ctx, dout, dfinal, eager=not torch.compiler.is_compiling()) + (None,)

    @staticmethod
    def use():
        """The Function class for this call: ``TransformableEagerAutograd`` under a torch.func
        transform (which needs ``setup_context``), else this one."""
        if torch._C._are_functorch_transforms_active():
            return TransformableEagerAutograd
        return EagerAutograd


class TransformableEagerAutograd(torch.autograd.Function):
    """``EagerAutograd`` as torch.func's transforms need it: the forward without ``ctx``, the
    inputs saved by ``setup_context``."""

    # forward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, options),
    # taken as *inputs: apply binds the arguments to this signature on every call, much faster
    # for one starred parameter than for twelve
    @staticmethod
    def forward(*inputs):
        return _eager_forward(inputs, keep=False)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save_inputs(ctx, inputs)
    backward = staticmethod(EagerAutograd.backward)
