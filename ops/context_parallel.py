"""Context parallelism: one long sequence split over several processes, each scanning its slice.

    out_r, final = context_parallel_chunk_scan(x_r, dt_r, A, B_r, C_r, chunk_size, D=D, z=z_r,
                                               dt_bias=dt_bias, dt_softplus=True,
                                               return_final_states=True, process_group=group)

Every rank of ``process_group`` passes its own contiguous slice of the sequence (rank order is
sequence order; batch and heads whole); each gets its slice of the output, and the final state
of the whole sequence.

Why the ranks need to exchange so little. For one head the scan is the recurrence

    S_t = a_t S_{t-1} + dt_t x_t B_t^T,      y_t = S_t C_t (+ D x_t, gated by silu(z_t)),

with a_t = exp(dt_t A) (a_t = 0 where a packed sequence starts: the state resets there). Each
step is an affine map of the state, so a rank's whole slice is one too: from entry state S_in,

    S_out = decay * S_in + S_own,     decay = prod_t a_t = exp(sum_t dt_t A),

where S_own is the slice's state scanned from zero. Affine maps compose, (d2, s2) after
(d1, s1) = (d2 d1, d2 s1 + s2), and the composition is associative, so each rank's entry state
is an exclusive scan over the ranks before it of their (decay, S_own): data of size
batch * heads * headdim * dstate per rank, whatever the sequence length. Unrolling the
recurrence inside the slice, the entry state reaches token l as

    y_l += exp(dA_cumsum[l]) * (S_in C_l),     dA_cumsum[l] = sum_{s <= l} dt_s A  (s in the slice),

a term linear in S_in that the gate multiplies like the rest of y (D x does not involve S_in).
So each rank runs the scan once on its slice from a zero state (``mamba_chunk_scan_combined``
with ``return_final_states=True`` gives its output and S_own), the ranks all-gather
(decay, S_own), and each adds the term above, (S_in C_l) * exp(dA_cumsum[l]) * silu(z_l), in
PyTorch: one batched product over the slice, O(L * heads * headdim * dstate) like the scan's own
reading of the chunks' entry states (and without the scan's within-chunk products). The first
rank starts from ``initial_states`` (or zero): it passes them to its own scan, which then
returns its exact S_out, and needs no correction at all.

Packed sequences (``seq_idx`` with global ids) follow the single-process call: a state belongs
to one sequence, and ``initial_states`` to sequence id 0 (the id "before" token 0 is 0). The
state entering rank r belongs to the sequence of the previous rank's last token (id 0 for the
first rank); it reaches only this slice's tokens of that id (a prefix of the slice), and it
carries through the slice (decay != 0) only if every token of the slice has that id: a sequence
starting anywhere in the slice, its first token included, resets the state. Each rank's own
scan already returns the state of its last token's sequence, from the slice's tokens of that id.

Gradients flow through all of it: the local scan is differentiable (its final state too), the
correction is PyTorch, and the all-gather's backward all-reduces the gathered gradient and keeps
this rank's part (``_AllGather``; gloo has no reduce-scatter). Tensors every rank passes whole
(A, D, dt_bias, initial_states, a layer's parameters) receive each rank's share of their
gradient, as in data parallelism: sum them over the group (initial_states' whole gradient lands
on the first rank, the only one that reads them). The backward is a collective too: every rank
must run it, and every rank's output takes part in it (``_ZeroLinkedTo``), so that a rank whose
output does not need the exchange (the first) still joins it.

A Mamba-2 layer needs one more exchange: its causal convolution reads the few tokens before
each of its own, which for a slice's first tokens live on the ranks before (``previous_tokens``,
used by ``ops.mixer.Mamba2Mixer``).

torch.compile: the exchanges run eagerly (``torch.compiler.disable``), the local scan and the
correction are traced; a compiled model breaks its graph around each exchange.

The device: collectives run on the tensors' device with the process group's backend (NCCL for
CUDA tensors, gloo for CPU tensors); the exchanged tensors are float32 (float64 for float64
inputs), the dtype of the returned states.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.common import compute_dtype, process_dt
from .inputs import check_values
# the single-process call's own input checks, run before the first collective (see _agree)
from .ssd_combined import KERNEL_DTYPES, _check_inputs, _resolve_backend, mamba_chunk_scan_combined

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)   # x's dtype, as a code


def context_parallel_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                initial_states=None, seq_idx=None, cu_seqlens=None,
                                dt_softplus=False, dt_limit=(0.0, float("inf")),
                                return_final_states=False, state_dtype=None, backend="auto",
                                process_group=None):
    """``mamba_chunk_scan_combined`` over a sequence split between the ranks of a process group.

    Every rank of ``process_group`` (default: the whole world) calls it with its own contiguous
    slice of the sequence, rank 0 the first; slices may differ in length (at least one token
    each) and need not be multiples of chunk_size. The arguments are those of
    ``mamba_chunk_scan_combined`` (see there), sliced along the sequence where they have one:

        x, dt, B, C, z, seq_idx   this rank's slice (b, L_r, ...); seq_idx with the GLOBAL ids,
                                  so packed sequences may run across rank boundaries
        A, D, dt_bias             whole, the same on every rank
        initial_states            the whole sequence's, the same on every rank (only rank 0's
                                  slice starts from it; its gradient lands on rank 0)
        cu_seqlens                refused: per-rank bounds cannot say whether a rank's first
                                  sequence continues the previous rank's last; pass seq_idx

    Returns this rank's slice of the output (b, L_r, h, p) in x's dtype, and with
    ``return_final_states`` the state after the sequence's last token (b, h, p, n), the same on
    every rank, float32 (float64 for float64 inputs). The result equals the single-process call
    on the whole sequence up to rounding (the module docstring says why).

    Collectives: three small all-gathers (an agreement on shapes and options, the sequence ids
    at the slice ends where seq_idx is given, and the (decay, own state) pairs); the backward adds
    one all-reduce. Every rank must call it, and run the backward, in the same order.
    """
    group = _group(process_group)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = _agree(group, size, rank, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
                  seq_idx, cu_seqlens, dt_softplus, dt_limit, state_dtype, backend)

    # This rank's slice from its entry state set to zero: rank 0 starts from the real one.
    out, own = mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
        initial_states=initial_states if rank == 0 else None, seq_idx=seq_idx,
        dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True,
        state_dtype=state_dtype, backend=backend)
    sdt = own.dtype
    b, L, h, _ = x.shape
    if rank == 0:
        dA_cumsum, decay = None, own.new_zeros(b, h)     # nothing enters rank 0 from the others
    else:
        cdt = compute_dtype(x, dt, A, B, C)
        dt_used = process_dt(dt.to(cdt), None if dt_bias is None else dt_bias.to(cdt),
                             dt_softplus, dt_limit)
        dA_cumsum = torch.cumsum(dt_used * A.to(cdt), dim=1)              # (b, L, h)
        # Masks go on exponents (-inf), never on exp's result: where A > 0 exp may overflow,
        # and a masked inf would still make the backward's 0 * inf a NaN. A slice in which a
        # sequence starts carries no state through: decay 0.
        last = dA_cumsum[:, -1]
        if seq_idx is not None:
            last = torch.where((seq_idx[:, 0] == seq_idx[:, -1])[:, None], last, -torch.inf)
        decay = torch.exp(last).to(sdt)                                   # (b, h)
    ends = None if seq_idx is None else torch.stack([seq_idx[:, 0], seq_idx[:, -1]]).long()

    link, entry, final, entry_id = _exchange(group, size, rank, plan, decay, own, ends,
                                             return_final_states)
    if rank == 0:
        if link is not None:       # an exact zero: the backward's collective reaches rank 0 too
            out = out + link
    else:
        # y_l += exp(dA_cumsum[l]) * (S_in C_l), on the tokens of the sequence S_in belongs to,
        # gated by silu(z_l) as the rest of y: in float32 (float64), added to the local output.
        g = C.shape[2]
        exponent = dA_cumsum.to(sdt)
        if seq_idx is not None:         # on the exponent, as above
            exponent = torch.where((seq_idx == entry_id[:, None])[..., None], exponent, -torch.inf)
        carried = torch.exp(exponent)
        read = torch.einsum("blgn,bgkpn->blgkp", C.to(sdt), entry.unflatten(1, (g, h // g)))
        term = read.flatten(2, 3) * carried[..., None]
        if z is not None:
            term = term * F.silu(z.to(sdt))
        out = (out.to(sdt) + term).to(x.dtype)
    return (out, final) if return_final_states else out


# The process group -------------------------------------------------------------------------------

def _group(process_group):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group: torch.distributed is not initialised; call "
                         "torch.distributed.init_process_group first (or run one process with "
                         "mamba_chunk_scan_combined)")
    group = dist.group.WORLD if process_group is None else process_group
    if dist.get_rank(group) < 0:
        raise ValueError("process_group: this process is not a member of the group it was given")
    return group


def _collective_device(group, x):
    """The device the group's collectives take tensors on: x's, where x is a tensor."""
    if isinstance(x, torch.Tensor):
        return x.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Differentiable collectives ---------------------------------------------------------------------

class _AllGather(torch.autograd.Function):
    """All-gather of equal-shaped tensors, stacked in rank order: (world, *shape).

    Backward: every rank's output reads every rank's input, so the gradient of rank q's part is
    the sum over ranks of the gradient each computed for it: an all-reduce of the gathered
    gradient, of which rank q keeps its own part (a reduce-scatter would send less; gloo has none,
    and the gathered tensors here are small)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


class _ZeroLinkedTo(torch.autograd.Function):
    """An exact scalar zero whose backward reaches ``tensor`` (with a zero gradient).

    Added to an output that does not otherwise depend on a gathered tensor, it makes every rank's
    backward run the all-gather's backward, a collective all of them must join. A fresh zero,
    not ``0 * tensor``: that would be NaN where the tensor holds an inf."""

    @staticmethod
    def forward(ctx, tensor):
        ctx.like = (tensor.shape, tensor.dtype, tensor.device)
        return tensor.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.like
        return torch.zeros(shape, dtype=dtype, device=device)


def previous_tokens(t, count, process_group=None):
    """The ``count`` tokens just before this rank's slice of a sequence split over the group.

    ``t`` (b, L_r, c) is this rank's slice of a per-token tensor (rank order is sequence order);
    returns (b, count, c): the sequence's tokens at global positions start_r - count ...
    start_r - 1, zeros where those fall before the sequence's start (rank 0's are all zeros), as
    a causal convolution of width count + 1 pads. A "halo": what a rank needs of its neighbours'
    data to compute its own slice. Usually all of it is the previous rank's last ``count``
    tokens; where some slices are shorter than ``count``, it reaches further back.

    One all-gather of every rank's last ``count`` tokens (padded to ``count``, with a 0/1
    channel saying which are real); each rank picks its halo by index, so the result is exact
    and the backward sends each token's gradient back to the rank that owns it (``_AllGather``).
    Every rank's result reads the gathered tensor, so every rank joins the backward's
    collective."""
    group = _group(process_group)
    if count == 0:
        return t[:, :0]
    return _previous_tokens(t, count, group)


@torch.compiler.disable
def _previous_tokens(t, count, group):
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    b, L, c = t.shape
    tail = t[:, -count:]
    tail = torch.cat([tail, tail.new_ones(b, tail.shape[1], 1)], dim=-1)   # + the "real" channel
    tail = F.pad(tail, (0, 0, count - tail.shape[1], 0))                    # zeros before it
    gathered = _AllGather.apply(tail, group)                          # (world, b, count, c + 1)
    tokens = gathered.transpose(0, 1).reshape(b, size * count, c + 1)      # in sequence order
    position = torch.arange(size * count, device=t.device)
    real = (tokens[0, :, -1].detach() > 0.5) & (position // count < rank)  # before this slice
    # the halo's slot of a real token: count minus the number of real tokens from it on (a
    # token too far back gets a negative slot and no place)
    slot = count - real.flip(0).cumsum(0).flip(0)
    slots = torch.arange(count, device=t.device)[:, None]
    match = real & (slot[None, :] == slots)                           # (count, world * count)
    source = torch.where(match.any(1), (match * position).sum(1), size * count)  # else a zero row
    rows = torch.cat([tokens[..., :-1], tokens.new_zeros(b, 1, c)], dim=1)
    return rows.index_select(1, source)


# Agreement on shapes and options, then the exchange --------------------------------------------

# What each rank tells the others before anything else. The fields between the first and the
# last must agree: the exchanged tensors' shapes and dtype, which exchanges run, whether the
# backward (a collective) will run, and the options that, were they to differ, would give a
# silently wrong result (chunk_size changes only the rounding, and is let differ).
_HEADER = ("inputs accepted", "batch (x.shape[0])", "nheads (x.shape[2])", "headdim (x.shape[3])",
           "ngroups (B.shape[2])", "dstate (B.shape[3])", "x.dtype", "seq_idx given",
           "initial_states given", "D given", "z given", "dt_bias given", "dt_softplus",
           "grad mode", "needs a gradient")


@torch.compiler.disable
def _agree(group, size, rank, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
           cu_seqlens, dt_softplus, dt_limit, state_dtype, backend):
    """Check this rank's inputs, then all-gather a header of shapes and options, so that every
    rank raises together: where one rank's inputs are refused (the others would wait for it in
    the next collective) or where the ranks disagree on what must be the same everywhere.
    Returns the gathered header's facts the exchange needs."""
    error = None
    try:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: sequence bounds per rank cannot say whether a rank's "
                             "first sequence continues the previous rank's last one; pass seq_idx "
                             "with global sequence ids instead (sliced like x)")
        _check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, None,
                      dt_limit, False, state_dtype)
        resolved = _resolve_backend(backend, x, B)
        if resolved != "reference" and x.dtype not in KERNEL_DTYPES:
            raise TypeError(f"backend={resolved!r} takes x, B, C, z in float32, bfloat16 or "
                            f"float16; got {x.dtype} (float64 works with backend='reference')")
        if seq_idx is not None:
            check_values(x, seq_idx, None)
    except (ValueError, TypeError) as e:
        error = e
    if error is None:
        tensors = (x, dt, A, B, C, D, z, dt_bias) + ((initial_states,) if rank == 0 else ())
        needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                     for t in tensors)
        mine = [1, x.shape[0], x.shape[2], x.shape[3], B.shape[2], B.shape[3],
                _DTYPES.index(x.dtype), seq_idx is not None, initial_states is not None,
                D is not None, z is not None, dt_bias is not None, bool(dt_softplus),
                torch.is_grad_enabled(), needs_grad]
    else:
        mine = [0] * len(_HEADER)
    header = torch.tensor([int(v) for v in mine], dtype=torch.int64,
                          device=_collective_device(group, x))
    parts = [torch.empty_like(header) for _ in range(size)]
    dist.all_gather(parts, header, group=group)
    table = [dict(zip(_HEADER, row)) for row in torch.stack(parts).tolist()]   # one per rank
    if error is not None:
        raise error
    refused = [q for q, row in enumerate(table) if not row["inputs accepted"]]
    if refused:
        raise ValueError(f"process_group: rank(s) {refused} refused their inputs (their error "
                         "says why); every rank must call with valid inputs")
    for name in _HEADER[1:-1]:
        values = [row[name] for row in table]
        if len(set(values)) > 1:
            if name == "x.dtype":
                values = [str(_DTYPES[v]).replace("torch.", "") for v in values]
            raise ValueError(f"{name} must be the same on every rank of process_group; got "
                             f"{values} (rank 0, 1, ...)")
    return dict(seq_idx=bool(table[0]["seq_idx given"]),
                needs_grad=any(row["needs a gradient"] for row in table))


@torch.compiler.disable
def _exchange(group, size, rank, plan, decay, own, ends, all_ranks):
    """All-gather every rank's (decay, S_own) and scan them in rank order.

    Returns (link, S_in, final, entry_id): a zero linked to the gathered tensor (for rank 0,
    whose output does not otherwise read it), this rank's entry state, the whole sequence's final
    state (None unless ``all_ranks``), and the id of the sequence S_in belongs to (b,), or None
    without seq_idx."""
    b, h = decay.shape
    payload = torch.cat([decay.flatten(), own.flatten()])
    if plan["needs_grad"] and not payload.requires_grad:
        # another rank needs a gradient through the exchange: join its backward's collective
        payload = payload.detach().requires_grad_()
    gathered = _AllGather.apply(payload, group)             # (world, b*h + b*h*p*n)
    decays = gathered[:, :b * h].view(size, b, h)
    owns = gathered[:, b * h:].view(size, *own.shape)

    keep = entry_ids = None
    if plan["seq_idx"]:
        parts = [torch.empty_like(ends) for _ in range(size)]
        dist.all_gather(parts, ends, group=group)
        first, last = torch.stack(parts).unbind(1)          # (world, b) each
        if size > 1 and bool((first[1:] < last[:-1]).any()):
            raise ValueError("seq_idx must be non-decreasing along the whole sequence: a rank's "
                             "first id is below the previous rank's last")
        entry_ids = torch.cat([torch.zeros_like(last[:1]), last[:-1]])   # id before each slice
        # the entering state crosses a slice only if no sequence starts in it (first token too)
        keep = (first == last) & (first == entry_ids)

    # S_in(r) = S_out(r - 1);  S_out(q) = decay(q) * S_in(q) + S_own(q);  S_out(0) = S_own(0)
    state = owns[0]
    entry = state if rank == 1 else None
    for q in range(1, size if all_ranks else rank):
        carry = decays[q] if keep is None else torch.where(keep[q, :, None], decays[q], 0.0)
        state = carry[..., None, None] * state + owns[q]
        if q == rank - 1:
            entry = state
    final = state if all_ranks else None
    # rank 0's output reads nothing gathered: a zero that brings its backward to the collective
    link = _ZeroLinkedTo.apply(gathered) if gathered.requires_grad else None
    return link, entry, final, None if entry_ids is None else entry_ids[rank]
