"""The forward-pass benchmark and its reports, importable as ``tests.benchmark.<module>``
(``bench_forward``, ``report``, ``plot``, ``tuning_report``, ``ncu_summary``, ...)."""
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"   # the committed measurements
OUTPUT = RESULTS.parents[2] / "bench_out"                        # new runs (ignored by git)
