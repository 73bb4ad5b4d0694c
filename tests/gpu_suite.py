"""The ``gpu`` tests in several pytest processes sharing one GPU, within a time limit.

    python -m tests.gpu_suite                          # every gpu test, 8 processes, 560 s
    python -m tests.gpu_suite --procs 12 --limit 540 --out gpu_suite tests/kernels

Most of a ``gpu`` test's time is compiling its kernels, one at a time on one CPU core per
process; the GPU work itself is short. So N processes on one GPU run the suite about N times
faster, until the CPU's cores or the GPU's memory run out (compiled kernels are cached on disk,
so a kernel compiled by one process is found by the others that need it after). What this runner
does:

1. It collects the gpu tests (``pytest --collect-only -m gpu``) under the given paths.
2. The tests marked ``gpu_memory`` (tens of GiB each: tensors past 2**31 elements) run first, one
   process and nothing beside it, so that no other test's memory makes them fail.
3. The rest are cut into ``--procs`` contiguous slices of the collection order (a file's tests
   stay mostly in one process, sharing its compiled kernels) and run in parallel.
4. A process that ends before its slice is done (a test broke the CUDA context and
   ``tests/conftest.py`` stopped the run, or the process crashed) is started again on the tests
   it did not reach; a test that ran and produced no outcome is reported as an error.
5. At ``--limit`` seconds from the start every process still running is stopped; the tests not
   reached are listed as not run.

Each test's outcome is read from its process's ``-v`` output as it runs, so a stopped process
loses nothing that finished. The logs go to ``--out`` (one per process run), with
``summary.txt``: counts, then every failed, errored and not-run test; and ``outcomes.tsv``: every
collected test's outcome, one a line. The exit status is 0 only if every collected test passed or
was skipped.

A suite longer than one sitting runs in parts: ``--resume`` an earlier ``outcomes.tsv`` keeps the
tests it has as passed, skipped or expected to fail, and runs the rest (failed, errored, not run,
and any it does not name), so that its summary and ``outcomes.tsv`` cover the whole suite:

    python -m tests.gpu_suite --limit 540 --out part1
    python -m tests.gpu_suite --limit 540 --out part2 --resume part1/outcomes.tsv

Only the same code's outcomes may be carried over: a change between the parts is tested only where
its tests run again.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")   # pytest's -v words
OUTCOME = re.compile(rf"^(\S+::\S+) ({'|'.join(OUTCOMES)})\b")
GOOD = {"PASSED", "SKIPPED", "XFAIL"}
NOT_RUN = "NOT RUN"                                   # a collected test without an outcome
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]


def collect(paths, marker, timeout=None):
    """The node ids of the tests under ``paths`` (none: pytest's testpaths) selected by
    ``-m marker``, in collection order; RuntimeError if collecting fails or takes longer than
    ``timeout`` seconds."""
    try:
        run = subprocess.run(PYTEST + ["--collect-only", "-q", "-m", marker, *paths],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"collecting {paths or 'the tests'} took over {timeout:.0f} s") from None
    if run.returncode not in (0, 5):                  # 5: nothing collected
        raise RuntimeError(f"collecting {paths} failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    return [line.strip() for line in run.stdout.splitlines() if "::" in line]


def slices(ids, n):
    """``ids`` cut into at most ``n`` contiguous, nonempty slices whose lengths differ by at most
    one, in order."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    n = min(n, len(ids))
    size, extra = divmod(len(ids), n) if n else (0, 0)
    out, start = [], 0
    for k in range(n):
        end = start + size + (k < extra)
        out.append(ids[start:end])
        start = end
    return out


def outcomes(text):
    """{node id: outcome} from pytest's ``-v`` output (the last word pytest printed for each)."""
    found = {}
    for line in text.splitlines():
        m = OUTCOME.match(line)
        if m:
            # a test that fails in teardown after passing prints twice: keep the worse
            if found.get(m.group(1)) not in ("FAILED", "ERROR"):
                found[m.group(1)] = m.group(2)
    return found


class Shard:
    """One slice of tests, run by one pytest process at a time until each has an outcome."""

    def __init__(self, name, ids, out, env):
        self.name, self.todo, self.out, self.env = name, list(ids), out, env
        self.results, self.runs, self.proc, self.log = {}, 0, None, None

    def start(self):
        self.runs += 1
        self.log = self.out / f"{self.name}.{self.runs}.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(PYTEST + ["-v", "-W", "ignore::Warning", *self.todo],
                                         env=self.env, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def poll(self, restart=True):
        """True while its process runs; when it has ended, takes its outcomes and, if tests are
        left and ``restart``, starts a new process on them (the first one left, which got no
        outcome, counted as an error when the process ran nothing further)."""
        if self.proc is None or self.proc.poll() is None:
            return self.proc is not None
        self.proc = None
        got = self.logged()
        self.results.update(got)
        left = [t for t in self.todo if t not in self.results]
        if left and not any(t in got for t in self.todo):
            self.results[left[0]] = "ERROR"           # ran nothing: the first test broke it
            left = left[1:]
        self.todo = left
        if left and restart:
            self.start()
            return True
        return False

    def logged(self):
        """The outcomes in its latest process's log (so far, while it runs)."""
        return outcomes(self.log.read_text(errors="replace"))

    def done(self):
        """How many of its tests have an outcome, the running process's so far included."""
        live = self.logged() if self.proc is not None else {}
        return len(self.results.keys() | live.keys())

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.log is not None:
            self.results.update(self.logged())
        self.proc = None


def run_all(shards, deadline, poll_s=1.0, every_s=30.0):
    """Start ``shards``, wait until each is done or ``deadline`` (time.monotonic()) passes, then
    stop what still runs; every ``every_s`` seconds, a line of progress."""
    for s in shards:
        s.start()
    total, said = sum(len(s.todo) for s in shards), time.monotonic()
    try:
        while [s.poll(time.monotonic() < deadline) for s in shards].count(True) \
                and time.monotonic() < deadline:
            time.sleep(poll_s)
            if time.monotonic() - said >= every_s:
                said = time.monotonic()
                print(f"  {sum(s.done() for s in shards)}/{total} tests done, "
                      f"{sum(s.proc is not None for s in shards)} processes running", flush=True)
    finally:
        for s in shards:
            s.stop()


def statuses(ids, results):
    """{node id: outcome} over ``ids`` in their order, ``NOT RUN`` for those without one."""
    return {t: results.get(t, NOT_RUN) for t in ids}


def summary(status):
    """(text, ok) of ``statuses``: counts of each outcome and the ids of every test that did not
    pass or skip."""
    counts = {}
    for v in status.values():
        counts[v] = counts.get(v, 0) + 1
    bad = [f"{v:8s} {t}" for t, v in status.items() if v not in GOOD]
    lines = [f"{len(status)} gpu tests: " + ", ".join(f"{n} {k.lower()}" for k, n in sorted(counts.items()))]
    return "\n".join(lines + bad) + "\n", not bad


def read_outcomes(path):
    """{node id: outcome} from an ``outcomes.tsv`` (``outcome<TAB>node id`` a line); ValueError,
    naming the line, for a line of another form or an outcome this runner does not write."""
    known = {*OUTCOMES, NOT_RUN}
    found = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        outcome, tab, node = line.partition("\t")
        if not tab or outcome not in known or "::" not in node:
            raise ValueError(f"{path}, line {number}: expected 'outcome<TAB>node id' with an "
                             f"outcome among {sorted(known)}, got {line!r}")
        found[node] = outcome
    return found


def main(argv=None):
    """The command line (see the module's docstring); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="test files or folders (default: pytest's testpaths)")
    parser.add_argument("--procs", type=int, default=8, help="pytest processes at once")
    parser.add_argument("--limit", type=float, default=560, help="seconds for the whole run")
    parser.add_argument("--out", default="gpu_suite", help="folder for the logs and summary.txt")
    parser.add_argument("--resume", metavar="TSV", help="an earlier run's outcomes.tsv: keep its "
                        "passed and skipped tests, run the rest")
    args = parser.parse_args(argv)
    if args.procs < 1:
        parser.error(f"--procs must be at least 1, got {args.procs}")
    if args.limit <= 0:
        parser.error(f"--limit must be positive, got {args.limit}")
    earlier = {}
    if args.resume:
        try:
            earlier = read_outcomes(args.resume)
        except OSError as e:
            parser.error(f"--resume: cannot read {args.resume}: {e.strerror}")
        except ValueError as e:
            parser.error(f"--resume: {e}")
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = start + args.limit
    ids = collect(args.paths, "gpu", deadline - time.monotonic())
    kept = {t: earlier[t] for t in ids if earlier.get(t) in GOOD}
    if args.resume:
        print(f"resuming {args.resume}: {len(kept)} outcomes kept, {len(ids) - len(kept)} tests to run",
              flush=True)
    todo = [t for t in ids if t not in kept]
    alone = set(collect(args.paths, "gpu and gpu_memory", max(1.0, deadline - time.monotonic()))) \
        & set(todo)
    rest = [t for t in todo if t not in alone]
    print(f"{len(todo)} tests: {len(alone)} alone first, then {len(rest)} in "
          f"{min(args.procs, len(rest))} processes; logs in {out}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = [Shard("alone", [t for t in todo if t in alone], out, env)] if alone else []
    if first:
        run_all(first, deadline)
        print(f"alone: {time.monotonic() - start:.0f} s", flush=True)
    shards = [Shard(f"shard{k}", part, out, env) for k, part in enumerate(slices(rest, args.procs))]
    if shards and time.monotonic() < deadline:
        run_all(shards, deadline)
    status = statuses(ids, {**kept, **{t: v for s in first + shards for t, v in s.results.items()}})
    text, ok = summary(status)
    if kept:
        text += f"({len(kept)} outcomes kept from {args.resume})\n"
    text += f"({time.monotonic() - start:.0f} s, {sum(s.runs for s in first + shards)} processes)\n"
    (out / "summary.txt").write_text(text)
    (out / "outcomes.tsv").write_text("".join(f"{v}\t{t}\n" for t, v in status.items()))
    print(text, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
