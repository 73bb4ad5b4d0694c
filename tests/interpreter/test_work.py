"""``ops.interpreter.count_work``: each kernel's launches, blocks, multiply-adds and bytes, against
counts made by hand for small kernels whose last tiles stick out of their arrays."""
import cuda.tile as ct
import torch

from ops import interpreter
from tests.interpreter.helpers import poisoned, randn

ConstInt = ct.Constant[int]


@ct.kernel
def tiled_matmul(a, b, c, BM: ConstInt, BN: ConstInt, BK: ConstInt):
    i, j = ct.bid(0), ct.bid(1)
    acc = ct.zeros((BM, BN), dtype=ct.float32)
    for k in range(ct.num_tiles(a, 1, (BM, BK))):
        acc = ct.mma(ct.load(a, (i, k), (BM, BK), padding_mode=ct.PaddingMode.ZERO),
                     ct.load(b, (k, j), (BK, BN), padding_mode=ct.PaddingMode.ZERO), acc)
    ct.store(c, (i, j), acc)


@ct.kernel
def batched_scale(x, y, B: ConstInt, M: ConstInt):
    """y[i] = x[i] @ x[i]^T for a block of B matrices (3-d matmul), read through a tiled view
    of x transposed by ``order`` in the other load."""
    i = ct.bid(0)
    t = ct.load(x, (i, 0, 0), (B, M, M))
    u = ct.load(x, (i, 0, 0), (B, M, M), order=(0, 2, 1))
    ct.store(y, (i, 0, 0), t @ u)


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
    k = work.kernels["tiled_matmul"]
    assert (k.launches, k.blocks) == (1, 6)
    assert k.macs == 6 * 3 * 16 ** 3
    assert k.loaded == 4 * (2 * (16 + 16 + 8) * 48 + 3 * (16 + 8) * 48)
    assert k.stored == 4 * 40 * 24


def test_launches_add_up_per_kernel_and_batches_count():
    """Two kernels, one launched twice: counts per kernel, in the order they first ran, and the
    total; a 3-d product counts its batch; an order= load counts the same bytes; a launch made
    outside the context counts nowhere."""
    x = randn(6, 8, 8, dtype=torch.bfloat16, seed=3)
    y = poisoned(6, 8, 8)
    a, b, c = randn(16, 16, seed=4), randn(16, 16, seed=5), poisoned(16, 16)
    interpreter.launch((1, 1), tiled_matmul, [a, b, c, 16, 16, 16])      # not counted
    with interpreter.count_work() as work:
        interpreter.launch((3,), batched_scale, [x, y, 2, 8])
        interpreter.launch((1, 1), tiled_matmul, [a, b, c, 16, 16, 16])
        interpreter.launch((1, 1), tiled_matmul, [a, b, c, 16, 16, 16])
    torch.testing.assert_close(y, (x.float() @ x.float().transpose(1, 2)), atol=1e-2, rtol=1e-2)
    assert list(work.kernels) == ["batched_scale", "tiled_matmul"]
    s, m = work.kernels["batched_scale"], work.kernels["tiled_matmul"]
    assert (s.launches, s.blocks, s.macs) == (1, 3, 3 * 2 * 8 * 8 * 8)
    assert (s.loaded, s.stored) == (2 * 6 * 8 * 8 * 2, 6 * 8 * 8 * 4)
    assert (m.launches, m.blocks, m.macs) == (2, 2, 2 * 16 ** 3)
    total = work.total()
    assert total.macs == s.macs + m.macs and total.loaded == s.loaded + m.loaded
    assert total.launches == 3
