"""The production kernels of the forward pass, and the backward's under ``backward/``.

One module per kernel, each with its ``@ct.kernel``, its configs (``default_config``,
``search_space``), a ``*_plan`` function that builds one launch and a wrapper that runs it:

    chunk_cumsum    step (a): processed dt and the running sum of dt * A within each chunk
    fwd_pass_state  step (b): each chunk's entry state, carried from chunk to chunk
    compute_out     step (c): the outputs, from the chunk's own tokens and its entry state
    common          what several kernels share (tile helpers, the chunk scores kernel)

A kernel module imports only ``common``, ``ops.tuning.configs``, ``ops.runtime`` and
``ops.checks``; the pipelines (``ops.forward``, ``ops.backward``) chain them.
"""
