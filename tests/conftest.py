import os
import sys

import pytest
import torch

# The repository root holds the `ops` and `reference` packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Tests check numerics of given configs; on a GPU the forward pass would otherwise autotune every
# test shape (minutes of compiling). The autotuner's own tests switch it back on where they need it.
os.environ.setdefault("MAMBA2_CUTILE_AUTOTUNE", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
