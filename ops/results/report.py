"""Turn benchmark rows into the numbers a reader decides with: speedups, best chunks, tables.

Shared by ``bench_forward.py`` (its closing table) and ``plot.py`` (the figure, the README table
and ``summary``). A row is one (implementation, shape, chunk) measurement, as ``bench_forward.py``
writes it to its CSV; ``load`` reads such a CSV back with numbers as numbers.

Conventions used throughout:
    speedup of A over B  = B's time / A's time   (above 1: A is faster)
    the reference chunk  = 256 if the rows have it, else their largest chunk
    best chunk           = an implementation's fastest successful chunk for a shape
"""
import csv
import math

REF_CHUNK = 256
SUBJECT = "cutile"                      # the implementation the tables and summary are about
COLUMN_ORDER = ("triton", "tilegym", "cutile_default", "cutile", "reference", "interpret")
SHAPE_KEYS = ("batch", "nheads", "headdim", "ngroups", "dtype", "seqlen", "dstate")

INT_COLUMNS = {"batch", "seqlen", "nheads", "headdim", "ngroups", "dstate", "chunk", "compute_chunk",
               "flops", "bytes", "fwd_chunk", "bwd_chunk", "launches", "blocks"}
FLOAT_COLUMNS = {"ms", "tflops", "gbps", "roofline_ms", "roofline_fraction", "rel_err", "peak_mem_mb",
                 "first_call_s", "task_s", "peak_tflops", "peak_gbps", "warmup_ms", "rep_ms",
                 # fwd_bwd.py's
                 "fwd_bwd_ms", "fwd_ms", "graph_ms", "bare_ms", "first_s", "peak_mib", "speedup",
                 # work_count.py's
                 "macs", "loaded", "stored"}
BOOL_COLUMNS = {"finite", "best_chunk"}


# Reading -------------------------------------------------------------------------------------

def load(source):
    """Rows from a CSV path (typed: ints, floats, bools; empty cells become None), or a copy of
    a list of row dicts."""
    if not isinstance(source, (str, bytes)) and not hasattr(source, "__fspath__"):
        return [dict(r) for r in source]
    with open(source, newline="") as f:
        return [_typed(r) for r in csv.DictReader(f)]


def write_csv(path, rows):
    """Write ``rows`` (dicts with the same keys) as a CSV file with a header."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _typed(raw):
    row = {}
    for key, value in raw.items():
        if value is None or value == "":
            row[key] = None
        elif key in INT_COLUMNS:
            row[key] = int(float(value))
        elif key in FLOAT_COLUMNS:
            row[key] = float(value)
        elif key in BOOL_COLUMNS:
            row[key] = value == "True"
        else:
            row[key] = value
    return row


def is_ok(row):
    return row is not None and row.get("status") == "ok" and row.get("ms") is not None


def shape_of(row):
    return tuple(row.get(k) for k in SHAPE_KEYS)


def points(rows):
    """{shape: {impl: {chunk: row}}}, shapes in (L, dstate) order."""
    out = {}
    for r in rows:
        out.setdefault(shape_of(r), {}).setdefault(r["impl"], {})[r["chunk"]] = r
    return dict(sorted(out.items(), key=lambda kv: (kv[0][5], kv[0][6], str(kv[0][:5]))))


def ref_chunk(rows):
    chunks = {r["chunk"] for r in rows if r.get("chunk") is not None}
    return REF_CHUNK if REF_CHUNK in chunks or not chunks else max(chunks)


def best_row(by_chunk):
    """The fastest successful row among one implementation's chunks (None if none succeeded)."""
    good = [r for r in (by_chunk or {}).values() if is_ok(r)]
    return min(good, key=lambda r: r["ms"]) if good else None


def pick(by_chunk, chunk):
    """The row at ``chunk``, or the best chunk's row when ``chunk == "best"``."""
    if chunk == "best":
        return best_row(by_chunk)
    return (by_chunk or {}).get(chunk)


def speedup(subject_row, other_row):
    """other's time / subject's time, or None unless both succeeded."""
    if is_ok(subject_row) and is_ok(other_row):
        return other_row["ms"] / subject_row["ms"]
    return None


def geomean(values):
    values = [v for v in values if v is not None]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def impls_in(rows):
    present = {r["impl"] for r in rows}
    return [i for i in COLUMN_ORDER if i in present] + sorted(present - set(COLUMN_ORDER))


def fmt_len(n):
    """1024 -> "1K", 262144 -> "256K", 1000 -> "1000"."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)


def short_status(row):
    """A table cell for a row that did not produce a time: "crashed", "failed", "skipped"..."""
    if row is None:
        return "-"
    status = row.get("status") or "-"
    return status.split(":")[0].split(" (")[0]


# The summary ---------------------------------------------------------------------------------

def summary(source, subject=SUBJECT, baseline="triton", peer="tilegym", long_seqlen=65536, target=1.8):
    """The headline numbers of a results CSV (or rows), as a dict:

        chunk                      the chunk compared at (256 unless the rows lack it)
        points                     shapes where both ``subject`` and ``baseline`` ran at that chunk
        geomean_speedup            geometric mean of subject's speedup over baseline at that chunk
        worst, best                {"seqlen", "dstate", "speedup"} of the smallest / largest speedup
        slower_than_baseline       the points with speedup < 1, as such dicts
        below_target_long          points with seqlen >= ``long_seqlen`` and speedup < ``target``
        geomean_speedup_best_chunks  the same geometric mean, each at its best chunk
        vs_peer                    per shape: subject vs ``peer``, each at its best chunk:
                                   {"seqlen", "dstate", "subject_chunk", "peer_chunk", "speedup"}
        geomean_vs_peer            their geometric mean
        roofline_seqlen            256K if present, else the longest sequence in the rows
        roofline_fraction          {dstate: subject's roofline fraction} at that seqlen and chunk
        not_compared               points where either side did not produce a time:
                                   {"seqlen", "dstate", subject: status, baseline: status}
    """
    rows = load(source)
    chunk = ref_chunk(rows)
    pts = points(rows)

    def point(shape, sp, **extra):
        return dict(seqlen=shape[5], dstate=shape[6], speedup=sp, **extra)

    at_chunk, at_best, vs_peer, not_compared = [], [], [], []
    for shape, by_impl in pts.items():
        mine, theirs = by_impl.get(subject), by_impl.get(baseline)
        if mine is None and theirs is None:
            continue
        sp = speedup(pick(mine, chunk), pick(theirs, chunk))
        if sp is not None:
            at_chunk.append(point(shape, sp))
        elif mine is not None and theirs is not None:
            not_compared.append({"seqlen": shape[5], "dstate": shape[6],
                                 subject: short_status(pick(mine, chunk)),
                                 baseline: short_status(pick(theirs, chunk))})
        sp_best = speedup(best_row(mine), best_row(theirs))
        if sp_best is not None:
            at_best.append(point(shape, sp_best))
        mine_best, peer_best = best_row(mine), best_row(by_impl.get(peer))
        sp_peer = speedup(mine_best, peer_best)
        if sp_peer is not None:
            vs_peer.append(point(shape, sp_peer, subject_chunk=mine_best["chunk"],
                                 peer_chunk=peer_best["chunk"]))

    longest = max((s[5] for s in pts), default=None)
    roof_L = 262144 if any(s[5] == 262144 for s in pts) else longest
    roofline = {}
    for shape, by_impl in pts.items():
        r = pick(by_impl.get(subject), chunk)
        if shape[5] == roof_L and is_ok(r) and r.get("roofline_fraction") is not None:
            roofline[shape[6]] = r["roofline_fraction"]

    by_speed = sorted(at_chunk, key=lambda p: p["speedup"])
    return {
        "subject": subject, "baseline": baseline, "peer": peer, "chunk": chunk,
        "points": len(at_chunk),
        "geomean_speedup": geomean(p["speedup"] for p in at_chunk),
        "worst": by_speed[0] if by_speed else None,
        "best": by_speed[-1] if by_speed else None,
        "slower_than_baseline": [p for p in by_speed if p["speedup"] < 1.0],
        "below_target_long": [p for p in by_speed if p["seqlen"] >= long_seqlen and p["speedup"] < target],
        "target": target, "long_seqlen": long_seqlen,
        "geomean_speedup_best_chunks": geomean(p["speedup"] for p in at_best),
        "vs_peer": vs_peer,
        "geomean_vs_peer": geomean(p["speedup"] for p in vs_peer),
        "roofline_seqlen": roof_L,
        "roofline_fraction": roofline,
        "not_compared": not_compared,
    }


def summary_text(s):
    """The summary as a few readable lines."""
    if not s["points"] and not s["vs_peer"]:
        return f"no point where both {s['subject']} and {s['baseline']} ran at chunk {s['chunk']}"
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)
    where = lambda p: f"L={fmt_len(p['seqlen'])} dstate={p['dstate']} ({p['speedup']:.2f}x)"
    lines = [f"{s['subject']} over {s['baseline']} at chunk {s['chunk']}: geometric mean "
             f"{f(s['geomean_speedup'])}x over {s['points']} points"
             + (f"; worst {where(s['worst'])}, best {where(s['best'])}" if s["worst"] else ""),
             f"  each at its best chunk: {f(s['geomean_speedup_best_chunks'])}x",
             f"  slower than {s['baseline']}: "
             + (", ".join(where(p) for p in s["slower_than_baseline"]) or "none"),
             f"  L >= {fmt_len(s['long_seqlen'])} below {s['target']}x: "
             + (", ".join(where(p) for p in s["below_target_long"]) or "none")]
    if s["vs_peer"]:
        lines.append(f"{s['subject']} over {s['peer']}, each at its best chunk: geometric mean "
                     f"{f(s['geomean_vs_peer'])}x; worst "
                     + where(min(s["vs_peer"], key=lambda p: p["speedup"])))
    if s["roofline_fraction"]:
        lines.append(f"{s['subject']} roofline fraction at L={fmt_len(s['roofline_seqlen'])}: "
                     + ", ".join(f"dstate {n}: {v:.0%}" for n, v in sorted(s["roofline_fraction"].items())))
    for p in s["not_compared"]:
        lines.append(f"  not compared at L={fmt_len(p['seqlen'])} dstate={p['dstate']}: "
                     + ", ".join(f"{k} {v}" for k, v in p.items() if k not in ("seqlen", "dstate")))
    return "\n".join(lines)


# Tables --------------------------------------------------------------------------------------

def table(source, chunk=None, markdown=True, subject=SUBJECT, rel_err=False):
    """One line per (L, dstate): each implementation's time, the subject's speedup over each
    other implementation, and the subject's roofline fraction.

    ``chunk``: a chunk size, "best" (each implementation at its own fastest chunk; the chunk is
    shown next to the time), or None for the reference chunk. ``rel_err`` adds the largest
    relative error of any implementation against the baseline at that point.
    """
    rows = load(source)
    if not rows:
        return "(no results)"
    chunk = ref_chunk(rows) if chunk is None else chunk
    impls = impls_in(rows)
    if subject not in impls:
        subject = impls[-1]
    others = [i for i in impls if i != subject]
    header = (["L", "dstate"] + [f"{i} ms" for i in impls] + [f"vs {i}" for i in others]
              + [f"{subject} roofline"] + (["max rel err"] if rel_err else []))
    lines = []
    for shape, by_impl in points(rows).items():
        picked = {i: pick(by_impl.get(i), chunk) for i in impls}
        cells = [fmt_len(shape[5]), str(shape[6])]
        for i in impls:
            r = picked[i]
            if is_ok(r):
                cells.append(f"{r['ms']:.3f}" + (f" ({r['chunk']})" if chunk == "best" else ""))
            elif chunk == "best":
                cells.append(short_status(next(iter((by_impl.get(i) or {}).values()), None)))
            else:
                cells.append(short_status(r))
        for i in others:
            sp = speedup(picked[subject], picked[i])
            cells.append("-" if sp is None else f"{sp:.2f}x")
        r = picked[subject]
        frac = r.get("roofline_fraction") if is_ok(r) else None
        cells.append("-" if frac is None else f"{frac:.0%}")
        if rel_err:
            errs = [(r["rel_err"], i) for i in impls for r in (by_impl.get(i) or {}).values()
                    if r.get("rel_err") is not None]
            cells.append(f"{max(errs)[0]:.1e} ({max(errs)[1]})" if errs else "-")
        lines.append(cells)
    return _render(header, lines, markdown)


def _render(header, lines, markdown):
    if markdown:
        right = ["---:" if i >= 2 else "---" for i in range(len(header))]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, right] + lines)
    widths = [max(len(c[i]) for c in [header] + lines) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in [header] + lines)


def failures(source):
    """Lines naming the points that did not produce a time (skipped ones excluded), one line per
    implementation and message."""
    grouped = {}
    for r in load(source):
        status = r.get("status") or ""
        if status != "ok" and not status.startswith("skipped"):
            where = f"L={fmt_len(r['seqlen'])}/dstate={r['dstate']}/chunk={r['chunk']}"
            grouped.setdefault((r["impl"], status), []).append(where)
    return [f"{impl} {status}\n      at {', '.join(where)}" for (impl, status), where in grouped.items()]
