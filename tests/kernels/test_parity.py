"""Interpreter vs GPU: every project kernel run on the same inputs on the CPU (through the tile
interpreter) and on a CUDA GPU (compiled), outputs compared with each other directly.

The per-kernel tests (test_chunk_cumsum.py, test_fwd_pass_state.py, test_compute_out.py,
test_forward.py) check each backend against the float64 reference; these tests check that the
interpreter is a faithful stand-in for the GPU, kernel by kernel, which is what makes CPU-only
CI and laptop debugging trustworthy.

Tolerances (relative, in norm): float32 paths agree to float32 rounding, 1e-5 (the GPU's exp2 and
summation order differ in the last bits, and long sums grow that a little). bfloat16 outputs are
rounded to 8 bits on both sides, and a last-bit difference before that rounding can flip one
rounding step: 4e-3.
"""
import pytest
import torch

from ops.kernels.chunk_cumsum import chunk_cumsum
from ops.kernels.compute_out import compute_out
from ops.forward import kernel_forward
from ops.kernels.fwd_pass_state import fwd_pass_state
from reference.problems import make_problem
from reference.validate import rel_err

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
OPTS = dict(dt_softplus=True, dt_limit=(0.0, 1.5))
SHAPE = dict(batch=2, seqlen=200, nheads=4, headdim=32, ngroups=2, dstate=64, seq_boundaries=[70, 128])
CHUNK = 64


def _both(fn, kw):
    """fn(**kw) on the CPU and on the GPU; returns (cpu_result, gpu_result_on_cpu)."""
    cpu = fn(**kw)
    gpu = fn(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    torch.cuda.synchronize()
    to_cpu = lambda r: tuple(t.cpu() for t in r) if isinstance(r, tuple) else r.cpu()
    return cpu, to_cpu(gpu)


def _problem(dtype, seed):
    return make_problem(**SHAPE, dtype=dtype, D="2d", seed=seed)


def test_chunk_cumsum_parity():
    kw = _problem(torch.float32, 1)
    (dt_c, dA_c), (dt_g, dA_g) = _both(
        lambda dt, A, dt_bias: chunk_cumsum(dt, A, CHUNK, dt_bias=dt_bias, poison=True, **OPTS),
        dict(dt=kw["dt"], A=kw["A"], dt_bias=kw["dt_bias"]))
    assert rel_err(dt_g, dt_c) < TOL[torch.float32] and rel_err(dA_g, dA_c) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_pass_state_parity(dtype):
    kw = _problem(dtype, 2)
    dt_out, dA = chunk_cumsum(kw["dt"], kw["A"], CHUNK, dt_bias=kw["dt_bias"], **OPTS)
    (e_c, f_c), (e_g, f_g) = _both(
        lambda **a: fwd_pass_state(**a, poison=True),
        dict(x=kw["x"], B=kw["B"], dt_out=dt_out, dA_cumsum=dA, initial_states=kw["initial_states"],
             seq_idx=kw["seq_idx"]))
    assert rel_err(e_g, e_c) < TOL[dtype] and rel_err(f_g, f_c) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_compute_out_parity(dtype):
    kw = _problem(dtype, 3)
    dt_out, dA = chunk_cumsum(kw["dt"], kw["A"], CHUNK, dt_bias=kw["dt_bias"], **OPTS)
    entry, _ = fwd_pass_state(kw["x"], kw["B"], dt_out, dA, kw["initial_states"], kw["seq_idx"],
                              states_dtype=kw["x"].dtype)
    out_c, out_g = _both(
        lambda **a: compute_out(**a, poison=True),
        dict(x=kw["x"], B=kw["B"], C=kw["C"], dt_out=dt_out, dA_cumsum=dA, entry_states=entry,
             D=kw["D"], z=kw["z"], seq_idx=kw["seq_idx"]))
    assert rel_err(out_g, out_c) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_parity(dtype):
    kw = _problem(dtype, 4)
    (o_c, f_c), (o_g, f_g) = _both(lambda **a: kernel_forward(**a, chunk_size=CHUNK, **OPTS), kw)
    assert rel_err(o_g, o_c) < TOL[dtype] and rel_err(f_g, f_c) < TOL[dtype]
