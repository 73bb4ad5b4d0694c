"""Backward kernel: the pass over chunks in reverse, the gradient of every chunk's state.

The forward pass over chunks (``ops/kernels/fwd_pass_state.py``) is

    entry[c + 1] = a[c] * entry[c] + S[c]      a[c] = exp2(dA[c, last]), 0 where a new
                                                sequence starts inside chunk c
    entry[nchunks] = the final state

so the gradients flow the other way: with g the gradient of entry[c + 1] (that of the final
state for the last chunk),

    dS[c]     = g
    d a[c]    = sum(g * entry[c])               -> the gradient of dA[c, last]: d a[c] * a[c]
    g         <- a[c] * g + dentry[c]           (dentry: what compute_out's backward gives)

and the g left after chunk 0 is the gradient of the initial state. As in the forward, one block
owns one (batch, head, headdim tile, dstate tile) slice and keeps its float32 tile of g in
registers while it walks the chunks, here from the last to the first; blocks are independent.

The sum over the state for d a[c] spans the block's tile only: each block writes its partial
sum, and the host adds the tiles' partials (a fixed order: the result is bitwise reproducible,
no atomics). ``reference.backward.state_passing_backward`` is the specification.

dS is written float32, or in another dtype (``ds_dtype``): ``ops/backward.py`` asks for bf16 with
bf16 inputs, whose chunk_states products round dS to bf16 anyway (half the bytes, the same bits
downstream). Tunables (``default_config`` / ``search_space``): the state tile BLOCK_P x BLOCK_N
(``common.state_tiles`` by default), LOAD_LAT (latency hint of the dentry and entry
loads), STORE_LAT (of the dS stores), and the compiler hints occupancy and num_worker_warps;
``walk_space``, the variants of the walk with FUSE_ENTRY (below), adds ROW_PARTS (d a[c]'s
partials one per headdim row of a tile instead of one per tile: BLOCK_P times the partials,
summed downstream in order), ENTRY_BLOCK_T, ENTRY_LAT (the latency hint of the product's dy
and C loads) and CARRY_ACC.

FUSE_ENTRY=True forms each chunk's dentry tile in the walk itself, from dy and C
(``common.entry_gradient``, over ENTRY_BLOCK_T-token tiles), as the forward's pass
forms each chunk's own state from x and B: no dentry buffer ((b, c, h, p, n) float32, alive
through this walk, whose step is then the backward's peak at chunk 128) and no entry launch, for
a walk that does a product per chunk. It takes other inputs (dy and C instead of dentry), so the
kernel's own default and search space keep the walk as first written, reading dentry;
``ops/backward.py`` runs it with FUSE_ENTRY (``walk_config``): a training step's scan
takes less time with it at chunks 64 and 128, little less at 256, and at the host-bound prefill
shape the rounds differ more than that (``tests/benchmark/results/bwd_fuse_entry_h200.csv``;
PERF_NOTES.md, "dentry formed in the pass").
"""
import torch

import cuda.tile as ct

from ops.tuning.configs import resolve_config, unique, with_hints
from ops.runtime.launch import Plan, fit_index_width, run
from ops.kernels.common import (entry_gradient, entry_read_dtype, load_state, state_tiles, ZERO, ConstBool, ConstInt, as_int32, cdiv, is_pow2_in, latency_hint,
                    multiprocessors, new_output, tile_size, unread_stand_in)


def chunk_state_tile(array, b, c, h, pi, ni, BLOCK_P, BLOCK_N, LOAD_LAT=0):
    """Tile (pi, ni) of chunk c of a (batch, nchunks, nheads, headdim, dstate) array as float32
    (zero-padded); ``common.load_state`` reads the (batch, nheads, ...) ones."""
    t = ct.load(array, (b, c, h, pi, ni), shape=(1, 1, 1, BLOCK_P, BLOCK_N), padding_mode=ZERO,
                latency=latency_hint(LOAD_LAT))
    return ct.reshape(t, (BLOCK_P, BLOCK_N)).astype(ct.float32)


@ct.kernel
def bwd_pass_state_kernel(
    dentry: ct.IndexedWithInt64,       # (batch, nchunks, nheads, headdim, dstate)
    dfinal,                            # (batch, nheads, headdim, dstate); unread if not HAS_DFINAL
    entry: ct.IndexedWithInt64,        # (batch, nchunks, nheads, headdim, dstate), the forward's
    dA_cumsum: ct.IndexedWithInt64,    # (batch, nheads, nchunks, CHUNK) float32, log2 units
    seq_idx: ct.IndexedWithInt64,      # (batch, seqlen) int32; unread if not HAS_SEQ_IDX
    dS: ct.IndexedWithInt64,           # (batch, nchunks, nheads, headdim, dstate), ds_dtype
    da_parts,                          # (batch, nheads, nchunks, tiles) float32, with
                                       # ROW_PARTS (..., tiles * BLOCK_P)
    dinitial,                          # (batch, nheads, headdim, dstate) float32; unwritten
                                       # unless WITH_DINITIAL
    dy: ct.IndexedWithInt64,           # (batch, seqlen, nheads, headdim); read if FUSE_ENTRY
    C: ct.IndexedWithInt64,            # (batch, seqlen, ngroups, dstate); read if FUSE_ENTRY
    heads_per_group: int,
    CHUNK: ConstInt,
    BLOCK_P: ConstInt,
    BLOCK_N: ConstInt,
    ENTRY_BLOCK_T: ConstInt,           # token tile of dentry's product (FUSE_ENTRY)
    HAS_DFINAL: ConstBool,
    HAS_SEQ_IDX: ConstBool,
    FUSE_ENTRY: ConstBool,             # dentry formed here from dy and C (dentry unread)
    BF16_OPERANDS: ConstBool,          # dentry's product in dy's dtype (bf16), else float32
    LOAD_LAT: ConstInt,                # latency hint of the dentry and entry loads; 0 = none
    STORE_LAT: ConstInt,               # latency hint of the dS stores; 0 = none
    WITH_DINITIAL: ConstBool,          # carry the walk past chunk 0 to dinitial (else stop)
    ENTRY_LAT: ConstInt,               # latency hint of dentry's product's dy and C loads
                                       # (FUSE_ENTRY); 0 = none
    CARRY_ACC: ConstBool,              # the carried gradient is that product's accumulator
                                       # (FUSE_ENTRY)
    ROW_PARTS: ConstBool,              # d a[c]'s partials per headdim row of the tile
                                       # (BLOCK_P a tile), else one a tile
):
    tile_id, h, b = ct.bid(0), ct.bid(1), ct.bid(2)
    n_ptiles = ct.cdiv(entry.shape[3], BLOCK_P)
    pi, ni = tile_id % n_ptiles, tile_id // n_ptiles
    nchunks = dA_cumsum.shape[2]
    if HAS_DFINAL:
        g = load_state(dfinal, b, h, pi, ni, BLOCK_P, BLOCK_N, False, 0)
    else:
        g = ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32)
    for i in range(nchunks):
        c = nchunks - 1 - i                                   # the chunks, last first
        ct.store(dS, (b, c, h, pi, ni),
                 ct.reshape(g, (1, 1, 1, BLOCK_P, BLOCK_N)).astype(dS.dtype),
                 latency=latency_hint(STORE_LAT))
        dA = ct.reshape(ct.load(dA_cumsum, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
        a = ct.exp2(ct.extract(dA, (CHUNK - 1,), shape=(1,)).item())
        if HAS_SEQ_IDX:
            seqlen = seq_idx.shape[1]
            seq_end = ct.load(seq_idx, (b, min((c + 1) * CHUNK, seqlen) - 1), shape=())
            seq_start = ct.load(seq_idx, (b, max(c * CHUNK - 1, 0)), shape=())
            seq_start = ct.where(c == 0, 0, seq_start)       # id 0 before token 0
            a = ct.where(seq_end == seq_start, a, 0.0)
        e = chunk_state_tile(entry, b, c, h, pi, ni, BLOCK_P, BLOCK_N, LOAD_LAT)
        if ROW_PARTS:
            ct.store(da_parts, (b, h, c, tile_id),
                     ct.reshape(ct.sum(g * e, axis=1) * a, (1, 1, 1, BLOCK_P)))
        else:
            ct.store(da_parts, (b, h, c, tile_id), ct.sum(g * e) * a)
        # the gradient of the state before chunk c; before chunk 0 it is dinitial's alone, and
        # without initial states no one reads it: the walk stops there (no dentry for chunk 0)
        if WITH_DINITIAL or c > 0:
            g = earlier_gradient(g, a, dentry, dy, C, dA_cumsum, seq_idx, b, c, h,
                                 heads_per_group, pi, ni, CHUNK, ENTRY_BLOCK_T, BLOCK_P, BLOCK_N,
                                 HAS_SEQ_IDX, FUSE_ENTRY, BF16_OPERANDS, LOAD_LAT, ENTRY_LAT,
                                 CARRY_ACC)
    if WITH_DINITIAL:
        ct.store(dinitial, (b, h, pi, ni), ct.reshape(g, (1, 1, BLOCK_P, BLOCK_N)))


def earlier_gradient(g, a, dentry, dy, C, dA_cumsum, seq_idx, b, c, h, heads_per_group, pi, ni,
                     CHUNK, ENTRY_BLOCK_T, BLOCK_P, BLOCK_N, HAS_SEQ_IDX, FUSE_ENTRY,
                     BF16_OPERANDS, LOAD_LAT, ENTRY_LAT, CARRY_ACC):
    """One step of the walk: the gradient of chunk c's entry state (``g``, carried through the
    chunk's decay ``a``) plus chunk c's dentry, formed here from dy and C (FUSE_ENTRY) or
    loaded: the gradient of the state before chunk c. With CARRY_ACC the decayed gradient is
    the product's accumulator (the tensor cores add it), else the product is formed from zeros
    and added after."""
    if FUSE_ENTRY:
        group = h // heads_per_group
        if CARRY_ACC:
            return entry_gradient(dy, C, dA_cumsum, seq_idx, b, c, h, group, pi, ni, CHUNK,
                                  ENTRY_BLOCK_T, BLOCK_P, BLOCK_N, HAS_SEQ_IDX, BF16_OPERANDS,
                                  a * g, ENTRY_LAT)
        return a * g + entry_gradient(dy, C, dA_cumsum, seq_idx, b, c, h, group, pi, ni, CHUNK,
                                      ENTRY_BLOCK_T, BLOCK_P, BLOCK_N, HAS_SEQ_IDX,
                                      BF16_OPERANDS, ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32),
                                      ENTRY_LAT)
    return a * g + chunk_state_tile(dentry, b, c, h, pi, ni, BLOCK_P, BLOCK_N, LOAD_LAT)


# Configs and launching -------------------------------------------------------------------------

# The most partials of d a[c] a chunk may have (ROW_PARTS): ``bwd_chunk_cumsum`` loads a chunk's
# partials of a block of heads as one tile, in registers.
MAX_PARTS = 256


def da_partials(headdim, dstate, block_p, block_n, row_parts):
    """How many partials of d a[c] the walk writes a chunk: one a (block_p, block_n) state tile,
    or one a row of it with ``row_parts``; the tiles cut as the plan cuts them (no wider than
    headdim's and dstate's own tiles)."""
    bp, bn = min(block_p, tile_size(headdim)), min(block_n, tile_size(dstate))
    return cdiv(headdim, bp) * cdiv(dstate, bn) * (bp if row_parts else 1)


def read_states_dtype(dtype=None, states_dtype=None):
    """The dtype this kernel reads the entry states in (``common.entry_read_dtype``):
    ``states_dtype`` (else ``dtype``, x's) as the backward reads it beside x's dtype; with
    ``dtype`` alone, the entry states' dtype as ``ops.backward`` passes them."""
    states = states_dtype or dtype or torch.float32
    return states if dtype is None else entry_read_dtype(dtype, states)


def default_config(*, headdim, dstate, dtype=None, states_dtype=None, **_):
    """The kernel as first written: ``state_tiles``' tiles for the entry states' dtype as this
    kernel gets them (``dtype``, x's, unless ``states_dtype`` says otherwise, as in
    ``ops.forward``; states of neither x's dtype nor float32 reach it widened to float32, as
    ``ops.backward`` passes them), no hints."""
    bp, bn = state_tiles(headdim, dstate, read_states_dtype(dtype, states_dtype))
    return dict(BLOCK_P=bp, BLOCK_N=bn, LOAD_LAT=0, STORE_LAT=0, INDEX64=False, occupancy=None,
                num_worker_warps=None, FUSE_ENTRY=False, ENTRY_BLOCK_T=64, ENTRY_LAT=0,
                CARRY_ACC=False, ROW_PARTS=False)


def walk_config(*, headdim, dstate, chunk_size, dtype=None, states_dtype=None, **_):
    """The keys ``ops/backward.py`` runs this kernel with over ``default_config`` (a caller's
    config is taken over them), by the width of ``state_tiles``' tiles:

      * FUSE_ENTRY everywhere (module docstring);
      * 128-column tiles (16-bit entry states, dstate's tile 128 and up): 64-column tiles at two
        blocks per multiprocessor with LOAD_LAT 8, twice the blocks of a walk that is
        latency-bound on its chunk-by-chunk loads, two of them resident per multiprocessor. A
        training step's scan took 2-3% less time at the 2.7B training shape, 16K x dstate 128
        and 64K x dstate 256; without the two blocks the 64-column tiles were 3-6% slower at the
        first two (at most 1.4% faster at the third), 32 x 64 tiles at two blocks slower at all
        three, and LOAD_LAT 8 alone changed nothing
        (``tests/benchmark/results/bwd_pass_state_tiles_h200.csv``);
      * dstate's tile 64 at chunk 128 (``chunk_size``, the chunk the backward computes at), with
        bf16 entry states as read (bf16 inputs and states): each chunk's dentry product in one
        piece (ENTRY_BLOCK_T 128) instead of 64-token tiles in a loop whose trip count is only
        known at run time (the last chunk may be short). Timed alone, the walk took 1.47-1.53x
        less time so at every dstate-64 shape searched, on an H100 and an H200 (1 x 16K and
        1 x 64K tokens x 80 heads, chunk 128;
        ``tests/benchmark/results/autotune_backward_chunk128_h100.json``, ``..._h200.json``),
        the best of ``walk_space`` each time; searched once it was the rule, at 1 x 4K on an
        H100, no candidate beat it by the tuner's margin (``autotune.MARGIN``; CARRY_ACC
        1.02x), the tiles 1.44x slower (``autotune_backward_chunk128_4k_dstate64_h100.json``).
        Compiled for sm_90 and sm_100 it spills no register; for sm_80, where no GPU has timed
        it, 48 bytes a thread each way (the tiles: none). fp16 and float32 inputs, never
        timed, keep the tiles: with the whole chunk they spill about three times the tiles'
        bytes (sm_90). Other chunks keep the tiles too: 64 is one tile already, 256 (the
        caller's chunk wherever ``ops/tuning/compute_chunk.py`` keeps it) was not measured.

    Other tiles (float32 entry states at dstate 128 and up, dstate's tile 32 and below) are left
    as they are. ``chunk_size`` is required: a caller that left it out would silently lose the
    third rule. What beats these keys differs by shape and GPU at dstate 128 and up
    (``walk_space``'s docstring): the table holds the winners."""
    states = read_states_dtype(dtype, states_dtype)
    if state_tiles(headdim, dstate, states)[1] >= 128:
        return {"FUSE_ENTRY": True, "BLOCK_N": 64, "occupancy": 2, "LOAD_LAT": 8}
    if tile_size(dstate) == 64 and chunk_size == 128 and states == torch.bfloat16:
        return {"FUSE_ENTRY": True, "ENTRY_BLOCK_T": 128}
    return {"FUSE_ENTRY": True}


def search_space(*, headdim, dstate, batch=1, nheads=1, **shape):
    """Variants worth timing (the default first, at most 14). Like the forward's pass, a block
    walks every chunk with one float32 state tile in registers, latency-bound on its
    chunk-by-chunk loads with few blocks: so the tiles (more, smaller blocks; 32-row tiles read
    the same bytes), the long latency hints on the loads and the stores, and two blocks per
    multiprocessor for tiles that give more blocks than multiprocessors."""
    base = default_config(headdim=headdim, dstate=dstate, **shape)
    tiles = [(base["BLOCK_P"], base["BLOCK_N"])]
    for bp, bn in ((64, 128), (64, 64), (32, 128), (32, 64)):
        bp, bn = min(bp, tile_size(headdim)), min(bn, tile_size(dstate))
        if (bp, bn) not in tiles:
            tiles.append((bp, bn))
    configs = [{**base, "BLOCK_P": bp, "BLOCK_N": bn} for bp, bn in tiles]
    configs += [{**base, "LOAD_LAT": 8}, {**base, "STORE_LAT": 8},
                {**base, "LOAD_LAT": 8, "STORE_LAT": 8}, {**base, "num_worker_warps": 8}]
    blocks = lambda bp, bn: batch * nheads * cdiv(headdim, bp) * cdiv(dstate, bn)
    for bp, bn in tiles[1:]:
        if blocks(bp, bn) > multiprocessors():
            configs += [{**base, "BLOCK_P": bp, "BLOCK_N": bn, "occupancy": 2, "LOAD_LAT": lat}
                        for lat in (0, 8)]
    return unique(configs)


def walk_space(*, headdim, dstate, chunk_size, batch=1, nheads=1, **shape):
    """The walk's variants as ``ops/backward.py`` runs it (FUSE_ENTRY), the chain's own config
    (``default_config`` with ``walk_config``'s keys) first: ``search_space``'s, fused (with
    the chain's ENTRY_BLOCK_T), and those of how a step forms its chunk's dentry product, what
    the step waits on being the walk's time (one block per state tile walks every chunk in
    turn):
      * the whole chunk in one product (ENTRY_BLOCK_T = the chunk) instead of 64-token tiles
        in a loop whose trip count is only known at run time (the last chunk may be short), or
        the tiles where the whole chunk is the chain's own;
      * the latency hint on the product's dy and C loads (ENTRY_LAT), which no other key
        reaches;
      * the decayed gradient as the product's accumulator (CARRY_ACC): one add and one
        (BLOCK_P, BLOCK_N) tile fewer a step;
      * d a[c]'s partials per headdim row (ROW_PARTS): a row sum per step instead of a sum over
        the whole tile, whose last stage crosses the block's warps (compiled for sm_90, the
        walk's block-wide barriers go from 12 to 2);
      * the whole chunk with the hint and the row partials, with and without the accumulator,
        and pairs of them; the three on narrower dstate tiles (32 and 16 columns) at two and
        four blocks per multiprocessor: more blocks walking at once where one per head leaves
        multiprocessors idle (batch 1, 80 heads, dstate 64: 80 blocks for 132).
    Every config gives the same gradients to float32 rounding (the order of the product's sums
    and of the partials' additions). Timed alone on an H100 at chunk 128 (``python -m
    ops.tools.tune search --backward-only``; ``tests/benchmark/results/
    autotune_backward_chunk128_h100.json``), the best at each shape changes one key or the
    tiles, and no pair or set of the new keys beat it: the whole chunk 1.53x the chain's config
    of then (64-token tiles) at 1 x 16K tokens x 80 heads of dstate 64, the accumulator 1.31x at
    the 2.7B training shape and 1.38x at 64K x dstate 256 (where 32 x 128 tiles at two blocks
    did best, 1.44x); all four together 0.92-1.19x. The machine code's counts did not rank them
    (``tests/benchmark/results/bwd_pass_state_walk_sass_sm90.csv``, ``walk_sass.py``: ROW_PARTS
    takes the block-wide barriers from 12 to 2 and was 1.11-1.36x).
    The H200's search (``autotune_backward_chunk128_h200.json``) agrees at dstate 64 (the whole
    chunk 1.47-1.50x at 16K and 64K tokens) and not at dstate 128, where ROW_PARTS won (1.19-1.27x
    at the 130M and 2.7B-prefill shapes), CARRY_ACC just behind. So the whole chunk is the
    chain's own at dstate 64 and chunk 128 with bf16 inputs (``walk_config``; the 64-token tiles
    stay in the space, to be timed against it), and at dstate 128 and up no key is: the winners
    are the table's entries, per GPU; PERF_NOTES.md, "The walk's step"."""
    sizes = dict(headdim=headdim, dstate=dstate, **shape)
    base = {**default_config(**sizes), **walk_config(chunk_size=chunk_size, **sizes)}
    configs = [base] + [{**c, "FUSE_ENTRY": True, "ENTRY_BLOCK_T": base["ENTRY_BLOCK_T"]}
                        for c in search_space(batch=batch, nheads=nheads, **sizes)]
    whole = min(chunk_size, 256)
    together = dict(ENTRY_BLOCK_T=whole, ENTRY_LAT=8, ROW_PARTS=True)
    configs += [{**base, "ENTRY_BLOCK_T": whole}, {**base, "ENTRY_BLOCK_T": 64},
                {**base, "ENTRY_LAT": 4},
                {**base, "ENTRY_LAT": 8}, {**base, "CARRY_ACC": True},
                {**base, "ROW_PARTS": True}, {**base, "ENTRY_BLOCK_T": whole, "ENTRY_LAT": 8},
                {**base, "ENTRY_BLOCK_T": whole, "ROW_PARTS": True}, {**base, **together},
                {**base, **together, "CARRY_ACC": True}]
    for bn in (32, 16):
        if bn < min(base["BLOCK_N"], tile_size(dstate)):
            configs += [{**base, **together, "BLOCK_N": bn, "occupancy": occupancy}
                        for occupancy in (2, 4)]
    return unique([c for c in configs if da_partials(headdim, dstate, c["BLOCK_P"], c["BLOCK_N"],
                                                     c["ROW_PARTS"]) <= MAX_PARTS])


def bwd_pass_state_plan(dentry, dfinal, entry, dA_cumsum, seq_idx=None, block_p=None,
                        block_n=None, poison=False, config=None, ds_dtype=torch.float32,
                        dy=None, C=None, with_dinitial=True):
    """The launch (an ``ops.runtime.launch.Plan``; outputs dS (in ``ds_dtype``), the partials
    of d dA[last] (one a state tile, or one a row of it with ROW_PARTS), dinitial;
    ``with_dinitial=False``: None for dinitial, and the walk stops after chunk 0's dS, without
    that chunk's dentry). ``dfinal`` may be None (a zero gradient). ``config``: a dict from
    ``search_space`` or ``walk_space`` (or part of one; missing keys take ``default_config``'s
    values);
    ``block_p`` / ``block_n``, when given, override its tiles. With FUSE_ENTRY the kernel forms
    dentry itself from ``dy`` (b, L, h, p) and ``C`` (b, L, g, n), contiguous, which it then
    needs, and ``dentry`` is not read (None will do)."""
    batch, nchunks, nheads, headdim, dstate = entry.shape
    chunk_size = dA_cumsum.shape[3]
    cfg = resolve_config(config, default_config(headdim=headdim, dstate=dstate,
                                                dtype=entry.dtype))
    fuse = bool(cfg["FUSE_ENTRY"])
    _check_entry_inputs(fuse, dentry, dy, C, entry, chunk_size, cfg["ENTRY_BLOCK_T"])
    bp = min(block_p or cfg["BLOCK_P"], tile_size(headdim))
    bn = min(block_n or cfg["BLOCK_N"], tile_size(dstate))
    if not (is_pow2_in(bp, 1, 1024) and is_pow2_in(bn, 1, 1024)):
        raise ValueError(f"BLOCK_P ({bp}) and BLOCK_N ({bn}) must be powers of two")
    if ds_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"ds_dtype must be float32, bfloat16 or float16, got {ds_dtype}")
    tiles = cdiv(headdim, bp) * cdiv(dstate, bn)
    row_parts = bool(cfg["ROW_PARTS"])
    parts = da_partials(headdim, dstate, bp, bn, row_parts)
    if row_parts and parts > MAX_PARTS:
        raise ValueError(f"ROW_PARTS with {bp} x {bn} tiles of a {headdim} x {dstate} state makes "
                         f"{parts} partials a chunk, over {MAX_PARTS}: take wider tiles")
    dS = new_output(entry.shape, ds_dtype, entry.device, poison)
    da_parts = new_output((batch, nheads, nchunks, parts), torch.float32, entry.device, poison)
    dinitial = (new_output((batch, nheads, headdim, dstate), torch.float32, entry.device, poison)
                if with_dinitial else None)
    seq_idx = as_int32(seq_idx)
    device = entry.device
    dinitial_arg = dinitial if with_dinitial else unread_stand_in(device, 4)
    args = (dentry if not fuse else unread_stand_in(device, 5),
            dfinal if dfinal is not None else dinitial_arg, entry, dA_cumsum,
            seq_idx if seq_idx is not None else dA_cumsum, dS, da_parts, dinitial_arg,
            dy if fuse else unread_stand_in(device, 4), C if fuse else unread_stand_in(device, 4),
            nheads // C.shape[2] if fuse else 1, chunk_size, bp, bn,
            min(cfg["ENTRY_BLOCK_T"], chunk_size), dfinal is not None, seq_idx is not None, fuse,
            fuse and dy.dtype == torch.bfloat16, cfg["LOAD_LAT"], cfg["STORE_LAT"],
            bool(with_dinitial), cfg["ENTRY_LAT"], bool(cfg["CARRY_ACC"]), row_parts)
    kernel = with_hints(fit_index_width(bwd_pass_state_kernel, args, cfg["INDEX64"]), cfg)
    return Plan((tiles, nheads, batch), kernel, args, (dS, da_parts, dinitial))


def _check_entry_inputs(fuse, dentry, dy, C, entry, chunk_size, entry_block_t):
    batch, nchunks, nheads, headdim, dstate = entry.shape
    if not fuse:
        if dentry is None:
            raise ValueError("dentry is required unless the config has FUSE_ENTRY=True")
        return
    if dy is None or C is None:
        raise ValueError("FUSE_ENTRY=True forms dentry from dy and C: pass both")
    if dy.dim() != 4 or tuple(dy.shape[::2]) != (batch, nheads) or dy.shape[3] != headdim:
        raise ValueError(f"dy must be (batch, seqlen, nheads, headdim) with batch {batch}, "
                         f"nheads {nheads}, headdim {headdim}; got {tuple(dy.shape)}")
    if (C.dim() != 4 or C.shape[:2] != dy.shape[:2] or C.shape[3] != dstate
            or nheads % C.shape[2]):
        raise ValueError(f"C must be (batch, seqlen, ngroups, dstate) like dy's tokens, with "
                         f"ngroups dividing nheads {nheads} and dstate {dstate}; got "
                         f"{tuple(C.shape)}")
    if -(-dy.shape[1] // chunk_size) != nchunks:
        raise ValueError(f"dy's {dy.shape[1]} tokens make {-(-dy.shape[1] // chunk_size)} "
                         f"chunks of {chunk_size}, the entry states {nchunks}")
    if not (dy.is_contiguous() and C.is_contiguous()):
        raise ValueError("dy and C must be contiguous")
    if not is_pow2_in(entry_block_t, 16, 256):
        raise ValueError(f"ENTRY_BLOCK_T must be a power of two in [16, 256], got "
                         f"{entry_block_t}")


def bwd_pass_state(dentry, dfinal, entry, dA_cumsum, seq_idx=None, poison=False, config=None,
                   ds_dtype=torch.float32, dy=None, C=None):
    """-> (dS (b, c, h, p, n) in ``ds_dtype`` (float32 by default), d dA_cumsum at each chunk's
    last token (b, h, c) float32, in natural-log units like
    ``reference.backward.state_passing_backward``'s, dinitial (b, h, p, n) float32).
    ``dA_cumsum`` in the kernels' log2 units. ``dy`` and ``C``: for FUSE_ENTRY (see
    ``bwd_pass_state_plan``)."""
    dS, da_parts, dinitial = run(bwd_pass_state_plan(dentry, dfinal, entry, dA_cumsum, seq_idx,
                                                     poison=poison, config=config,
                                                     ds_dtype=ds_dtype, dy=dy, C=C))
    return dS, da_parts.sum(-1), dinitial
