"""The results table of ``tests/benchmark/README.md``, generated from the committed CSVs of
``results/`` beside it (the top-level README links to it and quotes no number).

    python -m tests.benchmark.readme_table            # rewrite the block in that README in place
    python -m tests.benchmark.readme_table --check    # exit 1, with a short diff, if it differs

The block lies between ``<!-- results-table:begin -->`` and ``<!-- results-table:end -->``. It
holds two tables at the four model shapes of ``ops.results.models.MODELS``, each with a note
(its CSV, the device the rows record, the chunks, how close the outputs or gradients came):

    the forward pass      ``FORWARD_CSV`` (``tests/benchmark/models.py``): ms of this project,
                          mamba_ssm's Triton kernels and TileGym, and ours' speedup over each
    the training step     ``TRAINING_CSVS`` (``tests/benchmark/fwd_bwd.py``): forward + backward,
                          ms and peak MiB of the same three, and ours' speedup over each; where
                          every row has it (``--graph``), the GPU time too

and, where ``CONTEXT_PARALLEL_CSV`` names one, context parallelism's scaling (every row of
``tests/benchmark/context_parallel.py``'s CSV, as ``ops.results.scaling`` lays it out).

Each implementation is read at the chunk a caller passes it (``CHUNKS``). A needed row that is
missing, repeated or without a time raises ``MissingRow`` naming the CSV and the row: nothing is
skipped silently. A new run that replaces a CSV changes one constant below.
"""
import argparse
import difflib
import math
import pathlib
import sys
import textwrap

from ops.results.models import MODELS
from ops.results.report import fmt_len, load

# The committed results the tables are made from (file names under RESULTS).
FORWARD_CSV = "models_auto_h200.csv"
# Searched in order: a model's training-step rows come from the first CSV that has the model.
TRAINING_CSVS = ("fwd_bwd_h200.csv",)
# A later run of ours alone whose peak memory is quoted under the training table (None: none).
PEAK_RECHECK_CSV = None
# Context parallelism's scaling (``tests/benchmark/context_parallel.py``; None: no table).
CONTEXT_PARALLEL_CSV = "context_parallel_1gpu_h200.csv"

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "benchmark" / "results"
README = ROOT / "tests" / "benchmark" / "README.md"
BEGIN = "<!-- results-table:begin -->"
END = "<!-- results-table:end -->"

OURS = "cutile"
PEERS = ("triton", "tilegym")
IMPLS = (OURS,) + PEERS
NAMES = {"cutile": "ours", "triton": "Triton", "tilegym": "TileGym"}
# The chunk each implementation is called with: a Mamba-2 config's 256 for mamba_ssm's Triton
# kernels and ours (which may compute at another: ops/tuning/compute_chunk.py), TileGym's own 64.
CHUNKS = {"cutile": 256, "triton": 256, "tilegym": 64}
SHAPE_KEYS = ("batch", "seqlen", "nheads", "headdim", "ngroups", "dstate")


class MissingRow(LookupError):
    """A row the README's table needs is not in its CSV (or is there twice, or has no time)."""


# Finding rows ----------------------------------------------------------------------------------

def find_row(rows, source, model, impl, model_key, time_key, shape=None):
    """The one row of ``model`` and ``impl`` at ``CHUNKS[impl]`` with a finite ``time_key``,
    else MissingRow naming ``source``; with ``shape``, its sizes must be those."""
    what = f"{model_key}={model}, impl={impl}, chunk={CHUNKS[impl]}"
    hits = [r for r in rows if r.get(model_key) == model and r.get("impl") == impl
            and r.get("chunk") == CHUNKS[impl]]
    if not hits:
        raise MissingRow(f"{source}: no row with {what}")
    if len(hits) > 1:
        raise MissingRow(f"{source}: {len(hits)} rows with {what}; expected one")
    row = hits[0]
    status = row.get("status", "ok")
    time = row.get(time_key)
    if (status != "ok" or isinstance(time, bool) or not isinstance(time, (int, float))
            or not math.isfinite(time)):
        raise MissingRow(f"{source}: the row with {what} has no time "
                         f"({time_key}={time!r}, status={status!r})")
    if shape is not None:
        got = {k: row.get(k) for k in SHAPE_KEYS}
        if got != {k: shape[k] for k in SHAPE_KEYS}:
            raise MissingRow(f"{source}: the row with {what} has sizes {got}, not the model's {shape}")
    return row


def training_source(sources, model):
    """(name, rows) of the first of ``sources`` (pairs of a CSV's name and its rows) with any row
    of ``model``; MissingRow naming them all when none has."""
    for name, rows in sources:
        if any(r.get("shape") == model for r in rows):
            return name, rows
    names = ", ".join(name for name, _ in sources)
    raise MissingRow(f"{names}: no row with shape={model}")


# Formatting ------------------------------------------------------------------------------------

def shape_text(shape):
    """16 x 2K, 24 heads[, 8 groups]"""
    text = f"{shape['batch']} × {fmt_len(shape['seqlen'])}, {shape['nheads']} heads"
    return text + (f", {shape['ngroups']} groups" if shape["ngroups"] > 1 else "")


def ratio(theirs, ours):
    return f"{theirs / ours:.2f}×"


def table(header, rows, right_from=1):
    """A markdown table; columns from ``right_from`` on are right-aligned."""
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return ["| " + " | ".join(cells) + " |" for cells in [header, align] + rows]


def chunks_text(rows_by_impl, first, second=None):
    """"ours called at 256, computing at 128; Triton called at 256; ...": the chunk
    each implementation was called at, and where the CSV records another, the chunk it computed
    with (``first``; ``second`` for the backward where it differs from the forward)."""
    parts = []
    for impl in (OURS,) + PEERS:
        rows = rows_by_impl[impl]
        called = sorted({r["chunk"] for r in rows})
        computed = sorted({r.get(first) for r in rows} | ({r.get(second) for r in rows} if second else set()))
        text = f"{NAMES[impl]} called at {'/'.join(map(str, called))}"
        if computed != called and None not in computed:
            text += f", computing at {'/'.join(map(str, computed))}"
        parts.append(text)
    return "; ".join(parts)


def link(name):
    """A CSV's name as a markdown link from the README the table sits in (beside ``results/``)."""
    return f"[`{name}`]({RESULTS.relative_to(README.parent).as_posix()}/{name})"


def sci(value):
    """2.7e-3, not 2.7e-03."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def wrap(text, width=110):
    """A paragraph as lines of at most ``width`` characters (a link is never broken)."""
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)


def devices(*row_lists):
    found = sorted({r.get("device") or "an unrecorded device" for rows in row_lists for r in rows})
    return " and ".join(found)


def largest(rows, key):
    """The largest finite float of ``key`` over ``rows`` (CSV text or numbers), or None."""
    values = []
    for r in rows:
        try:
            v = float(r.get(key))
        except (TypeError, ValueError):
            continue
        if math.isfinite(v):
            values.append(v)
    return max(values) if values else None


# The tables ------------------------------------------------------------------------------------

def forward_table(rows, source=FORWARD_CSV, models=MODELS):
    """(lines of the forward pass's table, the rows it used per impl), from ``bench_forward.py``
    rows (``tests/benchmark/models.py``'s CSV)."""
    rows = load(rows)
    body, used = [], {impl: [] for impl in IMPLS}
    for model, shape in models.items():
        got = {impl: find_row(rows, source, model, impl, "model", "ms", shape) for impl in IMPLS}
        for impl in IMPLS:
            used[impl].append(got[impl])
        ms = {impl: got[impl]["ms"] for impl in IMPLS}
        body.append([f"`{model}`", shape_text(shape)]
                    + [f"{ms[impl]:.3f}" for impl in IMPLS]
                    + [ratio(ms[peer], ms[OURS]) for peer in PEERS])
    header = ["forward, ms", "batch × tokens, heads", "ours", "Triton", "TileGym", "× Triton",
              "× TileGym"]
    return table(header, body, right_from=2), used


def training_table(sources, models=MODELS):
    """(lines of the training step's table, the rows it used per impl, the CSVs' names in the
    order used), from ``fwd_bwd.py`` rows. ``sources``: (CSV name, rows) pairs, searched in
    order per model (``training_source``)."""
    sources = [(name, load(rows)) for name, rows in sources]
    body, used, names = [], {impl: [] for impl in IMPLS}, []
    for model, shape in models.items():
        name, rows = training_source(sources, model)
        if name not in names:
            names.append(name)
        got = {impl: find_row(rows, name, model, impl, "shape", "fwd_bwd_ms", shape) for impl in IMPLS}
        for impl in IMPLS:
            used[impl].append(dict(got[impl], source=name))
        ms = {impl: got[impl]["fwd_bwd_ms"] for impl in IMPLS}
        peak = {impl: got[impl].get("peak_mib") for impl in IMPLS}
        if any(isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p)
               for p in peak.values()):
            raise MissingRow(f"{name}: a row of shape={model} has no peak_mib ({peak})")
        gpu = {impl: got[impl].get("graph_ms") for impl in IMPLS}
        body.append(([f"`{model}`"] + [f"{ms[impl]:.2f}" for impl in IMPLS]
                     + [ratio(ms[peer], ms[OURS]) for peer in PEERS],
                     gpu, [" / ".join(f"{peak[impl]:.0f}" for impl in IMPLS)]))
    # GPU time (the step replayed from a CUDA graph), where every row has it
    graphed = all(_finite(t) for _, gpu, _ in body for t in gpu.values())
    header = ["training step, ms", "ours", "Triton", "TileGym", "× Triton", "× TileGym"]
    if graphed:
        header += ["GPU ms: ours / Triton / TileGym", "GPU: × Triton / × TileGym"]
    header += ["peak MiB: ours / Triton / TileGym"]
    lines = [eager + ([" / ".join(f"{gpu[impl]:.2f}" for impl in IMPLS),
                       " / ".join(ratio(gpu[peer], gpu[OURS]) for peer in PEERS)]
                      if graphed else []) + peak for eager, gpu, peak in body]
    return table(header, lines), used, names


def _finite(value):
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


def recheck_note(recheck, models=MODELS):
    """The sentence quoting a later run of ours alone (``PEAK_RECHECK_CSV``) at a model shape."""
    name, rows = recheck
    rows = load(rows)
    model = next((m for m in models if any(r.get("shape") == m for r in rows)), None)
    if model is None:
        raise MissingRow(f"{name}: no row with a model shape ({', '.join(models)})")
    row = find_row(rows, name, model, OURS, "shape", "fwd_bwd_ms", models[model])
    return (f" Ours' peaks include buffers the code now frees sooner: alone, `{model}` took "
            f"{row['peak_mib']:.0f} MiB, {row['fwd_bwd_ms']:.2f} ms ({link(name)}).")


def scaling_block(source):
    """(lines of context parallelism's table, its note) from ``source``: (CSV name, rows)."""
    from ops.results import scaling
    name, rows = source
    rows = scaling.scaling_rows(rows)
    if not rows:
        raise MissingRow(f"{name}: no rows")
    first = rows[0]
    sizes = sorted({int(r["world_size"]) for r in rows})
    gpus = ("Measured so far on one GPU only: the baseline at world size 1, which a run over "
            "several GPUs (`context_parallel.py` under torchrun) replaces." if sizes == [1]
            else f"World sizes {', '.join(map(str, sizes))}, GPUs of one machine, NCCL.")
    note = (f"From {link(name)}, on the {devices(rows)}: one sequence, {first.get('nheads')} heads × "
            f"headdim {first.get('headdim')} × dstate {first.get('dstate')}, "
            f"{first.get('dtype')}, this project's scan split over the GPUs "
            "(`ops.context_parallel`); strong: one sequence split, weak: the same tokens per GPU. "
            "ms: the slowest rank's median call; speedup and efficiency against one GPU; "
            f"collective: the largest share of a rank's call spent in the exchanges. {gpus}")
    return scaling.markdown(rows), note


def tilegym_dt_note(rows):
    """Where TileGym's forward had its dt processed (it takes the processed step, the others fuse
    it): the rows' ``tilegym_dt`` column ("in call": within the timed call), else outside it."""
    if rows and all(r.get("tilegym_dt") == "in call" for r in rows):
        return (" TileGym's dt is processed (bias, softplus) in PyTorch within its timed call, as"
                " a model calling it must.")
    return " TileGym is given dt already processed, outside its timed call."


def tilegym_step_note(rows):
    """How TileGym's training step was timed: rows with a ``bare_ms`` column ran its two functions
    in an autograd node with dt processed before it (``fwd_bwd.py``'s ``TileGymScan``), rows
    without it the two functions alone on a processed dt; rows of both kinds are refused."""
    kinds = {"bare_ms" in r for r in rows}
    if len(kinds) > 1:
        raise ValueError("TileGym's training-step rows mix the two ways of timing it (with and "
                         "without bare_ms): take them from one run")
    if kinds == {True}:
        return (" TileGym, which ships its forward and backward as two functions, runs them in an"
                " autograd node with dt's bias and softplus done in PyTorch before it, as a model"
                " training through them would.")
    return " TileGym gets dt already processed and returns no dt or dt_bias gradient."


def build_block(forward_rows, training_sources, recheck=None, forward_source=FORWARD_CSV,
                models=MODELS, scaling=None):
    """The text between the markers (without them), ending in a newline: the forward's table and
    its note, then the training step's table and its note, then (``scaling``: (CSV name, rows))
    context parallelism's table and its note."""
    fwd, fwd_used = forward_table(forward_rows, forward_source, models)
    train, train_used, names = training_table(training_sources, models)
    device = devices(*fwd_used.values(), *train_used.values())
    sizes = ", ".join(f"{key} {'/'.join(map(str, sorted({s[key] for s in models.values()})))}"
                      for key in ("headdim", "dstate"))
    err = {impl: largest(fwd_used[impl], "rel_err") for impl in IMPLS}
    agree = ", ".join(f"{sci(err[impl])} ({NAMES[impl]})" for impl in IMPLS if err[impl] is not None)
    fwd_chunks = chunks_text(fwd_used, "compute_chunk")
    fwd_note = (f"From {link(forward_source)}, on the {device}: bf16, {sizes}, D, dt_bias, softplus; "
                "medians of `triton.testing.do_bench`. × Triton, × TileGym: their time ÷ ours. "
                f"Chunks: {fwd_chunks}." + (f" Outputs within {agree} of Triton's." if agree else "")
                + tilegym_dt_note(fwd_used["tilegym"]))
    where = link(names[0])
    for other in names[1:]:
        these = [m for m, r in zip(models, train_used[OURS]) if r["source"] == other]
        where += f" ({', '.join(f'`{m}`' for m in these)}: {link(other)})"
    grads = [k for k in train_used[OURS][0] if k.startswith("grad_diff_")]
    worst = [v for v in (largest(train_used[OURS], k) for k in grads) if v is not None]
    train_chunks = chunks_text(train_used, "fwd_chunk", "bwd_chunk")
    graphed = all(_finite(r.get("graph_ms")) for impl in IMPLS for r in train_used[impl])
    train_note = (f"From {where}: forward, then `out.backward(dout)`, eager"
                  + ("; GPU: the same step replayed from a CUDA graph (no host time between "
                     "launches)" if graphed else "")
                  + "; peak: memory allocated in the step beyond that before it. Chunks"
                  + (" as above." if train_chunks == fwd_chunks else f": {train_chunks}.")
                  + (f" Gradients within {sci(max(worst))} of Triton's." if worst else "")
                  + tilegym_step_note(train_used["tilegym"])
                  + (recheck_note(recheck, models) if recheck is not None else ""))
    lines = fwd + [""] + wrap(fwd_note) + [""] + train + [""] + wrap(train_note)
    if scaling is not None:
        cp, cp_note = scaling_block(scaling)
        lines += [""] + cp + [""] + wrap(cp_note)
    return "\n".join(lines) + "\n"


def block_from_csvs(results=RESULTS):
    results = pathlib.Path(results)
    recheck = None
    if PEAK_RECHECK_CSV:
        recheck = (PEAK_RECHECK_CSV, load(results / PEAK_RECHECK_CSV))
    scaling = None
    if CONTEXT_PARALLEL_CSV:
        scaling = (CONTEXT_PARALLEL_CSV, load(results / CONTEXT_PARALLEL_CSV))
    return build_block(load(results / FORWARD_CSV),
                       [(name, load(results / name)) for name in TRAINING_CSVS], recheck,
                       scaling=scaling)


# The README ------------------------------------------------------------------------------------

def split_readme(text):
    """(before, block, after) around the markers; ValueError if they are not there once each."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"the README must hold {BEGIN} and {END} once each")
    before, rest = text.split(BEGIN, 1)
    block, after = rest.split(END, 1)
    if not block.startswith("\n"):
        raise ValueError(f"{BEGIN} must end its line")
    return before + BEGIN + "\n", block[1:], END + after


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.benchmark.readme_table",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 with a diff if the README's block differs from the CSVs'")
    parser.add_argument("--readme", default=str(README), help="the README to rewrite or check")
    args = parser.parse_args(argv)
    path = pathlib.Path(args.readme)
    text = path.read_text()
    before, current, after = split_readme(text)
    wanted = block_from_csvs()
    if args.check:
        if current == wanted:
            print(f"{path.name}: the results table matches the CSVs")
            return 0
        diff = difflib.unified_diff(current.splitlines(), wanted.splitlines(),
                                    f"{path.name} (now)", "from the CSVs", lineterm="", n=0)
        print("\n".join(diff))
        print(f"{path.name}: the results table differs from the CSVs; "
              "run python -m tests.benchmark.readme_table", file=sys.stderr)
        return 1
    if current != wanted:
        path.write_text(before + wanted + after)
        print(f"{path.name}: results table rewritten")
    else:
        print(f"{path.name}: results table already current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
