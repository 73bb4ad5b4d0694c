"""``ops.results.ncu_summary``: the summary of ncu's raw page, and that summary read back."""
import pathlib

from ops.results import ncu_summary

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def test_the_summary_reads_back_as_written(tmp_path):
    """Every number a summary line shows comes back from ``read_summary`` as shown."""
    records = ncu_summary.read(RESULTS / "ncu" / "ncu_cutile_64K_256_compute128.csv")
    assert records
    text = tmp_path / "summary.txt"
    text.write_text("# a comment\n## one run\n" + "\n".join(ncu_summary.summary_lines(records)) + "\n")
    [(section, back)] = ncu_summary.read_summary(text).items()
    assert section == "one run" and len(back) == len(records)
    for rec, got in zip(records, back):
        assert got["name"] == rec["name"][:60]
        assert round(got["duration_us"], 1) == round(rec["duration_us"], 1)
        assert got["registers"] == rec["registers"] and got["grid"] == rec["grid"]
        top = sorted(rec["stalls"].items(), key=lambda kv: -kv[1])[:4]
        assert list(got["stalls"]) == [k for k, _ in top]
        assert all(abs(got["stalls"][k] - v) <= 0.05 for k, v in top)


def test_the_committed_training_step_profile_reads():
    """The committed profile of a training step has four runs, each with its backward kernels."""
    sections = ncu_summary.read_summary(RESULTS / "ncu_fwd_bwd_h200.txt")
    assert len(sections) == 4
    for name, records in sections.items():
        assert any("bwd" in r["name"] for r in records), name
        assert all(r["duration_us"] >= 20 for r in records)        # written with --min-us 20
