import contextlib
import gc
import os
import sys

import pytest
import torch

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


def _cuda_context_ok():
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:
        return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A kernel that faults (illegal or misaligned address) leaves this process's CUDA context
    unusable, and every later GPU test in the process would fail for that reason alone. After a
    failed ``gpu`` test whose failure broke the context, end the process: under pytest-xdist the
    worker is replaced by a fresh one (the failing test is reported as the crash) and the rest of
    the suite runs normally; without xdist the run stops, naming the test."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or "gpu" not in item.keywords:
        return
    if not torch.cuda.is_available() or _cuda_context_ok():
        return
    message = f"CUDA context lost after {item.nodeid}: stopping this test process"
    if os.environ.get("PYTEST_XDIST_WORKER"):
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        os._exit(3)
    item.session.shouldstop = message


@pytest.fixture
def collector_off():
    """``with collector_off(debug_flags):`` runs its body with Python's garbage collector off
    (and ``gc.set_debug(debug_flags)``), then restores the collector's state as it was, also when
    the body fails. Memory tests use it: off, a tensor held only by a reference cycle stays
    alive, as it does on a GPU until the collector happens to run."""
    @contextlib.contextmanager
    def off(debug=0):
        enabled, flags = gc.isenabled(), gc.get_debug()
        gc.collect()
        gc.disable()
        gc.set_debug(debug)
        try:
            yield
        finally:
            gc.set_debug(flags)
            gc.garbage.clear()
            if enabled:
                gc.enable()
    return off


@pytest.fixture(autouse=True)
def fresh_tapes():
    """Each test starts with no taped training step (``ops.runtime.tape``): a tape replays what
    the module settings made when it was recorded, so a test that changes one (a slice length, a
    default) must not replay another test's recording."""
    from ops.runtime import tape
    tape.clear()
    yield
