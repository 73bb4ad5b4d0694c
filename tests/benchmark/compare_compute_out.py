"""compute_out before and after a change, side by side: the same configs, the same inputs.

The one-head and several-heads compute_out kernels became one kernel (HEADS_PER_BLOCK a
constant) after commit d059689. This script checks what that changed, against the ``ops``
package of the earlier commit checked out beside this one (loaded under the name ``ops_before``):

    mkdir -p .old && git archive d059689 ops | tar -x -C .old   # the earlier package: .old/ops
    python -m tests.benchmark.compare_compute_out --before .old/ops --sass sm_90 --csv S.csv
    python -m tests.benchmark.compare_compute_out --before .old/ops \
        --cache tests/benchmark/results/autotune_h200.json.gz --also S.csv --csv T.csv

``--sass ARCH`` (no GPU needed) compiles every config of compute_out's search space at each
dstate (16K tokens) for ARCH with both versions, as a launch would specialize them (meta
tensors), and compares the machine code byte for byte (the code sections of the cubins: the
kernel's name, line table and embedded PTX aside): identical code runs at identical speed. (For sm_90 a compile
is reproducible: the same launch compiled twice, disk cache off, gives the same bytes. For
sm_100 with TileIR 13.4 it is not -- two compiles of one launch differ -- so there only the
sizes mean something.)
The inputs are the forward's (D per head, no z, no seq_idx), or with ``--features`` every
optional input (D per headdim column, z, seq_idx).

Without ``--sass`` (a GPU): at each (seqlen, dstate), the compute_out config the tuner chose there
(the autotune cache given by ``--cache``; the default config where it has none) runs through both
versions on the same inputs (bf16, batch 1, 80 heads of 64, one group, chunk 256, D per head, as
the benchmark grid); ``--also S.csv`` adds every config that a ``--sass`` run found to compile
differently, at ``--also-seqlen`` tokens with that run's inputs. The kernels are compiled first,
several processes at a time (``--procs``), into cuTile's disk cache. Each output is compared
with the other version's, then the two are timed alternately (``triton.testing.do_bench``,
median, after warm-up) ``--rounds`` times each; a row gives the median of each version's
medians, their ratio and the spread (largest over smallest) of each version's medians.
"""
import argparse
import csv
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from ops.checks import cdiv
from ops.kernels.compute_out import compute_out_plan, default_config, search_space
from ops.runtime.launch import run

SHAPE = dict(batch=1, nheads=80, headdim=64, ngroups=1, chunk_size=256, dtype=torch.bfloat16)


def load_before(path):
    """The ``ops`` package at ``path`` (a folder holding its ``__init__.py``), as ``ops_before``."""
    spec = importlib.util.spec_from_file_location(
        "ops_before", os.path.join(path, "__init__.py"), submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules["ops_before"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("ops_before.compute_out")


def _plans(before, cfg, inputs):
    """(before's (grid, kernel, args, out, prerequisites), after's Plan) for one config;
    ``inputs`` = (tensors, options) as ``meta_tensors`` or ``make_tensors`` give them."""
    tensors, options = inputs
    grid, kernel, args, out = before.compute_out_plan(*tensors, **options, config=cfg)
    old = (grid, kernel, args, out, before.prerequisites(args))
    new = compute_out_plan(*tensors, **options, config=cfg)
    return old, new


# Machine code ---------------------------------------------------------------------------------

def machine_code(kernel, args, arch):
    """The bytes of the kernel's code sections (ELF ``.text.*``) in its cubin for ``arch``: the
    instructions exactly, without the kernel's name, line table or embedded PTX (which name
    source lines). (nvdisasm 13 cannot decode every sm_90 instruction these kernels contain, so
    the code is compared as bytes.)"""
    from ops.tools import aot
    return text_sections(aot.compile_cubin(kernel, args, arch))


def text_sections(elf):
    """[bytes of each section whose name starts with .text] of a 64-bit little-endian ELF."""
    shoff = int.from_bytes(elf[0x28:0x30], "little")
    shentsize, shnum, shstrndx = (int.from_bytes(elf[o:o + 2], "little") for o in (0x3A, 0x3C, 0x3E))
    headers = []
    for i in range(shnum):
        h = elf[shoff + i * shentsize: shoff + (i + 1) * shentsize]
        name, offset, size = (int.from_bytes(h[0:4], "little"), int.from_bytes(h[24:32], "little"),
                              int.from_bytes(h[32:40], "little"))
        headers.append((name, offset, size))
    strtab_off = headers[shstrndx][1]
    sections = []
    for name, offset, size in headers:
        end = elf.index(b"\0", strtab_off + name)
        if elf[strtab_off + name:end].startswith(b".text"):
            sections.append(elf[offset:offset + size])
    return sections


def meta_tensors(seqlen, dstate, features):
    """compute_out's arguments on meta tensors: D per head and no z (the forward's layer), or
    with ``features`` D per headdim column, z and seq_idx (every optional input)."""
    b, h, p, g, chunk = (SHAPE[k] for k in ("batch", "nheads", "headdim", "ngroups", "chunk_size"))
    meta = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device="meta")
    nchunks = cdiv(seqlen, chunk)
    x = meta(b, seqlen, h, p, dt=SHAPE["dtype"])
    B = meta(b, seqlen, g, dstate, dt=SHAPE["dtype"])
    tensors = (x, B, B, meta(b, h, nchunks, chunk), meta(b, h, nchunks, chunk),
               meta(b, nchunks, h, p, dstate, dt=SHAPE["dtype"]))
    if features:
        return tensors, dict(D=meta(h, p), z=x, seq_idx=meta(b, seqlen, dt=torch.int32))
    return tensors, dict(D=meta(h))


def compare_sass(before, arch, dstates, seqlen, features):
    rows = []
    for dstate in dstates:
        shape = dict(SHAPE, seqlen=seqlen, dstate=dstate)
        space = search_space(**shape)
        tensors, options = meta_tensors(seqlen, dstate, features)
        for cfg in space:
            t0 = time.time()
            (grid, kernel, args, _, _), new = _plans(before, cfg, (tensors, options))
            old_code = machine_code(kernel, args, arch)
            new_code = machine_code(new.kernel, new.args, arch)
            same = old_code == new_code and grid == new.grid
            label = ", ".join(f"{k}={v}" for k, v in cfg.items() if v != space[0][k]) or "default"
            size = sum(map(len, new_code))
            print(f"dstate {dstate:3d}  {label:70s} {size:7d} B of code  "
                  f"{'identical' if same else 'DIFFERENT'}  ({time.time() - t0:.0f} s)", flush=True)
            rows.append(dict(dstate=dstate, features="D2d-z-seq_idx" if features else "D",
                             config=label, same=same, code_bytes_before=sum(map(len, old_code)),
                             code_bytes_after=size, config_json=json.dumps(cfg)))
    n_same = sum(r["same"] for r in rows)
    print(f"{n_same} of {len(rows)} configs compile to identical {arch} code")
    return rows


# Timing on a GPU ------------------------------------------------------------------------------

def make_tensors(seqlen, dstate, features=False, seed=0):
    """compute_out's inputs from random layer inputs, through this version's first two kernels,
    as ``meta_tensors`` lays them out (``features``: D per headdim column, z, three sequences)."""
    from ops.kernels.chunk_cumsum import chunk_cumsum
    from ops.kernels.fwd_pass_state import fwd_pass_state
    from tests.benchmark.bench_forward import make_inputs
    b, h, p, g = SHAPE["batch"], SHAPE["nheads"], SHAPE["headdim"], SHAPE["ngroups"]
    inp = make_inputs(torch, "cuda", b, seqlen, h, p, g, dstate, "bfloat16", seed=seed)
    seq_idx = None
    options = dict(D=inp["D"])
    if features:
        gen = torch.Generator(device="cuda").manual_seed(seed + 1)
        tokens = torch.arange(seqlen, device="cuda")
        seq_idx = ((tokens >= seqlen // 3).int() + (tokens >= seqlen // 2 + 77).int())[None]
        options = dict(D=torch.randn(h, p, device="cuda", generator=gen),
                       z=torch.randn(inp["x"].shape, device="cuda", generator=gen).to(torch.bfloat16),
                       seq_idx=seq_idx.to(torch.int32))
    dt_out, dA = chunk_cumsum(inp["dt"], inp["A"], SHAPE["chunk_size"], dt_bias=inp["dt_bias"],
                              dt_softplus=True)
    states, _ = fwd_pass_state(inp["x"], inp["B"], dt_out, dA, seq_idx=seq_idx,
                               states_dtype=torch.bfloat16)
    return (inp["x"], inp["B"], inp["C"], dt_out, dA, states), options


def tuned_config(cache, seqlen, dstate):
    if cache:
        from ops.results import tuning_report
        try:
            return tuning_report.find(tuning_report.load(cache), "compute_out", seqlen,
                                      dstate)["config"]
        except KeyError:
            pass
    return None


def _warm(task):
    """Compile both versions of one point's config (a worker process: one launch each)."""
    before_path, (seqlen, dstate, cfg, features) = task
    before = load_before(before_path)
    old, new = _plans(before, cfg, make_tensors(seqlen, dstate, features))
    run_before(before, old)
    run(new)
    torch.cuda.synchronize()
    return seqlen, dstate


def run_before(before, old):
    """Launch the earlier version's plan (its prerequisites first)."""
    launch = importlib.import_module("ops_before.launch").launch
    for step in old[4]:
        launch(*step[:3])
    launch(*old[:3])


def label(cfg, seqlen, dstate):
    if cfg is None:
        return "default"
    default = default_config(**SHAPE, seqlen=seqlen, dstate=dstate)
    return ", ".join(f"{k}={v}" for k, v in cfg.items() if default[k] != v) or "default"


def time_point(before, point, rounds):
    """One point's row: both versions on the same inputs, outputs compared, timed alternately."""
    from triton.testing import do_bench
    seqlen, dstate, cfg, features = point
    old, new = _plans(before, cfg, make_tensors(seqlen, dstate, features))
    old[3].fill_(float("nan"))
    new.outputs[0].fill_(float("nan"))
    run_before(before, old)
    run(new)
    a, b = old[3].float(), new.outputs[0].float()
    times = {"before": [], "after": []}
    for _ in range(rounds):
        times["before"].append(do_bench(lambda: run_before(before, old), warmup=50, rep=300,
                                        return_mode="median"))
        times["after"].append(do_bench(lambda: run(new), warmup=50, rep=300,
                                       return_mode="median"))
    ms_old, ms_new = (statistics.median(times[k]) for k in ("before", "after"))
    return dict(seqlen=seqlen, dstate=dstate, features="D2d-z-seq_idx" if features else "D",
                config=label(cfg, seqlen, dstate), before_ms=round(ms_old, 4),
                after_ms=round(ms_new, 4), after_over_before=round(ms_new / ms_old, 4),
                bitwise_equal=bool(torch.equal(old[3], new.outputs[0])),
                max_abs_diff=(a - b).abs().max().item(),
                finite=bool(torch.isfinite(a).all() and torch.isfinite(b).all()),
                spread_before=round(max(times["before"]) / min(times["before"]), 4),
                spread_after=round(max(times["after"]) / min(times["after"]), 4))


def time_points(before_path, points, rounds, procs, out_csv):
    """Rows for ``points``, (seqlen, dstate, config or None, features) each."""
    before = load_before(before_path)
    t0 = time.time()
    with mp.get_context("spawn").Pool(procs) as pool:
        for L, n in pool.imap_unordered(_warm, [(before_path, p) for p in points]):
            print(f"compiled {L} x {n} ({time.time() - t0:.0f} s)", flush=True)
    rows = []
    for point in points:
        row = time_point(before, point, rounds)
        rows.append(row)
        print(f"{row['seqlen']:7d} x {row['dstate']:3d} {row['features']:13s} before "
              f"{row['before_ms']:8.4f} ms  after {row['after_ms']:8.4f} ms  after/before "
              f"{row['after_over_before']:.3f}  bitwise {row['bitwise_equal']}  [{row['config']}]",
              flush=True)
        torch.cuda.empty_cache()
    write_csv(out_csv, rows)
    worst = max(abs(r["after_over_before"] - 1) for r in rows)
    print(f"largest difference: {worst * 100:.1f}% over {len(rows)} points "
          f"({torch.cuda.get_device_name(0)})")
    return rows


def write_csv(path, rows):
    if path:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="folder of the earlier ops package")
    p.add_argument("--sass", metavar="ARCH", help="compare machine code for ARCH (no GPU)")
    p.add_argument("--cache", help="autotune cache whose compute_out configs to time")
    p.add_argument("--seqlens", default="16384,65536,262144")
    p.add_argument("--dstates", default="64,128,256,512")
    p.add_argument("--rounds", type=int, default=5, help="alternating timings of each version")
    p.add_argument("--procs", type=int, default=8, help="processes compiling ahead")
    p.add_argument("--features", action="store_true",
                   help="with --sass: D per headdim column, z and seq_idx too")
    p.add_argument("--csv", help="write the rows here")
    p.add_argument("--also", metavar="SASS_CSV", action="append",
                   help="also time the configs a --sass run found DIFFERENT (its --csv), at "
                        "--also-seqlen tokens (repeatable)")
    p.add_argument("--also-seqlen", type=int, default=16384)
    a = p.parse_args(argv)
    dstates = [int(v) for v in a.dstates.split(",")]
    if a.sass:
        rows = compare_sass(load_before(a.before), a.sass, dstates, 16384, a.features)
        write_csv(a.csv, rows)
        return
    points = [(L, n, tuned_config(a.cache, L, n), False)
              for L in (int(v) for v in a.seqlens.split(",")) for n in dstates]
    for path in a.also or ():
        with open(path) as f:
            points += [(a.also_seqlen, int(r["dstate"]), json.loads(r["config_json"]),
                        r["features"] != "D") for r in csv.DictReader(f) if r["same"] != "True"]
    time_points(a.before, points, a.rounds, a.procs, a.csv)


if __name__ == "__main__":
    sys.exit(main())
