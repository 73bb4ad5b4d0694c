"""``tests/gpu_suite.py``, the gpu tests in parallel processes, run on the CPU on a folder of
small stand-in tests (plain pytest tests carrying the ``gpu`` and ``gpu_memory`` markers): what
each test's outcome is, which tests run alone and first, that a process stopped by a broken test
is started again on the rest, what the time limit leaves as not run, and what a run resumed from
an earlier one keeps."""
import textwrap

import pytest

from tests import gpu_suite

STAND_INS = '''
import os, time
import pytest

LOG = os.environ["SUITE_LOG"]

def note(name):
    with open(LOG, "a") as f:
        f.write(f"{name} {os.getpid()} {time.monotonic()}\\n")

@pytest.mark.gpu
@pytest.mark.gpu_memory
def test_big():
    note("big")
    time.sleep(0.5)

@pytest.mark.gpu
@pytest.mark.parametrize("k", range(6))
def test_small(k):
    note(f"small{k}")

@pytest.mark.gpu
def test_fails():
    note("fails")
    assert 1 == 2

@pytest.mark.gpu
def test_stops_the_run(request):
    note("stops")
    request.session.shouldstop = "a broken context, say"
    assert False

@pytest.mark.gpu
def test_after_the_stop():
    note("after")

@pytest.mark.gpu
def test_crashes():
    note("crashes")
    os._exit(1)

@pytest.mark.gpu
def test_after_the_crash():
    note("after_crash")

def test_not_gpu():
    note("not_gpu")
'''


@pytest.fixture
def suite(tmp_path, monkeypatch):
    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "pytest.ini").write_text(textwrap.dedent("""\
        [pytest]
        markers =
            gpu: stand-in
            gpu_memory: stand-in
        """))
    (folder / "test_stand_ins.py").write_text(STAND_INS)
    log = tmp_path / "ran.txt"
    monkeypatch.chdir(folder)
    monkeypatch.setenv("SUITE_LOG", str(log))
    return folder, log


def ran(log):
    return [line.split() for line in log.read_text().splitlines()]


def test_slices_are_contiguous_and_even():
    ids = list("abcdefg")
    assert gpu_suite.slices(ids, 3) == [list("abc"), list("de"), list("fg")]
    assert gpu_suite.slices(ids, 10) == [[c] for c in ids]
    assert gpu_suite.slices([], 4) == []
    with pytest.raises(ValueError, match="n must be at least 1"):
        gpu_suite.slices(ids, 0)


def test_outcomes_are_read_from_the_verbose_lines():
    text = ("t.py::a PASSED   [ 10%]\nt.py::b[1-x] FAILED  [ 20%]\nnoise t.py::c PASSED\n"
            "t.py::d PASSED\nt.py::d ERROR\nt.py::e SKIPPED (needs a GPU)\n")
    assert gpu_suite.outcomes(text) == {"t.py::a": "PASSED", "t.py::b[1-x]": "FAILED",
                                        "t.py::d": "ERROR", "t.py::e": "SKIPPED"}


def test_the_suite_runs_each_gpu_test_once_the_big_one_alone_first(suite, capsys):
    folder, log = suite
    status = gpu_suite.main(["--procs", "2", "--limit", "120", "--out", str(folder / "out")])
    assert status == 1                    # one test fails, one stops its run, one crashes it
    names = [name for name, _, _ in ran(log)]
    everything = ["big", "fails", "stops", "after", "after_crash"] + [f"small{k}" for k in range(6)]
    assert sorted(set(names)) == sorted(everything + ["crashes"])
    assert names.count("crashes") == 2 and all(names.count(n) == 1 for n in everything)
    assert names[0] == "big"                            # alone, before any other started
    pids = {name: pid for name, pid, _ in ran(log)}
    assert pids["big"] not in {pid for name, pid in pids.items() if name != "big"}
    assert pids["after"] != pids["stops"]               # the stopped run started again on the rest
    text = (folder / "out" / "summary.txt").read_text()
    # the crash gave no outcome: run once more alone at the head of its slice, then an error
    assert text.startswith("12 gpu tests: 1 error, 2 failed, 9 passed")
    assert "ERROR    test_stand_ins.py::test_crashes" in text
    assert "FAILED   test_stand_ins.py::test_fails" in text
    assert "FAILED   test_stand_ins.py::test_stops_the_run" in text
    assert "not_gpu" not in text and "test_after_the_stop" not in text
    assert "12 tests: 1 alone first, then 11 in 2 processes" in capsys.readouterr().out


def test_the_time_limit_leaves_the_rest_not_run(suite, monkeypatch):
    folder, log = suite
    source = (folder / "test_stand_ins.py").read_text()
    (folder / "test_stand_ins.py").write_text(source.replace("time.sleep(0.5)", "time.sleep(60)"))
    status = gpu_suite.main(["--procs", "2", "--limit", "15", "--out", str(folder / "out")])
    assert status == 1
    text = (folder / "out" / "summary.txt").read_text()
    assert text.startswith("12 gpu tests: 12 not run")
    assert [name for name, _, _ in ran(log)] == ["big"]  # stopped at the limit; nothing else began
    seconds = int(text.rsplit("(", 1)[1].split(" s")[0])
    assert 15 <= seconds <= 20


def test_a_resumed_run_keeps_what_passed_and_runs_the_rest(suite, capsys):
    folder, log = suite
    assert gpu_suite.main(["--procs", "2", "--limit", "120", "--out", str(folder / "part1")]) == 1
    first = (folder / "part1" / "outcomes.tsv").read_text().splitlines()
    assert len(first) == 12 and "ERROR\ttest_stand_ins.py::test_crashes" in first
    assert "PASSED\ttest_stand_ins.py::test_small[3]" in first
    log.write_text("")
    status = gpu_suite.main(["--procs", "2", "--limit", "120", "--out", str(folder / "part2"),
                             "--resume", str(folder / "part1" / "outcomes.tsv")])
    assert status == 1                                  # the same three still fail
    assert sorted(name for name, _, _ in ran(log)) == ["crashes", "fails", "stops"]
    text = (folder / "part2" / "summary.txt").read_text()
    assert text.startswith("12 gpu tests: 1 error, 2 failed, 9 passed")
    assert "(9 outcomes kept from " in text
    assert (folder / "part2" / "outcomes.tsv").read_text().splitlines() == first
    out = capsys.readouterr().out
    assert "9 outcomes kept, 3 tests to run" in out and "3 tests: 0 alone first" in out


def test_bad_arguments_are_refused(capsys, tmp_path):
    broken = tmp_path / "outcomes.tsv"
    broken.write_text("PASSED\tt.py::a\nPASSED t.py::b\n")
    for argv, message in ((["--procs", "0"], "--procs must be at least 1"),
                          (["--limit", "0"], "--limit must be positive"),
                          (["--resume", str(tmp_path / "none.tsv")], "--resume: cannot read"),
                          (["--resume", str(broken)], "line 2: expected 'outcome<TAB>node id'")):
        with pytest.raises(SystemExit):
            gpu_suite.main(argv)
        assert message in capsys.readouterr().err
