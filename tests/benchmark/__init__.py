"""The benchmarks, run from the repository's root as ``python -m tests.benchmark.<script>``
(README.md in this folder says which result each one makes). Their readers are ``ops.results``."""
from ops.results import OUTPUT, RESULTS  # noqa: F401  (where the scripts read and write)


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
