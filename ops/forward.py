"""The whole forward pass as three kernel launches.

    (a) chunk_cumsum     dt -> processed dt and the within-chunk cumsum of dt * A (log2 units)
    (b) fwd_pass_state   chunk states and the pass over chunks -> entry states, final state
    (c) compute_out      entry states + the quadratic form inside each chunk -> outputs

The same code runs on both backends: ``ops.runtime.launch.launch`` compiles and launches on CUDA
tensors and interprets on CPU tensors. Inputs arrive checked and contiguous from
``ops.ssd_combined.mamba_chunk_scan_combined``.

Each kernel takes a config (tile sizes, variants, compiler hints: see each module's
``default_config`` and ``search_space``); ``configs`` maps a kernel's name to its config, and a
missing kernel (or a missing key of a config) takes the default.
"""
import hashlib
import math

import torch

from ops.kernels import chunk_cumsum as chunk_cumsum_module
from ops.kernels import compute_out as compute_out_module
from ops.kernels import fwd_pass_state as fwd_pass_state_module
from ops.kernels.chunk_cumsum import chunk_cumsum
from ops.kernels.compute_out import compute_out
from ops.kernels.fwd_pass_state import fwd_pass_state
from ops.runtime.launch import PlanTemplate, run, tensor_key
from ops.tuning.autotune import mode, seqlen_bucket, tuner
from ops.kernels.common import as_int32, check_sizes

# Tests set this to NaN-fill every output buffer before the kernels write it, so an element a
# kernel misses shows up; left off, the buffers are uninitialised (no extra memory traffic).
POISON_OUTPUTS = False


# The kernels of the forward pass, in launch order: name -> module. Each module has
# ``default_config``, ``search_space``, ``<name>_plan`` (an ``ops.runtime.launch.Plan``) and ``<name>``.
KERNELS = {"chunk_cumsum": chunk_cumsum_module, "fwd_pass_state": fwd_pass_state_module,
           "compute_out": compute_out_module}


_DEFAULTS = {}


def _config(name, configs, shape, features, run):
    """The config a kernel runs with: the one given, else (on a GPU) the tuned one for this
    shape -- from the cache or the committed table, or a search where one is asked for
    (``ops/tuning/autotune.py``) -- else the default. ``run(config)`` launches the kernel.

    Called on every forward, so the answer is memoised per exact shape (on the tuner object
    off the CPU, so a new tuner starts afresh): building the search space and the tuner's key
    costs more Python time, for the three kernels together, than a whole forward pass takes at
    1K tokens (``tests/benchmark/results/host_time_h200.csv``; PERF_NOTES.md, "An eager call
    replays the previous call's launches")."""
    if configs.get(name) is not None:
        return configs[name]
    how = mode() if shape["on_gpu"] else "off"     # the interpreter is not timed: defaults only
    memo_key = (name, features, how, tuple(shape.items()))
    memo = _DEFAULTS if how == "off" else tuner().chosen
    if memo_key not in memo:
        memo[memo_key] = _choose(name, shape, features, run, how)
    return memo[memo_key]


def _choose(name, shape, features, run, how):
    module = KERNELS[name]
    default = module.default_config(**shape)
    if how == "off":
        return default
    key, space = tuning_key(name, shape, features)
    if how == "table":
        return tuner().lookup(name, key, space, default)
    return tuner().best(name, key, space, default, run)


def tuning_key(name, shape, features, space=None):
    """(the tuner's shape key, the search space) of kernel ``name`` at ``shape`` (as
    ``kernel_forward`` describes a call) with ``features`` ("D", "z", "s", "i" present).
    ``space``: the candidates, where they are not the forward kernel's own search space (the
    backward's kernels: ``ops.backward.chain_space``)."""
    sizes = {k: v for k, v in shape.items() if k != "on_gpu"}
    key = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
           for k, v in sizes.items()}
    key["seqlen"] = seqlen_bucket(shape["seqlen"])
    key["features"] = features
    if space is None:
        space = KERNELS[name].search_space(**sizes)
    # A fingerprint of the candidates: when a search space changes, its shapes are tuned again
    # instead of reusing a winner picked from the old list.
    key["space"] = hashlib.sha256(repr(space).encode()).hexdigest()[:8]
    return key, space


# Plans of recent calls, by what they depend on (ops.runtime.launch.PlanTemplate): a call like an earlier
# one re-uses its plan instead of building it again (tens of microseconds of Python per kernel).
_PLANS = {}
PLAN_CACHE_SIZE = 512


def _run_step(name, args, options, config, stream=None):
    """Run kernel ``name``'s plan for ``args`` and ``options`` (its ``*_plan`` function's
    positional and keyword arguments) with ``config`` (on ``stream`` for CUDA tensors, looked up
    once per forward pass); returns the plan's outputs."""
    plan_of = getattr(KERNELS[name], f"{name}_plan")
    if POISON_OUTPUTS:
        return run(plan_of(*args, **options, poison=True, config=config), stream)
    values = tuple(args) + tuple(options.values())
    key = (name, tuple(options), tensor_key(values), tuple(sorted(config.items())))
    try:
        template = _PLANS.get(key)
    except TypeError:                                  # an unhashable config value: no re-use
        return run(plan_of(*args, **options, config=config), stream)
    if template is None:
        plan = plan_of(*args, **options, config=config)
        template = PlanTemplate(plan, values)
        if template.usable:
            if len(_PLANS) >= PLAN_CACHE_SIZE:
                _PLANS.pop(next(iter(_PLANS)))         # the oldest
            _PLANS[key] = template
        return run(plan, stream)
    return run(template.bind(values), stream)


def kernel_forward(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                   initial_states=None, seq_idx=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf), configs=None, states_dtype=None,
                   return_intermediates=False, with_output=True, intermediates=None):
    """-> (out (b, L, h, p) in x's dtype, final_states (b, h, p, n) float32), and with
    ``return_intermediates`` a third item (dt_out, dA_cumsum, entry_states).
    ``with_output=False`` stops before compute_out (out is then None): the backward's recompute
    wants only the intermediates. ``intermediates``: those of an earlier call on the same
    inputs (the backward's, kept by the forward), so that only compute_out runs (final_states
    is then None).

    ``states_dtype``: the dtype of the stored entry states (default x's dtype).

    ``configs``: ``{"chunk_cumsum": {...}, "fwd_pass_state": {...}, "compute_out": {...}}``,
    any of them optional (or None). A kernel without a config runs its default on the CPU interpreter,
    and on a GPU the tuned config for the shape (``ops/tuning/autotune.py``: a cached search's, else the
    committed table's; ``MAMBA2_CUTILE_AUTOTUNE=1`` searches, ``=0`` runs the defaults)."""
    check_sizes(headdim=x.shape[3], dstate=B.shape[3])   # before anything runs
    configs = dict(configs or {})
    unknown = set(configs) - set(KERNELS)
    if unknown:
        raise ValueError(f"configs for unknown kernels {sorted(unknown)}; expected {tuple(KERNELS)}")
    seq_idx = as_int32(seq_idx)          # ids are small; the kernels compare int32
    batch, seqlen, nheads, headdim = x.shape
    states_dtype = states_dtype or x.dtype
    shape = dict(batch=batch, seqlen=seqlen, nheads=nheads, headdim=headdim, ngroups=B.shape[2],
                 dstate=B.shape[3], chunk_size=chunk_size, dtype=x.dtype, states_dtype=states_dtype,
                 on_gpu=x.is_cuda)
    features = "".join(flag for flag, on in (("D", D is not None), ("z", z is not None),
                                             ("s", seq_idx is not None), ("i", initial_states is not None)) if on)

    stream = torch.cuda.current_stream() if x.is_cuda else None
    if intermediates is not None:
        (dt_out, dA_cumsum, entry_states), final_states = intermediates, None
    else:
        cumsum_args = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        cfg = _config("chunk_cumsum", configs, shape, features,
                      lambda c: chunk_cumsum(dt, A, chunk_size, **cumsum_args, config=c))
        dt_out, dA_cumsum = _run_step("chunk_cumsum", (dt, A, chunk_size), cumsum_args, cfg,
                                      stream)

        # Entry states are stored in x's dtype by default: compute_out rounds them to C's (==
        # x's) dtype for its product anyway, so 16-bit storage changes nothing there but halves
        # the traffic (mamba_ssm does the same). The final state stays float32.
        state_args = dict(initial_states=initial_states, seq_idx=seq_idx,
                          states_dtype=states_dtype)
        cfg = _config("fwd_pass_state", configs, shape, features,
                      lambda c: fwd_pass_state(x, B, dt_out, dA_cumsum, **state_args, config=c))
        entry_states, final_states = _run_step("fwd_pass_state", (x, B, dt_out, dA_cumsum),
                                               state_args, cfg, stream)

    out = None
    if with_output:
        out_args = dict(D=D, z=z, seq_idx=seq_idx)
        cfg = _config("compute_out", configs, shape, features,
                      lambda c: compute_out(x, B, C, dt_out, dA_cumsum, entry_states, **out_args,
                                            config=c))
        out, = _run_step("compute_out", (x, B, C, dt_out, dA_cumsum, entry_states), out_args,
                         cfg, stream)
    if return_intermediates:
        return out, final_states, (dt_out, dA_cumsum, entry_states)
    return out, final_states
