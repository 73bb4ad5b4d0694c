"""What the kernel tests (test_chunk_cumsum.py, test_fwd_pass_state.py, test_compute_out.py,
test_forward.py) share: devices, problems and tolerances, the upstream reference values each
kernel is fed, the machinery that runs every config of a search space against the default
config, and the ahead-of-time compilation helpers.

Against the reference
    Each kernel is fed the SAME upstream values as its reference step (``reference_states``).
    The reference steps run in float64; their outputs are rounded to what the kernel takes
    (float32, dA_cumsum times log2(e)) and the reference for the next step is computed from
    those rounded values (upcast again), so only the kernel's own rounding is measured.

    Tolerances (``TOL``), as ||out - ref|| / ||ref|| against float64:
      float32 inputs   the kernels compute in float32 throughout (float32 tensor-core operands,
                       float32 accumulation): a few ulps (~1e-7) per operation, summed over at
                       most a chunk's tokens and dstate terms; observed <= 2.1e-6 (whole forward
                       pass, H200 and interpreter alike), <= 2.2e-7 per kernel; bound 2e-5.
      16-bit inputs    the products take 16-bit operands: the dt/decay-weighted x, the CB
                       weights and the entry state are rounded to bf16 (8 significant bits, step
                       2^-8) or fp16 (11 bits), and a 16-bit output is rounded once more:
                       observed <= 2.7e-3 (bf16) and <= 3.1e-4 (fp16), the same on an H200 as in
                       the interpreter; bounds 1e-2 and 2e-3 (the float32 states: half of that).

Against the default config (``cases``, ``check``)
    A tuner picks, per shape, whichever config of ``search_space`` runs fastest, so every one of
    them must give the default's result. Each kernel is run, for every config of its search
    space built for a small shape (plus configs outside the space that reach code paths the
    small shape's space does not), on the same inputs as the default config, with its outputs
    NaN-poisoned first, and compared with the default's outputs.

    The shape (``VARIANT_SIZES``): 170 tokens in chunks of 64 (three chunks, the last one
    ragged: an odd number, so the two-chunks-per-iteration loop also runs its single-chunk
    tail), 8 heads in 2 groups (so 1, 2 and 4 heads per block all divide a group), headdim 32,
    dstate 64, packed sequences (one boundary inside a chunk, one on a chunk boundary), initial
    states, D per headdim column, z.

    Tolerances (``VARIANT_TOL``), relative in norm, against the default config:
      float32   the variants perform the same float32 operations; only the order in which a
                product's terms are summed can differ (a transposed product), a few ulps: 1e-5.
      bfloat16  the same, but the outputs (and the weights and entry states, which are
                tensor-core operands) are rounded to bf16 (8 significant bits): a last-bit
                difference before that rounding can move a value by one bf16 step (2^-8
                relative). Such flips are rare, so the norm of the difference stays far below
                one step: 4e-3 (as for the interpreter-vs-GPU parity tests).

    The CPU runs go through the interpreter; the same comparisons on a CUDA GPU carry the
    ``gpu`` marker (they compile every config: minutes).

Ahead-of-time compilation (``with_archs``, ``meta_inputs``, ``compiles``, ``compile_kind``)
    The arguments are built exactly as the launchers build them (their ``*_plan`` functions, fed
    tensors on the "meta" device), so the tests compile what runs: a type or shape error in any
    variant, on any architecture, fails without a GPU (``ops/tools/aot.py``).
"""
import functools
from typing import NamedTuple

import pytest
import torch

from ops.kernels import chunk_cumsum as cumsum_mod
from ops.kernels import compute_out as out_mod
from ops.kernels import fwd_pass_state as state_mod
from ops.checks import cdiv
from ops.forward import KERNELS
from ops.tools.aot import ARCHS, compile_cubin
from ops.tools.plans import meta_plan
from reference import chunked
from reference.common import LOG2E
from reference.problems import make_problem
from reference.validate import rel_err   # NaN/inf anywhere gives inf: never passes

DEVICES = [pytest.param("cpu", id="interpret"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]

# Against the reference ---------------------------------------------------------------------------

TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]
OPTIONS = dict(dt_softplus=True, dt_limit=(0.0, 1.5))

# Small problems for the interpreter (headdim and dstate are at least 16: tile dimensions).
SMALL = dict(batch=2, nheads=4, headdim=16, ngroups=2, dstate=32)


def synced(launcher, *args, **kwargs):
    """Run a launcher and wait for the GPU, so a failure is reported by the right test."""
    out = launcher(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def f64(t):
    """A float tensor in float64 (None stays None, integer tensors stay as they are)."""
    return None if t is None else (t.double() if t.is_floating_point() else t)


def to_device(kw, device):
    return {k: v.to(device) for k, v in kw.items()}


def upstream(kw, chunk_size):
    """Reference (a) in float64, rounded to the kernels' units: (dt_out, dA_cumsum log2) fp32."""
    dt_out, dA = chunked.chunk_cumsum(kw["dt"].double(), kw["A"].double(), chunk_size,
                                      f64(kw.get("dt_bias")), **OPTIONS)
    return dt_out.float(), (dA * LOG2E).float()


class Upstream(NamedTuple):
    """A problem and what reaches fwd_pass_state and compute_out from before them."""
    kw: dict                # the problem's inputs (CPU)
    dt: torch.Tensor        # reference (a)'s dt_out, float32: what the kernels take
    dA: torch.Tensor        # its dA_cumsum times log2(e), float32
    ref_dt: torch.Tensor    # the same two upcast to float64, in the reference's units
    ref_dA: torch.Tensor
    entry: torch.Tensor     # reference (b) from those: entry states (float64)
    final: torch.Tensor     # and final states (float64)


def reference_states(problem, chunk_size, dtype, seed):
    """``make_problem`` at ``SMALL`` updated with ``problem``, reference (a) rounded to the
    kernels' units, and reference (b) computed in float64 from those rounded values."""
    kw = make_problem(**{**SMALL, **problem}, dtype=dtype, seed=seed)
    dt_k, dA_k = upstream(kw, chunk_size)
    ref_dt, ref_dA = dt_k.double(), dA_k.double() / LOG2E
    entry, final = chunked.fwd_pass_state(kw["x"].double(), kw["B"].double(), ref_dt, ref_dA,
                                          f64(kw.get("initial_states")), kw.get("seq_idx"))
    return Upstream(kw, dt_k, dA_k, ref_dt, ref_dA, entry, final)


# Against the default config ----------------------------------------------------------------------

VARIANT_CHUNK = 64
VARIANT_SIZES = dict(batch=1, seqlen=170, nheads=8, headdim=32, ngroups=2, dstate=64)
VARIANT_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
VARIANT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def variant_shape(dtype):
    """The small shape as ``default_config`` / ``search_space`` take it."""
    return dict(VARIANT_SIZES, chunk_size=VARIANT_CHUNK, dtype=dtype)


def label(config, default):
    changed = {k: v for k, v in config.items() if default.get(k) != v}
    return "-".join(f"{k}={v}" for k, v in changed.items()) or "default"


def space_cases(module, shape, names=("fp32", "bf16")):
    """(the search space of ``module`` at ``shape``, with its default first, and pytest params
    (dtype name, config) for each other config of it in each of ``names``)."""
    default = module.default_config(**shape)
    space = module.search_space(**shape)
    assert space[0] == default, "the default config comes first in the search space"
    return space, [pytest.param(name, cfg, id=f"{name}-{label(cfg, default)}")
                   for name in names for cfg in space[1:]]


def cases(module, extra=()):
    """pytest params (dtype name, config) for every config of the space at the small shape."""
    params = []
    for name, dtype in VARIANT_DTYPES.items():
        default = module.default_config(**variant_shape(dtype))
        configs = module.search_space(**variant_shape(dtype)) + [{**default, **e} for e in extra]
        assert default in configs, "the default config must be part of the search space"
        params += [pytest.param(name, cfg, id=f"{name}-{label(cfg, default)}") for cfg in configs]
    return params


def int64_cases(module, extra=()):
    """bf16 cases of ``cases`` through the 64-bit-indexed kernel (INDEX64), the one that runs
    when a tensor reaches 2**31 elements. Tile addressing differs from the 32-bit twin (no TMA),
    so each config is checked on it too; the interpreter does not index, so these are GPU-only."""
    return [pytest.param(name, {**cfg, "INDEX64": True}, id=f"{p.id}-int64")
            for p in cases(module, extra) for name, cfg in [p.values] if name == "bf16"
            and not cfg["INDEX64"] and not refused_int64(cfg)]


def refused_int64(cfg):
    """compute_out with several heads per block and 32-row tiles or eight worker warps: these
    faulted in the 64-bit kernel on an H200, so compute_out_plan refuses them there (tested in
    test_compute_out.py)."""
    return cfg.get("HEADS_PER_BLOCK", 1) > 1 and (
        cfg.get("BLOCK_M") == 32 or cfg.get("num_worker_warps") == 8)


@functools.lru_cache(maxsize=None)
def problem(dtype_name, device, d="2d", z=True):
    """Inputs, and the upstream kernels' outputs (default configs), on ``device``."""
    kw = make_problem(**VARIANT_SIZES, dtype=VARIANT_DTYPES[dtype_name], D=d, z=z,
                      seq_boundaries=[50, 128], seed=11)
    kw = to_device(kw, device)
    dt_out, dA = cumsum_mod.chunk_cumsum(kw["dt"], kw["A"], VARIANT_CHUNK, dt_bias=kw["dt_bias"],
                                         **OPTIONS)
    entry, _ = state_mod.fwd_pass_state(kw["x"], kw["B"], dt_out, dA, kw["initial_states"],
                                        kw["seq_idx"], states_dtype=kw["x"].dtype)
    return kw, dt_out, dA, entry


def run_cumsum(dtype_name, device, config):
    kw, *_ = problem(dtype_name, device)
    dt = kw["dt"].to(VARIANT_DTYPES[dtype_name])     # dt may come in any float dtype
    return cumsum_mod.chunk_cumsum(dt, kw["A"], VARIANT_CHUNK, dt_bias=kw["dt_bias"],
                                   poison=True, config=config, **OPTIONS)


def run_state(dtype_name, device, config):
    kw, dt_out, dA, _ = problem(dtype_name, device)
    return state_mod.fwd_pass_state(kw["x"], kw["B"], dt_out, dA, kw["initial_states"],
                                    kw["seq_idx"], states_dtype=kw["x"].dtype, poison=True,
                                    config=config)


def run_out(dtype_name, device, config, d="2d", z=True):
    kw, dt_out, dA, entry = problem(dtype_name, device, d, z)
    return (out_mod.compute_out(kw["x"], kw["B"], kw["C"], dt_out, dA, entry, D=kw["D"],
                                z=kw.get("z"), seq_idx=kw["seq_idx"], poison=True,
                                config=config),)


@functools.lru_cache(maxsize=None)
def default_result(run, dtype_name, device, *options):
    return run(dtype_name, device, None, *options)


def check(run, dtype_name, config, device, *options):
    """``config``'s outputs against the default config's, output by output."""
    outs = run(dtype_name, device, config, *options)
    if device == "cuda":
        torch.cuda.synchronize()
    refs = default_result(run, dtype_name, device, *options)
    tol = VARIANT_TOL[VARIANT_DTYPES[dtype_name]]
    for out, ref in zip(outs, refs, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert rel_err(out, ref) < tol


def small_plan(name, config):
    """Kernel ``name``'s launch for ``config`` at the small shape in float32, built on meta
    tensors as ``ops.forward`` makes it (``ops.tools.plans.meta_plan``), not run."""
    return meta_plan(name, **variant_shape(torch.float32), config=config)


# Ahead-of-time compilation -----------------------------------------------------------------------

def with_archs(variants):
    """The first variant on every architecture, the others on sm_90 only (keeps the files fast:
    a compute_out compile takes seconds)."""
    return [pytest.param(v.values[0], arch, id=f"{v.id}-{arch}")
            for i, v in enumerate(variants) for arch in (ARCHS if i == 0 else ["sm_90"])]


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


# Problem shape for every compiled variant: only dtypes, sizes that are compile-time constants
# (chunk, headdim, dstate, tiles) and flags matter; the sequence length does not.
BATCH, SEQLEN, NHEADS, NGROUPS = 2, 1000, 8, 2


def meta_inputs(v):
    """x, B, dt_out, dA_cumsum and seq_idx (or None) on meta tensors for a compile variant ``v``
    (a dict with dtype, chunk, p (headdim), n (dstate) and seq)."""
    x = meta(BATCH, SEQLEN, NHEADS, v["p"], dtype=v["dtype"])
    B = meta(BATCH, SEQLEN, NGROUPS, v["n"], dtype=v["dtype"])
    nchunks = cdiv(SEQLEN, v["chunk"])
    dt_out, dA = meta(BATCH, NHEADS, nchunks, v["chunk"]), meta(BATCH, NHEADS, nchunks, v["chunk"])
    seq = meta(BATCH, SEQLEN, dtype=torch.int32) if v["seq"] else None
    return x, B, dt_out, dA, seq


def compiles(plan, arch):
    """Whether the launch ``plan`` and the launches it needs first (its ``before``) compile to
    non-empty cubins for ``arch``."""
    return all(compiles(step, arch) for step in plan.before) and \
        len(compile_cubin(plan.kernel, plan.args, arch)) > 0


# Tuning variants at a realistic shape: a Mamba-2 layer of a ~2.7B model (batch 1, 16K tokens, 80
# heads of 64, one group, bf16, chunks of 256), launched as ops.forward does. Every config of
# every search space compiles there (for sm_90, ``tests/benchmark/compile_all.py`` checks them
# all, with registers and spills: minutes); the tests compile the defaults and one config of each
# kind of variant (each kernel's KINDS table): for sm_90 and sm_100 where the kind changes the
# code's structure (operand order, heads per block, two chunks per iteration), for sm_90 only
# where it changes hints (latency, occupancy, clusters).

LAYER = dict(batch=1, seqlen=16384, nheads=80, headdim=64, ngroups=1, chunk_size=256,
             dtype=torch.bfloat16)
BOTH, HOPPER = ["sm_90", "sm_100"], ["sm_90"]


def layer_plan(name, dstate, config):
    """The ``Plan`` of one launch of kernel ``name`` at LAYER with ``dstate`` and ``config``, as
    ``ops.forward`` makes it (``ops.tools.plans.meta_plan``)."""
    return meta_plan(name, **LAYER, dstate=dstate, config=config)


def is_default(config, default):
    return config == default


def kind_params(name, kinds, default_dstates=(128,)):
    """pytest params (dstate, kind, pick, arch), one per architecture: kernel ``name``'s default
    config at each of ``default_dstates`` (the first for sm_90 and sm_100, the others for sm_90),
    then its KINDS rows (dstate, kind, which config of the search space, architectures)."""
    defaults = [(n, "default", is_default, BOTH if i == 0 else HOPPER)
                for i, n in enumerate(default_dstates)]
    return [pytest.param(n, kind, pick, arch, id=f"{name}-n{n}-{kind}-{arch}")
            for n, kind, pick, archs in defaults + list(kinds) for arch in archs]


def compile_kind(name, dstate, kind, pick, arch):
    """Compile for ``arch`` the first config of kernel ``name``'s search space at LAYER that
    ``pick(config, default)`` selects."""
    module = KERNELS[name]
    shape = dict(LAYER, dstate=dstate)
    default = module.default_config(**shape)
    space = module.search_space(**shape)
    assert space[0] == default, "the default config comes first in the search space"
    config = next((c for c in space if pick(c, default)), None)
    assert config is not None, f"no {kind!r} config in the search space"
    assert compiles(layer_plan(name, dstate, config), arch)
