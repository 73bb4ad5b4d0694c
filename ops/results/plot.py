"""Plot and summarise a results CSV of bench_forward.py.

    python -m ops.results.plot results.csv --out speedup.png   # the figure
    python -m ops.results.plot results.csv --markdown          # README-ready tables
    python -m ops.results.plot results.csv --summary           # the headline numbers

The figure has three panels, each against the sequence length L (log axis), one colour per dstate:
    1. cutile's speedup over mamba_ssm's Triton kernels: solid at chunk 256 for both, dashed with
       each at its best chunk (when the CSV has several chunks); the line at 1.0 is parity
    2. TileGym's speedup over the Triton kernels, drawn the same way: how the other cuTile
       implementation fares on the same problems. A CSV with no TileGym row but with rows of
       cutile_default (the same kernels at their default configs) shows instead the speedup of
       the autotuned kernels over the defaults
    3. the roofline fraction at chunk 256 -- the share of the hardware limit (peak matmul rate or
       copy bandwidth, whichever binds, measured at the start of the run) that each
       implementation reaches: cutile solid, Triton dotted, TileGym dash-dotted
A point that is missing (an implementation that crashed, failed or was not run) is left out; a
partial CSV plots what it has.

``summary(csv)`` returns the headline numbers as a dict (see report.summary for the keys).
"""
import argparse
import os
import sys


from ops.results import report
from ops.results.report import summary  # noqa: F401  (part of this module's interface)

LINESTYLE = {"cutile": "-", "triton": ":", "tilegym": "-."}


def _series(pts, dstate, num, den, chunk):
    """(L values, speedups of ``num`` over ``den``) for one dstate; ``chunk`` a size or "best"."""
    xs, ys = [], []
    for shape, by_impl in pts.items():
        if shape[6] != dstate:
            continue
        sp = report.speedup(report.pick(by_impl.get(num), chunk), report.pick(by_impl.get(den), chunk))
        if sp is not None:
            xs.append(shape[5])
            ys.append(sp)
    return xs, ys


def plot(source, out, title=None):
    """Write the three-panel figure of a results CSV (or rows) to ``out`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.load(source)
    pts = report.points(rows)
    chunk = report.ref_chunk(rows) if rows else report.REF_CHUNK
    several_chunks = len({r["chunk"] for r in rows}) > 1
    dstates = sorted({s[6] for s in pts})
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(dstates)}

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    ran = {r["impl"] for r in rows if report.is_ok(r)}
    panels = [(axes[0], "cutile", "triton", "cutile vs Triton (mamba_ssm): speedup", "Triton")]
    if "tilegym" in ran or "cutile_default" not in ran:
        panels.append((axes[1], "tilegym", "triton", "TileGym vs Triton (mamba_ssm): speedup", "Triton"))
    else:
        panels.append((axes[1], "cutile", "cutile_default", "cutile: tuned vs default configs",
                       "the default configs"))
    for ax, num, den, heading, den_name in panels:
        drawn = Drawn()
        for n in dstates:
            drawn.plot(ax, *_series(pts, n, num, den, chunk), n, f"both called at chunk {chunk}", "-",
                       colors, marker="o")
            if several_chunks:
                drawn.plot(ax, *_series(pts, n, num, den, "best"), n, "each at its best chunk",
                           "--", colors, marker="s", alpha=0.7, markersize=4)
        _log_if_wide(ax)                    # before the reference line, which it would count
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_title(heading)
        ax.set_ylabel(f"speedup over {den_name} (higher is better)")
        drawn.finish(ax, colors)

    ax = axes[2]
    drawn = Drawn()
    for impl in ("cutile", "triton", "tilegym"):
        for n in dstates:
            xs, ys = [], []
            for shape, by_impl in pts.items():
                r = report.pick(by_impl.get(impl), chunk)
                if shape[6] == n and report.is_ok(r) and r.get("roofline_fraction") is not None:
                    xs.append(shape[5])
                    ys.append(r["roofline_fraction"])
            drawn.plot(ax, xs, ys, n, impl, LINESTYLE[impl], colors, marker="o", markersize=3)
    ax.set_title(f"Roofline fraction, called at chunk {chunk}")
    ax.set_ylabel("roofline time / measured time (1.0 = hardware limit)")
    ax.set_ylim(bottom=0)
    drawn.finish(ax, colors)

    if title is None and rows:
        r0 = rows[0]
        title = (f"Mamba-2 SSD forward, {r0.get('nheads')} heads x headdim {r0.get('headdim')}, "
                 f"{r0.get('ngroups')} group(s), {r0.get('dtype')}, batch {r0.get('batch')} "
                 f"-- {r0.get('device') or 'unknown device'}")
    fig.suptitle(title or "Mamba-2 SSD forward")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _log_if_wide(ax, span=4.0):
    """A logarithmic y axis when the speedups drawn span more than ``span``x (host-bound small
    shapes can reach speedups an order of magnitude above the rest's; on a linear axis the rest
    would look flat)."""
    import matplotlib.ticker as ticker
    ys = [y for line in ax.get_lines() for y in line.get_ydata() if y > 0]
    if ys and max(ys) / min(ys) > span:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())


class Drawn:
    """What one panel has drawn, so that its ticks and legend name only that: the sequence
    lengths with a point, the dstates with a line, the line styles used."""

    def __init__(self):
        self.seqlens, self.dstates, self.styles = set(), set(), {}

    def plot(self, ax, xs, ys, dstate, style_name, linestyle, colors, **kw):
        if not xs:
            return
        ax.plot(xs, ys, linestyle=linestyle, color=colors[dstate], **kw)
        self.seqlens.update(xs)
        self.dstates.add(dstate)
        self.styles[style_name] = linestyle

    def finish(self, ax, colors):
        """Axis, ticks and a compact legend: one entry per colour (dstate), one per line style."""
        from matplotlib.lines import Line2D
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length L")
        ax.grid(True, which="major", alpha=0.3)
        if not self.seqlens:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                    color="gray")
            return
        ticks = sorted(self.seqlens)
        ax.set_xticks(ticks)
        ax.set_xticklabels([report.fmt_len(L) for L in ticks])
        ax.minorticks_off()
        handles = [Line2D([], [], color=colors[n], linewidth=3, label=f"dstate {n}")
                   for n in sorted(self.dstates)]
        handles += [Line2D([], [], color="gray", linestyle=ls, label=name)
                    for name, ls in self.styles.items()]
        ax.legend(handles=handles, fontsize=7)


def markdown(source):
    """README-ready tables: each implementation at chunk 256, and (if the CSV has a chunk sweep)
    each at its best chunk."""
    rows = report.load(source)
    if not rows:
        return "(no results)"
    chunk = report.ref_chunk(rows)
    impls = report.impls_in(rows)
    subject = report.SUBJECT if report.SUBJECT in impls else impls[-1]
    parts = [f"Time per forward call (ms) at chunk {chunk}; the speedups are {subject}'s (other's time / "
             f"{subject}'s); roofline: the share of the hardware limit {subject} reaches.\n",
             report.table(rows, chunk=chunk, markdown=True)]
    if len({r["chunk"] for r in rows}) > 1:
        parts += ["\nEach implementation at its best chunk (in parentheses):\n",
                  report.table(rows, chunk="best", markdown=True)]
    return "\n".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="a results CSV written by bench_forward.py")
    ap.add_argument("--out", default=None, help="PNG to write (default: the CSV's name with .png)")
    ap.add_argument("--markdown", action="store_true", help="print README-ready tables instead of plotting")
    ap.add_argument("--summary", action="store_true", help="print the headline numbers instead of plotting")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    if args.markdown or args.summary:
        if args.markdown:
            print(markdown(args.csv))
        if args.summary:
            print(report.summary_text(summary(args.csv)))
        return 0
    out = args.out or os.path.splitext(args.csv)[0] + ".png"
    plot(args.csv, out, title=args.title)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
