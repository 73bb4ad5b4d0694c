"""What the kernels can tile, checked on the host before anything launches; integer helpers.

Plain Python (neither torch nor cuda.tile needed): ``ops.ssd_combined`` checks its inputs with
these whatever the backend, and the kernel modules use them through ``ops.kernels.common``.
"""


def cdiv(a, b):
    """ceil(a / b) for positive ints."""
    return -(-a // b)


def next_pow2(n):
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def is_pow2_in(value, lo, hi):
    """Whether ``value`` is an int power of two in [lo, hi]."""
    return (isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
            and value & (value - 1) == 0)


def check_chunk_size(chunk_size):
    """The chunk is a tile dimension: a power of two, at most 256 (the kernels' tiles)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int; got {type(chunk_size).__name__}")
    if not is_pow2_in(chunk_size, 16, 256):
        raise ValueError(f"chunk_size must be a power of two in [16, 256]; got {chunk_size}")


MAX_HEADDIM, MAX_DSTATE = 256, 512


def tile_size(n):
    """The tile a dimension of ``n`` elements is computed in: the next power of two, at least 16
    (tensor-core products take 16 at least); the loads pad the rest with zeros, the stores drop
    it."""
    return max(16, next_pow2(n))


def check_sizes(headdim, dstate):
    """Any headdim in [1, 256] and dstate in [1, 512]: the kernels pad them to ``tile_size``."""
    for name, value, top, where in (("headdim", headdim, MAX_HEADDIM, "x.shape[3]"),
                                    ("dstate", dstate, MAX_DSTATE, "B.shape[3]")):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise ValueError(f"{name} ({where}) must be an integer in [1, {top}], got {value}")


def check_tile_sizes(headdim, dstate):
    """headdim and dstate used as tile dimensions themselves (the core kernels): powers of two."""
    if not is_pow2_in(headdim, 16, 128):
        raise ValueError(f"headdim must be a power of two in [16, 128], got {headdim}")
    if not is_pow2_in(dstate, 16, 512):
        raise ValueError(f"dstate must be a power of two in [16, 512], got {dstate}")


def check_groups(nheads, ngroups):
    """Every group serves the same number of heads."""
    if nheads % ngroups:
        raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
