"""Kernels written the way other cuTile projects write them, run unchanged.

None of these kernels uses anything from ``ops``: they are plain ``@ct.kernel``
functions (attention, an embedding lookup, a histogram, a windowed column sum,
layer norm, softmax), run through the CPU interpreter on random inputs and
compared with plain torch.  The same tests run on a CUDA GPU against torch
there (the ``cuda`` cases, marked ``gpu``, skipped without one):

    python -m pytest -m gpu tests/interpreter/test_foreign_kernels.py

Each kernel is also compiled ahead of time for sm_90, so it is valid cuTile even
where no GPU runs it.  The README's "Your own kernels" example is run here too, straight from the
README, so the documented code cannot rot.
"""
import math
import pathlib
import re
import runpy

import cuda.tile as ct
import pytest
import torch

from ops import interpreter
from ops.runtime.launch import launch
from tests.interpreter.helpers import array_constraint as arr
from tests.interpreter.helpers import compile_for_sm90, poisoned, randn

ConstInt = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def run(device, grid, kernel, args):
    """Launch on `device`: CPU tensors go to the interpreter, CUDA ones to ct.launch."""
    moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    if device == "cpu":
        interpreter.launch(grid, kernel, moved)
    else:
        launch(grid, kernel, moved)
        torch.cuda.synchronize()
    return [a.cpu() if isinstance(a, torch.Tensor) else a for a in moved]


# ---------------------------------------------------------------------------
# (a) causal attention, online softmax, partial tiles
# ---------------------------------------------------------------------------

@ct.kernel
def causal_attention(q, k, v, o, sm_scale: float, BLOCK_M: ConstInt, BLOCK_N: ConstInt,
                     HEAD_DIM: ConstInt):
    start_m = ct.bid(0)
    q_tile = ct.load(q, (start_m, 0), (BLOCK_M, HEAD_DIM))  # rows past the end: never stored
    offs_m = start_m * BLOCK_M + ct.arange(BLOCK_M, dtype=ct.int32)
    m_i = ct.full((BLOCK_M,), -math.inf, dtype=ct.float32)
    l_i = ct.zeros((BLOCK_M,), dtype=ct.float32)
    acc = ct.zeros((BLOCK_M, HEAD_DIM), dtype=ct.float32)
    # Key tiles up to and including the diagonal one (BLOCK_M == BLOCK_N).
    for start_n in range(min(start_m + 1, ct.num_tiles(k, 0, (BLOCK_N, HEAD_DIM)))):
        # Keys past the end only feed scores the causal mask throws away, but their values
        # are multiplied by p == 0: they must be zeros, not garbage (0 * NaN is NaN).
        k_tile = ct.load(k, (start_n, 0), (BLOCK_N, HEAD_DIM))
        v_tile = ct.load(v, (start_n, 0), (BLOCK_N, HEAD_DIM), padding_mode=ZERO)
        s = ct.mma(q_tile, ct.transpose(k_tile), ct.zeros((BLOCK_M, BLOCK_N), dtype=ct.float32))
        offs_n = start_n * BLOCK_N + ct.arange(BLOCK_N, dtype=ct.int32)
        s = ct.where(offs_n[None, :] <= offs_m[:, None], s * sm_scale, -math.inf)
        m_new = max(m_i, ct.max(s, axis=1))  # builtin max: elementwise on tiles
        p = ct.exp(s - m_new[:, None])
        alpha = ct.exp(m_i - m_new)
        l_i = l_i * alpha + ct.sum(p, axis=1)
        acc = acc * alpha[:, None] + ct.mma(p, v_tile, ct.zeros((BLOCK_M, HEAD_DIM), dtype=ct.float32))
        m_i = m_new
    ct.store(o, (start_m, 0), acc / l_i[:, None])


@pytest.mark.parametrize("device", DEVICES)
def test_causal_attention(device):
    S, D, B = 100, 32, 16  # 100 = 6 tiles of 16 + 4: the last query and key tiles are partial
    q, k, v = (randn(S, D, seed=10 + i) for i in range(3))
    scale = 1 / math.sqrt(D)
    o = run(device, (ct.cdiv(S, B),), causal_attention, [q, k, v, poisoned(S, D), scale, B, B, D])[3]
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    scores = (q.double() @ k.double().T * scale).masked_fill(~mask, -math.inf)
    ref = torch.softmax(scores, dim=-1) @ v.double()
    # float32 throughout: dot products of 32 terms, exps and at most 100-term sums of
    # magnitude < 10 round at ~1e-6 each; 2e-5 leaves room for the GPU's exp and mma order.
    torch.testing.assert_close(o.double(), ref, rtol=0, atol=2e-5)


# ---------------------------------------------------------------------------
# (b) embedding lookup with ct.gather, out-of-range ids padded
# ---------------------------------------------------------------------------

@ct.kernel
def embedding_lookup(ids, weight, out, BLOCK_T: ConstInt, BLOCK_D: ConstInt):
    pid = ct.bid(0)
    tok = ct.load(ids, (pid,), (BLOCK_T,), padding_mode=ZERO)
    cols = ct.arange(BLOCK_D, dtype=ct.int32)
    # Ids outside [0, vocab) and columns past the embedding width read 0.
    rows = ct.gather(weight, (tok[:, None], cols[None, :]), padding_value=0)
    ct.store(out, (pid, 0), rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_lookup(device, dtype):
    V, D, N = 50, 24, 37  # 24 columns in a 32-wide tile, 37 ids in tiles of 16
    weight = randn(V, D, dtype=dtype, seed=20)
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(-5, V + 5, (N,), generator=g, dtype=torch.int32)
    ids[:3] = torch.tensor([-1, V, 2**31 - 1], dtype=torch.int32)  # out of range for sure
    out = run(device, (ct.cdiv(N, 16),), embedding_lookup, [ids, weight, poisoned(N, D, dtype=dtype), 16, 32])[2]
    valid = (ids >= 0) & (ids < V)
    ref = torch.zeros(N, D, dtype=dtype)
    ref[valid] = weight[ids[valid].long()]
    assert torch.equal(out, ref)  # a copy: bit for bit


# ---------------------------------------------------------------------------
# (c) histogram with ct.atomic_add over several blocks
# ---------------------------------------------------------------------------

@ct.kernel
def weighted_histogram(x, w, counts, sums, n_bins: int, BLOCK: ConstInt):
    # Each block walks several tiles (a grid-stride loop); bins are shared by all blocks.
    n = x.shape[0]
    for t in range(ct.bid(0), ct.num_tiles(x, 0, (BLOCK,)), ct.num_blocks(0)):
        offs = t * BLOCK + ct.arange(BLOCK, dtype=ct.int32)
        valid = offs < n
        xv = ct.load(x, (t,), (BLOCK,), padding_mode=ZERO)
        wv = ct.load(w, (t,), (BLOCK,), padding_mode=ZERO)
        b = ct.astype(ct.floor(xv * n_bins), ct.int32)
        b = ct.minimum(ct.maximum(b, 0), n_bins - 1)
        # Lanes past the end add nothing (0 to bin 0) instead of being masked off.
        ct.atomic_add(counts, b, ct.where(valid, 1, 0))
        ct.atomic_add(sums, b, ct.where(valid, wv, 0.0))


@pytest.mark.parametrize("device", DEVICES)
def test_weighted_histogram(device):
    N, NB = 1000, 10  # 1000 = 7 tiles of 128 + 104, 3 blocks of 2-3 tiles each
    g = torch.Generator().manual_seed(30)
    x = torch.rand(N, generator=g) * 0.98 + 0.01  # never 0, away from the bin edges' ends
    w = randn(N, seed=31)
    counts = torch.zeros(NB, dtype=torch.int32)
    sums = torch.zeros(NB)
    counts, sums = run(device, (3,), weighted_histogram, [x, w, counts, sums, NB, 128])[2:4]
    bins = (x * NB).floor().long().clamp(0, NB - 1)  # float32 product, as in the kernel
    assert torch.equal(counts, torch.bincount(bins, minlength=NB).int())
    # float32 atomics in an unspecified order: ~100 terms of |w| < 4 per bin, 1e-4.
    ref = torch.zeros(NB, dtype=torch.float64).index_add_(0, bins, w.double())
    torch.testing.assert_close(sums.double(), ref, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------
# (d) a row window through Array.slice
# ---------------------------------------------------------------------------

@ct.kernel
def window_column_sum(x, out, row_start, row_stop, BLOCK_R: ConstInt, BLOCK_C: ConstInt):
    win = x.slice(axis=0, start=row_start, stop=row_stop)
    pid = ct.bid(0)
    acc = ct.zeros((BLOCK_C,), dtype=ct.float32)
    for r in range(ct.num_tiles(win, 0, (BLOCK_R, BLOCK_C))):
        # Rows past row_stop (inside x, outside the window) must read 0, not x's rows.
        tile = ct.load(win, (r, pid), (BLOCK_R, BLOCK_C), padding_mode=ZERO)
        acc = acc + ct.sum(tile, axis=0)
    ct.store(out, (pid,), acc)


@pytest.mark.parametrize("device", DEVICES)
def test_window_column_sum(device):
    x = randn(90, 70, seed=40)
    out = run(device, (ct.cdiv(70, 32),), window_column_sum, [x, poisoned(70), 13, 71, 16, 32])[1]
    ref = x[13:71].double().sum(0)
    # 58 float32 terms of |x| < 5 in another order: 58 half-ulps of ~50, < 1e-4.
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------
# (e) layer norm over rows
# ---------------------------------------------------------------------------

@ct.kernel
def layer_norm(x, weight, bias, y, eps: float, BLOCK_M: ConstInt, BLOCK_N: ConstInt):
    n = x.shape[1]
    row = ct.bid(0)
    xt = ct.load(x, (row, 0), (BLOCK_M, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    mean = ct.sum(xt, axis=1) / n  # the zero padding adds nothing
    cols = ct.arange(BLOCK_N, dtype=ct.int32)
    xc = ct.where(cols[None, :] < n, xt - mean[:, None], 0.0)
    rstd = ct.rsqrt(ct.sum(xc * xc, axis=1) / n + eps)
    w = ct.load(weight, (0,), (BLOCK_N,), padding_mode=ZERO).astype(ct.float32)
    b = ct.load(bias, (0,), (BLOCK_N,), padding_mode=ZERO).astype(ct.float32)
    ct.store(y, (row, 0), (xc * rstd[:, None] * w[None, :] + b[None, :]).astype(y.dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm(device, dtype):
    M, N = 37, 200  # rows in blocks of 8 (the last one partial), 200 columns in a 256 tile
    x = (randn(M, N, seed=50) * 3 + 1).to(dtype)
    w, b = randn(N, dtype=dtype, seed=51), randn(N, dtype=dtype, seed=52)
    y = run(device, (ct.cdiv(M, 8),), layer_norm, [x, w, b, poisoned(M, N, dtype=dtype), 1e-5, 8, 256])[3]
    ref = torch.nn.functional.layer_norm(x.double(), (N,), w.double(), b.double(), eps=1e-5)
    if dtype == torch.float32:
        # 200-term float32 sums and an rsqrt: ~1e-6 relative on outputs |y| < 20.
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    else:
        # float32 inside, one rounding to bfloat16 at the end: half a bf16 ulp (2^-9
        # relative), plus the float32 error where it tips a rounding over: 1 ulp, 2^-8.
        torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-5)


# ---------------------------------------------------------------------------
# (f) row softmax
# ---------------------------------------------------------------------------

@ct.kernel
def softmax_rows(x, y, BLOCK_M: ConstInt, BLOCK_N: ConstInt):
    row = ct.bid(0)
    # -inf padding: padded columns give exp(-inf) = 0, and never win the max.
    xt = ct.load(x, (row, 0), (BLOCK_M, BLOCK_N), padding_mode=ct.PaddingMode.NEG_INF)
    z = xt - ct.max(xt, axis=1, keepdims=True)
    e = ct.exp(z)
    ct.store(y, (row, 0), e / ct.sum(e, axis=1, keepdims=True))


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_rows(device):
    M, N = 45, 100  # blocks of 4 rows (the last one partial), 100 columns in a 128 tile
    x = randn(M, N, seed=60) * 4
    y = run(device, (ct.cdiv(M, 4),), softmax_rows, [x, poisoned(M, N), 4, 128])[1]
    ref = torch.softmax(x.double(), dim=1)
    # float32 exp and a 100-term sum: a few ulps relative to each output (< 1).
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------
# The README's example
# ---------------------------------------------------------------------------

def test_readme_your_own_kernels_example(tmp_path, capsys):
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("### Your own kernels", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    path = tmp_path / "readme_example.py"
    path.write_text(code)  # a real file: the kernel has source lines, as an imported one does
    runpy.run_path(str(path), run_name="readme_example")
    assert capsys.readouterr().out.strip()  # the print inside the kernel ran


# ---------------------------------------------------------------------------
# The same kernels compile for sm_90 (valid cuTile, checked without a GPU)
# ---------------------------------------------------------------------------

def _aot_cases():
    import cuda.tile.compilation as cc
    f32, i32 = cc.ScalarConstraint(ct.float32), cc.ScalarConstraint(ct.int32)
    return {
        "causal_attention": (causal_attention, [arr(ct.float32, 2)] * 4 + [f32, 16, 16, 32]),
        "embedding_lookup": (embedding_lookup, [arr(ct.int32, 1), arr(ct.bfloat16, 2),
                                                arr(ct.bfloat16, 2), 16, 32]),
        "weighted_histogram": (weighted_histogram, [arr(ct.float32, 1), arr(ct.float32, 1),
                                                    arr(ct.int32, 1), arr(ct.float32, 1), i32, 128]),
        "window_column_sum": (window_column_sum, [arr(ct.float32, 2), arr(ct.float32, 1),
                                                  i32, i32, 16, 32]),
        "layer_norm": (layer_norm, [arr(ct.bfloat16, 2), arr(ct.bfloat16, 1), arr(ct.bfloat16, 1),
                                    arr(ct.bfloat16, 2), f32, 8, 256]),
        "softmax_rows": (softmax_rows, [arr(ct.float32, 2)] * 2 + [4, 128]),
    }


@pytest.mark.parametrize("case", ["causal_attention", "embedding_lookup", "weighted_histogram",
                                  "window_column_sum", "layer_norm", "softmax_rows"])
def test_compiles_for_sm90(case):
    kernel, parameters = _aot_cases()[case]
    assert len(compile_for_sm90(kernel, parameters)) > 0
