"""The whole backward pass as kernel launches: the gradients of ``ops.forward.kernel_forward``.

The gradients flow back through the forward's steps in reverse (``reference/backward.py`` is
the specification, step by step, and names the same quantities):

    recompute          chunk_cumsum, fwd_pass_state (and compute_out only when dz needs y)
                                                           -> dt_out, dA_cumsum, entry states (, y)
                       (only compute_out, for y, where a training step's forward kept
                       the intermediates: ``keeps``)
    gate               out = (y + D x) * silu(z)           -> dy, dz          (PyTorch, float32,
                                                              over slices of the tokens; without
                                                              z, dy is dout and nothing runs)
    (b) bwd_pass_state     dy, C, dfinal -> dS, ddA_cumsum at each chunk's last token,
                           dinitial                          (the chunks in reverse order,
                           each chunk's dentry formed in the walk from dy and C: FUSE_ENTRY,
                           ``BACKWARD_DEFAULTS``; with FUSE_ENTRY=False compute_out's dentry
                           launch runs first, dy -> dentry, and the walk reads dentry)
    (c) bwd_compute_out    the pair kernel (dy x^T's sums and d(C B^T) summed over heads), then
                           its token work in two launches (SPLIT_DX; one fused launch with
                           SPLIT_DX=False): the states launch (dB, dC, each summed over its
                           group's heads, and the states' terms of ddt and ddA), then the dx
                           launch: dy, dS, D -> dx (complete, in its final dtype), ddt_out,
                           ddA_cumsum, dD's partials: compute_out's gradients, those through
                           each chunk's own state (bwd_chunk_states' work, fused: FUSE_STATES)
                           and the skip's
    (a) bwd_chunk_cumsum   ddt_out, ddA_cumsum (the three steps' contributions summed: the
                           terms at each chunk's last token, the pass' and the token tiles',
                           come as partials that this kernel sums where it reads ddA_cumsum)
                           -> ddt, dA, ddt_bias

and the host adds what remains: dB and dC's head-split partials, dD's token-tile partials; dA
and ddt_bias are the cumsum kernel's per-chunk partials summed. Every sum runs in a fixed order
(no atomics), so the gradients are bitwise reproducible. With z, the token kernel's skip terms
(D dy and dD's sum of dy x) read dy as rounded to x's dtype, the kernels' operand, where the
specification takes it in float32: one more rounding of dy (bf16: 2**-9 relative) in those two
terms; without z, dy is dout itself and nothing changes. With
``configs={"bwd_compute_out": {"FUSE_STATES": False}}`` (without the pair kernel, the default at
dstate 256 from 16K tokens: ``bwd_compute_out.fuse_states``) the token launch leaves the states'
gradients to ``bwd_chunk_states``, launched after it, which adds its dx, ddt_out and ddA_cumsum
into the token launch's (then float32) ones, and its own last-token partials for
``bwd_chunk_cumsum`` to sum.

Memory (bytes beyond the inputs and dout, at batch 8 x 2K tokens, 80 heads of 64 x 128, 1 group,
bf16, D, no z; ``memory_accounting`` computes them for any shape and config, and
``tests/kernels/test_backward_kernels.py`` checks them)
    Nothing token-sized is held in float32 or per head: dx is written once in x's dtype, dB and
    dC are summed over a group's heads in the token kernel, and the gate runs over slices of the
    tokens (``SLICE_ELEMENTS``).
    The token work's two launches (SPLIT_DX, the default) run as two plans, and what only the
    first reads is gone before the second's outputs exist: the states launch is the last reader
    of the entry states and of d(C B^T)'s partials and makes dB's and dC's head-split partials;
    those are summed, then dx is allocated for the dx launch. The peak is the states launch at
    chunk 128 (the chunk an H200 computes a caller's 256 at: ``ops/tuning/compute_chunk.py``),
    448 MiB, and the dx launch at 256, 342 MiB; with z, whose dz and dy in x's dtype add
    2 x 160 MiB, the gate (778 and 698 MiB). Alive there, MiB at 128 (at 256):
        the states launch, 448 (316): entry states 160 (80); dS 160 (80), stored in bf16 for
        bf16 inputs (the products round it so anyway); dB, dC head-split partials 4 splits x
        2 x 8 (``bwd_compute_out.BLOCKS_PER_SM``, at most ``MAX_SPLITS``); the pair kernel's
        d(C B^T) head-split partials 16 (16), C B^T per chunk and group 8 (16), float32, and
        its row and column sums of dG G 20 (40); the states' ddt and ddA terms 10; dt_out,
        dA_cumsum 10
        the dx launch, 394 (342): dx in x's dtype 160, written once (no float32 dx); dS; dB and
        dC 16; C B^T, the sums of dG G and the states' terms as above; ddt_out, ddA_cumsum 10;
        dD's partials 0.1 (a 1-d D's, summed over headdim in the kernel; a 2-d D's 5)
    The entry states are freed after the states launch whether the recompute made them or a
    training step's forward kept them (``keeps``: handed over to the backward, ``ops.torch_op``,
    not held by the autograd node). dy is dout itself (without z); y is not computed without z;
    there is no dentry (the pass forms it: FUSE_ENTRY), which with FUSE_ENTRY=False is a
    float32 (b, c, h, p, n) buffer, 160 (320), alive through the pass, whose step is then the
    peak at 128 (650 MiB).
    A training step's peak adds the forward's output and the gradients to this; it is measured
    by ``tests/benchmark/fwd_bwd.py`` (``tests/benchmark/results/fwd_bwd_h200.csv`` at the model
    shapes and the grid, next to mamba_ssm's Triton: PERF_NOTES.md, "The backward computes at the
    forward's chunk"). Plans must hold no reference cycles, or the forward's entry and final states
    stay allocated through this peak until the garbage collector runs
    (``ops.runtime.launch._build``; PERF_NOTES.md, "Plans hold no reference cycles", and
    ``tests/benchmark/results/memory_probe_2p7b_h200.txt``).

Saved and recomputed
    The operator saves its inputs. An eager training step's forward also keeps its
    intermediates dt_out, dA_cumsum (log2 units, as the backward kernels read it) and the entry
    states (in the forward's state dtype: the values the forward's compute_out read) where they
    take no more memory than x (``keeps``; ``MAMBA2_CUTILE_KEEP_INTERMEDIATES=0`` turns that
    off, and nothing is kept under saved-tensor hooks: a checkpoint's or an offload's would not
    reach them). The backward takes them from the autograd node and frees each after its last
    reader; a second backward through a retained graph makes them again. Otherwise, and for
    traced calls, the backward runs the forward kernels once more,
    without D and z, to make them: at most one forward pass, and no memory between the passes.
    compute_out runs again only when dz is wanted: its output is then the pre-gate y (the one
    forward value dz needs; D x is added on the host). When only D and z want gradients the
    backward kernels do not run, and nothing is kept; for D alone nothing is recomputed (dD
    reads dout, z and x).

The backward kernels return ddA_cumsum in natural-log units (from dA_cumsum in log2 units), so
their contributions add directly, and the cumsum kernel takes them so.

Inputs arrive from the operator (``backward_op`` below) as the forward's do: each tensor as
``ops.torch_op.as_kernel_input`` gives it, seq_idx int32. The backward kernels read x, B, C,
dt and the gradients contiguous (copied here where a view is passed). ``configs`` maps a forward
kernel's name (``ops.forward.KERNELS``) or a backward kernel's (``BACKWARD_CONFIGS``: each
module's ``default_config`` / ``search_space``) to its config; a missing one takes, on a GPU,
the tuned one (``tuned_config``), else the default, and a missing key the default (for the
backward kernels, with ``BACKWARD_DEFAULTS`` over it).
"""
import math
import os
from typing import Optional

import torch

from . import forward as forward_module
from ops.kernels.backward.bwd_chunk_states import bwd_chunk_states_plan
from ops.kernels.backward.bwd_chunk_states import default_config as chunk_states_config
from ops.kernels.backward.bwd_compute_out import bwd_compute_out_plan
from ops.kernels.backward.bwd_compute_out import resolved_config as compute_out_resolved
from ops.kernels.backward.bwd_compute_out import launch_slices as compute_out_slices
from ops.kernels.backward.bwd_pass_state import bwd_pass_state_plan
from ops.kernels.backward.bwd_pass_state import default_config as pass_state_config
from ops.kernels.backward.bwd_pass_state import walk_config as pass_state_walk
from ops.kernels.backward import bwd_chunk_cumsum as chunk_cumsum_module
from ops.kernels.backward import bwd_chunk_states as chunk_states_module
from ops.kernels.backward import bwd_compute_out as compute_out_module
from ops.kernels.backward import bwd_pass_state as pass_state_module
from ops.kernels.backward.bwd_chunk_cumsum import bwd_chunk_cumsum, bwd_chunk_cumsum_plan
from ops.tuning.autotune import mode, tuner
from ops.tuning.compute_chunk import kernel_chunk
from ops.tuning.configs import resolve_config
from ops.runtime.launch import run
from ops.inputs import as_kernel_input, check_values, with_canonical_strides
from ops.kernels.common import as_int32, entry_read_dtype, sum_splits

Tensor = torch.Tensor

# The inputs that have a gradient, in the operator's order, and those the four kernels give.
INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
KERNEL_INPUTS = ("x", "dt", "A", "B", "C", "dt_bias", "initial_states")
KERNEL_INPUT_POSITIONS = tuple(INPUTS.index(name) for name in KERNEL_INPUTS)
BACKWARD_CONFIGS = ("bwd_compute_out", "bwd_pass_state", "bwd_chunk_states", "bwd_chunk_cumsum")
# The chain's own choices over a backward kernel's default config (a kernel's default is the
# kernel as first written, for its standalone use), by shape: the pass over the states forms
# dentry itself (``ops/kernels/backward/bwd_pass_state.py``'s FUSE_ENTRY: less time per training
# step at chunks 64 and 128, ``tests/benchmark/results/bwd_fuse_entry_h200.csv``, and no dentry
# buffer), in narrower tiles where its default's are 128 columns wide, each chunk's product in
# one piece at dstate 64 and chunk 128 with bf16 inputs (``walk_config``). A config given for the
# kernel is taken over these.
BACKWARD_DEFAULTS = {"bwd_pass_state": pass_state_walk}


def backward_config(configs, name, **shape):
    """The config ``kernel_backward`` runs backward kernel ``name`` with at ``shape`` (headdim,
    dstate, chunk_size: the chunk the kernels compute at, dtype: the entry states' as the
    kernels read them): ``BACKWARD_DEFAULTS``' keys for the shape, then those of
    ``configs[name]`` (a missing key: the kernel's default)."""
    chain = BACKWARD_DEFAULTS[name](**shape) if name in BACKWARD_DEFAULTS else {}
    return {**chain, **((configs or {}).get(name) or {})}


def pass_config(configs, **walk_shape):
    """``bwd_pass_state``'s whole config as ``kernel_backward`` runs it (``backward_config``'s
    keys over the kernel's default); ``walk_shape``: headdim, dstate, chunk_size (the chunk the
    kernels compute at), dtype (the entry states' as the kernels read them)."""
    return resolve_config(backward_config(configs, "bwd_pass_state", **walk_shape),
                          pass_state_config(**walk_shape))


# Tuned configs ---------------------------------------------------------------------------------
#
# Each backward kernel takes, on a GPU, the tuned config for the shape as the forward's do
# (``ops/tuning/autotune.py``: a cached search's winner, else the committed table's, else the
# chain's own choice; ``MAMBA2_CUTILE_AUTOTUNE=1`` searches where the cache does not know the
# shape, ``=0`` runs the chain's choices). A kernel is timed alone, on the chain's real inputs,
# among the variants the chain can run in its place (``chain_space``): the others' work does not
# change with its config. The token kernel is timed with the sums of dB's and dC's partials over
# its head splits, whose number its config sets (HEADS_PER_BLOCK).
# ``python -m ops.tools.tune search --backward`` searches shapes ahead.

BACKWARD_KERNELS = {"bwd_compute_out": compute_out_module, "bwd_pass_state": pass_state_module,
                    "bwd_chunk_states": chunk_states_module,
                    "bwd_chunk_cumsum": chunk_cumsum_module}


def chain_space(name, shape):
    """(the config ``kernel_backward`` runs backward kernel ``name`` with at ``shape`` when
    nothing is tuned, the candidates a search times in its place). ``shape``: batch, seqlen,
    nheads, headdim, ngroups, dstate, chunk_size, dtype (x's), states_dtype (the entry states'
    as the kernels read them). The candidates keep what the rest of the chain depends on: the
    pass over the states forms dentry (FUSE_ENTRY), and the token kernel does or leaves the
    chunk states' work as the chain's rule says (FUSE_STATES: ``bwd_chunk_states`` runs after
    it or not, so the two kinds do different work)."""
    module = BACKWARD_KERNELS[name]
    sizes = {k: v for k, v in shape.items() if k != "on_gpu"}
    default, space = module.default_config(**sizes), module.search_space(**sizes)
    if name == "bwd_pass_state":
        space = module.walk_space(**sizes)
        default = space[0]
    elif name == "bwd_compute_out":
        space = [c for c in space if c["FUSE_STATES"] == default["FUSE_STATES"]]
    return default, space


def tuned_config(name, configs, shape, features, run):
    """The config backward kernel ``name`` runs with: the one in ``configs``, else on a GPU the
    tuned one for ``shape`` (``chain_space``'s; ``features`` as ``ops.forward.tuning_key``
    takes them), found in the cache or the table or, when a search is asked for, by timing
    ``run(config)``; None where that is the chain's own choice (also on the CPU interpreter,
    which is not timed). Memoised per shape, as the forward's."""
    given = (configs or {}).get(name)
    if given is not None:
        return given
    how = mode() if shape["on_gpu"] else "off"
    if how == "off":
        return None
    memo = tuner().chosen
    memo_key = (name, features, how, tuple(shape.items()))
    if memo_key not in memo:
        default, space = chain_space(name, shape)
        key, _ = forward_module.tuning_key(name, shape, features, space)
        if how == "table":
            found = tuner().lookup(name, key, space, default)
        else:
            found = tuner().best(name, key, space, default, run)
        memo[memo_key] = None if found == default else found
    return memo[memo_key]


# The elementwise gate (and dD when the kernels do not run) runs over slices of at most this many
# (token x head x headdim) elements: its float32 temporaries stay ~16 MB each instead of x's size
# in float32.
SLICE_ELEMENTS = 1 << 22


def token_slices(batch, seqlen, width):
    """(batch element, token range) slices of a (batch, seqlen, ...) tensor of ``width``
    elements per token, each of at most ``SLICE_ELEMENTS`` elements (one token at least), in
    order."""
    step = max(1, SLICE_ELEMENTS // max(width, 1))
    return [(b, slice(t, min(t + step, seqlen))) for b in range(batch)
            for t in range(0, seqlen, step)]


def memory_accounting(*, batch, seqlen, nheads, headdim, ngroups, dstate, chunk_size,
                      dtype=torch.bfloat16, states_dtype=None, z=False, initial_states=False,
                      configs=None, kept=False, D=1):
    """The bytes of the tensors ``kernel_backward`` (with ``input_dtypes=True``, as the operator
    calls it) holds beyond its inputs and dout at each of its steps, with the default configs
    (or ``configs``, as ``kernel_backward`` takes them: ``bwd_compute_out``'s,
    ``bwd_chunk_states``' and ``bwd_pass_state``'s change the count), as this module's docstring
    lists them: a dict of step -> {tensor: bytes}, and "peak" -> (step, bytes). Inputs are
    taken contiguous (views are copied, and dout in x's dtype: otherwise dy is a copy of it).
    Every tensor is counted, the (b, h, c, l) ones too. ``kept``: the forward's intermediates
    come from the forward (``keeps``), handed over to the backward (``ops.torch_op``: the
    autograd node holds them no longer), so alive as a recompute's would be; no final state is
    made. ``D``: its number of
    dimensions (1: one number per head, as Mamba-2's; 2: (nheads, headdim)), which sets the size
    of the token kernel's partials of dD."""
    configs = configs or {}
    f32, e = 4, torch.empty((), dtype=dtype).element_size()
    entry_dtype = entry_read_dtype(dtype, states_dtype or dtype)
    se = torch.empty((), dtype=entry_dtype).element_size()
    shape = dict(batch=batch, seqlen=seqlen, nheads=nheads, headdim=headdim, ngroups=ngroups,
                 dstate=dstate, chunk_size=chunk_size)
    nchunks = -(-seqlen // chunk_size)
    tokens = batch * seqlen * nheads * headdim
    states = batch * nchunks * nheads * headdim * dstate
    chunked = batch * nheads * nchunks * chunk_size * f32          # a (b, h, c, l) tensor
    groups = batch * seqlen * ngroups * dstate * f32                # a (b, L, g, n) tensor
    final = batch * nheads * headdim * dstate * f32
    per_group = nheads // ngroups
    out_cfg = compute_out_resolved(configs.get("bwd_compute_out"), **shape)
    out_splits = per_group // out_cfg["HEADS_PER_BLOCK"]
    fused = out_cfg["FUSE_STATES"]
    walk_shape = dict(headdim=headdim, dstate=dstate, chunk_size=chunk_size, dtype=entry_dtype)
    ps_cfg = pass_config(configs, **walk_shape)
    fuse_entry = ps_cfg["FUSE_ENTRY"]
    dentry = {} if fuse_entry else {"dentry": states * f32}   # FUSE_ENTRY: formed in the pass
    width = nheads * headdim
    slice_bytes = min(max(1, SLICE_ELEMENTS // width), seqlen) * width * f32
    ds = e if dtype == torch.bfloat16 else f32
    base = {"dt_out, dA_cumsum": 2 * chunked}
    held = {"dz": tokens * e} if z else {}       # gradients held to the end
    dy = {"dy (x's dtype)": tokens * e} if z else {}          # else dout itself
    dinit = {"dinitial": final} if initial_states else {}
    held["dD"] = nheads * (headdim if D == 2 else 1) * f32
    # the pass' term of d dA at each chunk's last token, one partial per state tile (per row of
    # one with ROW_PARTS), alive until bwd_chunk_cumsum sums it (as the token tiles' ddA_tiles,
    # when the token kernel is fused)
    ps_parts = pass_state_module.da_partials(headdim, dstate, ps_cfg["BLOCK_P"], ps_cfg["BLOCK_N"],
                                             ps_cfg["ROW_PARTS"])
    last = {"d dA[last] partials": chunked // chunk_size * ps_parts}
    recompute = {**base, "entry states": states * se, "final state": final}
    if z:
        recompute["y (pre-gate)"] = tokens * e
    # float32 slice temporaries alive at once: the gate's dz expression with z (without z the
    # gate has nothing to do: dy is dout, and the token kernel computes dD and the skip's dx)
    gate = {**base, **held, **dy, "entry states": states * se,
            "float32 slice temporaries": (8 if z else 0) * slice_bytes}
    if z:
        gate["y (pre-gate)"] = tokens * e
    split_sum = lambda n: groups if n > 1 else 0              # the sum of n > 1 partials
    tiles = nchunks * (chunk_size // out_cfg["BLOCK_T"])
    # (a 1-d D's partials are summed over headdim in the kernel)
    dd_parts = {"dD partials": batch * tiles * nheads * (headdim if D == 2 else 1) * f32}
    token_parts = {}
    # the states launch's dstate slices (SPLIT_DX): a ddA tile sum and a ddt and ddA term each
    slices = compute_out_slices(out_cfg)
    ends = {}                               # alive until bwd_chunk_cumsum sums them
    if fused:
        token_parts["ddA_tiles"] = ends["ddA_tiles"] = chunked // out_cfg["BLOCK_T"] * slices
    else:                                   # one-element tensors passed for dS and ddA_tiles
        token_parts["unread stand-ins"] = 2 * f32
    # C B^T per (chunk, group), alive while the token kernel runs (SCORES_IN_MEMORY); with the
    # pair kernel, which makes it, its d(C B^T) partials (read by the states launch with
    # SPLIT_DX) and the sums of dG and the states' terms the dx launch reads
    scores = ({"C B^T scores": batch * nchunks * ngroups * chunk_size ** 2 * f32}
              if out_cfg["SCORES_IN_MEMORY"] or out_cfg["PAIRS"] else {})
    pair_parts = {}
    if out_cfg["PAIRS"]:
        # the pair kernel's d(C B^T) head-split partials and its two sums of dG per head
        pair_splits = per_group // out_cfg["PAIR_HEADS_PER_BLOCK"]
        pair_parts["d(C B^T) partials"] = pair_splits * scores["C B^T scores"]
        scores["dG's row and column sums"] = 2 * chunked * (chunk_size // out_cfg["BLOCK_T"])
        if out_cfg["SPLIT_DX"]:
            scores["the states' ddt and ddA terms"] = 2 * chunked * slices
    # fused: dx written once, complete, in x's dtype; else float32, completed by chunk_states
    # and converted at the end
    dx = {"dx (x's dtype)": tokens * e} if fused else {"dx (float32)": tokens * f32}
    # dB's and dC's head-split partials, and the moment dB's sum is made (dC's, after dB's
    # partials are gone, takes no more)
    split_parts = {"dB, dC partials": 2 * out_splits * groups}
    summing = {**split_parts, "dB (their sum)": split_sum(out_splits)}
    ddt_dda = {"ddt_out, ddA": 2 * chunked}
    pass_on = {**base, **held, **dinit, **last}         # alive from the pass to the end
    steps = {
        "recompute": recompute,
        "gate": gate,
        "compute_out's dentry": {**base, **held, **dy, "entry states": states * se, **dentry},
        "pass_state": {**pass_on, **dy, "entry states": states * se, **dentry, "dS": states * ds},
    }
    if out_cfg["SPLIT_DX"]:
        # two plans: the states launch, dB's and dC's partials summed, then the dx launch,
        # whose outputs are allocated after the entry states and the partials are gone
        steps.update({
            "compute_out's states launch": {**pass_on, **dy, "entry states": states * se,
                                            "dS": states * ds, **split_parts, **token_parts,
                                            **scores, **pair_parts},
            "the split partials summed": {**pass_on, **dy, "dS": states * ds, **summing,
                                          **token_parts, **scores},
            "compute_out's dx launch": {**pass_on, **dy, "dS": states * ds,
                                        "dB, dC": 2 * groups, **token_parts, **scores, **dx,
                                        **ddt_dda, **dd_parts},
        })
    else:
        steps.update({
            "compute_out's tokens": {**pass_on, **dy, "entry states": states * se,
                                     "dS": states * ds, **dx, **ddt_dda, **split_parts,
                                     **token_parts, **dd_parts, **scores, **pair_parts},
            "the split partials summed": {**pass_on, "dS": states * ds, **dx, **ddt_dda,
                                          **summing, **token_parts, **dd_parts},
        })
    steps.update({
        "chunk_cumsum": {**base, **held, **dinit, **last, **dx, "dB, dC": 2 * groups,
                         "ddt_out, ddA": 2 * chunked, **ends,
                         "ddt (b, L, h)": batch * seqlen * nheads * f32},
        "gradients in x's dtype": {**base, **held, **dinit, **dx, "dB, dC": 2 * groups,
                                   "dB, dC in x's dtype": 2 * groups * e // f32 if e != f32 else 0,
                                   "ddt (b, L, h)": batch * seqlen * nheads * f32},
    })
    if not fused:
        # bwd_chunk_states after the token kernel: its dB's head-split partials and last-token
        # sums, then dB's sum; dx is converted to x's dtype beside its float32 self at the end
        cs_cfg = resolve_config(configs.get("bwd_chunk_states"), chunk_states_config(**shape))
        cs_splits = per_group // cs_cfg["HEADS_PER_BLOCK"]
        steps["chunk_states"] = {
            **base, **held, **dinit, **last, "dS": states * ds, **dx, "ddt_out, ddA": 2 * chunked,
            "dB, dC": 2 * groups, "chunk_states' dB partials": cs_splits * groups,
            "chunk_states' dB (their sum)": split_sum(cs_splits),
            "chunk_states' ddA_tiles": chunked // cs_cfg["BLOCK_T"],
            **dd_parts}
        steps["chunk_cumsum"]["chunk_states' ddA_tiles"] = chunked // cs_cfg["BLOCK_T"]
        if e != f32:
            steps["gradients in x's dtype"]["dx in x's dtype"] = tokens * e
    if kept:
        # handed over by the forward, alive as the recompute's would be (the backward takes
        # them: ops.torch_op), only the recompute's final state is not made
        steps["recompute"].pop("final state")
    totals = {k: sum(v.values()) for k, v in steps.items()}
    top = max(totals, key=totals.get)
    return {**steps, "peak": (top, totals[top])}


def _recompute(x, dt, A, B, C, chunk_size, dt_bias, initial_states, seq_idx, dt_softplus,
               dt_limit, configs, states_dtype, need_y, kept=None):
    """The forward's intermediates (dt_out, dA_cumsum, entry states) and, when ``need_y``, its
    pre-gate output y (else None): ``kernel_forward`` with the same configs (tuned or given),
    without D and z, and without compute_out (the forward's costliest kernel) unless y is
    needed; from the ``kept`` intermediates, only compute_out (for y) runs."""
    if kept is not None and not need_y:
        return (*kept, None)
    fwd_configs = {k: v for k, v in configs.items() if k in forward_module.KERNELS}
    y, _, (dt_out, dA_cumsum, entry) = forward_module.kernel_forward(
        x, dt, A, B, C, chunk_size, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit, configs=fwd_configs,
        states_dtype=states_dtype, return_intermediates=True, with_output=need_y,
        intermediates=kept)
    return dt_out, dA_cumsum, entry, y


KEEP_ENV = "MAMBA2_CUTILE_KEEP_INTERMEDIATES"


def keeping():
    """Whether training steps may keep their forward's intermediates (``keeps``): on unless
    ``MAMBA2_CUTILE_KEEP_INTERMEDIATES=0``, which trades the backward's recompute for memory
    between the passes. Read when a step's forward runs (a taped step keys on it)."""
    return os.environ.get(KEEP_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def keeps(x, entry_states):
    """Whether a training step's forward keeps its intermediates (dt_out, dA_cumsum, the entry
    states) for the backward, which then does not run chunk_cumsum and fwd_pass_state again (a
    share of a step's GPU time, two launches of host time): where the entry states take no more
    memory than x and the backward reads them as stored (dstate at most the chunk; states in x's
    dtype or float32, as ``entry_read_dtype`` reads them without a widened copy). A model then
    holds, per layer between its forward and backward, at most an x-sized tensor and 8 bytes
    per token and head more than its inputs, as mamba_ssm's Triton step does (it keeps its
    output and dA_cumsum); larger states are made again in the backward. The caller asks only
    for steps whose backward runs the kernels (``ops.torch_op.EagerAutograd``)."""
    return (entry_read_dtype(x.dtype, entry_states.dtype) == entry_states.dtype
            and entry_states.numel() * entry_states.element_size()
            <= x.numel() * x.element_size())


def _kept_matches(kept, x, B, chunk_size, states_dtype):
    """Whether ``kept`` are intermediates of this backward's forward: (dt_out, dA_cumsum)
    float32 (b, h, c, chunk) and entry states (b, c, h, p, n) in ``states_dtype``, on x's
    device. Others (kept at another chunk, say, after the compute chunk's mode changed between
    the passes) are not used: the backward makes its own."""
    batch, seqlen, nheads, headdim = x.shape
    nchunks = -(-seqlen // chunk_size)
    want = ((batch, nheads, nchunks, chunk_size, torch.float32),
            (batch, nheads, nchunks, chunk_size, torch.float32),
            (batch, nchunks, nheads, headdim, B.shape[3], states_dtype))
    return (len(kept) == 3 and all(
        isinstance(t, torch.Tensor) and (*t.shape, t.dtype) == w and t.device == x.device
        for t, w in zip(kept, want)))


def gate_and_skip_backward(dout, y, x, D=None, z=None, want_dD=True, want_dz=True,
                           want_dy=True, dz_dtype=torch.float32):
    """out = (y + D x) * silu(z), in float32 -> (dy in x's dtype (contiguous; the kernels'
    operand) or None, dD (float32) or None, dz (in ``dz_dtype``) or None), as
    ``reference.backward.gate_and_skip_backward``; y is read only for dz. The skip's dx (dy D)
    is not formed here: compute_out's token kernel adds it (and, when the kernels run, computes
    dD too: ``kernel_backward`` then asks for no dD here).

    The arithmetic runs in float32 over ``token_slices`` (a few slice-sized temporaries, not
    x-sized float32 tensors); dD sums the slices' partial sums in order (reproducible)."""
    batch, seqlen = x.shape[:2]
    D_full = None if D is None else (D.float()[:, None] if D.dim() == 1 else D.float())
    want_dD = want_dD and D is not None
    want_dz = want_dz and z is not None
    dy = dz = dD = None
    if want_dy:
        if z is None:
            dy = dout.to(x.dtype).contiguous()   # dout itself when it is contiguous in x's dtype
        else:
            dy = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if want_dz:
        dz = torch.empty(z.shape, dtype=dz_dtype, device=z.device)
    if want_dD:
        dD = torch.zeros(D.shape, dtype=torch.float32, device=D.device)
    if not (want_dD or want_dz or (want_dy and z is not None)):
        return dy, dD, dz
    for sl in token_slices(batch, seqlen, x[0, 0].numel()):
        d = dout[sl].float()
        if z is not None:
            zs = z[sl].float()
            sig = torch.sigmoid(zs)
            if want_dz:
                skip = y[sl].float() if D is None else y[sl].float() + x[sl].float() * D_full
                dz[sl] = d * skip * sig * (1 + zs * (1 - sig))          # d silu(z) / dz
                del skip
            d = d * zs * sig
            del zs, sig
            if want_dy:
                dy[sl] = d
        if want_dD:
            prod = d * x[sl].float()
            dD += prod.sum((0, 2)) if D.dim() == 1 else prod.sum(0)
    return dy, dD, dz


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
                    dt_limit=(0.0, math.inf), configs=None, states_dtype=None, wanted=None,
                    input_dtypes=False, kept=None):
    """Gradients of ``kernel_forward``'s (out, final_states) with respect to its inputs, like
    ``reference.backward.ssd_chunked_backward``: a dict with dx, ddt, dA, dB, dC and, for the
    inputs given, dD, dz, ddt_bias, dinitial_states, all float32 (``input_dtypes=True``: each in
    its input's dtype, as autograd returns them, each rounded once from its float32 value; dz
    and dD are converted as soon as they are complete, the others together at the end).

    ``dout`` (b, L, h, p) and ``dfinal`` (b, h, p, n): the loss' gradients with respect to the
    outputs (either may be None: zero; any strides). ``states_dtype``: the forward's entry
    states dtype (default x's). ``wanted``: the names of the inputs (``INPUTS``) whose
    gradients are needed (default all given). dD and dz come only when wanted; the kernels'
    gradients (x, dt, A, B, C, dt_bias, initial_states: one chain gives them all) come when any
    of them is wanted, and the kernels do not run otherwise. ``kept``: the forward's
    intermediates (dt_out, dA_cumsum, entry states), as ``kernel_forward`` made them with
    ``return_intermediates`` at ``chunk_size`` and ``states_dtype`` (``keeps``); the backward
    then takes them instead of running the forward's kernels again (where dz needs the
    pre-gate output, compute_out alone runs again, on them). Intermediates of another chunk or
    dtype are not used (``_kept_matches``). A list is handed over: emptied here, so that the
    entry states are freed after their last reader if the caller holds them nowhere else."""
    configs = dict(configs or {})
    given = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                 initial_states=initial_states)
    wanted = {k for k, v in given.items() if v is not None} if wanted is None else set(wanted)
    _check(dout, dfinal, x, B, configs, wanted, given)
    run_kernels = bool(wanted & set(KERNEL_INPUTS))
    need_y = z is not None and "z" in wanted
    out_dtype = (lambda name: given[name].dtype) if input_dtypes else (lambda name: torch.float32)
    batch, seqlen = x.shape[:2]
    seq_idx = None if seq_idx is None else as_int32(seq_idx).contiguous()
    # dout from autograd may be an expanded tensor (a sum's ones), absent (an unused output), or
    # a slice of a larger gradient whose size-1 dimensions keep that gradient's strides.
    dout = torch.zeros_like(x) if dout is None else with_canonical_strides(dout)
    dfinal = with_canonical_strides(dfinal)
    poison = forward_module.POISON_OUTPUTS

    y = dt_out = dA_cumsum = entry = None
    if isinstance(kept, list):
        # handed over (ops.torch_op): emptied, so that this call holds the only references and
        # the entry states are freed after the states launch, their last reader ("Memory")
        kept, handed = tuple(kept), kept
        handed.clear()
    if kept is not None and not _kept_matches(kept, x, B, chunk_size, states_dtype or x.dtype):
        kept = None
    if run_kernels or need_y:
        dt_out, dA_cumsum, entry, y = _recompute(
            x, dt, A, B, C, chunk_size, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
            configs, states_dtype, need_y, kept)
    del kept
    # With the kernels, dD comes from compute_out's token kernel (it reads dy and x anyway).
    dy, dD, dz = gate_and_skip_backward(dout, y, x, D, z,
                                        want_dD="D" in wanted and not run_kernels,
                                        want_dz=need_y, want_dy=run_kernels,
                                        dz_dtype=out_dtype("z") if need_y else torch.float32)
    del y                                      # read only for dz
    grads = {}
    if dD is not None:
        grads["dD"] = dD.to(out_dtype("D"))
    if dz is not None:
        grads["dz"] = dz
    if not run_kernels:
        return grads

    # bwd_compute_out takes entry states in x's dtype or float32 (entry_read_dtype)
    entry = entry.to(entry_read_dtype(x.dtype, entry.dtype))
    x_, B_, C_, dt_ = x.contiguous(), B.contiguous(), C.contiguous(), dt.contiguous()
    dfinal = None if dfinal is None else dfinal.float().contiguous()
    out_inputs = (dy, x_, B_, C_, dt_out, dA_cumsum, entry, seq_idx)
    # the shape and features the tuned configs are looked up for (tuned_config)
    tuning = dict(batch=batch, seqlen=seqlen, nheads=x.shape[2], headdim=x.shape[3],
                  ngroups=B.shape[2], dstate=B.shape[3], chunk_size=chunk_size, dtype=x.dtype,
                  states_dtype=entry.dtype, on_gpu=x.is_cuda)
    features = "".join(flag for flag, t in (("D", D), ("z", z), ("s", seq_idx),
                                             ("i", initial_states)) if t is not None)
    co_config = configs.get("bwd_compute_out")
    co_shape = dict(chunk_size=chunk_size, headdim=x.shape[3], dstate=B.shape[3],
                    nheads=x.shape[2], ngroups=B.shape[2], batch=batch, seqlen=seqlen)
    # (a tuned config keeps the chain's FUSE_STATES: chain_space)
    fused = compute_out_resolved(co_config, **co_shape)["FUSE_STATES"]

    # The pass over the states, then compute_out's token kernel. The pass forms dentry itself,
    # from dy and C (FUSE_ENTRY, BACKWARD_DEFAULTS): no dentry buffer, no entry launch; with
    # FUSE_ENTRY=False compute_out's dentry launch runs first, and dentry is freed before the
    # token kernel's dx exists (see "Memory").
    walk_shape = dict(headdim=x.shape[3], dstate=B.shape[3], chunk_size=chunk_size,
                      dtype=entry.dtype)
    # bf16 inputs: the products round dS to bf16, so it is stored so.
    ds_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    pass_args = (dfinal, entry, dA_cumsum, seq_idx)
    # (no initial states: the walk stops at chunk 0, without dinitial)
    pass_options = dict(poison=poison, ds_dtype=ds_dtype, dy=dy, C=C_,
                        with_dinitial=initial_states is not None)
    tuned = tuned_config("bwd_pass_state", configs, tuning, features, lambda c: run(
        bwd_pass_state_plan(None, *pass_args, config=c, **pass_options)))
    ps_config = pass_config({"bwd_pass_state": tuned}, **walk_shape)
    dentry = None
    if not ps_config["FUSE_ENTRY"]:
        dentry, = run(bwd_compute_out_plan(*out_inputs, poison=poison, config=co_config,
                                           launches="entry"))
        pass_options.update(dy=None, C=None)
    # (ddA's term at each chunk's last token as partials, one per state tile: bwd_chunk_cumsum
    # sums them where it reads ddA)
    dS, ddA_last_parts, dinitial = run(bwd_pass_state_plan(dentry, *pass_args, config=ps_config,
                                                           **pass_options))
    del pass_args, pass_options
    del dentry
    # The token kernel: compute_out's gradients, the skip's (dx += D dy, dD's partials) and,
    # fused, those through each chunk's own state; then dx is complete, in its final dtype.
    token_options = dict(poison=poison, dS=dS if fused else None, D=D,
                         dx_dtype=out_dtype("x") if fused else torch.float32)

    def time_tokens(c):
        # with the sums of dB's and dC's head-split partials: their number is the config's
        outputs = run(bwd_compute_out_plan(*out_inputs, config=c, launches="tokens",
                                           **token_options))
        return outputs, sum_splits(outputs[1]), sum_splits(outputs[2])
    co_config = tuned_config("bwd_compute_out", configs, tuning, features, time_tokens)
    if compute_out_resolved(co_config, **co_shape)["SPLIT_DX"]:
        # the token work's two launches as two plans: the states launch (the last reader of
        # the entry states and of d(C B^T)'s partials), then dB's and dC's partials summed,
        # then the dx launch, whose dx is allocated after all of those are gone ("Memory")
        dB_parts, dC_parts, ddA_tiles, *carried = run(bwd_compute_out_plan(
            *out_inputs, config=co_config, launches="states", **token_options))
        del entry, out_inputs
        # the head splits' partials, added in a fixed order (one split: the kernel's own sums)
        dB = sum_splits(dB_parts)
        del dB_parts
        dC = sum_splits(dC_parts)
        del dC_parts
        dx, ddt, ddA, dD_parts = run(bwd_compute_out_plan(
            dy, x_, B_, C_, dt_out, dA_cumsum, None, seq_idx, config=co_config, launches="dx",
            states=carried, **token_options))
        del carried, dy                        # (dy: dout itself without z)
    else:
        dx, dB_parts, dC_parts, ddt, ddA, ddA_tiles, dD_parts = run(bwd_compute_out_plan(
            *out_inputs, config=co_config, launches="tokens", **token_options))
        del entry, out_inputs, dy
        dB = sum_splits(dB_parts)
        del dB_parts
        dC = sum_splits(dC_parts)
        del dC_parts
    del token_options
    if fused:
        del dS
        # the states' term at each chunk's last token, as partials per token tile, is summed
        # by bwd_chunk_cumsum where it reads ddA (before the pass' term, as the terms' order)
        chunk_ends = (ddA_tiles, ddA_last_parts)
        if configs.get("bwd_chunk_states") is not None:
            # unused, but a typo in it must not pass unnoticed
            resolve_config(configs["bwd_chunk_states"], chunk_states_config(
                chunk_size=chunk_size, nheads=x.shape[2], ngroups=B.shape[2], batch=batch,
                seqlen=seqlen))
    else:
        # chunk_states adds its dx, ddt_out and ddA_cumsum into compute_out's (no second dx);
        # its term at each chunk's last token comes as partials per token tile, like the fused
        # kernel's
        states_args = (dS, x_, B_, dt_out, dA_cumsum, seq_idx)
        scratch = []

        def time_states(c):             # a search's runs add into copies (each runs repeatedly)
            if not scratch:
                scratch.append((dx.clone(), ddt.clone(), ddA.clone()))
            return run(bwd_chunk_states_plan(*states_args, config=c, accumulate=scratch[0]))
        cs_config = tuned_config("bwd_chunk_states", configs, tuning, features, time_states)
        del scratch
        dx, dB_s, ddt, ddA, ddA_tiles = run(bwd_chunk_states_plan(
            *states_args, poison=poison, config=cs_config, accumulate=(dx, ddt, ddA)))
        del states_args
        del dS
        # chunk_states' dB, summed over the group's heads (its head splits' partials in order)
        dB += sum_splits(dB_s)
        del dB_s
        chunk_ends = (ddA_tiles, ddA_last_parts)
    del ddA_tiles, ddA_last_parts
    dD = None
    if D is not None and "D" in wanted:
        # the token tiles' partials, in a fixed order (and over p too for a 1-d D)
        dD = dD_parts.sum((0, 1) if D.dim() == 2 else (0, 1, 3))
    del dD_parts
    cumsum_args = (ddt, ddA, dt_, A.contiguous(),
                   None if dt_bias is None else dt_bias.contiguous(), dt_softplus, dt_limit)
    cc_config = tuned_config("bwd_chunk_cumsum", configs, tuning, features, lambda c: run(
        bwd_chunk_cumsum_plan(*cumsum_args, config=c, chunk_ends=chunk_ends)))
    ddt, dA, ddt_bias = bwd_chunk_cumsum(*cumsum_args, poison=poison, config=cc_config,
                                         chunk_ends=chunk_ends)
    del ddA, chunk_ends, cumsum_args
    if dD is not None:
        grads["dD"] = dD.to(out_dtype("D"))
    grads.update(dx=dx.to(out_dtype("x")), ddt=ddt.to(out_dtype("dt")), dA=dA.to(out_dtype("A")),
                 dB=dB.to(out_dtype("B")), dC=dC.to(out_dtype("C")))
    del dx
    if dt_bias is not None:
        grads["ddt_bias"] = ddt_bias.to(out_dtype("dt_bias"))
    if initial_states is not None:
        grads["dinitial_states"] = dinitial.to(out_dtype("initial_states"))
    return grads


# The backward as a custom operator ------------------------------------------------------------
#
# torch.compile traces the forward operator's registered backward (ops/torch_op.py) into the
# backward graph, and cannot trace the kernels' launches: so the kernels' backward is an opaque
# operator too, ``torch.ops.mamba2_cutile.ssd_backward``, whose fake gives the gradients' shapes.
# It returns one tensor per input of ``INPUTS``, in that input's dtype (``input_dtypes``: rounded
# once from float32, as autograd would, but without a float32 copy of dx alive beside it), and an
# empty float32 one for each input that is not given or whose gradient is not wanted. Its work,
# ``ssd_backward``, is callable directly: eager training steps do (``ops.torch_op.EagerAutograd``).

def _gradient_shapes(x, dt, A, B, C, D, z, dt_bias, initial_states, wanted):
    inputs = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    return [tuple(t.shape) if t is not None and w else (0,)
            for t, w in zip(inputs, wanted, strict=True)]


def ssd_backward(dout: Optional[Tensor], dfinal: Optional[Tensor], x: Tensor, dt: Tensor,
                 A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
                 dt_bias: Optional[Tensor], initial_states: Optional[Tensor],
                 seq_idx: Optional[Tensor], cu_seqlens: Optional[Tensor], *, chunk_size: int,
                 dt_softplus: bool, dt_min: float, dt_max: float,
                 state_dtype: Optional[torch.dtype], wanted: list[bool]) -> list[Tensor]:
    return backward_work(dout, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx,
                         cu_seqlens, chunk_size=chunk_size, dt_softplus=dt_softplus,
                         dt_min=dt_min, dt_max=dt_max, state_dtype=state_dtype, wanted=wanted)


def backward_work(dout, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx,
                  cu_seqlens, *, chunk_size, dt_softplus, dt_min, dt_max, state_dtype, wanted,
                  kept=None, placeholders=True):
    """``ssd_backward``'s work; ``kept``: the forward's intermediates where it kept them
    (``keeps``; an eager training step's forward, ``ops.torch_op.EagerAutograd``).
    ``placeholders``: an input's gradient not wanted is an empty float32 tensor, as the
    operator's schema needs (else None: allocations fewer for an eager step)."""
    if len(wanted) != len(INPUTS):
        raise ValueError(f"wanted must have one flag per input of {INPUTS}, got {len(wanted)}")
    # The forward's preparation of its inputs (the values were checked there).
    seq_idx = check_values(x, seq_idx, cu_seqlens, check=False)
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx = (
        as_kernel_input(t) for t in (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx))
    names = [n for n, w in zip(INPUTS, wanted) if w]
    # the forward's chunk: the caller's, or where the H200 measured another faster, that one
    # (ops/tuning/compute_chunk.py)
    g = kernel_backward(dout, dfinal, x, dt, A, B, C, kernel_chunk(chunk_size, x, B), D=D, z=z,
                        dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
                        dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max),
                        states_dtype=state_dtype or x.dtype, wanted=names, input_dtypes=True,
                        kept=kept)
    return [g["d" + n] if n in names
            else x.new_empty((0,), dtype=torch.float32) if placeholders else None
            for n in INPUTS]


backward_op = torch.library.custom_op("mamba2_cutile::ssd_backward", ssd_backward, mutates_args=())


@backward_op.register_fake
def _(dout, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, *,
      chunk_size, dt_softplus, dt_min, dt_max, state_dtype, wanted):
    inputs = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    shapes = _gradient_shapes(*inputs, wanted)
    return [x.new_empty(s, dtype=t.dtype if s != (0,) else torch.float32)
            for s, t in zip(shapes, inputs, strict=True)]
