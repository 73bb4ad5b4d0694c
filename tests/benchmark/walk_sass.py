"""The backward's walk over the chunks, each variant the tuner may time, as machine code.

    python -m tests.benchmark.walk_sass [--arch sm_90] [--dstates 64,128,256] [--out F.csv]

No GPU needed. Every config of ``bwd_pass_state.walk_space`` (the walk as ``ops/backward.py``
runs it: FUSE_ENTRY, no initial states) at one layer of 1 x 16K tokens x 80 heads of 64, one
group, bf16, chunk 128, is compiled for ``--arch`` as a launch specializes it (meta tensors) and
its machine code counted (``ops.tools.sass``): instructions, registers, shared memory, spills,
block-wide barriers (``BAR``), mbarrier operations (``SYNCS``), shared-memory loads and stores
and matrix instructions. A row per (dstate, config); ``config`` names the keys that differ
from the chain's own config, the first row of each dstate.

The counts are static (a loop's body counts once), so they say what a step of the walk waits
on, not how long: the tuner's timings (``python -m ops.tools.tune search --backward-only``) decide.

The committed ``results/bwd_pass_state_walk_sass_sm90.csv`` was compiled when the chain's own
config formed each chunk's product in 64-token tiles at every dstate: its rows are the space the
committed searches timed (``autotune_backward_chunk128_h100.json``, ``..._h200.json``), labelled
as their timings are, from that config. Since then the chain takes the whole chunk at dstate 64
(``bwd_pass_state.walk_config``), which that CSV holds as ``ENTRY_BLOCK_T=128``; a new run
labels the dstate-64 rows from it, and its space keeps the 64-token tiles (``ENTRY_BLOCK_T=64``)
and no longer pairs them with the other keys.
"""
import argparse
import csv
import json
import math
import sys

import torch

from ops.results.report import write_csv

def walk_plan(config, dstate, seqlen=16384, nheads=80, headdim=64, chunk=128):
    """The walk's launch at the layer above, on meta tensors."""
    from ops.kernels.backward.bwd_pass_state import bwd_pass_state_plan
    meta = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")
    nchunks = -(-seqlen // chunk)
    return bwd_pass_state_plan(None, None, meta(1, nchunks, nheads, headdim, dstate),
                               meta(1, nheads, nchunks, chunk, dt=torch.float32), None,
                               config=config, ds_dtype=torch.bfloat16,
                               dy=meta(1, seqlen, nheads, headdim), C=meta(1, seqlen, 1, dstate),
                               with_dinitial=False)


def differences(config, own):
    """The keys of ``config`` that differ from ``own``, as text ("chain's own" for none)."""
    keys = [f"{k}={v}" for k, v in config.items() if own.get(k) != v]
    return " ".join(keys) or "chain's own"


def rows(arch="sm_90", dstates=(64, 128, 256), limit=None):
    """One row (a dict, the CSV's columns in order) per config of ``walk_space`` at each dstate; ``limit``: the
    first configs only."""
    import importlib.metadata as md
    from ops.kernels.backward.bwd_pass_state import walk_space
    from ops.tools.sass import sass_report
    version = md.version("cuda-tile")
    out = []
    for dstate in dstates:
        space = walk_space(batch=1, nheads=80, headdim=64, dstate=dstate, chunk_size=128,
                           dtype=torch.bfloat16, states_dtype=torch.bfloat16)[:limit]
        for config in space:
            plan = walk_plan(config, dstate)
            r = sass_report(plan.kernel, plan.args, arch)
            print(f"dstate {dstate}: {differences(config, space[0])}", file=sys.stderr)
            out.append(dict(arch=arch, dstate=dstate, config=differences(config, space[0]),
                            blocks=math.prod(plan.grid), instructions=r.instructions, registers=r.registers,
                            shared=r.shared, spill_bytes=r.spill_load_bytes + r.spill_store_bytes,
                            bar=r.count("BAR"), syncs=r.count("SYNCS"), lds=r.count("LDS"),
                            sts=r.count("STS"), mma=r.mma_count,
                            config_json=json.dumps(config, sort_keys=True), cuda_tile=version))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--dstates", default="64,128,256")
    parser.add_argument("--out", help="CSV to write (default: print)")
    args = parser.parse_args(argv)
    try:
        dstates = tuple(int(d) for d in args.dstates.split(","))
    except ValueError:
        parser.error(f"--dstates: comma-separated integers, got {args.dstates!r}")
    table = rows(args.arch, dstates)
    if args.out:
        write_csv(args.out, table)
    else:
        writer = csv.DictWriter(sys.stdout, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)


if __name__ == "__main__":
    main()
