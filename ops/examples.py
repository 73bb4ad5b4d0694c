"""Small cuTile kernels used to test the CPU interpreter against torch and the GPU.

Each kernel is ordinary cuTile code: the same object runs through
``ct.launch`` on a GPU and through ``ops.interpreter.launch`` on a CPU, and
``tests/interpreter/test_examples.py`` compiles each one ahead of time for
sm_90 to prove the compiler accepts it.
"""

import cuda.tile as ct


@ct.kernel
def vector_add(a, b, c, TILE: ct.Constant[int]):
    """c = a + b for 1-d arrays; block i handles elements [i*TILE, (i+1)*TILE)."""
    i = ct.bid(0)
    # The last tile may stick out of the arrays.  The padding of the loads is
    # left undetermined: the padded lanes are added but never stored, because
    # ct.store drops out-of-bounds elements.
    x = ct.load(a, index=(i,), shape=(TILE,))
    y = ct.load(b, index=(i,), shape=(TILE,))
    ct.store(c, index=(i,), tile=x + y)


@ct.kernel
def matmul(a, b, c, TM: ct.Constant[int], TN: ct.Constant[int], TK: ct.Constant[int],
           USE_TF32: ct.Constant[bool]):
    """c = a @ b with a float32 accumulator; block (m, n) computes one TM x TN tile of c.

    a is (M, K), b is (K, N) in float32, float16 or bfloat16; c is float32.
    With USE_TF32 float32 operands are rounded to tfloat32 first, which lets
    the compiler use tensor cores; plain float32 operands are multiplied with
    FMA instructions in full float32 precision.
    """
    m = ct.bid(0)
    n = ct.bid(1)
    acc = ct.zeros((TM, TN), dtype=ct.float32)
    # K need not be a multiple of TK: the last a/b tiles are padded with zeros
    # so the padded products add nothing to the sum.
    for k in range(ct.num_tiles(a, axis=1, shape=(TM, TK))):
        x = ct.load(a, index=(m, k), shape=(TM, TK), padding_mode=ct.PaddingMode.ZERO)
        y = ct.load(b, index=(k, n), shape=(TK, TN), padding_mode=ct.PaddingMode.ZERO)
        if USE_TF32:
            x = x.astype(ct.tfloat32)
            y = y.astype(ct.tfloat32)
        acc = ct.mma(x, y, acc)
    ct.store(c, index=(m, n), tile=acc)


@ct.kernel
def chunk_cumsum(x, out, CHUNK: ct.Constant[int]):
    """Cumulative sum within chunks of CHUNK elements along the last axis.

    x is (rows, L) of any float dtype and out is a float32 (rows, L); block
    (j, r) handles chunk j of row r, and each
    chunk restarts from zero.  The running sum is kept in float32 whatever
    the input dtype.
    """
    j = ct.bid(0)
    r = ct.bid(1)
    chunk = ct.load(x, index=(r, j), shape=(1, CHUNK)).astype(ct.float32)
    # Padding past the end of a row is undetermined, which is fine here: a
    # padded lane only influences the sums after it, and those lie outside
    # the array too, so the store drops them.
    sums = ct.cumsum(chunk, axis=1)
    ct.store(out, index=(r, j), tile=sums)
