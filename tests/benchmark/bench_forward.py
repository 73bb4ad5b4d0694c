"""Time the Mamba-2 SSD forward of this project against its peers, on one CUDA GPU.

    python tests/benchmark/bench_forward.py --seqlens 16384,65536 --dstates 128,256 --csv results.csv

Implementations (each optional: one that cannot be imported is skipped, and the run says so):
    cutile     this project, ``ops.mamba_chunk_scan_combined(backend="cutile")``
    triton     mamba_ssm's ``mamba_chunk_scan_combined`` (the published baseline), forward only
    tilegym    NVIDIA TileGym's ``tilegym.ops.cutile.mamba2.mamba2_chunk_forward`` (takes processed
               dt and needs seqlen divisible by its chunk size; we feed it equivalent inputs)
    reference  this project's PyTorch chunked reference (small sizes only)

Every implementation gets the same random inputs (a Mamba-2 layer's call: D, dt_bias, softplus,
no z), is timed with ``triton.testing.do_bench`` (median after warm-up), and its output is compared
with the first implementation's output of the same run. With ``--isolate`` each (implementation,
shape) runs in its own process, so one that crashes the CUDA context is recorded as failed and the
run goes on; outputs are then compared on saved slices (the first and last tokens).
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SLICE = 1024   # tokens kept from each end of the output for cross-process comparison


# Problem --------------------------------------------------------------------------------------

def make_inputs(batch, seqlen, nheads, headdim, ngroups, dstate, dtype, seed=0):
    """Random inputs (never zeros), generated on the GPU from a fixed seed: identical per run."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float32)
    return dict(
        x=r(batch, seqlen, nheads, headdim).to(dtype),
        dt=r(batch, seqlen, nheads) * 0.5 - 1.0,                     # softplus(dt + bias) ~ 0.1-1
        A=-torch.exp(r(nheads) * 0.5),                               # Mamba-2: A = -exp(A_log)
        B=r(batch, seqlen, ngroups, dstate).to(dtype),
        C=r(batch, seqlen, ngroups, dstate).to(dtype),
        D=r(nheads),
        dt_bias=r(nheads) * 0.5,
    )


def flops_and_bytes(batch, seqlen, nheads, headdim, ngroups, dstate, chunk, dtype):
    """Useful flops (causal half of the chunk blocks) and the fewest bytes any implementation moves."""
    flops = batch * (4 * seqlen * nheads * headdim * dstate          # write states + read them with C
                     + seqlen * chunk * ngroups * dstate             # C B^T, causal half
                     + seqlen * chunk * nheads * headdim)            # (C B^T o L) x, causal half
    esize = torch.tensor([], dtype=dtype).element_size()
    nbytes = batch * seqlen * (2 * nheads * headdim * esize          # read x, write out
                               + 2 * ngroups * dstate * esize        # read B, C
                               + nheads * 4)                         # read dt (fp32)
    nbytes += batch * nheads * headdim * dstate * 4                  # write the final state
    return flops, nbytes


# Implementations ------------------------------------------------------------------------------

def build(impl, inp, chunk):
    """A zero-argument callable running one forward pass; raises ImportError if not installed."""
    common = dict(D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True)
    if impl == "cutile":
        from ops import mamba_chunk_scan_combined
        return lambda: mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk,
                                                 **common, backend="cutile")
    if impl == "triton":
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as triton_fwd
        return lambda: triton_fwd(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, **common)
    if impl == "reference":
        from ops import mamba_chunk_scan_combined
        return lambda: mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk,
                                                 **common, backend="reference")
    if impl == "tilegym":
        from tilegym.ops.cutile.mamba2 import mamba2_chunk_forward
        from reference.common import process_dt
        dt_proc = process_dt(inp["dt"], inp["dt_bias"], True).to(torch.float32)   # its dt is processed
        b, _, h, p = inp["x"].shape
        h0 = torch.zeros(b, h, p, inp["B"].shape[-1], device="cuda", dtype=torch.float32)
        return lambda: mamba2_chunk_forward(inp["x"], inp["A"], inp["B"], inp["C"], inp["D"], dt_proc, h0,
                                            chunk_size=chunk)[0]
    raise ValueError(f"unknown implementation {impl!r}")


def run_one(impl, shape, chunk, dtype, warmup_ms, rep_ms):
    """Time one implementation on one shape. Returns (row dict, output tensor or None)."""
    import triton.testing
    batch, seqlen, nheads, headdim, ngroups, dstate = shape
    row = dict(impl=impl, batch=batch, seqlen=seqlen, nheads=nheads, headdim=headdim, ngroups=ngroups,
               dstate=dstate, chunk=chunk, dtype=str(dtype).replace("torch.", ""))
    inp = make_inputs(batch, seqlen, nheads, headdim, ngroups, dstate, dtype)
    try:
        fn = build(impl, inp, chunk)
    except ImportError as e:
        row.update(status=f"not installed ({e.name})")
        return row, None
    try:
        with torch.no_grad():
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    except Exception as e:  # a compile failure or a crash is a result too
        row.update(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        return row, None
    flops, nbytes = flops_and_bytes(batch, seqlen, nheads, headdim, ngroups, dstate, chunk, dtype)
    row.update(status="ok", ms=ms, tflops=flops / ms / 1e9, gbps=nbytes / ms / 1e6,
               peak_mem_mb=peak / 2**20, finite=bool(torch.isfinite(out).all()))
    return row, out


def environment():
    """Device, driver and package versions, recorded with every result."""
    import importlib.metadata as md
    env = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        env["driver"] = "unknown"
    for pkg in ("triton", "cuda-tile", "mamba_ssm", "tilegym"):
        env[pkg] = _version(pkg)
    return env


def _version(pkg):
    """A package's version from its metadata, else its __version__ (the device bundle puts some
    packages on the path without metadata), else 'not installed'."""
    import importlib
    import importlib.metadata as md
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        pass
    try:
        return getattr(importlib.import_module(pkg.replace("-", ".")), "__version__", "unknown")
    except Exception:
        return "not installed"


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# Driver ---------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="triton,cutile,tilegym", help="the first is the one others are compared with")
    ap.add_argument("--seqlens", default="16384,65536")
    ap.add_argument("--dstates", default="128,256")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nheads", type=int, default=80)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--ngroups", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--warmup-ms", type=float, default=100)
    ap.add_argument("--rep-ms", type=float, default=500)
    ap.add_argument("--csv", default=None, help="write the results here")
    ap.add_argument("--isolate", action="store_true", help="one process per implementation and shape")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dtype = DTYPES[args.dtype]
    impls = args.impls.split(",")

    if args.worker:   # child process of --isolate: one (impl, shape), result as JSON + output slices
        shape = tuple(int(v) for v in args.seqlens.split(":"))
        row, out = run_one(impls[0], shape, args.chunk, dtype, args.warmup_ms, args.rep_ms)
        if out is not None:
            torch.save(torch.cat([out[:, :SLICE], out[:, -SLICE:]], 1).cpu(), args.worker + ".pt")
        with open(args.worker + ".json", "w") as f:
            json.dump(row, f)
        return

    env = environment()
    print(" | ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    shapes = [(args.batch, L, args.nheads, args.headdim, args.ngroups, n)
              for L in map(int, args.seqlens.split(",")) for n in map(int, args.dstates.split(","))]
    rows, total, k = [], len(shapes) * len(impls), 0
    tmp = tempfile.mkdtemp()
    for shape in shapes:
        outs = {}
        for impl in impls:
            k += 1
            t0 = time.time()
            print(f"[{k}/{total}] {impl:9s} L={shape[1]:7d} dstate={shape[5]:4d} ...", end=" ", flush=True)
            if args.isolate:
                stem = os.path.join(tmp, f"{impl}_{k}")
                cmd = [sys.executable, __file__, "--worker", stem, "--impls", impl, "--seqlens",
                       ":".join(map(str, shape)), "--chunk", str(args.chunk), "--dtype", args.dtype,
                       "--warmup-ms", str(args.warmup_ms), "--rep-ms", str(args.rep_ms)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if os.path.exists(stem + ".json"):
                    row = json.load(open(stem + ".json"))
                    out = torch.load(stem + ".pt") if os.path.exists(stem + ".pt") else None
                else:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                    row = dict(impl=impl, seqlen=shape[1], dstate=shape[5], status=f"crashed: {tail[0][:200]}")
                    out = None
            else:
                row, out = run_one(impl, shape, args.chunk, dtype, args.warmup_ms, args.rep_ms)
            if out is not None:
                if outs:
                    first = next(iter(outs))
                    row["rel_err"], row["rel_err_vs"] = rel_err(out, outs[first]), first
                outs[impl] = out
            row.update(env)
            rows.append(row)
            ms = row.get("ms")
            print(f"{row['status'] if ms is None else f'{ms:8.3f} ms'}  ({time.time() - t0:.0f} s)", flush=True)
        del outs
        torch.cuda.empty_cache()

    _print_table(rows, impls)
    if args.csv:
        keys = sorted({k for r in rows for k in r}, key=lambda s: (s not in ("impl", "seqlen", "dstate"), s))
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")


def _print_table(rows, impls):
    print(f"\n{'seqlen':>7} {'dstate':>6} " + " ".join(f"{i + ' ms':>12}" for i in impls)
          + "  speedup cutile/triton  rel_err")
    keyed = {}
    for r in rows:
        keyed.setdefault((r["seqlen"], r["dstate"]), {})[r["impl"]] = r
    for (L, n), by in keyed.items():
        cells = [f"{by[i]['ms']:12.3f}" if by.get(i, {}).get("ms") else f"{'-':>12}" for i in impls]
        sp = (by["triton"]["ms"] / by["cutile"]["ms"]
              if by.get("triton", {}).get("ms") and by.get("cutile", {}).get("ms") else math.nan)
        errs = " ".join(f"{i}:{by[i]['rel_err']:.1e}" for i in impls if "rel_err" in by.get(i, {}))
        print(f"{L:7d} {n:6d} " + " ".join(cells) + f"  {sp:21.2f}  {errs}")


if __name__ == "__main__":
    main()
