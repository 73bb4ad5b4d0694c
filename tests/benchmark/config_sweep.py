"""Kernel configs side by side: the forward, the backward or a training step's whole scan with one
kernel's config changed, against the defaults, in one process on the same inputs.

    python -m tests.benchmark.config_sweep --what step --chunks 128,256 \\
        --shapes mamba2-2.7b-train 1x65536x80:256 \\
        --variant bwd_compute_out:SCORES_IN_MEMORY=false \\
        --variant bwd_compute_out:SCORES_IN_MEMORY=true \\
        --rounds 2 --warm-procs 10 --out bench_out/sweep.csv
    python -m tests.benchmark.config_sweep --what forward --variant fwd_pass_state:SPLIT=true ...
    python -m tests.benchmark.config_sweep --device cpu --shapes 1x64x4:16:2:16 --chunks 32 \\
        --what step --variant bwd_compute_out:SCORES_IN_MEMORY=true --out /tmp/s.csv   # dry run

What each ``--what`` times (bf16, D, dt_bias, softplus; ``bench_forward.make_inputs``' seeded
inputs, one seeded output gradient):
    forward    ``ops.forward.kernel_forward``
    backward   ``ops.backward.kernel_backward`` (its recompute of the forward included, as the
               autograd op runs it)
    step       both, one after the other: the work of one training step's scan through the op
``--variant KERNEL:KEY=VALUE[,KEY=VALUE...]`` (repeatable) gives that kernel a config: the keys
given over the kernel's *untuned* default config for the shape (``ops/tuning/configs.py``'
resolve_config: an unknown key is refused; for a backward kernel, with ``ops.backward``'s
``BACKWARD_DEFAULTS`` for the shape over that default, as the backward runs it: the pass over
the states forms dentry unless a variant says FUSE_ENTRY=false, in ``walk_config``'s tiles and
hints unless it names them); values are ints, true/false (the flags) or None.
Every shape x chunk runs "default" (the committed table's tuned configs for the forward
kernels, as a first call gets them with ``MAMBA2_CUTILE_AUTOTUNE=table``), on a GPU also
"untuned" (every kernel's default config: ``MAMBA2_CUTILE_AUTOTUNE=0``, what a variant is set
over), and then each variant.

Timing: ``--rounds`` rounds, each timing every variant in turn (``triton.testing.do_bench``'s
median after its warm-up; on the CPU the median of 3 calls), so that a drift of the machine over
the run falls on all of them alike; a variant's time is its best round's. ``vs_default`` is the
default's time over the variant's (above 1: the variant is faster), ``max_rel_diff`` the largest
relative difference (in norm) of any output from the default's (NaN: an output not finite): the
same function, so only rounding may differ. ``--warm-procs N`` first compiles every (shape,
chunk, variant) in N spawned processes (each frees its inputs after each job: a GPU holds about
ten of the 64K x dstate 256 steps at once).

Output: a line per (shape, chunk, variant) and ``--out``'s CSV, one row each (written after every
shape, so a run cut short keeps what it measured).
"""
import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch

WHAT = ("forward", "backward", "step")


def parse_shape(text):
    """A model name of ``models.MODELS`` or ``BxLxH[:dstate[:ngroups[:headdim]]]`` (defaults 128,
    1, 64) -> (name, shape dict)."""
    from tests.benchmark.models import MODELS
    if text in MODELS:
        return text, dict(MODELS[text])
    head, *rest = text.split(":")
    try:
        batch, seqlen, nheads = (int(v) for v in head.split("x"))
        dstate, ngroups, headdim = [int(v) for v in rest] + [128, 1, 64][len(rest):]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape {text!r}: expected a model name ({', '.join(MODELS)}) or "
            f"BxLxH[:dstate[:ngroups[:headdim]]], e.g. 1x65536x80:256") from None
    return text, dict(batch=batch, seqlen=seqlen, nheads=nheads, headdim=headdim,
                      ngroups=ngroups, dstate=dstate)


def _value(text):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    try:
        return int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"config value {text!r}: expected an int, true/false "
                                         f"or None") from None


def parse_variant(text):
    """``KERNEL:KEY=VALUE,...`` -> (text, {kernel: {key: value}})."""
    from ops import backward, forward
    kernels = set(forward.KERNELS) | set(backward.BACKWARD_CONFIGS)
    kernel, sep, items = text.partition(":")
    if not sep or kernel not in kernels or not items:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected KERNEL:KEY=VALUE[,...] with "
                                         f"KERNEL one of {sorted(kernels)}")
    config = {}
    for item in items.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(f"variant {text!r}: {item!r} is not KEY=VALUE")
        config[key.strip()] = _value(value)
    return text, {kernel: config}


def _inputs(shape, device):
    from tests.benchmark.bench_forward import make_inputs
    inputs = make_inputs(torch, device, shape["batch"], shape["seqlen"], shape["nheads"],
                         shape["headdim"], shape["ngroups"], shape["dstate"], "bfloat16")
    dout = torch.randn(inputs["x"].shape, device=device, generator=torch.Generator(
        device=device).manual_seed(1)).to(inputs["x"].dtype)
    return inputs, dout


UNTUNED = "untuned"


def call(what, inputs, dout, chunk, configs):
    """One run of ``what`` -> its outputs (a list of tensors). ``configs``: by kernel name, or
    ``UNTUNED`` (every kernel's default config, the tuned table switched off for the call)."""
    if configs == UNTUNED:
        from ops.tuning.autotune import ENV_SWITCH
        before = os.environ.get(ENV_SWITCH)
        os.environ[ENV_SWITCH] = "0"           # read at each call
        try:
            return call(what, inputs, dout, chunk, {})
        finally:
            if before is None:
                del os.environ[ENV_SWITCH]
            else:
                os.environ[ENV_SWITCH] = before
    from ops.backward import kernel_backward
    from ops.forward import kernel_forward
    fwd_configs = {k: v for k, v in configs.items() if not k.startswith("bwd_")}
    bwd_configs = {k: v for k, v in configs.items() if k.startswith("bwd_")}
    args = (inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], chunk)
    options = dict(D=inputs["D"], dt_bias=inputs["dt_bias"], dt_softplus=True)
    outputs = []
    if what in ("forward", "step"):
        outputs += kernel_forward(*args, **options, configs=fwd_configs)
    if what in ("backward", "step"):
        grads = kernel_backward(dout, None, *args, **options, configs={**fwd_configs,
                                **bwd_configs}, input_dtypes=True)
        outputs += [grads[k] for k in sorted(grads)]
    return outputs


def _warm(job):
    what, shape, chunk, configs, device = job
    start = time.perf_counter()
    inputs = dout = None
    try:
        inputs, dout = _inputs(shape, device)
        call(what, inputs, dout, chunk, configs)
        torch.cuda.synchronize()
        message = f"{time.perf_counter() - start:.0f} s"
    except Exception as e:              # reported; the timed run reports it again
        message = f"FAILED {type(e).__name__}: {str(e)[:200]}"
    del inputs, dout
    torch.cuda.empty_cache()
    return f"warm {what} {shape} chunk {chunk} {configs}: {message}"


def _time(fn, device):
    if device == "cpu":
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=150)


def rel_diff(got, want):
    """Relative difference in norm; NaN where ``got`` is not finite."""
    if not torch.isfinite(got).all():
        return float("nan")
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def sweep(what, name, shape, chunk, variants, rounds, device):
    """-> one row per variant ("default" first) of one shape and chunk."""
    inputs, dout = _inputs(shape, device)
    # (on the CPU the interpreter takes the default configs anyway: no "untuned" row)
    runs = [("default", {})] + ([(UNTUNED, UNTUNED)] if device != "cpu" else []) + variants
    outputs, times = {}, {label: [] for label, _ in runs}
    for label, configs in runs:
        try:
            outputs[label] = call(what, inputs, dout, chunk, configs)   # compiles, if not warm
        except Exception as e:
            print(f"{name} chunk {chunk} {label}: FAILED {type(e).__name__}: {str(e)[:300]}",
                  flush=True)
    for _ in range(rounds):
        for label, configs in runs:
            if label in outputs:
                times[label].append(_time(lambda: call(what, inputs, dout, chunk, configs), device))
    rows = []
    for label, _ in runs:
        if label not in outputs:
            continue
        ms = min(times[label])
        base = min(times["default"]) if "default" in outputs else float("nan")
        diff = (max(rel_diff(g, w) for g, w in zip(outputs[label], outputs["default"]))
                if "default" in outputs else float("nan"))
        rows.append(dict(shape=name, **shape, chunk=chunk, what=what, variant=label, ms=ms,
                         ms_rounds=";".join(f"{t:.4f}" for t in times[label]),
                         vs_default=base / ms, max_rel_diff=diff))
        print(f"{name} chunk {chunk} {what} {label}: {ms:.3f} ms (rounds "
              f"{rows[-1]['ms_rounds']}), {base / ms:.3f}x the default's speed, outputs within "
              f"{diff:.1e} of the default's", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--what", choices=WHAT, default="step")
    parser.add_argument("--shapes", nargs="+", type=parse_shape,
                        default=[parse_shape("mamba2-2.7b-train")])
    parser.add_argument("--chunks", default="128,256")
    parser.add_argument("--variant", action="append", type=parse_variant, default=[],
                        help="KERNEL:KEY=VALUE[,KEY=VALUE...], repeatable")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm-procs", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no GPU here: pass --device cpu for a dry run through the interpreter")
    if args.warm_procs and args.device == "cuda":
        jobs = [(args.what, shape, chunk, configs, args.device) for _, shape in args.shapes
                for chunk in chunks for configs in [{}, UNTUNED] + [v for _, v in args.variant]]
        start = time.perf_counter()
        with mp.get_context("spawn").Pool(args.warm_procs) as pool:
            for line in pool.imap_unordered(_warm, jobs):
                print(line, flush=True)
        print(f"warmed {len(jobs)} runs in {time.perf_counter() - start:.0f} s", flush=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    rows = []
    for name, shape in args.shapes:
        for chunk in chunks:
            rows += sweep(args.what, name, shape, chunk, args.variant, args.rounds, args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if args.out and rows:
            from ops.results.report import write_csv
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            write_csv(args.out, [dict(r, device=device_name, torch=torch.__version__)
                                 for r in rows])
    return rows


if __name__ == "__main__":
    main()
