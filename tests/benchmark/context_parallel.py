"""Context parallelism's scaling: one long sequence's scan split over several GPUs
(``ops.context_parallel.context_parallel_chunk_scan``), timed per rank.

    torchrun --nproc-per-node 8 -m tests.benchmark.context_parallel --world-sizes 1,2,4,8 \\
        --out bench_out/context_parallel.csv
    python -m tests.benchmark.context_parallel --out bench_out/context_parallel_1gpu.csv   # 1 GPU
    python -m tests.benchmark.context_parallel --device cpu --tokens 64 --tokens-per-rank 32 \\
        --nheads 2 --headdim 8 --dstate 8 --chunk 16 --reps 2 --warmup 1 --out /tmp/cp.csv  # dry run
    python -m tests.benchmark.context_parallel --combine a.csv b.csv --out all.csv

Launched by torchrun, every process is one rank (on cuda:LOCAL_RANK, NCCL); launched by plain
``python``, the process makes a group of one rank itself (a rendezvous through a file in a
temporary folder, so no port is opened). ``--device cpu`` runs the same on gloo with the PyTorch
reference (``backend="reference"``): a dry run of the harness at tiny sizes, not a measurement.

What is run (bf16, D, dt_bias, softplus, no z, no final state: the call ``ops.mixer.Mamba2Mixer``
makes):
    --mode strong   one sequence of ``--tokens`` split over the ranks as evenly as possible (the
                    first ``tokens % world`` ranks one token more)
    --mode weak     ``--tokens-per-rank`` on every rank, a sequence of world x that many
    --what forward  the call, no input requiring a gradient
    --what step     the call with x, dt, A, B, C, D, dt_bias requiring gradients, then
                    ``out.backward(dout)`` (the backward of sum(out * dout)) with a fixed random dout
``--world-sizes 1,2,4,8`` measures each world size in turn within one launch, on the first k
ranks (a subgroup; the others wait), so that one CSV holds the world-size-1 baseline; by default
only the launch's whole world is measured.

Inputs: each rank's slice is its part of ONE seeded global sequence, whatever the world size:
the sequence is made of blocks of ``BLOCK`` tokens, block j drawn from a generator seeded by
(seed, j), and a rank draws only the blocks its slice overlaps, on its device. So the global
sequence is never built in one place, and the slices of a run at world size 1 and at 8 are parts
of the same numbers (on one kind of device: CPU and CUDA generators differ). Per
``bench_forward.make_inputs``: standard normals (never zeros), dt = 0.5 N - 1 with dt_bias and
softplus, A = -exp(0.5 N) < 0 (A, D, dt_bias from the seed alone: the same on every rank).

Timing, per rank (``--warmup`` calls after the first, then ``--reps`` timed ones): before each
call the device is synchronised and the ranks meet at a barrier (gloo, on the host), so that
they start together from idle devices; a call is timed from just after the barrier to the end of
its last kernel (CUDA events on the current stream; ``time.perf_counter`` on the CPU, where
every op is synchronous). Gradients are cleared between steps, outside the timing.

The collective's share, measured in the same calls (no second run): the module's three
collective helpers are wrapped, each call of them timed with two marks on the same timeline
(CUDA events recorded on the current stream before and after it, or perf_counter):
    _agree              the all-gather of a header of shapes and options that starts every call
                        (with the host-side input checks it runs first, and its copy of the
                        header to the host)
    _exchange           the all-gather of (decay, S_own), and the tiny scan over the ranks' pairs
    _AllGather.backward the backward's all-reduce of the gathered gradient (step only)
A mark before a collective is passed when everything queued before it has run, the mark after
when the collective has finished (NCCL's stream joins the current one on return), so each span is
the collective's own time on the rank's timeline, INCLUDING any wait for slower ranks to arrive
(load imbalance shows up here, as it does in training). The spans lie inside the call's span and
do not overlap, so on each rank the median of their sum is at most the median of the call. The
wrappers add two timestamps per helper call (microseconds). If a helper is renamed or never
called, the run stops rather than report zero.

Columns (one row per mode, what and world size; rank 0 writes ``--out`` afresh after each
measurement, so a run cut short keeps what it measured):
    tokens_total, tokens_per_rank   the sequence; the largest slice
    time_ms          max over ranks of each rank's median call time (the slowest bounds a step)
    collective_ms    max over ranks of each rank's median time in the collective helpers
    collective_share max over ranks of (median collective time / median call time), in [0, 1]
    first_s          max over ranks of the measurement's first call (wall clock, synchronised):
                     compiling included for what this process has not compiled before (the run
                     goes mode by mode, world size by world size, forward before step)
    peak_mib_max     max over ranks of torch.cuda.max_memory_allocated over the timed calls
                     (reset after the warm-up; inputs, dout and outputs included); NaN on the CPU
    speedup          throughput (tokens_total / time_ms) over that of the world-size-1 row of the
                     same mode, what, shape and device, and for strong scaling the same
                     tokens_total, for weak the same tokens_per_rank: T1 / TN (strong), N T1 / TN
                     (weak); NaN where the CSV has no such row
    efficiency       speedup / world_size
Runs made separately (one launch per world size) combine with ``--combine A.csv B.csv ... --out
ALL.csv``, which concatenates the rows (a later file's row replacing an earlier's of the same
mode, what, world size, sizes, shape and device) and recomputes speedup and efficiency.
"""
import argparse
import csv
import datetime
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

MODES, WHATS = ("strong", "weak"), ("forward", "step")
BLOCK = 4096                       # tokens per seeded block of the global sequence
COLUMNS = ("mode", "what", "world_size", "tokens_total", "tokens_per_rank", "batch", "nheads",
           "headdim", "dstate", "ngroups", "chunk", "dtype", "backend", "reps", "time_ms",
           "collective_ms", "collective_share", "first_s", "peak_mib_max", "speedup",
           "efficiency", "device", "torch")
# what a world-size-1 row must share with a row to be its baseline (and the size, per mode)
MATCH = ("mode", "what", "batch", "nheads", "headdim", "dstate", "ngroups", "chunk", "dtype",
         "backend", "device")
NAN = float("nan")


# Timing ---------------------------------------------------------------------------------------

class Clock:
    """Marks on one rank's timeline: CUDA events recorded on the current stream (on a GPU), or
    perf_counter (on the CPU, where ops run synchronously). Read spans after ``sync``."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end):
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


HELPERS = ("_agree", "_exchange", "_AllGather.backward")


class CollectiveMeter:
    """Wraps ``ops.context_parallel``'s collective helpers so that each call of them leaves a
    (name, start mark, end mark) span; ``with meter:`` installs the wrappers, and restores the
    originals on leaving."""

    def __init__(self, clock):
        self.clock, self.spans = clock, []

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            start = self.clock.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((name, start, self.clock.mark()))
        return timed

    def __enter__(self):
        from ops import context_parallel as cp
        missing = [n for n in ("_agree", "_exchange", "_AllGather") if not hasattr(cp, n)]
        if not missing and "backward" not in vars(cp._AllGather):
            missing = ["_AllGather.backward"]
        if missing:
            raise RuntimeError(f"ops.context_parallel has no {missing}: the collective's share "
                               "cannot be measured; update HELPERS and CollectiveMeter")
        self._saved = (cp._agree, cp._exchange, cp._AllGather.backward)
        cp._agree = self._timed("_agree", cp._agree)
        cp._exchange = self._timed("_exchange", cp._exchange)
        cp._AllGather.backward = staticmethod(self._timed("_AllGather.backward",
                                                          cp._AllGather.backward))
        return self

    def __exit__(self, *exc):
        from ops import context_parallel as cp
        agree, exchange, backward = self._saved
        cp._agree, cp._exchange, cp._AllGather.backward = agree, exchange, staticmethod(backward)

    def take(self, expected):
        """The summed span time (ms, after a sync) of the calls since the last take; raises if
        the helpers ``expected`` were not all called (a renamed or bypassed helper must not pass
        for a free collective)."""
        names = {name for name, _, _ in self.spans}
        if not set(expected) <= names:
            raise RuntimeError(f"expected collective helpers {sorted(expected)} to run; saw "
                               f"{sorted(names)}: ops.context_parallel changed?")
        total = sum(self.clock.ms(a, b) for _, a, b in self.spans)
        self.spans.clear()
        return total


# Inputs ---------------------------------------------------------------------------------------

def slice_inputs(lo, hi, batch, nheads, headdim, ngroups, dstate, dtype, device, seed=0):
    """Tokens [lo, hi) of one seeded global sequence (x, dt, B, C and the output gradient dout),
    plus A, D and dt_bias: see the module docstring."""
    dtype = getattr(torch, dtype)
    shapes = dict(x=(nheads, headdim), dt=(nheads,), B=(ngroups, dstate), C=(ngroups, dstate),
                  dout=(nheads, headdim))
    out = {k: torch.empty(batch, hi - lo, *s, device=device,
                          dtype=torch.float32 if k == "dt" else dtype) for k, s in shapes.items()}
    for j in range(lo // BLOCK, -(-hi // BLOCK)):
        g = torch.Generator(device=device).manual_seed(seed * 2**32 + 1 + j)
        a, b = max(lo, j * BLOCK), min(hi, (j + 1) * BLOCK)       # overlap, global positions
        for k, s in shapes.items():            # every block draws all five, in this order
            block = torch.randn(batch, BLOCK, *s, generator=g, device=device)
            if k == "dt":
                block = block * 0.5 - 1.0                          # softplus(dt + dt_bias) ~ 0.1 .. 1
            out[k][:, a - lo:b - lo] = block[:, a - j * BLOCK:b - j * BLOCK]
    g = torch.Generator(device=device).manual_seed(seed * 2**32)
    r = lambda: torch.randn(nheads, generator=g, device=device)
    out["A"] = -torch.exp(r() * 0.5)                               # Mamba-2: A = -exp(A_log) < 0
    out["D"] = r()
    out["dt_bias"] = r() * 0.5
    return out


def slice_bounds(mode, world, rank, tokens, tokens_per_rank):
    """(lo, hi, tokens_total, largest slice) of ``rank``'s slice at world size ``world``."""
    if mode == "weak":
        return rank * tokens_per_rank, (rank + 1) * tokens_per_rank, world * tokens_per_rank, \
            tokens_per_rank
    if tokens < world:
        raise ValueError(f"--tokens {tokens} < world size {world}: a rank needs a token")
    base, extra = divmod(tokens, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra), tokens, base + (extra > 0)


# One measurement --------------------------------------------------------------------------------

LEAVES = ("x", "dt", "A", "B", "C", "D", "dt_bias")


def measure_rank(what, inp, args, group, barrier_group, device, backend):
    """This rank's numbers for one (mode, what, world size): dict of median time, median
    collective time, share, first call and peak memory."""
    from ops import context_parallel_chunk_scan
    clock = Clock(device)
    grad = what == "step"
    leaves = {k: inp[k].detach().requires_grad_(grad) for k in LEAVES}
    dout = inp["dout"]

    def call():
        out = context_parallel_chunk_scan(
            leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], args.chunk,
            D=leaves["D"], dt_bias=leaves["dt_bias"], dt_softplus=True, backend=backend,
            process_group=group)
        if grad:
            out.backward(dout)

    def clear():
        for t in leaves.values():
            t.grad = None

    expected = HELPERS if grad else HELPERS[:2]
    with CollectiveMeter(clock) as meter:
        clock.sync()
        dist.barrier(group=barrier_group)
        t0 = time.perf_counter()
        call()
        clock.sync()
        first_s = time.perf_counter() - t0
        meter.take(expected)
        for _ in range(args.warmup):
            clear()
            call()
        clock.sync()
        meter.take(expected if args.warmup else ())
        if clock.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times, colls = [], []
        for _ in range(args.reps):
            clear()
            clock.sync()
            dist.barrier(group=barrier_group)
            start = clock.mark()
            call()
            end = clock.mark()
            clock.sync()
            times.append(clock.ms(start, end))
            colls.append(meter.take(expected))
    clear()
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if clock.cuda else NAN
    time_ms, coll_ms = statistics.median(times), statistics.median(colls)
    return dict(time_ms=time_ms, collective_ms=coll_ms,
                collective_share=coll_ms / time_ms if time_ms > 0 else NAN,
                first_s=first_s, peak_mib=peak)


def combine_ranks(parts):
    """One row's numbers from every rank's (``measure_rank``) of one measurement."""
    return dict(time_ms=max(p["time_ms"] for p in parts),
                collective_ms=max(p["collective_ms"] for p in parts),
                collective_share=max(p["collective_share"] for p in parts),
                first_s=max(p["first_s"] for p in parts),
                peak_mib_max=max(p["peak_mib"] for p in parts))


# Scaling ----------------------------------------------------------------------------------------

def _size_key(row):
    return int(row["tokens_per_rank"]) if row["mode"] == "weak" else int(row["tokens_total"])


def add_scaling(rows):
    """Fill speedup and efficiency in ``rows`` (dicts) from their world-size-1 rows (see the
    module docstring); NaN where a row has none. Returns rows."""
    key = lambda r: tuple(str(r[k]) for k in MATCH) + (_size_key(r),)
    base = {key(r): r for r in rows if int(r["world_size"]) == 1}
    for r in rows:
        b = base.get(key(r))
        if b is None:
            r["speedup"] = r["efficiency"] = NAN
            continue
        speedup = (int(r["tokens_total"]) / float(r["time_ms"])) / \
                  (int(b["tokens_total"]) / float(b["time_ms"]))
        r["speedup"], r["efficiency"] = speedup, speedup / int(r["world_size"])
    return rows


def write_rows(path, rows):
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: r.get(k, NAN) for k in COLUMNS} for r in rows)


def combine_files(paths, out):
    """The rows of several runs' CSVs in one, speedup and efficiency recomputed; where two files
    hold a row of the same mode, what, world size, size, shape and device, the later file's
    replaces the earlier's (so a baseline is never ambiguous)."""
    rows = {}
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                key = tuple(str(r[k]) for k in MATCH) + (int(r["world_size"]), _size_key(r))
                rows.pop(key, None)                 # a replaced row goes where the new one came
                rows[key] = r
    rows = list(rows.values())
    write_rows(out, add_scaling(rows))
    return rows


# The process group ------------------------------------------------------------------------------

def init_group(device_kind, timeout_s):
    """(device, cleanup): joins torchrun's group (env://) or makes a group of one rank."""
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    local = int(os.environ.get("LOCAL_RANK", 0))
    kwargs = dict(timeout=datetime.timedelta(seconds=timeout_s))
    if device_kind == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        kwargs.update(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        kwargs.update(backend="gloo")
    folder = None
    if launched:
        dist.init_process_group(**kwargs)
    else:
        folder = tempfile.TemporaryDirectory()
        store = dist.FileStore(os.path.join(folder.name, "store"), 1)
        dist.init_process_group(store=store, rank=0, world_size=1, **kwargs)

    def cleanup():
        dist.destroy_process_group()
        if folder is not None:
            folder.cleanup()
    return device, cleanup


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


# Main ------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES + ("both",), default="both")
    p.add_argument("--what", choices=WHATS + ("both",), default="both")
    p.add_argument("--tokens", type=int, default=1 << 20, help="strong: the sequence's length")
    p.add_argument("--tokens-per-rank", type=int, default=1 << 18, help="weak: each rank's slice")
    p.add_argument("--world-sizes", help="e.g. 1,2,4,8: measure on the first k ranks for each k "
                                         "(default: the launch's world size)")
    p.add_argument("--nheads", type=int, default=80)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--dstate", type=int, default=128)
    p.add_argument("--ngroups", type=int, default=1)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--backend", help="the scan's backend (default: cutile on cuda, reference "
                                     "on cpu)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls after the first")
    p.add_argument("--reps", type=int, default=10, help="timed calls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=int, default=1800,
                   help="collectives' timeout (idle ranks wait through others' measurements)")
    p.add_argument("--out", help="CSV to write (rank 0)")
    p.add_argument("--combine", nargs="+", metavar="CSV",
                   help="only merge these runs' CSVs into --out, recomputing speedup/efficiency")
    args = p.parse_args(argv)
    if args.combine and not args.out:
        p.error("--combine needs --out")
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be at least 1 and --warmup at least 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.combine:
        rows = combine_files(args.combine, args.out)
        print(f"{len(rows)} rows from {len(args.combine)} files -> {args.out}")
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here (--device cpu runs a dry run)")
    backend = args.backend or ("cutile" if args.device == "cuda" else "reference")
    device, cleanup = init_group(args.device, args.timeout_s)
    try:
        run(args, device, backend)
    finally:
        cleanup()


def run(args, device, backend):
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [int(s) for s in args.world_sizes.split(",")] if args.world_sizes else [world]
    if any(not 1 <= k <= world for k in sizes):
        raise SystemExit(f"--world-sizes {sizes}: each must be in 1..{world} (the launch's)")
    # groups are made collectively, by every rank, in the same order; the scan's on the device's
    # backend, the barriers' and the gathers' on gloo (host-side, and idle ranks spin no GPU)
    scan_groups, host_groups = {}, {}
    # (a new group's timeout is PyTorch's default, not the world's: given, so that ranks waiting
    # on a long measurement of others wait as long as --timeout-s says)
    wait = dict(timeout=datetime.timedelta(seconds=args.timeout_s))
    host_world = (dist.new_group(backend="gloo", **wait) if args.device == "cuda"
                  else dist.group.WORLD)
    for k in sizes:
        if k == world:
            scan_groups[k], host_groups[k] = dist.group.WORLD, host_world
        else:
            scan_groups[k] = dist.new_group(list(range(k)), **wait)
            host_groups[k] = (dist.new_group(list(range(k)), backend="gloo", **wait)
                              if args.device == "cuda" else scan_groups[k])
    modes = MODES if args.mode == "both" else (args.mode,)
    whats = WHATS if args.what == "both" else (args.what,)
    shape = dict(batch=args.batch, nheads=args.nheads, headdim=args.headdim,
                 dstate=args.dstate, ngroups=args.ngroups)
    common = dict(shape, chunk=args.chunk, dtype=args.dtype, backend=backend, reps=args.reps,
                  device=device_name(device), torch=torch.__version__)
    rows = []
    for mode in modes:
        for k in sizes:
            inp = None
            if rank < k:
                lo, hi, total, largest = slice_bounds(mode, k, rank, args.tokens,
                                                      args.tokens_per_rank)
                inp = slice_inputs(lo, hi, **shape, dtype=args.dtype, device=device,
                                   seed=args.seed)
            for what in whats:
                mine = (measure_rank(what, inp, args, scan_groups[k], host_groups[k], device,
                                     backend) if rank < k else None)
                parts = [None] * world
                dist.all_gather_object(parts, mine, group=host_world)
                if rank != 0:
                    continue
                _, _, total, largest = slice_bounds(mode, k, 0, args.tokens, args.tokens_per_rank)
                row = dict(common, mode=mode, what=what, world_size=k, tokens_total=total,
                           tokens_per_rank=largest, **combine_ranks(parts[:k]))
                rows.append(row)
                add_scaling(rows)
                print(f"{mode:6} {what:7} world {k}: {total} tokens ({largest}/rank) "
                      f"{row['time_ms']:.3f} ms, collective {row['collective_ms']:.3f} ms "
                      f"({100 * row['collective_share']:.1f}%), first {row['first_s']:.2f} s, "
                      f"peak {row['peak_mib_max']:.0f} MiB, speedup {row['speedup']:.2f}",
                      flush=True)
                if args.out:
                    write_rows(args.out, rows)
            del inp
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rank == 0 and args.out:
        print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
