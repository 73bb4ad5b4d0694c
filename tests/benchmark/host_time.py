"""Host time of one forward call: eager against a CUDA-graph replay, and where the eager time goes.

    python -m tests.benchmark.host_time [--shape batch=1,seqlen=1024,nheads=24] [--out F.csv]

At small shapes a forward pass is a few tens of microseconds of GPU work, so an eager call costs
what its Python does: the checks, the config lookup, building three plans and launching them.
Measured here, each as the median over many calls after warm-up (the GPU work is queued, not
waited for, except where said):
  * eager: ``mamba_chunk_scan_combined`` called back to back (per call, synchronised every 50),
    replayed (``ops/runtime/replay.py``: the launches of the first call re-made with the new tensors), and
    with the replay switched off (checks, configs, plans, launches every time);
  * graph: the same call captured once in a CUDA graph and replayed;
  * launch: one ``ct.launch`` of a tiny kernel, the floor of any launch, and the forward's own
    launches alone with their arguments bound once;
  * the parts of an eager call: the entry point's checks, the custom op's dispatch, and
    ``kernel_forward`` alone;
  * a training step (forward and backward) taped (``ops/runtime/tape.py``), with the tape off,
    and replayed from a CUDA graph (``training_step_rows``); and where the taped step's host
    time goes, under torch.profiler (``host_breakdown``: each operator's, each launch's, the
    replay keys', the tapes' own Python and autograd's, per step).
"""
import argparse
import statistics
import time

import torch


def per_call(fn, calls=50, repeats=15):
    """Median over ``repeats`` of (wall time of ``calls`` calls, then a synchronise) / calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def main(argv=None):
    import cuda.tile as ct

    from ops import mamba_chunk_scan_combined
    from ops.forward import kernel_forward
    from ops.ssd_combined import _check_inputs
    from ops.tools.tune import DEFAULTS, make_inputs, parse_shape
    from tests.benchmark import capture_graph
    from ops.examples import vector_add

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="batch=1,seqlen=1024,nheads=24")
    parser.add_argument("--out")
    parser.add_argument("--profile", action="store_true",
                        help="also print where an eager call's host time goes (cProfile)")
    args = parser.parse_args(argv)
    shape = parse_shape(args.shape, DEFAULTS)
    kw = make_inputs(shape, torch.bfloat16, "D")
    q = shape["chunk_size"]
    call = lambda: mamba_chunk_scan_combined(**kw, chunk_size=q, dt_softplus=True, backend="cutile")
    rows = {}
    with torch.no_grad():
        rows["eager call"] = per_call(call)           # replayed (ops/runtime/replay.py) after the first
        from ops.runtime import replay
        from ops import ssd_combined
        recorded = next(iter(replay._REPLAYS.values()))
        original = ssd_combined._replay_key
        ssd_combined._replay_key = lambda *args: (None, None)     # neither replayed nor recorded
        try:
            rows["eager call, not replayed"] = per_call(call)
        finally:
            ssd_combined._replay_key = original
        graph, captured = capture_graph(call)
        eager = call()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), "the replay must equal the eager call"
        rows["graph replay"] = per_call(graph.replay)
        a = torch.ones(1024, device="cuda")
        c = torch.empty_like(a)
        stream = torch.cuda.current_stream()
        rows["one ct.launch (vector_add, 8 blocks)"] = per_call(
            lambda: ct.launch(stream, (8,), vector_add, (a, a, c, 128)))
        # The replay's launches alone, arguments bound once: the floor of an eager call.
        inputs = [kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], kw["D"], None, kw["dt_bias"], None, None]
        buffers = [torch.empty(s, dtype=d, device=v) for s, d, v in recorded.returned + recorded.internal]
        views = [inputs[j].as_strided(shape, st) for j, shape, st in recorded.restrided]
        slots = inputs + buffers + views + list(recorded.values)
        bound = [(grid, kernel, tuple(slots[i] for i in index)) for grid, kernel, index in recorded.launches]

        def launches():
            for grid, kernel, args in bound:
                ct.launch(stream, grid, kernel, args)
        rows[f"its {len(bound)} ct.launch calls alone"] = per_call(launches)
        rows["entry-point checks"] = per_call(lambda: _check_inputs(
            kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], q, kw["D"], None, kw["dt_bias"], None,
            None, None, (0.0, float("inf")), False, None))
        rows["kernel_forward alone"] = per_call(lambda: kernel_forward(
            kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], q, D=kw["D"], dt_bias=kw["dt_bias"],
            dt_softplus=True))
        if args.profile:
            print_profile(call, 500)
    rows.update(training_step_rows(kw, q, profile=args.profile))
    # a value: seconds per call, or (seconds, times per step) for a part of a step
    timed = {name: v if isinstance(v, tuple) else (v, "") for name, v in rows.items()}
    for name, (seconds, count) in timed.items():
        print(f"{name:60s} {seconds * 1e3:8.4f} ms" + (f"  ({count:g} per step)" if count else ""))
    print(f"eager / graph replay: {rows['eager call'] / rows['graph replay']:.1f}x")
    if args.out:
        from ops.results.report import write_csv
        device = torch.cuda.get_device_name()
        write_csv(args.out, [dict(shape=args.shape, what=name, ms=seconds * 1e3, per_step=count,
                                  device=device, torch=torch.__version__)
                             for name, (seconds, count) in timed.items()])


def training_step_rows(kw, chunk_size, profile=False):
    """A training step (the forward with every float input requiring a gradient, then
    ``backward`` of a fixed output gradient): taped (``ops/runtime/tape.py``: after the first
    step, each pass replays the first's torch ops and launches), with the tape switched off
    (plans, configs and checks every time), and captured in a CUDA graph and replayed."""
    import ops.torch_op
    from ops import mamba_chunk_scan_combined
    from tests.benchmark import capture_graph
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point())
              for k, v in kw.items() if v is not None}
    dout = torch.randn_like(leaves["x"])

    def step():
        for t in leaves.values():
            t.grad = None
        out = mamba_chunk_scan_combined(**leaves, chunk_size=chunk_size, dt_softplus=True,
                                        backend="cutile")
        out.backward(dout)
    rows = {"training step (taped)": per_call(step, calls=20)}
    parts, profiled = host_breakdown(step)
    rows["training step (taped), profiled"] = profiled
    for name, seconds, count in parts[:BREAKDOWN_ROWS]:
        rows[f"  in it: {name}"] = (seconds, count)
    taped = ops.torch_op.taped
    # (key None: run, not recorded or replayed)
    ops.torch_op.taped = lambda key, stamp, fn, inputs, owned=False: taped(None, stamp, fn, inputs,
                                                                            owned)
    try:
        rows["training step, not taped"] = per_call(step, calls=20)
    finally:
        ops.torch_op.taped = taped
    graph, _ = capture_graph(step)
    rows["training step, graph replay"] = per_call(graph.replay, calls=20)
    if profile:
        print_profile(step, 100)
    return rows


# The project's own parts of a step, marked for host_breakdown: (module, attribute, label). The
# two launch functions are the taped replay's (on a GPU) and every other launch's.
MARKED = [("ops.torch_op", "replay_key", "replay keys"),
          ("ops.ssd_combined", "_check_inputs", "entry checks"),
          ("ops.runtime.tape", "launch_on", "kernel launches"),
          ("ops.runtime.launch", "launch", "kernel launches"),
          ("ops.runtime.tape", "Tape.run", "tape replays (their own Python)")]
# The range around each call: its own time is what no operator or marked part took (the Python
# between them, and the profiler's own cost).
STEP_RANGE = "the rest: Python between the parts, and the profiler's"
BREAKDOWN_ROWS = 14


def host_breakdown(step, calls=50, warmup=10):
    """Where ``step``'s host time goes (a taped training step's): ``calls`` calls under
    torch.profiler, CPU activity only. Each PyTorch operator's and autograd node's own time (not
    its callees') and count, per call, and the same for ranges marked around the project's own
    parts (``MARKED``: a tape replay's own time is then its loop's Python, its operators and
    launches counted apart), and the rest (``STEP_RANGE``). The backward runs on the calling
    thread meanwhile (on a GPU autograd's device thread would run it, the caller waiting): the
    handoff between threads is then not in the parts, the unprofiled step's time has it.
    -> ([(name, seconds per call, count per call)], the longest first; the profiled call's
    seconds, the profiler's own cost included: read the parts as shares of it, and the
    unprofiled time beside it)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def marked(fn, label):
        def wrapper(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return wrapper

    originals = []
    try:
        for module_name, attribute, label in MARKED:
            owner, name = marked_place(module_name, attribute)
            originals.append((owner, name, getattr(owner, name)))
            setattr(owner, name, marked(getattr(owner, name), label))
        # the backward on the calling thread, as autograd runs a CPU backward: on a GPU it runs
        # on autograd's device thread while the caller waits, and the caller's ranges would
        # count that wait besides the backward's own parts
        with torch.autograd.set_multithreading_enabled(False):
            for _ in range(warmup):
                step()
            _synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                for _ in range(calls):
                    with record_function(STEP_RANGE):
                        step()
                _synchronize()
                seconds = (time.perf_counter() - start) / calls
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)
    parts = [(e.key, e.self_cpu_time_total / 1e6 / calls, e.count / calls)
             for e in prof.key_averages()]
    return sorted(parts, key=lambda p: -p[1]), seconds


def marked_place(module_name, attribute):
    """(the object holding ``attribute``, its last name) for a ``MARKED`` entry: the module
    itself, or a class in it for a dotted attribute ("Tape.run")."""
    import importlib
    owner = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def print_profile(fn, calls):
    """Where ``calls`` calls of ``fn`` spend the host's time (cProfile, by own time)."""
    import cProfile
    import pstats
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
