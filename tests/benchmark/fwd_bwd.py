"""A training step's scan: forward + backward against mamba_ssm's Triton kernels and TileGym's,
side by side.

    python -m tests.benchmark.fwd_bwd [--models mamba2-2.7b-train ...] [--grid] [--chunks 256,128]
        [--impls triton,cutile,tilegym] [--warm-procs 16] [--graph] [--out F.csv] [--plot F.png]
    python -m tests.benchmark.fwd_bwd --models --grid --grid-seqlens 4096 --impls triton,tilegym
    python -m tests.benchmark.fwd_bwd --replot F.csv --plot F.png      # no GPU needed
    python -m tests.benchmark.fwd_bwd --grid ... --resume part1.csv --out all.csv   # in parts

Shapes: the model shapes of ``tests/benchmark/models.py`` (``--models``; all by default) and, with
``--grid``, batch 1 x L in {4K, 16K, 64K} x dstate in {64, 128, 256}, 80 heads of headdim 64, 1
group (``--grid-seqlens`` / ``--grid-dstates``: a part of it). bf16, D, dt_bias, softplus; the same
seeded inputs (``bench_forward.make_inputs``) and the same output gradient for every
implementation:

    triton    mamba_ssm's ``mamba_chunk_scan_combined`` (autograd), chunk 256
    cutile    this project's (autograd through ``ops/backward.py``), at each of ``--chunks``
    tilegym   TileGym's ``mamba2_chunk_forward`` and ``mamba2_chunk_backward`` at
              ``--tilegym-chunk`` (only where the sequence length is a multiple of it), in the
              autograd node a model training through them needs (``TileGymScan``: TileGym ships
              the two functions, no wrapper), with dt's bias and softplus done in PyTorch before
              it (its kernels take the processed step; the others fuse that part): the same
              step, leaves and gradients as the others'

Per implementation and chunk (the caller's, as a model passes it):
    fwd_chunk, bwd_chunk  the chunks the forward and the backward computed with: the caller's,
                 but for this project's kernels where ``ops/tuning/compute_chunk.py`` picks another
                 (MAMBA2_CUTILE_COMPUTE_CHUNK=caller: the caller's)
    fwd_bwd_ms   median of ``triton.testing.do_bench`` of one step: the forward with x, dt, A, B,
                 C, D and dt_bias requiring gradients, then ``out.backward(dout)``
    fwd_ms       the forward alone, without gradients (TileGym's: dt processed, then its forward)
    bare_ms      TileGym's two functions alone, back to back, on a dt processed once: no
                 autograd, no dt work, no gradients of dt and dt_bias -- its kernels and their
                 Python without the training step around them (NaN for the others)
    tilegym_searches  with ``--tilegym-winners``, how many of TileGym's autotuning searches its
                 first step ran (0: the file answered every one, so first_s holds no search);
                 empty otherwise
    graph_ms     with ``--graph``: the same step captured once in a CUDA graph and replayed
                 (median of ``do_bench``), i.e. the GPU's time without the host's between
                 launches; NaN where the capture fails (its error is printed)
    first_s      the first step (compilation and autotuning included; after ``--warm-procs``
                 processes compiled it, so mostly the disk cache's load)
    peak_mib     memory allocated during one step beyond what was allocated before it
    speedup      Triton's fwd_bwd_ms / this one's (NaN where Triton did not run)
    grad_diff_*  each gradient's relative difference (in norm) from Triton's

``--resume CSV`` takes an earlier run's rows of the shapes it measured whole (every
implementation and chunk of this run) and runs only the others, so that a run longer than one
sitting on a machine (TileGym's search at every shape) is made in parts that add up to one CSV;
each shape's implementations are still measured side by side in one process.

``--warm-procs N`` first runs every first step in N spawned processes, which compile into the
disk caches. TileGym autotunes exhaustively (about a hundred configs for each of its five
kernels, each compiled on first use), which one process does one config at a time: so its
configs are shared out among ``--tilegym-parts`` processes per shape, each compiling every
n-th config of each list (``warm_compile.tilegym_configs_sliced``), and the timed run's own
search finds them compiled. Shapes that compile alike (the grid's 4K, 16K and 64K at one dstate)
share one such warm-up (``warm_jobs``). TileGym's search still times its configs at every shape:
35-95 s per shape on the H200, after a warm step of 206 s on 16 processes for the grid's three
dstates. ``--tilegym-winners JSON`` keeps its searches' winners in a file
(``warm_compile.tilegym_winners``): a search made before on the same GPU model is not made
again -- the step runs the config TileGym's own search picked -- and its warm-up compiles that
config alone; new searches are added to the file. Committed beside the run's CSV
(``results/tilegym_winners_h200.json``), it spares the next run on that GPU model the searches.
"""
import argparse
import multiprocessing as mp
import time
from typing import Callable, NamedTuple, Optional

import torch

IMPLS = ("triton", "cutile", "tilegym")
LEAVES = ("x", "dt", "A", "B", "C", "D", "dt_bias")
GRID_SEQLENS, GRID_DSTATES = (4096, 16384, 65536), (64, 128, 256)
GRID = [dict(batch=1, seqlen=L, nheads=80, headdim=64, ngroups=1, dstate=n)
        for L in GRID_SEQLENS for n in GRID_DSTATES]


def grid_points(seqlens=None, dstates=None):
    """The grid's shapes with seqlen in ``seqlens`` and dstate in ``dstates`` (None: all), so
    that a long run (TileGym's autotuning takes minutes per shape) can be made in parts; a value
    outside the grid is refused."""
    for name, wanted, known in (("seqlens", seqlens, GRID_SEQLENS),
                                ("dstates", dstates, GRID_DSTATES)):
        unknown = sorted(set(wanted or ()) - set(known))
        if unknown:
            raise ValueError(f"--grid-{name} {unknown} not in the grid's {list(known)}")
    return [s for s in GRID if (not seqlens or s["seqlen"] in seqlens)
            and (not dstates or s["dstate"] in dstates)]


def _scan(impl):
    """The scan of ``impl``: "triton", "cutile", or "interpret" (this project's kernels on the
    CPU interpreter, for ``work_count.py``)."""
    if impl == "triton":
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined
    from ops import mamba_chunk_scan_combined
    backend = "interpret" if impl == "interpret" else "cutile"
    return lambda *a, **k: mamba_chunk_scan_combined(*a, **k, backend=backend)


class StepFunctions(NamedTuple):
    """What a step builder gives: the training step, the forward alone (no gradients), the
    gradients of the last step (by leaf, float32), and its functions alone (TileGym's; None for
    the others)."""
    step: Callable
    forward: Callable
    grads: Callable
    bare: Optional[Callable]


def _autograd_step(impl, chunk, leaves, dout):
    scan = _scan(impl)

    def step():
        for t in leaves.values():
            t.grad = None
        out = scan(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
                   D=leaves["D"], dt_bias=leaves["dt_bias"], dt_softplus=True)
        out.backward(dout)

    def forward():
        with torch.no_grad():
            return scan(*(leaves[k].detach() for k in ("x", "dt", "A", "B", "C")), chunk,
                        D=leaves["D"].detach(), dt_bias=leaves["dt_bias"].detach(),
                        dt_softplus=True)

    def grads():
        return {k: leaves[k].grad.float().clone() for k in LEAVES}
    return StepFunctions(step, forward, grads, None)


class TileGymScan(torch.autograd.Function):
    """TileGym's functional ``mamba2_chunk_forward`` and ``mamba2_chunk_backward`` as one
    autograd node: TileGym ships the two functions and no autograd wrapper, so a model training
    through them needs this much. ``apply(x, dt, A, B, C, D, chunk, h0, dfinal, kernels)``:
    ``dt`` already processed (its bias added, softplus), ``h0`` and ``dfinal`` zero states
    (TileGym takes an initial state and a final state's gradient, always), ``kernels`` the
    (forward, backward) pair. Gradients for x, dt, A, B, C, D."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, chunk, h0, dfinal, kernels):
        out, _ = kernels[0](x, A, B, C, D, dt, h0, chunk_size=chunk)
        ctx.save_for_backward(x, dt, A, B, C, D)
        ctx.chunk, ctx.h0, ctx.dfinal, ctx.kernels = chunk, h0, dfinal, kernels
        return out

    @staticmethod
    def backward(ctx, dout):
        x, dt, A, B, C, D = ctx.saved_tensors
        dx, dA, dB, dC, dD, ddt, _ = ctx.kernels[1](x, A, B, C, D, dt, ctx.h0, dout.contiguous(),
                                                    ctx.dfinal, chunk_size=ctx.chunk)
        return dx, ddt, dA, dB, dC, dD, None, None, None, None


def _tilegym_step(chunk, leaves, dout, kernels=None):
    """TileGym's training step: ``dt`` processed in PyTorch (its bias, softplus: TileGym's
    kernels take the processed step, mamba_ssm's and this project's fuse it), then
    ``TileGymScan`` and ``out.backward(dout)``, every leaf getting its gradient, as the other
    implementations' steps. Besides: ``bare``, its two functions alone on a ``dt`` processed
    once (no autograd, no dt work, no gradients of dt and dt_bias): what its kernels and their
    Python cost without the training step around them. ``kernels``: the (forward, backward)
    pair, TileGym's by default."""
    if kernels is None:
        from tilegym.ops.cutile.mamba2 import mamba2_chunk_backward, mamba2_chunk_forward
        kernels = (mamba2_chunk_forward, mamba2_chunk_backward)
    from reference.common import process_dt
    x, A, B, C, D = (leaves[k] for k in ("x", "A", "B", "C", "D"))
    b, _, h, p = x.shape
    h0 = torch.zeros(b, h, p, B.shape[-1], device=x.device, dtype=torch.float32)
    dfinal = torch.zeros_like(h0)
    processed = lambda: process_dt(leaves["dt"], leaves["dt_bias"], dt_softplus=True).float()

    def step():
        for t in leaves.values():
            t.grad = None
        out = TileGymScan.apply(x, processed(), A, B, C, D, chunk, h0, dfinal, kernels)
        out.backward(dout)

    def forward():
        with torch.no_grad():
            return kernels[0](x, A, B, C, D, processed(), h0, chunk_size=chunk)[0]

    def grads():
        return {k: leaves[k].grad.float().clone() for k in LEAVES}

    with torch.no_grad():
        bare_inputs = [t.detach() for t in (x, A, B, C, D)] + [processed()]

    def bare():
        xb, Ab, Bb, Cb, Db, dtb = bare_inputs
        kernels[0](xb, Ab, Bb, Cb, Db, dtb, h0, chunk_size=chunk)
        kernels[1](xb, Ab, Bb, Cb, Db, dtb, h0, dout, dfinal, chunk_size=chunk)
    return StepFunctions(step, forward, grads, bare)


def _setup(shape):
    from tests.benchmark.bench_forward import make_inputs
    inputs = make_inputs(torch, "cuda", shape["batch"], shape["seqlen"], shape["nheads"],
                         shape["headdim"], shape["ngroups"], shape["dstate"], "bfloat16")
    dout = torch.randn(inputs["x"].shape, device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(1)).to(inputs["x"].dtype)
    return inputs, dout


def _graph_ms(step):
    """The median time of ``step`` replayed from a CUDA graph, or NaN where capturing fails."""
    from triton.testing import do_bench

    from tests.benchmark import capture_graph
    try:
        graph, _ = capture_graph(step)     # the step's tensors then live in the graph's pool
    except Exception as e:
        print(f"    CUDA graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.synchronize()
        return float("nan")
    ms = do_bench(graph.replay, warmup=50, rep=300)
    del graph
    torch.cuda.empty_cache()
    return ms


def measure(impl, chunk, inputs, dout, timed=True, graph=False, winners=None):
    """-> (row of timings, the gradients of one step). ``winners``: TileGym's searches' winners
    file (``warm_compile.tilegym_winners``), for its step."""
    if impl == "tilegym" and winners:
        from tests.benchmark.warm_compile import tilegym_winners
        with tilegym_winners(winners) as found:
            row, grads = _measure(impl, chunk, inputs, dout, timed, graph)
        row["tilegym_searches"] = found.searched
        return row, grads
    return _measure(impl, chunk, inputs, dout, timed, graph)


def _measure(impl, chunk, inputs, dout, timed, graph):
    from triton.testing import do_bench
    leaves = {k: v.detach().clone().requires_grad_(k in LEAVES) for k, v in inputs.items()}
    if impl == "tilegym":
        step, forward, grads, bare = _tilegym_step(chunk, leaves, dout)
    else:
        step, forward, grads, bare = _autograd_step(impl, chunk, leaves, dout)
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    if not timed:
        return dict(impl=impl, chunk=chunk, first_s=first), None
    g = grads()
    for t in leaves.values():
        t.grad = None                   # the step's gradients count in its peak
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    fwd_bwd = do_bench(step, warmup=50, rep=300)
    fwd = do_bench(forward, warmup=50, rep=200)
    row = dict(impl=impl, chunk=chunk, **computed_chunks(impl, chunk, inputs),
               fwd_bwd_ms=fwd_bwd, fwd_ms=fwd, first_s=first, peak_mib=peak,
               bare_ms=do_bench(bare, warmup=50, rep=300) if bare else float("nan"),
               tilegym_searches=None)
    if graph:                           # last: the captured step keeps its own memory
        row["graph_ms"] = _graph_ms(step)
    return row, g


def computed_chunks(impl, chunk, inputs):
    """The chunks the forward and the backward computed with (ops/tuning/compute_chunk.py: this
    project's kernels may take another than the caller's, the same for both passes; the others
    take the caller's)."""
    if impl != "cutile":
        return dict(fwd_chunk=chunk, bwd_chunk=chunk)
    from ops.tuning.compute_chunk import kernel_chunk
    used = kernel_chunk(chunk, inputs["x"], inputs["B"])
    return dict(fwd_chunk=used, bwd_chunk=used)


def _runs(shape, impls, chunks, tilegym_chunk):
    """(impl, chunk) pairs to run at ``shape``, Triton first (the baseline)."""
    runs = [("triton", 256)] if "triton" in impls else []
    runs += [("cutile", c) for c in chunks if "cutile" in impls]
    if "tilegym" in impls and shape["seqlen"] % tilegym_chunk == 0:
        runs.append(("tilegym", tilegym_chunk))
    return runs


def warm_jobs(shapes, impls, chunks, tilegym_chunk, tilegym_parts, winners=None):
    """The first steps ``--warm-procs`` runs: one per shape and run, but TileGym's exhaustive
    compiles (``tilegym_parts`` processes each) only once for the shapes that specialize alike
    (the same sizes but the length, whose tokens and chunks are multiples of 16 or not alike:
    ``warm_compile.specializes_as``), on the shortest: the grid's 4K, 16K and 64K at one dstate
    compile the same kernels. TileGym's first, the longest."""
    from tests.benchmark.warm_compile import specializes_as
    jobs, compiled = [], set()
    for s in sorted(shapes, key=lambda s: s["seqlen"]):
        for impl, c in _runs(s, impls, chunks, tilegym_chunk):
            if impl == "tilegym":
                key = (c, specializes_as(s["seqlen"], c),
                       *(s[k] for k in ("batch", "nheads", "headdim", "ngroups", "dstate")))
                if key in compiled:
                    continue
                compiled.add(key)
            parts = tilegym_parts if impl == "tilegym" else 1
            jobs += [(s, impl, c, part, parts, winners) for part in range(parts)]
    jobs.sort(key=lambda job: job[1] != "tilegym")
    return jobs


def _warm(job):
    """One first step in a fresh process: its compiled kernels land in the disk caches. For
    TileGym, one ``part`` of ``nparts`` of each of its autotuning lists (forward and backward:
    ``warm_compile.tilegym_configs_sliced``), so that several processes compile one shape's
    configs together and the timed run's search finds them all compiled; with a ``winners``
    file, a search it holds compiles its winner alone and only the others are sliced so
    (``warm_compile.tilegym_winners``: a warm process adds nothing to the file)."""
    shape, impl, chunk, part, nparts, winners = job
    inputs, dout = _setup(shape)
    label = f"warm {shape_text(shape)} {impl} {chunk}" + (f" part {part + 1}/{nparts}"
                                                          if nparts > 1 else "")
    try:
        if impl == "tilegym":
            from tests.benchmark.warm_compile import tilegym_configs_sliced, tilegym_winners
            with (tilegym_winners(winners, part, nparts, keep=False) if winners
                  else tilegym_configs_sliced(part, nparts)):
                row, _ = _measure(impl, chunk, inputs, dout, timed=False, graph=False)
        else:
            row, _ = measure(impl, chunk, inputs, dout, timed=False)
        return f"{label}: {row['first_s']:.0f} s"
    except Exception as e:               # reported; the timed run shows it again
        return f"{label}: {type(e).__name__}: {str(e)[:200]}"


def grad_diff(grad, ref):
    """Relative difference in norm; NaN for a gradient not given or of another shape."""
    if grad is None or grad.shape != ref.shape:
        return float("nan")
    return ((grad - ref).norm() / ref.norm()).item()


def bare_timed(row):
    return row.get("bare_ms") == row.get("bare_ms") and row.get("bare_ms") is not None


def shape_text(s):
    return f"{s['batch']}x{s['seqlen']}x{s['nheads']}h n{s['dstate']} g{s['ngroups']}"


def _graph_speedup(rows, row):
    """Triton's step replayed from a CUDA graph over this one's (NaN where either has none)."""
    base = next((r for r in rows if r["shape"] == row["shape"] and r["impl"] == "triton"), None)
    times = [r.get("graph_ms") if r else None for r in (base, row)]
    if any(t is None or t != t for t in times):
        return float("nan")
    return times[0] / times[1]


def plot(rows, path, device):
    """Each implementation's speedup over Triton per shape: the eager step's and, where the run
    had ``--graph``, the step replayed from a CUDA graph (the GPU's time alone; hatched)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = list(dict.fromkeys(r["shape"] for r in rows))
    pick = lambda s, impl, chunk: next((r for r in rows if r["shape"] == s and r["impl"] == impl
                                        and r["chunk"] == chunk), None)
    series = []
    for color, (impl, chunk) in enumerate(sorted({(r["impl"], r["chunk"]) for r in rows
                                                   if r["impl"] != "triton"})):
        found = [pick(s, impl, chunk) for s in labels]
        series.append((f"{impl}, called with chunk {chunk}", None, f"C{color}",
                       [r["speedup"] if r else float("nan") for r in found]))
        graphed = [_graph_speedup(rows, r) if r else float("nan") for r in found]
        if any(v == v for v in graphed):
            series.append((f"{impl}, called with chunk {chunk}, CUDA graph (GPU time)", "//",
                           f"C{color}", graphed))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(labels)), 4.5))
    width = 0.8 / max(len(series), 1)
    for k, (label, hatch, color, vals) in enumerate(series):
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))], vals,
               width, label=label, hatch=hatch, color=color, alpha=0.6 if hatch else 1.0)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("forward + backward speedup over Triton (chunk 256)")
    ax.set_title(f"Training step's scan (forward + backward), bf16, {device}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def resumed(path, shapes, impls, chunks, tilegym_chunk, graph):
    """(rows kept, shapes left) for ``--resume``: an earlier CSV's rows of the shapes whose every
    run (``_runs``) it holds, and the shapes still to run (a shape measured in part is run again
    whole, its earlier rows dropped, so that its implementations stay side by side in one
    process). Its rows of other shapes are kept too. Refused if it was made with and without
    ``--graph`` the other way (the columns would differ), or if its TileGym rows have no
    ``bare_ms`` column (they time its two functions alone, not a training step)."""
    from ops.results.report import load
    earlier = load(path)
    if any(r["impl"] == "tilegym" and "bare_ms" not in r for r in earlier):
        raise SystemExit(f"--resume {path}: its TileGym rows have no bare_ms column, so they time "
                         f"TileGym's two functions alone, not a training step: run them again")
    if earlier and ("graph_ms" in earlier[0]) != graph:
        raise SystemExit(f"--resume {path}: made {'with' if not graph else 'without'} --graph, "
                         f"this run {'with' if graph else 'without'}: give both the same")
    have = {(r["shape"], r["impl"], int(r["chunk"])) for r in earlier}
    done = {name for name, shape in shapes
            if all((name, impl, chunk) in have
                   for impl, chunk in _runs(shape, impls, chunks, tilegym_chunk))}
    names = {name for name, _ in shapes}
    kept = [r for r in earlier if r["shape"] in done or r["shape"] not in names]
    return kept, [(name, shape) for name, shape in shapes if name not in done]


def model_names(models, grid):
    """The model shapes a run measures: ``--models`` with names, those; ``--models`` alone, every
    one; no ``--models``, every one, or none when ``--grid`` is given (the grid alone)."""
    from tests.benchmark.models import MODELS
    if models is None:
        return [] if grid else sorted(MODELS)
    return list(models) or sorted(MODELS)


def main(argv=None):
    from tests.benchmark.models import MODELS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=None, choices=sorted(MODELS),
                        help="model shapes (none named: all; left out: all, or none with --grid)")
    parser.add_argument("--grid", action="store_true", help="also the L x dstate grid")
    parser.add_argument("--grid-seqlens", help="only these of the grid's seqlens, e.g. 4096,16384")
    parser.add_argument("--grid-dstates", help="only these of the grid's dstates, e.g. 64,128")
    parser.add_argument("--chunks", default="256,128", help="this project's chunks, e.g. 256,128")
    parser.add_argument("--impls", default="triton,cutile,tilegym")
    parser.add_argument("--tilegym-chunk", type=int, default=64)
    parser.add_argument("--tilegym-parts", type=int, default=8,
                        help="warm processes sharing one shape's TileGym configs (--warm-procs)")
    parser.add_argument("--tilegym-winners", metavar="JSON",
                        help="TileGym's searches' winners: those it holds are not searched "
                             "again, new ones are added (warm_compile.tilegym_winners)")
    parser.add_argument("--warm-procs", type=int, default=0,
                        help="compile every first step in this many processes first")
    parser.add_argument("--graph", action="store_true",
                        help="also time each step replayed from a CUDA graph (graph_ms)")
    parser.add_argument("--out", help="CSV file to write")
    parser.add_argument("--resume", metavar="CSV",
                        help="an earlier run's CSV: its shapes with every run measured are kept "
                             "and not run again (a long run made in parts)")
    parser.add_argument("--plot", help="figure (PNG) to write")
    parser.add_argument("--replot", metavar="CSV",
                        help="only draw --plot from this earlier run's CSV (no GPU needed)")
    args = parser.parse_args(argv)
    if (args.grid_seqlens or args.grid_dstates) and not args.grid:
        parser.error("--grid-seqlens and --grid-dstates choose part of --grid: give --grid too")
    if args.tilegym_winners:
        from tests.benchmark.warm_compile import read_winners
        try:
            read_winners(args.tilegym_winners)
        except ValueError as e:
            parser.error(str(e))
    if args.replot:
        from ops.results.report import load
        if not args.plot:
            parser.error("--replot needs --plot")
        rows = load(args.replot)
        plot(rows, args.plot, rows[0].get("device") or "GPU")
        return
    if not torch.cuda.is_available():
        raise SystemExit("fwd_bwd needs a CUDA GPU")
    impls = args.impls.split(",")
    unknown = set(impls) - set(IMPLS)
    if unknown:
        parser.error(f"unknown implementations {sorted(unknown)}; known: {', '.join(IMPLS)}")
    chunks = [int(c) for c in args.chunks.split(",")]
    names = model_names(args.models, args.grid)
    shapes = [(n, {k: MODELS[n][k] for k in ("batch", "seqlen", "nheads", "headdim", "ngroups",
                                             "dstate")}) for n in names]
    if args.grid:
        ints = lambda text: [int(v) for v in text.split(",")] if text else None
        try:
            points = grid_points(ints(args.grid_seqlens), ints(args.grid_dstates))
        except ValueError as e:
            parser.error(str(e))
        shapes += [(shape_text(s), s) for s in points]
    rows = []
    if args.resume:
        rows, shapes = resumed(args.resume, shapes, impls, chunks, args.tilegym_chunk, args.graph)
        print(f"resuming {args.resume}: {len(rows)} rows kept, {len(shapes)} shapes to run",
              flush=True)
    if args.warm_procs and shapes:
        jobs = warm_jobs([s for _, s in shapes], impls, chunks, args.tilegym_chunk,
                         args.tilegym_parts, args.tilegym_winners)
        start = time.perf_counter()
        with mp.get_context("spawn").Pool(args.warm_procs) as pool:
            for line in pool.imap_unordered(_warm, jobs):
                print(line, flush=True)
        print(f"warmed {len(jobs)} first steps in {time.perf_counter() - start:.0f} s", flush=True)
    for name, shape in shapes:
        inputs, dout = _setup(shape)
        base = ref = None               # Triton's row and gradients: the baseline, or none
        for impl, chunk in _runs(shape, impls, chunks, args.tilegym_chunk):
            try:
                row, grads = measure(impl, chunk, inputs, dout, graph=args.graph,
                                     winners=args.tilegym_winners)
            except Exception as e:
                print(f"{name:24s} {impl:7s} chunk {chunk:3d}: FAILED {type(e).__name__}: "
                      f"{str(e)[:200]}", flush=True)
                continue
            if impl == "triton":
                base, ref = row, grads
            nan = float("nan")
            row.update(shape=name, **shape,
                       speedup=base["fwd_bwd_ms"] / row["fwd_bwd_ms"] if base else nan,
                       **{f"grad_diff_{k}": grad_diff(grads.get(k), ref[k]) if ref else nan
                          for k in LEAVES})
            rows.append(row)
            diffs = [v for k in LEAVES if (v := row[f"grad_diff_{k}"]) == v]    # not NaN
            computed = ("" if (row["fwd_chunk"], row["bwd_chunk"]) == (chunk, chunk) else
                        f" (computed at {row['fwd_chunk']} / {row['bwd_chunk']})")
            print(f"{name:24s} {impl:7s} chunk {chunk:3d}{computed}: fwd+bwd "
                  f"{row['fwd_bwd_ms']:7.3f} ms ({row['speedup']:.2f}x Triton's), fwd {row['fwd_ms']:.3f} ms, first step "
                  f"{row['first_s']:.1f} s, peak +{row['peak_mib']:.0f} MiB, grad diff <= "
                  f"{max(diffs) if diffs else nan:.1e}"
                  + (f", graphed {row['graph_ms']:.3f} ms" if "graph_ms" in row else "")
                  + (f", its functions alone {row['bare_ms']:.3f} ms" if bare_timed(row) else ""),
                  flush=True)
        del inputs, dout
        if args.out and rows:           # after every shape: a run cut short keeps what it has
            from ops.results.report import write_csv
            device = torch.cuda.get_device_name()
            columns = dict.fromkeys(k for r in rows for k in r)     # (resumed rows may lack some)
            write_csv(args.out, [{**dict.fromkeys(columns), **r,
                                  "device": r.get("device") or device,
                                  "torch": r.get("torch") or torch.__version__} for r in rows])
    if args.plot and rows:
        plot(rows, args.plot, torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
