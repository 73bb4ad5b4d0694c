"""A training step's scan: forward + backward against mamba_ssm's Triton kernels, side by side.

    python -m tests.benchmark.fwd_bwd [--models mamba2-2.7b-train ...] [--chunks 256,128] [--out F.csv]

At each model shape of ``tests/benchmark/models.py`` (bf16, D, dt_bias, softplus), on the same
seeded inputs (``bench_forward.make_inputs``) for both, and with the same output gradient:
    fwd_bwd_ms   median of ``triton.testing.do_bench`` of one step: the forward with x, dt, A, B,
                 C, D and dt_bias requiring gradients, then ``out.backward(dout)``
    fwd_ms       the forward alone, without gradients
    first_s      the first step (compilation and autotuning included)
    peak_mib     memory allocated during one step beyond what was allocated before it
    grad_diff    each gradient's relative difference (in norm) from Triton's at chunk 256
Triton runs at chunk 256, this project at each of ``--chunks``.
"""
import argparse
import time

import torch

IMPLS = ("triton", "cutile")
LEAVES = ("x", "dt", "A", "B", "C", "D", "dt_bias")


def _scan(impl):
    if impl == "triton":
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined
    from ops import mamba_chunk_scan_combined
    return lambda *a, **k: mamba_chunk_scan_combined(*a, **k, backend="cutile")


def measure(impl, chunk, inputs, dout):
    """-> (row of timings, the gradients of one step)."""
    from triton.testing import do_bench
    scan = _scan(impl)
    leaves = {k: v.detach().clone().requires_grad_(k in LEAVES) for k, v in inputs.items()}

    def step():
        for t in leaves.values():
            t.grad = None
        out = scan(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
                   D=leaves["D"], dt_bias=leaves["dt_bias"], dt_softplus=True)
        out.backward(dout)

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    grads = {k: leaves[k].grad.float().clone() for k in LEAVES}
    for t in leaves.values():
        t.grad = None                   # the step's gradients count in its peak
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    fwd_bwd = do_bench(step, warmup=50, rep=300)
    with torch.no_grad():
        fwd = do_bench(lambda: scan(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"],
                                    chunk, D=inputs["D"], dt_bias=inputs["dt_bias"],
                                    dt_softplus=True), warmup=50, rep=200)
    return dict(impl=impl, chunk=chunk, fwd_bwd_ms=fwd_bwd, fwd_ms=fwd, first_s=first,
                peak_mib=peak), grads


def main(argv=None):
    from tests.benchmark.bench_forward import make_inputs
    from tests.benchmark.models import MODELS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mamba2-2.7b-train", "mamba2-130m-train"],
                        choices=sorted(MODELS))
    parser.add_argument("--chunks", default="256,128", help="this project's chunks, e.g. 256,128")
    parser.add_argument("--out", help="CSV file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fwd_bwd needs a CUDA GPU")
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = []
    for name in args.models:
        m = MODELS[name]
        inputs = make_inputs(torch, "cuda", m["batch"], m["seqlen"], m["nheads"], m["headdim"],
                             m["ngroups"], m["dstate"], "bfloat16")
        dout = torch.randn(inputs["x"].shape, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(1)).to(inputs["x"].dtype)
        base, ref = measure("triton", 256, inputs, dout)
        results = [(base, ref)] + [measure("cutile", c, inputs, dout) for c in chunks]
        for row, grads in results:
            row.update(model=name, speedup=base["fwd_bwd_ms"] / row["fwd_bwd_ms"],
                       **{f"grad_diff_{k}": ((grads[k] - ref[k]).norm() / ref[k].norm()).item()
                          for k in LEAVES})
            rows.append(row)
            print(f"{name:20s} {row['impl']:7s} chunk {row['chunk']:3d}: fwd+bwd "
                  f"{row['fwd_bwd_ms']:7.3f} ms ({row['speedup']:.2f}x Triton's), fwd "
                  f"{row['fwd_ms']:.3f} ms, first step {row['first_s']:.1f} s, peak "
                  f"+{row['peak_mib']:.0f} MiB, grad diff <= "
                  f"{max(row[f'grad_diff_{k}'] for k in LEAVES):.1e}", flush=True)
    if args.out:
        from tests.benchmark.report import write_csv
        device = torch.cuda.get_device_name()
        write_csv(args.out, [dict(r, device=device, torch=torch.__version__) for r in rows])


if __name__ == "__main__":
    main()
