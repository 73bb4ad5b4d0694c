"""How much work a training step's kernels ask for: this project's and TileGym's, kernel by kernel.

    python -m tests.benchmark.work_count [--shape 1x1024x32x1] [--dstates 64,128]
        [--chunks 128,64] [--tilegym-chunk 64] [--tilegym-configs first,largest] [--out F.csv]

A timing says how long a step took on one GPU; this says what its kernels asked of any GPU. One
training step (forward with every input requiring a gradient, then ``out.backward(dout)``: bf16,
headdim 64, D, dt_bias, softplus; ``fwd_bwd.py``'s inputs and output gradient) runs on the CPU
interpreter under ``ops.interpreter.count_work``, which counts each kernel's launches, blocks,
multiply-adds (``ct.mma`` / ``ct.matmul``) and the bytes its box loads and stores moved inside
its arrays (``ops/interpreter/work.py`` says exactly what is counted). Per implementation:

    cutile    this project's step at each of ``--chunks``, computed at that chunk (the
              interpreter keeps the caller's chunk: ``ops/tuning/compute_chunk.py``), with the
              kernels' default configs (the interpreter is not tuned)
    tilegym   TileGym's step (``fwd_bwd.py``'s ``TileGymScan``) at ``--tilegym-chunk``, its
              kernels run on the interpreter (``tilegym_on_interpreter``), its autotuning off,
              with each of ``--tilegym-configs``: its first config of every kernel, and the first
              with the kernel's largest state tile; where TileGym is installed, else left out

The multiply-adds do not depend on a config; the bytes do: a kernel that splits dstate into
smaller tiles reads x and dout once per tile (TileGym's first configs take 16 columns of it).
Which configs a GPU's search picks, the counts do not say (the ``configs`` column says which were
counted).

Rows (one per kernel, and a ``total`` row per step): the counts divided by the step's tokens x
heads, so that shapes compare: ``macs``, ``loaded`` and ``stored`` (bytes) per token and head.
``configs``: "defaults" (this project's), "first" or "largest state tiles" (TileGym's).
The counts depend on the sizes, not on a machine, so the CSV is made on any CPU. Work a group's
heads share (C Bᵀ, per group) is divided among its heads: the default shape has 32 heads in one
group, near the model shapes' 24-80 (the 8B layer has 16 a group).
"""
import argparse
import contextlib
import os

import torch

# Which of TileGym's configs a count takes: its lists' first, or their first with the largest
# state tile (BLOCK_STATE) of each kernel.
TILEGYM_CONFIGS = {"first": "first", "largest": "largest state tiles"}


@contextlib.contextmanager
def tilegym_on_interpreter(configs="first"):
    """Within it, TileGym's cuTile kernels (its mamba2 module's ``ct.launch``) run on this
    project's CPU interpreter, on CPU tensors, with its autotuning off (its caches of winners
    emptied before and after), so with the first config of each list: as they are
    (``configs`` "first"), or reordered largest state tile (BLOCK_STATE) first, stably
    ("largest"); what its wrappers ask of CUDA (the current stream, the multiprocessor count
    of an H200) is answered without a GPU."""
    import cuda.tile as ct
    import tilegym.ops.cutile.mamba2 as tg

    from ops import interpreter
    from tests.benchmark.warm_compile import TILEGYM_CONFIG_LISTS, clear_tilegym_caches
    if configs not in TILEGYM_CONFIGS:
        raise ValueError(f"configs must be one of {sorted(TILEGYM_CONFIGS)}, got {configs!r}")

    def largest_first(listing):
        return lambda *a, **k: sorted(listing(*a, **k),
                                      key=lambda c: -getattr(c, "BLOCK_STATE", 0))

    class Properties:
        multi_processor_count = 132
    listings = [name for name in TILEGYM_CONFIG_LISTS if hasattr(tg, name)]
    replaced = [(ct, "launch"), (torch.cuda, "current_stream"),
                (torch.cuda, "get_device_properties")]
    replaced += [(tg, name) for name in listings] if configs == "largest" else []
    saved = [(owner, name, getattr(owner, name)) for owner, name in replaced]
    if configs == "largest":
        for name in listings:
            setattr(tg, name, largest_first(getattr(tg, name)))
    env = os.environ.get("TILEGYM_DISABLE_AUTOTUNE")
    os.environ["TILEGYM_DISABLE_AUTOTUNE"] = "1"
    ct.launch = lambda stream, grid, kernel, args: interpreter.launch(grid, kernel, list(args))
    torch.cuda.current_stream = lambda *a, **k: None
    torch.cuda.get_device_properties = lambda *a, **k: Properties()
    clear_tilegym_caches(tg)
    try:
        yield tg
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        if env is None:
            del os.environ["TILEGYM_DISABLE_AUTOTUNE"]
        else:
            os.environ["TILEGYM_DISABLE_AUTOTUNE"] = env
        clear_tilegym_caches(tg)


def step_work(impl, chunk, shape, seed=0, configs="first"):
    """``ops.interpreter.Work`` of one training step of ``impl`` ("cutile" or "tilegym") at
    ``chunk`` on ``shape`` (batch, seqlen, nheads, headdim, ngroups, dstate): random bf16 inputs
    from ``seed`` (``bench_forward.make_inputs``) and output gradient; TileGym's with
    ``configs`` (``tilegym_on_interpreter``)."""
    from ops.interpreter import count_work
    from tests.benchmark.bench_forward import make_inputs
    from tests.benchmark.fwd_bwd import LEAVES, _autograd_step, _tilegym_step
    inputs = make_inputs(torch, "cpu", *(shape[k] for k in ("batch", "seqlen", "nheads",
                                                             "headdim", "ngroups", "dstate")),
                         "bfloat16", seed=seed)
    dout = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(seed + 1))
    dout = dout.to(torch.bfloat16)
    leaves = {k: v.clone().requires_grad_(k in LEAVES) for k, v in inputs.items()}
    if impl == "cutile":
        with count_work() as work:
            _autograd_step("interpret", chunk, leaves, dout).step()
        return work
    with tilegym_on_interpreter(configs) as tg:
        step = _tilegym_step(chunk, leaves, dout, (tg.mamba2_chunk_forward,
                                                   tg.mamba2_chunk_backward)).step
        with count_work() as work:
            step()
    return work


def rows_of(work, impl, chunk, shape, configs="defaults"):
    """One row per kernel (its function's name, and its module) and a ``total`` row: the counts
    per token and head (launches and blocks as they are)."""
    per = shape["batch"] * shape["seqlen"] * shape["nheads"]
    common = dict(impl=impl, chunk=chunk, configs=configs, **shape)
    rows = []
    for name, k in [*work.kernels.items(), ("total", work.total())]:
        module, _, function = name.rpartition(".")
        rows.append(dict(common, kernel=function, module=module, launches=k.launches,
                         blocks=k.blocks, macs=k.macs / per, loaded=k.loaded / per,
                         stored=k.stored / per))
    return rows


def tilegym_installed():
    try:
        import tilegym.ops.cutile.mamba2  # noqa: F401
        return True
    except ImportError:
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1x1024x32x1", help="batch x seqlen x nheads x ngroups")
    parser.add_argument("--dstates", default="64,128")
    parser.add_argument("--chunks", default="128,64", help="this project's chunks")
    parser.add_argument("--tilegym-chunk", type=int, default=64, help="0: not TileGym")
    parser.add_argument("--tilegym-configs", default="first,largest",
                        help="TileGym's configs counted: first, largest (state tiles), or both")
    parser.add_argument("--out", help="CSV file to write")
    args = parser.parse_args(argv)
    try:
        batch, seqlen, nheads, ngroups = (int(v) for v in args.shape.split("x"))
        dstates = [int(v) for v in args.dstates.split(",")]
        chunks = [int(v) for v in args.chunks.split(",")]
    except ValueError:
        parser.error("--shape is batch x seqlen x nheads x ngroups; --dstates and --chunks "
                     "comma-separated integers")
    which = [c for c in args.tilegym_configs.split(",") if c]
    if set(which) - set(TILEGYM_CONFIGS):
        parser.error(f"--tilegym-configs: expected some of {', '.join(TILEGYM_CONFIGS)}, got "
                     f"{args.tilegym_configs!r}")
    runs = [("cutile", c, "defaults") for c in chunks]
    if args.tilegym_chunk:
        if tilegym_installed():
            runs += [("tilegym", args.tilegym_chunk, c) for c in which]
        else:
            print("TileGym is not installed: its step is left out", flush=True)
    rows = []
    for dstate in dstates:
        shape = dict(batch=batch, seqlen=seqlen, nheads=nheads, headdim=64, ngroups=ngroups,
                     dstate=dstate)
        for impl, chunk, configs in runs:
            work = step_work(impl, chunk, shape, configs=configs)
            label = TILEGYM_CONFIGS.get(configs, configs)
            found = rows_of(work, impl, chunk, shape, label)
            rows += found
            print(f"== {impl} chunk {chunk}, dstate {dstate}, {label} configs: per token and "
                  f"head", flush=True)
            for r in found:
                print(f"  {r['kernel']:32s} {r['macs']:9.0f} multiply-adds  {r['loaded']:7.0f} B "
                      f"loaded  {r['stored']:6.0f} B stored  ({r['launches']} launches, "
                      f"{r['blocks']} blocks)", flush=True)
    if args.out and rows:
        from ops.results.report import write_csv
        from tests.benchmark.bench_forward import package_versions
        versions = package_versions()
        write_csv(args.out, [dict(r, tilegym=versions.get("tilegym"),
                                  cuda_tile=versions.get("cuda_tile")) for r in rows])


if __name__ == "__main__":
    main()
