"""The forward pass at real Mamba-2 model shapes: this project against mamba_ssm's Triton kernels and
TileGym, side by side.

What it measures: ``bench_forward.py`` (its docstring says how: the same seeded inputs for every
implementation, the median of ``triton.testing.do_bench`` after an untimed first call that
compiles and autotunes, outputs compared with Triton's, each implementation in a worker process
of its own) at the shapes one Mamba-2 layer's scan sees in four uses, headdim 64, dstate 128, bf16:

    mamba2-130m-train     Mamba-2 130M, a training batch: 16 sequences x 2K tokens, 24 heads, 1 group
    mamba2-2.7b-train     Mamba-2 2.7B, a training batch: 8 x 2K, 80 heads, 1 group
    mamba2-2.7b-prefill   Mamba-2 2.7B, the prefill of one 4K prompt: 1 x 4K, 80 heads, 1 group
    8b-hybrid-layer       a Mamba-2 layer of the 8B hybrid model: 2 x 8K, 128 heads, 8 groups

Each implementation runs at the chunks worth timing (``IMPL_CHUNKS``): cutile 64, 128, 256;
triton 128, 256 (its best chunk is always one of these); tilegym 64 (at 256 it is 16-18x slower
than at 64, e.g. 8.4 against 0.49 ms at 16K x 128 in ``results/chunks_tilegym_h200.csv``, and its
exhaustive autotuning at every chunk would cost minutes per shape). Every implementation of one model runs in one bench_forward
run, so the ratios are measured side by side on one GPU.

    python -m tests.benchmark.models --out bench_out/models.csv        # all four, on a GPU
    python -m tests.benchmark.models --models 8b-hybrid-layer --impls triton,cutile
    python -m tests.benchmark.models --impl-chunks cutile=128:256      # merged over IMPL_CHUNKS
    python -m tests.benchmark.models --warm                            # compile ahead (see below)
    python -m tests.benchmark.models --out /tmp/models.csv --scale-down 32 --device cpu \\
        --impls reference,interpret --chunks 16,32 --warmup-ms 1 --rep-ms 2   # dry run, no GPU

Any option this script does not know goes to bench_forward.py (``--impls``, ``--chunks`` for the
implementations without a list of their own, default here 64,128,256, ``--task-timeout``,
``--slices``, ``--device``, ...); the shape options are set by each model (``--scale-down N``
divides them for a dry run). The output is one CSV: a leading ``model`` column, then every
bench_forward column, one row per model x implementation x chunk; ``best_chunk`` marks each
implementation's fastest chunk per model. ``--resume`` keeps the rows of ``--out`` and runs only
the points it lacks (a model with all of them is skipped); without it ``--out`` is written anew.
At the end a table: per model, each implementation at its best chunk and cutile's speedup over
triton and over tilegym (their time / cutile's, each at its best chunk).

The committed ``results/models_h200.csv`` was made on the H200 (mamba_ssm and TileGym installed)
with the committed table of tuned configs (no search: what a user's first call gets), this
project at chunks 128 and 256, two models per command (each well inside 10 minutes):

    export MAMBA2_CUTILE_AUTOTUNE=table
    python -m tests.benchmark.models --warm --impls tilegym --warm-procs 16 \
        --models mamba2-130m-train mamba2-2.7b-train                     # 70 s
    python -m tests.benchmark.models --resume --out models_a.csv --impl-chunks cutile=128:256 \
        --task-timeout 200 --models mamba2-130m-train mamba2-2.7b-train  # 260 s
    (the same for mamba2-2.7b-prefill and 8b-hybrid-layer: 21 s, then 206 s; the two CSVs
    concatenated)

``results/models_auto_h200.csv`` is the same at a caller's chunk 256
only, where this project computes at 128 (ops/tuning/compute_chunk.py), TileGym at 64, in one command
after TileGym's warm step (70 s):

    python -m tests.benchmark.models --out models.csv --impls triton,cutile,tilegym \
        --impl-chunks triton=256,cutile=256,tilegym=64 --task-timeout 150      # 223 s, four models

The warm step compiles TileGym's configs at chunk 64 for the shapes, in one pool of processes,
into cuTile's disk cache (``warm_compile.py`` with each model's ``--batch --seqlens --nheads
--ngroups``), so that TileGym's exhaustive autotuning times its configs without compiling each.
With ``--impls`` including cutile it also compiles every search-space config of this project's
kernels, which a search (``MAMBA2_CUTILE_AUTOTUNE=1``, the default here, as run_h200.sh sets it)
needs: without it, tuning one cutile point compiles its ~100 candidates one at a time. If
``timeout`` stops a run, the rows measured are kept: run the same command again and it
continues. TRITON_CACHE_AUTOTUNING=1 and MAMBA2_CUTILE_AUTOTUNE_CACHE=.cache/bench/
cutile_autotune.json are set unless set already.
"""
import argparse
import csv
import os
import shutil
import signal
import sys
import tempfile
import time

from ops.results import OUTPUT, report
from ops.results.models import DTYPE, MODELS  # noqa: F401  (part of this script's interface)
from tests.benchmark import bench_forward

ROOT = bench_forward.ROOT


# The chunks each implementation is timed at (why: the module docstring); --impl-chunks replaces
# entries, and implementations not named here run at --chunks (OTHER_CHUNKS unless given).
IMPL_CHUNKS = {"cutile": [64, 128, 256], "triton": [128, 256], "tilegym": [64]}
OTHER_CHUNKS = "64,128,256"

# bench_forward's options that each model sets (parsed attribute -> option): not passed through.
SHAPE_OPTIONS = {"batch": "--batch", "seqlens": "--seqlens", "nheads": "--nheads", "headdim": "--headdim",
                 "ngroups": "--ngroups", "dstates": "--dstates"}
ENV_DEFAULTS = {"MAMBA2_CUTILE_AUTOTUNE": "1", "TRITON_CACHE_AUTOTUNING": "1",
                "MAMBA2_CUTILE_AUTOTUNE_CACHE": os.path.join(ROOT, ".cache", "bench", "cutile_autotune.json")}


def scaled(shape, factor):
    """``shape`` with its sizes divided by ``factor`` for a dry run: batch and seqlen at least 1,
    headdim and dstate at least 16, heads a multiple of the groups, which are kept (a dry run
    still passes several groups where the model has them)."""
    if factor == 1:
        return dict(shape)
    out = dict(shape, batch=max(1, shape["batch"] // factor), seqlen=max(1, shape["seqlen"] // factor),
               headdim=max(16, shape["headdim"] // factor), dstate=max(16, shape["dstate"] // factor))
    groups = shape["ngroups"]
    out["nheads"] = max(groups, shape["nheads"] // factor // groups * groups)
    return out


def shape_text(s):
    plural = lambda n, word: f"{n} {word}{'s' if n != 1 else ''}"
    return (f"{s['batch']} x {report.fmt_len(s['seqlen'])}, {plural(s['nheads'], 'head')} x {s['headdim']}, "
            f"{plural(s['ngroups'], 'group')}, dstate {s['dstate']}")


def format_impl_chunks(impl_chunks):
    return ",".join(f"{impl}={':'.join(map(str, chunks))}" for impl, chunks in impl_chunks.items())


def bench_argv(shape, impl_chunks, passthrough, csv_path=None, resume=False):
    """bench_forward's arguments for one model: the model's sizes after the options passed through
    (so the model's win), the chunks, the CSV."""
    argv = ["--chunks", OTHER_CHUNKS, "--dtype", DTYPE] + list(passthrough)
    argv += ["--batch", str(shape["batch"]), "--seqlens", str(shape["seqlen"]), "--nheads", str(shape["nheads"]),
             "--headdim", str(shape["headdim"]), "--ngroups", str(shape["ngroups"]),
             "--dstates", str(shape["dstate"]), "--impl-chunks", format_impl_chunks(impl_chunks)]
    if csv_path:
        argv += ["--csv", csv_path] + (["--resume"] if resume else [])
    return argv


def check_passthrough(ap, passthrough):
    """Reject the bench_forward options this script sets itself (argparse errors naming them)."""
    given, default = bench_forward.parse_args(passthrough), bench_forward.parse_args([])
    for attr, option in SHAPE_OPTIONS.items():
        if getattr(given, attr) != getattr(default, attr):
            ap.error(f"{option} is set by each model (--scale-down N divides the models' sizes for a dry run)")
    if given.csv is not None:
        ap.error("--csv: this script writes one CSV for all models, --out")
    if given.plot is not None:
        ap.error("--plot: not available here (one bench_forward run per model); plot --out's rows instead")


def key_of(row):
    """A row's point (bench_forward.point_key), as text: the same for CSV rows and tasks."""
    return tuple(str(v) for v in bench_forward.point_key(row))


def points_to_run(argv, have):
    """The tasks of one model's bench_forward run that ``have`` (rows) does not hold."""
    args = bench_forward.parse_args(argv)
    done = {key_of(r) for r in have}
    return [t for tasks in bench_forward.make_tasks(args, args.impls).values() for t in tasks
            if key_of(t) not in done]


# The CSVs: rows as text, as bench_forward wrote them -----------------------------------------

def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def load_output(path):
    """{model: [rows]} of an output CSV (empty when there is none)."""
    if not os.path.exists(path):
        return {}
    out = {}
    for row in read_csv(path):
        if "model" not in row:
            raise SystemExit(f"{path} has no 'model' column: not a {os.path.basename(__file__)} CSV")
        out.setdefault(row["model"], []).append(row)
    return out


def write_csv(path, rows, first=()):
    """``rows`` under a header of ``first``, then bench_forward's columns, then any others;
    written to a temporary file first, so a stop never leaves half a file."""
    names = list(first) + [c for c in bench_forward.CSV_COLUMNS if c not in first]
    names += [k for r in rows for k in r if k not in names]
    names = list(dict.fromkeys(names))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        w.writerows(rows)
    os.replace(path + ".tmp", path)


def model_order(names):
    return sorted(names, key=lambda n: (list(MODELS).index(n) if n in MODELS else len(MODELS), n))


def write_output(path, by_model):
    write_csv(path, [r for name in model_order(by_model) for r in by_model[name]], first=["model"])


# The closing table ---------------------------------------------------------------------------

def summary_table(source, markdown=False):
    """Per model: each implementation's time at its best chunk (the chunk in parentheses) and
    cutile's speedup over triton and over tilegym, each at its best chunk. ``source``: an output
    CSV's path, or its rows as ``report.load`` reads them."""
    rows = report.load(source)
    if not rows:
        return "(no results)"
    by_model = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    impls = report.impls_in(rows)
    header = ["model", "shape"] + [f"{i} ms" for i in impls] + ["cutile vs triton", "cutile vs tilegym"]
    lines = []
    for name in model_order(by_model):
        model_rows = by_model[name]
        cells, best = [name, shape_text(model_rows[0])], {}
        for impl in impls:
            by_chunk = {r["chunk"]: r for r in model_rows if r["impl"] == impl}
            best[impl] = report.best_row(by_chunk)
            b = best[impl]
            cells.append(f"{b['ms']:.3f} ({b['chunk']})" if b else
                         report.short_status(next(iter(by_chunk.values()), None)))
        for other in ("triton", "tilegym"):
            sp = report.speedup(best.get("cutile"), best.get(other))
            cells.append("-" if sp is None else f"{sp:.2f}x")
        lines.append(cells)
    return report._render(header, lines, markdown)


# The warm step -------------------------------------------------------------------------------

def warm_arg_sets(shapes, impls, impl_chunks, chunks, procs):
    """warm_compile.py's parsed arguments for each shape: this project's kernels as called at
    cutile's (and cutile_default's) chunks (warm_compile compiles at the chunk each call computes
    with), and TileGym's configs at its own chunks, as far as ``impls`` run them."""
    from tests.benchmark import warm_compile
    sets = []
    for s in shapes:
        common = ["--batch", str(s["batch"]), "--seqlens", str(s["seqlen"]), "--nheads", str(s["nheads"]),
                  "--headdim", str(s["headdim"]), "--ngroups", str(s["ngroups"]), "--dstates", str(s["dstate"]),
                  "--procs", str(procs)]
        ours = sorted({c for i in ("cutile", "cutile_default") if i in impls for c in impl_chunks.get(i, chunks)})
        if ours:
            sets.append(warm_compile.parse_args(common + ["--chunks", ",".join(map(str, ours))]))
        if "tilegym" in impls:
            tilegym = ",".join(map(str, impl_chunks.get("tilegym", chunks)))
            sets.append(warm_compile.parse_args(common + ["--chunks", tilegym, "--kernels", "none", "--tilegym"]))
    return sets


# Running -------------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Options not listed here go to bench_forward.py (see its --help); the module docstring "
               "has the H200 commands.")
    ap.add_argument("--out", default=str(OUTPUT / "models.csv"), help="the merged CSV (default: %(default)s)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), metavar="MODEL",
                    help="which models (space- or comma-separated): " + ", ".join(MODELS))
    ap.add_argument("--resume", action="store_true", help="keep --out's rows, run only the points it lacks")
    ap.add_argument("--impl-chunks", default="", metavar="IMPL=C[:C...],...",
                    help="chunk lists merged over the defaults " + format_impl_chunks(IMPL_CHUNKS))
    ap.add_argument("--scale-down", type=int, default=1, metavar="N",
                    help="divide batch, seqlen, heads, headdim and dstate by N for a dry run (the "
                         "groups and the chunks stay as given)")
    ap.add_argument("--warm", action="store_true",
                    help="only compile the kernels' configs for these shapes ahead (warm_compile.py), then exit")
    ap.add_argument("--warm-procs", type=int, default=os.cpu_count() or 1,
                    help="processes compiling in parallel with --warm (default: %(default)s, one per core)")
    args, passthrough = ap.parse_known_args(argv)
    names = [n for item in args.models for n in item.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        ap.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(MODELS)}")
    args.models = list(dict.fromkeys(names))
    if args.scale_down < 1:
        ap.error(f"--scale-down must be a positive integer, got {args.scale_down}")
    if args.warm_procs < 1:
        ap.error(f"--warm-procs must be a positive integer, got {args.warm_procs}")
    try:
        args.impl_chunks = dict(IMPL_CHUNKS, **bench_forward.parse_impl_chunks(args.impl_chunks))
    except ValueError as e:
        ap.error(f"--impl-chunks: {e}")
    check_passthrough(ap, passthrough)
    args.passthrough = passthrough
    return args


def main(argv=None):
    args = parse_args(argv)
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    shapes = {name: scaled(MODELS[name], args.scale_down) for name in args.models}
    if args.warm:
        from tests.benchmark import warm_compile
        first = bench_forward.parse_args(bench_argv(shapes[args.models[0]], args.impl_chunks, args.passthrough))
        sets = warm_arg_sets(shapes.values(), first.impls, first.impl_chunks, first.chunks, args.warm_procs)
        print(f"warming {', '.join(args.models)}: {len(sets)} sets of configs", flush=True)
        warm_compile.warm(sets, args.warm_procs)
        return 0

    def on_term(signum, frame):
        raise bench_forward.Stopped(signal.Signals(signum).name)
    signal.signal(signal.SIGTERM, on_term)      # bench_forward.main installs the same while it runs

    by_model = load_output(args.out) if args.resume else {}
    work = tempfile.mkdtemp(prefix="bench_models_")
    start, stopped, current = time.time(), None, None
    try:
        for name in args.models:
            part = os.path.join(work, f"{name}.csv")
            argv = bench_argv(shapes[name], args.impl_chunks, args.passthrough, part, resume=True)
            have = by_model.get(name, [])
            todo = points_to_run(argv, have)
            if not todo:
                print(f"=== {name}: all {len(have)} points are in {args.out} already; skipped", flush=True)
                continue
            print(f"\n=== {name}: {shape_text(shapes[name])}; {len(todo)} points to run "
                  f"({time.time() - start:.0f} s into the run)", flush=True)
            write_csv(part, [{k: v for k, v in r.items() if k != "model"} for r in have])
            current, t0 = (name, part), time.time()
            rc = bench_forward.main(argv)
            by_model[name] = [dict(model=name, **r) for r in read_csv(part)]
            current = None
            write_output(args.out, by_model)
            print(f"=== {name}: {'stopped' if rc else 'done'} after {time.time() - t0:.0f} s", flush=True)
            if rc:
                stopped = True
                break
    except (bench_forward.Stopped, KeyboardInterrupt) as e:
        stopped = str(e) or "interrupted"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)      # keep what was measured: write it out
        if current is not None and os.path.exists(current[1]):
            by_model[current[0]] = [dict(model=current[0], **r) for r in read_csv(current[1])]
        if by_model or not args.resume:
            write_output(args.out, by_model)
        shutil.rmtree(work, ignore_errors=True)

    print("\neach implementation at its best chunk (ms, chunk in parentheses); speedup = the other's "
          "time / cutile's:")
    print(summary_table(args.out) if os.path.exists(args.out) else "(no results)")
    print(f"\nwrote {args.out} ({sum(map(len, by_model.values()))} rows) in {time.time() - start:.0f} s")
    if stopped:
        why = f" ({stopped})" if isinstance(stopped, str) else ""
        print(f"stopped{why}: run the same command with --resume to continue")
        return 143
    return 0


if __name__ == "__main__":
    sys.exit(main())
