"""Benchmark the Mamba-2 SSD forward pass against mamba_ssm's Triton kernels and TileGym.

    python -m tests.benchmark.bench_forward --csv results.csv --plot speedup.png   # the full grid, chunk 256
    python -m tests.benchmark.bench_forward --chunks 64,128,256 --csv chunks.csv   # + each one's best chunk
    python -m tests.benchmark.bench_forward --chunks 64,128,256 --impl-chunks tilegym=64,triton=128:256
    python -m tests.benchmark.bench_forward --seqlens 16K --dstates 128 --impls triton,cutile
    python -m tests.benchmark.bench_forward --device cpu --impls reference,interpret \\
        --seqlens 64,128 --dstates 16 --nheads 2 --headdim 16 --chunks 32        # dry run, no GPU

Implementations (``--impls``; one that is not installed is recorded as such and the run goes on):
    triton     mamba_ssm's ``mamba_chunk_scan_combined``: the published Triton kernels, forward only
    cutile     this project, ``ops.mamba_chunk_scan_combined(..., backend="cutile")``, autotuned
               (a search per shape with MAMBA2_CUTILE_AUTOTUNE=1, as run_h200.sh sets it;
               otherwise the committed table of tuned configs)
    cutile_default  the same kernels at their default configs (autotuning switched off for the
               call): tuned against untuned, side by side
    tilegym    NVIDIA TileGym's cuTile ``mamba2_chunk_forward``; it takes the processed dt
               (softplus(dt + dt_bias), made in PyTorch within the timed call, as a model calling
               it must: the other two fuse that step; the ``tilegym_dt`` column says so), A, D
               and an initial state (zeros: the same as none, made once), and needs
               L % chunk == 0 (other points are recorded as skipped)
    reference  this project's chunked PyTorch reference
    interpret  this project's kernels in the CPU tile interpreter (``--device cpu``)
Every implementation gets the same call of a Mamba-2 layer -- x, dt, A, B, C, D, dt_bias,
dt_softplus, no z -- on the same seeded random inputs, generated on the device (never zeros).

Measured per (implementation, L, dstate, chunk), one CSV row each (chunk: the caller's, as a
model passes it):
    compute_chunk the chunk the implementation computed with: the caller's, but for this project's
                  kernels where ``ops/tuning/compute_chunk.py`` picks another (on the H200, 128 for a
                  caller's 256 in bf16; MAMBA2_CUTILE_COMPUTE_CHUNK=caller times the caller's)
    ms            median of ``triton.testing.do_bench`` (which flushes the L2 cache between calls),
                  after a first call that compiles and autotunes and is not timed. Without triton: a
                  median over CUDA events; with ``--device cpu``: a median over time.perf_counter
    first_call_s  that first call: compile + autotune + one run
    peak_mem_mb   memory allocated during one call, beyond what was allocated before it
    rel_err       ||out - base|| / ||base|| over the first and last 1024 tokens (all heads), against
                  the baseline named in rel_err_vs: triton at chunk 256 where it ran, else cutile
                  (``--baseline``; without 256 among its chunks, an implementation's largest chunk
                  stands in); the baseline's own row says "(baseline)"
    flops, bytes  the useful work (at compute_chunk) and the least memory traffic of the call
                  (``work_counts``)
    tflops, gbps  flops / time and bytes / time
    roofline_fraction  max(flops / peak_tflops, bytes / peak_gbps) / time: 1.0 is the hardware limit.
                  The peaks are measured at the start of the run on this device: a bf16 8192^3 matmul
                  and a 1 GiB device-to-device copy (bytes read + written)
    best_chunk    True on each implementation's fastest chunk for the shape, among the chunks it ran:
                  ``--chunks``, or its own list from ``--impl-chunks`` (implementations may differ;
                  for this project's, a chunk sweep wants MAMBA2_CUTILE_COMPUTE_CHUNK=caller, else
                  two caller's chunks may compute at one)
    status        ok, failed: <error>, crashed: <last error line>, not installed (<module>), skipped: ...
and with every row the device, driver, package versions, peaks, timer, settings and the
MAMBA2_CUTILE_*/TILEGYM_*/TRITON_* environment variables passed on, so a CSV explains itself.

Crashes do not end the run. Each implementation runs in a worker process of its own that works
through a list of tasks (the points of the grid). The worker protocol:
    parent -> worker   ``bench_forward.py --worker TASKS.json --results RESULTS.jsonl``; TASKS.json
                       holds the settings and the tasks still to do, in order
    worker -> parent   one JSON line per event, appended to RESULTS.jsonl and flushed:
                       {"event": "hello", "env": {...}}               started, CUDA initialised
                       {"event": "start", "id": ...}                  a task begins
                       {"event": "done", "id": ..., "row": {...}}     a task ends (any status)
                       outputs' first and last tokens go to <slices>/<point>.pt for rel_err
    a crash            the parent sees the worker exit with a task started and not done: it records
                       that task as ``crashed: <the worker's last error line>`` and starts a new
                       worker on the remaining tasks. A task that raises is recorded as failed and
                       the worker goes on -- unless the error broke the CUDA context (an illegal
                       memory access does), then the task is recorded as crashed and the worker
                       exits so that a fresh one takes over. A task running longer than
                       --task-timeout is killed and recorded as crashed too.
Worker output (autotuning progress and errors) is shown prefixed with the implementation's name.
``--in-process`` runs the same tasks in the main process instead (for a debugger; a crash then
ends the run). The CSV is rewritten after every task, so a run that is stopped (Ctrl-C, SIGTERM
from ``timeout``) keeps what it measured, and ``--resume`` runs only the points the CSV does not
hold yet, whatever their status there (delete a row to run its point again).
"""
import argparse
import collections
import csv
import datetime
import faulthandler
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from ops.results import report

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

IMPLS = ("triton", "cutile", "cutile_default", "tilegym", "reference", "interpret")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SLICE = 1024                 # tokens kept from each end of an output, to compare across processes
EXIT_RESTART = 75            # a worker's exit code after its CUDA context broke: start a new one
STARTUP_TIMEOUT = 300        # seconds a worker may take to start (import torch, initialise CUDA)
PASSED_ENV = ("MAMBA2_CUTILE_", "TILEGYM_", "TRITON_", "CUDA_VISIBLE_DEVICES")

CSV_COLUMNS = [
    "impl", "seqlen", "dstate", "chunk", "compute_chunk", "status", "ms", "best_chunk", "tflops", "gbps",
    "roofline_fraction", "roofline_ms", "rel_err", "rel_err_vs", "peak_mem_mb", "first_call_s",
    "task_s", "finite", "batch", "nheads", "headdim", "ngroups", "dtype", "flops", "bytes",
    "peak_tflops", "peak_gbps", "timer", "warmup_ms", "rep_ms", "device", "driver", "torch",
    "triton", "cuda_tile", "mamba_ssm", "tilegym", "tilegym_dt", "python", "git_commit", "source_digest", "started_at", "env",
]


# The problem --------------------------------------------------------------------------------

def make_inputs(torch, device, batch, seqlen, nheads, headdim, ngroups, dstate, dtype, seed=0):
    """Random inputs (never zeros) from a fixed seed, generated on the device: every process and
    every implementation gets exactly the same numbers."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.float32)
    dtype = getattr(torch, dtype)
    return dict(
        x=r(batch, seqlen, nheads, headdim).to(dtype),
        dt=r(batch, seqlen, nheads) * 0.5 - 1.0,              # softplus(dt + dt_bias) ~ 0.1 .. 1
        A=-torch.exp(r(nheads) * 0.5),                        # Mamba-2: A = -exp(A_log) < 0
        B=r(batch, seqlen, ngroups, dstate).to(dtype),
        C=r(batch, seqlen, ngroups, dstate).to(dtype),
        D=r(nheads),
        dt_bias=r(nheads) * 0.5,
    )


def work_counts(batch, seqlen, nheads, headdim, ngroups, dstate, chunk, dtype):
    """(flops, bytes): the useful work of the chunked algorithm and the least memory traffic.

    flops, with Q = min(chunk, seqlen), per batch row:
        4 L h p n      each token's contribution to its chunk's state, B^T (dt x): 2 p n per head,
                       and its read of the entry state through C: 2 p n per head
        L Q g n        C B^T inside each chunk, causal half (Q^2/2 pairs of 2n flops per chunk)
        L Q h p        (C B^T o decay) (dt x), causal half
    The O(L/Q h p n) pass over chunk states and the element-wise work are left out: small, and
    no implementation can skip the terms counted. A smaller chunk does less quadratic work.

    bytes: every input read once (x, B, C in the input dtype, dt fp32, and A, D, dt_bias) and
    the output written once. The final state is not asked for, so not counted.
    """
    q = min(chunk, seqlen)
    flops = batch * (4 * seqlen * nheads * headdim * dstate
                     + seqlen * q * ngroups * dstate
                     + seqlen * q * nheads * headdim)
    esize = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    nbytes = batch * seqlen * (2 * nheads * headdim * esize      # x in, out
                               + 2 * ngroups * dstate * esize    # B, C
                               + nheads * 4)                     # dt
    nbytes += 3 * nheads * 4                                     # A, D, dt_bias
    return flops, nbytes


# The implementations ------------------------------------------------------------------------

def build(impl, inp, chunk):
    """A zero-argument callable running one forward pass (returning the output, or a tuple whose
    first element is the output). Raises ImportError if the implementation is not installed."""
    common = dict(D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk)
    if impl in ("cutile", "reference", "interpret"):
        from ops import mamba_chunk_scan_combined
        return lambda: mamba_chunk_scan_combined(*args, **common, backend=impl)
    if impl == "cutile_default":
        from ops import mamba_chunk_scan_combined
        from ops.tuning.autotune import ENV_SWITCH

        def untuned():
            before = os.environ.get(ENV_SWITCH)
            os.environ[ENV_SWITCH] = "0"         # read at each call: the defaults, no search
            try:
                return mamba_chunk_scan_combined(*args, **common, backend="cutile")
            finally:
                if before is None:
                    del os.environ[ENV_SWITCH]
                else:
                    os.environ[ENV_SWITCH] = before
        return untuned
    if impl == "triton":
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as triton_forward
        return lambda: triton_forward(*args, **common)
    if impl == "tilegym":
        import torch
        from tilegym.ops.cutile.mamba2 import mamba2_chunk_forward
        from reference.common import process_dt
        b, _, h, p = inp["x"].shape
        h0 = torch.zeros(b, h, p, inp["B"].shape[-1], device=inp["x"].device, dtype=torch.float32)
        # the layer's dt processed in the call, as a model calling TileGym must (the others fuse it)
        return lambda: mamba2_chunk_forward(
            inp["x"], inp["A"], inp["B"], inp["C"], inp["D"],
            process_dt(inp["dt"], inp["dt_bias"], dt_softplus=True).float().contiguous(), h0,
            chunk_size=chunk)
    if impl == "_crash":
        return _crash_impl(inp, chunk)
    raise ValueError(f"unknown implementation {impl!r} (known: {', '.join(IMPLS)})")


def computed_chunk(impl, inp, chunk):
    """The chunk ``impl`` computes with for the caller's ``chunk``: this project's kernels may
    take another (ops/tuning/compute_chunk.py); the other implementations take the caller's."""
    if impl in ("cutile", "cutile_default", "interpret"):
        from ops.tuning.compute_chunk import kernel_chunk
        return kernel_chunk(chunk, inp["x"], inp["B"])
    return chunk


_SIMULATED_BROKEN_CONTEXT = False


def _crash_impl(inp, chunk):
    """Test-only: the reference, except at the points named in BENCH_FORWARD_CRASH, e.g.
    "64x32:exit,128x16x64:poison" (L x dstate [x chunk] : what happens), where the first call
    exits the process ("exit"), raises ("raise"), raises as if the CUDA context broke ("poison")
    or hangs ("hang"). This is how the tests check that the run survives each of these."""
    from ops import mamba_chunk_scan_combined
    L, n = inp["x"].shape[1], inp["B"].shape[-1]
    spec = dict(item.split(":") for item in os.environ.get("BENCH_FORWARD_CRASH", "").split(",") if item)
    mode = spec.get(f"{L}x{n}x{chunk}", spec.get(f"{L}x{n}"))

    def run():
        global _SIMULATED_BROKEN_CONTEXT
        if mode == "exit":
            print("simulated crash: Segmentation fault", file=sys.stderr, flush=True)
            os._exit(3)
        if mode == "raise":
            raise RuntimeError("simulated failure")
        if mode == "poison":
            _SIMULATED_BROKEN_CONTEXT = True
            raise RuntimeError("simulated CUDA error: an illegal memory access was encountered")
        if mode == "hang":
            time.sleep(3600)
        return mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk,
                                         D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True,
                                         backend="reference")
    return run


# Measuring (in the worker) ------------------------------------------------------------------

class Device:
    """The few things that differ between timing on a GPU and on a CPU."""

    def __init__(self, torch, name):
        self.torch, self.name, self.cuda = torch, name, name.startswith("cuda")

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def memory_mark(self):
        """Start measuring peak memory; returns what is allocated now."""
        if not self.cuda:
            return None
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        return self.torch.cuda.memory_allocated()

    def peak_since(self, mark):
        """Bytes allocated at the peak since ``memory_mark``, beyond what was allocated then."""
        if not self.cuda:
            return None
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated() - mark

    def free(self):
        gc.collect()
        if self.cuda:
            try:
                self.torch.cuda.empty_cache()
            except Exception:        # a broken context: context_ok() reports it
                pass

    def context_ok(self):
        """False once the device is unusable (on a GPU: a sticky CUDA error, such as an illegal
        memory access, poisons the process's context; every later call fails too)."""
        if not self.cuda:
            return not _SIMULATED_BROKEN_CONTEXT
        try:
            self.torch.cuda.synchronize()
            return self.torch.ones(1, device=self.name).add_(1).item() == 2.0
        except Exception:
            return False

    def bench(self, fn, warmup_ms, rep_ms):
        """(median milliseconds of fn(), name of the timer)."""
        if not self.cuda:
            return median_time(fn, warmup_ms, rep_ms, _cpu_time_once), "perf_counter median"
        try:
            import triton.testing
        except ImportError:
            return median_time(fn, warmup_ms, rep_ms, self._cuda_time_once), "cuda events median"
        return (triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"),
                "triton.testing.do_bench median")

    def _cuda_time_once(self, fn):
        """One call timed with CUDA events, after flushing the L2 cache (as do_bench does)."""
        torch = self.torch
        if not hasattr(self, "_l2_flush"):
            self._l2_flush = torch.empty(256 * 2**20, dtype=torch.int8, device=self.name)
        self._l2_flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def _cpu_time_once(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def median_time(fn, warmup_ms, rep_ms, time_once):
    """The median of ``time_once(fn)`` (milliseconds) over about ``rep_ms`` of calls, after about
    ``warmup_ms`` of untimed ones -- do_bench's recipe, for when triton is not there."""
    estimate = max(time_once(fn), 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    return statistics.median(time_once(fn) for _ in range(max(1, int(rep_ms / estimate))))


def measure_peaks(torch, dev, warmup_ms, rep_ms):
    """The device's achievable peaks: bf16 dense matmul TFLOP/s and copy GB/s (read + write)."""
    n, copy_bytes = (8192, 2**30) if dev.cuda else (512, 2**25)
    g = torch.Generator(device=dev.name).manual_seed(1)

    def matmul_ms():
        a = torch.randn(n, n, generator=g, device=dev.name).to(torch.bfloat16)
        b = torch.randn(n, n, generator=g, device=dev.name).to(torch.bfloat16)
        return dev.bench(lambda: torch.matmul(a, b), warmup_ms, rep_ms)[0]

    def copy_ms():
        src = torch.randn(copy_bytes // 4, generator=g, device=dev.name)
        dst = torch.empty_like(src)
        return dev.bench(lambda: dst.copy_(src), warmup_ms, rep_ms)

    ms_mm = matmul_ms()
    ms_copy, timer = copy_ms()
    dev.free()
    return dict(status="ok", peak_tflops=2 * n**3 / ms_mm / 1e9, peak_gbps=2 * copy_bytes / ms_copy / 1e6,
                matmul=f"bf16 {n}^3", copy=f"{copy_bytes >> 20} MiB", timer=timer)


def run_task(torch, dev, task, spec, not_installed):
    """Measure one point. Returns its row; ``row["_broken"]`` is set if the device broke."""
    if task.get("kind") == "calibrate":
        try:
            return measure_peaks(torch, dev, spec["warmup_ms"], spec["rep_ms"])
        except Exception as e:
            return {"status": f"failed: {type(e).__name__}: {first_line(e)}"}
    impl = spec["impl"]
    row = {"status": None}
    if impl in not_installed:
        row["status"] = not_installed[impl]
        return row
    inp = make_inputs(torch, dev.name, task["batch"], task["seqlen"], task["nheads"], task["headdim"],
                      task["ngroups"], task["dstate"], task["dtype"])
    fn = out = None
    try:
        fn = build(impl, inp, task["chunk"])
        row["compute_chunk"] = computed_chunk(impl, inp, task["chunk"])
    except ImportError as e:
        row["status"] = not_installed[impl] = f"not installed ({e.name or e})"
        return row
    except Exception as e:
        return {"status": f"failed: {type(e).__name__}: {first_line(e)}"}
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            fn()                                   # compile, autotune: not timed
            dev.sync()
            row["first_call_s"] = time.perf_counter() - t0
            mark = dev.memory_mark()
            out = fn()
            peak = dev.peak_since(mark)
            out = out[0] if isinstance(out, tuple) else out
            row["peak_mem_mb"] = None if peak is None else peak / 2**20
            row["finite"] = bool(torch.isfinite(out).all())
            L = out.shape[1]
            kept = out if L <= 2 * SLICE else torch.cat([out[:, :SLICE], out[:, -SLICE:]], dim=1)
            torch.save(kept.cpu().clone(), os.path.join(spec["slices_dir"], task["slice"]))
            out = kept = None                      # free it before timing
            row["ms"], row["timer"] = dev.bench(fn, spec["warmup_ms"], spec["rep_ms"])
            row["status"] = "ok"
    except Exception as e:   # a compile error, an out-of-memory, a bad launch: a result too
        message = f"{type(e).__name__}: {first_line(e)}"
        row = {"status": f"failed: {message}"}
        if not dev.context_ok():
            row.update(status=f"crashed: {message}", _broken=True)
    finally:
        fn = inp = out = None
        dev.free()
    return row


def first_line(e):
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def package_versions():
    """Versions of the packages compared, from their metadata or, where a package is on the path
    without metadata, its __version__."""
    import importlib
    import importlib.metadata as md
    out = {}
    for column, pkg, module in (("torch", "torch", "torch"), ("triton", "triton", "triton"),
                                ("cuda_tile", "cuda-tile", "cuda.tile"), ("mamba_ssm", "mamba_ssm", "mamba_ssm"),
                                ("tilegym", "tilegym", "tilegym")):
        try:
            out[column] = md.version(pkg)
            continue
        except md.PackageNotFoundError:
            pass
        try:
            out[column] = getattr(importlib.import_module(module), "__version__", "unknown")
        except Exception:
            out[column] = "not installed"
    return out


def worker_main(task_file, results_file):
    """A worker: run the tasks of TASKS.json in order, reporting to RESULTS.jsonl."""
    _die_with_parent()
    faulthandler.enable()          # a segfault prints "Fatal Python error: ..." for the parent to record
    parent = os.getppid()
    with open(task_file) as f:
        spec = json.load(f)
    import torch
    dev = Device(torch, spec["device"])
    env = package_versions()
    if dev.cuda:
        torch.cuda.init()
        env["device"] = torch.cuda.get_device_name(dev.name)
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"

    with open(results_file, "a") as results:
        def emit(event):
            results.write(json.dumps(event) + "\n")
            results.flush()

        emit({"event": "hello", "pid": os.getpid(), "env": env})
        not_installed = {}
        for task in spec["tasks"]:
            if os.getppid() != parent:      # the parent is gone: stop holding the GPU
                return 1
            emit({"event": "start", "id": task["id"]})
            t0 = time.time()
            row = run_task(torch, dev, task, spec, not_installed)
            row["task_s"] = time.time() - t0
            emit({"event": "done", "id": task["id"], "row": row})
            if row.pop("_broken", False):
                print(f"worker: the device is unusable after {task['id']}; exiting so a fresh "
                      "process takes over", file=sys.stderr, flush=True)
                return EXIT_RESTART
    return 0


def _die_with_parent():
    """Ask Linux to kill this worker if the parent dies, so no orphan keeps the GPU busy."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except Exception:
        pass


# Running the workers (in the parent) --------------------------------------------------------

class Stopped(Exception):
    """SIGTERM (e.g. from ``timeout``) or Ctrl-C: stop, keep what was measured."""


class WorkerRunner:
    """Runs one implementation's tasks in worker processes, starting a new one after a crash."""

    def __init__(self, impl, spec, workdir, on_row, task_timeout, quiet_workers=False):
        self.impl, self.spec, self.workdir = impl, spec, workdir
        self.on_row, self.task_timeout, self.quiet = on_row, task_timeout, quiet_workers
        self.results = os.path.join(workdir, f"{impl}.jsonl")
        self.proc = None
        self.env = None

    def run(self, tasks):
        pending = list(tasks)
        attempt = 0
        while pending:
            attempt += 1
            finished, in_flight, said_hello, rc, reason = self._run_worker(pending, attempt)
            pending = [t for t in pending if t["id"] not in finished]
            if not pending:
                break
            if rc == EXIT_RESTART and in_flight is None:   # it recorded the crash itself
                print(f"  ({self.impl}: starting a new worker for the {len(pending)} tasks left)", flush=True)
                continue
            error = reason or f"{self._last_error()} ({_exit_text(rc)})"
            if in_flight is not None:
                crashed = [t for t in pending if t["id"] == in_flight]
            elif not said_hello:
                crashed = list(pending)                  # it cannot even start: give up on them all
                error = f"worker did not start: {error}"
            else:
                crashed = pending[:1]                    # exited between tasks: never loop forever
            for t in crashed:
                self.on_row(t, {"status": f"crashed: {error}"})
            pending = [t for t in pending if t not in crashed]
            if pending:
                print(f"  ({self.impl}: starting a new worker for the {len(pending)} tasks left)", flush=True)

    def _run_worker(self, tasks, attempt):
        task_file = os.path.join(self.workdir, f"{self.impl}.tasks{attempt}.json")
        with open(task_file, "w") as f:
            json.dump(dict(self.spec, impl=self.impl, tasks=tasks), f)
        offset = os.path.getsize(self.results) if os.path.exists(self.results) else 0
        self.tail = collections.deque(maxlen=50)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", task_file, "--results", self.results],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env=dict(os.environ, PYTHONUNBUFFERED="1"),   # its last words reach us even if it crashes
            cwd=ROOT, start_new_session=True)             # its own process group: killed as a whole
        print(f"  ({self.impl} worker started, pid {self.proc.pid})", flush=True)
        echo = threading.Thread(target=self._echo, args=(self.proc.stdout,), daemon=True)
        echo.start()
        by_id = {t["id"]: t for t in tasks}
        finished, in_flight, said_hello, reason = set(), None, False, None
        last_event = time.time()
        while True:
            exited = self.proc.poll() is not None
            events, offset = _read_events(self.results, offset)
            for ev in events:
                last_event = time.time()
                if ev["event"] == "hello":
                    said_hello = True
                    self.env = self.env or ev["env"]
                elif ev["event"] == "start":
                    in_flight = ev["id"]
                elif ev["event"] == "done":
                    finished.add(ev["id"])
                    in_flight = None
                    self.on_row(by_id[ev["id"]], ev["row"])
            if exited:
                break
            # A task gets --task-timeout from its start; starting up (imports, CUDA) gets more.
            limit = self.task_timeout if in_flight else max(self.task_timeout, STARTUP_TIMEOUT)
            if time.time() - last_event > limit:
                reason = f"timed out after {limit:.0f} s"
                self.kill()
                break
            time.sleep(0.05)
        rc = self.proc.wait()
        echo.join(timeout=5)
        self.proc = None
        return finished, in_flight, said_hello, rc, reason

    def _echo(self, stream):
        for line in stream:
            line = line.rstrip("\n")
            self.tail.append(line)
            if not self.quiet:
                print(f"  {self.impl}| {line}", file=sys.stderr, flush=True)

    def _last_error(self):
        """The worker's most telling last line: the last that looks like an error, else the last."""
        lines = [l.strip() for l in self.tail if l.strip()]
        for line in reversed(lines):
            if any(w in line for w in ("Error", "error", "Exception", "Segmentation", "Aborted", "Killed",
                                       "crash")):
                return line[:300]
        return lines[-1][:300] if lines else "no output"

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


def _exit_text(rc):
    if rc is not None and rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            pass
    return f"exit code {rc}"


def _read_events(path, offset):
    """Complete JSON lines appended to ``path`` since ``offset``."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()], offset + end


class InProcessRunner:
    """``--in-process``: the same tasks in this process (for debugging; a crash ends the run)."""

    def __init__(self, impl, spec, on_row):
        self.impl, self.spec, self.on_row, self.env = impl, spec, on_row, None

    def run(self, tasks):
        import torch
        dev = Device(torch, self.spec["device"])
        self.env = dict(package_versions(), device=torch.cuda.get_device_name(dev.name) if dev.cuda else "cpu")
        not_installed = {}
        spec = dict(self.spec, impl=self.impl)
        for task in tasks:
            t0 = time.time()
            row = run_task(torch, dev, task, spec, not_installed)
            row["task_s"] = time.time() - t0
            row.pop("_broken", None)
            self.on_row(task, row)

    def kill(self):
        pass


# The run: tasks, rows, comparisons, the CSV (in the parent) ---------------------------------

def point_key(r):
    return (r["impl"], r["batch"], r["seqlen"], r["nheads"], r["headdim"], r["ngroups"], r["dstate"],
            r["chunk"], r["dtype"])


def slice_name(r):
    return "{}-b{}-L{}-h{}-p{}-g{}-n{}-c{}-{}.pt".format(*point_key(r))


class Run:
    """The rows of a run, kept in one place: derived columns, comparisons, progress, the CSV."""

    def __init__(self, args, meta, slices_dir, rows=()):
        self.args, self.meta, self.slices_dir = args, meta, slices_dir
        self.baseline = args.baseline                    # [(impl, chunk or None)], in order of preference
        self.rows = {point_key(r): r for r in rows}
        self.pending = {}                                # shape -> {(impl, chunk)} still to run
        self.peaks = {}
        self.done, self.total = 0, 0

    def add(self, task, result):
        """Record one finished task (``result``: the worker's row)."""
        if task.get("kind") == "calibrate":
            if result.get("status") == "ok":
                self.peaks = {k: result[k] for k in ("peak_tflops", "peak_gbps")}
                print(f"[peaks] {result['matmul']} matmul {result['peak_tflops']:.1f} TFLOP/s, "
                      f"{result['copy']} copy {result['peak_gbps']:.0f} GB/s ({result['task_s']:.0f} s)", flush=True)
            else:
                print(f"[peaks] not measured: {result.get('status')}", flush=True)
            return
        row = {k: task[k] for k in ("impl", "batch", "seqlen", "nheads", "headdim", "ngroups", "dstate",
                                    "chunk", "dtype")}
        row.update({k: v for k, v in result.items() if not k.startswith("_")})
        self._derive(row)
        self.rows[point_key(row)] = row
        self.done += 1
        self.compare()
        self.write_csv()
        status = f"{row['ms']:.3f} ms" if report.is_ok(row) else row["status"]
        print(f"[{self.done}/{self.total}] {row['impl']} L={report.fmt_len(row['seqlen'])} "
              f"dstate={row['dstate']} chunk={row['chunk']} {status} ({row.get('task_s') or 0:.0f} s)", flush=True)

    def _derive(self, row):
        row.update(self.meta, **self.peaks,
                   warmup_ms=self.args.warmup_ms, rep_ms=self.args.rep_ms)
        flops, nbytes = work_counts(row["batch"], row["seqlen"], row["nheads"], row["headdim"], row["ngroups"],
                                    row["dstate"], row.get("compute_chunk") or row["chunk"], row["dtype"])
        row.update(flops=flops, bytes=nbytes)
        if report.is_ok(row):
            row.update(tflops=flops / row["ms"] / 1e9, gbps=nbytes / row["ms"] / 1e6)
            if self.peaks:
                roof_ms = max(flops / self.peaks["peak_tflops"] / 1e9, nbytes / self.peaks["peak_gbps"] / 1e6)
                row.update(roofline_ms=roof_ms, roofline_fraction=roof_ms / row["ms"])

    def add_skipped(self, task, why):
        row = {k: task[k] for k in ("impl", "batch", "seqlen", "nheads", "headdim", "ngroups", "dstate",
                                    "chunk", "dtype")}
        row.update(self.meta, status=f"skipped: {why}")
        self.rows[point_key(row)] = row

    # Comparing outputs --------------------------------------------------------------------

    def ref_chunk(self, impl):
        """The chunk an implementation is a baseline at when --baseline names none: 256, or its
        largest chunk if it does not run at 256."""
        chunks = chunks_of(self.args, impl)
        return report.REF_CHUNK if report.REF_CHUNK in chunks else max(chunks)

    def baseline_for(self, shape_rows, pending):
        """The baseline row of one shape: the first candidate (impl, chunk) that ran; None if it
        is not decided yet (a candidate is still to run) or none ran."""
        for impl, chunk in self.baseline:
            chunk = chunk or self.ref_chunk(impl)
            r = shape_rows.get((impl, chunk))
            if r is not None and report.is_ok(r):
                return r
            if r is None and (impl, chunk) in pending:
                return None
        return None

    def compare(self, final=False):
        """Fill rel_err / rel_err_vs wherever the shape's baseline is known."""
        by_shape = {}
        for r in self.rows.values():
            by_shape.setdefault(report.shape_of(r), {})[(r["impl"], r["chunk"])] = r
        for shape, shape_rows in by_shape.items():
            todo = [r for r in shape_rows.values() if report.is_ok(r) and r.get("rel_err_vs") is None]
            if not todo:
                continue
            base = self.baseline_for(shape_rows, set() if final else self.pending.get(shape, set()))
            if base is None:
                if final:
                    for r in todo:
                        r["rel_err_vs"] = "none (no baseline ran)"
                continue
            import torch
            from reference.validate import rel_err
            base_file = os.path.join(self.slices_dir, slice_name(base))
            base_out = torch.load(base_file) if os.path.exists(base_file) else None
            for r in todo:
                if r is base:
                    r["rel_err_vs"] = "(baseline)"
                    continue
                mine = os.path.join(self.slices_dir, slice_name(r))
                if base_out is None or not os.path.exists(mine):
                    r["rel_err_vs"] = "none (output not saved)"
                    continue
                r["rel_err"] = rel_err(torch.load(mine), base_out)
                r["rel_err_vs"] = f"{base['impl']}/{base['chunk']}"

    # Output -------------------------------------------------------------------------------

    def mark_best_chunks(self):
        for by_impl in report.points(self.rows.values()).values():
            for by_chunk in by_impl.values():
                best = report.best_row(by_chunk)
                for r in by_chunk.values():
                    r["best_chunk"] = r is best if report.is_ok(r) else None

    def sorted_rows(self):
        order = {impl: i for i, impl in enumerate(self.args.impls)}
        return sorted(self.rows.values(), key=lambda r: (r["nheads"], r["headdim"], r["ngroups"], r["dtype"],
                                                         r["seqlen"], r["dstate"], order.get(r["impl"], 99),
                                                         r["chunk"]))

    def write_csv(self):
        if not self.args.csv:
            return
        self.mark_best_chunks()
        rows = self.sorted_rows()
        for r in rows:                                   # e.g. skipped rows, added before a worker said hello
            for k, v in self.meta.items():
                r.setdefault(k, v)
        extra = sorted({k for r in rows for k in r} - set(CSV_COLUMNS))
        tmp = self.args.csv + ".tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_COLUMNS + extra)
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, self.args.csv)


def parse_lengths(text):
    """"1K,4K,256K" or "1024,4096" -> [1024, 4096, ...] (K = 1024, M = 1024^2)."""
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        scale = {"K": 1024, "M": 1024**2}.get(item[-1:], 1)
        out.append(int(float(item[:-1] if scale > 1 else item) * scale))
    return out


def parse_ints(text):
    return [int(v) for v in text.split(",") if v.strip()]


def parse_impl_chunks(text):
    """"tilegym=64,triton=128:256" -> {"tilegym": [64], "triton": [128, 256]}. Raises ValueError
    (its message names the problem) on a malformed item, an unknown implementation or a chunk
    that is not a power of two."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        impl, sep, chunks = (s.strip() for s in item.partition("="))
        if not sep or not impl or not chunks:
            raise ValueError(f"{item!r} is not IMPL=CHUNK[:CHUNK...]")
        if impl not in IMPLS and not impl.startswith("_"):
            raise ValueError(f"unknown implementation {impl!r}; known: {', '.join(IMPLS)}")
        if impl in out:
            raise ValueError(f"{impl} is named twice")
        try:
            values = [int(c) for c in chunks.split(":")]
        except ValueError:
            raise ValueError(f"{impl}: chunks must be integers separated by ':', got {chunks!r}") from None
        bad = [c for c in values if c < 1 or c & (c - 1)]
        if bad:
            raise ValueError(f"{impl}: chunk {bad[0]} is not a power of two")
        out[impl] = list(dict.fromkeys(values))
    return out


def chunks_of(args, impl):
    """The chunk sizes ``impl`` runs at: its own from --impl-chunks, else --chunks."""
    return args.impl_chunks.get(impl, args.chunks)


def parse_baseline(text):
    """"triton:256,cutile" -> [("triton", 256), ("cutile", None)]. None stands for the reference
    chunk: 256, or the implementation's largest chunk if it does not run at 256."""
    out = []
    for item in text.split(","):
        impl, _, chunk = item.strip().partition(":")
        out.append((impl, int(chunk) if chunk else None))
    return out


# Where TileGym's dt is processed (its bias added, softplus), recorded in every row: within the
# timed call, as a model calling TileGym must (the other implementations fuse that step). A CSV
# without the column processed it outside the timed call.
TILEGYM_DT = "in call"


def run_metadata(args):
    """What the parent knows without touching the GPU: driver, git commit, time, environment."""
    meta = {"python": platform.python_version(), "started_at": datetime.datetime.now().isoformat(timespec="seconds"),
            "driver": "n/a", "git_commit": "unknown"}
    if args.device.startswith("cuda"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
            meta["driver"] = out[0] if out else "unknown"
        except (OSError, subprocess.SubprocessError):
            meta["driver"] = "unknown"
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            meta["git_commit"] = out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    meta["source_digest"] = source_digest()
    meta["tilegym_dt"] = TILEGYM_DT
    meta["env"] = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(PASSED_ENV))
    return meta


def source_digest(root=ROOT):
    """A short SHA-256 of the code that runs (ops/, reference/, tests/benchmark/ Python files):
    ties a CSV to the exact sources even where the checkout's git metadata is missing or stale
    (``bench_forward.py --source-digest`` prints it for a checkout)."""
    import hashlib
    h = hashlib.sha256()
    for folder in ("ops", "reference", os.path.join("tests", "benchmark")):
        base = os.path.join(root, folder)
        for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            if name.endswith(".py"):
                with open(os.path.join(base, name), "rb") as f:
                    h.update(f"{folder}/{name}\0".encode() + f.read() + b"\0")
    return h.hexdigest()[:12]


def make_tasks(args, impls):
    """Every point of the grid for each implementation, in (L, dstate, chunk) order; each
    implementation at its own chunks (``chunks_of``)."""
    tasks = {impl: [] for impl in impls}
    for L in args.seqlens:
        for n in args.dstates:
            for impl in impls:
                for chunk in chunks_of(args, impl):
                    t = dict(impl=impl, batch=args.batch, seqlen=L, nheads=args.nheads, headdim=args.headdim,
                             ngroups=args.ngroups, dstate=n, chunk=chunk, dtype=DTYPES[args.dtype])
                    t["id"] = slice_name(t)[:-3]
                    t["slice"] = slice_name(t)
                    tasks[impl].append(t)
    return tasks


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="See the module docstring for what is measured and how.")
    ap.add_argument("--impls", default="triton,cutile,tilegym", help="comma-separated: " + ", ".join(IMPLS))
    ap.add_argument("--seqlens", default="1K,4K,16K,64K,256K", help="e.g. 1K,4K,16K,64K,256K or 1024,4096")
    ap.add_argument("--dstates", default="64,128,256,512")
    ap.add_argument("--chunks", default="256", help="chunk sizes to run every implementation at, e.g. 64,128,256")
    ap.add_argument("--impl-chunks", default="", metavar="IMPL=C[:C...],...",
                    help="chunk sizes of the implementations named, in place of --chunks, e.g. "
                         "tilegym=64,triton=128:256 (the others run at --chunks; an implementation "
                         "named but not in --impls is ignored)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nheads", type=int, default=80)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--ngroups", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--warmup-ms", type=float, default=50, help="do_bench warm-up (after the untimed first call)")
    ap.add_argument("--rep-ms", type=float, default=200, help="do_bench measuring time")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run of the harness")
    ap.add_argument("--baseline", default="triton,cutile",
                    help="outputs are compared with the first of these (impl or impl:chunk; if not given, "
                         "chunk 256, or the implementation's largest without 256) that ran at each "
                         "shape; the other implementations follow, in order")
    ap.add_argument("--csv", default=None, help="write every row here (rewritten after each task)")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --csv, run only the others")
    ap.add_argument("--plot", default=None, help="also write the speedup plot (PNG) here")
    ap.add_argument("--slices", default=None,
                    help="keep output slices here (default: a temporary folder, removed at the end); "
                         "with --resume, lets later runs compare with earlier outputs")
    ap.add_argument("--task-timeout", type=float, default=600,
                    help="seconds one point may take (first call and autotuning included) before it is "
                         "killed and recorded as crashed")
    ap.add_argument("--in-process", action="store_true", help="no worker processes (debugging: a crash ends the run)")
    ap.add_argument("--quiet-workers", action="store_true", help="do not echo the workers' output")
    ap.add_argument("--source-digest", action="store_true", help="print the digest of the sources and exit")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--results", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = [i for i in args.impls if i not in IMPLS and not i.startswith("_")]
    if unknown:
        ap.error(f"unknown implementation(s) {', '.join(unknown)}; known: {', '.join(IMPLS)}")
    args.seqlens, args.dstates, args.chunks = parse_lengths(args.seqlens), parse_ints(args.dstates), parse_ints(args.chunks)
    try:
        args.impl_chunks = parse_impl_chunks(args.impl_chunks)
    except ValueError as e:
        ap.error(f"--impl-chunks: {e}")
    args.baseline = parse_baseline(args.baseline)
    args.baseline += [(i, None) for i in args.impls if i not in {b[0] for b in args.baseline}]
    if args.resume and not args.csv:
        ap.error("--resume needs --csv")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.source_digest:
        print(source_digest())
        return 0
    if args.worker:
        return worker_main(args.worker, args.results)

    meta = run_metadata(args)
    existing = report.load(args.csv) if args.resume and args.csv and os.path.exists(args.csv) else []
    if any(r["impl"] == "tilegym" and r.get("tilegym_dt") != TILEGYM_DT for r in existing):
        raise SystemExit(f"--resume {args.csv}: its TileGym rows were given dt processed outside "
                         f"the timed call (no tilegym_dt column): run them again")
    workdir = tempfile.mkdtemp(prefix="bench_forward_")
    slices_dir = args.slices or os.path.join(workdir, "slices")
    os.makedirs(slices_dir, exist_ok=True)
    run = Run(args, meta, slices_dir, rows=existing)

    # The tasks: the grid minus what the CSV holds already, minus what an implementation cannot do.
    tasks = make_tasks(args, args.impls)
    for impl in tasks:
        todo = []
        for t in tasks[impl]:
            if point_key(t) in run.rows:
                continue
            if impl == "tilegym" and t["seqlen"] % t["chunk"]:
                run.add_skipped(t, "TileGym needs L % chunk == 0")
            else:
                todo.append(t)
        tasks[impl] = todo
    for impl_tasks in tasks.values():
        for t in impl_tasks:
            run.pending.setdefault(report.shape_of(t), set()).add((t["impl"], t["chunk"]))
    run.total = sum(len(v) for v in tasks.values())
    if existing:
        print(f"resuming {args.csv}: {len(existing)} rows kept, {run.total} points to run", flush=True)
    own = ", ".join(f"{i} {','.join(map(str, c))}" for i, c in args.impl_chunks.items() if i in args.impls)
    own = f" ({own})" if own else ""
    print(f"{run.total} points: impls {','.join(args.impls)}; L {','.join(map(report.fmt_len, args.seqlens))}; "
          f"dstate {','.join(map(str, args.dstates))}; chunk {','.join(map(str, args.chunks))}{own}; "
          f"{args.nheads} heads x {args.headdim}, {args.ngroups} group(s), {DTYPES[args.dtype]}, on {args.device}",
          flush=True)

    spec = dict(device=args.device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, slices_dir=slices_dir)
    calibrate = run.total > 0
    runner = None

    def on_term(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_term)
    stopped = None
    try:
        for impl in args.impls:
            if not tasks[impl]:
                continue
            impl_tasks = tasks[impl]
            if calibrate:     # the device's peaks, measured once, by the first worker
                impl_tasks = [{"id": "calibrate", "kind": "calibrate"}] + impl_tasks
                calibrate = False

            def on_row(task, result):
                if task.get("kind") == "calibrate" or not run.meta.get("device"):   # device, versions
                    run.meta.update(runner.env or {})
                if task.get("kind") != "calibrate":
                    run.pending.get(report.shape_of(task), set()).discard((task["impl"], task["chunk"]))
                run.add(task, result)

            if args.in_process:
                runner = InProcessRunner(impl, spec, on_row)
            else:
                runner = WorkerRunner(impl, spec, workdir, on_row, args.task_timeout, args.quiet_workers)
            runner.run(impl_tasks)
            runner = None
    except (Stopped, KeyboardInterrupt) as e:
        stopped = str(e) or "interrupted"
        print(f"\nstopped ({stopped}): killing the worker; the rows measured so far are kept", flush=True)
    finally:
        if runner is not None:
            runner.kill()
    run.compare(final=not stopped)      # stopped: undecided comparisons stay open for --resume
    run.write_csv()

    rows = run.sorted_rows()
    print("\n" + report.table(rows, markdown=False, rel_err=True))
    if len({c for impl in args.impls for c in chunks_of(args, impl)}) > 1:
        print("\neach implementation at its best chunk (chunk in parentheses):")
        print(report.table(rows, chunk="best", markdown=False))
    for line in report.failures(rows):
        print("  " + line)
    if args.csv:
        print(f"\nwrote {args.csv} ({len(rows)} rows)")
    if args.plot:
        from ops.results import plot
        plot.plot(rows, args.plot)
        print(f"wrote {args.plot}")
    shutil.rmtree(workdir, ignore_errors=True)          # task files, event logs (and slices, unless --slices)
    return 143 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
