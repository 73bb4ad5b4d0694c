"""Context parallelism's scaling, read from ``tests/benchmark/context_parallel.py``'s CSV: the
table notebook 09 prints and the benchmarks' results table
(``tests/benchmark/README.md``) carries.

    python -m ops.results.scaling tests/benchmark/results/context_parallel_1gpu_h200.csv

A row of that CSV is one (mode, what, world size): ``time_ms`` the slowest rank's median call,
``collective_share`` the largest share of a rank's call spent in the collectives, and
``speedup`` / ``efficiency`` against the world-size-1 row of the same mode, what and sizes, as
the benchmark computed them (strong: T1 / TN; weak: N T1 / TN). The issue's targets read off
the same columns: weak-scaling efficiency at the largest world size, strong-scaling speedup
against the number of GPUs, the collective's share of a step.
"""
import argparse
import math

from .report import load

MODES = ("strong", "weak")
WHATS = ("forward", "step")
HEADER = ("context parallel", "tokens (per GPU)", "GPUs", "ms", "speedup", "efficiency",
          "collective", "peak GiB per GPU")
NUMBERS = ("world_size", "tokens_total", "tokens_per_rank", "time_ms", "collective_share",
           "peak_mib_max", "speedup", "efficiency")


def tokens_text(n):
    """1048576 -> "1M", 262144 -> "256K", 100 -> "100"."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def scaling_rows(rows):
    """The rows in table order (strong before weak, the forward before the step, world sizes
    ascending), each as a dict with its numbers as floats (NaN where the CSV has none).
    Raises ValueError naming the column a row lacks."""
    out = []
    for r in load(rows):
        missing = [k for k in ("mode", "what", *NUMBERS) if k not in r]
        if missing:
            raise ValueError(f"a context-parallel row lacks the column(s) {', '.join(missing)}: "
                             f"{r}")
        out.append({**r, **{k: _number(r[k]) for k in NUMBERS}})
    order = lambda r: (MODES.index(r["mode"]) if r["mode"] in MODES else len(MODES),
                       WHATS.index(r["what"]) if r["what"] in WHATS else len(WHATS),
                       r["world_size"])
    return sorted(out, key=order)


def _cell(value, fmt):
    return "–" if not math.isfinite(value) else fmt.format(value)


def table_cells(rows):
    """One list of strings per row, in ``HEADER``'s order."""
    cells = []
    for r in scaling_rows(rows):
        total, per_rank = int(r["tokens_total"]), int(r["tokens_per_rank"])
        cells.append([f"{r['mode']}, {'training step' if r['what'] == 'step' else r['what']}",
                      f"{tokens_text(total)} ({tokens_text(per_rank)})",
                      str(int(r["world_size"])), _cell(r["time_ms"], "{:.1f}"),
                      _cell(r["speedup"], "{:.2f}×"), _cell(r["efficiency"], "{:.0%}"),
                      _cell(r["collective_share"], "{:.1%}"),
                      _cell(r["peak_mib_max"] / 1024, "{:.1f}")])
    return cells


def markdown(rows):
    """The table as markdown lines (columns from the third right-aligned)."""
    align = ["---", "---"] + ["---:"] * (len(HEADER) - 2)
    return ["| " + " | ".join(c) + " |" for c in [list(HEADER), align, *table_cells(rows)]]


def text(rows):
    """The table as aligned plain text (notebook 09)."""
    lines = [list(HEADER), *table_cells(rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths))) for line in lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="context_parallel.py's CSV")
    p.add_argument("--markdown", action="store_true", help="a markdown table instead of text")
    args = p.parse_args(argv)
    rows = load(args.csv)
    print("\n".join(markdown(rows)) if args.markdown else text(rows))


if __name__ == "__main__":
    main()
