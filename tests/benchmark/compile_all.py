"""Compile every config of every kernel's search space ahead of time, and report which compile.

    python -m tests.benchmark.compile_all                          # sm_90, dstate 128 and 256
    python -m tests.benchmark.compile_all --arch sm_90,sm_100 --dstates 64,128,256,512 --jobs 2
    python -m tests.benchmark.compile_all --kernels compute_out --csv compile.csv

A tuner times each config of ``search_space`` on the GPU; a config that does not compile would
only waste its time there, so this script checks them all beforehand, on any machine (no GPU:
see ``ops/tools/aot.py``). The shape is a Mamba-2 layer of a ~2.7B model: batch 1, 16K tokens, 80
heads of 64, one group, bf16, chunks of 256 (only dtypes, the compile-time sizes -- chunk,
headdim, dstate, tiles -- and the flags change the code; the tensors are "meta" tensors). The
launches are those of ``ops.forward``: dt bias and softplus, D per head, no z, entry states in
x's dtype.

For each config it prints the compile time and, when ``ops.tools.sass`` is available (it needs
NVIDIA's nvdisasm and cuobjdump), the registers per thread, threads per block, spilled
registers and shared memory of the machine code: a config that spills is legal but a poor bet.
By default the kernel is compiled as a launch would specialize it (``ops.tools.aot.launch_signature``:
16-byte alignment, unit strides); ``--generic`` compiles ``ops.tools.aot.signature_of``'s signature
for arbitrary arrays instead. The compiler's disk cache is bypassed so the times are real.
Exit status 1 if any config fails.
"""
import argparse
import concurrent.futures as futures
import csv
import json
import os
import sys
import time

os.environ.setdefault("CUDA_TILE_CACHE_DIR", "off")   # measure compiles, not cache hits

import torch

from ops.forward import KERNELS
from ops.tools.plans import SHAPE, meta_plan

# ops.tools.plans' representative layer, in the keys the kernel modules' config functions take.
LAYER = dict({k: v for k, v in SHAPE.items() if k not in ("chunk", "dstate")},
             chunk_size=SHAPE["chunk"], dtype=torch.bfloat16)


def shape(dstate, **overrides):
    """The shape dict that ``default_config`` / ``search_space`` take."""
    return {**LAYER, "dstate": dstate, **overrides}


def plan(name, shp, config):
    """The ``Plan`` of one launch of kernel ``name`` for shape ``shp`` with ``config``: the
    representative launch of ``ops.tools.sass`` (the same layer, as ``ops.forward`` calls it) at
    ``shp``'s dstate and dtype, with the launches it needs first (its ``before``)."""
    layer = {k: v for k, v in SHAPE.items() if k != "chunk"}
    layer.update(chunk_size=SHAPE["chunk"], dstate=shp["dstate"])
    return meta_plan(name, dtype=shp["dtype"], **layer, config=config)


def _sass():
    """``ops.tools.sass`` if it and its NVIDIA tools are available, else None (then only compile)."""
    try:
        from ops.tools import sass
        sass.find_tool("nvdisasm")
        sass.find_tool("cuobjdump")
        return sass
    except (ImportError, RuntimeError):
        return None


def compile_one(name, shp, config, arch, generic):
    """Compile one config; returns a dict for the report (never raises)."""
    row = dict(kernel=name, dstate=shp["dstate"], arch=arch, config=json.dumps(config))
    start = time.perf_counter()
    try:
        launch = plan(name, shp, config)
        kernel, args = launch.kernel, launch.args
        from ops.tools.aot import compile_cubin
        for step in launch.before:       # a config's first launches (chunk_scores, chunk states)
            compile_cubin(step.kernel, step.args, arch, specialize=not generic)
        sass = _sass()
        if sass is not None:
            report = sass.sass_report(kernel, args, arch, specialize=not generic)
            row.update(registers=report.registers, threads=report.threads,
                       spill_loads=report.spill_loads, spill_stores=report.spill_stores,
                       shared=report.shared)
        else:
            compile_cubin(kernel, args, arch, specialize=not generic)
        row["status"] = "ok"
    except Exception as e:   # report it and go on: the point is to list every failure
        row["status"] = "FAIL"
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def diff(config, default):
    """The config's keys that differ from the default (what a row is about)."""
    d = {k: v for k, v in config.items() if default.get(k) != v}
    return ", ".join(f"{k}={v}" for k, v in d.items()) or "(default)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90", help="comma-separated, e.g. sm_90,sm_100")
    ap.add_argument("--dstates", default="128,256")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="compiles in parallel (processes)")
    ap.add_argument("--generic", action="store_true",
                    help="compile ops.tools.aot's signature for arbitrary arrays instead of a launch's")
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    opts = ap.parse_args(argv)

    jobs = []
    for name in opts.kernels.split(","):
        module = KERNELS[name]
        for n in map(int, opts.dstates.split(",")):
            shp = shape(n)
            default = module.default_config(**shp)
            for config in module.search_space(**shp):
                for arch in opts.arch.split(","):
                    jobs.append((name, shp, config, arch, diff(config, default)))
    print(f"{len(jobs)} compiles, {opts.jobs} at a time", flush=True)

    rows, start = [], time.perf_counter()
    with futures.ProcessPoolExecutor(max_workers=opts.jobs) as pool:
        running = {pool.submit(compile_one, name, shp, cfg, arch, opts.generic): label
                   for name, shp, cfg, arch, label in jobs}
        for done in futures.as_completed(running):
            row = {**done.result(), "variant": running[done]}
            rows.append(row)
            extra = (f"regs {row['registers']:3d} x {row['threads']:3d} threads, "
                     f"spills {row['spill_loads']}/{row['spill_stores']}, "
                     f"smem {row['shared'] // 1024} KiB" if "registers" in row else "")
            print(f"{row['status']:4s} {row['seconds']:5.1f}s {row['kernel']:14s} "
                  f"n={row['dstate']:<3d} {row['arch']:6s} {row['variant']:60s} "
                  f"{row.get('error', extra)}", flush=True)

    failed = [r for r in rows if r["status"] != "ok"]
    total = time.perf_counter() - start
    print(f"\n{len(rows) - len(failed)} compiled, {len(failed)} failed, "
          f"{sum(r['seconds'] for r in rows):.0f} s of compiling in {total:.0f} s")
    for r in failed:
        print(f"FAILED {r['kernel']} n={r['dstate']} {r['arch']} {r['variant']}: {r['error']}")
    if opts.csv:
        keys = ["kernel", "dstate", "arch", "variant", "status", "seconds", "registers",
                "threads", "spill_loads", "spill_stores", "shared", "error", "config"]
        with open(opts.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(sorted(rows, key=lambda r: (r["kernel"], r["dstate"], r["arch"])))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
