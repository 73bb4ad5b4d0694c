"""What holds memory at a training step's peak on a GPU: the live allocations, and who made them.

    python -m tests.benchmark.memory_probe [--shape 8x2048x80x1] [--dstate 128] [--chunk 256]
        [--top 20] [--depth 4]

Why: on the H200 a training step's scan (``fwd_bwd.py``) peaks above what
``ops.backward.memory_accounting``, the forward's output and the gradients account for: at the 2.7B
training shape, chunk 128, 949 MiB measured against about 750, a remainder a little larger than the
forward's own entry states (160 MiB); and the step's peak moved with the forward's chunk by as much
as those grow (``PERF_NOTES.md``). On the CPU interpreter, in a step whose plans were built afresh,
nothing of the forward was alive in the backward. On the H200 the launch probe gave back all 3072
MiB; at the step's peak, 947 MiB against about 740 (577 accounted at the token kernel's step plus
the forward's 160 MiB output), five blocks of 160 MiB were alive (three made by a plan's ``bind``,
two by ``new_output``) where those name four, and two of 20 MiB from ``bind`` where they name none.
20 MiB is the final states' size at chunk 128; 160 MiB the entry states', but also x's. They were
the forward's entry and final states and the recompute's final states, held through the backward by
a reference cycle in ``bind`` (found on the CPU with a tracker of live tensors, fixed:
``ops.runtime.launch._build``); ``--depth`` names the callers of ``bind`` to tell such blocks apart.
Two probes, each printed:

    launch  one launch of a small kernel (``ops.examples.vector_add``) on three 1 GiB
            tensors, which are then dropped: how much of their memory comes back. All of it, unless
            something keeps a launch's arguments alive after the launch.
    step    one step (bf16, D, dt_bias, softplus; ``fwd_bwd.py``'s inputs and output gradient)
            under ``torch.cuda.memory._record_memory_history``: the blocks alive at the step's
            peak, largest first, each with the project's lines that allocated it (the innermost
            ``--depth``, callee < caller).
"""
import argparse
import gc
import os

# This project's folder: frames under it are the project's lines.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def live_at_peak(trace):
    """Replays one device's allocator trace (``torch.cuda.memory._snapshot()["device_traces"]``'s
    entries, in order): -> (peak bytes above the trace's start, the events of the blocks alive at
    that peak). A block counts from its ``alloc`` until its ``free_requested`` (or, without one,
    its ``free_completed``)."""
    live, current, peak, at_peak = {}, 0, 0, []
    for event in trace:
        action, addr = event["action"], event.get("addr")
        if action == "alloc":
            live[addr] = event
            current += event["size"]
            if current > peak:
                peak, at_peak = current, list(live.values())
        elif action in ("free_requested", "free_completed") and addr in live:
            current -= live.pop(addr)["size"]
    return peak, sorted(at_peak, key=lambda e: -e["size"])


def origin(event, root=ROOT, depth=1):
    """The innermost ``depth`` of the event's Python frames in files under ``root`` (this
    project), each as 'path:line function' with the path relative to ``root``, joined by ' < '
    (callee < caller); '?' where none is. A shared allocation site (a plan's ``bind``) needs a
    few callers to say which step made the block."""
    found = [f"{f['filename'][len(root):]}:{f['line']} {f['name']}"
             for f in event.get("frames", []) if f.get("filename", "").startswith(root)]
    return " < ".join(found[:depth]) or "?"


def probe_launch(torch):
    from ops.runtime.launch import launch
    from ops.examples import vector_add
    n, tile = 1 << 28, 1024                           # 1 GiB of float32 each
    a = torch.randn(n, device="cuda")
    b, c = torch.randn_like(a), torch.empty_like(a)
    launch(n // tile, vector_add, (a, b, c, tile))
    torch.cuda.synchronize()
    assert torch.equal(c, a + b)
    held = torch.cuda.memory_allocated()
    del a, b, c
    gc.collect()
    back = (held - torch.cuda.memory_allocated()) / 2**20
    print(f"launch: dropping a launch's three 1 GiB arguments gave back {back:.0f} of 3072 MiB")


def probe_step(torch, shape, chunk, top, depth):
    from tests.benchmark.fwd_bwd import LEAVES, _autograd_step, _setup
    inputs, dout = _setup(shape)
    leaves = {k: v.detach().clone().requires_grad_(k in LEAVES) for k, v in inputs.items()}
    step = _autograd_step("cutile", chunk, leaves, dout).step
    step()                                            # compile and tune outside the record
    for t in leaves.values():
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, alive = live_at_peak(trace)
    print(f"step at {shape}, chunk {chunk}: peak +{peak / 2**20:.0f} MiB above the step's start; "
          f"{len(alive)} blocks alive there, the largest:")
    for event in alive[:top]:
        print(f"  {event['size'] / 2**20:8.1f} MiB  {origin(event, depth=depth)}")


def main(argv=None):
    import torch
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8x2048x80x1", help="batch x seqlen x nheads x ngroups")
    parser.add_argument("--dstate", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=256, help="the caller's chunk")
    parser.add_argument("--top", type=int, default=20, help="blocks listed")
    parser.add_argument("--depth", type=int, default=4,
                        help="the project's frames named per block, innermost first")
    args = parser.parse_args(argv)
    try:
        batch, seqlen, nheads, ngroups = (int(v) for v in args.shape.split("x"))
    except ValueError:
        parser.error(f"--shape must be batch x seqlen x nheads x ngroups, got {args.shape!r}")
    if not torch.cuda.is_available():
        raise SystemExit("memory_probe needs a CUDA GPU")
    probe_launch(torch)
    probe_step(torch, dict(batch=batch, seqlen=seqlen, nheads=nheads, headdim=64,
                           ngroups=ngroups, dstate=args.dstate), args.chunk, args.top, args.depth)


if __name__ == "__main__":
    main()
