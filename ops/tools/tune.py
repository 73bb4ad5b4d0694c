"""``python -m ops.tools.tune``: search shapes ahead of time, and turn searches into a table.

    python -m ops.tools.tune search --shape batch=8,seqlen=2048,nheads=80 --dstate 128 --jobs 16
    python -m ops.tools.tune search --backward --chunk 128 --shape batch=8,seqlen=2048,nheads=80
    python -m ops.tools.tune export ~/.cache/mamba2-cutile/autotune.json --out table.json
    python -m ops.tools.tune export new_cache.json --keep ops/tuning/tuned_configs.json   # refresh some shapes

``search`` makes random inputs of each shape on the GPU, compiles every candidate config of the
three kernels in parallel worker processes (each launches its candidate once, so cuTile's disk
cache of compiled kernels holds them all), then runs the forward pass with the search switched
on: the tuner times every candidate -- now without compiling -- and writes the winners to the
cache. It prints, per kernel, the default's time, the winner's and what each knob gained alone.
With ``--backward`` it does the same for the backward's four kernels too (``ops.backward``'s
``chain_space``: the variants the chain can run), through one ``kernel_backward`` call at the
chunk given, which is the chunk the kernels compute at (a training step's backward computes at
``ops/tuning/compute_chunk.py``'s chunk, 128 for a caller's 256 on an H200). ``--backward-only``
searches the backward's kernels alone: the forward's run the configs a first call takes with
``MAMBA2_CUTILE_AUTOTUNE=table`` (the cache's winner, else the committed table's, else the
default), and are neither compiled ahead nor timed.
``export`` writes caches' winners as a table in the format of ``ops/tuning/tuned_configs.json``,
with each GPU's compute capability (its searches record it; ``--keep``'s table gives those of
earlier ones), by which a GPU the table has no entries for borrows another's
(``autotune.Table.choice``).
"""
import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time

import torch

from ops import backward, forward
from ops.backward import BACKWARD_KERNELS, chain_space
from ops.forward import KERNELS
from ops.tuning import autotune
from ops.tuning.autotune import TABLE_PATH, Table, export_table

DEFAULTS = dict(batch=1, seqlen=16384, nheads=80, headdim=64, ngroups=1, dstate=128,
                chunk_size=256)


def parse_shape(text, base):
    """"batch=8,seqlen=2048" -> the base shape with those items replaced (ints)."""
    shape = dict(base)
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        name = {"chunk": "chunk_size"}.get(name.strip(), name.strip())
        if name not in DEFAULTS:
            raise SystemExit(f"--shape: unknown item {name!r}; expected some of {', '.join(DEFAULTS)}")
        try:
            shape[name] = int(value)
        except ValueError:
            raise SystemExit(f"--shape: {name} must be an integer, got {value!r}") from None
    return shape


def make_inputs(shape, dtype, features, device="cuda", seed=0):
    """Random inputs of one forward call (never zeros): x, dt, A, B, C and the optional tensors
    named by ``features`` ("D", "z", "s" packed sequences, "i" initial states)."""
    g = torch.Generator(device=device).manual_seed(seed)
    b, L, h, p, gr, n = (shape[k] for k in ("batch", "seqlen", "nheads", "headdim", "ngroups", "dstate"))
    r = lambda *s, dt=dtype: torch.randn(*s, device=device, generator=g).to(dt)
    kw = dict(x=r(b, L, h, p), dt=r(b, L, h, dt=torch.float32) * 0.5 - 1.0,
              A=-torch.rand(h, device=device, generator=g) - 0.1, B=r(b, L, gr, n), C=r(b, L, gr, n),
              dt_bias=r(h, dt=torch.float32) * 0.5)
    if "D" in features:
        kw["D"] = r(h, dt=torch.float32)
    if "z" in features:
        kw["z"] = r(b, L, h, p)
    if "s" in features:
        kw["seq_idx"] = (torch.arange(L, device=device) // max(1, L // 4)).to(torch.int32).expand(b, L).contiguous()
    if "i" in features:
        kw["initial_states"] = r(b, h, p, n, dt=torch.float32)
    return kw


def _launch_one(name, shape, dtype_name, features, config, device="cuda"):
    """Worker: run the forward pass once with ``config`` for kernel ``name`` (the others at their
    defaults), which compiles it into cuTile's disk cache. Returns (ok, message)."""
    # The others at their defaults, whatever the parent's mode: a worker spawned after the parent
    # switched the search on would otherwise search them, timing candidates on a GPU that the
    # other workers share, and write those timings to the cache.
    os.environ[autotune.ENV_SWITCH] = "0"
    dtype = getattr(torch, dtype_name)
    kw = make_inputs(shape, dtype, features, device=device)
    try:
        if name in BACKWARD_KERNELS:
            _backward(kw, shape, configs={name: config})
        else:
            forward.kernel_forward(**_forward_args(kw, shape), configs={name: config})
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:              # reported, and skipped by the search later too
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return True, ""


def _forward_args(kw, shape):
    return dict(kw, chunk_size=shape["chunk_size"], dt_softplus=True)


def _backward(kw, shape, configs=None):
    """One backward pass of the forward ``_forward_args`` describes (a seeded gradient of the
    output; its recompute of the forward included)."""
    g = torch.Generator(device=kw["x"].device).manual_seed(1)
    dout = torch.randn(kw["x"].shape, device=kw["x"].device, generator=g).to(kw["x"].dtype)
    args = _forward_args(kw, shape)
    tensors = [args.pop(k) for k in ("x", "dt", "A", "B", "C")]
    return backward.kernel_backward(dout, None, *tensors, args.pop("chunk_size"),
                                    configs=configs, input_dtypes=True, **args)


def _candidates(shape, dtype, with_backward, with_forward=True):
    """(kernel, config) of every candidate a search times: the forward's kernels' search spaces
    (unless ``with_forward`` is False) and, ``with_backward``, the backward chain's
    (``chain_space``; the chunk states' kernel only where the chain runs it: its token kernel
    leaves their work to it)."""
    sizes = dict(shape, dtype=dtype, states_dtype=dtype)
    work = ([(name, cfg) for name, module in KERNELS.items()
             for cfg in module.search_space(**sizes)] if with_forward else [])
    if with_backward:
        unfused = not chain_space("bwd_compute_out", sizes)[0]["FUSE_STATES"]
        for name in BACKWARD_KERNELS:
            if name != "bwd_chunk_states" or unfused:
                work += [(name, cfg) for cfg in chain_space(name, sizes)[1]]
    return work


def _bytes_per_worker(shape, dtype):
    b, L, h, p, g, n, q = (shape[k] for k in ("batch", "seqlen", "nheads", "headdim", "ngroups",
                                              "dstate", "chunk_size"))
    size = torch.empty((), dtype=dtype).element_size()
    return size * (3 * b * L * h * p + 2 * b * L * g * n + b * -(-L // q) * h * p * n) + 8 * b * L * h


def precompile(shape, dtype, features, jobs, out=sys.stderr, with_backward=False,
               with_forward=True):
    """Compile every candidate of the three forward kernels (unless ``with_forward`` is False)
    and, ``with_backward``, the backward's, in ``jobs`` processes; returns the failures."""
    work = _candidates(shape, dtype, with_backward, with_forward)
    free = torch.cuda.mem_get_info()[0]
    per_worker = _bytes_per_worker(shape, dtype) * (3 if with_backward else 1)
    jobs = max(1, min(jobs, int(0.6 * free // max(1, per_worker))))
    failures, done, start = [], 0, time.time()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {pool.submit(_launch_one, name, shape, str(dtype).replace("torch.", ""),
                               features, cfg): (name, cfg) for name, cfg in work}
        shown = -1
        for future in concurrent.futures.as_completed(futures):
            done += 1
            ok, message = future.result()
            if not ok:
                failures.append((*futures[future], message))
            width = 30 * done // len(work)
            if width != shown:                      # redraw when the bar grows
                shown = width
                out.write(f"\r[mamba2-cutile] compiling {len(work)} candidates on {jobs} "
                          f"processes [{'#' * width:<30}] {done}/{len(work)} "
                          f"({time.time() - start:.0f} s)")
                out.flush()
    out.write("\n")
    return failures


def knob_gains(entry, default):
    """{knob: best speedup over the default among the candidates that change only that knob
    (occupancy may change with it)}, from a cache entry's timings."""
    timings = entry.get("timings", [])
    base = next((ms for ms, cfg in timings if cfg == default), None)
    gains = {}
    if base is None:
        return gains
    for ms, cfg in timings:
        changed = [k for k in cfg if cfg.get(k) != default.get(k) and k != "occupancy"]
        label = changed[0] if len(changed) == 1 else ("occupancy" if not changed else None)
        if label and cfg != default:
            gains[label] = max(gains.get(label, 0.0), base / ms)
    return gains


def table_configs(shape, dtype, features):
    """{forward kernel: config} at ``shape`` as a first call gets it with
    ``MAMBA2_CUTILE_AUTOTUNE=table``, whatever the tuner's mode: the tuner's cache's winner for
    the shape where it has one, else the committed table's (the nearest tuned shape's), else the
    kernel's default."""
    sizes = dict(shape, dtype=dtype, states_dtype=dtype, on_gpu=True)
    return {name: forward._choose(name, sizes, features, None, "table") for name in KERNELS}


def search(args):
    if not torch.cuda.is_available():
        raise SystemExit("search needs a CUDA GPU (the candidates are timed on it)")
    args.backward = args.backward or args.backward_only
    if args.cache:
        os.environ[autotune.ENV_CACHE] = args.cache
    dtype = getattr(torch, args.dtype)
    base = dict(DEFAULTS, headdim=args.headdim, dstate=args.dstate, ngroups=args.ngroups,
                chunk_size=args.chunk)
    for text in args.shape or [""]:
        shape = parse_shape(text, base)
        print(f"== {', '.join(f'{k}={v}' for k, v in shape.items())}, {args.dtype}, features "
              f"{args.features!r}", flush=True)
        start = time.time()
        if args.jobs > 1:
            for name, cfg, message in precompile(shape, dtype, args.features, args.jobs,
                                                  with_backward=args.backward,
                                                  with_forward=not args.backward_only):
                print(f"   {name}: {autotune._fmt(cfg)} does not run: {message}")
        compiled = time.time()
        features = "".join(f for f in "Dzsi" if f in args.features)
        fixed = table_configs(shape, dtype, features) if args.backward_only else None
        os.environ[autotune.ENV_SWITCH] = "1"
        autotune._TUNER = None                       # a fresh tuner on the chosen cache
        kw = make_inputs(shape, dtype, args.features)
        forward.kernel_forward(**_forward_args(kw, shape), configs=fixed)
        if args.backward:
            _backward(kw, shape, configs=fixed)
        torch.cuda.synchronize()
        print(f"   compiled in {compiled - start:.0f} s, searched in {time.time() - compiled:.0f} s")
        tuner = autotune.tuner()
        memory = tuner._load()
        sizes = dict(shape, dtype=dtype, states_dtype=dtype, on_gpu=True)
        searched = list(dict.fromkeys(n for n, _ in _candidates(shape, dtype, args.backward,
                                                                not args.backward_only)))
        for name in searched:
            if name in BACKWARD_KERNELS:
                default, space = chain_space(name, sizes)
                key, _ = forward.tuning_key(name, sizes, features, space)
            else:
                key, _ = forward.tuning_key(name, sizes, features)
                default = KERNELS[name].default_config(**sizes)
            entry = memory.get(tuner.key(name, key), {})
            base_ms = next((ms for ms, c in entry.get("timings", []) if c == default), None)
            gain = f"{base_ms / entry['ms']:.2f}x the default's speed" if base_ms and entry.get("ms") else ""
            print(f"   {name:15s} {autotune._fmt(entry.get('config', default))}  {gain}")
            for knob, g in sorted(knob_gains(entry, default).items(), key=lambda kv: -kv[1]):
                print(f"      {knob:18s} alone: {g:.2f}x")
    print(f"cache: {autotune.tuner().path}")


def export(args):
    out = args.out or TABLE_PATH
    print(f"{export_table(args.caches, out, keep=args.keep)} entries written to {out}")
    table = Table.load(out)
    unknown = sorted({e["device"] for e in table.entries} - set(table.devices))
    if unknown:
        print(f"note: no compute capability recorded for {', '.join(unknown)} (searches made "
              f"before it was recorded): no other GPU borrows their entries; --keep a table "
              f"whose devices name them, or add them to its devices")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ops.tools.tune", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("search", help="search shapes on this GPU and cache the winners")
    s.add_argument("--shape", action="append", help="e.g. batch=8,seqlen=2048,nheads=80 (repeatable)")
    s.add_argument("--headdim", type=int, default=64)
    s.add_argument("--dstate", type=int, default=128)
    s.add_argument("--ngroups", type=int, default=1)
    s.add_argument("--chunk", type=int, default=256)
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    s.add_argument("--features", default="D", help="D, z, s (seq_idx), i (initial states): e.g. Dz")
    s.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="processes compiling candidates in parallel (1: compile while searching)")
    s.add_argument("--cache", help="the cache file to write (default: the tuner's)")
    s.add_argument("--backward", action="store_true",
                   help="search the backward's kernels too (at the chunk the kernels compute at)")
    s.add_argument("--backward-only", action="store_true",
                   help="search the backward's kernels alone (the forward's run the configs a "
                        "first call takes with MAMBA2_CUTILE_AUTOTUNE=table)")
    s.set_defaults(run=search)
    e = sub.add_parser("export", help="write caches' winners as a table")
    e.add_argument("caches", nargs="+")
    e.add_argument("--out", help="default: ops/tuning/tuned_configs.json")
    e.add_argument("--keep", metavar="TABLE",
                   help="keep this table's entries for the shapes the caches did not search")
    e.set_defaults(run=export)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
