"""What runs a kernel, under everything else:

    launch            ``Plan`` (one launch, built but not run), ``run``, re-usable plans, and the
                      dispatch to ``ct.launch`` (CUDA tensors) or the interpreter (CPU tensors)
    replay            an eager call's launches recorded once and replayed
    tape              an eager training step's torch ops and launches, recorded once and replayed
    cutile_internals  the one module that touches cuda.tile's private surface
"""
