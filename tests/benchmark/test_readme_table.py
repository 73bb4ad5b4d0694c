"""The results table of tests/benchmark/README.md (``tests/benchmark/readme_table.py``):
current, right, and loud.

On a CPU: the block in that README equals what the committed CSVs give now (it fails when either
the README or a CSV changes without the other: ``python -m tests.benchmark.readme_table``
rewrites it); the table builder on rows made by hand, with the expected cells worked out here by
hand; and a missing row raises, naming the CSV and the row.
"""
import pytest

from tests.benchmark import readme_table as rt

# One model, so the hand-made rows stay small; its sizes are what the rows must carry.
MODEL = {"toy": dict(batch=2, seqlen=4096, nheads=8, headdim=64, ngroups=2, dstate=128)}
SIZES = MODEL["toy"]


def forward_rows():
    # ours 0.5 ms, Triton 1.0 ms, TileGym 0.75 ms: Triton/ours = 2.00, TileGym/ours = 1.50.
    common = dict(model="toy", status="ok", device="Test GPU", **SIZES)
    return [
        dict(common, impl="cutile", chunk=256, compute_chunk=128, ms=0.5, rel_err=4e-4),
        dict(common, impl="triton", chunk=256, compute_chunk=256, ms=1.0, rel_err=None),
        dict(common, impl="tilegym", chunk=64, compute_chunk=64, ms=0.75, rel_err=2e-3),
        # another chunk of ours, which the table must not pick up (it reads the caller's 256)
        dict(common, impl="cutile", chunk=128, compute_chunk=128, ms=0.1, rel_err=4e-4),
    ]


def training_rows():
    # ours 2.0 ms, Triton 3.0 ms, TileGym 1.0 ms: Triton/ours = 1.50, TileGym/ours = 0.50.
    common = dict(shape="toy", device="Test GPU", **SIZES)
    return [
        dict(common, impl="cutile", chunk=256, fwd_chunk=128, bwd_chunk=128, fwd_bwd_ms=2.0,
             peak_mib=600.4, grad_diff_x="0.001", grad_diff_dt="0.002"),
        dict(common, impl="triton", chunk=256, fwd_chunk=256, bwd_chunk=256, fwd_bwd_ms=3.0,
             peak_mib=500.0, grad_diff_x="0.0", grad_diff_dt="0.0"),
        dict(common, impl="tilegym", chunk=64, fwd_chunk=64, bwd_chunk=64, fwd_bwd_ms=1.0,
             peak_mib=1000.6, grad_diff_x="0.0005", grad_diff_dt="nan"),
    ]


def test_readme_block_is_what_the_csvs_give():
    _, block, _ = rt.split_readme(rt.README.read_text())
    assert block == rt.block_from_csvs(), (
        "tests/benchmark/README.md's results table differs from the committed CSVs: "
        "run python -m tests.benchmark.readme_table")


def test_forward_table_by_hand():
    lines, _ = rt.forward_table(forward_rows(), "fwd.csv", MODEL)
    assert lines[0].startswith("| forward, ms | batch × tokens, heads | ours | Triton | TileGym |")
    assert lines[2] == "| `toy` | 2 × 4K, 8 heads, 2 groups | 0.500 | 1.000 | 0.750 | 2.00× | 1.50× |"
    assert len(lines) == 3


def test_training_table_by_hand():
    lines, _, names = rt.training_table([("step.csv", training_rows())], MODEL)
    assert names == ["step.csv"]
    assert lines[0].endswith("| peak MiB: ours / Triton / TileGym |")
    assert lines[2] == "| `toy` | 2.00 | 3.00 | 1.00 | 1.50× | 0.50× | 600 / 500 / 1001 |"


def test_training_table_adds_gpu_time_where_every_row_has_it():
    """With graph times in every row (fwd_bwd.py --graph), two more columns: GPU ms of the three
    and ours' speedup by GPU time (ours 1.6 ms, Triton 2.4, TileGym 0.8: 1.50x and 0.50x); a row
    without one (NaN) leaves them out rather than show a gap."""
    rows = training_rows()
    for row, gpu in zip(rows, (1.6, 2.4, 0.8)):
        row["graph_ms"] = gpu
    lines, _, _ = rt.training_table([("step.csv", rows)], MODEL)
    assert "| GPU ms: ours / Triton / TileGym | GPU: × Triton / × TileGym |" in lines[0]
    assert lines[2] == ("| `toy` | 2.00 | 3.00 | 1.00 | 1.50× | 0.50× | 1.60 / 2.40 / 0.80 | "
                        "1.50× / 0.50× | 600 / 500 / 1001 |")
    rows[2]["graph_ms"] = float("nan")
    lines, _, _ = rt.training_table([("step.csv", rows)], MODEL)
    assert "GPU" not in lines[0] and lines[2].endswith("| 0.50× | 600 / 500 / 1001 |")


def test_block_notes_by_hand():
    block = rt.build_block(forward_rows(), [("step.csv", training_rows())],
                           forward_source="fwd.csv", models=MODEL)
    text = " ".join(block.split())        # the notes are wrapped; compare them unwrapped
    assert "[`fwd.csv`](results/fwd.csv), on the Test GPU" in text
    assert "headdim 64, dstate 128" in text
    assert "Chunks: ours called at 256, computing at 128; Triton called at 256; TileGym called at 64." in text
    assert "Outputs within 4.0e-4 (ours), 2.0e-3 (TileGym) of Triton's." in text
    assert "Chunks as above." in text
    assert "Gradients within 2.0e-3 of Triton's." in text      # the largest of ours' gradients
    assert block.endswith("\n") and not block.startswith("\n")


def test_the_note_says_how_tilegyms_step_was_timed():
    """A CSV made before fwd_bwd.py timed TileGym's step in an autograd node (no bare_ms column)
    is described as its two functions alone; one made after, as a step like the others'."""
    old = " ".join(rt.build_block(forward_rows(), [("step.csv", training_rows())],
                                  forward_source="fwd.csv", models=MODEL).split())
    assert "TileGym gets dt already processed and returns no dt or dt_bias gradient." in old
    rows = [dict(r, bare_ms=0.5 if r["impl"] == "tilegym" else float("nan"))
            for r in training_rows()]
    new = " ".join(rt.build_block(forward_rows(), [("step.csv", rows)], forward_source="fwd.csv",
                                  models=MODEL).split())
    assert "runs them in an autograd node with dt's bias and softplus done in PyTorch" in new
    assert "TileGym gets dt already processed" not in new
    with pytest.raises(ValueError, match="mix the two ways"):       # two models, two runs
        rt.tilegym_step_note([rows[2], training_rows()[2]])


def test_the_note_says_where_tilegyms_forward_had_its_dt_processed():
    """Forward rows whose tilegym_dt column says "in call" (bench_forward.py's rows) processed
    TileGym's dt within the timed call; rows without it were given dt processed outside."""
    text = lambda rows: " ".join(rt.build_block(rows, [("step.csv", training_rows())],
                                                forward_source="fwd.csv", models=MODEL).split())
    assert "TileGym is given dt already processed, outside its timed call." in text(forward_rows())
    inside = text([dict(r, tilegym_dt="in call") for r in forward_rows()])
    assert "TileGym's dt is processed (bias, softplus) in PyTorch within its timed call" in inside
    assert "outside its timed call" not in inside


def test_training_rows_come_from_the_first_csv_that_has_the_model():
    other = [dict(r, fwd_bwd_ms=r["fwd_bwd_ms"] * 10) for r in training_rows()]
    lines, used, names = rt.training_table([("empty.csv", []), ("step.csv", training_rows()),
                                            ("later.csv", other)], MODEL)
    assert names == ["step.csv"]
    assert lines[2].startswith("| `toy` | 2.00 | 3.00 | 1.00 |")


def test_a_missing_row_raises_naming_the_csv_and_the_row():
    rows = [r for r in forward_rows() if r["impl"] != "tilegym"]
    with pytest.raises(rt.MissingRow, match=r"fwd\.csv: no row with model=toy, impl=tilegym, chunk=64"):
        rt.forward_table(rows, "fwd.csv", MODEL)
    rows = [r for r in training_rows() if r["impl"] != "triton"]
    with pytest.raises(rt.MissingRow, match=r"step\.csv: no row with shape=toy, impl=triton, chunk=256"):
        rt.training_table([("step.csv", rows)], MODEL)
    with pytest.raises(rt.MissingRow, match=r"a\.csv, b\.csv: no row with shape=toy"):
        rt.training_table([("a.csv", []), ("b.csv", [])], MODEL)


def test_a_row_without_a_time_or_of_other_sizes_raises():
    rows = forward_rows()
    rows[1] = dict(rows[1], status="crashed (illegal memory access)", ms=None)
    with pytest.raises(rt.MissingRow, match=r"fwd\.csv: the row with model=toy, impl=triton.*no time"):
        rt.forward_table(rows, "fwd.csv", MODEL)
    rows = forward_rows()
    rows[0] = dict(rows[0], nheads=16)
    with pytest.raises(rt.MissingRow, match="has sizes"):
        rt.forward_table(rows, "fwd.csv", MODEL)
    rows = forward_rows() + [forward_rows()[2]]
    with pytest.raises(rt.MissingRow, match="2 rows with model=toy, impl=tilegym"):
        rt.forward_table(rows, "fwd.csv", MODEL)


def test_check_mode_reports_drift(tmp_path, capsys):
    readme = tmp_path / "README.md"
    before, block, after = rt.split_readme(rt.README.read_text())
    readme.write_text(before + block.replace("×", "x", 1) + after)
    assert rt.main(["--check", "--readme", str(readme)]) == 1
    assert "-" in capsys.readouterr().out
    assert rt.main(["--readme", str(readme)]) == 0            # rewrites it
    assert rt.main(["--check", "--readme", str(readme)]) == 0
    assert readme.read_text() == before + rt.block_from_csvs() + after


def scaling_rows():
    """context_parallel.py rows: the step at 1, 2 and 4 GPUs (strong, 1M tokens), the forward
    at 1 (weak), listed out of order."""
    common = dict(nheads=80, headdim=64, dstate=128, dtype="bfloat16", device="Test GPU")
    strong = dict(common, mode="strong", what="step", tokens_total=1 << 20)
    return [
        dict(strong, world_size=4, tokens_per_rank=1 << 18, time_ms=30.0, collective_share=0.042,
             peak_mib_max=15 * 1024, speedup=100 / 30, efficiency=100 / 120),
        dict(common, mode="weak", what="forward", world_size=1, tokens_total=1 << 18,
             tokens_per_rank=1 << 18, time_ms=6.8, collective_share=0.046,
             peak_mib_max=10.4 * 1024, speedup=1.0, efficiency=1.0),
        dict(strong, world_size=1, tokens_per_rank=1 << 20, time_ms=100.0, collective_share=0.005,
             peak_mib_max=56 * 1024, speedup=1.0, efficiency=1.0),
        dict(strong, world_size=2, tokens_per_rank=1 << 19, time_ms=55.0, collective_share=0.02,
             peak_mib_max=29 * 1024, speedup=100 / 55, efficiency=100 / 110),
    ]


def test_scaling_table_by_hand():
    """Context parallelism's table: strong before weak, world sizes ascending; the note says
    which world sizes the CSV holds."""
    lines, note = rt.scaling_block(("cp.csv", scaling_rows()))
    assert lines[0] == ("| context parallel | tokens (per GPU) | GPUs | ms | speedup | efficiency "
                        "| collective | peak GiB per GPU |")
    assert lines[2:] == [
        "| strong, training step | 1M (1M) | 1 | 100.0 | 1.00× | 100% | 0.5% | 56.0 |",
        "| strong, training step | 1M (512K) | 2 | 55.0 | 1.82× | 91% | 2.0% | 29.0 |",
        "| strong, training step | 1M (256K) | 4 | 30.0 | 3.33× | 83% | 4.2% | 15.0 |",
        "| weak, forward | 256K (256K) | 1 | 6.8 | 1.00× | 100% | 4.6% | 10.4 |"]
    assert "[`cp.csv`](results/cp.csv), on the Test GPU" in note
    assert "80 heads × headdim 64 × dstate 128, bfloat16" in note
    assert "World sizes 1, 2, 4" in note
    _, alone = rt.scaling_block(("cp.csv", [r for r in scaling_rows() if r["world_size"] == 1]))
    assert "one GPU only" in alone
    block = rt.build_block(forward_rows(), [("step.csv", training_rows())],
                           forward_source="fwd.csv", models=MODEL,
                           scaling=("cp.csv", scaling_rows()))
    assert block.endswith("\n".join(lines + [""] + rt.wrap(note)) + "\n")     # the last table


def test_the_scaling_text_table():
    """Notebook 09's plain-text table: the same cells, aligned; token counts in K and M."""
    from ops.results import scaling
    assert [scaling.tokens_text(n) for n in (3 << 20, 1 << 18, 1000, 1536)] == [
        "3M", "256K", "1000", "1536"]
    lines = scaling.text(scaling_rows()).split("\n")
    assert len(lines) == 5 and len({len(line) for line in lines}) == 1
    assert lines[1].split() == ["strong,", "training", "step", "1M", "(1M)", "1", "100.0",
                                "1.00×", "100%", "0.5%", "56.0"]


def test_a_scaling_row_without_a_column_raises():
    rows = scaling_rows()
    del rows[0]["collective_share"]
    with pytest.raises(ValueError, match="lacks the column.*collective_share"):
        rt.scaling_block(("cp.csv", rows))
    with pytest.raises(rt.MissingRow, match="cp.csv: no rows"):
        rt.scaling_block(("cp.csv", []))
