"""What a headdim or dstate that is not a power of two costs: the forward pass timed at such sizes
beside the powers of two around them, in one run, on one GPU.

    python -m tests.benchmark.odd_sizes [--shape batch=1,seqlen=16384,nheads=80] [--out F.csv]

Each size is timed with ``triton.testing.do_bench`` (median, after warm-up) on the default path
(committed table or defaults; the odd sizes have no table entry, so their default configs run),
and its time is also given per useful element of x (batch x seqlen x heads x headdim), which
shows the padding: headdim 48 runs in 64-wide tiles.
"""
import argparse

import torch

SIZES = [(64, 128), (48, 128), (96, 128), (128, 128), (64, 96), (64, 64), (64, 200), (64, 256)]


def main(argv=None):
    from triton.testing import do_bench

    from ops import mamba_chunk_scan_combined
    from ops.tools.tune import DEFAULTS, make_inputs, parse_shape

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="batch=1,seqlen=16384,nheads=80")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    rows = []
    for headdim, dstate in SIZES:
        shape = parse_shape(args.shape, DEFAULTS)
        shape.update(headdim=headdim, dstate=dstate)
        kw = make_inputs(shape, torch.bfloat16, "D")
        with torch.no_grad():
            call = lambda: mamba_chunk_scan_combined(**kw, chunk_size=shape["chunk_size"],
                                                     dt_softplus=True, backend="cutile")
            out = call()
            assert torch.isfinite(out).all()
            ms = do_bench(call, warmup=25, rep=100)
        elements = shape["batch"] * shape["seqlen"] * shape["nheads"] * headdim
        rows.append(dict(shape=args.shape, headdim=headdim, dstate=dstate, ms=ms,
                         ns_per_element=ms * 1e6 / elements, device=torch.cuda.get_device_name()))
        print(f"headdim {headdim:3d} dstate {dstate:3d}: {ms:7.3f} ms  "
              f"{rows[-1]['ns_per_element']:.4f} ns per x element", flush=True)
    if args.out:
        from ops.results.report import write_csv
        write_csv(args.out, rows)


if __name__ == "__main__":
    main()
