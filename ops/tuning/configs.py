"""Kernel configs: the helpers every kernel module's ``default_config`` / ``search_space`` and
``*_plan`` share.

Every kernel module exposes ``default_config(**shape)`` (the kernel as first written and
measured) and ``search_space(**shape)`` (the variants worth timing for that shape); its
``*_plan`` takes ``config=`` and returns an ``ops.runtime.launch.Plan`` whose kernel carries the config's
compiler hints.
``shape`` is one dict of problem sizes shared by the modules (each takes what it needs and
ignores the rest): batch, seqlen, nheads, headdim, ngroups, dstate, chunk_size, dtype (x's) and
optionally states_dtype (defaults to dtype, as in ops.forward).
"""

# Compiler hints a config may set (None keeps the kernel's own).
HINT_KEYS = ("occupancy", "num_ctas", "num_worker_warps")
_HINTED = {}                             # (kernel, hints) -> kernel with those hints


def with_hints(kernel, config):
    """``kernel`` with the config's compiler hints (occupancy, num_ctas, num_worker_warps) applied.

    ``replace_hints`` returns a new kernel object with its own compile cache, so calling it on
    every launch would recompile every time; keeping one object per (kernel, hints) means each
    variant compiles once per process. With no hint set, the kernel itself is returned."""
    hints = tuple((k, config[k]) for k in HINT_KEYS if config.get(k) is not None)
    if not hints:
        return kernel
    key = (kernel, tuple((k, _hashable(v)) for k, v in hints))
    if key not in _HINTED:
        _HINTED[key] = kernel.replace_hints(**dict(hints))
    return _HINTED[key]


def _hashable(value):
    """A hint value as a dict key: a ``ct.ByTarget`` (unhashable) by identity, so pass one
    module-level object (as compute_out does), not a new one per call: each new object would
    make (and compile) a kernel of its own."""
    try:
        hash(value)
        return value
    except TypeError:
        return ("object", id(value))


def resolve_config(config, default):
    """``default`` updated with ``config`` (None -> the default). Unknown keys raise: a typo
    would otherwise silently time the default under another name."""
    if config is None:
        return dict(default)
    unknown = set(config) - set(default)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; expected {sorted(default)}")
    merged = {**default, **config}
    for key in ("LOAD_LAT", "STORE_LAT"):
        if key in merged and not (isinstance(merged[key], int) and 0 <= merged[key] <= 10):
            raise ValueError(f"{key} must be an int in 0..10 (0 = no hint), got {merged[key]!r}")
    occ, ctas = merged.get("occupancy"), merged.get("num_ctas")
    if merged.get("num_worker_warps") not in (None, 4, 8):
        # 4 and 8 are what the TileIR compiler 13.4 accepts (others need 13.5)
        raise ValueError(f"num_worker_warps must be None, 4 or 8, got {merged['num_worker_warps']!r}")
    if occ is not None and not (isinstance(occ, int) and 1 <= occ <= 32):
        raise ValueError(f"occupancy must be None or an int in 1..32, got {occ!r}")
    if ctas not in (None, 1):
        # Clusters of several CTAs (cuTile's num_ctas > 1) gave wrong results (chunk_cumsum) and
        # misaligned-address faults (fwd_pass_state, compute_out) on an H200 with cuda-tile
        # 1.7.0, so they are refused rather than tuned over (PERF_NOTES.md, "Refused configs").
        raise ValueError(f"num_ctas must be None or 1 (clusters of several CTAs gave wrong "
                         f"results on sm_90 with these kernels), got {ctas!r}")
    return merged


def unique(configs):
    """The configs in order, duplicates dropped."""
    seen, out = set(), []
    for cfg in configs:
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


# The token-tiled backward kernels (bwd_compute_out, bwd_chunk_states) ---------------------------

def group_divisors(nheads, ngroups):
    """The numbers of heads a block may take at once: the divisors of a group's heads (a block
    never spans two groups)."""
    per_group = nheads // ngroups
    return [d for d in range(1, per_group + 1) if per_group % d == 0]


def token_tiling(cfg, chunk_size, nheads, ngroups):
    """(BLOCK_T, HEADS_PER_BLOCK) of a token-tiled backward kernel's config, checked: a tile of
    16 to chunk_size tokens (a power of two), and a divisor of a group's heads."""
    bt, hb = cfg["BLOCK_T"], cfg["HEADS_PER_BLOCK"]
    if bt not in (16, 32, 64, 128, 256) or bt > chunk_size:
        raise ValueError(f"BLOCK_T ({bt}) must be a power of two in [16, chunk_size {chunk_size}]")
    if hb not in group_divisors(nheads, ngroups):
        raise ValueError(f"HEADS_PER_BLOCK ({hb}) must divide the {nheads // ngroups} heads of "
                         f"a group")
    return bt, hb
