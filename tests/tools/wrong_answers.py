"""Plausible wrong answers to the graded exercises, one or more per exercise: each is a mistake a
learner makes (the one the exercise warns about first), and ``WRONG`` says which words the
grader's FAIL must contain to name it. ``tests/tools/test_exercises.py`` grades them all.
"""
import math

import cuda.tile as ct

from ops.core.chunk_cumsum import chunk_cumsum_core_kernel
from ops.core.compute_out import compute_out_core_kernel

ConstInt = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO


# add_vectors: the index counted in elements, not tiles.
@ct.kernel
def add_vectors_element_index(a, b, c, TILE: ConstInt):
    i = ct.bid(0)
    ct.store(c, (i * TILE,), ct.load(a, (i * TILE,), shape=(TILE,)) + ct.load(b, (i * TILE,), shape=(TILE,)))


# scale_matrix: the block's axes swapped.
@ct.kernel
def scale_matrix_swapped(a, out, scale: float, TM: ConstInt, TN: ConstInt):
    i, j = ct.bid(0), ct.bid(1)
    ct.store(out, (j, i), ct.load(a, (j, i), shape=(TM, TN)) * scale)


# transpose: order= forgotten, and the tile transposed after a plain load of the wrong tile.
@ct.kernel
def transpose_no_order(a, out, TM: ConstInt, TN: ConstInt):
    i, j = ct.bid(0), ct.bid(1)
    ct.store(out, (i, j), ct.load(a, (i, j), shape=(TM, TN)))


# row_cumsum: summed down the columns.
@ct.kernel
def row_cumsum_axis0(a, out, TM: ConstInt, N: ConstInt):
    i = ct.bid(0)
    t = ct.load(a, (i, 0), shape=(TM, N), padding_mode=ZERO)
    ct.store(out, (i, 0), ct.cumsum(t, axis=0))


# causal_decay: the mask multiplied in after exp2.
@ct.kernel
def causal_decay_mask_after(v, out, N: ConstInt):
    x = ct.load(v, (0,), shape=(N,))
    pos = ct.arange(N, dtype=ct.int32)
    mask = ct.where(pos[:, None] >= pos[None, :], 1.0, 0.0)
    ct.store(out, (0, 0), ct.exp2(x[:, None] - x[None, :]) * mask)


# matmul: a float16 accumulator.
@ct.kernel
def matmul_fp16_acc(a, b, out, TM: ConstInt, TN: ConstInt, TK: ConstInt):
    i, j = ct.bid(0), ct.bid(1)
    acc = ct.zeros((TM, TN), dtype=ct.float16)
    for k in range(ct.cdiv(a.shape[1], TK)):
        x = ct.load(a, (i, k), shape=(TM, TK))
        y = ct.load(b, (k, j), shape=(TK, TN))
        acc = ct.mma(x, y, acc)
    ct.store(out, (i, j), acc.astype(out.dtype))


# decay_to_end: the sum including token t itself.
@ct.kernel
def decay_to_end_inclusive(dt, A, out, CHUNK: ConstInt, H: ConstInt):
    a = ct.load(A, (0,), shape=(H,)) * 1.4426950408889634
    v = ct.load(dt, (0, 0), shape=(H, CHUNK), order=(1, 0), padding_mode=ZERO) * a[:, None]
    ct.store(out, (0, 0), ct.exp2(ct.sum(v, axis=1, keepdims=True) - ct.cumsum(v, axis=1) + v))


# dt_cumsum: softplus as log(1 + exp(v)), which overflows for large v.
@ct.kernel
def dt_cumsum_naive_softplus(dt, A, dt_bias, out, CHUNK: ConstInt, H: ConstInt):
    v = ct.load(dt, (0, 0), shape=(H, CHUNK), order=(1, 0))
    v = v + ct.load(dt_bias, (0,), shape=(H,))[:, None]
    a = ct.load(A, (0,), shape=(H,)) * 1.4426950408889634
    ct.store(out, (0, 0), ct.cumsum(ct.log(1.0 + ct.exp(v)) * a[:, None], axis=1))


# state_passing: the entry state stored after the chunk is folded in.
@ct.kernel
def state_passing_store_after(states, decay, entry, final, TP: ConstInt, N: ConstInt):
    i = ct.bid(0)
    state = ct.zeros((TP, N), dtype=ct.float32)
    for c in range(states.shape[0]):
        s = ct.reshape(ct.load(states, (c, i, 0), shape=(1, TP, N)), (TP, N))
        state = ct.exp2(ct.load(decay, (c,), shape=(1,))) * state + s
        ct.store(entry, (c, i, 0), ct.reshape(state, (1, TP, N)))
    ct.store(final, (i, 0), state)


# chunk_output_partial: the default padding everywhere.
@ct.kernel
def chunk_output_partial_default_padding(C, B, x, dA, dt, out, CHUNK: ConstInt, P: ConstInt,
                                         N: ConstInt):
    c_rows = ct.load(C, (0, 0), shape=(CHUNK, N))
    b_rows = ct.load(B, (0, 0), shape=(CHUNK, N))
    x_rows = ct.load(x, (0, 0), shape=(CHUNK, P))
    a = ct.load(dA, (0,), shape=(CHUNK,))
    d = ct.load(dt, (0,), shape=(CHUNK,))
    cb = ct.mma(c_rows, ct.transpose(b_rows), ct.zeros((CHUNK, CHUNK), dtype=ct.float32))
    pos = ct.arange(CHUNK, dtype=ct.int32)
    expo = ct.where(pos[:, None] >= pos[None, :], a[:, None] - a[None, :], -math.inf)
    weights = (cb * ct.exp2(expo) * d[None, :]).astype(x.dtype)
    ct.store(out, (0, 0), ct.mma(weights, x_rows, ct.zeros((CHUNK, P), dtype=ct.float32)))


# row_sums: the grid rounds down, and the column loop forgets the partial tile.
def row_sums_grid_floor(M, N):
    return (M // 16,)


def row_sums_grid(M, N):
    return (ct.cdiv(M, 16),)


@ct.kernel
def row_sums_right(a, out, TM: ConstInt, TN: ConstInt):      # right (every row fits one 1024-wide
    t = ct.load(a, (ct.bid(0), 0), shape=(TM, 1024), padding_mode=ZERO)  # tile), for the wrong grid
    ct.store(out, (ct.bid(0),), ct.sum(t, axis=1))


@ct.kernel
def row_sums_floor_loop(a, out, TM: ConstInt, TN: ConstInt):
    i = ct.bid(0)
    acc = ct.zeros((TM,), dtype=ct.float32)
    for j in range(a.shape[1] // TN):
        acc = acc + ct.sum(ct.load(a, (i, j), shape=(TM, TN), padding_mode=ZERO), axis=1)
    ct.store(out, (i,), acc)


@ct.kernel
def row_sums_default_padding(a, out, TM: ConstInt, TN: ConstInt):
    i = ct.bid(0)
    acc = ct.sum(ct.load(a, (i, 0), shape=(TM, TN)), axis=1)
    for j in range(1, ct.cdiv(a.shape[1], TN)):
        acc += ct.sum(ct.load(a, (i, j), shape=(TM, TN)), axis=1)
    ct.store(out, (i,), acc)


# softmax_rows: no maximum subtracted; zero padding.
@ct.kernel
def softmax_rows_no_max(a, out, TM: ConstInt, N: ConstInt):
    i = ct.bid(0)
    e = ct.exp(ct.load(a, (i, 0), shape=(TM, N), padding_mode=ct.PaddingMode.NEG_INF))
    ct.store(out, (i, 0), e / ct.sum(e, axis=1, keepdims=True))


@ct.kernel
def softmax_rows_zero_padding(a, out, TM: ConstInt, N: ConstInt):
    i = ct.bid(0)
    t = ct.load(a, (i, 0), shape=(TM, N), padding_mode=ZERO)
    e = ct.exp(t - ct.max(t, axis=1, keepdims=True))
    ct.store(out, (i, 0), e / ct.sum(e, axis=1, keepdims=True))


# layer_norm: the variance as E[x^2] - E[x]^2; padded deviations not masked.
@ct.kernel
def layer_norm_one_pass(a, w, b, out, eps: float, TM: ConstInt, N: ConstInt):
    i = ct.bid(0)
    n = a.shape[1]
    t = ct.load(a, (i, 0), shape=(TM, N), padding_mode=ZERO)
    mean = ct.sum(t, axis=1, keepdims=True) / n
    var = ct.sum(t * t, axis=1, keepdims=True) / n - mean * mean
    wt = ct.load(w, (0,), shape=(N,), padding_mode=ZERO)
    bt = ct.load(b, (0,), shape=(N,), padding_mode=ZERO)
    ct.store(out, (i, 0), (t - mean) * ct.rsqrt(var + eps) * wt[None, :] + bt[None, :])


@ct.kernel
def layer_norm_unmasked(a, w, b, out, eps: float, TM: ConstInt, N: ConstInt):
    i = ct.bid(0)
    n = a.shape[1]
    t = ct.load(a, (i, 0), shape=(TM, N), padding_mode=ZERO)
    d = t - ct.sum(t, axis=1, keepdims=True) / n
    var = ct.sum(d * d, axis=1, keepdims=True) / n
    wt = ct.load(w, (0,), shape=(N,), padding_mode=ZERO)
    bt = ct.load(b, (0,), shape=(N,), padding_mode=ZERO)
    ct.store(out, (i, 0), d * ct.rsqrt(var + eps) * wt[None, :] + bt[None, :])


# matmul_k: the K loop rounds down; the partial K tile read with the default padding.
@ct.kernel
def matmul_k_floor_loop(a, b, out, TM: ConstInt, TN: ConstInt, TK: ConstInt):
    i, j = ct.bid(0), ct.bid(1)
    acc = ct.zeros((TM, TN), dtype=ct.float32)
    for k in range(a.shape[1] // TK):
        acc = ct.mma(ct.load(a, (i, k), shape=(TM, TK), padding_mode=ZERO),
                     ct.load(b, (k, j), shape=(TK, TN), padding_mode=ZERO), acc)
    ct.store(out, (i, j), acc)


@ct.kernel
def matmul_k_default_padding(a, b, out, TM: ConstInt, TN: ConstInt, TK: ConstInt):
    i, j = ct.bid(0), ct.bid(1)
    acc = ct.zeros((TM, TN), dtype=ct.float32)
    for k in range(ct.cdiv(a.shape[1], TK)):
        acc = ct.mma(ct.load(a, (i, k), shape=(TM, TK)), ct.load(b, (k, j), shape=(TK, TN)), acc)
    ct.store(out, (i, j), acc)


# state_update: the decay applied to the new chunk instead of the old state.
@ct.kernel
def state_update_decay_wrong(x, B, w, state, decay, out, CHUNK: ConstInt, P: ConstInt, N: ConstInt):
    xt = ct.load(x, (0, 0), shape=(CHUNK, P))
    bt = ct.load(B, (0, 0), shape=(CHUNK, N))
    xw = (xt.astype(ct.float32) * ct.load(w, (0,), shape=(CHUNK,))[:, None]).astype(xt.dtype)
    d = ct.load(decay, (0,), shape=(1,))
    acc = ct.mma(ct.transpose(xw), bt, ct.zeros((P, N), dtype=ct.float32))
    ct.store(out, (0, 0), ct.load(state, (0, 0), shape=(P, N)) + d * acc)


# chunk_output: no causal mask.
@ct.kernel
def chunk_output_no_mask(C, B, x, dA, dt, out, CHUNK: ConstInt, P: ConstInt, N: ConstInt):
    c_rows = ct.load(C, (0, 0), shape=(CHUNK, N))
    b_rows = ct.load(B, (0, 0), shape=(CHUNK, N))
    a = ct.load(dA, (0,), shape=(CHUNK,))
    cb = ct.mma(c_rows, ct.transpose(b_rows), ct.zeros((CHUNK, CHUNK), dtype=ct.float32))
    weights = (cb * ct.exp2(a[:, None] - a[None, :])
               * ct.load(dt, (0,), shape=(CHUNK,))[None, :]).astype(x.dtype)
    ct.store(out, (0, 0), ct.mma(weights, ct.load(x, (0, 0), shape=(CHUNK, P)),
                                 ct.zeros((CHUNK, P), dtype=ct.float32)))


# ssd_forward: the state pass forgets to decay the carried state (the other two kernels right:
# ops/core's).
@ct.kernel
def ssd_states_no_decay(x, B, dt_out, dA_cumsum, entry_states, final_states,
                        CHUNK: ConstInt, P: ConstInt, N: ConstInt):
    h, b = ct.bid(0), ct.bid(1)
    state = ct.zeros((P, N), dtype=ct.float32)
    for c in range(dt_out.shape[2]):
        ct.store(entry_states, (b, c, h, 0, 0),
                 ct.reshape(state, (1, 1, 1, P, N)).astype(entry_states.dtype))
        xt = ct.reshape(ct.load(x, (b, c, h, 0), shape=(1, CHUNK, 1, P)), (CHUNK, P))
        bt = ct.reshape(ct.load(B, (b, c, 0, 0), shape=(1, CHUNK, 1, N)), (CHUNK, N))
        dA = ct.reshape(ct.load(dA_cumsum, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
        dt = ct.reshape(ct.load(dt_out, (b, h, c, 0), shape=(1, 1, 1, CHUNK)), (CHUNK,))
        last = ct.extract(dA, (CHUNK - 1,), shape=(1,))
        xw = (xt.astype(ct.float32) * (ct.exp2(last - dA) * dt)[:, None]).astype(xt.dtype)
        state = state + ct.mma(ct.transpose(xw), bt, ct.zeros((P, N), dtype=ct.float32))
    ct.store(final_states, (b, h, 0, 0), ct.reshape(state, (1, 1, P, N)))


# (exercise, kernel, grid function or None, words the FAIL must contain)
WRONG = [
    ("add_vectors", add_vectors_element_index, None, "block (1,)"),
    ("scale_matrix", scale_matrix_swapped, None, "problem 2 of 3"),
    ("transpose", transpose_no_order, None, "problem 1 of 3"),
    ("row_cumsum", row_cumsum_axis0, None, "block (0,) stored it"),
    ("causal_decay", causal_decay_mask_after, None, "exp2 of an unmasked exponent overflows"),
    ("matmul", matmul_fp16_acc, None, "summed or rounded in 16 bits"),
    ("decay_to_end", decay_to_end_inclusive, None, "the sum including token t itself"),
    ("dt_cumsum", dt_cumsum_naive_softplus, None, "log(1 + exp(v)) overflows"),
    ("state_passing", state_passing_store_after, None, "entry[0, 0, 0] is"),
    ("chunk_output_partial", chunk_output_partial_default_padding, None,
     "with the default padding_mode"),
    ("row_sums", row_sums_floor_loop, row_sums_grid, "a partial last tile"),
    ("row_sums", row_sums_default_padding, row_sums_grid, "with the default padding_mode"),
    ("row_sums", row_sums_right, row_sums_grid_floor, "never written"),
    ("softmax_rows", softmax_rows_no_max, None, "exp of a logit overflows"),
    ("softmax_rows", softmax_rows_zero_padding, None, "28 padded columns"),
    ("layer_norm", layer_norm_one_pass, None, "E[x^2] - E[x]^2 cancels"),
    ("layer_norm", layer_norm_unmasked, None, "28 padded columns"),
    ("matmul_k", matmul_k_floor_loop, None, "a partial last K tile"),
    ("matmul_k", matmul_k_default_padding, None, "with the default padding_mode"),
    ("state_update", state_update_decay_wrong, None, "problem 1 of 3"),
    ("chunk_output", chunk_output_no_mask, None, "problem 1 of 3"),
    ("ssd_forward", (chunk_cumsum_core_kernel, ssd_states_no_decay, compute_out_core_kernel), None,
     "two chunks"),
]
