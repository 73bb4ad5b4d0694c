"""The chunk the kernels compute with, which may differ from the caller's ``chunk_size``.

The chunked algorithm computes the same function at every chunk size: only the order of the
sums differs, so only rounding (measured below). The caller's chunk is a model's config value
(Mamba-2's configs say 256), chosen for mamba_ssm's Triton kernels, and on an H200 this
project's kernels are faster at 128, forward and backward. So by default ("auto") the forward
and the backward kernels compute with the chunk ``AUTO_RULES`` names for the call's shape and
device, else the caller's.

    MAMBA2_CUTILE_COMPUTE_CHUNK=auto     the default, as above
    MAMBA2_CUTILE_COMPUTE_CHUNK=caller   the caller's chunk exactly, forward and backward (the
                                         lowest memory: see "What it costs")
    MAMBA2_CUTILE_COMPUTE_CHUNK=128      this chunk (a power of two in [16, 256]) for every
                                         call, forward and backward

What "auto" rests on: the forward alone on the H200, bf16, headdim 64, D, dt_bias, softplus,
ms at chunk 256 -> 128, each the median of ``triton.testing.do_bench`` (CSVs in
``tests/benchmark/results/``). Mamba-2 130M training 16 x 2K x 24 heads 0.271 -> 0.240, 2.7B
training 8 x 2K x 80 0.423 -> 0.379, 2.7B prefill 1 x 4K x 80 0.137 -> 0.124, 8B hybrid 2 x 8K x
128 heads, 8 groups 0.687 -> 0.599 (``models_h200.csv``); again in another run 0.272 -> 0.257,
0.422 -> 0.383, -, 0.682 -> 0.599, and 1 x 80 heads: 16K dstate 256 0.638 -> 0.581, 64K
dstate 128 1.809 -> 1.569, 64K dstate 256 2.463 -> 2.250, 256K dstate 128 7.272 -> 6.412
(``fwd_pass_state_split_h200.csv``, the defaults' rows); 16K dstate 64 0.438 -> 0.378
(``chunk_sweep_h200.csv``); 16K dstate 64 / 128 / 256 0.441 -> 0.378, 0.463 -> 0.411, 0.635
-> 0.579, 64K 1.674 -> 1.463, 1.797 -> 1.558, 2.436 -> 2.233 (``fwd_bwd_h200.csv``'s fwd_ms as
committed at 83edc7f, before the forward computed at 128 by default).
At 1 x 4K x 80 and dstate 64 nothing timed it reliably (that last harness is not made for a
0.13 ms forward: it timed the same 4K shape at 0.135 and 0.222 ms in one run), so at dstate 64
"auto" starts at 16K tokens. (Chunk 64 was faster still at 16K x dstate 64, 0.347 ms in
``chunk_sweep_h200.csv``: one point, not yet a rule.)

And a training step's scan (forward + backward through autograd, bf16, D, dt_bias, softplus;
``tests/benchmark/fwd_bwd.py``), ms with the backward at chunk 256 -> 128, the forward at 128 in
both (but at 1 x 4K x dstate 64, where it stays at 256): 130M training 3.29 -> 2.98, 2.7B
training 3.40 -> 2.96, 8B hybrid 5.71 -> 4.77, 1 x 80 heads at 16K dstate 64 / 128 / 256 3.03 ->
2.85, 3.51 -> 3.12, 7.05 -> 6.47, at 64K 11.67 -> 9.20, 14.11 -> 11.84, 27.01 -> 24.91
(``fwd_bwd_d971a0b_h200.csv``; at 4K tokens and the 2.7B prefill shape, where the step is
host-bound, within 2.5% either way). With the pass over the states forming dentry itself
(``ops.backward.BACKWARD_DEFAULTS``), which gains most at 128, the kernels' forward then
backward called directly, both at the chunk (``config_sweep.py --what step``), 256 -> 128: 130M
2.23 -> 1.80, 2.7B 3.41 -> 2.77, 8B 5.75 -> 4.44 (``bwd_fuse_entry_h200.csv``). So the backward
computes at the forward's chunk.

Where "auto" applies (``AUTO_RULES``): a GPU whose name says H200, bf16 inputs, a caller's chunk
of 256, headdim up to 64, dstate 65-256 from 2K tokens and 33-64 from 16K, and entry states at
the new chunk under 2**31 elements (so the kernels stay 32-bit indexed, as measured). Measured
were headdim 64, dstate 64, 128 and 256, 2K-256K tokens and 24-128 heads; the rule extends that
to the sizes that compile to the same tiles. Everywhere else -- other GPUs (other Hopper parts
included), dtypes, sizes, a caller's chunk other than 256, the CPU interpreter -- "auto" keeps
the caller's chunk.

What it costs: the entry states, (b, chunks, h, p, n), double at half the chunk, and so does
the backward's dS, their gradient. The forward's peak memory rises by 29-31% at the model shapes
(``models_h200.csv``'s peak_mem_mb: 130M 163 -> 210 MB, 2.7B training 270 -> 350, 2.7B prefill
65 -> 85, 8B hybrid 408 -> 536); the forward's entry states are freed when it returns (the
backward recomputes them). A training step's peak, measured side by side with the same step at
exactly the caller's 256 (MiB beyond the inputs, the forward's output and the gradients
included; ``fwd_bwd_h200.csv`` against ``fwd_bwd_caller_h200.csv``, mamba_ssm's Triton in
parentheses): 130M 606 / 478 (470), 2.7B training 949 / 715 (713), 2.7B prefill 233 / 176
(180), 8B hybrid 1544 / 1224 (1416), 1 x 80 heads at 16K dstate 128 912 / 681 (696), at 64K
dstate 128 3441 / 2513 (2769), dstate 256 6263 / 4374 (4733). Those peaks at 128 include a
leak since fixed (a reference cycle in ``ops.launch``'s plans held the forward's states): after
the fix the 2.7B training step's peak at 128 is 737 MiB (``fwd_bwd_2p7b_plan_fix_h200.csv``),
3% above Triton's. That memory is transient, one
layer's scan at a time; ``MAMBA2_CUTILE_COMPUTE_CHUNK=caller`` gives it back, at the time the
caller's chunk takes (2.7B training 3.42 ms against 2.77).

The rounding difference, measured through the interpreter (``tests/test_compute_chunk.py``: 1 x
1024 tokens, 2 heads of 64 x 64, D, dt_bias, softplus) as the output's relative distance (in
norm) from the float64 reference at the caller's chunk 256: float32 inputs 5.1e-7 at chunk 128,
9.4e-7 at 256 (9.2e-7 from each other); bf16 2.34e-3 and 2.33e-3 (the output's own rounding to
bf16; 6.6e-4 from each other); and the gradients' distance from float64 autograd at 128 / 256
(1 x 512 tokens): fp32 dx 1.2e-6 / 2.5e-6, dA 7.6e-6 / 3.7e-5, bf16 3.4e-4 to 2.6e-3 at either
chunk. The GPU test there checks the output's bound on the GPU at a Mamba-2 layer's shape, and
that the op's gradients are the kernels' at the chunk chosen. So, memory aside, a change of
chunk is a change of rounding only, no larger than the rounding at either chunk.
"""
import functools
import os

import torch

from .checks import tile_size

ENV = "MAMBA2_CUTILE_COMPUTE_CHUNK"

# (the GPU's name, x's dtype, caller's chunk, largest headdim, dstate's tiles, least seqlen) ->
# the chunk to compute with. Each from the H200 measurements in the docstring; other Hopper GPUs
# (H100, H20, GH200) are the same architecture but were not measured, so they are not named.
AUTO_RULES = [
    dict(gpu="H200", dtype=torch.bfloat16, caller=256, max_headdim=64, dstate_tiles=(128, 256),
         min_seqlen=2048, chunk=128),
    dict(gpu="H200", dtype=torch.bfloat16, caller=256, max_headdim=64, dstate_tiles=(64,),
         min_seqlen=16384, chunk=128),
]
# The entry states, (b, chunks, h, p, n), double at half the chunk; past this many elements the
# kernels would switch to their 64-bit-indexed (slower) variants where the caller's chunk would
# not need them (ops.launch.fit_index_width), which nothing measured: "auto" stops short of it.
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


def kernel_chunk(chunk_size, x, B):
    """The chunk the kernels compute with, forward and backward, for a call with the caller's
    ``chunk_size`` and inputs ``x`` (b, L, h, p), ``B`` (b, L, g, n)."""
    batch, seqlen, nheads, headdim = x.shape
    return chunk_for(chunk_size, gpu=_gpu_name(x.device), dtype=x.dtype, batch=batch,
                     seqlen=seqlen, nheads=nheads, headdim=headdim, dstate=B.shape[3])
