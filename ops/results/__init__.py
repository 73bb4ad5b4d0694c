"""Readers of the committed measurements: what notebooks 05-09 and the benchmarks' results table
(``tests/benchmark/README.md``) show.

The benchmarks that produce them live in ``tests/benchmark/`` (its README says how to run each);
their CSVs, profiles and figures are committed under ``tests/benchmark/results/`` (``RESULTS``).
These modules only read and present them, so they work on any machine:

    report         rows of a benchmark CSV -> speedups, best chunks, tables
    plot           the benchmark figures
    ncu_summary    Nsight Compute CSV exports -> a short table of where a kernel's time goes
    tuning_report  what the autotuner measured, from its caches
    models         the model shapes the benchmarks time (MODELS)
    scaling        context parallelism's scaling table (notebook 09, the README)

``RESULTS`` is found beside the sources, so it exists in a checkout (the project is installed
editable, as ``requirements.txt`` does).
"""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]       # the repository's root
RESULTS = ROOT / "tests" / "benchmark" / "results"       # the committed measurements
OUTPUT = ROOT / "bench_out"                               # new runs (ignored by git)
