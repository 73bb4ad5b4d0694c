"""ops.context_parallel: a sequence split over several processes gives the single-process result.

How it runs: ``torch.multiprocessing`` spawns four worker processes once for the module (gloo, a
file store in a temporary folder). Together they form the default group: world size 4, called
with ``process_group=None``. ``torch.distributed.new_group`` also makes two pairs (world size 2;
the pairs run different cases at the same time) and four single-rank groups (world size 1).
Every worker runs the cases it belongs to and saves what it got (outputs, final states,
gradients, or the error it raised); the tests compare in this process.

Expected values: the single-process call on the whole sequence (``mamba_chunk_scan_combined``
or ``Mamba2Mixer`` without a process group), same backend and dtype, computed here; those are
checked against the token-by-token recurrence in test_api.py and test_drop_in.py. Gradients:
each rank backpropagates its share of one loss, random weights on its slice of the output
(never zeros), plus on the group's first rank a random weighting of the final state, so the
shares add up to the single-process loss. A sliced input's gradient (x, dt, B, C, z, the
mixer's input) is compared slice by slice; a whole input's (A, D, dt_bias, initial_states, the
mixer's parameters) summed over the ranks, each of which holds its share.

Tolerances (relative error in norm, ``reference.validate.rel_err``):

* float64, backend "reference": 1e-10. Both sides compute in float64 and differ in rounding
  only: the split moves the chunk boundaries, and a rank's entry state reaches its tokens
  through exp of a running sum of dt * A over the slice instead of chunk by chunk. The errors
  seen are ~1e-15; 1e-10 leaves room for growth along the sequence and still fails on any wrong
  term (a missing or doubled entry state is an O(1) error).
* float32 ("reference" and "interpret"): 1e-5 for outputs and final states, 2e-5 for gradients.
  float32 rounds each operation to 6e-8; the chunk sums and the running sum over a slice add a
  few hundred such terms, in a different order than the single-process call, and the backward
  adds as many again (the same bounds as test_api.py / test_mixer.py for float32 against
  another summation order).
* the mixer: float32's bounds whatever its dtype. Its gated norm computes in float32, and it
  keeps dt_bias, A_log and D in float32, so a float64 layer rounds to float32 on the way forward
  and back (the errors seen: ~1e-8 in float64, ~1e-7 in float32).

The kernels (the end of the file): a 1000-token scan and a layer on it, in float32, at a model's
headdim and dstate, split over 1, 2, 4 or 8 ranks. ``test_the_kernels_under_nccl`` (gpu) runs them
with backend "cutile" under NCCL, rank r on GPU r, each world size only where the machine has that
many GPUs; ``test_the_kernel_cases_through_the_interpreter`` runs them at world size 2 on the CPU
(gloo, backend "interpret"), so that the cases and their checks are tested wherever the suite
runs. Float32's bounds above; the interpreter's errors on these cases stay below 3e-6 at every
world size.
"""
import datetime
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ops import Mamba2Mixer, context_parallel_chunk_scan, mamba_chunk_scan_combined
from reference.problems import make_problem
from reference.validate import rel_err

WORLD = 4
OPTIONS = dict(dt_softplus=True, dt_limit=(0.0, 1.5))
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 2e-5)}    # (outputs, gradients)
SLICED = ("x", "dt", "B", "C", "z")


def packed(batch, seqlen, rows):
    """seq_idx (batch, seqlen): row i starts at id rows[i][0], adding 1 at each of rows[i][1]."""
    seq = torch.zeros(batch, seqlen, dtype=torch.int64)
    for i, (first, bounds) in enumerate(rows):
        seq[i] = first
        for start in bounds:
            seq[i, start:] += 1
    return seq


# The rank boundaries of the 77 tokens at world size 4 are 20, 25 and 58 (a 5-token slice: shorter
# than a chunk). Row 0: sequences start at 12 (running from rank 0 through the whole of rank 1),
# at 25 (exactly at a rank's first token), at 40 (running from rank 2 into rank 3) and at 70; its
# first sequence has id 0, so it starts from initial_states. Row 1: ids from 3 (initial_states
# belong to id 0: no token of this row reads them), sequences starting exactly at two rank
# boundaries, 20 and 58.
SPLIT4 = [20, 5, 33, 19]
PACKED = [(0, [12, 25, 40, 70]), (3, [20, 58])]

SCAN_CASES = {
    # name: size (ranks in the group), lengths of the slices, the problem, options
    "all-options-f64": dict(size=4, lengths=SPLIT4, dtype=torch.float64, problem=dict(D="1d")),
    "packed-f64": dict(size=4, lengths=SPLIT4, dtype=torch.float64, problem=dict(D="2d"),
                       seq=PACKED, inference=True),
    "packed-f32": dict(size=4, lengths=SPLIT4, dtype=torch.float32, problem=dict(ngroups=4),
                       seq=PACKED),
    # no option at all: the default dt_limit clamps negative steps; a one-token slice; one group
    "bare-f64": dict(size=4, lengths=[40, 16, 1, 20], dtype=torch.float64, options={},
                     problem=dict(D=None, z=False, dt_bias=False, initial_states=False, ngroups=1),
                     final=False),
    # only initial_states needs a gradient: a rank other than the first has nothing of its own
    # to differentiate, yet must join the backward's collective
    "initial-states-gradient-only": dict(size=4, lengths=SPLIT4, dtype=torch.float64,
                                         seq=PACKED, wants=("initial_states",)),
    # row 0: a sequence starts at the rank boundary; row 1: one runs across it
    "pair-f64": dict(size=2, lengths=[64, 13], dtype=torch.float64, problem=dict(D="2d"),
                     seq=[(0, [64]), (0, [30, 70])]),
    "pair-interpret-f32": dict(size=2, lengths=[13, 27], dtype=torch.float32, backend="interpret",
                               problem=dict(batch=1, nheads=2, ngroups=1, dstate=8),
                               seq=[(0, [20])], inference=True),
    # torch.compile around the call (the exchanges run eagerly between traced graphs)
    "pair-compiled-f64": dict(size=2, lengths=[30, 47], dtype=torch.float64, compiled=True),
    # a growing head (A > 0): exp of rank 1's running sum over its whole slice (two sequences,
    # 27 tokens) overflows float32 where the single-process call's states (15 and 13 tokens)
    # do not; masked on the exponent, the overflow leaves no NaN in the backward
    "pair-growing-head-f32": dict(size=2, lengths=[13, 27], dtype=torch.float32,
                                  problem=dict(ngroups=1), A=[11.0, -1.0, -0.5, -2.0],
                                  seq=[(0, [12, 27]), (0, [12, 27])]),
    "single-f64": dict(size=1, lengths=[77], dtype=torch.float64, seq=PACKED),
    "single-f32": dict(size=1, lengths=[77], dtype=torch.float32),
}

MIXER_CASES = {
    # slices of 2 and 1 tokens: shorter than the convolution's reach back (d_conv - 1 = 3)
    "mixer-f64": dict(size=4, lengths=[9, 2, 1, 25], dtype=torch.float64),
    "mixer-pair-f64": dict(size=2, lengths=[16, 21], dtype=torch.float64),
    "mixer-pair-f32": dict(size=2, lengths=[30, 7], dtype=torch.float32),
}

# What every rank raises: {rank: (exception type, message pattern)}, "*" for every rank.
ERROR_CASES = {
    "different-batch": {"*": (ValueError, r"batch \(x.shape\[0\]\) must be the same on every")},
    "one-rank-refused": {1: (ValueError, r"dt must have shape"),
                         "*": (ValueError, r"rank\(s\) \[1\] refused")},
    "cu_seqlens": {"*": (ValueError, r"cu_seqlens")},
    "ids-decrease-across-ranks": {"*": (ValueError, r"non-decreasing along the whole sequence")},
}


def members(case, index):
    """The global ranks of the group a case runs on: all four, pair index % 2, or rank index % 4."""
    if case["size"] == WORLD:
        return list(range(WORLD))
    if case["size"] == 2:
        return [2 * (index % 2), 2 * (index % 2) + 1]
    return [index % WORLD]


def schedule():
    """Every case with its group's ranks, in one order that all workers follow (the cases of one
    size take the groups of that size in turn)."""
    order, taken = [], {}
    for name, case in {**SCAN_CASES, **MIXER_CASES}.items():
        index = taken[case["size"]] = taken.get(case["size"], -1) + 1
        order.append((name, case, members(case, index)))
    return order


# Inputs (the same in every process: seeded generators) -----------------------------------------

def scan_inputs(case):
    """The whole sequence's inputs: floating tensors with requires_grad per ``case["wants"]``."""
    spec = dict(batch=2, seqlen=sum(case["lengths"]), nheads=4, headdim=8, ngroups=2, dstate=16)
    spec.update(case.get("problem", {}))
    kw = make_problem(**spec, dtype=case["dtype"], seed=11)
    if "A" in case:
        kw["A"] = torch.tensor(case["A"], dtype=kw["A"].dtype)
    if "seq" in case:
        kw["seq_idx"] = packed(spec["batch"], spec["seqlen"], case["seq"])
    wants = case.get("wants", [k for k, v in kw.items() if v.is_floating_point()])
    return {k: v.requires_grad_(k in wants) if v.is_floating_point() else v for k, v in kw.items()}


def loss_weights(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) + 0.5


def scan(case, kw, process_group=None, split=True):
    """The call a case makes: context parallel (``split``) or the single-process call."""
    options = dict(chunk_size=16, backend=case.get("backend", "reference"),
                   return_final_states=case.get("final", True), **case.get("options", OPTIONS))
    if not split:
        return mamba_chunk_scan_combined(**kw, **options)
    call = lambda kw: context_parallel_chunk_scan(**kw, **options, process_group=process_group)
    return torch.compile(call, backend="aot_eager")(kw) if case.get("compiled") else call(kw)


def loss_of(case, out, final, lo, hi, first):
    """A rank's share of the loss (weights drawn on the CPU, the same on every device)."""
    w = loss_weights(out.shape[:1] + (sum(case["lengths"]),) + out.shape[2:], out.dtype, 5)
    loss = (out * w[:, lo:hi].to(out.device)).sum()
    if final is not None and first:
        loss = loss + (final * loss_weights(final.shape, final.dtype, 6).to(final.device)).sum()
    return loss


MIXER = dict(d_model=16, d_state=8, headdim=8, ngroups=2, chunk_size=16, backend="reference")


def mixer(case, process_group=None, device=None):
    """The layer of a case (``MIXER`` updated by its "layer"), the same weights in every process."""
    return Mamba2Mixer(**{**MIXER, **case.get("layer", {})}, dtype=case["dtype"], device=device,
                       generator=torch.Generator().manual_seed(2), process_group=process_group)


def mixer_input(case):
    d_model = case.get("layer", {}).get("d_model", MIXER["d_model"])
    return torch.randn(2, sum(case["lengths"]), d_model, generator=torch.Generator().manual_seed(3),
                       dtype=case["dtype"])


# The workers ------------------------------------------------------------------------------------

def run_scan(case, group, rank, device="cpu"):
    kw = scan_inputs(case)
    lo = sum(case["lengths"][:rank])
    hi = lo + case["lengths"][rank]
    mine = {k: (v[:, lo:hi] if k in SLICED or k == "seq_idx" else v).detach().to(device).clone()
            .requires_grad_(v.requires_grad) for k, v in kw.items()}
    result = scan(case, mine, group)
    out, final = result if case.get("final", True) else (result, None)
    loss_of(case, out, final, lo, hi, rank == 0).backward()
    got = dict(out=out.detach(), final=None if final is None else final.detach(),
               grads={k: v.grad for k, v in mine.items() if v.requires_grad})
    if case.get("inference"):                       # no gradient: no graph, the same output
        with torch.no_grad():
            got["inference"] = scan(case, mine, group)[0]
        assert got["inference"].grad_fn is None
    return got


def run_mixer(case, group, rank, device="cpu"):
    m = mixer(case, group if group is not None else dist.group.WORLD, device)
    lo = sum(case["lengths"][:rank])
    u = mixer_input(case)[:, lo:lo + case["lengths"][rank]].to(device).requires_grad_()
    out = m(u)
    loss_of(case, out, None, lo, lo + out.shape[1], rank == 0).backward()
    grads = {"u": u.grad, **{n: p.grad for n, p in m.named_parameters()}}
    return dict(out=out.detach(), grads=grads)


def run_error(name, rank):
    """The error cases on the default group: the inputs of "all-options-f64", spoilt on a rank."""
    case = SCAN_CASES["all-options-f64"]
    kw = scan_inputs(case)
    lo = sum(SPLIT4[:rank])
    mine = {k: v[:, lo:lo + SPLIT4[rank]] if k in SLICED else v for k, v in kw.items()}
    options = dict(chunk_size=16, backend="reference", **OPTIONS)
    if name == "different-batch" and rank == 2:
        mine = {k: v[:1] if k in SLICED or k == "initial_states" else v for k, v in mine.items()}
    if name == "one-rank-refused" and rank == 1:
        mine["dt"] = mine["dt"][..., :3]
    if name == "cu_seqlens":
        options["cu_seqlens"] = torch.tensor([0, SPLIT4[rank]])
    if name == "ids-decrease-across-ranks":        # each rank's ids are fine, but rank 2 restarts
        mine["seq_idx"] = torch.full((2, SPLIT4[rank]), 5 - (rank == 2) * 4)
    context_parallel_chunk_scan(**mine, **options)


def worker(rank, folder):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD),
                            rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([q]) for q in range(WORLD)]
    results = {}
    for name, case, ranks in schedule():
        if rank not in ranks:
            continue
        group = (None if len(ranks) == WORLD else
                 pairs[ranks[0] // 2] if len(ranks) == 2 else singles[rank])
        run = run_mixer if name in MIXER_CASES else run_scan
        try:
            results[name] = run(case, group, ranks.index(rank))
        except Exception as e:                      # reported by the test of that case
            results[name] = dict(error=f"{type(e).__name__}: {e}")
    for name in ERROR_CASES:
        try:
            run_error(name, rank)
            results[name] = None
        except Exception as e:
            results[name] = (type(e), str(e))
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the four workers got: [{case name: result}] in rank order."""
    folder = str(tmp_path_factory.mktemp("context_parallel"))
    mp.spawn(worker, args=(folder,), nprocs=WORLD, join=True)
    return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False)
            for r in range(WORLD)]


# The tests --------------------------------------------------------------------------------------

def gathered(results, key):
    """Sliced along the sequence on each rank: concatenated in rank order."""
    return torch.cat([r[key] for r in results], dim=1)


def summed(results, name, like):
    """Each rank's share of a whole tensor's gradient, added up (None: no share)."""
    return sum((r["grads"][name] if r["grads"][name] is not None else torch.zeros_like(like))
               for r in results)


def case_results(ranks, name):
    group = next(g for n, _, g in schedule() if n == name)
    results = [ranks[q][name] for q in group]
    for r in results:
        assert "error" not in r, r["error"]
    return results


def check_scan(case, results, device="cpu"):
    """The ranks' results (on the CPU) against the single-process call on ``device``."""
    assert len(results) == case["size"]
    kw = {k: v.detach().to(device).requires_grad_(v.requires_grad)
          for k, v in scan_inputs(case).items()}
    result = scan(case, kw, split=False)
    out, final = result if case.get("final", True) else (result, None)
    loss_of(case, out, final, 0, out.shape[1], True).backward()
    tol_out, tol_grad = TOL[case["dtype"]]
    # norms in float64: a growing head's float32 values square past float32's range
    err = lambda got, want: rel_err(got.double(), want.double().cpu())

    assert all(r["out"].dtype == out.dtype for r in results)
    assert err(gathered(results, "out"), out) < tol_out
    if case.get("inference"):
        assert err(gathered(results, "inference"), out) < tol_out
    for r in results:                               # the whole sequence's, on every rank
        assert (r["final"] is None) == (final is None)
        if final is not None:
            assert r["final"].dtype == final.dtype and err(r["final"], final) < tol_out
    for k, v in kw.items():
        if not v.requires_grad:
            continue
        got = (torch.cat([r["grads"][k] for r in results], dim=1) if k in SLICED
               else summed(results, k, v.cpu()))
        assert err(got, v.grad) < tol_grad, k


def check_mixer(case, results, device="cpu"):
    """The ranks' results (on the CPU) against the single-process layer on ``device``."""
    assert len(results) == case["size"]
    m, u = mixer(case, device=device), mixer_input(case).to(device).requires_grad_()
    out = m(u)
    loss_of(case, out, None, 0, out.shape[1], True).backward()
    tol_out, tol_grad = TOL[torch.float32]            # the norm computes in float32 (docstring)
    err = lambda got, want: rel_err(got, want.cpu())

    assert err(gathered(results, "out"), out) < tol_out
    assert err(torch.cat([r["grads"]["u"] for r in results], dim=1), u.grad) < tol_grad
    for n, p in m.named_parameters():
        assert err(summed(results, n, p.cpu()), p.grad) < tol_grad, n


@pytest.mark.parametrize("name", list(SCAN_CASES))
def test_the_scan_equals_the_single_process_call(ranks, name):
    check_scan(SCAN_CASES[name], case_results(ranks, name))


@pytest.mark.parametrize("name", list(MIXER_CASES))
def test_the_mixer_equals_the_single_process_layer(ranks, name):
    check_mixer(MIXER_CASES[name], case_results(ranks, name))


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_every_rank_raises_together(ranks, name):
    """A refused input raises on every rank (none is left waiting in a collective), naming the
    argument; the rank whose input is wrong gets the single-process call's own message."""
    for rank in range(WORLD):
        kind, pattern = ERROR_CASES[name].get(rank, ERROR_CASES[name]["*"])
        got = ranks[rank][name]
        assert got is not None, f"rank {rank} raised nothing"
        assert got[0] is kind and re.search(pattern, got[1]), (rank, got)


def test_an_uninitialised_process_group_is_refused():
    assert not dist.is_initialized()
    kw = make_problem(batch=1, seqlen=20, seed=1)
    with pytest.raises(ValueError, match="process_group: torch.distributed is not initialised"):
        context_parallel_chunk_scan(**kw, chunk_size=16)


def test_the_mixer_takes_a_process_group_or_a_scan():
    with pytest.raises(ValueError, match="process_group"):
        Mamba2Mixer(d_model=32, headdim=16, scan=mamba_chunk_scan_combined,
                    process_group=object())


# The kernels: under NCCL, one GPU a rank (gpu); the same cases through the interpreter ----------

# 1000 tokens split unevenly at each world size, with a 5-token and a 1-token slice (shorter than a
# chunk). Sequences start at 12, 305 and 700 in row 0 and at 505, 600 and 900 in row 1: at world
# sizes 2, 4 and 8 one starts exactly at a rank's first token (600; 305 and 700; 505) and others
# run across ranks. Row 0 starts from initial_states; row 1's ids start at 3 (none of its tokens
# reads them).
KERNEL_SPLITS = {1: [1000], 2: [600, 400], 4: [300, 5, 395, 300],
                 8: [130, 5, 120, 250, 1, 199, 150, 145]}
KERNEL_PACKED = [(0, [12, 305, 700]), (3, [505, 600, 900])]


# the kernels' backend under each collective backend: on GPUs, or interpreted on the CPU
KERNELS = {"nccl": "cutile", "gloo": "interpret"}


def kernel_cases(size, collective):
    """What the ranks of one world size run, in float32 (the kernels compute in full float32):
    the scan at headdim 64 and dstate 64, and a layer of 8 heads on it."""
    backend, lengths = KERNELS[collective], KERNEL_SPLITS[size]
    return {"scan": dict(size=size, lengths=lengths, dtype=torch.float32, backend=backend,
                         seq=KERNEL_PACKED, problem=dict(nheads=8, headdim=64, dstate=64)),
            "mixer": dict(size=size, lengths=lengths, dtype=torch.float32,
                          layer=dict(d_model=256, d_state=64, headdim=64, chunk_size=64,
                                     backend=backend))}


def kernel_worker(rank, size, collective, folder):
    if collective == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(collective, store=dist.FileStore(os.path.join(folder, "store"), size),
                            rank=rank, world_size=size, timeout=datetime.timedelta(seconds=300))
    runs = {"scan": run_scan, "mixer": run_mixer}
    got = {what: runs[what](case, None, rank, device)
           for what, case in kernel_cases(size, collective).items()}
    torch.save(got, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def kernel_ranks(tmp_path_factory):
    """(collective, size) -> what each rank got, [{"scan": ..., "mixer": ...}] in rank order: one
    launch of ``size`` processes per pair (under NCCL on GPUs 0 .. size - 1)."""
    done = {}

    def at(collective, size):
        if (collective, size) not in done:
            folder = str(tmp_path_factory.mktemp(f"{collective}{size}"))
            mp.spawn(kernel_worker, args=(size, collective, folder), nprocs=size, join=True)
            done[collective, size] = [
                torch.load(os.path.join(folder, f"rank{r}.pt"), map_location="cpu",
                           weights_only=False) for r in range(size)]
        return done[collective, size]
    return at


CHECKS = {"scan": check_scan, "mixer": check_mixer}


@pytest.mark.gpu
@pytest.mark.parametrize("what", list(CHECKS))
@pytest.mark.parametrize("size", sorted(KERNEL_SPLITS))
def test_the_kernels_under_nccl(kernel_ranks, size, what):
    """World size ``size`` on NCCL, rank r on GPU r, backend "cutile": outputs, final states and
    every gradient against the single-process call on the whole sequence on GPU 0. World size 1
    runs the exchange's collectives on CUDA tensors; 2, 4 and 8 need as many GPUs."""
    if torch.cuda.device_count() < size:
        pytest.skip(f"world size {size} needs {size} GPUs, this machine has "
                    f"{torch.cuda.device_count()}")
    CHECKS[what](kernel_cases(size, "nccl")[what], [r[what] for r in kernel_ranks("nccl", size)],
                 "cuda")


@pytest.mark.parametrize("what", list(CHECKS))
def test_the_kernel_cases_through_the_interpreter(kernel_ranks, what):
    """test_the_kernels_under_nccl's cases at world size 2 on the CPU: gloo, and the kernels' tile
    programs run by the interpreter (backend "interpret") against its single-process call."""
    CHECKS[what](kernel_cases(2, "gloo")[what], [r[what] for r in kernel_ranks("gloo", 2)])
