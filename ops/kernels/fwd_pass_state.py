"""Kernel (b): every chunk's state, and the pass over chunks that chains them.

The state of one head is a (headdim, dstate) matrix. A chunk adds to it

    chunk_state = sum_t  exp2(dA[last] - dA[t]) * dt[t] * outer(x[t], B[t])
                = (x * w)^T @ B          with w[t] = exp2(dA[last] - dA[t]) * dt[t]

(a (headdim, chunk) x (chunk, dstate) matrix product), and carries in the state it started
from, decayed over the whole chunk:

    entry[c]  = running
    running   = exp2(dA[c, last]) * running + chunk_state[c]

What one block does
    One block owns one (batch, head, headdim tile, dstate tile) slice of the state: a
    (BLOCK_P, BLOCK_N) tile that stays in registers, in float32, for the whole sequence. It walks
    the chunks in order; for each chunk it loads x (CHUNK, BLOCK_P), B (CHUNK, BLOCK_N) and the
    chunk's dt and dA, computes the chunk's state with one ``ct.mma``, writes the running state
    out as that chunk's entry state, and updates the running state. The final running state is
    the final state.

The grid
    ``(cdiv(headdim, BLOCK_P) * cdiv(dstate, BLOCK_N), nheads, batch)``. Blocks are independent
    (state entries never mix across heads, headdim rows or dstate columns); only the loop over
    chunks inside a block is sequential. The loads of chunk c + 1 don't depend on the running
    state, so they can be in flight while chunk c is being folded in.

Parallelism
    That grid is small: batch * nheads * (headdim / BLOCK_P) * (dstate / BLOCK_N) blocks, e.g.
    80 for a 2.7B-sized layer (h=80, p=64, n=128) with 64 x 128 tiles, against 132
    multiprocessors on an H200. Narrower tiles give more blocks but read x once per dstate
    tile and B once per headdim tile. Each block is latency-bound on its chunk-by-chunk loads,
    at about half the peak memory throughput (``tests/benchmark/results/ncu/*_compute128.csv``;
    PERF_NOTES.md, open question 4). With no hints, at the compiler's occupancy, 64 x 128 with
    16-bit entry states is the fastest tile at every benchmark shape from dstate 128 (the
    tuner's cache, ``tests/benchmark/results/autotune_h200.json.gz``, times each). Tuned, the
    load latency hint LOAD_LAT=8 gives 1.3-1.4x at dstate >= 128, and 64 x 64 tiles at two
    blocks per multiprocessor up to 1.7x (notebook 06; ``tests/benchmark/test_tuning_claims.py``
    checks both against that cache); beyond that, a faster version needs more memory in flight
    per block or a parallel chunk-state pass ahead of a light sequential one, as mamba_ssm does
    (SPLIT, below).

Layouts
    dt and the decay cumsum come from chunk_cumsum as (batch, nheads, nchunks, CHUNK): one
    contiguous run of (padded) tokens per head, so a block reads its head's chunk of each as one
    contiguous CHUNK * 4-byte segment (in the (batch, seqlen, nheads) layout of the input dt the
    same values would lie nheads * 4 bytes apart). x and B are read as (CHUNK, BLOCK_P) and
    (CHUNK, BLOCK_N) tiles whose rows are contiguous runs of headdim / dstate.

Variants (``default_config`` / ``search_space``)
    CHUNKS_PER_ITER=2 loads two chunks' inputs at the top of each loop iteration, then folds
    them in order: twice the bytes in flight per block, which is what a latency-bound block with
    few neighbours needs (the two products are independent of the running state, so they can
    overlap the folds). It needs registers for a second product: with the default 64 x 128 tile
    it spills heavily, so the search space pairs it with smaller tiles.
    SWAP=True computes the transposed chunk state, (BLOCK_N, BLOCK_P) = B^T @ (x * w), carries
    the running state transposed and writes it through ``order=`` (the same memory layout):
    the tensor cores then take B, straight from shared memory, as the first operand and the
    weighted x (computed in registers) as the second; which order the compiler serves better is
    measured, not guessed.
    SPLIT=True takes the work apart in two launches: ``chunk_states_kernel`` forms every chunk's
    own state at once, one block per (chunk, state tile, head, batch) -- nchunks times the
    blocks, none waiting on another -- into a float32 (b, c, h, p, n) buffer; then this kernel
    walks the chunks loading only that tile and dA[last], decaying and adding. The price: the
    buffer written and read once (the entry states' size in float32), and a pass that is still
    sequential but does no product. On the H200 the whole forward is slower with it at every
    shape timed (``tests/benchmark/results/fwd_pass_state_split_h200.csv``); it stays in the
    search space for GPUs where the balance differs. (A third layout, one block per chunk handing
    each chunk's state to the next through ready flags in global memory, is slower too and is
    not implemented: ``fwd_pass_state_chained_h200.csv``; notebook 06 says why both lose.)
    Latency hints (LOAD_LAT on x, B and the initial state; STORE_LAT on
    the entry states), tile sizes and the compiler hint occupancy complete the space (num_ctas > 1 is
    refused: it faulted on sm_90).

Indexing
    Sequence-long arrays are ``ct.IndexedWithInt64`` (64-bit offsets); below 2**31 elements
    ``ops.runtime.launch.fit_index_width`` runs the kernel's 32-bit twin instead (notebook 06).

Packed sequences (seq_idx)
    Only tokens of the sequence that the chunk's last token belongs to write the chunk's state,
    and the carried state is dropped (not decayed) when the chunk's last token belongs to a
    different sequence than the one running at the chunk's start (id 0 before token 0, which is
    the sequence ``initial_states`` belongs to).

Precision
    The weighted x is cast back to x's dtype before the product, as mamba_ssm does: 16-bit inputs
    give 16-bit tensor-core operands with a float32 accumulator; float32 inputs give float32
    operands (full float32 products, not tf32).
"""
import torch

import cuda.tile as ct

from ops.tuning.configs import resolve_config, unique, with_hints
from ops.runtime.launch import Plan, fit_index_width, run
from ops.kernels.common import (load_state, state_tiles, ZERO, ConstBool, ConstInt, as_int32, cdiv, check_groups, check_sizes,
                    element_size, is_pow2_in, latency_hint, multiprocessors, new_output, tile_size)


# Helpers called from the kernel below. Plain functions are compiled into the kernel that calls
# them (inlined); their Constant arguments stay compile-time constants.

def store_entry(entry_states, b, c, h, pi, ni, running, BLOCK_P, BLOCK_N, SWAP, STORE_LAT):
    """Write the running state as chunk c's entry state. A transposed (SWAP) state goes through
    order=(0, 1, 2, 4, 3), which maps its (dstate, headdim) axes onto the array's
    (headdim, dstate) ones: the layout in memory is the same either way.
    (Tiles past headdim / dstate are dropped.)"""
    if SWAP:
        ct.store(entry_states, (b, c, h, ni, pi),
                 ct.reshape(running, (1, 1, 1, BLOCK_N, BLOCK_P)).astype(entry_states.dtype),
                 order=(0, 1, 2, 4, 3), latency=latency_hint(STORE_LAT))
    else:
        ct.store(entry_states, (b, c, h, pi, ni),
                 ct.reshape(running, (1, 1, 1, BLOCK_P, BLOCK_N)).astype(entry_states.dtype),
                 latency=latency_hint(STORE_LAT))


def store_final(final_states, b, h, pi, ni, running, BLOCK_P, BLOCK_N, SWAP):
    if SWAP:
        ct.store(final_states, (b, h, ni, pi), ct.reshape(running, (1, 1, BLOCK_N, BLOCK_P)),
                 order=(0, 1, 3, 2))
    else:
        ct.store(final_states, (b, h, pi, ni), ct.reshape(running, (1, 1, BLOCK_P, BLOCK_N)))


def chunk_inputs(x, B, dt_out, dA_cumsum, b, h, g, c, pi, ni, dtype,
                 CHUNK, BLOCK_P, BLOCK_N, LOAD_LAT):
    """Chunk c's x (CHUNK, BLOCK_P), B (CHUNK, BLOCK_N), dA and dt (CHUNK,). None of them
    depends on the running state, so they can be loaded ahead of the fold."""
    # The last chunk may be partial: zero padding gives x = B = 0 there (and dt is 0 too).
    xt = ct.load(x, (b, c, h, pi), shape=(1, CHUNK, 1, BLOCK_P), padding_mode=ZERO,
                 latency=latency_hint(LOAD_LAT))
    xt = ct.reshape(xt, (CHUNK, BLOCK_P))
    bt = ct.load(B, (b, c, g, ni), shape=(1, CHUNK, 1, BLOCK_N), padding_mode=ZERO,
                 latency=latency_hint(LOAD_LAT))
    bt = ct.reshape(bt, (CHUNK, BLOCK_N)).astype(dtype)
    # One head's dA / dt of one chunk: a contiguous CHUNK * 4-byte segment (see "Layouts").
    dA = ct.reshape(ct.load(dA_cumsum, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
    dt = ct.reshape(ct.load(dt_out, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
    return xt, bt, dA, dt


def last_sequence(seq_idx, b, c, seqlen, CHUNK):
    """The sequence id of chunk c's last token (a 0-d int32 tile)."""
    return ct.load(seq_idx, (b, min((c + 1) * CHUNK, seqlen) - 1), shape=())


def write_weights(dA, dt, seq_idx, b, c, seqlen, CHUNK, HAS_SEQ_IDX):
    """w (CHUNK,) = exp2(dA[last] - dA) dt, each token's weight in chunk c's own state (0 for
    tokens of another sequence than the last token's), and dA[last]."""
    # Decay from each token to the end of the chunk. The exponent is <= 0 for A <= 0;
    # the clamp makes sure exp2 can never overflow whatever the rounding.
    dA_last = ct.extract(dA, (CHUNK - 1,), shape=(1,)).item()
    w = ct.exp2(ct.minimum(dA_last - dA, 0.0)) * dt
    if HAS_SEQ_IDX:
        seq = ct.reshape(ct.load(seq_idx, (b, c), shape=(1, CHUNK), padding_mode=ZERO),
                         (CHUNK,))
        w = ct.where(seq == last_sequence(seq_idx, b, c, seqlen, CHUNK), w, 0.0)  # others don't
    return w, dA_last


def own_state(xt, bt, w, BLOCK_P, BLOCK_N, SWAP):
    """The chunk's own state sum_t w[t] outer(x[t], B[t]), in float32 (transposed when SWAP)."""
    xw = (xt.astype(ct.float32) * w[:, None]).astype(xt.dtype)
    if SWAP:
        # B^T @ (x * w): a (BLOCK_N, CHUNK) x (CHUNK, BLOCK_P) product; the state is transposed.
        return ct.mma(ct.transpose(bt), xw, ct.zeros((BLOCK_N, BLOCK_P), dtype=ct.float32))
    # (x * w)^T @ B: a (BLOCK_P, CHUNK) x (CHUNK, BLOCK_N) product on the tensor cores.
    return ct.mma(ct.transpose(xw), bt, ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32))


def carry(running, running_seq, own, dA_last, seq_idx, b, c, seqlen, CHUNK, HAS_SEQ_IDX):
    """running -> exp2(dA[last]) * running + the chunk's own state; (running, running_seq). The
    carried state is dropped when the chunk's last token starts another sequence."""
    chunk_decay = ct.exp2(dA_last)
    if HAS_SEQ_IDX:
        seq_last = last_sequence(seq_idx, b, c, seqlen, CHUNK)
        chunk_decay = ct.where(seq_last == running_seq, chunk_decay, 0.0)
        running_seq = seq_last
    return chunk_decay * running + own, running_seq


def fold_chunk(running, running_seq, xt, bt, dA, dt, seq_idx, b, c, seqlen,
               CHUNK, BLOCK_P, BLOCK_N, HAS_SEQ_IDX, SWAP):
    """running -> exp2(dA[last]) * running + chunk state; returns (running, running_seq)."""
    w, dA_last = write_weights(dA, dt, seq_idx, b, c, seqlen, CHUNK, HAS_SEQ_IDX)
    own = own_state(xt, bt, w, BLOCK_P, BLOCK_N, SWAP)
    return carry(running, running_seq, own, dA_last, seq_idx, b, c, seqlen, CHUNK, HAS_SEQ_IDX)


@ct.kernel
def chunk_states_kernel(
    x: ct.IndexedWithInt64,               # (batch, seqlen, nheads, headdim)
    B: ct.IndexedWithInt64,               # (batch, seqlen, ngroups, dstate)
    dt_out: ct.IndexedWithInt64,          # (batch, nheads, nchunks, CHUNK) float32
    dA_cumsum: ct.IndexedWithInt64,       # (batch, nheads, nchunks, CHUNK) float32, log2 units
    seq_idx: ct.IndexedWithInt64,         # (batch, seqlen) int32, unread if not HAS_SEQ_IDX
    chunk_states: ct.IndexedWithInt64,    # (batch, nchunks, nheads, headdim, dstate) float32
    heads_per_group: int,
    CHUNK: ConstInt,
    BLOCK_P: ConstInt,
    BLOCK_N: ConstInt,
    HAS_SEQ_IDX: ConstBool,
    LOAD_LAT: ConstInt,
):
    """SPLIT's first step: every chunk's own state at once, one block per (chunk, state tile,
    head, batch): nchunks times the blocks of the pass, none of them waiting on another."""
    n_ptiles = ct.cdiv(x.shape[3], BLOCK_P)
    n_tiles = n_ptiles * ct.cdiv(B.shape[3], BLOCK_N)
    tile_id, c = ct.bid(0) % n_tiles, ct.bid(0) // n_tiles
    pi, ni = tile_id % n_ptiles, tile_id // n_ptiles
    h, b = ct.bid(1), ct.bid(2)
    xt, bt, dA, dt = chunk_inputs(x, B, dt_out, dA_cumsum, b, h, h // heads_per_group, c, pi, ni,
                                  x.dtype, CHUNK, BLOCK_P, BLOCK_N, LOAD_LAT)
    w, _ = write_weights(dA, dt, seq_idx, b, c, x.shape[1], CHUNK, HAS_SEQ_IDX)
    own = own_state(xt, bt, w, BLOCK_P, BLOCK_N, False)
    ct.store(chunk_states, (b, c, h, pi, ni), ct.reshape(own, (1, 1, 1, BLOCK_P, BLOCK_N)))


@ct.kernel
def fwd_pass_state_kernel(
    x: ct.IndexedWithInt64,               # (batch, seqlen, nheads, headdim)
    B: ct.IndexedWithInt64,               # (batch, seqlen, ngroups, dstate)
    dt_out: ct.IndexedWithInt64,          # (batch, nheads, nchunks, CHUNK) float32
    dA_cumsum: ct.IndexedWithInt64,       # (batch, nheads, nchunks, CHUNK) float32, log2 units
    initial_states: ct.IndexedWithInt64,  # (batch, nheads, headdim, dstate), unread if not HAS_INIT
    seq_idx: ct.IndexedWithInt64,         # (batch, seqlen) int32, unread if not HAS_SEQ_IDX
    entry_states: ct.IndexedWithInt64,    # (batch, nchunks, nheads, headdim, dstate)
    final_states: ct.IndexedWithInt64,    # (batch, nheads, headdim, dstate) float32
    chunk_states: ct.IndexedWithInt64,    # (batch, nchunks, nheads, headdim, dstate) float32,
                                          # chunk_states_kernel's; unread unless SPLIT
    heads_per_group: int,
    CHUNK: ConstInt,
    BLOCK_P: ConstInt,
    BLOCK_N: ConstInt,
    HAS_INIT: ConstBool,
    HAS_SEQ_IDX: ConstBool,
    SWAP: ConstBool,                      # carry the state transposed: (BLOCK_N, BLOCK_P)
    CHUNKS_PER_ITER: ConstInt,            # 1 or 2 chunks loaded and folded per loop iteration
    LOAD_LAT: ConstInt,                   # latency hint of the x, B, initial state loads; 0 = none
    STORE_LAT: ConstInt,                  # latency hint of the entry state stores; 0 = none
    SPLIT: ConstBool,                     # the chunks' own states come from chunk_states
):
    tile_id = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    n_ptiles = ct.cdiv(x.shape[3], BLOCK_P)
    pi = tile_id % n_ptiles         # neighbouring blocks share the dstate tile, hence B
    ni = tile_id // n_ptiles
    g = h // heads_per_group        # the group whose B this head reads
    seqlen = x.shape[1]
    nchunks = dt_out.shape[2]

    if HAS_INIT:
        running = load_state(initial_states, b, h, pi, ni, BLOCK_P, BLOCK_N, SWAP, LOAD_LAT)
    elif SWAP:
        running = ct.zeros((BLOCK_N, BLOCK_P), dtype=ct.float32)
    else:
        running = ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32)
    running_seq = ct.zeros((), dtype=ct.int32)   # id of the sequence the running state belongs to

    singles_from = 0                # chunks from here on are folded one per iteration
    if CHUNKS_PER_ITER == 2:
        # Two chunks per iteration: both chunks' loads are issued before either is folded in,
        # so twice the bytes are in flight while the block waits, and the second chunk's
        # product (independent of the running state) can overlap the first one's fold.
        for pair in range(nchunks // 2):
            c = 2 * pair
            x0, b0, dA0, dt0 = chunk_inputs(x, B, dt_out, dA_cumsum, b, h, g, c, pi, ni,
                                            x.dtype, CHUNK, BLOCK_P, BLOCK_N, LOAD_LAT)
            x1, b1, dA1, dt1 = chunk_inputs(x, B, dt_out, dA_cumsum, b, h, g, c + 1, pi, ni,
                                            x.dtype, CHUNK, BLOCK_P, BLOCK_N, LOAD_LAT)
            store_entry(entry_states, b, c, h, pi, ni, running, BLOCK_P, BLOCK_N, SWAP, STORE_LAT)
            running, running_seq = fold_chunk(running, running_seq, x0, b0, dA0, dt0, seq_idx,
                                              b, c, seqlen, CHUNK, BLOCK_P, BLOCK_N,
                                              HAS_SEQ_IDX, SWAP)
            store_entry(entry_states, b, c + 1, h, pi, ni, running, BLOCK_P, BLOCK_N, SWAP,
                        STORE_LAT)
            running, running_seq = fold_chunk(running, running_seq, x1, b1, dA1, dt1, seq_idx,
                                              b, c + 1, seqlen, CHUNK, BLOCK_P, BLOCK_N,
                                              HAS_SEQ_IDX, SWAP)
        singles_from = 2 * (nchunks // 2)     # an odd number of chunks: the last one alone

    for c in range(singles_from, nchunks):
        # The state this chunk starts from. (Tiles past headdim / dstate are dropped.)
        store_entry(entry_states, b, c, h, pi, ni, running, BLOCK_P, BLOCK_N, SWAP, STORE_LAT)
        if SPLIT:
            # A light step: the chunk's own state was formed ahead, by another kernel.
            own = ct.reshape(ct.load(chunk_states, (b, c, h, pi, ni),
                                     shape=(1, 1, 1, BLOCK_P, BLOCK_N), padding_mode=ZERO,
                                     latency=latency_hint(LOAD_LAT)), (BLOCK_P, BLOCK_N))
            dA_last = ct.load(dA_cumsum, (b, h, c, CHUNK - 1), shape=())
            running, running_seq = carry(running, running_seq, own, dA_last, seq_idx, b, c,
                                         seqlen, CHUNK, HAS_SEQ_IDX)
        else:
            xt, bt, dA, dt = chunk_inputs(x, B, dt_out, dA_cumsum, b, h, g, c, pi, ni, x.dtype,
                                          CHUNK, BLOCK_P, BLOCK_N, LOAD_LAT)
            running, running_seq = fold_chunk(running, running_seq, xt, bt, dA, dt, seq_idx, b,
                                              c, seqlen, CHUNK, BLOCK_P, BLOCK_N, HAS_SEQ_IDX,
                                              SWAP)

    store_final(final_states, b, h, pi, ni, running, BLOCK_P, BLOCK_N, SWAP)


def default_config(*, headdim, dstate, dtype=torch.bfloat16, states_dtype=None, **_):
    """The kernel as described above: ``state_tiles``' tiles, one chunk per iteration, no
    hints. ``states_dtype`` (the entry states') defaults to ``dtype``, as ``ops.forward`` stores
    them."""
    bp, bn = state_tiles(headdim, dstate, states_dtype or dtype)
    return dict(BLOCK_P=bp, BLOCK_N=bn, SWAP=False, CHUNKS_PER_ITER=1, LOAD_LAT=0, STORE_LAT=0,
                INDEX64=False, occupancy=None, num_ctas=None, num_worker_warps=None, SPLIT=False)


def fits(cfg, *, chunk_size, dtype=torch.bfloat16, **_):
    """A rough budget that prunes tiles the chip cannot hold well (not a precise model).

    Registers: the float32 running state plus one chunk product per chunk in flight,
    (1 + CHUNKS_PER_ITER) * BLOCK_P * BLOCK_N floats, at most 16K (64 KiB, half of what 128
    threads at 255 registers hold: the inputs and addresses need the rest). The default 64 x 128
    tile sits exactly there (255 registers, no spills, on sm_90); two chunks of it in flight
    spill ~1000 registers, two chunks of 64 x 64 none. Shared memory: one chunk's x and B tiles
    per chunk in flight, at most 200 KiB of the 227 KiB an H200 block may use."""
    bp, bn, k = cfg["BLOCK_P"], cfg["BLOCK_N"], cfg["CHUNKS_PER_ITER"]
    regs = (1 + k) * bp * bn * 4
    smem = k * chunk_size * (bp + bn) * element_size(dtype)
    return regs <= 64 * 1024 and smem <= 200 * 1024


def search_space(*, headdim, dstate, chunk_size, dtype=torch.bfloat16, **shape):
    """Variants worth timing (about 25-45 for realistic shapes; the default comes first).

    The block is latency-bound on its chunk-by-chunk loads with few blocks in flight, so the
    space varies the work's split (SPLIT: the chunks' own states in parallel first), what is in
    flight per block (CHUNKS_PER_ITER, latency hints), the number of
    blocks (headdim x dstate tiles of 32..64 x 64..128), the operand order of the product
    (SWAP). Hints are tried on the default and on the first two-chunk config that fits. The
    occupancies tried depend on the multiprocessor count of the current GPU (an H200's 132
    without one), so the space, and the tuner's key, can differ between GPU models."""
    kw = dict(chunk_size=chunk_size, dtype=dtype)
    base = default_config(headdim=headdim, dstate=dstate, dtype=dtype, **shape)
    tiles = [(base["BLOCK_P"], base["BLOCK_N"])]
    for bp, bn in ((64, 64), (64, 128), (32, 128), (32, 64)):
        if bp <= tile_size(headdim) and bn <= tile_size(dstate) and (bp, bn) not in tiles:
            tiles.append((bp, bn))
    configs = [base]
    for bp, bn in tiles:
        for swap in (False, True):
            for k in (1, 2):
                configs.append({**base, "BLOCK_P": bp, "BLOCK_N": bn, "SWAP": swap,
                                "CHUNKS_PER_ITER": k})
    configs = [c for c in configs if fits(c, **kw)]
    anchors = [base] + [c for c in configs if c["CHUNKS_PER_ITER"] == 2 and not c["SWAP"]][:1]
    for anchor in anchors:
        for load_lat, store_lat in ((3, 0), (8, 0), (0, 8), (8, 8)):
            configs.append({**anchor, "LOAD_LAT": load_lat, "STORE_LAT": store_lat})
    # Smaller tiles give more blocks than multiprocessors: let several share one. Every block
    # walks the whole sequence, so a block that finds no free slot waits for a whole block's
    # run: besides two per multiprocessor, the occupancy that fits all blocks in one wave (at
    # most 4, where the registers run out). Each with and without the long load-latency hint
    # (both paid on their own on the H200).
    blocks = lambda bp, bn: (shape.get("batch", 1) * shape.get("nheads", 1)
                             * cdiv(headdim, bp) * cdiv(dstate, bn))
    narrow = [(bp, bn) for bp, bn in ((64, 32),) if bp <= tile_size(headdim) and bn <= tile_size(dstate)]
    sms = multiprocessors()      # the current GPU's (132 without one): prunes occupancies only
    for bp, bn in tiles[1:] + narrow:      # 64 x 32: 32 dstate columns, x read from L2 again
        n = blocks(bp, bn)
        if n <= blocks(base["BLOCK_P"], base["BLOCK_N"]):
            continue
        one_wave = min(4, cdiv(n, sms))
        for occupancy in sorted({2, max(2, one_wave)}):
            configs += [{**base, "BLOCK_P": bp, "BLOCK_N": bn, "occupancy": occupancy,
                         "LOAD_LAT": lat} for lat in (0, 8)]
    kept = [c for c in configs if fits(c, **kw)]
    # Eight worker warps (the compiler's default is four) on the two kinds of winners measured
    # on the H200: the long load-latency hint, and smaller tiles at two blocks per multiprocessor.
    wide = [{**base, "LOAD_LAT": 8}] + [c for c in kept if c.get("occupancy") == 2
                                        and not c["LOAD_LAT"]][:1]
    kept += [{**c, "num_worker_warps": 8} for c in wide]
    # SPLIT: every chunk's own state formed in parallel first (chunk_states_kernel), then a pass
    # that only decays and adds; with the long load-latency hint on the pass' reads too.
    kept += [{**base, "SPLIT": True}, {**base, "SPLIT": True, "LOAD_LAT": 8}]
    return unique(kept + [{**kept[0], "INDEX64": True}])


def fwd_pass_state_plan(x, B, dt_out, dA_cumsum, initial_states=None, seq_idx=None,
                        states_dtype=torch.float32, block_p=None, block_n=None, poison=False,
                        config=None):
    """Allocate the outputs and build the launch (an ``ops.runtime.launch.Plan``) without running it.

    ``config``: a dict from ``search_space`` (or part of one; missing keys take
    ``default_config``'s values for this shape). ``block_p`` / ``block_n``, when given, override
    the config's tiles. The returned kernel carries the config's compiler hints."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    check_sizes(headdim, dstate)
    check_groups(nheads, ngroups)
    nchunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    cfg = resolve_config(config, default_config(headdim=headdim, dstate=dstate, dtype=x.dtype,
                                                states_dtype=states_dtype))
    bp = min(block_p or cfg["BLOCK_P"], tile_size(headdim))
    bn = min(block_n or cfg["BLOCK_N"], tile_size(dstate))
    if not (is_pow2_in(bp, 1, 1024) and is_pow2_in(bn, 1, 1024)):
        raise ValueError(f"BLOCK_P ({bp}) and BLOCK_N ({bn}) must be powers of two")
    if cfg["CHUNKS_PER_ITER"] not in (1, 2):
        raise ValueError(f"CHUNKS_PER_ITER must be 1 or 2, got {cfg['CHUNKS_PER_ITER']}")
    if cfg["SPLIT"] and (cfg["SWAP"] or cfg["CHUNKS_PER_ITER"] != 1):
        raise ValueError("SPLIT takes SWAP=False and CHUNKS_PER_ITER=1 (its pass loads no x or B "
                         f"to swap or pair), got SWAP={cfg['SWAP']}, "
                         f"CHUNKS_PER_ITER={cfg['CHUNKS_PER_ITER']}")

    entry_states = new_output((batch, nchunks, nheads, headdim, dstate), states_dtype, x.device,
                              poison)
    final_states = new_output((batch, nheads, headdim, dstate), torch.float32, x.device, poison)
    seq_idx = as_int32(seq_idx)
    seq_arg = seq_idx if seq_idx is not None else dt_out
    tiles = cdiv(headdim, bp) * cdiv(dstate, bn)
    before = ()
    chunk_states = entry_states               # never read without SPLIT
    if cfg["SPLIT"]:
        chunk_states = new_output(entry_states.shape, torch.float32, x.device, poison)
        first = (x, B, dt_out, dA_cumsum, seq_arg, chunk_states, nheads // ngroups, chunk_size,
                 bp, bn, seq_idx is not None, cfg["LOAD_LAT"])
        before = (Plan((nchunks * tiles, nheads, batch),
                       fit_index_width(chunk_states_kernel, first, cfg["INDEX64"]), first,
                       (chunk_states,)),)
    # Absent optional tensors are replaced by an input the compiled variant never reads.
    args = (x, B, dt_out, dA_cumsum,
            initial_states if initial_states is not None else x,
            seq_arg, entry_states, final_states, chunk_states,
            nheads // ngroups, chunk_size, bp, bn,
            initial_states is not None, seq_idx is not None,
            bool(cfg["SWAP"]), cfg["CHUNKS_PER_ITER"], cfg["LOAD_LAT"], cfg["STORE_LAT"],
            bool(cfg["SPLIT"]))
    kernel = with_hints(fit_index_width(fwd_pass_state_kernel, args, cfg["INDEX64"]), cfg)
    return Plan((tiles, nheads, batch), kernel, args, (entry_states, final_states), before)


def fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states=None, seq_idx=None,
                   states_dtype=torch.float32, poison=False, config=None):
    """-> (entry_states (b, nchunks, h, p, n), final_states (b, h, p, n) float32).

    dt_out and dA_cumsum come from ``chunk_cumsum`` (dA_cumsum in log2 units). entry_states is
    float32 unless ``states_dtype`` says otherwise (16 bits halves its traffic; compute_out
    rounds it to C's dtype for its product anyway); inputs as ``ops.torch_op.as_kernel_input``
    gives them. ``poison=True`` NaN-fills the outputs first (for tests). ``config`` picks a
    variant (see ``search_space``); None is ``default_config``.
    """
    return run(fwd_pass_state_plan(x, B, dt_out, dA_cumsum, initial_states, seq_idx,
                                   states_dtype, poison=poison, config=config))
