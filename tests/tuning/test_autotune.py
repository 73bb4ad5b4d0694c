"""The autotuner's bookkeeping, on the CPU: a fake timer stands in for the GPU."""
import gzip
import io
import json
import os
import subprocess
import sys

import pytest

from ops.tuning.autotune import Autotuner, seqlen_bucket

SHAPE = {"seqlen": 65536, "dstate": 128, "dtype": "bfloat16"}
CONFIGS = [{"BLOCK_M": 64, "occupancy": 3}, {"BLOCK_M": 128, "occupancy": 2},
           {"BLOCK_M": 256, "occupancy": 1}, {"BLOCK_M": 32, "occupancy": 4}]
TIMES = {64: 2.0, 128: 1.5, 256: float("nan"), 32: 3.0}    # 256 "fails to compile" below


class FakeGPU:
    """run(cfg) 'launches' a config; the timer reads back how long that config takes."""

    def __init__(self):
        self.launched = []

    def run(self, cfg):
        if cfg["BLOCK_M"] == 256:
            raise RuntimeError("TileCompilerError: out of shared memory")
        self.launched.append(cfg["BLOCK_M"])

    def measure(self, fn):
        fn()
        return TIMES[self.launched[-1]]


def _tuner(tmp_path, gpu, **kw):
    return Autotuner(path=str(tmp_path / "autotune.json"), measure=gpu.measure, device="Test GPU",
                     out=kw.pop("out", io.StringIO()), **kw)


@pytest.fixture(autouse=True)
def tuning_on(monkeypatch):
    """conftest.py switches tuning off for the rest of the suite; these tests are about it."""
    monkeypatch.setenv("MAMBA2_CUTILE_AUTOTUNE", "1")


def test_picks_the_fastest_and_skips_failures(tmp_path):
    gpu, out = FakeGPU(), io.StringIO()
    t = _tuner(tmp_path, gpu, out=out)
    best = t.best("compute_out", SHAPE, CONFIGS, CONFIGS[0], gpu.run)
    assert best == {"BLOCK_M": 128, "occupancy": 2}
    assert [c["BLOCK_M"] for c, _ in t.last_failures] == [256]
    log = out.getvalue()
    assert "autotuning compute_out" in log and "[3/4]" in log and "skipped" in log and "1.500 ms" in log


def test_remembers_in_memory_on_disk_and_across_processes(tmp_path):
    gpu = FakeGPU()
    _tuner(tmp_path, gpu).best("compute_out", SHAPE, CONFIGS, CONFIGS[0], gpu.run)
    n = len(gpu.launched)
    # Same object and a fresh object on the same file: no launch at all.
    again = _tuner(tmp_path, gpu)
    assert again.best("compute_out", SHAPE, CONFIGS, CONFIGS[0], gpu.run)["BLOCK_M"] == 128
    assert len(gpu.launched) == n
    # Another process reads the same file and gets the winner without tuning (its run() would fail).
    code = ("import os, io; from ops.tuning.autotune import Autotuner\n"
            "os.environ['MAMBA2_CUTILE_AUTOTUNE'] = '1'\n"
            "t = Autotuner(path=%r, measure=lambda f: 1/0, device='Test GPU', out=io.StringIO())\n"
            "def run(cfg): raise SystemExit('retuned')\n"
            "print(t.best('compute_out', %r, [{'BLOCK_M': 1}], {'BLOCK_M': 0}, run)['BLOCK_M'])"
            % (str(tmp_path / "autotune.json"), SHAPE))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "128"
    entry = next(iter(json.load(open(tmp_path / "autotune.json")).values()))
    assert entry["ms"] == 1.5 and entry["failures"] == 1 and entry["candidates"] == 4
    # every timed candidate is kept with its time (the failed one is not)
    assert len(entry["timings"]) == 3 and min(t for t, _ in entry["timings"]) == 1.5
    assert [1.5, entry["config"]] in entry["timings"]


def test_keys_separate_kernels_shapes_and_devices(tmp_path):
    gpu = FakeGPU()
    t = _tuner(tmp_path, gpu)
    t.best("compute_out", SHAPE, CONFIGS, CONFIGS[0], gpu.run)
    n = len(gpu.launched)
    t.best("compute_out", {**SHAPE, "dstate": 256}, CONFIGS, CONFIGS[0], gpu.run)
    assert len(gpu.launched) > n                      # a new shape is tuned
    n = len(gpu.launched)
    other = Autotuner(path=t.path, measure=gpu.measure, device="Other GPU", out=io.StringIO())
    other.best("compute_out", SHAPE, CONFIGS, CONFIGS[0], gpu.run)
    assert len(gpu.launched) > n                      # a new device is tuned


def test_switched_off_uses_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("MAMBA2_CUTILE_AUTOTUNE", "0")
    gpu = FakeGPU()
    assert _tuner(tmp_path, gpu).best("compute_out", SHAPE, CONFIGS, CONFIGS[3], gpu.run) == CONFIGS[3]
    assert gpu.launched == [] and not (tmp_path / "autotune.json").exists()


def test_corrupt_cache_is_ignored_and_every_failure_is_an_error(tmp_path):
    (tmp_path / "autotune.json").write_text("{not json")
    gpu, out = FakeGPU(), io.StringIO()
    t = _tuner(tmp_path, gpu, out=out)
    assert t.best("compute_out", SHAPE, CONFIGS, CONFIGS[0], gpu.run)["BLOCK_M"] == 128
    assert "ignoring unreadable autotune cache" in out.getvalue()
    with pytest.raises(RuntimeError, match="every candidate failed.*out of shared memory"):
        t.best("fwd_pass_state", SHAPE, [CONFIGS[2]], CONFIGS[2], gpu.run)


def test_seqlen_buckets():
    assert [seqlen_bucket(n) for n in (1, 1000, 1024, 1025, 65536, 70000)] == [1024, 1024, 1024, 2048, 65536, 131072]


def test_forward_asks_the_tuner_for_every_kernel(tmp_path, monkeypatch):
    """The kernel forward's tuning path, on the CPU: every candidate of every kernel's search
    space really launches (here through the interpreter), a winner is cached per kernel, and the
    forward then runs with it and still matches the untuned result."""
    import torch
    import ops.tuning.autotune as autotune
    import ops.forward as fwd
    from reference.problems import make_problem
    from reference.validate import rel_err

    launched = []

    def measure(fn):
        fn()
        launched.append(1)
        return float(len(launched) % 7 + 1)      # an arbitrary but fixed ranking

    monkeypatch.setattr(autotune, "_TUNER", Autotuner(path=str(tmp_path / "t.json"), measure=measure,
                                                      device="Test GPU", out=io.StringIO()))
    kw = make_problem(batch=1, seqlen=80, nheads=4, headdim=16, ngroups=2, dstate=32, dtype=torch.float32)
    ref, _ = fwd.kernel_forward(**kw, chunk_size=32)
    real = fwd._config
    monkeypatch.setattr(fwd, "_config", lambda name, configs, shape, features, run:
                        real(name, configs, {**shape, "on_gpu": True}, features, run))
    out, _ = fwd.kernel_forward(**kw, chunk_size=32)
    cache = json.load(open(tmp_path / "t.json"))
    assert sorted(k.split("|")[0] for k in cache) == ["chunk_cumsum", "compute_out", "fwd_pass_state"]
    assert len(launched) == sum(v["candidates"] - v["failures"] for v in cache.values()) > 3
    assert rel_err(out, ref) < 1e-5


def test_the_timers_sleep_outlasts_the_hosts_call():
    """The sleep ahead of a timed launch lasts 4x the host's time for one call (sized at 2 GHz,
    above an H200's clock, so it is no shorter), never under 0.5 ms (above the slowest host call
    measured on the H200, 0.35 ms) nor over 20 ms."""
    from ops.tuning.autotune import SLEEP_HZ, sleep_cycles
    assert SLEEP_HZ >= 1.98e9
    assert sleep_cycles(40e-6) == sleep_cycles(0.0) == int(5e-4 * SLEEP_HZ)
    assert sleep_cycles(0.35e-3) / SLEEP_HZ >= 1.4e-3
    assert sleep_cycles(1e-3) == int(4e-3 * SLEEP_HZ)
    assert sleep_cycles(1.0) == int(2e-2 * SLEEP_HZ)


def test_the_timer_sleeps_longer_than_the_hosts_last_warm_up_call(monkeypatch):
    """cuda_event_timer sizes the sleep ahead of each timed launch from the host's time for the
    last warm-up call (the GPU's part faked here: the sleep and the events)."""
    from ops.tuning import autotune
    torch = pytest.importorskip("torch")
    slept, clock = [], [0.0]

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            self.at = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(torch.cuda, "_sleep", slept.append, raising=False)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    host = iter([0.05, 0.002] + [0.0] * 20)          # host seconds per call: first warm-up slow
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock[0])

    def fn():
        clock[0] += next(host) + 1e-5                # the host's part, and 10 us of "kernel"
    assert autotune.cuda_event_timer(fn, warmup=2, reps=3) == pytest.approx(0.01)
    want = autotune.sleep_cycles(0.002 + 1e-5)      # 4x the second call's, above the floor
    assert len(slept) == 3 and all(abs(c - want) <= 2 for c in slept) and want > autotune.sleep_cycles(0.0)


def test_the_timer_check_says_it_needs_a_gpu(monkeypatch):
    from tests.benchmark import tuner_timer
    monkeypatch.setattr(tuner_timer.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        tuner_timer.main()


def test_keeps_the_default_unless_clearly_faster(tmp_path):
    """A candidate within the timer's noise (MARGIN) of the default does not replace it."""
    from ops.tuning.autotune import MARGIN
    times = {64: 2.0, 128: 2.0 * (1 - MARGIN / 2), 32: 3.0}
    launched = []
    t = Autotuner(path=str(tmp_path / "a.json"), device="Test GPU", out=io.StringIO(),
                  measure=lambda fn: (fn(), times[launched[-1]])[1])
    configs = [c for c in CONFIGS if c["BLOCK_M"] != 256]
    assert t.best("compute_out", SHAPE, configs, configs[0],
                  lambda cfg: launched.append(cfg["BLOCK_M"])) == configs[0]
    times[128] = 2.0 * (1 - 2 * MARGIN)          # now clearly faster: it wins
    assert t.best("compute_out", dict(SHAPE, dstate=256), configs, configs[0],
                  lambda cfg: launched.append(cfg["BLOCK_M"]))["BLOCK_M"] == 128


def test_a_gpu_fault_stops_the_search(tmp_path):
    """After a kernel faults (misaligned / illegal address) the CUDA context is gone: the tuner
    says which config did it instead of 'skipping' every later candidate, picks no winner, and
    records the config so that the next process's search (a fresh context) leaves it out."""
    gpu = FakeGPU()

    def run(cfg):
        if cfg["BLOCK_M"] == 128:
            raise RuntimeError("CUDA error: misaligned address")
        gpu.run(cfg)
    t = _tuner(tmp_path, gpu)
    with pytest.raises(RuntimeError, match=r"BLOCK_M=128 occupancy=2 faulted.*MAMBA2_CUTILE_AUTOTUNE=0"):
        t.best("compute_out", SHAPE, CONFIGS, CONFIGS[0], run)
    assert gpu.launched == [64]
    on_disk = json.load(open(t.path))
    assert list(on_disk) == [t.key("compute_out", SHAPE) + "|faulted"]
    assert on_disk[t.key("compute_out", SHAPE) + "|faulted"]["configs"] == [CONFIGS[1]]
    # the next process: the faulting config is skipped, the rest are timed, a winner is kept
    out = io.StringIO()
    again = _tuner(tmp_path, gpu, out=out)
    assert again.best("compute_out", SHAPE, CONFIGS, CONFIGS[0], run) == CONFIGS[0]
    assert 128 not in gpu.launched and "skipping 1 config(s) that faulted" in out.getvalue()
    assert json.load(open(again.path))[again.key("compute_out", SHAPE)]["config"] == CONFIGS[0]


# Without a search: the committed table ----------------------------------------------------------

from ops import forward as forward_mod           # noqa: E402
from ops.tuning.autotune import TABLE_PATH, Table, export_table, mode, parse_key  # noqa: E402
from ops.forward import KERNELS                   # noqa: E402


@pytest.mark.parametrize("value, expected", [("", "table"), ("1", "search"), ("on", "search"),
                                             ("0", "off"), ("off", "off"), ("table", "table")])
def test_modes(monkeypatch, value, expected):
    monkeypatch.setenv("MAMBA2_CUTILE_AUTOTUNE", value)
    assert mode() == expected


TABLE_SHAPE = dict(batch="1", chunk_size="256", dstate="128", dtype="bfloat16", features="D",
                   headdim="64", ngroups="1", nheads="80", seqlen="16384", states_dtype="bfloat16")


def _entry(config, device="Test GPU", kernel="compute_out", **shape):
    return {"kernel": kernel, "device": device, "shape": {**TABLE_SHAPE, **shape},
            "config": config, "tuned_at": "2026-01-01 00:00:00"}


def test_table_takes_the_shape_else_the_nearest_valid_one():
    a, b, c = CONFIGS[:3]
    t = Table([_entry(a, seqlen="16384"), _entry(b, seqlen="262144"),
               _entry(c, seqlen="4096", dstate="256"), _entry(c, device="Other GPU")])
    shape = {**TABLE_SHAPE, "space": "whatever"}
    assert t.choose("compute_out", "Test GPU", shape, CONFIGS) == a                  # exact
    assert t.choose("compute_out", "Test GPU", {**shape, "seqlen": "131072"}, CONFIGS) == b
    # batch 8 x 2K tokens is the work of 16K tokens at batch 1: the 16K entry is the nearest
    assert t.choose("compute_out", "Test GPU", {**shape, "batch": "8", "seqlen": "2048"}, CONFIGS) == a
    assert t.choose("compute_out", "Test GPU", shape, [b, c]) == b    # a is not valid here: next
    assert t.choose("compute_out", "Test GPU", {**shape, "dstate": "64"}, CONFIGS) is None
    # a dstate of 100 runs in the tiles of 128: that entry serves it
    assert t.choose("compute_out", "Test GPU", {**shape, "dstate": "100"}, CONFIGS) == a
    assert t.choose("fwd_pass_state", "Test GPU", shape, CONFIGS) is None
    assert t.choose("compute_out", "Third GPU", shape, CONFIGS) is None


def test_a_borrowed_config_leaves_persistent_blocks_off():
    persistent = {"BLOCK_M": 64, "PERSISTENT": True}
    plain = {"BLOCK_M": 64, "PERSISTENT": False}
    t = Table([_entry(persistent)])
    shape = {**TABLE_SHAPE, "space": "whatever"}
    assert t.choose("compute_out", "Test GPU", shape, [persistent, plain]) == persistent   # its own
    nearby = {**shape, "seqlen": "32768"}
    assert t.choose("compute_out", "Test GPU", nearby, [persistent, plain]) == plain
    assert t.choose("compute_out", "Test GPU", nearby, [persistent]) == persistent  # no cheap twin


def test_a_gpu_without_entries_borrows_those_of_its_architecture():
    """Table.choice: this GPU's entries first, even a nearby shape's; only where none of them
    qualifies, the entries of a GPU of the same compute capability, chosen the same way, their
    costly knobs left off even at this very shape (not timed on this GPU)."""
    a, b = CONFIGS[:2]
    persistent = {"BLOCK_M": 64, "PERSISTENT": True}
    plain = {"BLOCK_M": 64, "PERSISTENT": False}
    devices = {"Test GPU": "9.0", "Sibling GPU": "9.0", "Older GPU": "8.0"}
    shape = {**TABLE_SHAPE, "space": "whatever"}
    t = Table([_entry(a, device="Sibling GPU"), _entry(b, device="Older GPU"),
               _entry(persistent, device="Sibling GPU", dstate="256")], devices)
    assert t.choose("compute_out", "Test GPU", shape, CONFIGS) is None         # no capability given
    config, entry = t.choice("compute_out", "Test GPU", shape, CONFIGS, "9.0")
    assert config == a and entry["device"] == "Sibling GPU"
    assert t.choose("compute_out", "Test GPU", shape, CONFIGS, "8.0") == b
    assert t.choose("compute_out", "Test GPU", shape, CONFIGS, "10.0") is None
    assert t.choose("compute_out", "Test GPU", {**shape, "dstate": "256"},
                    [persistent, plain], "9.0") == plain                     # borrowed: cheap twin
    # one entry of its own, at another length, comes before the sibling's at this one
    mine = Table(t.entries + [_entry(b, seqlen="262144")], devices)
    assert mine.choose("compute_out", "Test GPU", shape, CONFIGS, "9.0") == b
    # ... unless its config is not valid here
    assert mine.choose("compute_out", "Test GPU", shape, [a], "9.0") == a


def test_lookup_asks_the_table_with_the_gpus_capability_and_a_search_records_it(tmp_path,
                                                                                monkeypatch):
    import ops.tuning.autotune as autotune
    monkeypatch.setattr(autotune, "_TABLE", Table([_entry(CONFIGS[1], device="Sibling GPU")],
                                                  {"Sibling GPU": "9.0"}))
    gpu = FakeGPU()
    shape = {**TABLE_SHAPE, "space": "x"}
    assert _tuner(tmp_path, gpu).lookup("compute_out", shape, CONFIGS, CONFIGS[0]) == CONFIGS[0]
    t = _tuner(tmp_path, gpu, capability="9.0")
    assert t.lookup("compute_out", shape, CONFIGS, CONFIGS[0]) == CONFIGS[1]
    t.best("compute_out", shape, [CONFIGS[3]], CONFIGS[3], gpu.run)
    (record,) = json.loads((tmp_path / "autotune.json").read_text()).values()
    assert record["capability"] == "9.0"
    # the export carries it into the table's devices, beside those the kept table had
    (tmp_path / "old.json").write_text(json.dumps({"devices": {"Sibling GPU": "9.0"}, "entries": []}))
    export_table([tmp_path / "autotune.json"], tmp_path / "t.json", keep=tmp_path / "old.json")
    assert Table.load(tmp_path / "t.json").devices == {"Sibling GPU": "9.0", "Test GPU": "9.0"}


def test_lookup_prefers_an_earlier_search_then_the_table_then_the_default(tmp_path, monkeypatch):
    import ops.tuning.autotune as autotune
    monkeypatch.setattr(autotune, "_TABLE", Table([_entry(CONFIGS[1])]))
    gpu = FakeGPU()
    t = _tuner(tmp_path, gpu)
    shape = {**TABLE_SHAPE, "space": "x"}
    assert t.lookup("compute_out", shape, CONFIGS, CONFIGS[0]) == CONFIGS[1]           # table
    assert t.lookup("compute_out", {**shape, "dstate": "64"}, CONFIGS, CONFIGS[0]) == CONFIGS[0]
    assert t.best("compute_out", shape, [CONFIGS[3]], CONFIGS[3], gpu.run) == CONFIGS[3]  # search
    assert t.lookup("compute_out", shape, CONFIGS, CONFIGS[0]) == CONFIGS[3]           # cache
    assert gpu.launched == [32]                        # the search, once; the lookups: nothing


def test_export_keeps_the_latest_search_of_each_shape(tmp_path):
    key = "compute_out|Test GPU|cuda-tile 1.7.0|" + ",".join(f"{k}={v}" for k, v in sorted(
        {**TABLE_SHAPE, "space": "s1"}.items()))
    cache = {key: {"config": CONFIGS[0], "tuned_at": "2026-01-01 00:00:00"},
             key.replace("space=s1", "space=s2"): {"config": CONFIGS[1], "tuned_at": "2026-02-01 00:00:00"},
             key + "|faulted": {"configs": [CONFIGS[2]]}}
    (tmp_path / "c.json").write_text(json.dumps(cache))
    assert parse_key(key)[:2] == ("compute_out", "Test GPU")
    assert export_table([tmp_path / "c.json"], tmp_path / "t.json") == 1
    t = Table.load(tmp_path / "t.json")
    assert [e["config"] for e in t.entries] == [CONFIGS[1]]


def test_export_with_keep_refreshes_some_shapes_and_keeps_the_others(tmp_path):
    searched = {**TABLE_SHAPE, "dstate": "256"}
    other = {**TABLE_SHAPE, "dstate": "64"}
    old = {"entries": [{"kernel": "compute_out", "device": "Test GPU", "shape": s, "config": CONFIGS[0],
                        "tuned_at": "2026-01-01 00:00:00"} for s in (searched, other)]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    key = "compute_out|Test GPU|cuda-tile 1.7.0|" + ",".join(f"{k}={v}" for k, v in sorted(
        {**searched, "space": "s1"}.items()))
    # a search replaces the kept entry of its shape, even one stamped earlier (another machine's clock)
    with gzip.open(tmp_path / "c.json.gz", "wt") as f:
        json.dump({key: {"config": CONFIGS[2], "tuned_at": "2025-03-01 00:00:00"}}, f)
    assert export_table([tmp_path / "c.json.gz"], tmp_path / "t.json", keep=tmp_path / "old.json") == 2
    found = {e["shape"]["dstate"]: e["config"] for e in Table.load(tmp_path / "t.json").entries}
    assert found == {"256": CONFIGS[2], "64": CONFIGS[0]}
    assert export_table([tmp_path / "c.json.gz"], tmp_path / "t.json") == 1     # without keep: the cache only


def test_export_notes_the_gpus_whose_capability_it_lacks(tmp_path, capsys):
    """``tune export``: a GPU whose entries come from a search that recorded no capability, and
    which the kept table's devices do not name, lends nothing: the export says so."""
    from ops.tools import tune
    key = "compute_out|Old GPU|cuda-tile 1.7.0|" + ",".join(f"{k}={v}" for k, v in sorted(
        {**TABLE_SHAPE, "space": "s1"}.items()))
    (tmp_path / "c.json").write_text(json.dumps({key: {"config": CONFIGS[0], "tuned_at": "x"}}))
    tune.main(["export", str(tmp_path / "c.json"), "--out", str(tmp_path / "t.json")])
    assert "no compute capability recorded for Old GPU" in capsys.readouterr().out
    (tmp_path / "keep.json").write_text(json.dumps({"devices": {"Old GPU": "8.0"}, "entries": []}))
    tune.main(["export", str(tmp_path / "c.json"), "--out", str(tmp_path / "t.json"),
               "--keep", str(tmp_path / "keep.json")])
    assert "no compute capability" not in capsys.readouterr().out
    assert Table.load(tmp_path / "t.json").devices == {"Old GPU": "8.0"}


def test_the_capability_is_this_gpus_only_where_the_keys_name_it(tmp_path, monkeypatch):
    """Autotuner._capability: this process's GPU's, as "major.minor", when the tuner's keys name
    that GPU; None for another GPU's name or without a GPU (no wrong GPU's capability)."""
    import torch
    gpu = FakeGPU()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert _tuner(tmp_path, gpu)._capability() == "9.0"
    assert Autotuner(path=str(tmp_path / "a.json"), device="Other GPU")._capability() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _tuner(tmp_path, gpu)._capability() is None


def _sizes(shape):
    import torch
    out = {}
    for k, v in shape.items():
        if k in ("dtype", "states_dtype"):
            out[k] = getattr(torch, v)
        elif k != "features":
            out[k] = int(v)
    return out


def test_every_committed_entry_is_valid_today():
    """Each config of the committed table is in its kernel's current search space at its shape
    (a backward kernel's: the variants the backward chain can run, ``chain_space``): ``choose``
    would otherwise skip it, and the table would silently stop being used."""
    from ops.backward import BACKWARD_KERNELS, chain_space
    entries = Table.load(TABLE_PATH).entries
    assert len(entries) >= 80 and {e["device"] for e in entries} >= {"NVIDIA H200"}
    for e in entries:
        sizes = _sizes(e["shape"])
        if e["kernel"] in BACKWARD_KERNELS:
            space = chain_space(e["kernel"], sizes)[1]
        else:
            space = KERNELS[e["kernel"]].search_space(**sizes)
        assert e["config"] in space, (e["kernel"], e["shape"])


@pytest.mark.parametrize("configs, searched", [
    (None, ["bwd_chunk_cumsum", "bwd_compute_out", "bwd_pass_state"]),
    ({"bwd_compute_out": {"FUSE_STATES": False, "PAIRS": False}},
     ["bwd_chunk_cumsum", "bwd_chunk_states", "bwd_pass_state"]),
], ids=["fused", "unfused"])
def test_the_backward_asks_the_tuner_for_every_kernel(tmp_path, monkeypatch, configs, searched):
    """The kernel backward's tuning path, on the CPU: every candidate the chain can run for each
    backward kernel really launches (through the interpreter) on the chain's own inputs, a
    winner is cached per kernel (the forward's kernels of the recompute too), a kernel given a
    config is not searched, and the gradients with the winners match the untuned ones (those
    of the kernels that accumulate into their inputs too: their search runs on copies). The
    token kernel's candidates are timed with the sums of dB's and dC's head-split partials
    (their number is the config's), and nothing else is."""
    import torch
    import ops.tuning.autotune as autotune
    import ops.backward as bwd
    from reference.problems import make_problem
    from reference.validate import rel_err

    launched, sums, summed_per_run = [], [], []
    real_sum_splits = bwd.sum_splits
    monkeypatch.setattr(bwd, "sum_splits", lambda parts: sums.append(1) or real_sum_splits(parts))

    def measure(fn):
        before = len(sums)
        fn()
        summed_per_run.append(len(sums) - before)
        launched.append(1)
        return float(len(launched) % 5 + 1)      # an arbitrary but fixed ranking

    monkeypatch.setattr(autotune, "_TUNER", Autotuner(path=str(tmp_path / "t.json"),
                                                      measure=measure, device="Test GPU",
                                                      out=io.StringIO()))
    kw = make_problem(batch=1, seqlen=64, nheads=4, headdim=16, ngroups=2, dstate=32, D="1d",
                      dtype=torch.float32, seed=3)
    dout = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(4))
    args = (dout, None, kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 32)
    options = dict(D=kw["D"], dt_bias=kw["dt_bias"], dt_softplus=True, configs=configs)
    want = bwd.kernel_backward(*args, **options)
    real = bwd.tuned_config
    monkeypatch.setattr(bwd, "tuned_config", lambda name, configs, shape, features, run:
                        real(name, configs, {**shape, "on_gpu": True}, features, run))
    got = bwd.kernel_backward(*args, **options)
    cache = json.load(open(tmp_path / "t.json"))
    assert sorted(k.split("|")[0] for k in cache if k.startswith("bwd_")) == searched
    for name in searched:
        entry = next(v for k, v in cache.items() if k.startswith(name + "|"))
        default, space = bwd.chain_space(name, {**dict(
            batch=1, seqlen=64, nheads=4, headdim=16, ngroups=2, dstate=32, chunk_size=32,
            dtype=torch.float32, states_dtype=torch.float32)})
        assert entry["candidates"] == len(space) > 1 and entry["failures"] == 0, name
        if name == "bwd_pass_state":
            assert all(c["FUSE_ENTRY"] for c in space)
    assert set(got) == set(want)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-5, name
    tokens = [v["candidates"] for k, v in cache.items() if k.startswith("bwd_compute_out|")]
    assert summed_per_run.count(2) == sum(tokens) and set(summed_per_run) <= {0, 2}


def test_the_backward_on_a_gpu_takes_the_table_by_default(monkeypatch, tmp_path):
    """A table entry for a backward kernel at a GPU shape is what the chain runs there (no
    search, nothing launched to choose it); where it is the chain's own choice the answer is
    None (the chain's defaults then apply, as without a table)."""
    import torch
    import ops.tuning.autotune as autotune
    import ops.backward as bwd
    monkeypatch.delenv("MAMBA2_CUTILE_AUTOTUNE")
    shape = dict(batch=8, seqlen=2048, nheads=80, headdim=64, ngroups=1, dstate=128,
                 chunk_size=128, dtype=torch.bfloat16, states_dtype=torch.bfloat16, on_gpu=True)
    default, space = bwd.chain_space("bwd_chunk_cumsum", shape)
    other = space[-1]
    assert other != default
    entry = {"kernel": "bwd_chunk_cumsum", "device": "NVIDIA H200",
             "shape": {"batch": "8", "seqlen": "2048", "nheads": "80", "headdim": "64",
                       "ngroups": "1", "dstate": "128", "chunk_size": "128",
                       "dtype": "bfloat16", "states_dtype": "bfloat16", "features": "D"},
             "config": other, "tuned_at": "2026-01-01 00:00:00"}
    no_launch = lambda cfg: pytest.fail("a lookup must not launch")
    for table, want in (([entry], other), ([{**entry, "config": default}], None), ([], None)):
        monkeypatch.setattr(autotune, "_TABLE", Table(table))
        monkeypatch.setattr(autotune, "_TUNER", Autotuner(path=str(tmp_path / "none.json"),
                                                          measure=lambda f: 1 / 0,
                                                          device="NVIDIA H200"))
        assert bwd.tuned_config("bwd_chunk_cumsum", {}, shape, "D", no_launch) == want
    given = {"BLOCK_H": 4}
    assert bwd.tuned_config("bwd_chunk_cumsum", {"bwd_chunk_cumsum": given}, shape, "D",
                            no_launch) is given
    assert bwd.tuned_config("bwd_chunk_cumsum", {}, {**shape, "on_gpu": False}, "D",
                            no_launch) is None


def test_forward_on_a_gpu_takes_the_table_by_default(monkeypatch, tmp_path):
    """ops.forward's choice for a GPU shape in the table, with no search and no cache: the
    table's config (the tuner is told it runs on an H200; nothing is launched)."""
    import torch

    import ops.tuning.autotune as autotune
    monkeypatch.delenv("MAMBA2_CUTILE_AUTOTUNE")
    monkeypatch.setattr(autotune, "_TUNER", Autotuner(path=str(tmp_path / "none.json"),
                                                      measure=lambda f: 1 / 0, device="NVIDIA H200"))
    entry = next(e for e in Table.load(TABLE_PATH).entries
                 if e["kernel"] == "compute_out" and e["shape"]["seqlen"] == "65536"
                 and e["shape"]["dstate"] == "256" and e["shape"]["chunk_size"] == "256")
    shape = dict(_sizes(entry["shape"]), on_gpu=True)
    shape["dtype"] = shape["states_dtype"] = torch.bfloat16
    run = lambda cfg: pytest.fail("a lookup must not launch")
    assert forward_mod._config("compute_out", {}, shape, "D", run) == entry["config"]
    assert entry["config"] != KERNELS["compute_out"].default_config(**shape)
