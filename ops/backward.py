"""The whole backward pass as kernel launches: the gradients of ``ops.forward.kernel_forward``.

The gradients flow back through the forward's steps in reverse (``reference/backward.py`` is
the specification, step by step, and names the same quantities):

    recompute          kernel_forward without D and z      -> y, dt_out, dA_cumsum, entry states
    gate and skip      out = (y + D x) * silu(z)           -> dy, dx (skip), dD, dz   (PyTorch,
                                                              elementwise, float32)
    (c) bwd_compute_out    dy -> dx, dB, dC (each summed over its group's heads), ddt_out,
                           ddA_cumsum, dentry                               (two launches)
    (b) bwd_pass_state     dentry, dfinal -> dS, ddA_cumsum at each chunk's last token,
                           dinitial                          (the chunks in reverse order)
        bwd_chunk_states   dS -> dx, dB per head, ddt_out, ddA_cumsum
    (a) bwd_chunk_cumsum   ddt_out, ddA_cumsum (the three steps' contributions summed)
                           -> ddt, dA, ddt_bias

and the host adds the contributions: dx = compute_out's + chunk_states' + the skip's; dB =
compute_out's + chunk_states' summed over each group's heads; dA and ddt_bias are the cumsum
kernel's per-chunk partials summed. Every sum runs in a fixed order (no atomics), so the
gradients are bitwise reproducible.

Saved and recomputed
    The operator saves only its inputs. The backward runs the three forward kernels once more,
    without D and z: their output is then the pre-gate y (the one forward value the gate's
    gradient dz needs; D x is added on the host), and their intermediates dt_out, dA_cumsum
    (log2 units, as the backward kernels read it) and the entry states (in the forward's state
    dtype, so the backward sees the values the forward's compute_out read). That costs one
    forward pass (three launches; compute_out's y is not read when z is None or needs no
    gradient), and no memory between the passes. When only D and z want gradients the backward
    kernels do not run; for D alone nothing is recomputed (dD reads dout, z and x).

The backward kernels return ddA_cumsum in natural-log units (from dA_cumsum in log2 units), so
their contributions add directly, and the cumsum kernel takes them so.

Inputs arrive from the operator (``backward_op`` below) as the forward's do: each tensor as
``ops.torch_op.as_kernel_input`` gives it, seq_idx int32. The backward kernels read x, B, C,
dt and the gradients contiguous (copied here where a view is passed). ``configs`` maps a forward
kernel's name (``ops.forward.KERNELS``) or "bwd_compute_out" (the one backward kernel with
configs: ``ops/bwd_compute_out.py``) to its config; a missing one takes the default.
"""
import math
from typing import Optional

import torch

from . import forward as forward_module
from .bwd_chunk_cumsum import bwd_chunk_cumsum
from .bwd_chunk_states import bwd_chunk_states
from .bwd_compute_out import bwd_compute_out
from .bwd_pass_state import bwd_pass_state
from .utils import as_int32

Tensor = torch.Tensor

# The inputs that have a gradient, in the operator's order, and those the four kernels give.
INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
KERNEL_INPUTS = ("x", "dt", "A", "B", "C", "dt_bias", "initial_states")
BACKWARD_CONFIGS = ("bwd_compute_out",)


def gate_and_skip_backward(dout, y, x, D=None, z=None, want_dD=True, want_dz=True):
    """out = (y + D x) * silu(z), in float32 -> (dy, dx from the skip or None, dD or None, dz
    or None), as ``reference.backward.gate_and_skip_backward``; y is read only for dz."""
    f32 = lambda t: None if t is None else t.float()
    dout, x, D, z = f32(dout), f32(x), f32(D), f32(z)
    dy, dz, dx, dD = dout, None, None, None
    D_full = None if D is None else (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        sig = torch.sigmoid(z)
        if want_dz:
            skip = y.float() if D is None else y.float() + x * D_full
            dz = dout * skip * sig * (1 + z * (1 - sig))                 # d silu(z) / dz
        dy = dout * z * sig
    if D is not None:
        if want_dD:
            dD = (dy * x).sum((0, 1, 3)) if D.dim() == 1 else (dy * x).sum((0, 1))
        dx = dy * D_full
    return dy, dx, dD, dz


def _check(dout, dfinal, x, B, configs, wanted, given):
    batch, _, nheads, headdim = x.shape
    if dout is not None and dout.shape != x.shape:
        raise ValueError(f"dout must have x's shape {tuple(x.shape)}, got {tuple(dout.shape)}")
    state_shape = (batch, nheads, headdim, B.shape[3])
    if dfinal is not None and tuple(dfinal.shape) != state_shape:
        raise ValueError(f"dfinal must be (batch, nheads, headdim, dstate) = {state_shape}, got "
                         f"{tuple(dfinal.shape)}")
    known = set(forward_module.KERNELS) | set(BACKWARD_CONFIGS)
    unknown = set(configs) - known
    if unknown:
        raise ValueError(f"configs for unknown kernels {sorted(unknown)}; expected some of "
                         f"{sorted(known)}")
    absent = set(wanted) - {k for k, v in given.items() if v is not None}
    if absent:
        raise ValueError(f"gradients wanted of inputs that are not given or unknown: "
                         f"{sorted(absent)}")


def kernel_backward(dout, dfinal, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                    initial_states=None, seq_idx=None, dt_softplus=False,
                    dt_limit=(0.0, math.inf), configs=None, states_dtype=None, wanted=None):
    """Gradients of ``kernel_forward``'s (out, final_states) with respect to its inputs, like
    ``reference.backward.ssd_chunked_backward``: a dict with dx, ddt, dA, dB, dC and, for the
    inputs given, dD, dz, ddt_bias, dinitial_states, all float32.

    ``dout`` (b, L, h, p) and ``dfinal`` (b, h, p, n): the loss' gradients with respect to the
    outputs (either may be None: zero; any strides). ``states_dtype``: the forward's entry
    states dtype (default x's). ``wanted``: the names of the inputs (``INPUTS``) whose
    gradients are needed (default all given). dD and dz come only when wanted; the kernels'
    gradients (x, dt, A, B, C, dt_bias, initial_states: one chain gives them all) come when any
    of them is wanted, and the kernels do not run otherwise."""
    configs = dict(configs or {})
    given = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                 initial_states=initial_states)
    wanted = {k for k, v in given.items() if v is not None} if wanted is None else set(wanted)
    _check(dout, dfinal, x, B, configs, wanted, given)
    run_kernels = bool(wanted & set(KERNEL_INPUTS))
    need_y = z is not None and "z" in wanted
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    seq_idx = None if seq_idx is None else as_int32(seq_idx).contiguous()
    # dout from autograd may be an expanded tensor (a sum's ones) or absent (an unused output).
    dout = torch.zeros_like(x) if dout is None else dout

    y = dt_out = dA_cumsum = entry = None
    if run_kernels or need_y:
        fwd_configs = {k: v for k, v in configs.items() if k in forward_module.KERNELS}
        y, _, (dt_out, dA_cumsum, entry) = forward_module.kernel_forward(
            x, dt, A, B, C, chunk_size, dt_bias=dt_bias, initial_states=initial_states,
            seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit, configs=fwd_configs,
            states_dtype=states_dtype, return_intermediates=True)

    dy, dx_skip, dD, dz = gate_and_skip_backward(dout, y, x, D, z, want_dD="D" in wanted,
                                                 want_dz=need_y)
    grads = {}
    if dD is not None:
        grads["dD"] = dD
    if dz is not None:
        grads["dz"] = dz
    if not run_kernels:
        return grads

    # bwd_compute_out takes entry states in x's dtype or float32: other stored dtypes (fp16
    # states of bf16 inputs, 16-bit states of float32 ones) widen exactly to float32.
    if entry.dtype not in (x.dtype, torch.float32):
        entry = entry.float()
    x_, B_, C_, dt_ = x.contiguous(), B.contiguous(), C.contiguous(), dt.contiguous()
    dy = dy.to(x.dtype).contiguous()           # the kernels' operand dtype (exact for float32)
    dfinal = None if dfinal is None else dfinal.float().contiguous()

    dx_c, dB_c, dC, ddt_c, ddA_c, dentry = bwd_compute_out(
        dy, x_, B_, C_, dt_out, dA_cumsum, entry, seq_idx,
        poison=forward_module.POISON_OUTPUTS, config=configs.get("bwd_compute_out"))
    dS, ddA_last, dinitial = bwd_pass_state(dentry, dfinal, entry, dA_cumsum, seq_idx,
                                            poison=forward_module.POISON_OUTPUTS)
    dx_s, dB_s, ddt_s, ddA_s = bwd_chunk_states(dS, x_, B_, dt_out, dA_cumsum, seq_idx,
                                                poison=forward_module.POISON_OUTPUTS)
    ddA = ddA_c + ddA_s
    ddA[..., -1] += ddA_last                   # the pass' term, at each chunk's last token
    ddt, dA, ddt_bias = bwd_chunk_cumsum(ddt_c + ddt_s, ddA, dt_, A.contiguous(),
                                         None if dt_bias is None else dt_bias.contiguous(),
                                         dt_softplus, dt_limit,
                                         poison=forward_module.POISON_OUTPUTS)
    dx = dx_c + dx_s
    if dx_skip is not None:
        dx = dx + dx_skip
    # chunk_states' dB is per head: summed over each group's heads in order (a fixed reduction)
    dB = dB_c + dB_s.reshape(batch, seqlen, ngroups, nheads // ngroups, dstate).sum(3)
    grads.update(dx=dx, ddt=ddt, dA=dA, dB=dB, dC=dC)
    if dt_bias is not None:
        grads["ddt_bias"] = ddt_bias
    if initial_states is not None:
        grads["dinitial_states"] = dinitial
    return grads


# The backward as a custom operator ------------------------------------------------------------
#
# torch.compile traces the forward operator's registered backward (ops/torch_op.py) into the
# backward graph, and cannot trace the kernels' launches: so the kernels' backward is an opaque
# operator too, ``torch.ops.mamba2_cutile.ssd_backward``, whose fake gives the gradients' shapes.
# It returns one tensor per input of ``INPUTS``, float32, and an empty one for each input that is
# not given or whose gradient is not wanted.

def _gradient_shapes(x, dt, A, B, C, D, z, dt_bias, initial_states, wanted):
    inputs = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    return [tuple(t.shape) if t is not None and w else (0,)
            for t, w in zip(inputs, wanted, strict=True)]


@torch.library.custom_op("mamba2_cutile::ssd_backward", mutates_args=())
def backward_op(dout: Optional[Tensor], dfinal: Optional[Tensor], x: Tensor, dt: Tensor,
                A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
                dt_bias: Optional[Tensor], initial_states: Optional[Tensor],
                seq_idx: Optional[Tensor], cu_seqlens: Optional[Tensor], *, chunk_size: int,
                dt_softplus: bool, dt_min: float, dt_max: float,
                state_dtype: Optional[torch.dtype], wanted: list[bool]) -> list[Tensor]:
    from .ssd_combined import check_values
    from .torch_op import as_kernel_input
    if len(wanted) != len(INPUTS):
        raise ValueError(f"wanted must have one flag per input of {INPUTS}, got {len(wanted)}")
    # The forward's preparation of its inputs (the values were checked there).
    seq_idx = check_values(x, seq_idx, cu_seqlens, check=False)
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx = (
        as_kernel_input(t) for t in (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx))
    names = [n for n, w in zip(INPUTS, wanted) if w]
    g = kernel_backward(dout, dfinal, x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                        initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
                        dt_limit=(dt_min, dt_max), states_dtype=state_dtype or x.dtype,
                        wanted=names)
    return [g["d" + n] if n in names else x.new_empty((0,), dtype=torch.float32)
            for n in INPUTS]


@backward_op.register_fake
def _(dout, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, *,
      chunk_size, dt_softplus, dt_min, dt_max, state_dtype, wanted):
    shapes = _gradient_shapes(x, dt, A, B, C, D, z, dt_bias, initial_states, wanted)
    return [x.new_empty(s, dtype=torch.float32) for s in shapes]
