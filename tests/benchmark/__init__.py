"""The forward-pass benchmark and its reports, importable as ``tests.benchmark.<module>``
(``bench_forward``, ``report``, ``plot``, ``tuning_report``, ``ncu_summary``, ...)."""
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"   # the committed measurements
OUTPUT = RESULTS.parents[2] / "bench_out"                        # new runs (ignored by git)


def capture_graph(call):
    """Capture ``call()`` in a CUDA graph, after one warm-up call on a side stream (which also
    compiles the kernels, before the capture): -> (graph, the captured call's outputs)."""
    import torch
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        outputs = call()
    return graph, outputs
