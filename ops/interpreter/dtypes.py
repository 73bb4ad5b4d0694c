"""cuTile dtypes in torch: storage, rounding, conversion and promotion with scalars."""

import cuda.tile as ct
import torch

from ops.runtime.cutile_internals import is_boolean, is_float, is_integral, promote_dtypes
from .errors import KernelTypeError, UnsupportedOperation

# How each cuTile dtype is stored in torch.  tfloat32 has no torch dtype: it
# is a float32 whose mantissa has been rounded to 10 bits.
TORCH_DTYPE = {
    ct.bool_: torch.bool,
    ct.uint8: torch.uint8,
    ct.int8: torch.int8,
    ct.int16: torch.int16,
    ct.int32: torch.int32,
    ct.int64: torch.int64,
    ct.float16: torch.float16,
    ct.bfloat16: torch.bfloat16,
    ct.tfloat32: torch.float32,
    ct.float32: torch.float32,
    ct.float64: torch.float64,
    ct.float8_e4m3fn: torch.float8_e4m3fn,
    ct.float8_e5m2: torch.float8_e5m2,
}
CT_DTYPE = {t: d for d, t in TORCH_DTYPE.items() if d is not ct.tfloat32}

# Dtypes narrower than float32: arithmetic runs in float32, then rounds back.
NARROW_FLOATS = (ct.float16, ct.bfloat16, ct.tfloat32)

# float8 tiles only move and convert (cuTile allows no arithmetic on them).
# Conversions to them saturate: sm_90 has only the ``cvt.rn.satfinite``
# form, so values beyond the largest finite one (infinities included)
# become +-max and NaN stays NaN; torch alone would give NaN or inf.
FLOAT8 = {
    ct.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,  # 448
    ct.float8_e5m2: torch.finfo(torch.float8_e5m2).max,      # 57344
}

# cuTile dtypes without an emulation, and why.
_UNSUPPORTED_REASONS = {
    ct.float8_e8m0fnu: "it is a scale format for ct.mma_scaled (sm_100+), not emulated",
    ct.float8_e5m3fnu: "torch has no such dtype",
    ct.float4_e2m1fn: "torch has no unpacked float4 dtype",
}


def storage(dtype):
    """The torch dtype holding tiles of cuTile `dtype`."""
    try:
        return TORCH_DTYPE[dtype]
    except KeyError:
        why = _UNSUPPORTED_REASONS.get(dtype)
        raise UnsupportedOperation(
            f"{dtype} tiles are not supported by the CPU interpreter"
            + (f": {why}" if why else "")) from None


def compute(dtype):
    """The torch dtype in which arithmetic on `dtype` tiles is carried out."""
    return torch.float32 if dtype in NARROW_FLOATS or dtype in FLOAT8 else storage(dtype)


def require_dtype(op, dtype):
    """`dtype` if it is a cuTile dtype the interpreter can store, else an error."""
    if not isinstance(dtype, ct.DType):
        raise KernelTypeError(f"{op}: dtype must be a cuTile dtype such as ct.float32, "
                              f"got {dtype!r}")
    storage(dtype)
    return dtype


def round_tf32(t):
    """Round float32 values to tfloat32 (10 mantissa bits), ties to even."""
    bits = t.view(torch.int32)
    # Add half of the dropped 13 bits (minus one unless the kept LSB is odd,
    # which turns ties into ties-to-even), then clear them.
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0xFFF + lsb) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isnan(t), t, rounded)  # keep NaN payloads NaN


def to_dtype(t, dtype):
    """Round a result computed in `compute(dtype)` to the storage of `dtype`."""
    if dtype is ct.tfloat32:
        return round_tf32(t.to(torch.float32))
    if dtype in FLOAT8:
        if t.dtype == TORCH_DTYPE[dtype]:
            return t
        limit = FLOAT8[dtype]
        # Clamping first is exact: anything beyond max rounds to max under satfinite.
        return t.clamp(-limit, limit).to(TORCH_DTYPE[dtype])
    target = TORCH_DTYPE[dtype]
    return t if t.dtype == target else t.to(target)


def convert(t, src, dst):
    """Elementwise conversion of a tensor holding `src` values to `dst` (astype)."""
    if src == dst:
        return t
    if src in FLOAT8:
        # torch computes little on float8; every float8 value is exact in float32.
        t = t.to(torch.float32)
    if dst is ct.bool_:
        return t != 0
    if is_float(src) and is_integral(dst):
        # Truncate toward zero and saturate at the integer range, NaN -> 0.
        target = storage(dst)
        info = torch.iinfo(target)
        x = t.double().nan_to_num(nan=0.0).clamp(info.min, info.max).trunc()
        out = x.to(target)
        if target == torch.int64:  # 2**63 is not an int64: saturate by hand
            out = torch.where(x >= 2.0**63, info.max, out)
        return out
    return to_dtype(t.to(compute(dst)), dst)


def is_scalar(value):
    """True for the Python constants cuTile accepts as operands (bool, int, float)."""
    return isinstance(value, (bool, int, float))


def dtype_of_scalar(value):
    """The dtype cuTile gives a Python constant (used for promotion)."""
    if isinstance(value, bool):
        return ct.bool_
    if isinstance(value, int):
        return ct.int32 if -2**31 <= value < 2**31 else ct.int64
    return ct.float32


def kind(dtype):
    """0 for bool, 1 for integers, 2 for floats: a scalar only wins if stronger."""
    return 0 if is_boolean(dtype) else 1 if is_integral(dtype) else 2


def promote_with_scalar(op, dtype, scalar):
    """cuTile's rule for a tile and a Python scalar: the tile wins within its kind."""
    scalar_dtype = dtype_of_scalar(scalar)
    if kind(scalar_dtype) > kind(dtype):
        return scalar_dtype
    if kind(dtype) == 1 and kind(scalar_dtype) == 1:
        info = torch.iinfo(storage(dtype))
        if not info.min <= scalar <= info.max:
            raise KernelTypeError(f"{op}: integer constant {scalar} is out of range of {dtype}")
    return dtype


def widens_to(src, dst):
    """Whether a ``src`` tile may be implicitly cast to ``dst`` (a store or scatter into a
    ``dst`` array): cuTile's promotion of the two gives ``dst``, so the cast only widens."""
    try:
        return promote_dtypes(src, dst) == dst
    except ct.TileError:
        return False
