"""The context-parallel benchmark (tests/benchmark/context_parallel.py) on the CPU: its dry run at
world size 1 (plain ``python``, a group of one rank it makes itself) and, launched by torchrun, at
world sizes 1 and 2 in one launch; plus its scaling arithmetic and its refusal to report a
collective it did not see.

The dry runs check what a GPU run's CSV will hold: the columns, one row per (mode, what, world
size), the token counts of each mode, positive finite times, a collective share in [0, 1], and
speedup and efficiency computed against the world-size-1 rows. The numbers themselves (gloo on a
small CPU, the PyTorch reference) mean nothing.
"""
import csv
import math
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from tests.benchmark import context_parallel as cpb

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TINY = ["--device", "cpu", "--tokens", "64", "--tokens-per-rank", "32", "--nheads", "2",
        "--headdim", "8", "--dstate", "8", "--chunk", "16", "--reps", "2", "--warmup", "1"]


def read(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def check_rows(fields, rows, sizes):
    assert tuple(fields) == cpb.COLUMNS
    assert [(r["mode"], int(r["world_size"]), r["what"]) for r in rows] == [
        (m, k, w) for m in cpb.MODES for k in sizes for w in cpb.WHATS]
    for r in rows:
        k = int(r["world_size"])
        total, per_rank = int(r["tokens_total"]), int(r["tokens_per_rank"])
        assert (total, per_rank) == ((64, 64 // k) if r["mode"] == "strong" else (32 * k, 32)), r
        for name in ("time_ms", "collective_ms", "first_s"):
            v = float(r[name])
            assert math.isfinite(v) and v > 0, (name, r)
        share = float(r["collective_share"])
        assert 0 <= share <= 1, r
        assert float(r["collective_ms"]) <= float(r["time_ms"]), r
        assert math.isnan(float(r["peak_mib_max"]))                     # no CUDA memory on CPU
        assert r["backend"] == "reference" and r["device"].startswith("cpu")
        base = next(b for b in rows if int(b["world_size"]) == 1 and b["mode"] == r["mode"]
                    and b["what"] == r["what"])
        want = (total / float(r["time_ms"])) / (int(base["tokens_total"]) / float(base["time_ms"]))
        assert float(r["speedup"]) == pytest.approx(want, rel=1e-9)
        assert float(r["efficiency"]) == pytest.approx(want / k, rel=1e-9)


def run(cmd, timeout):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_dry_run_one_rank(tmp_path):
    out = tmp_path / "cp.csv"
    out.write_text("stale,row\n1,2\n")                          # the run writes the file afresh
    proc = run([sys.executable, "-m", "tests.benchmark.context_parallel", *TINY,
                "--out", str(out)], timeout=60)
    check_rows(*read(out), sizes=[1])
    assert proc.stdout.count(" world 1: ") == 4                  # a progress line per row


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_dry_run_torchrun_two_ranks(tmp_path):
    """torchrun's launcher (``python -m torch.distributed.run``, the same entry point as the
    ``torchrun`` script, from this interpreter) with two gloo ranks, world sizes 1 and 2."""
    out = tmp_path / "cp.csv"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "tests.benchmark.context_parallel", *TINY, "--world-sizes", "1,2",
         "--out", str(out)], timeout=90)
    fields, rows = read(out)
    check_rows(fields, rows, sizes=[1, 2])
    assert sum(int(r["world_size"]) == 2 for r in rows) == 4


def test_slices_are_parts_of_one_sequence():
    """A slice's numbers do not depend on the world size: the slices of two ranks, side by
    side, are the one-rank sequence, across a block boundary too."""
    shape = dict(batch=1, nheads=2, headdim=4, ngroups=1, dstate=4, dtype="float32",
                 device="cpu", seed=3)
    n = cpb.BLOCK + 40
    whole = cpb.slice_inputs(0, n, **shape)
    for k in (2, 3):
        parts = [cpb.slice_inputs(*cpb.slice_bounds("strong", k, r, n, 0)[:2], **shape)
                 for r in range(k)]
        for name in ("x", "dt", "B", "C", "dout"):
            assert (cpb.torch.cat([p[name] for p in parts], 1) == whole[name]).all(), name
        for name in ("A", "D", "dt_bias"):
            assert all((p[name] == whole[name]).all() for p in parts)
    assert (whole["A"] < 0).all() and (whole["x"] != 0).all()
    assert [cpb.slice_bounds("strong", 3, r, 10, 0) for r in range(3)] == [
        (0, 4, 10, 4), (4, 7, 10, 4), (7, 10, 10, 4)]
    assert cpb.slice_bounds("weak", 4, 2, 0, 5) == (10, 15, 20, 5)


def test_scaling_needs_a_matching_world_size_1_row():
    row = lambda mode, k, total, per, ms, **kw: dict(
        dict(mode=mode, what="step", world_size=k, tokens_total=total, tokens_per_rank=per,
             time_ms=ms, batch=1, nheads=2, headdim=8, dstate=8, ngroups=1, chunk=16,
             dtype="bfloat16", backend="cutile", device="GPU"), **kw)
    rows = cpb.add_scaling([
        row("strong", 1, 100, 100, 10.0), row("strong", 4, 100, 25, 4.0),
        row("weak", 1, 25, 25, 3.0), row("weak", 4, 100, 25, 4.0),
        row("strong", 2, 200, 100, 1.0),                  # no world-size-1 row of 200 tokens
        row("weak", 2, 50, 25, 1.0, dstate=16)])          # another shape
    got = [(r["speedup"], r["efficiency"]) for r in rows]
    assert got[:4] == [(1.0, 1.0), (2.5, 0.625), (1.0, 1.0), (3.0, 0.75)]
    assert all(math.isnan(v) for pair in got[4:] for v in pair)


def test_a_collective_not_seen_is_an_error():
    meter = cpb.CollectiveMeter(cpb.Clock(cpb.torch.device("cpu")))
    meter.spans = [("_agree", 0.0, 0.001)]
    with pytest.raises(RuntimeError, match="_exchange"):
        meter.take(cpb.HELPERS[:2])


def test_combining_runs_fills_the_scaling_and_a_later_run_replaces(tmp_path):
    row = lambda k, ms: dict(mode="strong", what="forward", world_size=k, tokens_total=64,
                             tokens_per_rank=64 // k, time_ms=ms, batch=1, nheads=2, headdim=8,
                             dstate=8, ngroups=1, chunk=16, dtype="bfloat16", backend="cutile",
                             device="GPU")
    files = [tmp_path / f"{name}.csv" for name in ("one_old", "two", "one_new")]
    for path, r in zip(files, [row(1, 99.0), row(2, 4.0), row(1, 6.0)]):
        cpb.write_rows(str(path), cpb.add_scaling([r]))
    assert math.isnan(float(read(files[1])[1][0]["speedup"]))       # alone: no baseline
    out = tmp_path / "all.csv"
    cpb.main(["--combine", *map(str, files), "--out", str(out)])
    fields, rows = read(out)
    assert tuple(fields) == cpb.COLUMNS
    assert [(int(r["world_size"]), float(r["time_ms"]), float(r["speedup"])) for r in rows] == [
        (2, 4.0, 1.5), (1, 6.0, 1.0)]
