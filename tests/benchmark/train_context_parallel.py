"""Train a 2-layer Mamba-2 language model context parallel, each rank holding a slice of every
sequence, and check that its loss curve is the single-process one within run-to-run noise.

    # GPUs (NCCL): the single-process run on rank 0, then context parallel at 2 and 4 ranks
    torchrun --nproc-per-node 4 -m tests.benchmark.train_context_parallel --world-sizes 2,4 \\
        --out bench_out/train_context_parallel.csv --plot bench_out/train_context_parallel.png

    # CPU dry run: two spawned gloo ranks, the PyTorch reference scan, tiny sizes
    python -m tests.benchmark.train_context_parallel --device cpu --ranks 2 --scan reference \\
        --d-model 32 --headdim 16 --dstate 16 --seq-len 96 --chunk 16 --batch 2 --vocab 32 \\
        --pairs 4 --queries 4 --steps 40 --out /tmp/cp_train.csv --plot /tmp/cp_train.png

What it measures. ``tests/api/test_context_parallel.py`` checks one layer's outputs and gradients
against the single-process call; this checks the effect over hundreds of optimizer steps of a
model whose layers all run split: that a model trained context parallel learns what the same
model learns in one process, at the same rate.

The task and the model are ``train_recall.py``'s (multi-query associative recall; an
embedding, pre-norm residual ``Mamba2Mixer`` blocks, a tied LM head), at a long sequence by
default: the keys and values sit at the start, the queries anywhere after, so an answer may
need the state carried across every rank boundary before it. Every run trains from the same
initial weights (``--seed``) on the same batches (``--data-seed``):

    single        one process, no process group (rank 0 alone; the other ranks wait)
    single@seedS  the same at the initial weights of seed + 1 (the run-to-run noise)
    cpK           context parallel over the first K ranks (``--world-sizes``, default the
                  launch's world): every rank draws the whole batch and keeps its contiguous
                  slice of the tokens (rank order is sequence order; the first seq_len % K
                  ranks one token more), and its mixers run over that slice
                  (``Mamba2Mixer(process_group=...)``: the convolution's halo and the scan's
                  exchange; ``ops.context_parallel``)

The loss is the mean cross-entropy over the batch's answers: each rank computes the sum over the
answers in its slice, divided by the batch's number of answers, and backpropagates that share;
the shares add up to the loss. So the parameters' gradients, summed over the ranks (one
all-reduce of all of them, flattened), are the loss's gradients; every rank then clips and steps
the same optimizer on the same numbers, and the replicas stay equal (checked at the end: every
rank's parameters are compared with rank 0's, bitwise). The loss and accuracy logged are the
shares' sums. Optimizer, schedule and precision as ``train_recall.py`` (AdamW, warm-up and
cosine, clipping at 1; bf16 autocast on a GPU, float32 on the CPU).

The agreement rule is ``train_recall.py``'s: a context-parallel run agrees when the mean gap of
its smoothed loss curve to the single run's is at most that of the single run at another seed;
the exit status is 1 when one does not. In float32 the first steps agree to rounding (the split
changes only the order of sums); the curves then drift apart as any two runs with different
rounding do.

Output (rank 0): a progress line every ``--print-every`` steps; a CSV (``--out``: run,
world_size, tokens_per_rank, seed, data_seed, step, loss, accuracy, wall_s, peak_mib: the
largest over the run's ranks of the memory allocated, on a GPU); a figure (``--plot``) of the
loss and accuracy curves; the verdict.

Defaults: sequence 16K tokens (4K a rank at 4 ranks), batch 4, d_model 128, headdim 32, dstate
32, chunk 256, 300 steps. Not yet run on several GPUs: whether recall is learned at that length
in that many steps is open; the curves are compared either way.
"""
import argparse
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

from tests.benchmark import train_recall as recall
from tests.benchmark.context_parallel import init_group, slice_bounds

COLUMNS = ("run", "world_size", "tokens_per_rank", "seed", "data_seed", "step", "loss",
           "accuracy", "wall_s", "peak_mib")


def _quiet(*_):
    pass


def model_for(args, seed, group):
    return recall.RecallLM(args.vocab, args.d_model, args.layers, args.dstate, args.headdim,
                           args.chunk, scan=args.scan, seed=seed, process_group=group)


def _sum_over(group, tensor):
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


def train(args, device, group, seed, data_seed, label, log=print):
    """One run, on this rank's slice (all of the sequence without a group): -> its logged rows
    (dicts; every rank of the group gets the same) and the model."""
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    lo, hi, _, largest = slice_bounds("strong", world, rank, args.seq_len, None)
    task = recall.RecallTask(args.vocab, args.pairs, args.queries, args.seq_len, seed=data_seed)
    model = model_for(args, seed, group).to(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(recall.param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: recall.lr_factor(i + 1, args.steps))
    bf16 = args.precision == "bf16"
    answers_per_batch = args.batch * args.queries
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rows, last = [], (0.0, 0)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets, mask, _ = task.batch(step, args.batch)
        inputs, targets, mask = (t[:, lo:hi].to(device, non_blocking=True)
                                 for t in (inputs, targets, mask))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(inputs)
        picked, answers = logits.float()[mask], targets[mask]      # this slice's answers
        share = F.cross_entropy(picked, answers, reduction="sum") / answers_per_batch
        opt.zero_grad(set_to_none=True)
        share.backward()                 # a collective: every rank runs it, answers or none
        if group is not None:
            # one all-reduce of every gradient (zeros where this rank has none); a parameter no
            # rank has a gradient for keeps none, as in one process (the optimizer skips it)
            has = _sum_over(group, torch.tensor([p.grad is not None for p in params],
                                                dtype=torch.float32, device=device))
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = _sum_over(group, torch.cat([g.reshape(-1) for g in grads]))
            for p, g, n in zip(params, flat.split([p.numel() for p in params]), has.tolist()):
                p.grad = g.view_as(p) if n else None
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % args.log_every and step != args.steps and step != 1:
            continue
        with torch.no_grad():
            right = (picked.argmax(-1) == answers).sum().float()
        stats = _sum_over(group, torch.stack([share.detach(), right]).double())
        loss_v, acc_v = stats[0].item(), stats[1].item() / answers_per_batch
        now = time.perf_counter()
        if not math.isfinite(loss_v):
            raise RuntimeError(f"{label}: the loss is {loss_v} at step {step}")
        peak = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
                else float("nan"))                          # (the ranks' largest: below)
        rows.append({"run": label, "world_size": world, "tokens_per_rank": largest, "seed": seed,
                     "data_seed": data_seed, "step": step, "loss": loss_v, "accuracy": acc_v,
                     "wall_s": now - start, "peak_mib": peak})
        last = recall.progress(log, label, args, step, loss_v, acc_v, now - start, last)
    if group is not None:
        _check_replicas(params, group, label)
        _largest_peak(rows, group, device)
    return rows, model


def _check_replicas(params, group, label):
    """Every rank's parameters equal rank 0's of the group, bitwise."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    first = flat.clone()
    dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
    differ = torch.tensor([float(not torch.equal(flat, first))], device=flat.device)
    if _sum_over(group, differ).item():
        raise RuntimeError(f"{label}: the ranks' parameters differ after training (the "
                           "gradients' all-reduce or the optimizer's steps disagree)")


def _largest_peak(rows, group, device):
    """Each row's peak memory: the largest over the group's ranks."""
    peaks = torch.tensor([r["peak_mib"] for r in rows], dtype=torch.float64, device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
    for r, p in zip(rows, peaks.tolist()):
        r["peak_mib"] = p


def run(args, device, log=print):
    """Every run this launch makes (the single ones on rank 0, then each world size); rank 0
    writes the outputs and returns {"runs", "verdict"}, the others None."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = args.world_size_list or [world]
    if any(not 1 <= k <= world for k in sizes):
        raise SystemExit(f"--world-sizes {sizes}: each must be in 1..{world} (the launch's)")
    # groups are made by every rank, in the same order; waits on gloo (idle ranks spin no GPU),
    # each as long as --timeout-s (a new group's default is PyTorch's, not the world's)
    wait = dict(timeout=datetime.timedelta(seconds=args.timeout_s))
    host = dist.new_group(backend="gloo", **wait) if device.type == "cuda" else dist.group.WORLD
    groups = {k: dist.group.WORLD if k == world else dist.new_group(list(range(k)), **wait)
              for k in sizes}
    say = log if rank == 0 else _quiet
    say(f"multi-query associative recall, seq len {args.seq_len}, batch {args.batch}, vocab "
        f"{args.vocab}, {args.pairs} pairs, {args.queries} queries; model d_model "
        f"{args.d_model}, {args.layers} layers, headdim {args.headdim}, dstate {args.dstate}, "
        f"chunk {args.chunk}; scan {args.scan}, {args.precision}, {args.steps} steps; "
        f"{world} rank(s), world sizes {sizes}")
    runs, noise = {}, None
    if rank == 0:
        runs["single"], _ = train(args, device, None, args.seed, args.data_seed, "single", say)
        if args.noise_run:
            noise = f"single@seed{args.seed + 1}"
            runs[noise], _ = train(args, device, None, args.seed + 1, args.data_seed, noise, say)
    dist.barrier(group=host)
    for k in sizes:
        if rank < k:
            rows, _ = train(args, device, groups[k], args.seed, args.data_seed, f"cp{k}", say)
            runs[f"cp{k}"] = rows
        dist.barrier(group=host)
    if rank != 0:
        return None
    if args.out:
        recall.write_csv(args.out, runs, COLUMNS)
        say(f"wrote {args.out}")
    if args.plot:
        task = recall.RecallTask(args.vocab, args.pairs, args.queries, args.seq_len)
        recall.write_plot(args.plot, runs, task.chance,
                          f"MQAR at L {args.seq_len}, context parallel over "
                          f"{', '.join(map(str, sizes))} ranks against one process; "
                          f"d_model {args.d_model} x {args.layers} layers, {args.precision}")
        say(f"wrote {args.plot}")
    verdict = {}
    if noise is not None:
        verdict = recall.agreement(runs, "single", noise, args.smooth)
        for label, (gap, spread, ok) in verdict.items():
            say(f"{label} vs single: mean gap of the smoothed loss curves {gap:.4g}; "
                f"seed-to-seed ({noise} vs single) {spread:.4g} -> "
                f"{'AGREE within run-to-run noise' if ok else 'DISAGREE: beyond run-to-run noise'}")
    return {"runs": runs, "verdict": verdict}


def _spawned_rank(rank, world_size, args):
    """A rank spawned by ``--ranks`` (``ops.tools.ranks.run_on_ranks``: its gloo group is made)."""
    return run(args, torch.device("cpu"), print if rank == 0 else _quiet)


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scan", default=None, choices=("cutile", "interpret", "reference"),
                   help="this project's backend (default: cutile on a GPU, reference on the CPU)")
    p.add_argument("--world-sizes", help="e.g. 2,4: context parallel over the first k ranks for "
                                         "each k (default: the launch's world size)")
    p.add_argument("--ranks", type=int, default=0,
                   help="CPU only, without torchrun: spawn this many gloo ranks")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda if there is one")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: bf16 autocast on a GPU, float32 on the CPU")
    recall.add_training_options(p, steps=300, batch=4, seq_len=16384, chunk=256)
    p.add_argument("--noise-run", action=argparse.BooleanOptionalAction, default=True,
                   help="train the single run again at seed + 1, for the agreement rule")
    p.add_argument("--timeout-s", type=int, default=3600,
                   help="the process group's timeout (ranks wait while others train)")
    return p


def check_args(p, args):
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here")
    args.scan = args.scan or ("cutile" if on_gpu else "reference")
    if args.scan == "cutile" and not on_gpu:
        p.error("--scan cutile needs a CUDA GPU; on the CPU use interpret or reference")
    if args.scan == "interpret" and on_gpu:
        p.error("--scan interpret runs the kernels on the CPU: use --device cpu")
    if args.ranks and (on_gpu or "WORLD_SIZE" in os.environ):
        p.error("--ranks spawns CPU ranks; on GPUs launch with torchrun instead")
    if args.ranks < 0:
        p.error(f"--ranks must be >= 0; got {args.ranks}")
    if args.timeout_s < 1:
        p.error(f"--timeout-s must be >= 1; got {args.timeout_s}")
    recall.check_training_args(p, args, on_gpu)
    try:
        args.world_size_list = ([int(k) for k in args.world_sizes.split(",")]
                                if args.world_sizes else None)
    except ValueError:
        p.error(f"--world-sizes must be comma-separated integers; got {args.world_sizes!r}")
    largest = max(args.world_size_list or [args.ranks or 1])
    if args.seq_len < largest:
        p.error(f"--seq-len ({args.seq_len}) must give every one of {largest} ranks a token")
    return args


def main(argv=None, log=print):
    p = parser()
    args = check_args(p, p.parse_args(argv))
    if args.ranks:
        from ops.tools.ranks import run_on_ranks
        return run_on_ranks(_spawned_rank, args.ranks, args, timeout_s=args.timeout_s)[0]
    device, cleanup = init_group(args.device, args.timeout_s)
    try:
        return run(args, device, log)
    finally:
        cleanup()


if __name__ == "__main__":
    result = main()
    if result is not None and not all(ok for _, _, ok in result["verdict"].values()):
        sys.exit(1)
