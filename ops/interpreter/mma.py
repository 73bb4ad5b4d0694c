"""Matrix multiplication: ct.mma and ct.matmul (the ``@`` operator)."""

import cuda.tile as ct
import torch

from ops.runtime.cutile_internals import is_integral
from .arguments import promote, require_tile
from .dtypes import FLOAT8, convert, to_dtype
from .errors import KernelTypeError
from .registry import OPS, emulates
from .values import Tile
from .work import COUNTING

# Operand dtype -> allowed accumulator dtypes (the table in help(ct.mma)).
MMA_ACCUMULATORS = {
    ct.float8_e4m3fn: (ct.float16, ct.float32),
    ct.float8_e5m2: (ct.float16, ct.float32),
    ct.float16: (ct.float16, ct.float32),
    ct.bfloat16: (ct.float32,),
    ct.float32: (ct.float32,),
    ct.tfloat32: (ct.float32,),
    ct.float64: (ct.float64,),
    ct.int8: (ct.int32,),
    ct.uint8: (ct.int32,),
}


def _matmul_shape(op, x_shape, y_shape):
    """Broadcast batch dims of (..., M, K) @ (..., K, N); returns (..., M, N)."""
    if x_shape[-1] != y_shape[-2]:
        raise KernelTypeError(
            f"{op}: the K dimensions differ: x has shape {x_shape} (K={x_shape[-1]}) and "
            f"y has shape {y_shape} (K={y_shape[-2]})")
    try:
        batch = tuple(torch.broadcast_shapes(x_shape[:-2], y_shape[:-2]))
    except RuntimeError:
        raise KernelTypeError(f"{op}: batch dimensions of {x_shape} and {y_shape} "
                              "are not broadcastable") from None
    return batch + (x_shape[-2], y_shape[-1])


def _check_mma_dtypes(op, x_dtype, y_dtype, acc_dtype):
    ints = (ct.int8, ct.uint8)
    if x_dtype != y_dtype and not (x_dtype in ints and y_dtype in ints):
        raise KernelTypeError(f"{op}: x and y must have the same dtype, got {x_dtype} and "
                              f"{y_dtype}; convert one with .astype()")
    if x_dtype not in MMA_ACCUMULATORS:
        raise KernelTypeError(f"{op}: unsupported operand dtype {x_dtype}; supported: "
                              f"{', '.join(str(d) for d in MMA_ACCUMULATORS)}")
    allowed = MMA_ACCUMULATORS[x_dtype]
    if acc_dtype not in allowed:
        raise KernelTypeError(f"{op}: {x_dtype} operands need a "
                              f"{' or '.join(str(d) for d in allowed)} accumulator, "
                              f"got {acc_dtype}")


def _mma_product(x, y, acc_dtype):
    """x @ y computed exactly as the hardware sees it: operands as stored, wide sums (and
    counted where ``work.count_work`` counts)."""
    work = COUNTING.get()
    if work is not None:
        work.mma(x.shape, y.shape)
    if is_integral(acc_dtype):
        out = torch.matmul(x._t.to(torch.int64), y._t.to(torch.int64))
        return out  # wrapped to int32 by the caller's conversion
    wide = torch.float64 if acc_dtype is ct.float64 else torch.float32
    return torch.matmul(x._t.to(wide), y._t.to(wide))


@emulates("mma")
def mma(x, y, /, acc, *, use_fast_acc=False):
    op = "ct.mma"
    x, y, acc = (require_tile(op, v, name) for v, name in ((x, "x"), (y, "y"), (acc, "acc")))
    for v, name in ((x, "x"), (y, "y")):
        if v.ndim not in (2, 3):
            raise KernelTypeError(f"{op}: {name} must be 2-d or 3-d, got shape {v.shape}")
    out_shape = _matmul_shape(op, x.shape, y.shape)
    if acc.shape != out_shape:
        raise KernelTypeError(f"{op}: acc must have shape {out_shape} for x {x.shape} and "
                              f"y {y.shape}, got {acc.shape}")
    _check_mma_dtypes(op, x.dtype, y.dtype, acc.dtype)
    if use_fast_acc and x.dtype not in FLOAT8:
        raise KernelTypeError(f"{op}: use_fast_acc needs float8 operands")
    # use_fast_acc lets the GPU keep fewer accumulator bits; we always sum in float32.
    product = _mma_product(x, y, acc.dtype)
    out = product + acc._t.to(product.dtype)
    if is_integral(acc.dtype):
        return Tile(out.to(torch.int32), acc.dtype)
    return Tile(to_dtype(out, acc.dtype), acc.dtype)


@emulates("matmul")
def matmul(x, y, /):
    op = "ct.matmul"
    x, y = require_tile(op, x, "x"), require_tile(op, y, "y")
    dtype = promote(op, x, y)
    if dtype not in MMA_ACCUMULATORS:
        raise KernelTypeError(f"{op}: unsupported dtype {dtype}")
    # 1-d operands are treated as a row (x) or a column (y) and squeezed after.
    x2 = x.reshape((1,) + x.shape) if x.ndim == 1 else x
    y2 = y.reshape(y.shape + (1,)) if y.ndim == 1 else y
    out_shape = _matmul_shape(op, x2.shape, y2.shape)
    acc_dtype = MMA_ACCUMULATORS[dtype][0]
    astype = OPS["astype"]
    product = _mma_product(astype(x2, dtype), astype(y2, dtype), acc_dtype)
    # Round to the accumulator dtype (as mma would), then to the promoted dtype.
    product = product.to(torch.int32) if is_integral(acc_dtype) else to_dtype(product, acc_dtype)
    result = Tile(convert(product, acc_dtype, dtype).reshape(out_shape), dtype)
    if x.ndim == 1:
        result = Tile(result._t.squeeze(-2), dtype)
    if y.ndim == 1:
        result = Tile(result._t.squeeze(-1), dtype)
    return result
