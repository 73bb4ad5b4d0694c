"""The chunk the kernels compute with, which may differ from the caller's ``chunk_size``.

The chunked algorithm computes the same function at every chunk size: only the order of the
sums differs, so only rounding (the last paragraph). The caller's chunk is a model's config value
(Mamba-2's configs say 256), chosen for mamba_ssm's Triton kernels, and on an H200 this
project's kernels are faster at 128, forward and backward. So by default ("auto") the forward
and the backward kernels compute with the chunk ``AUTO_RULES`` names for the call's shape and
device, else the caller's.

    MAMBA2_CUTILE_COMPUTE_CHUNK=auto     the default, as above
    MAMBA2_CUTILE_COMPUTE_CHUNK=caller   the caller's chunk exactly, forward and backward (the
                                         lowest memory: see "What it costs")
    MAMBA2_CUTILE_COMPUTE_CHUNK=128      this chunk (a power of two in [16, 256]) for every
                                         call, forward and backward

Why 128 (``tests/benchmark/PERF_NOTES.md``, "The forward computes a caller's 256 at 128 on the
H200" and "The backward computes at the forward's chunk"; notebooks 06, 07 and 08): halving the
chunk halves the quadratic work inside a chunk and doubles the cheap chunk count. The forward
alone takes less time at 128 at every model and grid shape timed reliably (under
``tests/benchmark/results/``: ``models_h200.csv``, the default rows of
``fwd_pass_state_split_h200.csv``, ``chunk_sweep_h200.csv``), and so does a training step's scan
wherever the GPU, not the host, sets its time, the more so with the pass over the states forming
dentry itself (``ops.backward.BACKWARD_DEFAULTS``; ``fwd_bwd_backward_at_128_h200.csv``,
``bwd_fuse_entry_h200.csv``): so the backward computes at the forward's chunk. At dstate 64 a
forward of a few thousand tokens is mostly host time, so there "auto" rests on training steps
timed from CUDA-graph replays (``fwd_bwd_chunks_dstate64_h200.csv``): at 4K tokens 128 took
1.17x less GPU time than 256 (eager, 1.03x less), and chunk 64 lost to 128 at 4K, 16K and 64K by
1.13-1.29x; so "auto" starts there at 4K tokens, the shortest timed. Elsewhere too chunk 64 is no
faster than 128 at nearly twice its peak memory (``fwd_bwd_chunks_h200.csv``), so 128.

Where "auto" applies (``AUTO_RULES``): a GPU whose name says H200, bf16 inputs, a caller's chunk
of 256, headdim up to 64, dstate 65-256 from 2K tokens and 33-64 from 4K, and entry states at
the new chunk under 2**31 elements (so the kernels stay 32-bit indexed, as measured). Measured
were headdim 64, dstate 64, 128 and 256, 2K-256K tokens and 24-128 heads; the rule extends that
to the sizes that compile to the same tiles. Everywhere else -- other GPUs (other Hopper parts
included), dtypes, sizes, a caller's chunk other than 256, the CPU interpreter -- "auto" keeps
the caller's chunk.

What it costs: the entry states, (b, chunks, h, p, n), double at half the chunk, and so does
the backward's dS, their gradient. That memory is transient, one layer's scan at a time: the
forward's entry states are freed when it returns (the backward recomputes them), but where a
training step's forward keeps them for its backward (``ops.backward.keeps``: no larger than x,
which at 128 means dstate up to 128), until that backward has run. The forward's
peak and a training step's rise accordingly (``models_h200.csv``'s ``peak_mem_mb``;
``fwd_bwd_h200.csv``, beside Triton's, against the same step at exactly the caller's 256,
``fwd_bwd_caller_h200.csv``; PERF_NOTES.md compares them).
``MAMBA2_CUTILE_COMPUTE_CHUNK=caller`` gives it back, at the time the caller's chunk takes.

The rounding difference is measured through the interpreter by
``tests/tuning/test_compute_chunk.py`` (the output, and the gradients, against float64 at the
caller's 256; its docstrings give the distances): at 128 the error is that of 256 give or take
rounding, for float32 and bf16 inputs alike (asserted: within 1.5 times 256's). Its GPU test
checks the output's bound on the GPU at a Mamba-2 layer's shape, and that the op's gradients are
the kernels' at the chunk chosen. So, memory aside, a change of chunk is a change of rounding
only, no larger than the rounding at either chunk.
"""
import functools
import os

import torch

from ops.checks import tile_size

ENV = "MAMBA2_CUTILE_COMPUTE_CHUNK"

# (the GPU's name, x's dtype, caller's chunk, largest headdim, dstate's tiles, least seqlen) ->
# the chunk to compute with. Each rests on the H200 measurements the docstring points to; other
# Hopper GPUs (H100, H20, GH200) are the same architecture but were not measured, so they are not
# named.
AUTO_RULES = [
    dict(gpu="H200", dtype=torch.bfloat16, caller=256, max_headdim=64, dstate_tiles=(128, 256),
         min_seqlen=2048, chunk=128),
    dict(gpu="H200", dtype=torch.bfloat16, caller=256, max_headdim=64, dstate_tiles=(64,),
         min_seqlen=4096, chunk=128),
]
# The entry states, (b, chunks, h, p, n), double at half the chunk; past this many elements the
# kernels would switch to their 64-bit-indexed (slower) variants where the caller's chunk would
# not need them (ops.runtime.launch.fit_index_width), which nothing measured: "auto" stops short of it.
INDEX32_LIMIT = 2 ** 31


def mode():
    """"auto", "caller" or an int chunk, from ``MAMBA2_CUTILE_COMPUTE_CHUNK`` (default auto);
    anything else is refused, naming the variable."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value == "caller":
        return "caller"
    try:
        chunk = int(value)
    except ValueError:
        chunk = None
    if chunk is None or chunk < 16 or chunk > 256 or chunk & (chunk - 1):
        raise ValueError(f"{ENV} must be 'auto', 'caller' or a power of two in [16, 256], got "
                         f"{os.environ[ENV]!r}")
    return chunk


def _gpu_name(device):
    if device.type != "cuda":
        return None
    return _name_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _name_of(index):
    return torch.cuda.get_device_name(index)


def auto_chunk(chunk_size, *, gpu, dtype, batch, seqlen, nheads, headdim, dstate):
    """The chunk ``AUTO_RULES`` give for this call on the GPU named ``gpu`` (None: not a GPU),
    else ``chunk_size``."""
    for rule in AUTO_RULES:
        chunk = rule["chunk"]
        entry_elements = batch * -(-seqlen // chunk) * nheads * headdim * dstate
        if (gpu is not None and rule["gpu"] in gpu and dtype == rule["dtype"]
                and chunk_size == rule["caller"] and headdim <= rule["max_headdim"]
                and tile_size(dstate) in rule["dstate_tiles"] and seqlen >= rule["min_seqlen"]
                and entry_elements < INDEX32_LIMIT):
            return chunk
    return chunk_size


def chunk_for(chunk_size, **call):
    """The chunk the kernels compute with for the caller's ``chunk_size`` and a call described
    by ``auto_chunk``'s keywords (gpu, dtype, batch, seqlen, nheads, headdim, dstate), as
    ``MAMBA2_CUTILE_COMPUTE_CHUNK`` says: the caller's, a forced chunk, or "auto"'s."""
    how = mode()
    if how == "caller":
        return chunk_size
    if how != "auto":
        return how
    return auto_chunk(chunk_size, **call)


def smallest_chunk(chunk_size):
    """The smallest chunk the kernels may compute with for a caller's ``chunk_size``, whatever
    the call's sizes and device (``chunk_for``'s choices): it bounds the entry states' size
    before a call's own chunk is known (``ops.ssd_combined``'s calls in pieces)."""
    how = mode()
    if how == "caller":
        return chunk_size
    if how != "auto":
        return how
    return min([chunk_size] + [r["chunk"] for r in AUTO_RULES if r["caller"] == chunk_size])


def kernel_chunk(chunk_size, x, B):
    """The chunk the kernels compute with, forward and backward, for a call with the caller's
    ``chunk_size`` and inputs ``x`` (b, L, h, p), ``B`` (b, L, g, n)."""
    batch, seqlen, nheads, headdim = x.shape
    return chunk_for(chunk_size, gpu=_gpu_name(x.device), dtype=x.dtype, batch=batch,
                     seqlen=seqlen, nheads=nheads, headdim=headdim, dstate=B.shape[3])
