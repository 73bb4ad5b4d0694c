"""Per-shape autotuning of kernel configs, cached in memory and on disk.

The fastest tile sizes, latency hints, operand order and occupancy depend on the input shape
(sequence length, dstate, heads) and on the GPU, so each kernel module offers a
``search_space(...)`` of valid configs and a ``default_config(...)``. The first time a kernel
meets a new shape on a GPU, ``Autotuner.best`` times every candidate on the real inputs and keeps
the fastest; the winner is remembered in memory and in a JSON file, so later calls -- and later
processes -- skip the search.

Environment:
    MAMBA2_CUTILE_AUTOTUNE=0        no search: every kernel uses its default config
    MAMBA2_CUTILE_AUTOTUNE_CACHE    the JSON file (default ~/.cache/mamba2-cutile/autotune.json)
    MAMBA2_CUTILE_AUTOTUNE_QUIET=1  no progress output

A candidate that fails (a compile error, a launch error) is skipped and reported, never fatal.
Tuning happens only on a GPU: the CPU interpreter always runs the default config.
"""
import json
import math
import os
import statistics
import sys
import tempfile
import time

ENV_SWITCH = "MAMBA2_CUTILE_AUTOTUNE"
ENV_CACHE = "MAMBA2_CUTILE_AUTOTUNE_CACHE"
ENV_QUIET = "MAMBA2_CUTILE_AUTOTUNE_QUIET"

# Suffix of the cache entry listing a shape's configs that faulted on the GPU.
FAULTED = "|faulted"

# A candidate replaces the default only when it is this much faster: closer than that is
# within the timer's noise, and the default is the config the tests and the notebooks study.
MARGIN = 0.03


def enabled():
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def default_cache_path():
    return os.environ.get(ENV_CACHE) or os.path.join(
        os.path.expanduser("~"), ".cache", "mamba2-cutile", "autotune.json")


def cuda_event_timer(fn, warmup=2, reps=10):
    """Median milliseconds of ``fn()`` on the current CUDA stream, timed with CUDA events.

    Each timed launch is queued behind a short sleep kernel, so the host has queued it before
    the GPU reaches the start event: the events then bracket GPU time only. Without this, a
    small kernel (tens of microseconds) measures the host's launch cost, the same for every
    candidate, and the winner is noise."""
    import torch
    sleep = getattr(torch.cuda, "_sleep", None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep is not None:
            sleep(200_000)                  # ~0.1 ms at H200 clocks: longer than a launch
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def seqlen_bucket(seqlen):
    """Sequence lengths tune in power-of-two buckets (1K at least): the best tiles change with the
    amount of parallel work, not with the exact length, and every new length would retune."""
    return max(1024, 1 << max(0, math.ceil(math.log2(max(1, seqlen)))))


class Autotuner:
    """Finds, remembers and returns the fastest config of a kernel for a shape key.

    ``measure(run) -> milliseconds`` times one candidate (CUDA events by default; tests inject
    their own). ``device`` names the GPU (keys of different GPUs never mix).
    """

    def __init__(self, path=None, measure=None, device=None, quiet=None, out=None):
        self.path = path or default_cache_path()
        self.measure = measure or cuda_event_timer
        self.device = device
        self.quiet = (os.environ.get(ENV_QUIET, "0") == "1") if quiet is None else quiet
        self.out = out or sys.stderr
        self._memory = None          # loaded lazily from disk
        self.last_failures = []      # (config, error) of the last search, for inspection
        self.chosen = {}             # the callers' memo of answers (ops.forward._config)

    # Keys and the cache file -----------------------------------------------------------------

    def key(self, kernel_name, shape):
        """A readable, stable key: kernel, device, package version and the shape description."""
        from cuda.tile import __version__ as ct_version
        items = ",".join(f"{k}={shape[k]}" for k in sorted(shape))
        return f"{kernel_name}|{self._device_name()}|cuda-tile {ct_version}|{items}"

    def _device_name(self):
        if self.device is None:
            import torch
            self.device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        return self.device

    def _load(self):
        if self._memory is None:
            try:
                with open(self.path) as f:
                    self._memory = json.load(f)
            except FileNotFoundError:
                self._memory = {}
            except (OSError, ValueError) as e:   # a corrupt cache only costs a retune
                self._say(f"ignoring unreadable autotune cache {self.path}: {e}")
                self._memory = {}
        return self._memory

    def _save(self):
        # Merge with what other processes wrote meanwhile, then replace the file atomically.
        try:
            with open(self.path) as f:
                on_disk = json.load(f)
        except (OSError, ValueError):
            on_disk = {}
        on_disk.update(self._memory)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(self.path)), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(on_disk, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    # The search -------------------------------------------------------------------------------

    def best(self, kernel_name, shape, candidates, default, run):
        """The config to use for ``kernel_name`` at ``shape``.

        ``run(config)`` launches the kernel once with that config on the real inputs.
        Tuning off: ``default``. Known shape: the remembered winner. Otherwise every candidate
        is timed; failures are skipped; the fastest is remembered and returned.
        """
        if not enabled():
            return default
        key = self.key(kernel_name, shape)
        memory = self._load()
        if key in memory:
            return memory[key]["config"]

        candidates = list(candidates) or [default]
        # Configs that faulted on the GPU in an earlier process (see below) are not tried again.
        faulted = memory.get(key + FAULTED, {}).get("configs", [])
        if faulted:
            candidates = [c for c in candidates if c not in faulted] or [default]
            self._say(f"{kernel_name}: skipping {len(faulted)} config(s) that faulted here before")
        self.last_failures = []
        results = []
        start = time.time()
        desc = " ".join(f"{k}={v}" for k, v in sorted(shape.items()))
        self._say(f"autotuning {kernel_name} ({desc}): {len(candidates)} configs")
        for i, cfg in enumerate(candidates, 1):
            try:
                ms = self.measure(lambda: run(cfg))
                if not math.isfinite(ms):
                    raise RuntimeError(f"timing gave {ms}")
            except Exception as e:   # compile or launch failure: skip this candidate
                if _breaks_context(e):
                    # A fault inside a kernel (illegal or misaligned address) leaves the CUDA
                    # context unusable: every later candidate would fail too. Stop here, and
                    # remember the config so that the next process's search skips it.
                    record = memory.setdefault(key + FAULTED, {"configs": []})
                    record["configs"].append(cfg)
                    self._save()
                    raise RuntimeError(
                        f"autotuning {kernel_name} ({desc}): config {_fmt(cfg)} faulted on the GPU "
                        f"({type(e).__name__}: {e}); the CUDA context is lost, so this process "
                        f"cannot go on; the config is recorded in {self.path} and will be skipped "
                        f"by the next search. Please report it (or set {ENV_SWITCH}=0 to run the "
                        f"defaults)") from e
                self.last_failures.append((cfg, f"{type(e).__name__}: {e}"))
                self._say(f"  [{i}/{len(candidates)}] {_fmt(cfg)}: skipped ({type(e).__name__})")
                continue
            results.append((ms, cfg))
            best_ms = min(r[0] for r in results)
            self._say(f"  [{i}/{len(candidates)}] {_fmt(cfg)}: {ms:.3f} ms (best {best_ms:.3f})")
        if not results:
            raise RuntimeError(f"autotuning {kernel_name}: every candidate failed; first error: "
                               f"{self.last_failures[0][1] if self.last_failures else 'none'}")
        ms, cfg = min(results, key=lambda r: r[0])
        default_ms = next((t for t, c in results if c == default), None)
        if default_ms is not None and ms > default_ms * (1 - MARGIN):
            ms, cfg = default_ms, default          # not clearly faster: keep the default
        # Every candidate's time is kept too: it shows what each knob is worth for this shape.
        memory[key] = {"config": cfg, "ms": ms, "candidates": len(candidates),
                       "failures": len(self.last_failures), "tuned_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "timings": [[round(t, 5), c] for t, c in results]}
        self._save()
        self._say(f"  -> {_fmt(cfg)} at {ms:.3f} ms ({time.time() - start:.0f} s; cached in {self.path})")
        return cfg

    def _say(self, msg):
        if not self.quiet:
            print(f"[mamba2-cutile] {msg}", file=self.out, flush=True)


def _breaks_context(error):
    """True for the errors after which no CUDA call in this process can succeed."""
    text = f"{type(error).__name__}: {error}"
    return ("AcceleratorError" in text or "illegal memory access" in text
            or "misaligned address" in text or "unspecified launch failure" in text)


def _fmt(cfg):
    return " ".join(f"{k}={v}" for k, v in cfg.items())


_TUNER = None


def tuner():
    """The process-wide autotuner (created on first use, so the environment is read then)."""
    global _TUNER
    if _TUNER is None:
        _TUNER = Autotuner()
    return _TUNER
