"""The benchmark harness (tests/benchmark/), end to end on the CPU.

The GPU benchmark is expensive to rerun, so every path of the harness that does not need a GPU is
run here: the worker processes and their task lists, restarting after a crash, a broken device, a
failure and a hang, the comparison with the baseline, the CSV, resuming, stopping on SIGTERM,
the plot, the README table and the summary numbers.

mamba_ssm and TileGym are replaced by stand-ins with their real call signatures (written to a
temporary folder put first on PYTHONPATH) that compute with this project's reference, so the
argument plumbing of both -- TileGym's processed dt, A, D and initial state included -- is
checked against the baseline too.
"""
import csv
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ops.results import plot, report

HERE = os.path.dirname(os.path.abspath(__file__))           # tests/benchmark
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH = os.path.join(HERE, "bench_forward.py")
PLOT = ["-m", "ops.results.plot"]

TINY = ["--device", "cpu", "--nheads", "2", "--headdim", "16", "--warmup-ms", "1", "--rep-ms", "2"]
PROGRESS = re.compile(r"^\[(\d+)/(\d+)\] (\S+) L=(\S+) dstate=(\d+) chunk=(\d+) (.*) \((\d+) s\)$", re.M)

STAND_INS = {
    "mamba_ssm/__init__.py": '__version__ = "0.0-stand-in"\n',
    "mamba_ssm/ops/__init__.py": "",
    "mamba_ssm/ops/triton/__init__.py": "",
    "mamba_ssm/ops/triton/ssd_combined.py": '''
        import math
        from reference.chunked import ssd_chunked

        def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                      initial_states=None, seq_idx=None, cu_seqlens=None,
                                      dt_softplus=False, dt_limit=(0.0, math.inf),
                                      return_final_states=False, return_varlen_states=False):
            return ssd_chunked(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                               initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
                               dt_limit=dt_limit, return_final_states=return_final_states)
    ''',
    "tilegym/__init__.py": '__version__ = "0.0-stand-in"\n',
    "tilegym/ops/__init__.py": "",
    "tilegym/ops/cutile/__init__.py": "",
    "tilegym/ops/cutile/mamba2.py": '''
        import torch
        from reference.chunked import ssd_chunked

        def mamba2_chunk_forward(x, a, b, c, d, dt, init_state, chunk_size=64):
            if x.shape[1] % chunk_size:
                raise ValueError("num_tokens must be divisible by a positive chunk_size")
            assert dt.shape == x.shape[:3] and dt.dtype == torch.float32 and bool((dt > 0).all())
            assert a.shape == d.shape == (x.shape[2],) and bool((a < 0).all())
            assert init_state.shape == (x.shape[0], x.shape[2], x.shape[3], b.shape[3])
            return ssd_chunked(x, dt, a, b, c, chunk_size, D=d, initial_states=init_state,
                               return_final_states=True)
    ''',
}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    root = tmp_path_factory.mktemp("stand_ins")
    for path, text in STAND_INS.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))
    return str(root)


def bench_env(stand_ins, **extra):
    """The environment of a harness run: the stand-ins first on the path, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "BENCH_FORWARD_CRASH"}
    env.update(PYTHONPATH=os.pathsep.join([stand_ins, ROOT]), MPLBACKEND="Agg", **extra)
    return env


def run_bench(args, env, timeout=180):
    proc = subprocess.run([sys.executable, BENCH] + args, capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    return proc


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# Pieces ------------------------------------------------------------------------------------------

def test_the_default_grid_is_the_h200_one():
    from tests.benchmark import bench_forward as bf
    a = bf.parse_args([])
    assert (a.impls, a.seqlens, a.dstates, a.chunks) == (
        ["triton", "cutile", "tilegym"], [1024, 4096, 16384, 65536, 262144], [64, 128, 256, 512], [256])
    assert (a.nheads, a.headdim, a.ngroups, a.batch, a.dtype, a.device) == (80, 64, 1, 1, "bf16", "cuda")
    assert a.baseline == [("triton", None), ("cutile", None), ("tilegym", None)]
    assert bf.parse_lengths("1K,4k,1M,96") == [1024, 4096, 1 << 20, 96]


def test_work_counts_at_the_h200_shape():
    from tests.benchmark import bench_forward as bf
    flops, nbytes = bf.work_counts(1, 65536, 80, 64, 1, 128, 256, "bfloat16")
    assert flops == 4 * 65536 * 80 * 64 * 128 + 65536 * 256 * 128 + 65536 * 256 * 80 * 64
    assert nbytes == 65536 * (2 * 80 * 64 * 2 + 2 * 128 * 2 + 80 * 4) + 3 * 80 * 4


def test_median_time_follows_do_bench_recipe():
    """The timer used when triton is missing: an estimate, ~warmup_ms of calls, ~rep_ms timed."""
    from tests.benchmark import bench_forward as bf
    calls, times = [], iter([2.0] + [5.0, 1.0, 3.0, 4.0, 2.0])
    fn = lambda: calls.append(1)

    def time_once(f):
        f()
        return next(times)
    assert bf.median_time(fn, warmup_ms=4, rep_ms=10, time_once=time_once) == 3.0
    assert len(calls) == 1 + 2 + 5                      # estimate, 4/2 warm-up calls, 10/2 timed ones


# The whole harness on a tiny grid ------------------------------------------------------------

IMPLS = ["triton", "cutile", "tilegym", "interpret", "_crash"]
CRASHES = "64x32x32:exit,96x16x64:poison,96x32:raise"     # _crash's behaviour by L x dstate [x chunk]


@pytest.fixture(scope="module")
def grid(stand_ins, tmp_path_factory):
    out = tmp_path_factory.mktemp("grid")
    csv_path, png = str(out / "grid.csv"), str(out / "grid.png")
    args = TINY + ["--impls", ",".join(IMPLS), "--seqlens", "64,96", "--dstates", "16,32",
                   "--chunks", "32,64", "--csv", csv_path, "--plot", png]
    proc = run_bench(args, bench_env(stand_ins, BENCH_FORWARD_CRASH=CRASHES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(proc=proc, csv=csv_path, png=png, args=args)


def rows_by(rows):
    return {(r["impl"], int(r["seqlen"]), int(r["dstate"]), int(r["chunk"])): r for r in rows}


def test_every_point_is_recorded(grid):
    rows = read_csv(grid["csv"])
    assert len(rows) == len(IMPLS) * 2 * 2 * 2
    by = rows_by(rows)
    for impl in ("triton", "interpret"):
        assert all(r["status"] == "ok" for r in rows if r["impl"] == impl)
    # cutile needs a GPU: each point fails with the reason, and the run goes on
    assert all(r["status"].startswith("failed: ValueError") and "CUDA" in r["status"]
               for r in rows if r["impl"] == "cutile")
    # TileGym runs only where L is a multiple of the chunk
    assert by[("tilegym", 96, 16, 64)]["status"].startswith("skipped")
    assert by[("tilegym", 96, 16, 32)]["status"] == "ok"


def test_crashes_are_recorded_and_the_run_goes_on(grid):
    by = rows_by(read_csv(grid["csv"]))
    exited = by[("_crash", 64, 32, 32)]["status"]
    assert exited.startswith("crashed: simulated crash: Segmentation fault") and "exit code 3" in exited
    broken = by[("_crash", 96, 16, 64)]["status"]                 # the device broke: a new worker took over
    assert broken.startswith("crashed: RuntimeError: simulated CUDA error")
    for chunk in (32, 64):
        assert by[("_crash", 96, 32, chunk)]["status"] == "failed: RuntimeError: simulated failure"
        assert by[("_crash", 64, 16, chunk)]["status"] == "ok"
    # the same shapes at the other chunk ran fine: in a new worker after the crash, before the break
    assert by[("_crash", 64, 32, 64)]["status"] == by[("_crash", 96, 16, 32)]["status"] == "ok"
    out = grid["proc"].stdout
    assert out.count("_crash worker started") == 3                # 1 + a crash + a broken device
    assert "_crash| simulated crash: Segmentation fault" in grid["proc"].stderr


def test_outputs_are_compared_with_the_baseline(grid):
    rows = read_csv(grid["csv"])
    for r in rows:
        if r["status"] != "ok":
            assert r["rel_err"] == ""
        elif (r["impl"], r["chunk"]) == ("triton", "64"):
            assert r["rel_err_vs"] == "(baseline)"                 # chunk 64: the run's largest
        else:
            assert r["rel_err_vs"] == "triton/64", r
            assert float(r["rel_err"]) < 1e-2, r                  # bf16 outputs


def test_derived_columns(grid):
    rows = read_csv(grid["csv"])
    r = rows_by(rows)[("interpret", 96, 32, 64)]
    flops = 4 * 96 * 2 * 16 * 32 + 96 * 64 * 1 * 32 + 96 * 64 * 2 * 16
    nbytes = 96 * (2 * 2 * 16 * 2 + 2 * 32 * 2 + 2 * 4) + 3 * 2 * 4
    assert (int(r["flops"]), int(r["bytes"])) == (flops, nbytes)
    ms, peak_tflops, peak_gbps = float(r["ms"]), float(r["peak_tflops"]), float(r["peak_gbps"])
    assert math.isclose(float(r["tflops"]), flops / ms / 1e9, rel_tol=1e-9)
    assert math.isclose(float(r["gbps"]), nbytes / ms / 1e6, rel_tol=1e-9)
    roof = max(flops / peak_tflops / 1e9, nbytes / peak_gbps / 1e6)
    assert math.isclose(float(r["roofline_fraction"]), roof / ms, rel_tol=1e-9)
    # the CSV describes its run
    assert r["device"].startswith("cpu") and r["timer"] == "perf_counter median"
    assert r["mamba_ssm"] == r["tilegym"] == "0.0-stand-in" and r["torch"] and r["git_commit"]
    assert r["finite"] == "True" and float(r["first_call_s"]) > 0
    # exactly one best chunk per implementation and shape (where any chunk ran)
    for impl in ("triton", "interpret", "tilegym"):
        for L in (64, 96):
            for n in (16, 32):
                marks = [r["best_chunk"] for r in rows if (r["impl"], r["seqlen"], r["dstate"]) == (impl, str(L), str(n))
                         and r["status"] == "ok"]
                assert marks.count("True") == 1, (impl, L, n, marks)


def test_progress_lines(grid):
    lines = PROGRESS.findall(grid["proc"].stdout)
    total = len(IMPLS) * 8 - 2                                    # two TileGym points are skipped
    assert [int(k) for k, *_ in lines] == list(range(1, total + 1))
    assert {int(n) for _, n, *_ in lines} == {total}
    assert any(status.endswith(" ms") for *_, status, _ in lines)
    assert "[peaks] bf16 512^3 matmul" in grid["proc"].stdout
    assert "max rel err" in grid["proc"].stdout                   # the closing table


def test_plot_of_the_run(grid):
    assert os.path.getsize(grid["png"]) > 10_000


def test_resume_runs_nothing_twice(grid, stand_ins):
    before = read_csv(grid["csv"])
    proc = run_bench(grid["args"] + ["--resume"], bench_env(stand_ins, BENCH_FORWARD_CRASH=CRASHES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 points to run" in proc.stdout and "worker started" not in proc.stdout
    assert read_csv(grid["csv"]) == before


# Hangs, SIGTERM, in-process mode ---------------------------------------------------------------

def test_a_hanging_point_times_out(stand_ins, tmp_path):
    csv_path = str(tmp_path / "hang.csv")
    proc = run_bench(TINY + ["--impls", "_crash", "--seqlens", "64,96", "--dstates", "16", "--chunks", "32",
                             "--task-timeout", "2", "--csv", csv_path, "--quiet-workers"],
                     bench_env(stand_ins, BENCH_FORWARD_CRASH="64x16:hang"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by = rows_by(read_csv(csv_path))
    assert by[("_crash", 64, 16, 32)]["status"] == "crashed: timed out after 2 s"
    assert by[("_crash", 96, 16, 32)]["status"] == "ok"


def test_sigterm_stops_the_worker_and_keeps_the_rows(stand_ins, tmp_path):
    csv_path = str(tmp_path / "stopped.csv")
    proc = subprocess.Popen([sys.executable, BENCH] + TINY + [
        "--impls", "_crash", "--seqlens", "64,96", "--dstates", "16", "--chunks", "32", "--csv", csv_path,
        "--quiet-workers"], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env=bench_env(stand_ins, BENCH_FORWARD_CRASH="96x16:hang"))
    out, pid, deadline = [], None, time.time() + 60
    for line in proc.stdout:                        # wait until the first point is done
        out.append(line)
        pid = pid or (re.search(r"worker started, pid (\d+)", line) or [None, None])[1]
        if line.startswith("[1/2]") or time.time() > deadline:
            break
    time.sleep(0.5)                                 # the second point hangs now
    proc.send_signal(signal.SIGTERM)
    out.append(proc.stdout.read())
    assert proc.wait(timeout=30) == 143, "".join(out)
    assert "stopped (SIGTERM)" in "".join(out)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)                        # the worker is gone too
    rows = read_csv(csv_path)
    assert [(r["seqlen"], r["status"]) for r in rows] == [("64", "ok")]


def test_in_process_mode(stand_ins, tmp_path):
    csv_path = str(tmp_path / "inproc.csv")
    proc = run_bench(TINY + ["--impls", "triton,interpret", "--seqlens", "64", "--dstates", "16", "--chunks", "32",
                             "--in-process", "--csv", csv_path], bench_env(stand_ins))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_csv(csv_path)
    assert [r["status"] for r in rows] == ["ok", "ok"] and float(rows[1]["rel_err"]) < 1e-2


# The summary, the README table and the plot, from known numbers -------------------------------

SYNTHETIC = [   # impl, L, dstate, chunk, status, ms, roofline_fraction
    ("triton", 1024, 64, 256, "ok", 1.0, 0.1), ("cutile", 1024, 64, 256, "ok", 0.5, 0.2),
    ("tilegym", 1024, 64, 256, "ok", 0.8, 0.15),
    ("triton", 1024, 128, 256, "ok", 1.0, 0.1), ("cutile", 1024, 128, 256, "ok", 1.25, 0.08),
    ("tilegym", 1024, 128, 256, "ok", 1.0, 0.1),
    ("triton", 1024, 128, 128, "ok", 0.75, 0.1), ("cutile", 1024, 128, 128, "ok", 0.625, 0.1),
    ("triton", 65536, 64, 256, "ok", 4.0, 0.1), ("cutile", 65536, 64, 256, "ok", 2.0, 0.3),
    ("tilegym", 65536, 64, 256, "ok", 5.0, 0.1), ("tilegym", 65536, 64, 128, "ok", 3.0, 0.1),
    ("triton", 65536, 128, 256, "ok", 6.0, 0.1), ("cutile", 65536, 128, 256, "ok", 4.0, 0.3),
    ("triton", 262144, 64, 256, "ok", 16.0, 0.1), ("cutile", 262144, 64, 256, "ok", 4.0, 0.5),
    ("triton", 262144, 128, 256, "crashed: CUDA error: an illegal memory access was encountered", None, None),
    ("cutile", 262144, 128, 256, "ok", 8.0, 0.4),
]


@pytest.fixture
def synthetic_csv(tmp_path):
    path = str(tmp_path / "synthetic.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["impl", "seqlen", "dstate", "chunk", "status", "ms", "roofline_fraction", "batch", "nheads",
                    "headdim", "ngroups", "dtype", "device"])
        for impl, L, n, chunk, status, ms, frac in SYNTHETIC:
            w.writerow([impl, L, n, chunk, status, "" if ms is None else ms, "" if frac is None else frac,
                        1, 80, 64, 1, "bfloat16", "Test GPU"])
    return path


def test_summary_numbers(synthetic_csv):
    s = plot.summary(synthetic_csv)
    assert s["chunk"] == 256 and s["points"] == 5
    # cutile over triton at chunk 256: 2.0, 0.8, 2.0, 1.5, 4.0 (256K x 128: Triton crashed)
    assert math.isclose(s["geomean_speedup"], (2.0 * 0.8 * 2.0 * 1.5 * 4.0) ** (1 / 5), rel_tol=1e-12)
    assert s["worst"] == {"seqlen": 1024, "dstate": 128, "speedup": 0.8}
    assert s["best"] == {"seqlen": 262144, "dstate": 64, "speedup": 4.0}
    assert s["slower_than_baseline"] == [s["worst"]]
    assert s["below_target_long"] == [{"seqlen": 65536, "dstate": 128, "speedup": 1.5}]
    assert s["not_compared"] == [{"seqlen": 262144, "dstate": 128, "cutile": "ok", "triton": "crashed"}]
    # each at its best chunk: 1K x 128 becomes 0.75 / 0.625 = 1.2
    assert math.isclose(s["geomean_speedup_best_chunks"], (2.0 * 1.2 * 2.0 * 1.5 * 4.0) ** (1 / 5), rel_tol=1e-12)
    # cutile vs TileGym, each at its best chunk
    assert [(p["seqlen"], p["dstate"], p["subject_chunk"], p["peer_chunk"]) for p in s["vs_peer"]] == [
        (1024, 64, 256, 256), (1024, 128, 128, 256), (65536, 64, 256, 128)]
    assert [p["speedup"] for p in s["vs_peer"]] == pytest.approx([1.6, 1.6, 1.5])
    assert math.isclose(s["geomean_vs_peer"], (1.6 * 1.6 * 1.5) ** (1 / 3), rel_tol=1e-12)
    assert s["roofline_seqlen"] == 262144 and s["roofline_fraction"] == {64: 0.5, 128: 0.4}
    assert "geometric mean" in report.summary_text(s)


def test_markdown_table(synthetic_csv):
    md = subprocess.run([sys.executable, *PLOT, synthetic_csv, "--markdown"], capture_output=True, text=True,
                        check=True).stdout
    lines = md.splitlines()
    assert "| L | dstate | triton ms | tilegym ms | cutile ms | vs triton | vs tilegym | cutile roofline |" in lines
    assert "| 1K | 64 | 1.000 | 0.800 | 0.500 | 2.00x | 1.60x | 20% |" in lines
    assert "| 256K | 128 | crashed | - | 8.000 | - | - | 40% |" in lines
    assert "| 1K | 128 | 0.750 (128) | 1.000 (256) | 0.625 (128) | 1.20x | 1.60x | 10% |" in lines   # best chunks


def test_plot_cli_with_partial_data(synthetic_csv, tmp_path):
    out = str(tmp_path / "speedup.png")
    subprocess.run([sys.executable, *PLOT, synthetic_csv, "--out", out], check=True, capture_output=True,
                   env=dict(os.environ, MPLBACKEND="Agg"))
    assert os.path.getsize(out) > 10_000
    only_cutile = [r for r in report.load(synthetic_csv) if r["impl"] == "cutile"]     # nothing to compare
    plot.plot(only_cutile, str(tmp_path / "partial.png"))
    assert os.path.getsize(tmp_path / "partial.png") > 10_000


# The H200 script, as a dry run on the CPU --------------------------------------------------------

def test_run_h200_script_dry_run(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, OUT=str(out), BENCH_WORK=str(work), IMPLS="interpret", SEQLENS="64,128",
               DSTATES="16", SWEEP_CHUNKS="32,256", MPLBACKEND="Agg",
               EXTRA_ARGS="--device cpu --nheads 2 --headdim 16 --warmup-ms 1 --rep-ms 2 --quiet-workers")
    proc = subprocess.run(["bash", os.path.join(HERE, "run_h200.sh")], capture_output=True,
                          text=True, env=env, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "=== grid_chunk256: complete" in proc.stdout and "=== grid_chunks: complete" in proc.stdout
    for name in ("grid_chunk256", "grid_chunks"):
        for ext in ("csv", "log", "png", "md"):
            assert (out / f"{name}.{ext}").stat().st_size > 0, (name, ext)
    assert len(read_csv(out / "grid_chunk256.csv")) == 2
    sweep = read_csv(out / "grid_chunks.csv")
    assert sorted((r["seqlen"], r["chunk"], r["status"]) for r in sweep) == [
        ("128", "256", "ok"), ("128", "32", "ok"), ("64", "256", "ok"), ("64", "32", "ok")]
    # the sweep took the chunk-256 rows over from the grid and ran only the chunk-32 points
    assert "2 rows kept, 2 points to run" in (out / "grid_chunks.log").read_text()


def test_warm_compile_covers_every_search_space_config():
    """The warm-up list holds each kernel's whole search space for every (dstate, seqlen) that
    specializes differently, chunk_cumsum once per seqlen (it never sees dstate)."""
    import argparse
    import torch
    from ops.forward import KERNELS
    from tests.benchmark import warm_compile
    args = argparse.Namespace(batch=1, dstates=[64, 256], seqlens=[1024, 16384], nheads=80, headdim=64,
                              ngroups=1, chunks=[128, 256], tilegym=True, tilegym_parts=2,
                              kernels=list(KERNELS))
    tasks = warm_compile._tasks(args)
    for name, module in KERNELS.items():
        for dstate in (64, 256):
            for chunk in (128, 256):
                shape = dict(batch=1, seqlen=16384, nheads=80, headdim=64, ngroups=1, dstate=dstate,
                             chunk_size=chunk, dtype=torch.bfloat16, states_dtype=torch.bfloat16)
                listed = [cfg for n, L, d, c, cfg in tasks if n == name and L == 16384 and c == chunk
                          and (d == dstate or name == "chunk_cumsum")]
                assert all(cfg in listed for cfg in module.search_space(**shape))
    assert sum(1 for n, L, d, c, _ in tasks if n == "chunk_cumsum" and d == 256) == 0
    # TileGym: one call per (seqlen, dstate, chunk) and slice of its config lists, first
    assert tasks[:16] == [("tilegym", L, d, c, (part, 2)) for c in (128, 256) for d in (64, 256)
                          for L in (1024, 16384) for part in (0, 1)]
    assert all(t[0] != "tilegym" for t in tasks[16:])
    # --kernels keeps only the kernels named; none at all leaves TileGym's calls alone
    args.kernels = ["fwd_pass_state"]
    assert {t[0] for t in warm_compile._tasks(args)} == {"tilegym", "fwd_pass_state"}
    args.kernels, args.tilegym = [], False
    assert warm_compile._tasks(args) == []


def test_warm_compile_jobs_put_the_first_lengths_first_in_small_batches():
    """A warm-up cut short by its limit has compiled the grid's first lengths: our variants go
    out in order, a few per job, shorter lengths first; each TileGym slice is a job of its own
    (so one shape's slices compile side by side), before everything else."""
    import argparse
    from ops.forward import KERNELS
    from tests.benchmark import warm_compile
    args = argparse.Namespace(batch=1, dstates=[64, 128], seqlens=[1024, 16384], nheads=80, headdim=64,
                              ngroups=1, chunks=[128, 256], tilegym=True, tilegym_parts=3,
                              kernels=list(KERNELS))
    jobs, total = warm_compile._jobs([args], gpu=None)
    assert total == len(warm_compile._tasks(args)) == sum(len(tasks) for tasks, _ in jobs)
    searches = [tasks for tasks, _ in jobs if tasks[0][0] == "tilegym"]
    assert all(len(t) == 1 for t in searches) and len(searches) == 2 * 2 * 2 * 3
    assert [tasks for tasks, _ in jobs[:len(searches)]] == searches
    ours = [t for tasks, _ in jobs[len(searches):] for t in tasks]
    assert all(len(tasks) <= warm_compile.JOB_SIZE for tasks, _ in jobs)
    lengths = [t[1] for t in ours]
    assert lengths == sorted(lengths) and set(lengths) == {1024, 16384}


def test_warm_compile_compiles_at_the_chunk_the_forward_computes_with(monkeypatch):
    """The benchmark's calls at chunk 256 compute at 128 on an H200 where ops/tuning/compute_chunk.py
    says so: the warm-up compiles there, once per chunk, dstate and specialization, on the
    shortest listed length that specializes alike; MAMBA2_CUTILE_COMPUTE_CHUNK=caller (the chunk
    sweep) keeps the callers' chunks; with no GPU the callers' chunks are all there is."""
    import argparse
    from ops.tuning import compute_chunk
    from tests.benchmark import warm_compile
    args = argparse.Namespace(batch=1, dstates=[64, 128, 256, 512], seqlens=[1024, 4096, 16384, 262144],
                              nheads=80, headdim=64, ngroups=1, chunks=[256], tilegym=False, tilegym_parts=1,
                              kernels=["chunk_cumsum", "compute_out"])
    monkeypatch.delenv(compute_chunk.ENV, raising=False)
    assert [s[:4] for s in warm_compile._shapes(args, "NVIDIA H200")] == [
        (1024, 1024, 64, 256), (1024, 1024, 128, 256), (1024, 1024, 256, 256), (1024, 1024, 512, 256),
        (4096, 4096, 64, 128), (4096, 4096, 128, 128), (4096, 4096, 256, 128), (4096, 4096, 512, 256),
        (4096, 262144, 256, 256),           # 256K x 256: its entry states at 128 would pass 2**31
        (4096, 262144, 512, 256)]           # 256K x 512: 64-bit indices, forced on 4K's inputs
    assert [s[4] for s in warm_compile._shapes(args, "NVIDIA H200")] == [False] * 9 + [True]
    tasks = warm_compile._tasks(args, "NVIDIA H200")
    assert sorted({(L, c) for n, L, d, c, _ in tasks if n == "chunk_cumsum"}) == [(1024, 256), (4096, 128), (4096, 256)]
    import torch
    from ops.kernels.compute_out import search_space
    at = lambda L: search_space(batch=1, seqlen=L, nheads=80, headdim=64, ngroups=1, dstate=512, chunk_size=256,
                                dtype=torch.bfloat16, states_dtype=torch.bfloat16)
    assert len(at(262144)) < len(at(4096))          # the 64-bit kernel's space is narrower
    from ops.tuning.configs import unique
    listed = [cfg for n, L, d, c, cfg in tasks if n == "compute_out" and (L, d, c) == (4096, 512, 256)]
    assert listed == at(4096) + unique([{**cfg, "INDEX64": True} for cfg in at(262144)])
    caller = [(L, L, d, 256) for L in (1024, 4096) for d in args.dstates] + [(4096, 262144, 512, 256)]
    assert [s[:4] for s in warm_compile._shapes(args, None)] == caller
    monkeypatch.setenv(compute_chunk.ENV, "caller")
    assert [s[:4] for s in warm_compile._shapes(args, "NVIDIA H200")] == caller


def test_warm_compile_slices_tilegym_config_lists(monkeypatch):
    """Each warm-up process sees every n-th of TileGym's configs, forward and backward (a fake
    TileGym module stands in), and TileGym's own functions are restored afterwards."""
    import types
    import torch
    from tests.benchmark import warm_compile
    seen = {}
    fake = types.ModuleType("tilegym.ops.cutile.mamba2")
    fake._chunk_cumsum_autotune_configs = lambda num_heads: iter(range(5))
    fake._fwd_pass_state_autotune_configs = lambda *a, **k: iter(range(7))
    fake._compute_out_configs = lambda *a: iter(range(3))
    fake._compute_out_swap_configs = lambda *a: iter(range(3))
    fake._bwd_pass_state_autotune_configs = lambda *a: iter(range(6))
    fake._compute_dd_dcb_dx_autotune_configs = lambda *a, **k: iter(range(4))
    fake._compute_da_db_dc_ddt_autotune_configs = lambda *a: iter(range(2))
    fake._chunk_cumsum_tune_cache = {"old": 1}
    fake._bwd_pass_state_tune_cache = {}
    originals = {n: getattr(fake, n) for n in warm_compile.TILEGYM_CONFIG_LISTS}

    def forward(*args, chunk_size):
        seen["cumsum"] = fake._chunk_cumsum_autotune_configs(num_heads=4)
        seen["state"] = fake._fwd_pass_state_autotune_configs(64, 64, chunk_size)
        seen["out"] = fake._compute_out_configs(64, 64)
    fake.mamba2_chunk_forward = forward
    for name in ("tilegym", "tilegym.ops", "tilegym.ops.cutile"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "tilegym.ops.cutile.mamba2", fake)
    inp = dict(x=torch.randn(1, 8, 2, 4), dt=torch.randn(1, 8, 2), dt_bias=torch.randn(2), A=None,
               B=torch.randn(1, 8, 1, 4), C=None, D=None)
    monkeypatch.setattr(torch, "zeros", lambda *s, **k: None)      # no CUDA here
    warm_compile._tilegym_forward(inp, 4, part=1, nparts=3)
    assert seen == {"cumsum": [1, 4], "state": [1, 4], "out": [1]}
    assert fake._chunk_cumsum_tune_cache == {}
    assert all(getattr(fake, n) is f for n, f in originals.items())
    warm_compile._tilegym_forward(inp, 4, part=4, nparts=5)       # an empty slice: the first config
    assert seen["out"] == [0] and seen["state"] == [4]
    # the backward's lists too (fwd_bwd.py warms TileGym's backward so); a slice's winners are
    # dropped afterwards, so the timed search is not served from them
    with warm_compile.tilegym_configs_sliced(1, 3):
        assert list(fake._bwd_pass_state_autotune_configs(64, 64)) == [1, 4]
        assert list(fake._compute_dd_dcb_dx_autotune_configs(64, 64)) == [1]
        assert list(fake._compute_da_db_dc_ddt_autotune_configs(64, 64)) == [1]
        fake._bwd_pass_state_tune_cache["shape"] = "a slice's winner"
    assert fake._bwd_pass_state_tune_cache == {}
    assert all(getattr(fake, n) is f for n, f in originals.items())


def test_warm_compile_takes_the_batch_and_models_warm_every_model():
    """--batch reaches the search spaces (fwd_pass_state's depends on it); models.py --warm asks for
    our kernels at cutile's chunks and TileGym's configs at its own, per model shape."""
    import torch
    from ops.forward import KERNELS
    from tests.benchmark import models, warm_compile
    sets = models.warm_arg_sets(models.MODELS.values(), ["triton", "cutile", "tilegym"], models.IMPL_CHUNKS,
                                [256], procs=4)
    assert len(sets) == 2 * len(models.MODELS)
    for (name, shape), ours, tilegym in zip(models.MODELS.items(), sets[::2], sets[1::2]):
        for a in (ours, tilegym):
            assert (a.batch, a.seqlens, a.nheads, a.headdim, a.ngroups, a.dstates) == (
                shape["batch"], [shape["seqlen"]], shape["nheads"], shape["headdim"], shape["ngroups"],
                [shape["dstate"]]), name
        assert (ours.chunks, ours.tilegym, ours.kernels) == ([64, 128, 256], False, list(KERNELS))
        assert (tilegym.chunks, tilegym.tilegym, tilegym.kernels) == ([64], True, [])
    hybrid = sets[-2]                                  # 8b-hybrid-layer: batch 2
    listed = [cfg for n, L, d, c, cfg in warm_compile._tasks(hybrid) if n == "fwd_pass_state" and c == 64]
    space = lambda batch: list(KERNELS["fwd_pass_state"].search_space(
        batch=batch, seqlen=8192, nheads=128, headdim=64, ngroups=8, dstate=128, chunk_size=64,
        dtype=torch.bfloat16, states_dtype=torch.bfloat16))
    assert listed == space(2) and space(2) != space(1)
    assert models.warm_arg_sets(models.MODELS.values(), ["triton"], models.IMPL_CHUNKS, [256], 4) == []


def test_ncu_summary_reads_the_raw_page(tmp_path):
    """ncu_summary.py on a small raw-page CSV in ncu's layout: header, units, one row per launch."""
    from ops.results import ncu_summary
    header = ["ID", "Kernel Name", "gpu__time_duration.sum",
              "sm__throughput.avg.pct_of_peak_sustained_elapsed",
              "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
              "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
              "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]
    units = ["", "", "msecond", "%", "%", "%", "register/thread", "ratio", "ratio", "ratio"]
    rows = [["0", "compute_out_kernel", "4.5", "35.2", "48.0", "22.1", "168", "6.0", "1.0", "3.0"],
            ["1", "fwd_pass_state_kernel", "1,200", "10", "30", "12", "128", "0", "", "2"]]
    path = tmp_path / "raw.csv"
    with open(path, "w", newline="") as f:
        f.write("==PROF== Disconnected from process 1\n")
        csv.writer(f).writerows([header, units] + rows)
    recs = ncu_summary.read(path)
    assert [r["name"] for r in recs] == ["compute_out_kernel", "fwd_pass_state_kernel"]
    assert recs[0]["duration_us"] == 4500.0 and recs[1]["duration_us"] == 1200.0 * 1e3
    assert recs[0]["stalls"] == {"long_scoreboard": 6.0, "barrier": 1.0, "wait": 3.0}
    assert recs[1]["stalls"] == {"wait": 2.0}
    lines = ncu_summary.summary_lines(recs, top=2)
    assert "4500.0 us; SM 35% memory 48% of peak; occupancy 22%" in lines[0]
    assert lines[1].strip() == "stalls per issued instruction: long_scoreboard 6.0 (60%), wait 3.0 (30%)"
    assert "theoretical -%" in lines[0]           # a metric the CSV lacks


def test_merge_results_later_runs_win_point_by_point(tmp_path):
    from tests.benchmark import merge_results
    shape = {"batch": 1, "nheads": 80, "headdim": 64, "ngroups": 1, "dtype": "bfloat16"}
    header = ["impl", "seqlen", "dstate", "chunk", "ms", "started_at", *shape]

    def write(name, rows):
        path = tmp_path / name
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows(row + list(shape.values()) for row in rows)
        return str(path)

    first = write("first.csv", [["triton", 1024, 64, 256, 0.5, "t1"], ["cutile", 1024, 64, 256, 0.2, "t1"],
                                ["triton", 4096, 64, 256, 0.6, "t1"]])
    second = write("second.csv", [["cutile", 4096, 64, 256, 0.3, "t2"], ["triton", 4096, 64, 256, 0.7, "t2"]])
    out = tmp_path / "merged.csv"
    merge_results.main([str(out), first, second])
    rows = [(r["impl"], r["seqlen"], r["ms"], r["started_at"]) for r in csv.DictReader(open(out))]
    assert rows == [("triton", "1024", "0.5", "t1"), ("triton", "4096", "0.7", "t2"),
                    ("cutile", "1024", "0.2", "t1"), ("cutile", "4096", "0.3", "t2")]
    other = tmp_path / "other.csv"
    other.write_text("impl,seqlen,dstate,chunk,ms\ntriton,1024,64,256,0.5\n")
    with pytest.raises(ValueError, match="columns differ"):
        merge_results.merge([first, str(other)])


def test_run_h200_script_shares_lengths_over_gpus(tmp_path):
    """GPUS=0,1: one run per GPU at the same time (here two CPU processes), merged into one CSV."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, OUT=str(out), BENCH_WORK=str(work), IMPLS="interpret", SEQLENS="64,128",
               DSTATES="16", GPUS="0,1", MPLBACKEND="Agg",
               EXTRA_ARGS="--device cpu --nheads 2 --headdim 16 --warmup-ms 1 --rep-ms 2 --quiet-workers")
    proc = subprocess.run(["bash", os.path.join(HERE, "run_h200.sh"), "grid"], capture_output=True,
                          text=True, env=env, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPU 0: L = 128" in proc.stdout and "GPU 1: L = 64" in proc.stdout, proc.stdout
    assert "=== grid_chunk256: complete" in proc.stdout
    assert sorted(r["seqlen"] for r in read_csv(work / "gpu0" / "grid_chunk256.csv")) == ["128"]
    assert sorted(r["seqlen"] for r in read_csv(work / "gpu1" / "grid_chunk256.csv")) == ["64"]
    merged = read_csv(out / "grid_chunk256.csv")
    assert sorted((r["seqlen"], r["status"]) for r in merged) == [("128", "ok"), ("64", "ok")]
    for gpu in (0, 1):
        assert (out / f"grid_chunk256.gpu{gpu}.log").stat().st_size > 0


def test_merge_results_shares_lengths_longest_first():
    from tests.benchmark import merge_results
    assert merge_results.share("1K,4K,16K,64K,256K", "0,1") == [("0", ["256K"]), ("1", ["1K", "4K", "16K", "64K"])]
    assert merge_results.share("16K,64K,256K", "0,1,2,3") == [("0", ["256K"]), ("1", ["64K"]), ("2", ["16K"])]
    assert merge_results.share("64,128", "0") == [("0", ["64", "128"])]
    with pytest.raises(ValueError):
        merge_results.share("", "0")


# Each implementation at its own chunks (--impl-chunks) ------------------------------------------

def test_impl_chunks_are_checked(capsys):
    from tests.benchmark import bench_forward as bf
    a = bf.parse_args(["--impls", "triton,cutile,tilegym", "--chunks", "64,128",
                       "--impl-chunks", "tilegym=64, triton=128:256"])
    assert a.impl_chunks == {"tilegym": [64], "triton": [128, 256]}
    assert [bf.chunks_of(a, i) for i in a.impls] == [[128, 256], [64, 128], [64]]
    for bad, why in (("nope=64", "unknown implementation 'nope'"), ("triton=96", "96 is not a power of two"),
                     ("triton=0", "0 is not a power of two"), ("triton", "not IMPL=CHUNK"),
                     ("triton=x", "must be integers"), ("triton=64,triton=128", "named twice")):
        with pytest.raises(SystemExit):
            bf.parse_args(["--impl-chunks", bad])
        err = capsys.readouterr().err
        assert "--impl-chunks" in err and why in err, (bad, err)


def test_impl_chunks_give_each_implementation_its_own_chunks(stand_ins, tmp_path):
    """Implementations at different chunk sets: each marks its own best chunk, the baseline is Triton
    at its largest chunk (it has no 256), and the closing tables show each at its best."""
    csv_path = str(tmp_path / "own.csv")
    proc = run_bench(TINY + ["--impls", "triton,tilegym,interpret", "--seqlens", "64", "--dstates", "16",
                             "--chunks", "32", "--impl-chunks", "interpret=16:32,tilegym=16,triton=32:64",
                             "--csv", csv_path, "--quiet-workers"], bench_env(stand_ins))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_csv(csv_path)
    assert sorted((r["impl"], int(r["chunk"])) for r in rows) == [
        ("interpret", 16), ("interpret", 32), ("tilegym", 16), ("triton", 32), ("triton", 64)]
    assert all(r["status"] == "ok" for r in rows)
    for impl in ("triton", "tilegym", "interpret"):
        mine = [r for r in rows if r["impl"] == impl]
        assert [r["best_chunk"] for r in mine].count("True") == 1, mine
        fastest = min(mine, key=lambda r: float(r["ms"]))
        assert fastest["best_chunk"] == "True"
    for r in rows:
        expected = "(baseline)" if (r["impl"], r["chunk"]) == ("triton", "64") else "triton/64"
        assert r["rel_err_vs"] == expected, r
        assert r["rel_err_vs"] == "(baseline)" or float(r["rel_err"]) < 1e-2
    assert "chunk 32 (interpret 16,32, tilegym 16, triton 32,64)" in proc.stdout
    best_table = proc.stdout.split("each implementation at its best chunk")[1]
    assert re.search(r"^64\s+16\s+[\d.]+ \((32|64)\)\s+[\d.]+ \(16\)\s+[\d.]+ \((16|32)\)", best_table, re.MULTILINE), best_table


# The model shapes (models.py), as a dry run on the CPU --------------------------------------------

MODELS_DRY = ["--models", "mamba2-130m-train,8b-hybrid-layer", "--scale-down", "64", "--device", "cpu",
              "--impls", "reference,interpret", "--chunks", "16,32", "--impl-chunks", "interpret=32",
              "--warmup-ms", "1", "--rep-ms", "2", "--quiet-workers"]


def run_models(args, env, timeout=180):
    return subprocess.run([sys.executable, "-m", "tests.benchmark.models"] + args, capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def models_run(stand_ins, tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    out, slices = str(folder / "models.csv"), str(folder / "slices")
    proc = run_models(MODELS_DRY + ["--out", out, "--slices", slices], bench_env(stand_ins))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(proc=proc, out=out, slices=slices)


def test_models_rows_per_model_implementation_and_chunk(models_run):
    from tests.benchmark import models
    from tests.benchmark.bench_forward import CSV_COLUMNS
    with open(models_run["out"], newline="") as f:
        header = next(csv.reader(f))
    assert header[0] == "model" and header[1:len(CSV_COLUMNS) + 1] == CSV_COLUMNS
    rows = read_csv(models_run["out"])
    assert sorted((r["model"], r["impl"], int(r["chunk"])) for r in rows) == sorted(
        (m, impl, c) for m in ("mamba2-130m-train", "8b-hybrid-layer")
        for impl, c in (("reference", 16), ("reference", 32), ("interpret", 32)))
    for r in rows:
        shape = models.scaled(models.MODELS[r["model"]], 64)
        assert {k: int(r[k]) for k in shape} == shape and r["dtype"] == "bfloat16"
        assert r["status"] == "ok" and r["rel_err_vs"] in ("(baseline)", "reference/32"), r
    assert models.scaled(models.MODELS["8b-hybrid-layer"], 64)["ngroups"] == 8   # groups are kept
    for m in ("mamba2-130m-train", "8b-hybrid-layer"):
        for impl in ("reference", "interpret"):
            marks = [r["best_chunk"] for r in rows if (r["model"], r["impl"]) == (m, impl)]
            assert marks.count("True") == 1, (m, impl, marks)
    out = models_run["proc"].stdout
    table = out.split("each implementation at its best chunk (ms")[1]
    assert "mamba2-130m-train" in table and "8b-hybrid-layer" in table and "cutile vs tilegym" in table
    assert "1 x 128, 8 heads x 16, 8 groups, dstate 16" in table


def test_models_resume_skips_what_is_done(models_run, stand_ins, tmp_path):
    out = str(tmp_path / "resumed.csv")
    with open(models_run["out"]) as f:
        text = f.read()
    with open(out, "w") as f:
        f.write(text)
    proc = run_models(MODELS_DRY + ["--out", out, "--resume"], bench_env(stand_ins))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("points are in") == 2 and "worker started" not in proc.stdout
    with open(out) as f:
        assert f.read() == text
    # one point missing: only that one runs, in its model's run; the other model is skipped
    rows = read_csv(out)
    kept = [r for r in rows if (r["model"], r["impl"]) != ("8b-hybrid-layer", "interpret")]
    report.write_csv(out, kept)
    proc = run_models(MODELS_DRY + ["--out", out, "--resume", "--slices", models_run["slices"]], bench_env(stand_ins))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "=== mamba2-130m-train: all 3 points are in" in proc.stdout
    assert "=== 8b-hybrid-layer: 1 x 128" in proc.stdout and "2 rows kept, 1 points to run" in proc.stdout
    assert proc.stdout.count("worker started") == 1
    again = read_csv(out)
    assert len(again) == len(rows)
    assert [r for r in again if r["model"] == "mamba2-130m-train"] == [r for r in rows if r["model"] == "mamba2-130m-train"]
    new = [r for r in again if (r["model"], r["impl"]) == ("8b-hybrid-layer", "interpret")]
    # compared with the baseline's output of the first run (kept in --slices)
    assert len(new) == 1 and new[0]["status"] == "ok" and new[0]["rel_err_vs"] == "reference/32"


def test_models_rejects_what_the_models_set(capsys):
    from tests.benchmark import models
    for argv, expected in ((["--nheads", "4"], "--nheads is set by each model"),
                           (["--seqlens", "1K"], "--seqlens is set by each model"),
                           (["--csv", "x.csv"], "--csv"),
                           (["--impl-chunks", "tilegym=3"], "--impl-chunks: tilegym: chunk 3 is not a power of two"),
                           (["--models", "mamba2-9b"], "--models: unknown mamba2-9b")):
        with pytest.raises(SystemExit):
            models.parse_args(argv)
        assert expected in capsys.readouterr().err, argv
    a = models.parse_args(["--models", "8b-hybrid-layer", "mamba2-130m-train", "--impl-chunks", "cutile=128",
                           "--impls", "cutile,triton"])
    assert a.models == ["8b-hybrid-layer", "mamba2-130m-train"]
    assert a.impl_chunks == {"cutile": [128], "triton": [128, 256], "tilegym": [64]}
    assert a.passthrough == ["--impls", "cutile,triton"]


def test_config_sweep_dry_run(tmp_path, capsys):
    """config_sweep on the CPU (the interpreter): the defaults and each variant, one row each,
    outputs compared with the default's (C B^T read from memory computes the same sums: within
    float32 rounding of theirs); a variant with an unknown key is reported and has no row."""
    from tests.benchmark import config_sweep
    out = str(tmp_path / "sweep.csv")
    rows = config_sweep.main(["--device", "cpu", "--shapes", "1x64x4:16:2:16", "--chunks", "32",
                              "--what", "step", "--rounds", "1", "--out", out,
                              "--variant", "bwd_compute_out:SCORES_IN_MEMORY=true,BLOCK_T=16",
                              "--variant", "fwd_pass_state:NOT_A_KEY=3"])
    assert [r["variant"] for r in rows] == ["default",
                                            "bwd_compute_out:SCORES_IN_MEMORY=true,BLOCK_T=16"]
    assert rows[0]["max_rel_diff"] == 0 and 0 <= rows[1]["max_rel_diff"] < 1e-5
    assert all(r["ms"] > 0 and r["what"] == "step" and r["dstate"] == 16 for r in rows)
    printed = capsys.readouterr().out
    assert "fwd_pass_state:NOT_A_KEY=3: FAILED ValueError: unknown config keys" in printed
    assert [r["variant"] for r in read_csv(out)] == [r["variant"] for r in rows]


def test_config_sweep_checks_its_arguments(capsys):
    from tests.benchmark import config_sweep
    for argv, expected in ((["--variant", "compute_out"], "expected KERNEL:KEY=VALUE"),
                           (["--variant", "no_kernel:A=1"], "expected KERNEL:KEY=VALUE"),
                           (["--variant", "compute_out:BLOCK_M"], "is not KEY=VALUE"),
                           (["--variant", "compute_out:BLOCK_M=big"], "expected an int"),
                           (["--shapes", "1x2"], "expected a model name"),
                           (["--device", "cpu", "--rounds", "0"], "--rounds must be at least 1")):
        with pytest.raises(SystemExit):
            config_sweep.main(argv)
        assert expected in capsys.readouterr().err, argv


def test_host_breakdown_counts_a_taped_steps_parts(monkeypatch):
    """host_time.host_breakdown on the CPU: a small taped training step (the interpreter's launches
    stubbed out, whose torch ops would be the interpreter's, not the step's) is counted per step as
    its two tapes recorded it -- each launch, each allocation, each sum -- with one replay key per
    pass, and the functions it marks are the originals again afterwards."""
    from collections import Counter

    import torch

    from ops import interpreter, mamba_chunk_scan_combined
    from ops.runtime import tape
    from reference.problems import make_problem
    from tests.benchmark import host_time
    monkeypatch.setattr(interpreter, "launch", lambda grid, kernel, args: None)
    monkeypatch.setattr(tape, "_TAPES", {})
    p = make_problem(batch=1, seqlen=128, nheads=4, headdim=16, ngroups=1, dstate=16, D="1d",
                     z=False, initial_states=False, dtype=torch.bfloat16, seed=1)
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in p.items()}
    dout = torch.randn_like(p["x"])

    def step():
        for t in leaves.values():
            t.grad = None
        mamba_chunk_scan_combined(**leaves, chunk_size=32, dt_softplus=True,
                                  backend="interpret").backward(dout)

    def marked_functions():
        return [getattr(*host_time.marked_place(module_name, attribute))
                for module_name, attribute, _ in host_time.MARKED]
    before = marked_functions()
    parts, seconds = host_time.host_breakdown(step, calls=3, warmup=2)
    assert marked_functions() == before
    count = {name: c for name, _, c in parts}
    recorded = Counter("launch" if s[0] == tape._LAUNCH else str(s[1])
                       for t in tape._TAPES.values() for s in t.steps)
    assert len(tape._TAPES) == 2 and recorded["launch"] == 8
    assert count["tape replays (their own Python)"] == 2 and count["replay keys"] == 2
    assert count["kernel launches"] == recorded["launch"]
    assert count["aten::empty"] == recorded["aten.empty.memory_format"]
    assert count["aten::sum"] == recorded["aten.sum.dim_IntList"]
    assert count[host_time.STEP_RANGE] == 1
    assert seconds > 0 and sum(s for _, s, _ in parts) <= seconds * 1.01


def test_fwd_bwd_models_alone_means_every_model():
    from tests.benchmark import fwd_bwd
    from tests.benchmark.models import MODELS
    assert fwd_bwd.model_names([], grid=True) == sorted(MODELS)       # --models --grid
    assert fwd_bwd.model_names(None, grid=True) == []                 # --grid alone
    assert fwd_bwd.model_names(None, grid=False) == sorted(MODELS)
    assert fwd_bwd.model_names(["8b-hybrid-layer"], grid=True) == ["8b-hybrid-layer"]


def test_fwd_bwd_replots_a_run_without_a_gpu(tmp_path):
    """fwd_bwd --replot draws --plot from an earlier run's CSV: each implementation's eager
    speedup and, where the run timed CUDA-graph replays, Triton's graphed time over its own
    (NaN where a row has none); without --plot it is refused."""
    from tests.benchmark import fwd_bwd
    rows = [dict(shape="s1", impl="triton", chunk=256, fwd_bwd_ms=4.0, graph_ms=2.0, speedup=1.0),
            dict(shape="s1", impl="cutile", chunk=256, fwd_bwd_ms=2.0, graph_ms=1.6, speedup=2.0),
            dict(shape="s2", impl="triton", chunk=256, fwd_bwd_ms=3.0, graph_ms="", speedup=1.0),
            dict(shape="s2", impl="cutile", chunk=256, fwd_bwd_ms=2.0, graph_ms=1.0, speedup=1.5)]
    path = tmp_path / "run.csv"
    report.write_csv(path, [dict(r, device="GPU X") for r in rows])
    loaded = report.load(path)
    assert fwd_bwd._graph_speedup(loaded, loaded[1]) == pytest.approx(1.25)
    assert math.isnan(fwd_bwd._graph_speedup(loaded, loaded[3]))     # Triton's not graphed
    png = tmp_path / "run.png"
    fwd_bwd.main(["--replot", str(path), "--plot", str(png)])
    assert png.stat().st_size > 10_000
    with pytest.raises(SystemExit):
        fwd_bwd.main(["--replot", str(path)])


def test_memory_probe_finds_what_is_alive_at_the_peak():
    """memory_probe replays an allocator trace: the peak (bytes above the trace's start) and
    the blocks alive at it, largest first, each named by its innermost frame in this project; a
    block freed before the peak is not among them, and a free of a block allocated before the
    trace began is ignored."""
    from tests.benchmark.memory_probe import ROOT, live_at_peak, origin
    frame = lambda f, line, name: dict(filename=f, line=line, name=name)
    ours = [frame("/usr/lib/site-packages/mamba_ssm/ops/x.py", 1, "empty"),
            frame(os.path.join(ROOT, "ops", "kernels", "common.py"), 60, "new_output")]
    trace = [dict(action="free_requested", addr=9, size=50),          # from before the trace
             dict(action="alloc", addr=1, size=100, frames=ours),
             dict(action="alloc", addr=2, size=30, frames=[]),
             dict(action="free_requested", addr=2, size=30),
             dict(action="free_completed", addr=2, size=30),
             dict(action="alloc", addr=3, size=40, frames=ours[1:]),
             dict(action="alloc", addr=4, size=500, frames=ours),
             dict(action="free_completed", addr=4, size=500),          # no free_requested
             dict(action="alloc", addr=5, size=10)]
    peak, alive = live_at_peak(trace)
    assert peak == 640 and [e["addr"] for e in alive] == [4, 1, 3]
    assert origin(alive[0]) == "ops/kernels/common.py:60 new_output" and origin(trace[2]) == "?"
    caller = frame(os.path.join(ROOT, "ops", "backward.py"), 7, "ssd_backward")
    chain = dict(frames=[*ours, frame("/usr/lib/python3.12/x.py", 2, "call"), caller])
    assert origin(chain, depth=4) == "ops/kernels/common.py:60 new_output < ops/backward.py:7 ssd_backward"
    assert origin(chain, depth=1) == "ops/kernels/common.py:60 new_output"


def test_memory_probe_checks_its_shape(capsys):
    from tests.benchmark import memory_probe
    with pytest.raises(SystemExit):
        memory_probe.main(["--shape", "8x2048"])
    assert "--shape must be batch x seqlen x nheads x ngroups" in capsys.readouterr().err


def test_fwd_bwd_resumes_an_earlier_run_shape_by_shape(tmp_path):
    """--resume keeps an earlier CSV's shapes whose every run it holds (and its rows of shapes
    not asked for), runs the rest, a shape measured in part again whole; a CSV made with --graph
    the other way is refused, and so is one whose TileGym rows have no bare_ms column (made
    before TileGym's rows were a training step; its other rows are still good)."""
    from ops.results.report import write_csv
    from tests.benchmark import fwd_bwd
    shape = dict(batch=1, seqlen=4096, nheads=80, headdim=64, ngroups=1, dstate=64)
    shapes = [("a", shape), ("b", shape), ("c", shape)]
    row = lambda name, impl, chunk: dict(shape=name, impl=impl, chunk=chunk, fwd_bwd_ms=1.5,
                                         bare_ms=0.5 if impl == "tilegym" else float("nan"),
                                         graph_ms=1.0)
    earlier = [row("a", "triton", 256), row("a", "cutile", 256), row("a", "tilegym", 64),
               row("b", "triton", 256), row("b", "cutile", 256),                # no TileGym
               row("z", "triton", 256)]                                         # not asked for
    path = tmp_path / "earlier.csv"
    write_csv(path, earlier)
    impls = ("triton", "cutile", "tilegym")
    kept, left = fwd_bwd.resumed(path, shapes, impls, [256], 64, graph=True)
    assert [name for name, _ in left] == ["b", "c"]
    assert sorted({r["shape"] for r in kept}) == ["a", "z"] and len(kept) == 4
    kept, left = fwd_bwd.resumed(path, shapes, ("triton", "cutile"), [256], 64, graph=True)
    assert [name for name, _ in left] == ["c"] and len(kept) == 6
    with pytest.raises(SystemExit, match="--graph"):
        fwd_bwd.resumed(path, shapes, impls, [256], 64, graph=False)
    write_csv(path, [{k: v for k, v in r.items() if k != "bare_ms"} for r in earlier])
    with pytest.raises(SystemExit, match="TileGym rows have no bare_ms"):
        fwd_bwd.resumed(path, shapes, impls, [256], 64, graph=True)
    write_csv(path, [{k: v for k, v in r.items() if k != "bare_ms"} for r in earlier
                     if r["impl"] != "tilegym"])                     # no TileGym rows: kept
    kept, left = fwd_bwd.resumed(path, shapes, ("triton", "cutile"), [256], 64, graph=True)
    assert [name for name, _ in left] == ["c"] and len(kept) == 5


def test_fwd_bwd_times_tilegym_in_a_training_step():
    """fwd_bwd's TileGym step is a training step like the others': its two functions in one
    autograd node (``TileGymScan``), dt's bias and softplus in PyTorch before it, so that every
    leaf -- x, dt, A, B, C, D, dt_bias -- gets the gradient of the same loss through the
    recurrence. On the CPU, the chunked reference stands in for TileGym's two functions (same
    signatures and result order as TileGym 1.5.1's). Float64 inputs; the processed dt is
    float32 on its way into the functions (TileGym's kernels take float32), hence 1e-6."""
    import torch

    from reference.chunked import ssd_chunked
    from tests.benchmark import fwd_bwd
    from tests.benchmark.bench_forward import make_inputs

    def forward(x, a, b, c, d, dt, init_state, chunk_size=64):
        assert dt.dtype == torch.float32 and init_state.dtype == torch.float32
        return ssd_chunked(x, dt.double(), a, b, c, chunk_size, D=d,
                           initial_states=init_state.double(), return_final_states=True)

    def backward(x, a, b, c, d, dt, init_state, dout, dfinal, chunk_size=64):
        leaves = [t.detach().requires_grad_() for t in (x, a, b, c, d, dt, init_state)]
        with torch.enable_grad():                   # (an autograd node's backward runs without)
            out, final = forward(*leaves, chunk_size=chunk_size)
        # TileGym's order: dx, da, db, dc, dd, ddt, dinit_state
        return torch.autograd.grad((out, final), leaves, (dout, dfinal.double()))

    inputs = {k: v.double() for k, v in make_inputs(torch, "cpu", 2, 64, 4, 8, 2, 16,
                                                      "float64").items()}
    dout = torch.randn(inputs["x"].shape, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(3))
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    step, forward_only, grads, bare = fwd_bwd._tilegym_step(16, leaves, dout, (forward, backward))
    step()
    got = grads()
    expected = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    out = ssd_chunked(*(expected[k] for k in ("x", "dt", "A", "B", "C")), 16, D=expected["D"],
                      dt_bias=expected["dt_bias"], dt_softplus=True)
    out.backward(dout)
    assert set(got) == set(fwd_bwd.LEAVES)
    for k in fwd_bwd.LEAVES:
        ref = expected[k].grad
        assert fwd_bwd.grad_diff(got[k], ref.float()) < 1e-6, k
    assert fwd_bwd.grad_diff(forward_only().float(), out.detach().float()) < 1e-6
    bare()                                                  # its two functions alone


def test_fwd_bwd_runs_part_of_the_grid():
    """--grid-seqlens / --grid-dstates pick part of the grid (a long run made in parts); a value
    outside the grid is refused, naming the option."""
    from tests.benchmark import fwd_bwd
    from tests.benchmark.fwd_bwd import GRID, grid_points
    assert grid_points() == GRID and len(GRID) == 9
    part = grid_points([4096, 16384], [256])
    assert [(s["seqlen"], s["dstate"]) for s in part] == [(4096, 256), (16384, 256)]
    assert [s["dstate"] for s in grid_points([65536])] == [64, 128, 256]
    with pytest.raises(ValueError, match=r"--grid-dstates \[512\] not in the grid's"):
        grid_points(dstates=[128, 512])
    with pytest.raises(SystemExit):                          # part of a grid not asked for
        fwd_bwd.main(["--grid-seqlens", "4096"])


def test_fwd_bwd_tilegym_step_with_tilegyms_own_kernels_on_the_interpreter():
    """The same step with TileGym's real functions and kernels, where TileGym is installed (the
    GPU machine's bundle has it; elsewhere skipped), its kernels run on this project's CPU
    interpreter with its first config (``work_count.tilegym_on_interpreter``), so that the
    argument order and dtypes TileGymScan assumes are TileGym's own. Float32 inputs, chunk 64
    (TileGym's); every gradient within 1e-4 of the float64 recurrence's (float32 rounding)."""
    pytest.importorskip("tilegym.ops.cutile.mamba2")
    import torch

    from reference.chunked import ssd_chunked
    from tests.benchmark import fwd_bwd
    from tests.benchmark.bench_forward import make_inputs
    from tests.benchmark.work_count import tilegym_on_interpreter

    inputs = make_inputs(torch, "cpu", 2, 128, 4, 16, 2, 16, "float32")
    dout = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(3))
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    with tilegym_on_interpreter() as tg:
        step, _, grads, bare = fwd_bwd._tilegym_step(
            64, leaves, dout, (tg.mamba2_chunk_forward, tg.mamba2_chunk_backward))
        step()
        bare()                                              # its two functions alone
    got = grads()
    expected = {k: v.double().clone().requires_grad_() for k, v in inputs.items()}
    out = ssd_chunked(*(expected[k] for k in ("x", "dt", "A", "B", "C")), 64, D=expected["D"],
                      dt_bias=expected["dt_bias"], dt_softplus=True)
    out.backward(dout.double())
    for k in fwd_bwd.LEAVES:
        assert fwd_bwd.grad_diff(got[k].double(), expected[k].grad) < 1e-4, k


def test_work_count_counts_a_steps_kernels(tmp_path):
    """work_count on a small step of this project's (and TileGym's, where installed): a row per
    kernel the step launched -- the eight launches of a default step -- and a total row that adds
    them up; the state pass does the p x n multiply-adds per token and head that each token's
    contribution B^T (dt x) to its chunk's state takes, no more."""
    import torch

    import cuda.tile as cuda_tile

    from ops.results.report import load
    from tests.benchmark import work_count
    originals = (cuda_tile.launch, torch.cuda.current_stream)
    path = tmp_path / "work.csv"
    work_count.main(["--shape", "1x128x4x1", "--dstates", "32", "--chunks", "32",
                     "--out", str(path)])
    rows = load(path)
    ours = [r for r in rows if r["impl"] == "cutile"]
    kernels, total = ours[:-1], ours[-1]
    assert total["kernel"] == "total" and sum(r["launches"] for r in kernels) == 8
    for field in ("macs", "loaded", "stored"):
        assert total[field] == pytest.approx(sum(r[field] for r in kernels))
    state, = [r for r in kernels if r["kernel"] == "fwd_pass_state_kernel"]
    assert state["macs"] == 64 * 32
    assert all(r["loaded"] > 0 for r in kernels)
    if work_count.tilegym_installed():
        theirs = [r for r in rows if r["impl"] == "tilegym"]
        assert theirs[-1]["kernel"] == "total" and theirs[-1]["macs"] > 0
        assert (cuda_tile.launch, torch.cuda.current_stream) == originals    # restored


def test_walk_sass_counts_the_walks_variants():
    """walk_sass: a row per config of the walk's space, the chain's own first and named so,
    the others by the keys they change; its launch's blocks and counts from the machine code;
    a bad --dstates refused by the parser."""
    from tests.benchmark import walk_sass
    rows = walk_sass.rows("sm_90", (64,), limit=2)
    assert [r["config"] for r in rows] == ["chain's own", "BLOCK_P=32"]
    assert [r["blocks"] for r in rows] == [80, 160]
    assert all(r["instructions"] > 0 and r["registers"] > 0 and r["mma"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        walk_sass.main(["--dstates", "64,x"])


def test_tilegym_winners_are_searched_once_and_kept(tmp_path, monkeypatch):
    """warm_compile.tilegym_winners: a TileGym search (its module's exhaustive_search, stood in
    for here: the winner is the config with the largest ``speed``) runs once and its winner is
    written to the file; in a later context, the same search -- same kernel, arguments' shapes
    and config list -- returns that config of the list without searching; another shape or
    another list searches again; a warm context (keep=False) searches its slice of the list on
    a miss and keeps nothing; the module's function is restored after each."""
    import json
    import sys
    import types
    from types import SimpleNamespace

    import torch
    from cuda.tile.tune import Measurement, TuningResult

    from tests.benchmark import warm_compile
    from tests.benchmark.warm_compile import tilegym_winners
    searched = []

    def exhaustive_search(configs, stream, grid_fn, kernel, args_fn, hints_fn=None):
        searched.append([c.speed for c in configs])
        best = max(configs, key=lambda c: c.speed)
        m = Measurement(config=best, mean_us=100.0 / best.speed, num_samples=5,
                        error_margin_us=0.1)
        return TuningResult(best=m, successes=[m], failures=[])
    names = ["tilegym", "tilegym.ops", "tilegym.ops.cutile", "tilegym.ops.cutile.mamba2"]
    modules = [types.ModuleType(n) for n in names]
    for parent, child, name in zip(modules, modules[1:], names[1:]):
        setattr(parent, name.rsplit(".", 1)[1], child)
    for name, module in zip(names, modules):
        monkeypatch.setitem(sys.modules, name, module)
    tg = modules[-1]
    tg.exhaustive_search = exhaustive_search

    def kernel():
        pass
    configs = [SimpleNamespace(BLOCK=b, speed=s) for b, s in ((16, 1.0), (32, 3.0), (64, 2.0))]
    x = torch.randn(4, 8)
    args = lambda x: (lambda cfg: (x, cfg.BLOCK))
    path = tmp_path / "winners.json"

    counts = []

    def run(cfgs, tensor=x, **options):
        with tilegym_winners(path, **options) as state:
            found = tg.exhaustive_search(cfgs, None, None, kernel, args(tensor)).best.config
        counts.append((state.reused, state.searched))
        return found
    assert run(configs) is configs[1] and searched == [[1.0, 3.0, 2.0]]
    assert tg.exhaustive_search is exhaustive_search and counts[-1] == (0, 1)
    entry, = json.loads(path.read_text()).values()
    assert entry["config"] == repr(configs[1]) and entry["mean_us"] == pytest.approx(100 / 3)
    assert entry["kernel"].endswith("kernel") and entry["args"][0] == "(4, 8) (8, 1) torch.float32"
    again = [SimpleNamespace(**vars(c)) for c in configs]          # a new process's list
    assert run(again) is again[1] and len(searched) == 1 and counts[-1] == (1, 0)
    assert run(configs, torch.randn(4, 16)) is configs[1] and len(searched) == 2
    assert run(configs[::2]) is configs[2] and len(searched) == 3
    before = path.read_text()
    more = configs + [SimpleNamespace(BLOCK=128, speed=0.5)]
    assert run(more, keep=False, part=1, nparts=2) is configs[1]      # its slice: 3.0, 0.5
    assert searched[-1] == [3.0, 0.5] and path.read_text() == before
    assert tg.exhaustive_search is exhaustive_search
    assert len(json.loads(path.read_text())) == 3 and not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(warm_compile, "_versions", lambda: {"tilegym": "9.9"})    # an upgrade
    assert run(configs) is configs[1] and len(searched) == 5          # searched again


def test_a_bad_winners_file_is_refused_naming_it(tmp_path, capsys):
    """fwd_bwd and profile_fwd_bwd --tilegym-winners: a file that is not a winners file, or a path
    whose folder does not exist, stops the run before any search, naming the file."""
    from tests.benchmark import fwd_bwd, profile_fwd_bwd
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    for path, says in ((bad, "not a winners file"), (tmp_path / "no" / "w.json", "does not exist")):
        for main, more in ((fwd_bwd.main, ["--models"]),
                           (profile_fwd_bwd.main, ["--tilegym-chunk", "64"])):
            with pytest.raises(SystemExit):
                main(["--tilegym-winners", str(path), *more])
            err = capsys.readouterr().err
            assert path.name in err and says in err, err
    from tests.benchmark.warm_compile import read_winners
    with pytest.raises(ValueError, match="bad.json: not a winners file"):
        read_winners(bad)
    with pytest.raises(ValueError, match="does not exist"):
        read_winners(tmp_path / "no" / "w.json")
    assert read_winners(tmp_path / "new.json") == {}


def test_fwd_bwd_warms_tilegym_once_per_specialization():
    """TileGym's exhaustive compiles run once for the shapes that specialize alike (the grid's
    4K, 16K and 64K at one dstate), on the shortest, in ``tilegym_parts`` processes, before the
    others' first steps; every shape still warms this project's and Triton's first step."""
    from tests.benchmark import fwd_bwd
    shapes = fwd_bwd.grid_points() + [dict(batch=8, seqlen=2048, nheads=80, headdim=64, ngroups=1, dstate=128)]
    jobs = fwd_bwd.warm_jobs(shapes, ("triton", "cutile", "tilegym"), [256], 64, 4)
    tilegym = [(s["batch"], s["seqlen"], s["dstate"], part) for s, impl, c, part, n, _ in jobs
               if impl == "tilegym"]
    assert tilegym == [(8, 2048, 128, p) for p in range(4)] + [
        (1, 4096, n, p) for n in (64, 128, 256) for p in range(4)]
    assert all(impl == "tilegym" for _, impl, *_ in jobs[:len(tilegym)])
    ours = sorted((s["batch"], s["seqlen"], s["dstate"]) for s, impl, *_ in jobs if impl == "cutile")
    assert ours == sorted((s["batch"], s["seqlen"], s["dstate"]) for s in shapes)


def test_plot_uses_a_log_axis_only_for_wide_speedups():
    """Speedups spanning more than 4x get a logarithmic axis; a narrow range stays linear, the
    1.0 reference line not counted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from ops.results.plot import _log_if_wide
    fig, (wide, narrow) = plt.subplots(1, 2)
    wide.plot([1, 2, 3], [1.7, 2.0, 23.0])
    narrow.plot([1, 2, 3], [4.5, 6.0, 10.0])
    for ax in (wide, narrow):
        _log_if_wide(ax)
        ax.axhline(1.0)
    assert (wide.get_yscale(), narrow.get_yscale()) == ("log", "linear")
    plt.close(fig)
