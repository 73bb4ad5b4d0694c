"""Merge benchmark CSVs from several runs into one, a row per (impl, seqlen, dstate, chunk).

    python tests/benchmark/merge_results.py OUT.csv RUN1.csv RUN2.csv ...

For grids split over runs (one GPU each, or a run resumed later): where two inputs hold the same
point for the same implementation, the later input wins, so list the runs oldest first. Each row
keeps its own provenance columns (git_commit, started_at, env), so notebook 07 can still say which
run measured what. Rows are written in the order bench_forward.py uses: implementation (as first
seen), then L, dstate and chunk. Inputs must share one header; a mismatch is an error, not a guess.
"""
import argparse
import csv
import sys

KEY = ("impl", "seqlen", "dstate", "chunk")


def merge(paths):
    """-> (header, rows): the rows of ``paths``, later files replacing earlier ones point by point."""
    header, merged, impl_order = None, {}, []
    for path in paths:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if header is None:
                header = reader.fieldnames
                missing = [k for k in KEY if k not in header]
                if missing:
                    raise ValueError(f"{path}: no column(s) {', '.join(missing)}")
            elif reader.fieldnames != header:
                raise ValueError(f"{path}: its columns differ from {paths[0]}'s; merge runs of one "
                                 f"version of bench_forward.py")
            for row in reader:
                if row["impl"] not in impl_order:
                    impl_order.append(row["impl"])
                merged[tuple(row[k] for k in KEY)] = row
    if header is None:
        raise ValueError("no input files")
    rows = sorted(merged.values(), key=lambda r: (impl_order.index(r["impl"]), int(r["seqlen"]),
                                                   int(r["dstate"]), int(r["chunk"])))
    return header, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    args = ap.parse_args(argv)
    header, rows = merge(args.inputs)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}: {len(rows)} rows from {len(args.inputs)} file(s)", file=sys.stderr)


if __name__ == "__main__":
    main()
