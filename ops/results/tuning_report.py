"""Read an autotune cache (``ops/tuning/autotune.py``'s JSON) as measurements: what each knob is worth.

The tuner keeps, for every (kernel, shape) it searched, the time of every candidate config
(CUDA events, GPU time only, on the real inputs). Compared with the default config's time at the
same shape, each candidate says what its changes bought or cost there.

    python -m ops.results.tuning_report tests/benchmark/results/autotune_h200.json.gz
    python -m ops.results.tuning_report CACHE --kernel compute_out --seqlen 65536 --dstate 512

    python -m ops.results.tuning_report CACHE --chunk 128 --against OLD_TABLE.json
    python -m ops.results.tuning_report CACHE --chunk 128 --against ops/tuning/tuned_configs.json --new-gpu

``load(path)`` -> entries (chunk 256's); ``knobs(entry)`` -> one row per candidate (its changes from the
default, time, speedup); ``best_single_knob(entries, kernel)`` -> for each knob, the speedup of
the best candidate that changes only that knob (and occupancy, which goes with tiles), per shape;
``against_table(entries, table)`` -> what a refresh of the table gained at the searched shapes:
the time, in the same search, of the config an earlier table (``ops.tuning.autotune.Table``) chose
there (its own entry, or one borrowed from the nearest tuned shape or from another GPU of the same
compute capability), against the winner's; with ``new_gpu``, what the table would give an unknown
GPU of the searched GPU's compute capability.
"""
import argparse
import os

from ops.tuning.autotune import Table, parse_key, read_cache

# Knobs, and the names the notebook and tables use for them.
KNOB_NAMES = {
    "INDEX64": "64-bit indexing (no TMA)",
    "SWAP": "operand order swapped",
    "HEADS_PER_BLOCK": "heads per block",
    "CHUNKS_PER_ITER": "chunks per iteration",
    "LOAD_LAT": "load latency hint",
    "STORE_LAT": "store latency hint",
    "occupancy": "occupancy",
    "BLOCK_M": "BLOCK_M", "BLOCK_K": "BLOCK_K", "BLOCK_P": "BLOCK_P", "BLOCK_N": "BLOCK_N",
    "BLOCK_H": "BLOCK_H", "DSTATE_TILE": "DSTATE_TILE",
    "SCORES_IN_MEMORY": "C*B^T from memory", "PERSISTENT": "persistent blocks",
    "num_worker_warps": "worker warps",
}


def load(path, chunk_size=256):
    """-> list of entries: dict(kernel, device, shape (dict), config, ms, default, default_ms,
    timings [(ms, config), ...], capability (the GPU's, where the search recorded it, else
    None)). The default is the first candidate timed (the search spaces put it first); entries
    without per-candidate timings are skipped. Only entries tuned at ``chunk_size`` are kept
    (None: every chunk size), so that one (seqlen, dstate) names one entry."""
    raw = read_cache(path)                 # caches are committed gzipped
    entries = []
    for key, value in raw.items():
        if not value.get("timings"):
            continue
        kernel, device, items = parse_key(key)
        shape = {k: int(v) if v.isdigit() else v for k, v in items.items()}
        if chunk_size is not None and shape.get("chunk_size") != chunk_size:
            continue
        timings = [(float(ms), cfg) for ms, cfg in value["timings"]]
        entries.append(dict(kernel=kernel, device=device, shape=shape, config=value["config"],
                            ms=float(value["ms"]), default=timings[0][1],
                            default_ms=timings[0][0], timings=timings,
                            capability=value.get("capability")))
    entries.sort(key=lambda e: (e["kernel"], e["shape"].get("dstate", 0), e["shape"].get("seqlen", 0)))
    return entries


def find(entries, kernel, seqlen, dstate):
    for e in entries:
        if e["kernel"] == kernel and e["shape"]["seqlen"] == seqlen and e["shape"]["dstate"] == dstate:
            return e
    raise KeyError(f"no {kernel} entry at seqlen={seqlen} dstate={dstate}")


def changes(cfg, default):
    return {k: v for k, v in cfg.items() if default.get(k) != v}


def label(diff):
    return ", ".join(f"{k}={v}" for k, v in diff.items()) or "default"


def knobs(entry):
    """Rows (label, ms, speedup over the default), fastest first."""
    rows = [(label(changes(cfg, entry["default"])), ms, entry["default_ms"] / ms)
            for ms, cfg in entry["timings"]]
    return sorted(rows, key=lambda r: r[1])


def best_single_knob(entries, kernel, knob):
    """{(seqlen, dstate): best speedup over the default among candidates that change ``knob``
    and nothing else but occupancy} -- what that one change can buy at each shape."""
    out = {}
    for e in entries:
        if e["kernel"] != kernel:
            continue
        best = None
        for ms, cfg in e["timings"]:
            diff = changes(cfg, e["default"])
            if knob in diff and set(diff) <= {knob, "occupancy"}:
                sp = e["default_ms"] / ms
                best = sp if best is None else max(best, sp)
        if best is not None:
            out[(e["shape"]["seqlen"], e["shape"]["dstate"])] = best
    return out


def min_bytes(kernel, *, seqlen, nheads=80, headdim=64, ngroups=1, dstate, chunk_size=256, esize=2,
              batch=1):
    """The bytes one kernel of the forward pass must move at least (each input read once, each
    output written once), with the entry states stored in the inputs' dtype as ops.forward does
    and dt, dA in float32. Unlike the whole pass's minimum (bench_forward.work_counts), this
    counts the entry states, which the three-kernel split writes and reads back."""
    L, h, p, g, n = batch * seqlen, nheads, headdim, ngroups, dstate
    nchunks = batch * -(-seqlen // chunk_size)
    x, bc, per_head_f32 = L * h * p * esize, L * g * n * esize, L * h * 4
    states = nchunks * h * p * n * esize
    if kernel == "chunk_cumsum":
        return 3 * per_head_f32                              # dt in; dt_out, dA_cumsum out
    if kernel == "fwd_pass_state":
        return x + bc + 2 * per_head_f32 + states + batch * h * p * n * 4   # + final state
    if kernel == "compute_out":
        return 2 * x + 2 * bc + 2 * per_head_f32 + states   # x in, out; B, C; dt, dA; states
    raise ValueError(f"unknown kernel {kernel!r}")


def against_table(entries, table, new_gpu=False):
    """Rows (kernel, shape, what ``table`` chose, its ms, the winner's ms, speedup), from the
    search's own timings: both configs timed in one run on the same inputs. What it chose:
    "entry" (this shape's own), "nearest" (a nearby shape's), "borrowed" or "borrowed nearest"
    (another GPU's of the same compute capability, at this shape or a nearby one: ``Table.choice``)
    or "default". ``table`` is an ``ops.tuning.autotune.Table``; it chooses among the configs the
    search timed, so an entry whose config the search did not time is passed over, as the forward
    would pass it over. The searched GPU's compute capability is the table's ``devices``' for it,
    else the search's own record. ``new_gpu``: the table without the searched GPU's own entries,
    choosing with that capability: what an unknown GPU of the searched GPU's compute capability
    would get."""
    rows = []
    for e in entries:
        candidates = [cfg for _, cfg in e["timings"]]
        want = {k: v for k, v in e["shape"].items() if k != "space"}
        seen = table
        if new_gpu:
            seen = Table([t for t in table.entries if t["device"] != e["device"]], table.devices)
        found = seen.choice(e["kernel"], e["device"], want, candidates,
                            table.devices.get(e["device"], e.get("capability")))
        if found is None:
            how, chosen = "default", e["default"]
        else:
            chosen, entry = found
            here = entry["shape"] == {k: str(v) for k, v in want.items()}
            if entry["device"] == e["device"]:
                how = "entry" if here else "nearest"
            else:
                how = "borrowed" if here else "borrowed nearest"
        ms = next(t for t, cfg in e["timings"] if cfg == chosen)
        rows.append((e["kernel"], want, how, ms, e["ms"], ms / e["ms"]))
    return rows


def markdown(entry, top=None):
    lines = [f"{entry['kernel']} at L={entry['shape']['seqlen']}, dstate={entry['shape']['dstate']} "
             f"({entry['device']}): default {entry['default_ms']:.3f} ms, tuned {entry['ms']:.3f} ms",
             "", "| config (changes from the default) | ms | speedup |", "| --- | ---: | ---: |"]
    for name, ms, sp in knobs(entry)[:top]:
        lines.append(f"| {name} | {ms:.3f} | {sp:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cache")
    ap.add_argument("--kernel", default=None)
    ap.add_argument("--seqlen", type=int, default=None)
    ap.add_argument("--dstate", type=int, default=None)
    ap.add_argument("--top", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=256, help="the entries tuned at this chunk size")
    ap.add_argument("--against", metavar="TABLE", help="an earlier tuned table (ops/tuning/tuned_configs.json "
                    "as it was): the time of its choice at each searched shape against the winner's")
    ap.add_argument("--new-gpu", action="store_true",
                    help="with --against: the table without the searched GPU's own entries (what "
                         "another GPU of its compute capability, unknown to the table, would get)")
    args = ap.parse_args(argv)
    entries = [e for e in load(args.cache, chunk_size=args.chunk)
               if not ((args.kernel and e["kernel"] != args.kernel)
                       or (args.seqlen and e["shape"]["seqlen"] != args.seqlen)
                       or (args.dstate and e["shape"]["dstate"] != args.dstate))]
    if args.new_gpu and not args.against:
        ap.error("--new-gpu needs --against TABLE")
    if args.against:
        if not os.path.exists(args.against):
            raise SystemExit(f"--against: no table at {args.against!r} (a tuned_configs.json)")
        whose = "its choice for an unknown GPU of this capability" if args.new_gpu \
            else "earlier table's choice"
        print(f"| kernel | batch x seqlen x heads, groups, dstate | {whose} | its ms | "
              "tuned ms | speedup |\n| --- | --- | --- | ---: | ---: | ---: |")
        rows = against_table(entries, Table.load(args.against), new_gpu=args.new_gpu)
        for kernel, s, how, ms, tuned, sp in rows:
            print(f"| {kernel} | {s['batch']} x {s['seqlen']} x {s['nheads']}, {s['ngroups']}, "
                  f"{s['dstate']} | {how} | {ms:.4f} | {tuned:.4f} | {sp:.2f}x |")
        return
    for e in entries:
        print(markdown(e, args.top))
        print()


if __name__ == "__main__":
    main()
