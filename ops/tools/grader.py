"""Graded cuTile exercises: a PyTorch spec per exercise, and a grader that runs a learner's kernel
on the CPU interpreter and says pass, or which element is wrong, with a hint.

    from ops.tools.grader import grade
    grade("add_vectors", add_vectors)          # prints PASS / FAIL ...; returns a Result

Each exercise (``EXERCISES``) says how to make random inputs (never zeros), the outputs' shapes,
how the kernel is launched (grid and arguments), what it must compute (a PyTorch function) and
the tolerance with its reason. The grader poisons every output with NaN before the launch, so an
element the kernel never writes is reported as such, tries three random problems (the last with
sizes that leave partial tiles where the exercise has them), and catches the interpreter's errors
(a wrong tile shape, a dtype the compiler would reject) as a failure with the kernel's message.
The exercises are in ``notebooks/exercises/``; their solutions apart, in its ``solutions/``.
"""
import dataclasses
import math
import re

import torch

from ..checks import cdiv
from ops.runtime.launch import launch
from ops.kernels.common import LOG2E


@dataclasses.dataclass
class Exercise:
    inputs: object          # (generator, size) -> tuple of input tensors
    outputs: object         # inputs -> tuple of (shape, dtype) of the outputs
    run: object             # (kernel, inputs, outputs) -> None: launches the kernel
    spec: object            # inputs -> tuple of expected outputs (PyTorch)
    tol: float              # max |out - expected| / (1 + |expected|), elementwise
    hint: str
    sizes: tuple = (1, 2, 3)  # the problems tried (each exercise reads them its own way)


@dataclasses.dataclass
class Result:
    name: str
    passed: bool
    message: str

    def __bool__(self):
        return self.passed


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


TILE = 64           # the 1-d tile of the warm-up exercises
TM, TN = 16, 32     # the 2-d tile


def _vector_sizes(size):
    return {1: 256, 2: 4 * TILE, 3: 1000}[size]            # the last: a partial last tile


def _matrix_sizes(size):
    return {1: (TM, TN), 2: (3 * TM, 2 * TN), 3: (50, 70)}[size]


EXERCISES = {
    # 1. One tile per block, the last one partial.
    "add_vectors": Exercise(
        inputs=lambda g, s: (_randn(g, _vector_sizes(s)), _randn(g, _vector_sizes(s))),
        outputs=lambda a, b: [(a.shape, a.dtype)],
        run=lambda k, i, o: launch(cdiv(i[0].numel(), TILE), k, (*i, *o, TILE)),
        spec=lambda a, b: (a + b,),
        tol=1e-6,       # float32 addition, exact up to rounding
        hint="c = a + b: load tile ct.bid(0) of a and of b (shape=(TILE,)), store their sum; "
             "the last tile sticks out of the arrays, and the store drops what lies outside"),
    # 2. A 2-d grid of 2-d tiles.
    "scale_matrix": Exercise(
        inputs=lambda g, s: (_randn(g, *_matrix_sizes(s)),),
        outputs=lambda a: [(a.shape, a.dtype)],
        run=lambda k, i, o: launch((cdiv(i[0].shape[0], TM), cdiv(i[0].shape[1], TN)), k,
                                   (*i, *o, 2.5, TM, TN)),
        spec=lambda a: (a * 2.5,),
        tol=1e-6,
        hint="out = scale * a with (TM, TN) tiles: block (ct.bid(0), ct.bid(1)) owns tile "
             "(ct.bid(0), ct.bid(1)); the index counts tiles, not elements"),
    # 3. A transposing load: order=.
    "transpose": Exercise(
        inputs=lambda g, s: (_randn(g, *_matrix_sizes(s)),),
        outputs=lambda a: [((a.shape[1], a.shape[0]), a.dtype)],
        run=lambda k, i, o: launch((cdiv(i[0].shape[1], TM), cdiv(i[0].shape[0], TN)), k,
                                   (*i, *o, TM, TN)),
        spec=lambda a: (a.t().contiguous(),),
        tol=0.0,        # a copy: exact
        hint="out = a.T: with order=(1, 0), ct.load reads a through its transposed view, of "
             "out's shape, so tile (i, j) of that view is out's tile (i, j)"),
    # 4. A scan along the rows.
    "row_cumsum": Exercise(
        inputs=lambda g, s: (_randn(g, {1: 4, 2: 16, 3: 20}[s], TILE),),
        outputs=lambda a: [(a.shape, a.dtype)],
        run=lambda k, i, o: launch(cdiv(i[0].shape[0], TM), k, (*i, *o, TM, TILE)),
        spec=lambda a: (a.cumsum(1),),
        tol=1e-5,       # float32 sums of 64 terms in another order: a few ulps
        hint="out = a.cumsum(axis 1): one block loads TM whole rows (shape=(TM, N)) and "
             "ct.cumsum(tile, axis=1); rows past the end: padding_mode=ct.PaddingMode.ZERO"),
    # 5. A causal decay mask: ct.where before exp2 (compute_out's in-chunk weights).
    "causal_decay": Exercise(
        inputs=lambda g, s: (torch.cumsum(-torch.rand(TILE, generator=g), 0),),
        outputs=lambda v: [((TILE, TILE), torch.float32)],
        run=lambda k, i, o: launch(1, k, (*i, *o, TILE)),
        spec=lambda v: (torch.where(torch.ones(TILE, TILE, dtype=torch.bool).tril(),
                                    torch.exp2(v[:, None] - v[None, :]), 0.0),),
        tol=1e-6,       # one exp2 per element
        hint="out[l, s] = exp2(v[l] - v[s]) for s <= l, else 0: build the exponent with "
             "broadcasting (v[:, None] - v[None, :]), mask it with ct.where(rows >= cols, "
             "expo, -inf) using ct.arange, then ct.exp2"),
    # 6. A matrix product on the tensor cores, looping over K.
    "matmul": Exercise(
        inputs=lambda g, s: (_randn(g, TM * s, 64, dtype=torch.float16),
                             _randn(g, 64, TN * s, dtype=torch.float16)),
        outputs=lambda a, b: [((a.shape[0], b.shape[1]), torch.float32)],
        run=lambda k, i, o: launch((i[0].shape[0] // TM, i[1].shape[1] // TN), k,
                                   (*i, *o, TM, TN, 16)),
        spec=lambda a, b: (a.float() @ b.float(),),
        tol=1e-5,       # fp16 operands, exact products, float32 sums of 64 terms
        hint="out = a @ b in float32: acc = ct.zeros((TM, TN), dtype=ct.float32), then for each "
             "of the K // TK tiles of the shared dimension acc = ct.mma(a_tile, b_tile, acc)"),
    # The "your turn" exercises of notebooks 03-05: the heart of each kernel, one chunk.
    # 03: dt processing and the decay cumsum, heads along the rows.
    "dt_cumsum": Exercise(
        inputs=lambda g, s: (_randn(g, TILE, 8) * 2, -torch.rand(8, generator=g) - 0.1,
                             _randn(g, 8) * 0.5),
        outputs=lambda dt, A, bias: [((8, TILE), torch.float32)],
        run=lambda k, i, o: launch(1, k, (*i, *o, TILE, 8)),
        spec=lambda dt, A, bias: ((torch.nn.functional.softplus(dt + bias) * A).t().cumsum(1)
                                  * LOG2E,),
        tol=1e-5,       # float32 softplus and a 64-term running sum: a few ulps of the sum
        hint="out[h, t] = sum over t' <= t of softplus(dt[t', h] + bias[h]) * A[h] * log2(e): load "
             "dt transposed (order=(1, 0)) so heads are rows, add bias[:, None], softplus as "
             "ct.log(1 + ct.exp(v)), multiply by A[:, None] * LOG2E, ct.cumsum along axis 1"),
    # 04: one chunk folded into the state: one ct.mma.
    "state_update": Exercise(
        inputs=lambda g, s: (_randn(g, TILE, 16, dtype=torch.float16),
                             _randn(g, TILE, 32, dtype=torch.float16), torch.rand(TILE, generator=g),
                             _randn(g, 16, 32), torch.rand(1, generator=g)),
        outputs=lambda x, B, w, state, decay: [(state.shape, torch.float32)],
        run=lambda k, i, o: launch(1, k, (*i, *o, TILE, 16, 32)),
        spec=lambda x, B, w, state, decay: (decay * state + (x.float() * w[:, None]).t() @ B.float(),),
        tol=1e-2,       # the weighted x may be rounded to float16 for the tensor cores (2^-11
                        # relative per term, as the kernels do): over 64 terms of size ~1, a few
                        # 1e-3 absolute
        hint="out = decay * state + (x * w[:, None])^T @ B: weight x in float32, cast back to "
             "x.dtype, then ct.mma(ct.transpose(xw), B_tile, ct.zeros((P, N), dtype=ct.float32)); "
             "decay is a (1,) array: load it with shape=(1,)"),
    # 05: the in-chunk term: C B^T, the causal decay, times dt, then @ x: two ct.mma.
    "chunk_output": Exercise(
        inputs=lambda g, s: (_randn(g, TILE, 32, dtype=torch.float16),
                             _randn(g, TILE, 32, dtype=torch.float16),
                             _randn(g, TILE, 16, dtype=torch.float16),
                             torch.cumsum(-torch.rand(TILE, generator=g) * 0.1, 0),
                             torch.rand(TILE, generator=g)),
        outputs=lambda C, B, x, dA, dt: [((TILE, 16), torch.float32)],
        run=lambda k, i, o: launch(1, k, (*i, *o, TILE, 16, 32)),
        spec=lambda C, B, x, dA, dt: (
            (torch.where(torch.ones(TILE, TILE, dtype=torch.bool).tril(),
                         C.float() @ B.float().t() * torch.exp2(dA[:, None] - dA[None, :]), 0.0)
             * dt[None, :]) @ x.float(),),
        tol=1e-2,       # the weights are rounded to float16 for the second product (2^-11
                        # relative each), sums of up to 64 terms of size ~|C B^T| ~ 6
        hint="y = (where(l >= s, C B^T * exp2(dA[l] - dA[s]), 0) * dt[s]) @ x: cb = ct.mma(C, "
             "ct.transpose(B), zeros (CHUNK, CHUNK)); mask the exponent with ct.where and ct.arange "
             "(-inf gives 0); weights = (cb * ct.exp2(expo) * dt[None, :]).astype(x.dtype); "
             "ct.mma(weights, x, zeros (CHUNK, P))"),
}


def _first_wrong(out, ref, tol):
    """(index, got, expected) of the first element outside the tolerance, or None."""
    out, ref = out.double(), ref.double()
    bad = ~(torch.abs(out - ref) <= tol * (1 + torch.abs(ref)))
    if not bool(bad.any()):
        return None
    index = tuple(int(i) for i in bad.nonzero()[0])
    return index, out[index].item(), ref[index].item()


def _strip_location(message):
    """The interpreter's message without its 'file.py:LINE in kernel: ' prefix (a notebook's
    file name differs from run to run)."""
    return re.sub(r"^\S+:\d+ in \w+: ", "", message)


def check(name, kernel):
    """Grade ``kernel`` for exercise ``name`` -> Result (nothing printed)."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; choose from {', '.join(EXERCISES)}")
    ex = EXERCISES[name]
    for size in ex.sizes:
        gen = torch.Generator().manual_seed(1000 + size)
        inputs = ex.inputs(gen, size)
        outputs = [torch.full(shape, math.nan, dtype=dtype) for shape, dtype in ex.outputs(*inputs)]
        try:
            ex.run(kernel, inputs, outputs)
        except Exception as e:      # the learner's kernel failed: say how, not a traceback
            text = _strip_location(str(e).splitlines()[0]) if str(e) else ""
            return Result(name, False, f"FAIL {name}: the kernel raised {type(e).__name__}: "
                                       f"{text}\n  hint: {ex.hint}")
        shape = "x".join(map(str, inputs[0].shape))
        for k, (out, ref) in enumerate(zip(outputs, ex.spec(*inputs), strict=True)):
            wrong = _first_wrong(out, ref, ex.tol)
            if wrong is not None:
                index, got, expected = wrong
                what = "never written (still NaN)" if math.isnan(got) else f"{got:.6g}"
                label = "out" if len(outputs) == 1 else f"output {k}"
                return Result(name, False,
                              f"FAIL {name} (input {shape}): {label}{list(index)} is {what}, "
                              f"expected {expected:.6g}\n  hint: {ex.hint}")
    return Result(name, True, f"PASS {name}: {len(ex.sizes)} random problems, every element "
                              f"within {ex.tol:g}")


def grade(name, kernel):
    """Grade ``kernel`` for exercise ``name``, print the verdict and return the Result."""
    result = check(name, kernel)
    print(result.message)
    return result
