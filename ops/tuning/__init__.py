"""How each kernel's config is chosen, below the kernels and the pipelines:

    configs        helpers the kernels' search spaces are built with
    autotune       the tuner: the committed table (tuned_configs.json), a cache, a search
    compute_chunk  the chunk the forward computes with, from the caller's chunk and the sizes

The command line that searches and exports the table is ``python -m ops.tools.tune``.
"""
