"""Backward kernel: the gradients of every chunk's own state.

Each chunk's state is S[c] = sum_t v[t] outer(x[t], B[t]) with v[t] = exp2(dA[last] - dA[t])
dt[t] (only the tokens of the sequence the chunk's last token belongs to). Given its gradient
dS[c] (``ops/kernels/backward/bwd_pass_state.py``), for the tokens t of chunk c:

    dx[t]  = v[t] * (B[t] @ dS^T)           a (BLOCK_T, dstate) x (dstate, headdim) product
    dB[t]  = v[t] * (x[t] @ dS)             a (BLOCK_T, headdim) x (headdim, dstate) product
    dv[t]  = sum((x @ dS)[t] * B[t])        -> d dt[t] = dv[t] * exp2(dA[last] - dA[t]),
                                               d dA[t] = -dv[t] v[t], d dA[last] += sum(dv v)

One block takes one BLOCK_T-token tile of a chunk for HEADS_PER_BLOCK heads of one group, with
each head's whole (headdim, dstate) state; the two products run on the tensor cores (bfloat16
inputs: bf16 operands, float32 accumulation; float16 inputs use float32 operands, since a
loss-scaled dS overflows float16's range). dS may come in x's dtype for bfloat16 inputs: the
products round it to bf16 anyway, so storing it so (``bwd_pass_state``'s ``ds_dtype``) changes
no bit and halves its size.

dB across the heads of a group (deterministic, no atomics)
    B is shared by the heads of a group: the block loops over its heads in order, sums their dB
    in registers and writes (splits, batch, seqlen, ngroups, dstate), splits = heads_per_group /
    HEADS_PER_BLOCK; the wrapper adds the splits' partials in a fixed order (one split: the
    kernel's own sum). A per-head dB would be heads_per_group times larger: (b, L, h, n) float32
    is 671 MB at batch 8 x 2K tokens x 80 heads x dstate 128.

d dA at the chunk's last token
    sum(dv v) runs over the whole chunk, i.e. over BLOCK_T tiles held by different blocks: each
    block writes its tile's sum to ``ddA_tiles`` (b, h, c, CHUNK / BLOCK_T), and the wrapper adds
    them (a fixed order) to ddA[..., -1]; the kernel's own ddA holds -dv v at every token.

Accumulating (ACCUMULATE)
    With an accumulator, dx, ddt and ddA are read before they are written and this kernel's
    contributions added (each element belongs to one block, and the value written depends on
    the one read: no race). ``ops/backward.py`` passes compute_out's float32 dx, ddt and ddA, so
    no second float32 dx is allocated.

``reference.backward.chunk_states_backward`` is the specification. Tunables
(``default_config`` / ``search_space``): BLOCK_T, HEADS_PER_BLOCK, LOAD_LAT (latency hint of the
x and dS loads), and the compiler hints occupancy and num_worker_warps.
"""
import torch

import cuda.tile as ct

from ops.tuning.configs import group_divisors, resolve_config, token_tiling, unique, with_hints
from ops.runtime.launch import Plan, fit_index_width, run
from ops.kernels.common import (ZERO, sum_splits, ConstBool, ConstInt, as_int32, cdiv, latency_hint, multiprocessors,
                    new_output, tile_size)


@ct.kernel
def bwd_chunk_states_kernel(
    dS: ct.IndexedWithInt64,           # (batch, nchunks, nheads, headdim, dstate) f32 or x's dtype
    x: ct.IndexedWithInt64,            # (batch, seqlen, nheads, headdim)
    B: ct.IndexedWithInt64,            # (batch, seqlen, ngroups, dstate)
    dt_out: ct.IndexedWithInt64,       # (batch, nheads, nchunks, CHUNK) float32
    dA_cumsum: ct.IndexedWithInt64,    # (batch, nheads, nchunks, CHUNK) float32, log2 units
    seq_idx: ct.IndexedWithInt64,      # (batch, seqlen) int32; unread if not HAS_SEQ_IDX
    dx: ct.IndexedWithInt64,           # (batch, seqlen, nheads, headdim) float32
    dB: ct.IndexedWithInt64,           # (splits, batch, seqlen, ngroups, dstate) float32
    ddt: ct.IndexedWithInt64,          # (batch, nheads, nchunks, CHUNK) float32
    ddA: ct.IndexedWithInt64,          # (batch, nheads, nchunks, CHUNK) float32, natural units
    ddA_tiles: ct.IndexedWithInt64,    # (batch, nheads, nchunks, CHUNK // BLOCK_T) float32
    heads_per_group: int,
    heads_per_block: int,              # divides heads_per_group; splits = their ratio
    CHUNK: ConstInt,
    BLOCK_T: ConstInt,                 # token tile (divides CHUNK)
    P: ConstInt,                       # headdim and dstate tiles (powers of two, zero-padded)
    N: ConstInt,
    HAS_SEQ_IDX: ConstBool,
    F32_OPERANDS: ConstBool,           # float32 products (float16 inputs)
    ACCUMULATE: ConstBool,             # add into dx, ddt, ddA instead of overwriting them
    LOAD_LAT: ConstInt,                # latency hint of the x and dS loads; 0 = none
):
    tile, hblock, b = ct.bid(0), ct.bid(1), ct.bid(2)
    splits = heads_per_group // heads_per_block
    g, split = hblock // splits, hblock % splits
    first_head = g * heads_per_group + split * heads_per_block
    TILES = CHUNK // BLOCK_T
    c, t = tile // TILES, tile % TILES               # its chunk, and its place in the chunk
    seqlen = x.shape[1]
    if tile * BLOCK_T >= seqlen:
        # Past the end of the sequence: only ddt and ddA (whole chunks) are there, all zero.
        zero = ct.zeros((1, 1, 1, BLOCK_T), dtype=ct.float32)
        for k in range(heads_per_block):
            h = first_head + k
            if not ACCUMULATE:
                ct.store(ddt, (b, h, c, t), zero)
                ct.store(ddA, (b, h, c, t), zero)
            ct.store(ddA_tiles, (b, h, c, t), ct.zeros((), dtype=ct.float32))
    else:
        bt = ct.reshape(ct.load(B, (b, tile, g, 0), shape=(1, BLOCK_T, 1, N), padding_mode=ZERO),
                        (BLOCK_T, N))
        bt_f32 = bt.astype(ct.float32)
        b_op = bt_f32 if F32_OPERANDS else bt.astype(x.dtype)
        # 1 for the tokens of the sequence the chunk's last token belongs to (they write S[c])
        keep = ct.full((BLOCK_T,), 1.0, dtype=ct.float32)
        if HAS_SEQ_IDX:
            seq_last = ct.load(seq_idx, (b, min((c + 1) * CHUNK, seqlen) - 1), shape=())
            seq = ct.reshape(ct.load(seq_idx, (b, tile), shape=(1, BLOCK_T), padding_mode=ZERO),
                             (BLOCK_T,))
            keep = ct.where(seq == seq_last, 1.0, 0.0)
        dB_acc = ct.zeros((BLOCK_T, N), dtype=ct.float32)
        for k in range(heads_per_block):                 # the group's heads, in order
            h = first_head + k
            s = ct.reshape(ct.load(dS, (b, c, h, 0, 0), shape=(1, 1, 1, P, N), padding_mode=ZERO,
                                   latency=latency_hint(LOAD_LAT)), (P, N))
            xt = ct.reshape(ct.load(x, (b, tile, h, 0), shape=(1, BLOCK_T, 1, P), padding_mode=ZERO,
                                    latency=latency_hint(LOAD_LAT)), (BLOCK_T, P))
            dA = ct.reshape(ct.load(dA_cumsum, (b, h, c, t), shape=(1, 1, 1, BLOCK_T)), (BLOCK_T,))
            dt = ct.reshape(ct.load(dt_out, (b, h, c, t), shape=(1, 1, 1, BLOCK_T)), (BLOCK_T,))
            dA_last = ct.load(dA_cumsum, (b, h, c, CHUNK - 1), shape=())
            decay = ct.exp2(ct.minimum(dA_last - dA, 0.0))
            if HAS_SEQ_IDX:
                decay = decay * keep
            v = decay * dt
            # The two products, with x's dtype (or float32) operands and float32 accumulators.
            if F32_OPERANDS:
                s_op, x_op = s.astype(ct.float32), xt.astype(ct.float32)
            else:
                s_op, x_op = s.astype(x.dtype), xt
            b_ds = ct.mma(b_op, ct.transpose(s_op), ct.zeros((BLOCK_T, P), dtype=ct.float32))
            x_ds = ct.mma(x_op, s_op, ct.zeros((BLOCK_T, N), dtype=ct.float32))
            grad_x = b_ds * v[:, None]
            dB_acc = dB_acc + x_ds * v[:, None]
            dv = ct.sum(x_ds * bt_f32, axis=1)                            # (BLOCK_T,)
            grad_dt = dv * decay
            dvv = dv * v
            grad_dA = -dvv           # and sum(dv v) at the chunk's last token: ddA_tiles
            if ACCUMULATE:
                grad_x = grad_x + ct.reshape(ct.load(dx, (b, tile, h, 0), shape=(1, BLOCK_T, 1, P),
                                                     padding_mode=ZERO), (BLOCK_T, P))
                grad_dt = grad_dt + ct.reshape(ct.load(ddt, (b, h, c, t), shape=(1, 1, 1, BLOCK_T)),
                                               (BLOCK_T,))
                grad_dA = grad_dA + ct.reshape(ct.load(ddA, (b, h, c, t), shape=(1, 1, 1, BLOCK_T)),
                                               (BLOCK_T,))
            ct.store(dx, (b, tile, h, 0), ct.reshape(grad_x, (1, BLOCK_T, 1, P)))
            ct.store(ddt, (b, h, c, t), ct.reshape(grad_dt, (1, 1, 1, BLOCK_T)))
            ct.store(ddA, (b, h, c, t), ct.reshape(grad_dA, (1, 1, 1, BLOCK_T)))
            ct.store(ddA_tiles, (b, h, c, t), ct.sum(dvv))
        ct.store(dB, (split, b, tile, g, 0), ct.reshape(dB_acc, (1, 1, BLOCK_T, 1, N)))


# Configs and launching -------------------------------------------------------------------------

# Blocks wanted per multiprocessor before the heads of a group go into one block. A block is
# light (two (BLOCK_T x 64 x 128) products per head) and walks its heads one after the other, so
# several resident blocks per multiprocessor hide its load latency. The value is untimed.
BLOCKS_PER_SM = 8


def default_block_t(chunk_size):
    """64-token tiles (the whole chunk of a 256-token chunk at dstate 128 holds two (256, 128)
    float32 tiles per block and spills on sm_90: ``python -m ops.tools.sass``); never more than
    the chunk."""
    return min(64, chunk_size)


def default_heads_per_block(*, nheads, ngroups, token_tiles, device=None):
    """The largest divisor of a group's heads that still gives ``BLOCKS_PER_SM`` blocks per
    multiprocessor (all the heads of a group for long sequences: dB written directly), else one
    head per block."""
    wanted = BLOCKS_PER_SM * multiprocessors(device)
    per_group = nheads // ngroups
    for hb in sorted(group_divisors(nheads, ngroups), reverse=True):
        if token_tiles * ngroups * (per_group // hb) >= wanted:
            return hb
    return 1


def default_config(*, chunk_size, nheads=1, ngroups=1, batch=1, seqlen=None, **_):
    """``default_block_t``'s tiles, ``default_heads_per_block`` (seqlen None: a long sequence,
    all heads of a group per block), no hints."""
    bt = default_block_t(chunk_size)
    if seqlen is None:
        hb = nheads // ngroups
    else:
        tiles = batch * cdiv(seqlen, chunk_size) * (chunk_size // bt)
        hb = default_heads_per_block(nheads=nheads, ngroups=ngroups, token_tiles=tiles)
    return dict(BLOCK_T=bt, HEADS_PER_BLOCK=hb, LOAD_LAT=0, INDEX64=False, occupancy=None,
                num_worker_warps=None)


def search_space(*, chunk_size, nheads=1, ngroups=1, **shape):
    """Variants worth timing (the default first, at most 11): the other token tiles (32, 128),
    one head per block, a quarter, half and all of a group's heads (more or fewer, larger
    blocks), the long load-latency hint, two blocks per multiprocessor and eight worker warps."""
    base = default_config(chunk_size=chunk_size, nheads=nheads, ngroups=ngroups, **shape)
    configs = [base]
    for bt in (32, 64, 128):
        if bt <= chunk_size and bt != base["BLOCK_T"]:
            configs.append({**base, "BLOCK_T": bt})
    options = group_divisors(nheads, ngroups)
    per_group = nheads // ngroups
    for want in (1, per_group // 4, per_group // 2, per_group):
        # the largest divisor not above the wanted count (a block never spans two groups)
        hb = max(d for d in options if d <= max(want, 1))
        configs.append({**base, "HEADS_PER_BLOCK": hb})
    configs += [{**base, "LOAD_LAT": 8}, {**base, "occupancy": 2},
                {**base, "num_worker_warps": 8}]
    return unique(configs)


def _check(dS, x, B, dt_out, dA_cumsum, accumulate):
    batch, seqlen, nheads, headdim = x.shape
    nchunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    want = (batch, nchunks, nheads, headdim, B.shape[3])
    if tuple(dS.shape) != want:
        raise ValueError(f"dS must be (batch, nchunks, nheads, headdim, dstate) = {want}, got "
                         f"{tuple(dS.shape)}")
    ok = (torch.float32,) if x.dtype != torch.bfloat16 else (torch.float32, torch.bfloat16)
    if dS.dtype not in ok:
        raise TypeError(f"dS must be one of {ok} for {x.dtype} inputs, got {dS.dtype}")
    if accumulate is not None:
        for name, t, shape in (("dx", accumulate[0], x.shape), ("ddt", accumulate[1], dt_out.shape),
                               ("ddA", accumulate[2], dt_out.shape)):
            if t.shape != shape or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"the accumulator {name} must be a contiguous float32 "
                                 f"{tuple(shape)} tensor, got {t.dtype} {tuple(t.shape)}")
        # The kernel is compiled for arrays that share no memory: a block reads an accumulator
        # and writes it back, so one shared with another argument would be read after a write.
        read = (dS, x, B, dt_out, dA_cumsum)
        starts = [t.data_ptr() for t in accumulate]
        if x.device.type != "meta" and (len(set(starts)) < 3
                                        or any(t.data_ptr() in starts for t in read)):
            raise ValueError("the accumulators dx, ddt and ddA must be three tensors of their own, "
                             "sharing no memory with each other or with the inputs")


def bwd_chunk_states_plan(dS, x, B, dt_out, dA_cumsum, seq_idx=None, poison=False, config=None,
                          accumulate=None):
    """The launch (an ``ops.runtime.launch.Plan``; outputs dx, the head splits' dB partials (splits, b,
    L, g, n), ddt_out, ddA_cumsum and the token tiles' sums for the last token (b, h, c,
    tiles)). ``accumulate``: None, or compute_out's (dx, ddt, ddA), float32, that this launch
    adds into (and returns as its dx, ddt, ddA). ``config``: a dict from ``search_space`` (or part
    of one; missing keys take ``default_config``'s values for this shape)."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    nchunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    _check(dS, x, B, dt_out, dA_cumsum, accumulate)
    cfg = resolve_config(config, default_config(chunk_size=chunk_size, nheads=nheads,
                                                ngroups=ngroups, batch=batch, seqlen=seqlen))
    bt, hb = token_tiling(cfg, chunk_size, nheads, ngroups)
    splits = (nheads // ngroups) // hb
    tiles = chunk_size // bt
    device = x.device
    if accumulate is None:
        dx = new_output(x.shape, torch.float32, device, poison)
        ddt = new_output(dt_out.shape, torch.float32, device, poison)
        ddA = new_output(dt_out.shape, torch.float32, device, poison)
    else:
        dx, ddt, ddA = accumulate
    dB = new_output((splits, batch, seqlen, ngroups, dstate), torch.float32, device, poison)
    ddA_tiles = new_output((batch, nheads, nchunks, tiles), torch.float32, device, poison)
    seq_idx = as_int32(seq_idx)
    args = (dS, x, B, dt_out, dA_cumsum, seq_idx if seq_idx is not None else dt_out, dx, dB,
            ddt, ddA, ddA_tiles, nheads // ngroups, hb, chunk_size, bt, tile_size(headdim),
            tile_size(dstate), seq_idx is not None, x.dtype == torch.float16,
            accumulate is not None, cfg["LOAD_LAT"])
    kernel = with_hints(fit_index_width(bwd_chunk_states_kernel, args, cfg["INDEX64"]), cfg)
    return Plan((nchunks * tiles, ngroups * splits, batch), kernel, args,
                (dx, dB, ddt, ddA, ddA_tiles))


def bwd_chunk_states(dS, x, B, dt_out, dA_cumsum, seq_idx=None, poison=False, config=None,
                     accumulate=None):
    """-> (dx (b, L, h, p), dB summed over each group's heads (b, L, g, n), ddt_out and
    ddA_cumsum (b, h, c, l), the latter in natural-log units), all float32, like
    ``reference.backward.chunk_states_backward`` (whose dB is per head: sum it with
    ``reference.backward._sum_groups``). ``dA_cumsum`` in the kernels' log2 units. With
    ``accumulate`` = (dx, ddt, ddA) those tensors get this kernel's contributions added in place
    and are returned."""
    dx, dB_parts, ddt, ddA, ddA_tiles = run(bwd_chunk_states_plan(
        dS, x, B, dt_out, dA_cumsum, seq_idx, poison, config, accumulate))
    # Fixed-order sums: the head splits' dB partials, the token tiles' last-token terms.
    dB = sum_splits(dB_parts)
    ddA[..., -1] += ddA_tiles.sum(-1)
    return dx, dB, ddt, ddA
