"""Where a training step's scan spends its GPU time: every kernel's time per step, by name.

    python -m tests.benchmark.profile_fwd_bwd --shape 8x2048x80x1 --chunks 128,256 [--steps 10]
        [--tilegym-chunk 64]                                # TileGym's kernels too
    ncu --profile-from-start off ... python -m tests.benchmark.profile_fwd_bwd --ncu \
        --impl cutile --chunks 128 --shape 8x2048x80x1      # one step for Nsight Compute

With ``--ncu``, one implementation (``--impl``, at the first of ``--chunks``; TileGym at its own
``--chunks`` value too) runs three warm-up steps, then one step between ``cudaProfilerStart`` and
``cudaProfilerStop``, so that ``ncu --profile-from-start off`` profiles that step's kernels only
(``tests/benchmark/profile_ncu.sh`` with ``PASS=fwd_bwd``). Not an NVTX range: NVTX ranges belong
to a thread, and autograd launches the backward's kernels from a thread of its own.

At batch x seqlen x nheads x ngroups (headdim 64, dstate ``--dstate``, bf16, D, dt_bias,
softplus; ``fwd_bwd.py``'s inputs), mamba_ssm's Triton scan at chunk 256 and this project's at each
of ``--chunks`` run three warm-up steps (forward with gradients, then ``out.backward(dout)``), then
``--steps`` steps under ``torch.profiler``; each kernel's summed device time is divided by the
steps. With ``--tilegym-chunk``, TileGym's step (``fwd_bwd.py``'s: its two functions in an autograd
node, dt's bias and softplus in PyTorch before it) at that chunk too; its first steps autotune (a
minute or more), unless ``--tilegym-winners JSON`` holds its searches' winners for this GPU
(``fwd_bwd.py``'s file, e.g. ``results/tilegym_winners_h200.json``: read, and new searches added
to it). The total is
the GPU's busy time per step; a step's wall time (``fwd_bwd.py``) also holds the host's work between
launches, and the gap between the two is how host-bound the step is.
"""
import argparse
import contextlib

import torch


def warm_step(impl, chunk, shape, winners=None):
    """One training step's scan of ``impl`` at ``chunk`` on ``fwd_bwd.py``'s inputs for
    ``shape`` (each implementation's as ``fwd_bwd.py`` times it), after three warm-up steps;
    ``winners``: TileGym's searches' winners file (``warm_compile.tilegym_winners``)."""
    from tests.benchmark.fwd_bwd import LEAVES, _autograd_step, _setup, _tilegym_step
    inputs, dout = _setup(shape)
    leaves = {k: v.detach().clone().requires_grad_(k in LEAVES) for k, v in inputs.items()}
    searches = contextlib.nullcontext()
    if impl == "tilegym" and winners:
        from tests.benchmark.warm_compile import tilegym_winners
        searches = tilegym_winners(winners)
    with searches:
        step = (_tilegym_step(chunk, leaves, dout) if impl == "tilegym"
                else _autograd_step(impl, chunk, leaves, dout)).step
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    return step


def kernel_times(impl, chunk, shape, steps, winners=None):
    """-> {kernel name: ms per step} for one implementation."""
    from torch.profiler import ProfilerActivity, profile

    step = warm_step(impl, chunk, shape, winners)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time / steps / 1e3
    return totals


def one_step_for_ncu(impl, chunk, shape, winners=None):
    """Three warm-up steps, then one between cudaProfilerStart and cudaProfilerStop."""
    step = warm_step(impl, chunk, shape, winners)
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one step of {impl} at chunk {chunk}, {shape}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8x2048x80x1", help="batch x seqlen x nheads x ngroups")
    parser.add_argument("--dstate", type=int, default=128)
    parser.add_argument("--chunks", default="128,256", help="this project's chunks")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=20, help="kernels listed per implementation")
    parser.add_argument("--ncu", action="store_true",
                        help="one step of --impl between cudaProfilerStart/Stop, for ncu")
    parser.add_argument("--tilegym-chunk", type=int, default=0,
                        help="also TileGym's step at this chunk (0: not)")
    parser.add_argument("--impl", default="cutile", choices=("triton", "cutile", "tilegym"),
                        help="with --ncu: the implementation profiled")
    parser.add_argument("--tilegym-winners", metavar="JSON",
                        help="TileGym's searches' winners (fwd_bwd.py's file): those it holds "
                             "are not searched again, new ones are added")
    args = parser.parse_args(argv)
    if args.tilegym_winners:
        from tests.benchmark.warm_compile import read_winners
        try:
            read_winners(args.tilegym_winners)
        except ValueError as e:
            parser.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("profile_fwd_bwd needs a CUDA GPU")
    batch, seqlen, nheads, ngroups = (int(v) for v in args.shape.split("x"))
    shape = dict(batch=batch, seqlen=seqlen, nheads=nheads, headdim=64, ngroups=ngroups,
                 dstate=args.dstate)
    if args.ncu:
        one_step_for_ncu(args.impl, int(args.chunks.split(",")[0]), shape, args.tilegym_winners)
        return
    runs = [("triton", 256)] + [("cutile", int(c)) for c in args.chunks.split(",")]
    if args.tilegym_chunk:
        runs.append(("tilegym", args.tilegym_chunk))
    for impl, chunk in runs:
        totals = kernel_times(impl, chunk, shape, args.steps, args.tilegym_winners)
        print(f"== {impl} chunk {chunk} at {args.shape} dstate {args.dstate}: GPU busy "
              f"{sum(totals.values()):.3f} ms per step", flush=True)
        for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {ms:7.3f} ms  {name[:100]}", flush=True)


if __name__ == "__main__":
    main()
