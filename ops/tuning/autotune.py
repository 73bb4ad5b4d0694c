"""Per-shape kernel configs: a committed table of tuned configs, and a search on request.

The fastest tile sizes, latency hints, operand order and occupancy depend on the input shape
(sequence length, dstate, heads) and on the GPU, so each kernel module offers a
``search_space(...)`` of valid configs and a ``default_config(...)``. A search times every
candidate on the real inputs and keeps the fastest; it takes minutes (each candidate compiles),
so it never runs unasked. By default a kernel on a GPU takes, in this order:

  1. the winner of an earlier search at this shape, from the cache file;
  2. the committed table (``tuned_configs.json``, searched on an NVIDIA H200 at the benchmark's
     grid and at model shapes; the backward's kernels, so far, at a few shapes on an H100 and an
     H200): the entry for this shape, else the nearest tuned shape of the
     same GPU, chunk, dtype and head and state tiles (by the amount of work), if its config is
     valid here, with the knobs that are slow to compile and gain little away from their own
     shape left off (``COSTLY_TO_COMPILE``); a GPU with no such entry of its own chooses the
     same way among those of the GPUs of its compute capability (``Table.choice``: an H100
     takes the H200's forward entries, the H200 the H100's backward ones at dstate 256);
  3. the kernel's default config.

The forward's kernels ask in ``ops.forward._config``, the backward's in
``ops.backward.tuned_config`` (among the variants the backward chain can run in a kernel's
place: ``ops.backward.chain_space``).

Environment:
    MAMBA2_CUTILE_AUTOTUNE=1        search on a shape the cache does not know (then cache it)
    MAMBA2_CUTILE_AUTOTUNE=0        no cache, no table: every kernel uses its default config
    MAMBA2_CUTILE_AUTOTUNE_CACHE    the JSON file (default ~/.cache/mamba2-cutile/autotune.json)
    MAMBA2_CUTILE_AUTOTUNE_QUIET=1  no progress output

``python -m ops.tools.tune --help``: search given shapes ahead of time, compiling the candidates in
parallel, and export caches into a table. A candidate that fails (a compile error, a launch
error) is skipped and reported, never fatal. The CPU interpreter always runs the default config.
"""
import gzip
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

from ops.checks import tile_size

ENV_SWITCH = "MAMBA2_CUTILE_AUTOTUNE"
ENV_CACHE = "MAMBA2_CUTILE_AUTOTUNE_CACHE"
ENV_QUIET = "MAMBA2_CUTILE_AUTOTUNE_QUIET"

# Suffix of the cache entry listing a shape's configs that faulted on the GPU.
FAULTED = "|faulted"

# A candidate replaces the default only when it is this much faster: closer than that is
# within the timer's noise, and the default is the config the tests and the notebooks study.
MARGIN = 0.03


TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned_configs.json")


def mode():
    """"search", "table" (the default: cache and table, no search) or "off" (defaults only)."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in ("1", "true", "on", "yes", "search"):
        return "search"
    if value in ("0", "false", "off", "no"):
        return "off"
    return "table"


def enabled():
    """Whether a search may run (MAMBA2_CUTILE_AUTOTUNE=1)."""
    return mode() == "search"


def default_cache_path():
    return os.environ.get(ENV_CACHE) or os.path.join(
        os.path.expanduser("~"), ".cache", "mamba2-cutile", "autotune.json")


# The sleep queued before each timed launch is sized in cycles at this clock, above any H200
# boost clock (1.98 GHz), so it lasts at least as long as asked for; between these bounds (s).
# The floor, 0.5 ms, is above the slowest host call measured for one of this project's launches
# (``tests/benchmark/results/tuner_timer_h200.txt``).
SLEEP_HZ = 2.0e9
SLEEP_S = (5e-4, 2e-2)


def sleep_cycles(host_s):
    """Cycles for the sleep ahead of a timed launch whose host side took ``host_s`` seconds: four
    times as long, within ``SLEEP_S``."""
    low, high = SLEEP_S
    return int(min(max(4 * host_s, low), high) * SLEEP_HZ)


def cuda_event_timer(fn, warmup=2, reps=10):
    """Median milliseconds of ``fn()`` on the current CUDA stream, timed with CUDA events.

    Each timed launch is queued behind a sleep kernel, so the host has queued it before the GPU
    reaches the start event: the events then bracket GPU time only. Without this, a small kernel
    (tens of microseconds) measures the host's launch cost, the same for every candidate, and the
    winner is noise. The sleep must outlast the host's work for one call, which varies several
    fold from call to call: behind a fixed 0.1 ms sleep a microsecond kernel sometimes read the
    host's time instead of its own (``tests/benchmark/results/tuner_timer_h200.txt``, made by
    ``tests/benchmark/tuner_timer.py``; PERF_NOTES.md, "A committed table of tuned configs"). So
    the sleep is 4x the last warm-up call's host time, and at least 0.5 ms, above the slowest
    such call measured (``sleep_cycles``; ``tests/tuning/test_autotune.py``)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    host_s = 0.0
    for _ in range(warmup):
        start = time.perf_counter()
        fn()
        host_s = time.perf_counter() - start         # the last: compiled and loaded by then
    cycles = sleep_cycles(host_s)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep is not None:
            sleep(cycles)
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
    their own). ``device`` names the GPU (keys of different GPUs never mix); ``capability`` is
    its compute capability ("9.0"), by default this process's GPU's where ``device`` names it:
    the table lends a GPU with no entries of its own those of GPUs of its capability, and a
    search records it for ``export_table``.
    """

    def __init__(self, path=None, measure=None, device=None, quiet=None, out=None,
                 capability=None):
        self.path = path or default_cache_path()
        self.measure = measure or cuda_event_timer
        self.device = device
        self.capability = capability
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
            self.device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        return self.device

    def _capability(self):
        """The compute capability ("9.0") of the GPU the keys name: the one given, else this
        process's GPU's where the keys name it; None otherwise (no GPU, or another GPU's name)."""
        if (self.capability is None and torch.cuda.is_available()
                and self._device_name() == torch.cuda.get_device_name()):
            self.capability = "%d.%d" % torch.cuda.get_device_capability()
        return self.capability

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

    # Without a search -------------------------------------------------------------------------

    def lookup(self, kernel_name, shape, candidates, default):
        """The config for ``kernel_name`` at ``shape`` without timing anything: an earlier
        search's winner from the cache, else the committed table's (``Table.choose``), else
        ``default``."""
        memory = self._load()
        key = self.key(kernel_name, shape)
        if key in memory:
            return memory[key]["config"]
        found = table().choose(kernel_name, self._device_name(), shape, candidates,
                               self._capability())
        return default if found is None else found

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
        if self._capability() is not None:        # export_table's devices: Table.choice
            memory[key]["capability"] = self._capability()
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


# The committed table ---------------------------------------------------------------------------

def parse_key(key):
    """A cache key -> (kernel, device, {shape item: value as text})."""
    kernel, device, _version, items = key.split("|")[:4]
    return kernel, device, dict(item.split("=", 1) for item in items.split(","))


# Shape items a table entry must share with the call (they change which configs are valid and
# what they cost; headdim and dstate through their tiles); the others decide which is nearest.
SAME = ("headdim", "dstate", "chunk_size", "dtype")


def _same(item, a, b):
    """headdim and dstate match by the tile they are computed in (48 runs as 64), the rest exactly."""
    if item in ("headdim", "dstate") and a is not None and b is not None:
        return tile_size(int(a)) == tile_size(int(b))
    return a == b


def _work(shape):
    return int(shape["batch"]) * int(shape["seqlen"]) * int(shape["nheads"])


class Table:
    """Tuned configs, as entries {kernel, device, shape, config} (``export_table`` makes them),
    and ``devices``: {GPU name as the entries give it: its compute capability, "9.0"}."""

    def __init__(self, entries, devices=None):
        self.entries = entries
        self.devices = dict(devices or {})

    @classmethod
    def load(cls, path=TABLE_PATH):
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return cls([])
        return cls(data["entries"], data.get("devices"))

    def choose(self, kernel_name, device, shape, candidates, capability=None):
        """The config ``choice`` picks, or None."""
        found = self.choice(kernel_name, device, shape, candidates, capability)
        return None if found is None else found[0]

    def choice(self, kernel_name, device, shape, candidates, capability=None):
        """(config, the entry it comes from) for ``kernel_name`` at ``shape`` on GPU ``device``,
        among the entries whose config is one of ``candidates`` (the current search space) and
        whose ``SAME`` items match; None if none qualifies.

        The rule: this GPU's entry for this shape, else its nearest tuned shape's (nearest in
        log2 of batch x seqlen x heads, then features, state dtype and groups). Where none of
        this GPU's entries qualifies (none for this kernel, chunk, dtype and head and state
        tiles whose config is valid here), the same choice among the entries of the GPUs of its
        compute capability (``capability``, as ``devices`` records each GPU's; between two such
        GPUs' equally near entries, the first GPU by name). So one entry of its own, however far
        its shape, comes before another GPU's at this very shape: a GPU's own timings are the
        better evidence for it. Why borrow: the H100 and the H200 are one chip with different
        memory, and where the backward's searches on either timed the config the other's entries
        give, it was within 1.05x of the fastest candidate in 15 of 16 and 1.16x in the last
        (``tests/benchmark/test_tuning_report.py``; PERF_NOTES.md, "A committed table of tuned
        configs", which also says what borrowing has not been timed at). A config from another
        shape or another GPU has the knobs that are slow to compile left off
        (``COSTLY_TO_COMPILE``): it was not timed at this shape on this GPU."""
        want = {k: str(v) for k, v in shape.items() if k != "space"}

        def qualifying(gpu):
            return [e for e in self.entries if e["kernel"] == kernel_name and e["device"] == gpu
                    and all(_same(k, e["shape"].get(k), want.get(k)) for k in SAME)
                    and e["config"] in candidates]

        def distance(entry):
            other = entry["shape"]
            far = abs(math.log2(_work(other)) - math.log2(_work(want)))
            return (far, sum(other.get(k) != want.get(k)
                             for k in ("headdim", "dstate", "features", "states_dtype", "ngroups",
                                       "batch", "nheads")))

        found = qualifying(device)
        if not found and capability is not None:
            found = [e for gpu in sorted(self.devices) if gpu != device
                     and self.devices[gpu] == capability for e in qualifying(gpu)]
        if not found:
            return None
        entry = min(found, key=distance)
        config = entry["config"]
        if entry["shape"] != want or entry["device"] != device:   # not timed here
            config = _cheap_to_compile(config, candidates)
        return config, entry


# Knobs whose variants take much longer to compile, and the value that does not: persistent
# blocks about double compute_out's compile time (most of a first call) for a few percent at the
# shapes they were tuned at, where their grid was sized for the work
# (``tests/benchmark/results/first_call_h200.csv``; PERF_NOTES.md, "A committed table of tuned
# configs"). A config borrowed from a nearby shape leaves them off.
COSTLY_TO_COMPILE = {"PERSISTENT": False}


def _cheap_to_compile(config, candidates):
    """``config`` with the ``COSTLY_TO_COMPILE`` knobs at their cheap values, if that config is a
    candidate, else ``config`` itself."""
    cheap = {**config, **{k: v for k, v in COSTLY_TO_COMPILE.items() if k in config}}
    return cheap if cheap in candidates else config


_TABLE = None


def table():
    """The committed table (loaded on first use)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = Table.load()
    return _TABLE


def read_cache(path):
    """An autotune cache file's contents: JSON, or gzipped JSON (``.gz``, as committed results)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _entry_ident(entry):
    """What one table entry is for: its kernel, device and shape."""
    return entry["kernel"], entry["device"], tuple(sorted(entry["shape"].items()))


def export_table(cache_paths, out_path=TABLE_PATH, keep=None):
    """Write the searches' winners of autotune caches (JSON, or gzipped JSON: ``.gz``) as a
    table: one entry per kernel, device and shape (the latest search where the caches searched
    a shape more than once). With ``keep`` (a table's path), that table's entries stay for the
    shapes no cache searched, so a refresh of some shapes leaves the others' tuning in place;
    a shape the caches searched takes their winner. The table's ``devices`` (each GPU's compute
    capability, which ``Table.choice`` matches GPUs by) are ``keep``'s and those the searches
    recorded. Returns the count of entries."""
    best = {}
    devices = dict(Table.load(keep).devices if keep else {})
    for path in cache_paths:
        for key, value in read_cache(path).items():
            if key.endswith(FAULTED):
                continue
            kernel, device, shape = parse_key(key)
            shape.pop("space", None)
            if value.get("capability"):
                devices[device] = value["capability"]
            entry = {"kernel": kernel, "device": device, "shape": shape,
                     "config": value["config"], "tuned_at": value.get("tuned_at", "")}
            ident = _entry_ident(entry)
            if ident not in best or entry["tuned_at"] >= best[ident]["tuned_at"]:
                best[ident] = entry
    for entry in (Table.load(keep).entries if keep else []):
        best.setdefault(_entry_ident(entry), entry)
    entries = [best[k] for k in sorted(best)]
    with open(out_path, "w") as f:
        json.dump({"about": "winners of autotune searches (python -m ops.tools.tune export); "
                            "read by ops.tuning.autotune.Table",
                   "devices": dict(sorted(devices.items())), "entries": entries}, f, indent=1)
        f.write("\n")
    return len(entries)

