"""Compile every config of every kernel's search space ahead of the autotuner, in parallel.

The autotuner times each candidate config on the real inputs, and the first launch of each one
compiles it (a second or more each, one at a time). cuTile keeps compiled kernels in a disk cache
keyed by the kernel, its constants and what the launch specializes on (dtypes, unit strides,
sizes divisible by 16). So launching every config once, from several processes at a time, on
inputs with the same constants and divisibility as the benchmark's, lets the tuner find them all
compiled.

    python -m tests.benchmark.warm_compile --dstates 64,128,256,512 --seqlens 1024,4096,16384,262144
    python -m tests.benchmark.warm_compile --chunks 64,128,256 --tilegym     # + the chunk sweep, TileGym
    python -m tests.benchmark.warm_compile --kernels fwd_pass_state          # one kernel's space
    python -m tests.benchmark.warm_compile --batch 8 --seqlens 2048 --dstates 128 --chunks 64,128,256
    python -m tests.benchmark.models --warm       # the model shapes (tests/benchmark/models.py), one pool

``--chunks`` are the chunks the benchmark calls with; each (length, dstate) compiles at the chunk
this project's forward then computes with (``ops/tuning/compute_chunk.py`` on this GPU, or as
MAMBA2_CUTILE_COMPUTE_CHUNK says: on an H200 a caller's 256 is often computed at 128). A length
stands for the longer ones that specialize alike at that chunk: 1K tokens have 4 chunks of 256
(not a multiple of 16), 4K and more have a multiple of 16 chunks; so list the lengths whose chunk
differs (``--seqlens 1024,4096,16384,262144`` for the grid: 4K x 64 stays at 256, 256K x 256 too)
and each compiles once, on the shortest such length's inputs. Give the benchmark's batch size too
(``--batch``): some search spaces depend on it.

``--tilegym`` also warms TileGym's cuTile kernels the same way: it calls TileGym's forward (which
runs its own exhaustive autotuning, compiling each of its configs) once per (dstate, seqlen, chunk)
in the worker processes. The configs those processes pick are thrown away -- they time on a shared
GPU -- but the compiled kernels land in the same disk cache, so the benchmark's TileGym worker
tunes without compiling.
"""
import argparse
import contextlib
import multiprocessing as mp
import os
import time


# ops.forward.KERNELS' names, known without importing torch (to parse the arguments)
KERNEL_NAMES = ("chunk_cumsum", "fwd_pass_state", "compute_out")
JOB_SIZE = 4                  # our kernels' variants a process takes at a time
PROGRESS_EVERY_S = 10


def _inputs(seqlen, dstate, nheads, headdim, ngroups, batch=1):
    """The benchmark's own inputs (bench_forward.make_inputs): the same shapes and dtypes."""
    import torch
    from tests.benchmark import bench_forward
    return bench_forward.make_inputs(torch, "cuda", batch, seqlen, nheads, headdim, ngroups, dstate,
                                     "bfloat16")


def _computed_chunk(caller, seqlen, dstate, args, gpu):
    """The chunk this project's forward computes with when the benchmark calls it at ``caller``
    (ops/tuning/compute_chunk.py: on an H200 often 128 for a caller's 256; MAMBA2_CUTILE_COMPUTE_CHUNK
    as set, e.g. "caller" for the chunk sweep): the chunk whose variants the tuner will time."""
    import torch
    from ops.tuning.compute_chunk import chunk_for
    return chunk_for(caller, gpu=gpu, dtype=torch.bfloat16, batch=args.batch, seqlen=seqlen,
                     nheads=args.nheads, headdim=args.headdim, dstate=dstate)


def specializes_as(seqlen, chunk):
    """What the launches of one chunk size specialize on that depends on the length: whether the
    tokens and the chunks are multiples of 16 (1K tokens are 4 chunks of 256, 4K and more 16+)."""
    return seqlen % 16 == 0, -(-seqlen // chunk) % 16 == 0


def _needs_int64(args, seqlen, dstate, chunk):
    """Whether the call's launches index with 64 bits (a tensor of 2**31 elements or more: at
    256K x 512 the entry states), which also narrows compute_out's search space."""
    from ops.kernels.compute_out import needs_int64
    return needs_int64(batch=args.batch, seqlen=seqlen, chunk_size=chunk, headdim=args.headdim,
                       dstate=dstate, nheads=args.nheads, ngroups=args.ngroups)


def _shapes(args, gpu=None):
    """(stand-in length, length, dstate, chunk, 64-bit) to compile at, lengths first as given:
    each (length, dstate, the caller's chunk) at the chunk the forward computes with, once per
    specialization and index width, launched on the shortest listed length that specializes
    alike (so 256K x 256, computed at 256, compiles on 4K's inputs when 4K is listed; 256K x 512,
    whose launches need 64-bit indices, on 4K's inputs with the 64-bit kernels forced)."""
    seen, shapes = set(), []
    for seqlen in args.seqlens:
        for caller in args.chunks:
            for dstate in args.dstates:
                chunk = _computed_chunk(caller, seqlen, dstate, args, gpu)
                alike = specializes_as(seqlen, chunk)
                wide = _needs_int64(args, seqlen, dstate, chunk)
                if (chunk, dstate, alike, wide) not in seen:
                    seen.add((chunk, dstate, alike, wide))
                    stand_in = min(L for L in args.seqlens if specializes_as(L, chunk) == alike)
                    shapes.append((stand_in, seqlen, dstate, chunk, wide))
    return shapes


def _tasks(args, gpu=None):
    import torch
    from ops import forward
    from ops.tuning.configs import unique
    tasks, tilegym = [], []
    # Lengths outermost, as the benchmark's grid runs them: a warm-up cut short by its time limit
    # has then compiled everything the first points need.
    cumsums = set()
    for stand_in, seqlen, dstate, chunk, wide in _shapes(args, gpu):
        shape = dict(batch=args.batch, seqlen=seqlen, nheads=args.nheads, headdim=args.headdim,
                     ngroups=args.ngroups, dstate=dstate, chunk_size=chunk,
                     dtype=torch.bfloat16, states_dtype=torch.bfloat16)
        for name in args.kernels:
            if name == "chunk_cumsum":      # it never sees dstate: one set of compiles per chunk serves all
                if (stand_in, chunk) in cumsums:
                    continue
                cumsums.add((stand_in, chunk))
            space = forward.KERNELS[name].search_space(**shape)
            if wide and name != "chunk_cumsum":   # the 64-bit kernels the long call will launch
                space = unique([{**cfg, "INDEX64": True} for cfg in space])
            tasks += [(name, stand_in, dstate, chunk, cfg) for cfg in space]
    if args.tilegym:
        tilegym = [("tilegym", seqlen, dstate, chunk, (part, args.tilegym_parts))
                   for chunk in args.chunks for dstate in args.dstates for seqlen in args.seqlens
                   if seqlen % chunk == 0 for part in range(args.tilegym_parts)]
    return tilegym + tasks      # the long TileGym searches first


def _worker(job):
    """Launch each (kernel, config) once through the forward pass (the other kernels at their
    defaults), exactly as the benchmark calls it: D, dt_bias, softplus."""
    tasks, args = job
    os.environ["MAMBA2_CUTILE_AUTOTUNE"] = "0"
    import torch
    from ops.forward import kernel_forward
    results, inputs = [], {}
    for name, seqlen, dstate, chunk, cfg in tasks:
        key = (seqlen, dstate)
        if key not in inputs:
            inputs.clear()
            inputs[key] = _inputs(seqlen, dstate, args.nheads, args.headdim, args.ngroups, args.batch)
        t0 = time.time()
        try:
            if name == "tilegym":
                _tilegym_forward(inputs[key], chunk, *cfg)
            else:
                kernel_forward(**inputs[key], chunk_size=chunk, dt_softplus=True, configs={name: cfg})
            torch.cuda.synchronize()
            results.append((name, seqlen, dstate, chunk, cfg, "ok", time.time() - t0))
        except Exception as e:   # a config that fails here is skipped by the tuner too
            results.append((name, seqlen, dstate, chunk, cfg, f"{type(e).__name__}: {str(e)[:120]}",
                            time.time() - t0))
    return results


# TileGym's functions listing each kernel's autotuning configs, forward and backward, and the
# in-process caches of its searches' winners (tilegym/ops/cutile/mamba2.py).
TILEGYM_CONFIG_LISTS = ("_chunk_cumsum_autotune_configs", "_fwd_pass_state_autotune_configs",
                        "_compute_out_configs", "_compute_out_swap_configs",
                        "_bwd_pass_state_autotune_configs", "_compute_dd_dcb_dx_autotune_configs",
                        "_compute_da_db_dc_ddt_autotune_configs")
TILEGYM_TUNE_CACHES = ("_chunk_cumsum_tune_cache", "_fwd_pass_state_tune_cache",
                       "_compute_out_tune_cache", "_fwd_pass_state_dual_tune_cache",
                       "_bwd_pass_state_tune_cache", "_compute_dd_dcb_dx_tune_cache",
                       "_compute_da_db_dc_ddt_tune_cache")


def clear_tilegym_caches(tg):
    """Empty TileGym's in-process caches of its searches' winners (module ``tg``), so that its
    next calls search (or look up) afresh."""
    for name in TILEGYM_TUNE_CACHES:
        getattr(tg, name, {}).clear()


@contextlib.contextmanager
def tilegym_configs_sliced(part, nparts):
    """Within it, each of TileGym's autotuning lists is cut to every ``nparts``-th config from
    ``part`` on, and its searches start afresh: an exhaustive search then compiles only those,
    so ``nparts`` processes compile one shape's configs together. Its tuner's prints (every
    config's time) are swallowed."""
    import io
    import tilegym.ops.cutile.mamba2 as tg

    def sliced(listing):
        def configs(*a, **k):
            every = list(listing(*a, **k))
            return every[part::nparts] or every[:1]
        return configs
    originals = {name: getattr(tg, name) for name in TILEGYM_CONFIG_LISTS if hasattr(tg, name)}
    clear_tilegym_caches(tg)
    try:
        for name, listing in originals.items():
            setattr(tg, name, sliced(listing))
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for name, listing in originals.items():
            setattr(tg, name, listing)
        clear_tilegym_caches(tg)                    # winners among a slice: not the real ones


class TileGymWinners:
    """The winners file's entries (``found``: key -> entry) and, since the context opened, how
    many of TileGym's searches it answered (``reused``) and how many ran (``searched``)."""

    def __init__(self, found):
        self.found, self.reused, self.searched = found, 0, 0


def read_winners(path):
    """The entries of a winners file (``tilegym_winners``), {} where it does not exist yet; a file
    that is not a JSON object of entries, or a path whose folder does not exist, is a
    ValueError naming it (before any search is spent on it)."""
    import json
    import pathlib
    path = pathlib.Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"--tilegym-winners {path}: its folder {path.parent} does not exist")
    if not path.exists():
        return {}
    try:
        found = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"--tilegym-winners {path}: not a winners file ({e})") from None
    if not isinstance(found, dict) or not all(isinstance(v, dict) and "config" in v
                                              for v in found.values()):
        raise ValueError(f"--tilegym-winners {path}: not a winners file (expected a JSON object "
                         f"of entries with a config each)")
    return found


def _save_winner(path, key, entry):
    """Add one entry to the file: read again, merged, written whole to a new file that then
    replaces it (a run killed mid-write leaves the old file)."""
    import json
    import pathlib
    path = pathlib.Path(path)
    found = read_winners(path)
    found[key] = entry
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    os.replace(temporary, path)


@contextlib.contextmanager
def tilegym_winners(path, part=0, nparts=1, keep=True):
    """Within it, each of TileGym's autotuning searches (``cuda.tile.tune.exhaustive_search`` as
    its mamba2 module calls it) is first looked up in the JSON file ``path``: a search made
    before, in any process, with the same TileGym and cuda.tile versions, on the same GPU model,
    for the same kernel, the same arguments' shapes, strides and dtypes and the same list of
    configs (``tilegym_search``), gives back its winner without timing anything (nor compiling
    the losers); any other search runs, as TileGym runs it, and its winner is added to the file
    at once (``_save_winner``: a run cut short keeps what it found). TileGym's searches are
    exhaustive and in memory only, 35-95 s a shape on an H200: with their winners kept, a later
    run times the configs TileGym's own search picked, and its first step compiles only those.
    Each entry says what it was searched for (kernel, GPU, versions, arguments) and what won.
    -> ``TileGymWinners`` (how many searches it answered and how many ran).

    ``keep`` False (a warm process of ``fwd_bwd.py --warm-procs``, timing on a shared GPU): a
    search the file does not hold times only every ``nparts``-th config from ``part`` on, to
    compile its share (as ``tilegym_configs_sliced``), and its winner is not kept, in the file
    or in TileGym's caches; prints are swallowed."""
    import io

    import tilegym.ops.cutile.mamba2 as tg
    from cuda.tile.tune import Measurement, TuningResult
    state = TileGymWinners(read_winners(path))
    search = tg.exhaustive_search
    versions = _versions()

    def remembered(configs, stream, grid_fn, kernel, args_fn, hints_fn=None, **options):
        configs = list(configs)
        key, described = tilegym_search(configs, kernel, args_fn, versions)
        entry = state.found.get(key)
        names = [repr(c) for c in configs]
        if entry is not None and entry["config"] in names:
            state.reused += 1
            best = Measurement(config=configs[names.index(entry["config"])],
                               mean_us=entry["mean_us"], num_samples=0, error_margin_us=0.0)
            return TuningResult(best=best, successes=[best], failures=[])
        state.searched += 1
        if not keep:
            return search(configs[part::nparts] or configs[:1], stream, grid_fn, kernel, args_fn,
                          hints_fn, **options)
        result = search(configs, stream, grid_fn, kernel, args_fn, hints_fn, **options)
        entry = dict(described, config=repr(result.best.config), mean_us=result.best.mean_us)
        state.found[key] = entry
        _save_winner(path, key, entry)
        return result
    quiet = contextlib.nullcontext() if keep else contextlib.redirect_stdout(io.StringIO())
    if not keep:
        clear_tilegym_caches(tg)
    tg.exhaustive_search = remembered
    try:
        with quiet:
            yield state
    finally:
        tg.exhaustive_search = search
        if not keep:                                # winners among a slice: not the real ones
            clear_tilegym_caches(tg)


def tilegym_search(configs, kernel, args_fn, versions):
    """(key, description) of one TileGym search: what its winner depends on -- the TileGym and
    cuda.tile ``versions`` (``_versions``), the GPU model, the kernel, its arguments' shapes,
    strides and dtypes (and plain values) as the first config binds them, and the list of configs
    searched -- as a hex digest, and the same in words for the file's readers (the config list as
    its length)."""
    import hashlib

    import torch
    args = [f"{tuple(a.shape)} {tuple(a.stride())} {a.dtype}" if torch.is_tensor(a) else repr(a)
            for a in args_fn(configs[0])]
    described = dict(kernel=_kernel_label(kernel), gpu=(torch.cuda.get_device_name()
                                                        if torch.cuda.is_available() else "cpu"),
                     versions=versions, args=args, configs=len(configs))
    text = repr((described, [repr(c) for c in configs]))
    return hashlib.sha256(text.encode()).hexdigest(), described


def _versions():
    """The TileGym and cuda.tile versions a winner was found with (``bench_forward``'s lookup)."""
    from tests.benchmark.bench_forward import package_versions
    versions = package_versions()
    return {k: versions[k] for k in ("tilegym", "cuda_tile")}


def _kernel_label(kernel):
    """A ``@ct.kernel``'s function's name (TileGym may pass a function of the config instead)."""
    from ops.runtime.cutile_internals import kernel_function
    try:
        kernel = kernel_function(kernel)
    except TypeError:
        pass
    return getattr(kernel, "__qualname__", repr(kernel))


def _tilegym_forward(inp, chunk, part=0, nparts=1):
    """TileGym's forward as the benchmark calls it (processed dt, zero initial state), within
    ``tilegym_configs_sliced(part, nparts)``."""
    from tests.benchmark import bench_forward
    forward = bench_forward.build("tilegym", inp, chunk)
    with tilegym_configs_sliced(part, nparts):
        forward()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dstates", default="64,128,256,512")
    ap.add_argument("--seqlens", default="1024,4096,16384,262144")
    ap.add_argument("--nheads", type=int, default=80)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--ngroups", type=int, default=1)
    ap.add_argument("--chunks", default="256", help="chunk sizes, e.g. 64,128,256")
    ap.add_argument("--tilegym", action="store_true", help="also warm TileGym's kernels (see above)")
    ap.add_argument("--tilegym-parts", type=int, default=8,
                    help="processes sharing one shape's TileGym configs (each compiles every n-th)")
    ap.add_argument("--kernels", default=",".join(KERNEL_NAMES),
                    help="which of our kernels to warm (comma-separated; 'none' with --tilegym "
                         "for TileGym's alone)")
    ap.add_argument("--procs", type=int, default=min(12, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    args.dstates = [int(v) for v in args.dstates.split(",")]
    args.seqlens = [int(v) for v in args.seqlens.split(",")]
    args.chunks = [int(v) for v in args.chunks.split(",")]
    args.kernels = [k for k in args.kernels.split(",") if k and k != "none"]
    unknown = set(args.kernels) - set(KERNEL_NAMES)
    if unknown:
        ap.error(f"--kernels: unknown {sorted(unknown)}; expected some of {', '.join(KERNEL_NAMES)}")
    return args


def _jobs(arg_sets, gpu="this GPU"):
    """The pool's jobs: each TileGym slice's search alone (the slices of one shape then run side
    by side), our kernels' variants in small batches of consecutive tasks (one shape's inputs
    serve a batch), handed out in order, so that progress shows as they finish and the first
    shapes are compiled first; the long TileGym searches before everything. ``gpu``: the name the
    compute chunk's rules see (by default this machine's GPU, None without one). -> (jobs, total)"""
    if gpu == "this GPU":
        import torch
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    jobs, total = [], 0
    for args in arg_sets:
        tasks = _tasks(args, gpu)
        total += len(tasks)
        ours = [t for t in tasks if t[0] != "tilegym"]
        jobs += [([t], args) for t in tasks if t[0] == "tilegym"]
        jobs += [(ours[i:i + JOB_SIZE], args) for i in range(0, len(ours), JOB_SIZE)]
    jobs.sort(key=lambda job: job[0][0][0] != "tilegym")
    return jobs, total


def warm(arg_sets, procs):
    """Compile the tasks of every parsed argument set (each its own shape) on one pool of
    ``procs`` processes: several shapes share the processes instead of each starting its own."""
    jobs, total = _jobs(arg_sets)
    if not jobs:
        print("nothing to compile", flush=True)
        return
    print(f"compiling {total} kernel variants in {min(procs, len(jobs))} processes", flush=True)
    t0, shown, done, failed = time.time(), 0.0, 0, []
    with mp.get_context("spawn").Pool(min(procs, len(jobs))) as pool:
        for results in pool.imap_unordered(_worker, jobs):
            done += len(results)
            failed += [r for r in results if r[5] != "ok"]
            now = time.time() - t0
            if now - shown >= PROGRESS_EVERY_S or done == total:
                last = results[-1]
                print(f"  {done}/{total} done ({now:.0f} s; last: {last[0]} L={last[1]} "
                      f"dstate={last[2]} chunk={last[3]})", flush=True)
                shown = now
    print(f"{total - len(failed)} compiled, {len(failed)} failed, {time.time() - t0:.0f} s")
    for name, seqlen, dstate, chunk, cfg, status, _ in failed:
        print(f"  FAILED {name} L={seqlen} dstate={dstate} chunk={chunk} {cfg}: {status}")


def main(argv=None):
    args = parse_args(argv)
    warm([args], args.procs)


if __name__ == "__main__":
    main()
