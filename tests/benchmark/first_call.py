"""How long the first call of the forward pass takes, in a fresh process, on a GPU.

    python -m tests.benchmark.first_call [--shape batch=8,seqlen=2048,nheads=80] [--out F.csv]

Two processes run one forward call each at the same shape, sharing a cuTile compile cache that
starts empty: the first sees the shape for the first time (it compiles the three kernels), the
second is a new process at a shape already seen (the compiled kernels come from the disk cache).
Each reports the wall time of its first call (synchronised) and of a second call in the same
process; the configs come from the default path (cache, committed table, defaults: no search).
The ``table`` column says whether the committed table has the shape itself ("exact": its tuned
configs) or lends the configs of the nearest tuned shape ("nearest"); by default one shape of
each kind is run.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import torch
from ops import mamba_chunk_scan_combined
from ops.tools.tune import make_inputs, parse_shape, DEFAULTS
shape = parse_shape(sys.argv[1], DEFAULTS)
kw = make_inputs(shape, torch.bfloat16, "D")
torch.cuda.synchronize()
times = []
for _ in range(2):
    start = time.perf_counter()
    with torch.no_grad():
        mamba_chunk_scan_combined(**kw, chunk_size=shape["chunk_size"], dt_softplus=True, backend="cutile")
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
print(json.dumps({"first_s": times[0], "second_s": times[1]}))
"""


def table_match(shape_text):
    """"exact" if the committed table has compute_out's entry for this shape, else "nearest"."""
    import torch
    from ops.tuning import autotune
    from ops.forward import tuning_key
    from ops.tools.tune import DEFAULTS, parse_shape
    shape = dict(parse_shape(shape_text, DEFAULTS), dtype=torch.bfloat16,
                 states_dtype=torch.bfloat16, on_gpu=True)
    key, _ = tuning_key("compute_out", shape, "D")
    want = {k: str(v) for k, v in key.items() if k != "space"}
    exact = any(e["kernel"] == "compute_out" and e["device"] == torch.cuda.get_device_name()
                and e["shape"] == want for e in autotune.table().entries)
    return "exact" if exact else "nearest"


def run(shape_text):
    rows = []
    match = table_match(shape_text)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CUDA_TILE_CACHE_DIR=cache,
                   MAMBA2_CUTILE_AUTOTUNE_CACHE=os.path.join(cache, "autotune.json"))
        env.pop("MAMBA2_CUTILE_AUTOTUNE", None)              # the default path: no search
        for case in ("unseen shape", "new process, seen shape"):
            res = subprocess.run([sys.executable, "-c", CHILD, shape_text], env=env,
                                 capture_output=True, text=True, check=True)
            timing = json.loads(res.stdout.strip().splitlines()[-1])
            rows.append({"shape": shape_text, "table": match, "case": case, **timing})
            print(f"{shape_text:32s} ({match}) {case:24s} first call {timing['first_s']:6.2f} s, "
                  f"then {timing['second_s'] * 1e3:7.2f} ms", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", help="e.g. batch=8,seqlen=2048,nheads=80")
    parser.add_argument("--out", help="CSV file to write")
    args = parser.parse_args(argv)
    shapes = args.shape or ["batch=8,seqlen=2048,nheads=80", "batch=2,seqlen=3072,nheads=48"]
    rows = [r for s in shapes for r in run(s)]
    if args.out:
        from ops.results.report import write_csv
        write_csv(args.out, rows)


if __name__ == "__main__":
    main()
