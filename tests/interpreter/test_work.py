"""``ops.interpreter.count_work``: each kernel's launches, blocks, multiply-adds and bytes, against
counts made by hand for small kernels whose last tiles stick out of their arrays."""
import cuda.tile as ct
import torch

from ops import interpreter
from tests.interpreter.helpers import poisoned, randn

ConstInt = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO


@ct.kernel
def tiled_matmul(a, b, c, BM: ConstInt, BN: ConstInt, BK: ConstInt):
    i, j = ct.bid(0), ct.bid(1)
    acc = ct.zeros((BM, BN), dtype=ct.float32)
    for k in range(ct.num_tiles(a, 1, (BM, BK))):
        acc = ct.mma(ct.load(a, (i, k), (BM, BK), padding_mode=ZERO),
                     ct.load(b, (k, j), (BK, BN), padding_mode=ZERO), acc)
    ct.store(c, (i, j), acc)


@ct.kernel
def batched_gram(x, y, B: ConstInt, M: ConstInt, N: ConstInt):
    """y[i] = x[i] @ x[i]^T for a block of B (M, N) matrices: a 3-d matmul, its second operand
    loaded transposed (``order``)."""
    i = ct.bid(0)
    t = ct.load(x, (i, 0, 0), (B, M, N))
    u = ct.load(x, (i, 0, 0), (B, N, M), order=(0, 2, 1))
    ct.store(y, (i, 0, 0), t @ u)


@ct.kernel
def row_sums(x, y, BM: ConstInt, BN: ConstInt):
    """y[rows] = x[rows, :] summed, read in column tiles through a tiled view."""
    i = ct.bid(0)
    view = x.tiled_view((BM, BN), padding_mode=ZERO)
    acc = ct.zeros((BM,), dtype=ct.float32)
    for j in range(view.num_tiles(1)):
        acc = acc + ct.sum(view.load((i, j)), axis=1)
    ct.store(y, (i,), acc)


def test_a_tiled_matmul_is_counted_as_by_hand():
    """40 x 48 @ 48 x 24 in 16 x 16 x 16 tiles: a 3 x 2 grid, three k-tiles a block. Every
    product is a whole tile (4096 multiply-adds, padding included: the hardware multiplies it
    too); bytes are the in-bounds elements only: a's rows 0-16, 16-32 and 32-40 (48 columns)
    twice, b's columns 0-16 and 16-24 (48 rows) three times, c once."""
    a, b = randn(40, 48, seed=1), randn(48, 24, seed=2)
    c = poisoned(40, 24)
    with interpreter.count_work() as work:
        interpreter.launch((3, 2), tiled_matmul, [a, b, c, 16, 16, 16])
    torch.testing.assert_close(c, a @ b, atol=1e-4, rtol=1e-4)
    (name, k), = work.kernels.items()
    assert name == f"{__name__}.tiled_matmul"
    assert (k.launches, k.blocks) == (1, 6)
    assert k.macs == 6 * 3 * 16 ** 3
    assert k.loaded == 4 * (2 * (16 + 16 + 8) * 48 + 3 * (16 + 8) * 48)
    assert k.stored == 4 * 40 * 24


def test_launches_add_up_per_kernel_and_batches_and_views_count():
    """Three kernels, one launched twice: counts per kernel, in the order they first ran, and
    their total; a 3-d product counts its batch; a transposed load of a non-square tile counts
    its own elements; a tiled view's loads count the in-bounds part of each tile; a launch made
    outside the context counts nowhere."""
    x = randn(6, 8, 4, dtype=torch.bfloat16, seed=3)
    y = poisoned(6, 8, 8)
    a, b, c = randn(16, 16, seed=4), randn(16, 16, seed=5), poisoned(16, 16)
    m = randn(10, 12, seed=6)
    sums = poisoned(10)
    interpreter.launch((1, 1), tiled_matmul, [a, b, c, 16, 16, 16])      # not counted
    with interpreter.count_work() as work:
        interpreter.launch((3,), batched_gram, [x, y, 2, 8, 4])
        interpreter.launch((1, 1), tiled_matmul, [a, b, c, 16, 16, 16])
        interpreter.launch((1, 1), tiled_matmul, [a, b, c, 16, 16, 16])
        interpreter.launch((3,), row_sums, [m, sums, 4, 8])
    torch.testing.assert_close(y, x.float() @ x.float().transpose(1, 2), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(sums, m.sum(1), atol=1e-5, rtol=1e-5)
    assert list(work.kernels) == [f"{__name__}.{k}" for k in ("batched_gram", "tiled_matmul",
                                                             "row_sums")]
    g, t, r = work.kernels.values()
    assert (g.launches, g.blocks, g.macs) == (1, 3, 3 * 2 * 8 * 4 * 8)
    assert (g.loaded, g.stored) == (2 * 6 * 8 * 4 * 2, 6 * 8 * 8 * 4)
    assert (t.launches, t.blocks, t.macs) == (2, 2, 2 * 16 ** 3)
    # rows 0-4, 4-8, 8-10 in column tiles 0-8 and 8-12: every element of m once
    assert (r.blocks, r.macs, r.loaded, r.stored) == (3, 0, 10 * 12 * 4, 10 * 4)
    total = work.total()
    assert total.macs == g.macs + t.macs and total.loaded == g.loaded + t.loaded + r.loaded
    assert total.launches == 4
