"""Run one implementation's forward pass a few times at one shape, for a profiler to watch.

    ncu --clock-control none --nvtx --nvtx-include profile/ --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats \\
        python -m tests.benchmark.profile_forward --impl cutile --seqlen 64K --dstate 256 --reps 1
    tests/benchmark/profile_ncu.sh                  # the usual set, reports in $OUT

The inputs are the benchmark's (``bench_forward.make_inputs``: the same seeded random Mamba-2 layer
call). The first call compiles and, for cutile, autotunes (or reads the tuner's cache); then
``--reps`` more calls run, each followed by a synchronize, so a profiler that skips the first
launches sees warm, tuned kernels; those calls run inside an NVTX range named "profile", so
``ncu --nvtx --nvtx-include profile/`` sees only them. ``--device cpu`` with ``--impl interpret``
is a dry run.
"""
import argparse
import sys
import time

from tests.benchmark import bench_forward


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="cutile", choices=bench_forward.IMPLS)
    ap.add_argument("--seqlen", default="64K")
    ap.add_argument("--dstate", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--nheads", type=int, default=80)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--ngroups", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=sorted(bench_forward.DTYPES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    import torch
    seqlen = bench_forward.parse_lengths(args.seqlen)[0]
    inp = bench_forward.make_inputs(torch, args.device, 1, seqlen, args.nheads, args.headdim, args.ngroups,
                                    args.dstate, bench_forward.DTYPES[args.dtype])
    fn = bench_forward.build(args.impl, inp, args.chunk)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        t0 = time.perf_counter()
        fn()
        sync()
        print(f"{args.impl} L={seqlen} dstate={args.dstate} chunk={args.chunk}: first call "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        for _ in range(args.reps):
            t0 = time.perf_counter()
            if args.device.startswith("cuda"):
                with torch.cuda.nvtx.range("profile"):   # ncu --nvtx --nvtx-include profile/
                    fn()
            else:
                fn()
            sync()
            print(f"  call {(time.perf_counter() - t0) * 1e3:.3f} ms (wall, unprofiled only)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
