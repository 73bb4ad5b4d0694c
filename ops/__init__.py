"""The Mamba-2 SSD layer in cuTile: a drop-in ``mamba_chunk_scan_combined`` and a Mamba-2 mixer.

    from ops import mamba_chunk_scan_combined, Mamba2Mixer
    from ops import context_parallel_chunk_scan        # one sequence over several processes

The layout (imports run down this list; ``tests/tools/test_layout.py`` checks it):

    ssd_combined, mixer, torch_op     the API: the entry point, the layer, autograd and compile;
    context_parallel                  one sequence split over the ranks of a process group
    forward, backward, varlen_states  the pipelines that chain the kernels; inputs: what every
                                      call does to its inputs first
    core/                             the small kernels notebooks 03-05 start from
    kernels/, kernels/backward/       the production kernels; kernels/common.py what they share
    tuning/                           configs, the autotuner and its table, the compute chunk
    runtime/, interpreter/, checks    launching a kernel on a GPU or on the CPU interpreter
    tools/, results/, examples        grader, ahead-of-time compiler, machine code, tuning CLI;
                                      readers of the committed results; small example kernels
"""
from ops.context_parallel import context_parallel_chunk_scan
from ops.mixer import Mamba2Mixer
from ops.ssd_combined import mamba_chunk_scan_combined

__all__ = ["mamba_chunk_scan_combined", "Mamba2Mixer", "context_parallel_chunk_scan"]
