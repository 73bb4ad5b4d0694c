"""Summarise Nsight Compute's raw CSV page (``ncu --import R --csv --page raw``), a few lines per kernel.

    python -m ops.results.ncu_summary tests/benchmark/results/ncu/ncu_cutile_64K_256_compute128.csv

Per kernel launch: duration, compute (SM) and memory throughput as a share of peak, achieved
occupancy against the theoretical one, registers per thread, and the warp stall reasons that cost
the most (cycles a warp spends stalled per issued instruction, by reason). A metric the CSV lacks
(another ncu version, another section set) is shown as "-".
"""
import argparse
import csv
import re
import sys

COLUMNS = {
    "duration_us": ("gpu__time_duration.sum",),
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "mem_pct": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
                "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    "occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "theoretical_occupancy_pct": ("sm__maximum_warps_per_active_cycle_pct",),
    "registers": ("launch__registers_per_thread",),
    "grid": ("launch__grid_size",),
    "block": ("launch__block_size",),
}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(.+)_per_issue_active\.ratio$")
TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def _number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def read(path):
    """-> list of dicts, one per kernel launch: name, the COLUMNS above, and stalls {reason: ratio}."""
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("==")]   # ncu's own messages
    table = list(csv.reader(lines))
    if len(table) < 3:
        return []
    header, units, rows = table[0], table[1], table[2:]
    index = {name: i for i, name in enumerate(header)}
    out = []
    for row in rows:
        get = lambda name: row[index[name]] if name in index and index[name] < len(row) else None
        rec = {"name": get("Kernel Name") or "?"}
        for key, names in COLUMNS.items():
            rec[key] = None
            for name in names:
                value = _number(get(name))
                if value is not None:
                    if key == "duration_us":
                        value *= TIME_UNITS.get(units[index[name]].strip().lower(), 1.0)
                    rec[key] = value
                    break
        rec["stalls"] = {}
        for name, i in index.items():
            m = STALL.match(name)
            value = _number(row[i]) if m and i < len(row) else None
            if value:
                rec["stalls"][m.group(1)] = value
        out.append(rec)
    return out


def summary_lines(records, top=4):
    f = lambda v, spec: "-" if v is None else format(v, spec)
    lines = []
    for r in records:
        lines.append(f"{r['name'][:60]}: {f(r['duration_us'], '.1f')} us; SM {f(r['sm_pct'], '.0f')}% "
                     f"memory {f(r['mem_pct'], '.0f')}% of peak; occupancy {f(r['occupancy_pct'], '.0f')}% "
                     f"(theoretical {f(r['theoretical_occupancy_pct'], '.0f')}%); "
                     f"{f(r['registers'], '.0f')} registers; grid {f(r['grid'], '.0f')} x {f(r['block'], '.0f')}")
        stalls = sorted(r["stalls"].items(), key=lambda kv: -kv[1])[:top]
        if stalls:
            total = sum(r["stalls"].values())
            lines.append("    stalls per issued instruction: " + ", ".join(
                f"{k} {v:.1f} ({v / total:.0%})" for k, v in stalls))
    return lines


LINE = re.compile(r"(?P<name>.+?): (?P<duration_us>[\d.]+) us; SM (?P<sm_pct>[\d.]+)% memory "
                  r"(?P<mem_pct>[\d.]+)% of peak; occupancy (?P<occupancy_pct>[\d.]+)% \(theoretical "
                  r"(?P<theoretical_occupancy_pct>[\d.]+)%\); (?P<registers>\d+) registers; grid "
                  r"(?P<grid>\d+) x (?P<block>\d+)$")
STALL_ITEM = re.compile(r"(\w+) ([\d.]+) \(\d+%\)")


def read_summary(path):
    """The text ``summary_lines`` writes, read back -> {section: [record]}: a line starting with
    "## " opens a section (the part of a results file one run wrote); each kernel line becomes a
    dict like ``read``'s (name, the COLUMNS as numbers, stalls {reason: ratio}, the top reasons
    only). Lines of neither kind (comments, blank lines) are skipped. A committed profile keeps
    this summary rather than ncu's raw page, which is forty times larger."""
    sections, current = {}, None
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("## "):
                current = sections.setdefault(line[3:].strip(), [])
            elif current is not None and (m := LINE.match(line)):
                rec = {k: (v if k == "name" else float(v)) for k, v in m.groupdict().items()}
                rec["stalls"] = {}
                current.append(rec)
            elif current and line.strip().startswith("stalls per issued instruction:"):
                current[-1]["stalls"] = {k: float(v) for k, v in STALL_ITEM.findall(line)}
    return sections


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="A few lines per kernel from Nsight Compute's raw CSV page (ncu --import R "
                    "--csv --page raw): duration, throughput against peak, occupancy, registers, "
                    "the main warp stall reasons.")
    parser.add_argument("csv", nargs="+", help="ncu raw-page CSV files")
    parser.add_argument("--min-us", type=float, default=0.0,
                        help="leave out kernels shorter than this many microseconds")
    args = parser.parse_args(argv)
    for path in args.csv:
        records = [r for r in read(path)
                   if r["duration_us"] is None or r["duration_us"] >= args.min_us]
        print("\n".join(summary_lines(records)) or f"{path}: no kernel rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
