"""Merge benchmark CSVs from several runs into one, a row per point of the grid.

    python -m tests.benchmark.merge_results OUT.csv RUN1.csv RUN2.csv ...
    python -m tests.benchmark.merge_results --share 1K,4K,16K,64K,256K 0,1    # split L over GPUs

For grids split over runs (one GPU each, or a run resumed later): where two inputs hold the same
point for the same implementation, the later input wins, so list the runs oldest first. Each row
keeps its own provenance columns (git_commit, started_at, env), so notebook 07 can still say which
run measured what. A point is what bench_forward.py calls one (``point_key``: implementation,
shape, chunk, dtype). Rows are written grouped by implementation (in the order first seen), then
by L, dstate and chunk. Inputs must share one header; a mismatch is an error, not a guess.

``--share LENGTHS GPUS`` prints how ``run_h200.sh`` (with ``GPUS=...``) shares the sequence lengths
of a grid out over several GPUs, one line per GPU that gets any: "GPU LENGTHS". A point's cost grows
with L, so the longest lengths go first, each to the GPU with the least work so far; every point's
implementations still run one after another on one GPU, side by side.
"""
import argparse
import csv
import sys

from tests.benchmark.bench_forward import parse_lengths, point_key


def merge(paths):
    """-> (header, rows): the rows of ``paths``, later files replacing earlier ones point by point."""
    header, merged, impl_order = None, {}, []
    for path in paths:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if header is None:
                header = reader.fieldnames
            elif reader.fieldnames != header:
                raise ValueError(f"{path}: its columns differ from {paths[0]}'s; merge runs of one "
                                 f"version of bench_forward.py")
            for row in reader:
                if row["impl"] not in impl_order:
                    impl_order.append(row["impl"])
                try:
                    merged[point_key(row)] = row
                except KeyError as e:
                    raise ValueError(f"{path}: no column {e} (not a bench_forward.py CSV)") from None
    if header is None:
        raise ValueError("no input files")
    rows = sorted(merged.values(), key=lambda r: (impl_order.index(r["impl"]), int(r["seqlen"]),
                                                   int(r["dstate"]), int(r["chunk"])))
    return header, rows


def share(lengths, gpus):
    """-> [(gpu, [length text, ...]), ...]: the longest length first, each to the least-loaded GPU
    (work taken as proportional to L); each share in increasing L; GPUs left without work omitted."""
    items = [t.strip() for t in lengths.split(",") if t.strip()]
    devices = [g.strip() for g in gpus.split(",") if g.strip()]
    if not items or not devices:
        raise ValueError("--share needs at least one length and one GPU")
    length = dict(zip(items, parse_lengths(",".join(items))))     # "16K" -> 16384
    load = {g: 0 for g in devices}
    shares = {g: [] for g in devices}
    for item in sorted(items, key=length.get, reverse=True):
        g = min(devices, key=lambda d: (load[d], devices.index(d)))
        load[g] += length[item]
        shares[g].append(item)
    return [(g, sorted(shares[g], key=length.get)) for g in devices if shares[g]]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--share"]:
        if len(argv) != 3:
            raise SystemExit("usage: merge_results.py --share LENGTHS GPUS")
        for gpu, items in share(argv[1], argv[2]):
            print(gpu, ",".join(items))
        return
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
