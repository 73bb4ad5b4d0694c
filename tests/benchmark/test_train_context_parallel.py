"""tests/benchmark/train_context_parallel.py: the recall model trained context parallel.

CPU: two spawned gloo ranks train the model split (and one rank alone, context parallel at world
size 1) from the same weights on the same batches as the single process; the logged losses must
be the single process' to float32 rounding for the first steps (the split reorders sums only: a
share left out, a missing all-reduce of the gradients or a slice trained twice would change the
second step's loss by far more), and the script's verdict must say they agree; the CSV and the
figure. The options it refuses. GPU: the same at world size 1 on one GPU (a several-GPU run
needs torchrun: issue notes, tests/benchmark/README.md).
"""
import csv
import math
import re

import pytest

from tests.benchmark import train_context_parallel as tcp

TINY = ["--d-model", "32", "--headdim", "16", "--dstate", "16", "--seq-len", "96", "--chunk", "16",
        "--batch", "2", "--vocab", "32", "--pairs", "4", "--queries", "4", "--print-every", "100"]


def test_two_ranks_train_as_one_process(tmp_path):
    """Tolerance: 1e-5 relative on each of the first 10 logged losses (float32; observed
    ~1e-7: the ranks' shares of the loss and of the gradients add in another order than one
    process' sums), and the agreement rule over all 30 steps."""
    out, plot = tmp_path / "cp.csv", tmp_path / "cp.png"
    result = tcp.main(["--device", "cpu", "--ranks", "2", "--scan", "reference", *TINY,
                       "--steps", "30", "--world-sizes", "1,2", "--out", str(out),
                       "--plot", str(plot)])
    runs = result["runs"]
    assert list(runs) == ["single", "single@seed1", "cp1", "cp2"]
    single = [r["loss"] for r in runs["single"]]
    for label in ("cp1", "cp2"):
        split = [r["loss"] for r in runs[label]]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(split[:10], single[:10])), label
    # another seed is another curve (the comparison above can tell runs apart)
    noise = [r["loss"] for r in runs["single@seed1"]]
    assert max(abs(a - b) for a, b in zip(noise, single)) > 1e-2
    assert set(result["verdict"]) == {"cp1", "cp2"}
    assert all(ok for _, _, ok in result["verdict"].values())
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * 30 and set(rows[0]) == set(tcp.COLUMNS)
    by_run = {r["run"]: r for r in rows}
    assert by_run["cp2"]["world_size"] == "2" and by_run["cp2"]["tokens_per_rank"] == "48"
    assert by_run["single"]["world_size"] == "1" and by_run["single"]["tokens_per_rank"] == "96"
    assert math.isnan(float(by_run["cp2"]["peak_mib"]))                  # (a GPU's only)
    assert plot.stat().st_size > 10_000


def test_uneven_slices_and_the_kernels(tmp_path):
    """Three ranks over 50 tokens (slices of 17, 17 and 16: rank boundaries inside chunks of 16;
    a query's answer may sit on any rank), through the kernels on the CPU interpreter, a few
    steps: the same losses as one process. Tolerance as above."""
    result = tcp.main(["--device", "cpu", "--ranks", "3", "--scan", "interpret", *TINY,
                       "--seq-len", "50", "--steps", "3", "--no-noise-run"])
    runs = result["runs"]
    assert list(runs) == ["single", "cp3"] and runs["cp3"][0]["tokens_per_rank"] == 17
    assert len(runs["cp3"]) == len(runs["single"]) == 3
    for a, b in zip(runs["cp3"], runs["single"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)


def options(argv):
    p = tcp.parser()
    return tcp.check_args(p, p.parse_args(argv))


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--scan", "cutile"], "--scan cutile needs a CUDA GPU"),
    (["--device", "cpu", "--world-sizes", "2,x"], "--world-sizes must be"),
    (["--device", "cpu", "--ranks", "-1"], "--ranks must be >= 0"),
    (["--device", "cpu", "--ranks", "4", "--seq-len", "3", "--pairs", "1", "--queries", "1"],
     "--seq-len \\(3\\) must give every one of 4 ranks a token"),
    (["--device", "cpu", "--chunk", "48"], "--chunk must be a power of two"),
    (["--device", "cpu", "--headdim", "48"], "--headdim \\(48\\) must divide"),
    (["--device", "cpu", "--pairs", "40"], "--pairs"),
])
def test_bad_options_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit):
        options(argv)
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.gpu
def test_world_size_one_on_a_gpu(tmp_path):
    """On one GPU, without torchrun: a group of one rank; the single runs and context parallel
    at world size 1, bf16 autocast, 20 steps: the curves agree by the script's rule, and the
    peak memory is recorded."""
    result = tcp.main(["--device", "cuda", *TINY, "--steps", "20", "--world-sizes", "1",
                       "--out", str(tmp_path / "cp.csv")])
    assert all(ok for _, _, ok in result["verdict"].values()) and set(result["verdict"]) == {"cp1"}
    assert all(r["peak_mib"] > 0 for r in result["runs"]["cp1"])
