"""The graded exercises: for each, a PyTorch spec, the launch, the problems tried, two hints.

``ops.tools.grader`` runs a learner's kernel against these; the notebooks that pose them are
``notebooks/exercises/`` (the warm-up and the kernels), and the "your turn" cells of notebooks
03, 04 and 05. Every exercise obeys four rules, each checked by ``tests/tools/test_exercises.py``:

* **The problems catch the mistake the exercise warns about.** Each problem has a label saying
  what it stresses (what goes wrong there, not how to avoid it), and the grader prints it on a
  FAIL: a last tile that sticks out where padding reaches a sum, logits large enough that
  ``exp`` of them overflows, decays fast enough that ``exp2`` of an unmasked exponent is
  infinite, positive sums long enough that a float16 accumulator shows. The problems run in
  order, easy first, so a wrong answer fails on the first problem that exposes it. ``mistakes``
  lists outputs that known mistakes produce, so a FAIL can name one. A plausible wrong answer
  for each exercise is kept in the tests, and must fail.
* **Inputs are random, never zeros**, from a seeded generator (the same problems every run).
* **Tolerances say why**: a comment beside each, from the dtype and the length of the sums.
* **Two hints**: ``nudge`` points at what to think about; ``recipe`` says what to write. The
  grader prints neither on a FAIL: ``hint(name)`` prints the nudge, ``hint(name, full=True)``
  the recipe.

An exercise's ``launch(kernel, inputs, outputs, run, grid)`` launches the learner's kernel
through ``run(grid, kernel, args)`` (the grader's recording launch). ``grid`` is the learner's
grid function for the exercises that ask for one (``learner_grid``), else None.
"""
import dataclasses

import torch

from ops.checks import cdiv
from ops.core.chunk_cumsum import chunk_cumsum_core_kernel
from ops.core.compute_out import compute_out_core_kernel
from ops.core.fwd_pass_state import fwd_pass_state_core_kernel
from ops.kernels.common import LOG2E
from reference import chunked
from reference.sequential import ssd_sequential


@dataclasses.dataclass
class Exercise:
    title: str
    problems: tuple         # a label per problem: what it stresses (printed on a FAIL)
    inputs: object          # (generator, k) -> tuple of input tensors for problem k (0-based)
    outputs: object         # *inputs -> list of (shape, dtype) of the outputs, in kernel order
    launch: object          # (kernel, inputs, outputs, run, grid) -> None
    spec: object            # *inputs -> tuple of expected outputs (PyTorch)
    tol: float              # max |out - expected| / (1 + |expected|), elementwise
    nudge: str              # the first hint: what to think about
    recipe: str             # the second: what to write
    learner_grid: str = ""  # for exercises where the learner writes the grid: the grid
                            # function's signature, e.g. "row_sums_grid(M, N)"
    kernels: tuple = ()     # for an exercise of several kernels: their names, in launch order
    given: object = None    # () -> the project's own kernels for this exercise, which the
                            # grader refuses as an answer
    mistakes: tuple = ()    # (what the mistake is, *inputs -> the outputs it gives): when a wrong
                            # output matches one of these, the FAIL says so


def _randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _rand(gen, *shape):
    return torch.rand(*shape, generator=gen)


def _causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


TILE = 64           # the 1-d tile of the warm-up
TM, TN = 16, 32     # its 2-d tile


def _one_output(*inputs):
    return [(inputs[0].shape, inputs[0].dtype)]


# The warm-up: one new idea each ------------------------------------------------------------------

WARMUP = {
    "add_vectors": Exercise(
        title="Add two vectors",
        problems=("n = 256: four whole tiles", "n = 64: one block", "n = 1000: a partial last tile"),
        inputs=lambda g, k: (_randn(g, (256, 64, 1000)[k]), _randn(g, (256, 64, 1000)[k])),
        outputs=_one_output,
        launch=lambda kern, i, o, run, grid: run(cdiv(i[0].numel(), TILE), kern, (*i, *o, TILE)),
        spec=lambda a, b: (a + b,),
        tol=1e-6,       # one float32 addition: exact up to rounding
        nudge="Which elements does block i own? ct.load's index counts tiles, not elements.",
        recipe="load tile ct.bid(0) of a and of b with shape=(TILE,), store their sum as tile "
               "ct.bid(0) of c; the store drops what lies past the end"),
    "scale_matrix": Exercise(
        title="Scale a matrix, with 2-d tiles",
        problems=("16 x 32: one tile", "48 x 64: a 3 x 2 grid", "50 x 70: partial tiles on both axes"),
        inputs=lambda g, k: (_randn(g, *((TM, TN), (3 * TM, 2 * TN), (50, 70))[k]),),
        outputs=_one_output,
        launch=lambda kern, i, o, run, grid: run(
            (cdiv(i[0].shape[0], TM), cdiv(i[0].shape[1], TN)), kern, (*i, *o, 2.5, TM, TN)),
        spec=lambda a: (a * 2.5,),
        tol=1e-6,       # one float32 product
        nudge="The grid has two axes now: which tile does block (ct.bid(0), ct.bid(1)) own?",
        recipe="t = ct.load(a, (i, j), shape=(TM, TN)); ct.store(out, (i, j), t * scale)"),
    "transpose": Exercise(
        title="Transpose, with a transposing load",
        problems=("16 x 32", "48 x 64", "50 x 70: partial tiles"),
        inputs=lambda g, k: (_randn(g, *((TM, TN), (3 * TM, 2 * TN), (50, 70))[k]),),
        outputs=lambda a: [((a.shape[1], a.shape[0]), a.dtype)],
        launch=lambda kern, i, o, run, grid: run(
            (cdiv(i[0].shape[1], TM), cdiv(i[0].shape[0], TN)), kern, (*i, *o, TM, TN)),
        spec=lambda a: (a.t().contiguous(),),
        tol=0.0,        # a copy: exact
        nudge="With order=(1, 0) the load sees a through a view with its axes swapped: in that "
              "view's coordinates, which tile is out's tile (i, j)?",
        recipe="t = ct.load(a, (i, j), shape=(TM, TN), order=(1, 0)); ct.store(out, (i, j), t)"),
    "row_cumsum": Exercise(
        title="Running sums along rows",
        problems=("16 x 64: one whole block", "20 x 64: a whole block and a partial one",
                  "4 x 64: one partial block of rows"),
        inputs=lambda g, k: (_randn(g, (16, 20, 4)[k], TILE),),
        outputs=_one_output,
        launch=lambda kern, i, o, run, grid: run(cdiv(i[0].shape[0], TM), kern, (*i, *o, TM, TILE)),
        spec=lambda a: (a.cumsum(1),),
        tol=1e-5,       # float32 running sums of up to 64 terms, in another order: a few ulps
        mistakes=(("a running sum down the columns (axis 0) instead of along the rows",
                   lambda a: (torch.cat([t.cumsum(0) for t in a.split(TM)]),)),),
        nudge="A block owns TM whole rows; which axis does the running sum run along?",
        recipe="t = ct.load(a, (i, 0), shape=(TM, N)); ct.store(out, (i, 0), ct.cumsum(t, axis=1))"),
    "causal_decay": Exercise(
        title="A causal decay mask",
        problems=("slow decays", "slow decays, another draw",
                  "fast decays (v falls by up to 8 a step): exp2 of an unmasked exponent "
                  "overflows to inf, and inf * 0 is NaN"),
        inputs=lambda g, k: (torch.cumsum(-_rand(g, TILE) * (1.0, 1.0, 8.0)[k], 0),),
        outputs=lambda v: [((TILE, TILE), torch.float32)],
        launch=lambda kern, i, o, run, grid: run(1, kern, (*i, *o, TILE)),
        spec=lambda v: (torch.where(_causal(TILE), torch.exp2(v[:, None] - v[None, :]), 0.0),),
        tol=1e-6,       # one exp2 per element
        mistakes=(("exp (base e) where the decays are in log2 units: exp2",
                   lambda v: (torch.where(_causal(TILE), torch.exp(v[:, None] - v[None, :]), 0.0),)),
                  ("the mask the wrong way round (s >= l kept)",
                   lambda v: (torch.where(_causal(TILE).t(), torch.exp2(v[:, None] - v[None, :]), 0.0),))),
        nudge="Above the diagonal v[l] - v[s] is positive and can be large. What is exp2 of a "
              "large number, times 0? Which value of the exponent gives exactly 0?",
        recipe="pos = ct.arange(N, dtype=ct.int32); expo = ct.where(pos[:, None] >= pos[None, :], "
               "x[:, None] - x[None, :], -math.inf); ct.store(out, (0, 0), ct.exp2(expo))"),
    "matmul": Exercise(
        title="A matrix product on the tensor cores",
        problems=("K = 64", "K = 128, a 2 x 2 grid",
                  "K = 512: the longest sums"),
        inputs=lambda g, k: (_randn(g, TM * (1, 2, 1)[k], (64, 128, 512)[k], dtype=torch.float16),
                             _randn(g, (64, 128, 512)[k], TN * (1, 2, 1)[k], dtype=torch.float16)),
        outputs=lambda a, b: [((a.shape[0], b.shape[1]), torch.float32)],
        launch=lambda kern, i, o, run, grid: run(
            (i[0].shape[0] // TM, i[1].shape[1] // TN), kern, (*i, *o, TM, TN, 16)),
        spec=lambda a, b: (a.float() @ b.float(),),
        tol=1e-4,       # float16 operands multiply exactly; float32 sums of up to 512 terms of
                        # size ~1 (partial sums ~25) drift by ~3e-5; a float16 accumulator by ~1e-2
        nudge="ct.mma(x, y, acc) adds x @ y to acc: how many (TM, TK) x (TK, TN) products make "
              "one (TM, TN) tile of out, and in which dtype should acc add them up?",
        recipe="for k in range(ct.cdiv(a.shape[1], TK)): acc = ct.mma(ct.load(a, (i, k), "
               "shape=(TM, TK)), ct.load(b, (k, j), shape=(TK, TN)), acc); then store acc"),
}


# The "your turn" exercises of notebooks 03-05 --------------------------------------------------

CHUNK = 64


def _chunk_output_inputs(g, n, decay=0.1):
    return (_randn(g, n, 32, dtype=torch.float16), _randn(g, n, 32, dtype=torch.float16),
            _randn(g, n, 16, dtype=torch.float16), torch.cumsum(-_rand(g, n) * decay, 0),
            _rand(g, n))


def _chunk_output_spec(C, B, x, dA, dt, exp=torch.exp2, dt_axis=0):
    n = x.shape[0]
    weights = torch.where(_causal(n), C.float() @ B.float().t() * exp(dA[:, None] - dA[None, :]),
                          0.0) * (dt[None, :] if dt_axis == 0 else dt[:, None])
    return (weights @ x.float(),)


CHUNK_OUTPUT_MISTAKES = (
    ("exp (base e) where the decays are in log2 units: exp2",
     lambda *i: _chunk_output_spec(*i, exp=torch.exp)),
    ("dt[l] of the output's token where the sum weighs each token s by its own dt[s]",
     lambda *i: _chunk_output_spec(*i, dt_axis=1)),
)


def _decay_to_end(dt, A, inclusive=False, exp=torch.exp2):
    """exp2 of the sum of dt * A * log2(e) over the tokens after t (and t itself if inclusive),
    heads along the rows: (h, tokens)."""
    v = (dt * A).t() * LOG2E
    after = v.sum(1, keepdim=True) - v.cumsum(1) + (v if inclusive else 0)
    return exp(after)


def _state_passing_spec(states, decay, exp=torch.exp2):
    entry, state = torch.empty_like(states), torch.zeros_like(states[0])
    for c in range(states.shape[0]):
        entry[c] = state
        state = exp(decay[c]) * state + states[c]
    return entry, state


TP = 32     # state_passing's rows of the state per block


YOUR_TURN = {
    # 03: each token's decay to the end of its chunk: a scan, read backwards.
    "decay_to_end": Exercise(
        title="Each token's decay to the end of its chunk (notebook 03)",
        problems=("a whole chunk of 64 tokens, slow decays",
                  "a whole chunk, fast decays (dt up to 10)",
                  "a last chunk of 40 tokens: 24 padded"),
        inputs=lambda g, k: (_rand(g, (64, 64, 40)[k], 8) * (1.0, 10.0, 1.0)[k] + 0.01,
                             -_rand(g, 8) - 0.1),
        outputs=lambda dt, A: [((8, dt.shape[0]), torch.float32)],
        launch=lambda kern, i, o, run, grid: run(1, kern, (*i, *o, CHUNK, 8)),
        spec=lambda dt, A: (_decay_to_end(dt, A),),
        tol=1e-4,       # the exponent is a difference of float32 sums that reach ~1000 with fast
                        # decays (ulp 6e-5), and exp2 turns an absolute error e of it into e*ln 2
                        # relative: ~4e-5 where the decay is near 1
        mistakes=(("the sum including token t itself: the decay to the end starts after t",
                   lambda dt, A: (_decay_to_end(dt, A, inclusive=True),)),
                  ("exp (base e) of a sum in log2 units: exp2",
                   lambda dt, A: (_decay_to_end(dt, A, exp=torch.exp),))),
        nudge="ct.cumsum runs forwards. How do the sum of everything after t and the running "
              "sum up to t relate, given the chunk's total? And what must a padded token add?",
        recipe="v = ct.load(dt, (0, 0), shape=(H, CHUNK), order=(1, 0), padding_mode=ZERO) * "
               "(A * LOG2E)[:, None]; run = ct.cumsum(v, axis=1); total = ct.sum(v, axis=1, "
               "keepdims=True); ct.store(out, (0, 0), ct.exp2(total - run))"),
    # 04: the pass over the chunks, as its own kernel: a loop that carries the state.
    "state_passing": Exercise(
        title="Pass the state from chunk to chunk (notebook 04)",
        problems=("1 chunk", "4 chunks", "7 chunks, 48 rows: the second block's tile sticks out"),
        inputs=lambda g, k: (_randn(g, (1, 4, 7)[k], (32, 32, 48)[k], 16),
                             -_rand(g, (1, 4, 7)[k]) * 2),
        outputs=lambda states, decay: [(states.shape, torch.float32), (states.shape[1:], torch.float32)],
        launch=lambda kern, i, o, run, grid: run(cdiv(i[0].shape[1], TP), kern, (*i, *o, TP, 16)),
        spec=_state_passing_spec,
        tol=1e-5,       # float32, a few multiply-adds per element
        mistakes=(("exp (base e) where the decays are in log2 units: exp2",
                   lambda states, decay: _state_passing_spec(states, decay, torch.exp)),),
        nudge="Which value of the state does chunk c start from, and when is it stored: before "
              "or after chunk c is folded in?",
        recipe="state = ct.zeros((TP, N)); for c in range(states.shape[0]): store state as "
               "entry[c]; state = ct.exp2(decay[c]) * state + states[c] (a (1, TP, N) tile, "
               "reshaped); after the loop store state as final"),
    # 05: the in-chunk term of a last chunk that the sequence fills only partly.
    "chunk_output_partial": Exercise(
        title="The in-chunk term of a partial last chunk (notebook 05)",
        problems=("n = 64: a whole chunk", "n = 40: 24 padded tokens",
                  "n = 17: 47 padded tokens"),
        inputs=lambda g, k: _chunk_output_inputs(g, (64, 40, 17)[k]),
        outputs=lambda C, B, x, dA, dt: [((x.shape[0], 16), torch.float32)],
        launch=lambda kern, i, o, run, grid: run(1, kern, (*i, *o, CHUNK, 16, 32)),
        spec=_chunk_output_spec,
        tol=1e-2,       # the weights are rounded to float16 for the second product (2^-11
                        # relative each), sums of up to 64 terms of size ~|C B^T| ~ 6
        mistakes=CHUNK_OUTPUT_MISTAKES,
        nudge="The padded tokens s > n - 1 get weight 0 from the mask, but 0 * NaN is NaN: "
              "which loads can bring a NaN into a row that is stored?",
        recipe="load C, B, x, dt with padding_mode=ct.PaddingMode.ZERO (dA may keep the "
               "default: it only reaches masked exponents and dropped rows); then as in "
               "05: cb = ct.mma(C, ct.transpose(B), zeros); mask the exponent; weights "
               "(cb * ct.exp2(expo) * dt[None, :]).astype(x.dtype); ct.mma(weights, x, zeros)"),
}


# Real kernels: the learner designs more of the launch, and every one has a partial tile ----------

RS_TM, RS_TN = 16, 64      # row_sums' tile


def _row_sums_launch(kern, i, o, run, grid):
    run(grid(*i[0].shape), kern, (*i, *o, RS_TM, RS_TN))


def _softmax_inputs(g, k):
    n, scale = ((128, 1.0), (100, 1.0), (77, 60.0))[k]
    return (_randn(g, 24, n, scale=scale),)


def _layer_norm_inputs(g, k):
    n, offset = ((128, 0.0), (100, 0.0), (100, 300.0))[k]
    a = _randn(g, 24, n) + offset
    a[5] = a[5, 0]          # a constant row: variance 0, kept finite only by eps
    return (a, _randn(g, n) * 0.5 + 1, _randn(g, n) * 0.1)


def _layer_norm_spec(a, w, b, unbiased=False):
    a64, n = a.double(), a.shape[1]
    mean = a64.mean(1, keepdim=True)
    var = ((a64 - mean) ** 2).sum(1, keepdim=True) / (n - 1 if unbiased else n)
    return (((a64 - mean) / torch.sqrt(var + 1e-5) * w.double() + b.double()).float(),)


RN = 128    # the row tile of softmax_rows and layer_norm: one whole row (n <= 128) per block row


SSD_PROBLEMS = (    # batch, seqlen, nheads, headdim, dstate, BLOCK_H (heads per chunk_cumsum block)
    (1, 64, 2, 16, 16, 2), (1, 128, 4, 16, 32, 2), (2, 192, 2, 32, 16, 1))


def _ssd_problem(x):
    return next(p for p in SSD_PROBLEMS if (p[0], p[1], p[2], p[3]) == tuple(x.shape))


def _ssd_inputs(g, k):
    batch, seqlen, nheads, headdim, dstate, _ = SSD_PROBLEMS[k]
    x = _randn(g, batch, seqlen, nheads, headdim, dtype=torch.float16)
    dt = torch.nn.functional.softplus(_randn(g, batch, seqlen, nheads) - 1.0)
    A = -torch.exp(_randn(g, nheads) * 0.5)
    B = _randn(g, batch, seqlen, 1, dstate, dtype=torch.float16)
    C = _randn(g, batch, seqlen, 1, dstate, dtype=torch.float16)
    return x, dt, A, B, C


def _ssd_outputs(x, dt, A, B, C):
    """Every array the three kernels write, in launch order: each is checked, so a FAIL names
    the kernel that went wrong first."""
    batch, seqlen, nheads, headdim = x.shape
    nchunks, dstate = seqlen // CHUNK, B.shape[3]
    return [((batch, nheads, nchunks, CHUNK), torch.float32),              # dt_out
            ((batch, nheads, nchunks, CHUNK), torch.float32),              # dA_cumsum
            ((batch, nchunks, nheads, headdim, dstate), x.dtype),          # entry_states
            ((batch, nheads, headdim, dstate), torch.float32),             # final_states
            (x.shape, x.dtype)]                                            # out


def _ssd_launch(kernels, i, o, run, grid):
    cumsum, states, output = kernels
    x, dt, A, B, C = i
    dt_out, dA_cumsum, entry_states, final_states, out = o
    batch, seqlen, nheads, headdim = x.shape
    nchunks, dstate, block_h = seqlen // CHUNK, B.shape[3], _ssd_problem(x)[5]
    run((nchunks, nheads // block_h, batch), cumsum, (dt, A, dt_out, dA_cumsum, CHUNK, block_h))
    run((nheads, batch), states, (x, B, dt_out, dA_cumsum, entry_states, final_states,
                                  CHUNK, headdim, dstate))
    run((nchunks, nheads, batch), output, (x, B, C, dt_out, dA_cumsum, entry_states, out,
                                           CHUNK, headdim, dstate))


def _ssd_spec(x, dt, A, B, C, log2=True):
    dt_out, dA = chunked.chunk_cumsum(dt.double(), A.double(), CHUNK)
    entry, final = chunked.fwd_pass_state(x.double(), B.double(), dt_out, dA)
    out = ssd_sequential(x.double(), dt.double(), A.double(), B.double(), C.double())
    return dt_out, dA * (LOG2E if log2 else 1.0), entry, final, out


KERNELS = {
    # dt processing and the decay cumsum, heads along the rows (notebook 03's production kernel).
    "dt_cumsum": Exercise(
        title="Process dt and sum the decays",
        problems=("dt of order 1", "dt of order 1, another draw",
                  "dt + bias up to 120: log(1 + exp(v)) overflows float32 past v = 88"),
        inputs=lambda g, k: (_randn(g, CHUNK, 8) * 2 + (0.0, 0.0, 60.0)[k] * _rand(g, CHUNK, 8) * 2,
                             -_rand(g, 8) - 0.1, _randn(g, 8) * 0.5),
        outputs=lambda dt, A, bias: [((8, CHUNK), torch.float32)],
        launch=lambda kern, i, o, run, grid: run(1, kern, (*i, *o, CHUNK, 8)),
        spec=lambda dt, A, bias: ((torch.nn.functional.softplus(dt + bias) * A).t().cumsum(1)
                                  * LOG2E,),
        tol=1e-5,       # float32 softplus and a 64-term running sum: a few ulps of the sum
        mistakes=(("the sum in natural-log units: the decays are kept in log2 units (times LOG2E)",
                   lambda dt, A, bias: ((torch.nn.functional.softplus(dt + bias) * A).t().cumsum(1),)),
                  ("no softplus: dt + bias used as it is",
                   lambda dt, A, bias: (((dt + bias) * A).t().cumsum(1) * LOG2E,))),
        nudge="Heads are rows of out but columns of dt: how does the load turn them? And for "
              "large v, softplus(v) is v to float32's precision: what does exp(v) give there?",
        recipe="v = ct.load(dt, (0, 0), shape=(H, CHUNK), order=(1, 0)) + bias[:, None]; "
               "softplus = ct.where(v > 20, v, ct.log(1 + ct.exp(ct.minimum(v, 20)))); "
               "ct.cumsum(softplus * (A * LOG2E)[:, None], axis=1)"),
    "row_sums": Exercise(
        title="Row sums: your grid, your loop",
        problems=("32 x 128: whole tiles", "50 x 300: a partial last tile on both axes",
                  "7 x 1000: one partial block of rows, a partial last column tile"),
        inputs=lambda g, k: (_randn(g, *((32, 128), (50, 300), (7, 1000))[k]),),
        outputs=lambda a: [((a.shape[0],), a.dtype)],
        launch=_row_sums_launch,
        spec=lambda a: (a.sum(1),),
        tol=1e-5,       # float32 sums of up to 1000 terms of size ~1, in another order
        learner_grid="row_sums_grid(M, N)",
        nudge="How many blocks cover M rows, TM at a time? Inside a block, how many TN-wide "
              "tiles cover N columns, and what do the elements past column N - 1 add to a sum?",
        recipe="grid: (ct.cdiv(M, TM),); kernel: acc = ct.zeros((TM,), ct.float32); for j in "
               "range(ct.cdiv(a.shape[1], TN)): t = ct.load(a, (i, j), shape=(TM, TN), "
               "padding_mode=ct.PaddingMode.ZERO); acc += ct.sum(t, axis=1); store acc at (i,)"),
    "softmax_rows": Exercise(
        title="Softmax along rows",
        problems=("24 x 128: whole rows, logits of order 1",
                  "24 x 100: 28 padded columns per row",
                  "24 x 77, logits up to a few hundred: exp of a logit overflows float32 "
                  "past 88"),
        inputs=_softmax_inputs,
        outputs=_one_output,
        launch=lambda kern, i, o, run, grid: run(cdiv(i[0].shape[0], TM), kern, (*i, *o, TM, RN)),
        spec=lambda a: (torch.softmax(a.double(), 1).float(),),
        tol=1e-5,       # float32 exp of arguments <= 0 and a sum of up to 128 terms <= 1
        nudge="Which value of a padded element leaves both the row's maximum and the sum of "
              "exponentials unchanged? And how large may a logit be before exp(logit) is inf?",
        recipe="t = ct.load(a, (i, 0), shape=(TM, N), padding_mode=ct.PaddingMode.NEG_INF); "
               "e = ct.exp(t - ct.max(t, axis=1, keepdims=True)); "
               "store e / ct.sum(e, axis=1, keepdims=True)"),
    "layer_norm": Exercise(
        title="Layer norm along rows",
        problems=("24 x 128: whole rows; row 5 is constant, so only eps keeps it finite",
                  "24 x 100: 28 padded columns per row",
                  "24 x 100, values near 300: the variance as E[x^2] - E[x]^2 cancels in "
                  "float32"),
        inputs=_layer_norm_inputs,
        outputs=lambda a, w, b: [(a.shape, a.dtype)],
        launch=lambda kern, i, o, run, grid: run(cdiv(i[0].shape[0], TM), kern,
                                                 (*i, *o, 1e-5, TM, RN)),
        spec=_layer_norm_spec,
        tol=1e-3,       # float32 means of 100 values near 300 are off by ~1e-5 (sums near
                        # 3e4, whose ulp is 2e-3), which moves deviations of order 1 by as much;
                        # E[x^2] - E[x]^2 there is off by ~1e-2 (squares near 9e4, ulp 8e-3)
        mistakes=(("the unbiased variance (divided by n - 1): layer norm divides by n",
                   lambda a, w, b: _layer_norm_spec(a, w, b, unbiased=True)),),
        nudge="The mean is easy to pad for; the deviations from it are not: what is a padded "
              "element's deviation? And which form of the variance stays accurate when the "
              "mean is much larger than the spread?",
        recipe="t = load with ZERO padding; mean = ct.sum(t, axis=1, keepdims=True) / n; "
               "d = ct.where(cols < n, t - mean, 0) with cols = ct.arange(N, dtype=ct.int32)"
               "[None, :]; var = ct.sum(d * d, axis=1, keepdims=True) / n; "
               "out = d / ct.sqrt(var + eps) * w + b (w, b loaded with ZERO padding)"),
    "matmul_k": Exercise(
        title="A blocked product whose shared dimension ends in a partial tile",
        problems=("K = 64: whole tiles", "K = 200: a partial last K tile",
                  "K = 520: a partial last tile after 16 whole ones"),
        inputs=lambda g, k: (_randn(g, 32, (64, 200, 520)[k], dtype=torch.float16),
                             _randn(g, (64, 200, 520)[k], 64, dtype=torch.float16)),
        outputs=lambda a, b: [((a.shape[0], b.shape[1]), torch.float32)],
        launch=lambda kern, i, o, run, grid: run(
            (i[0].shape[0] // TM, i[1].shape[1] // TN), kern, (*i, *o, TM, TN, 32)),
        spec=lambda a, b: (a.float() @ b.float(),),
        tol=1e-4,       # as matmul: float32 sums of up to 520 terms drift by ~3e-5
        nudge="How many TK-wide tiles cover K when TK does not divide it? What must the "
              "elements past K - 1 read as, in a and in b, for the product to ignore them?",
        recipe="for k in range(ct.cdiv(a.shape[1], TK)): load a's (i, k) and b's (k, j) tiles "
               "with padding_mode=ct.PaddingMode.ZERO; acc = ct.mma(a_t, b_t, acc) with acc "
               "float32; store acc"),
    "state_update": Exercise(
        title="Fold one chunk into the state",
        problems=("decay 0.9: the old state mostly kept", "decay 0.1: the chunk mostly new",
                  "decay 0.5, weights up to 2"),
        inputs=lambda g, k: ((_rand(g, CHUNK, 16) + 0.5).to(torch.float16),
                             (_rand(g, CHUNK, 32) + 0.5).to(torch.float16),
                             _rand(g, CHUNK) * (1.0, 1.0, 2.0)[k],
                             _randn(g, 16, 32), torch.tensor([(0.9, 0.1, 0.5)[k]])),
        outputs=lambda x, B, w, state, decay: [(state.shape, torch.float32)],
        launch=lambda kern, i, o, run, grid: run(1, kern, (*i, *o, CHUNK, 16, 32)),
        spec=lambda x, B, w, state, decay: (decay * state + (x.float() * w[:, None]).t() @ B.float(),),
        tol=2.5e-4,     # x and B positive, so each sum grows with its 64 terms: the weighted x
                        # rounded to float16 for the tensor cores (2^-12 relative per term, as
                        # the kernels do) moves a sum by at most ~1.2e-4 of its size, a sum kept
                        # in a float16 accumulator by ~5e-4
        nudge="The state is (P, N); x is (CHUNK, P) and B is (CHUNK, N). Which product of the "
              "two, with which one transposed, has the state's shape?",
        recipe="xw = (x_t.astype(ct.float32) * w_t[:, None]).astype(x_t.dtype); "
               "acc = ct.mma(ct.transpose(xw), B_t, ct.zeros((P, N), dtype=ct.float32)); "
               "store decay * state + acc (decay loaded with shape=(1,))"),
    "chunk_output": Exercise(
        title="The in-chunk term, from a blank cell",
        problems=("a chunk of 64 tokens, slow decays", "another draw",
                  "fast decays (dA falls by up to 8 a step): exp2 of an unmasked exponent "
                  "overflows to inf, and inf * 0 is NaN"),
        inputs=lambda g, k: _chunk_output_inputs(g, CHUNK, (0.1, 0.1, 8.0)[k]),
        outputs=lambda C, B, x, dA, dt: [((CHUNK, 16), torch.float32)],
        launch=lambda kern, i, o, run, grid: run(1, kern, (*i, *o, CHUNK, 16, 32)),
        spec=_chunk_output_spec,
        tol=1e-2,       # as chunk_output_partial
        mistakes=CHUNK_OUTPUT_MISTAKES,
        nudge="Two products: the first makes a (CHUNK, CHUNK) matrix from C and B, the second "
              "applies it to x. What happens to that matrix in between?",
        recipe="cb = ct.mma(C, ct.transpose(B), zeros (CHUNK, CHUNK)); expo = ct.where(l >= s, "
               "dA[:, None] - dA[None, :], -inf); weights = (cb * ct.exp2(expo) * "
               "dt[None, :]).astype(x.dtype); ct.mma(weights, x, zeros (CHUNK, P))"),
    "ssd_forward": Exercise(
        title="Capstone: the three kernels, chained",
        problems=("1 x 64 tokens x 2 heads: one chunk",
                  "1 x 128 x 4 heads, dstate 32: two chunks, two blocks of 2 heads",
                  "2 x 192 x 2 heads, headdim 32: three chunks, two sequences, one head a block"),
        inputs=_ssd_inputs,
        outputs=_ssd_outputs,
        launch=_ssd_launch,
        spec=_ssd_spec,
        tol=2e-2,       # float16 entry states and outputs (2^-11 relative) from float16 products
                        # of up to 192 tokens' terms, against float64
        kernels=("chunk_cumsum", "fwd_pass_state", "compute_out"),
        given=lambda: (chunk_cumsum_core_kernel, fwd_pass_state_core_kernel, compute_out_core_kernel),
        mistakes=(("decays in natural-log units: chunk_cumsum keeps them in log2 units (times "
                   "LOG2E), for exp2", lambda *i: _ssd_spec(*i, log2=False)),),
        nudge="A FAIL names the first wrong array in launch order (dt_out, dA_cumsum, "
              "entry_states, final_states, out): the kernel that wrote it is the one to read. "
              "Which layout does each array have, and which block owns which part of it?",
        recipe="the three kernels of ops/core/ with the signatures given: (c, heads, b) blocks "
               "for chunk_cumsum, (h, b) for fwd_pass_state looping over chunks, (c, h, b) for "
               "compute_out"),
}


EXERCISES = {**WARMUP, **YOUR_TURN, **KERNELS}
