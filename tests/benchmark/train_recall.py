"""Train a small Mamba-2 language model on multi-query associative recall, once per scan, and
check that the scans give the same training curve.

    # GPU (one H200): this project's cuTile scan against mamba_ssm's Triton scan
    python -m tests.benchmark.train_recall --scans cutile,triton \\
        --out bench_out/train_recall.csv --plot bench_out/train_recall.png

    # CPU dry run: the same kernels through the tile interpreter against the PyTorch reference
    python -m tests.benchmark.train_recall --scans interpret,reference --device cpu \\
        --d-model 32 --layers 2 --headdim 16 --dstate 16 --seq-len 48 --chunk 16 --batch 8 \\
        --vocab 32 --pairs 4 --queries 4 --steps 40 --out /tmp/recall.csv --plot /tmp/recall.png

What it measures. Whether a model trained through this project's scan (forward and backward
kernels) learns the same thing, at the same rate, as the same model trained through the scan it
replaces -- not one layer's numerics (tests/api/test_mixer.py does that) but their effect compounded
over hundreds of optimizer steps. Every scan trains the same model from the same initial weights
(``--seed``) on the same batches (``--data-seed``); only the scan differs.

The task (``RecallTask``): multi-query associative recall. Token 0 is a filler; tokens
1..K (K = (vocab - 1) // 2) are keys, tokens K+1..vocab-1 values. Each sequence of seq_len + 1
tokens starts with ``--pairs`` key-value pairs (distinct keys, values drawn with replacement),
``k1 v1 k2 v2 ...``; the rest of the sequence is filler with ``--queries`` of those keys (distinct,
in random order) placed at random even offsets, each followed by its value. The model reads the
first seq_len tokens and predicts the next; the loss (cross-entropy over the whole vocabulary)
and the accuracy (argmax) count only the answers, i.e. the value after each queried key. Without
memory of the context the answer is uniform over the values, so no model that does not recall
can beat loss ln(number of values) or accuracy 1 / (number of values); these are printed as
"chance". Batch ``step`` is drawn from numpy's PCG64 seeded with the pair (data seed, step), so the
batches are the same for every run with the same data seed, whatever ran before; held-out
batches (printed at the end) come from steps 2**40 onwards, never trained on.

The model (``RecallLM``): a token embedding, ``--layers`` pre-norm residual blocks
``h = h + Mamba2Mixer(RMSNorm(h))`` (ops/mixer.py; Mamba-2's language models have no MLP), a
final RMSNorm and an LM head tied to the embedding (``--untied`` for a separate one). All
weights come from one generator seeded with ``--seed``, on the CPU in float32, then move to the
device. The scan: "cutile", "interpret", "reference" are this project's backends of
``ops.mamba_chunk_scan_combined``; "triton" is mamba_ssm's
``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` (``Mamba2Mixer(scan=...)``).

Training: AdamW (betas 0.9, 0.95, weight decay ``--wd`` on the matrices and the embedding, none
on norms, biases, A_log, D, dt_bias), learning rate ``--lr`` with a linear warm-up over the first
10% of steps and a cosine decay to 10% of it, gradients clipped to norm 1. Precision: on a GPU,
float32 parameters and optimizer state under ``torch.autocast(dtype=torch.bfloat16)`` (mixed
precision, as Mamba-2 is usually trained: the projections, and so the scan's x, B, C and dt, run in
bf16; A, D, dt_bias and the norms stay float32); on the CPU everything is float32
(``--precision`` overrides).

Output: a progress line every ``--print-every`` steps (step, loss, recall accuracy, steps/s); a
CSV (``--out``) with one row per run x logged step (every ``--log-every`` steps: run, scan, seeds,
step, loss, accuracy, wall_s = seconds since the run's first step began, the first step's
compilation included); a figure (``--plot``) with the loss and accuracy curves of every run; and a
verdict.

The agreement rule. One step's loss is noisy and two runs drift apart chaotically once their
numerics differ at all, so "the curves agree" is judged against what an unimportant change does
to the same training: the baseline scan (the last of ``--scans``) is trained a second time with
the initial weights of seed ``--seed + 1`` and the same batches (``--noise-vary data`` changes the
batches instead, ``both`` both). Each curve is smoothed by a trailing mean over ``--smooth``
logged points; the gap between two runs is the mean over logged steps of the absolute difference
of their smoothed losses. A scan agrees with the baseline when

    gap(scan, baseline) <= gap(baseline at the other seed, baseline)

i.e. swapping the scan moves the loss curve no more than re-drawing the initial weights does.
Both pairs share their batches, so per-batch difficulty cancels in both gaps alike. The rule
uses one sample of the seed-to-seed spread, so it is a coarse check: it catches a scan that
trains differently (a wrong gradient slows or stalls learning, or changes where it plateaus),
not a difference smaller than seed noise. The exit status is 1 when some scan disagrees.

The defaults and what they were chosen by. At d_model 256, 4 layers, headdim 64, dstate 64,
chunk 256, seq len 512, vocab 256 and 32 pairs and queries, 400 steps on the H200 did not learn
(recall 0.017, loss 4.82 against chance's 4.85), nor on the CPU at d_model 128, seq len 256, vocab
128, 16 pairs in 600 steps (0.037 held out): recall is learned late and suddenly, and a few
hundred steps are not enough at that size. The defaults (d_model 128, 2 layers, headdim 32,
dstate 32, chunk 32, seq len 128, batch 32, vocab 64, 8 pairs and queries, lr 3e-3, 800 steps)
learn: through the reference scan on the CPU (float32), recall leaves chance (0.031) by step
300 and reaches 0.54 held out at step 800 (loss 1.44 against chance's 3.47), 4 minutes on two
cores. On the H200 the scan's kernels compile once per scan (13.7 s for cutile's first step,
102 s for Triton's autotuning, at the earlier defaults), then a step took ~28 ms (36 steps/s,
launch-bound).
"""
import argparse
import csv
import math
import os
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

SCANS = ("cutile", "triton", "interpret", "reference")
FILLER = 0
EVAL_STEP = 2**40          # held-out batches are drawn at steps EVAL_STEP, EVAL_STEP + 1, ...


# ----------------------------------------------------------------------------------------------
# The task

class RecallTask:
    """Multi-query associative recall batches (see the module docstring), drawn on the CPU.

    ``batch(step, size)`` -> (inputs, targets, mask, positions): inputs and targets (size,
    seq_len) int64 with targets[:, t] = the token after inputs[:, t]; mask (size, seq_len) bool,
    True exactly where the target is an answer; positions (size, queries) int64, those places in
    increasing order (the loss gathers the logits there)."""

    def __init__(self, vocab, pairs, queries, seq_len, seed=0):
        for name, value, least in (("--vocab", vocab, 3), ("--pairs", pairs, 1),
                                   ("--queries", queries, 1), ("--seq-len", seq_len, 2)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}; got {value!r}")
        self.n_keys = (vocab - 1) // 2
        self.n_values = vocab - 1 - self.n_keys
        if pairs > self.n_keys:
            raise ValueError(f"--pairs ({pairs}) must be at most the number of key tokens, "
                             f"(--vocab - 1) // 2 = {self.n_keys}: keys are distinct in a sequence")
        if queries > pairs:
            raise ValueError(f"--queries ({queries}) must be at most --pairs ({pairs}): "
                             "each query asks for a different key")
        if 2 * pairs + 2 * queries > seq_len + 1:
            raise ValueError(f"--seq-len ({seq_len}) is too short for {pairs} pairs and {queries} "
                             f"queries: it needs 2 * pairs + 2 * queries - 1 = "
                             f"{2 * pairs + 2 * queries - 1} tokens or more")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"--data-seed must be an integer >= 0; got {seed!r}")
        self.vocab, self.pairs, self.queries, self.seq_len, self.seed = vocab, pairs, queries, seq_len, seed

    def generator(self, step):
        """numpy's PCG64 seeded with the pair (seed, step): independent streams for every pair.
        (torch's CPU generator keeps only 32 bits of its seed, too few to hold both.)"""
        if step < 0:
            raise ValueError(f"step must be >= 0; got {step}")
        return np.random.default_rng([self.seed, step])

    def batch(self, step, size):
        g = self.generator(step)
        P, Q, n = self.pairs, self.queries, self.seq_len + 1
        rows = np.arange(size)[:, None]
        keys = g.random((size, self.n_keys)).argsort(1)[:, :P] + 1
        values = g.integers(self.n_keys + 1, self.vocab, (size, P))
        seq = np.full((size, n), FILLER, dtype=np.int64)
        seq[:, 0:2 * P:2], seq[:, 1:2 * P:2] = keys, values
        slots = (n - 2 * P) // 2                       # places for a (query, answer) pair
        where = np.sort(g.random((size, slots)).argsort(1)[:, :Q], axis=1)
        asked = g.random((size, P)).argsort(1)[:, :Q]  # which pairs, in which order
        query_at = 2 * P + 2 * where
        seq[rows, query_at] = np.take_along_axis(keys, asked, 1)
        seq[rows, query_at + 1] = np.take_along_axis(values, asked, 1)
        mask = np.zeros((size, self.seq_len), dtype=bool)
        mask[rows, query_at] = True                    # targets[:, query_at] is the answer
        seq = torch.from_numpy(seq)
        return (seq[:, :-1].contiguous(), seq[:, 1:].contiguous(), torch.from_numpy(mask),
                torch.from_numpy(query_at.astype(np.int64)))

    @property
    def chance(self):
        """(loss, accuracy) of the best predictor that remembers nothing of the context."""
        return math.log(self.n_values), 1 / self.n_values


# ----------------------------------------------------------------------------------------------
# The model

class RMSNorm(nn.Module):
    def __init__(self, width, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        v = x.float()
        v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + self.eps)
        return (v * self.weight).to(x.dtype)


def scan_options(scan):
    """The Mamba2Mixer arguments that pick the scan called ``scan`` (or the function ``scan``,
    with mamba_ssm's signature)."""
    if callable(scan):
        return {"scan": scan}
    if scan not in SCANS:
        raise ValueError(f"--scans: unknown scan {scan!r}; choose from {', '.join(SCANS)}")
    if scan == "triton":
        try:
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        except ImportError as e:
            raise ValueError(f"--scans triton needs mamba_ssm installed ({e})") from e
        return {"scan": mamba_chunk_scan_combined}
    return {"backend": scan}


class RecallLM(nn.Module):
    """Embedding, ``layers`` x (x + Mamba2Mixer(RMSNorm(x))), RMSNorm, LM head.
    ``process_group``: the mixers run context parallel over it (``ops.mixer``; ``scan`` one of
    this project's backends), each rank passing its slice of the tokens; the rest is per token."""

    def __init__(self, vocab, d_model, layers, d_state, headdim, chunk_size, scan="reference",
                 seed=0, tied=True, expand=2, ngroups=1, process_group=None):
        super().__init__()
        from ops.mixer import Mamba2Mixer
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab, d_model)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab, d_model, generator=g) * 0.02)
        options = scan_options(scan)
        if process_group is not None:
            options["process_group"] = process_group
        self.norms = nn.ModuleList(RMSNorm(d_model) for _ in range(layers))
        self.mixers = nn.ModuleList(
            Mamba2Mixer(d_model, d_state=d_state, headdim=headdim, expand=expand, ngroups=ngroups,
                        chunk_size=chunk_size, generator=g, **options) for _ in range(layers))
        with torch.no_grad():         # the residual branches' outputs scaled by 1/sqrt(layers)
            for m in self.mixers:
                m.out_proj.weight.div_(math.sqrt(layers))
        self.norm_f = RMSNorm(d_model)
        self.head = None
        if not tied:
            self.head = nn.Linear(d_model, vocab, bias=False)
            with torch.no_grad():
                self.head.weight.copy_(torch.randn(vocab, d_model, generator=g) * 0.02)

    def forward(self, tokens, positions=None):
        """tokens (b, L) -> logits (b, L, vocab), or (b, n, vocab) at ``positions`` (b, n) only."""
        h = self.embed(tokens)
        for norm, mixer in zip(self.norms, self.mixers):
            h = h + mixer(norm(h))
        if positions is not None:
            h = h.gather(1, positions[..., None].expand(-1, -1, h.shape[-1]))
        h = self.norm_f(h)
        return F.linear(h, (self.head or self.embed).weight)


def param_groups(model, weight_decay):
    decay, rest = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "conv1d" not in name else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def lr_factor(step, steps):
    """Linear warm-up over the first 10% of steps (step counted from 1), cosine to 0.1 after."""
    warm = max(1, steps // 10)
    if step <= warm:
        return step / warm
    t = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


# ----------------------------------------------------------------------------------------------
# Training

def model_for(args, scan, seed):
    return RecallLM(args.vocab, args.d_model, args.layers, args.dstate, args.headdim, args.chunk,
                    scan=scan, seed=seed, tied=not args.untied)


def train(args, scan, seed, data_seed, label=None, log=print):
    """Train one model through ``scan``: -> (rows (dicts) at every logged step, the model)."""
    device = torch.device(args.device)
    label = label or scan
    task = RecallTask(args.vocab, args.pairs, args.queries, args.seq_len, seed=data_seed)
    model = model_for(args, scan, seed).to(device)
    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i + 1, args.steps))
    bf16 = args.precision == "bf16"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows, last = [], (0.0, 0)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets, _, positions = task.batch(step, args.batch)
        answers = targets.gather(1, positions)
        inputs, positions, answers = (t.to(device, non_blocking=True) for t in (inputs, positions, answers))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(inputs, positions)
        logits = logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), answers.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.log_every and step != args.steps and step != 1:
            continue
        with torch.no_grad():
            acc = (logits.argmax(-1) == answers).float().mean()
        sync()
        now = time.perf_counter()
        loss_v, acc_v = loss.item(), acc.item()
        if not math.isfinite(loss_v):
            raise RuntimeError(f"{label}: the loss is {loss_v} at step {step}")
        rows.append({"run": label, "scan": scan, "seed": seed, "data_seed": data_seed, "step": step,
                         "loss": loss_v, "accuracy": acc_v, "wall_s": now - start})
        last = progress(log, label, args, step, loss_v, acc_v, now - start, last)
    return rows, model


def progress(log, label, args, step, loss, accuracy, elapsed, last):
    """Log ``step``'s line where one is due (the first step, every ``--print-every``, the
    last), with the rate since the previous line: ``last`` (seconds elapsed, step) at that
    line, returned anew when this step logs."""
    if step == 1:
        log(f"[{label}] step 1: loss {loss:.4f}  acc {accuracy:.3f}  "
            f"(first step, compilation included: {elapsed:.1f} s)")
    elif step % args.print_every == 0 or step == args.steps:
        rate = (step - last[1]) / (elapsed - last[0])
        log(f"[{label}] step {step}/{args.steps}: loss {loss:.4f}  acc {accuracy:.3f}  "
            f"{rate:.2f} steps/s")
    else:
        return last
    return elapsed, step


@torch.no_grad()
def evaluate(model, args, data_seed, batches=4):
    """(loss, accuracy) on the answers of ``batches`` held-out batches (never trained on)."""
    device = next(model.parameters()).device
    task = RecallTask(args.vocab, args.pairs, args.queries, args.seq_len, seed=data_seed)
    total_loss = total_right = count = 0.0
    for i in range(batches):
        inputs, targets, _, positions = task.batch(EVAL_STEP + i, args.batch)
        answers = targets.gather(1, positions).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = model(inputs.to(device), positions.to(device)).float()
        total_loss += F.cross_entropy(logits.flatten(0, 1), answers.flatten(), reduction="sum").item()
        total_right += (logits.argmax(-1) == answers).sum().item()
        count += answers.numel()
    return total_loss / count, total_right / count


# ----------------------------------------------------------------------------------------------
# The agreement rule

def smooth(values, window):
    """Trailing mean over ``window`` points (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def curve_gap(a, b, window):
    """Mean over logged steps of |smoothed loss of a - smoothed loss of b| (rows of one step grid)."""
    if [r["step"] for r in a] != [r["step"] for r in b]:
        raise ValueError("the two runs were logged at different steps")
    sa, sb = smooth([r["loss"] for r in a], window), smooth([r["loss"] for r in b], window)
    return sum(abs(x - y) for x, y in zip(sa, sb)) / len(sa)


def agreement(runs, baseline, noise_label, window):
    """-> {scan: (gap to the baseline, seed-to-seed gap, agrees)} for every scan but the baseline."""
    spread = curve_gap(runs[noise_label], runs[baseline], window)
    return {label: (gap, spread, gap <= spread)
            for label, gap in ((label, curve_gap(rows, runs[baseline], window))
                               for label, rows in runs.items() if label not in (baseline, noise_label))}


# ----------------------------------------------------------------------------------------------
# Output

COLUMNS = ("run", "scan", "seed", "data_seed", "step", "loss", "accuracy", "wall_s")


def write_csv(path, runs, columns=COLUMNS):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for rows in runs.values():
            w.writerows(rows)


def write_plot(path, runs, chance, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (label, rows) in enumerate(runs.items()):
        steps = [r["step"] for r in rows]
        style = {"label": label, "linestyle": "--" if "@" in label else "-", "color": f"C{i}"}
        ax_loss.plot(steps, [r["loss"] for r in rows], **style)
        ax_acc.plot(steps, [r["accuracy"] for r in rows], **style)
    ax_loss.axhline(chance[0], color="grey", linewidth=0.8, linestyle=":", label="chance")
    ax_acc.axhline(chance[1], color="grey", linewidth=0.8, linestyle=":", label="chance")
    ax_loss.set(xlabel="step", ylabel="loss on the answers", yscale="log")
    ax_acc.set(xlabel="step", ylabel="recall accuracy", ylim=(0, 1.02))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# The command line

def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scans", default="cutile,triton",
                   help=f"comma-separated scans to train with, from {', '.join(SCANS)}; the last "
                        "is the baseline (default cutile,triton)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="bf16: bf16 autocast over float32 parameters; auto: bf16 on a GPU, fp32 on the CPU")
    add_training_options(p, steps=800, batch=32, seq_len=128, chunk=32)
    p.add_argument("--untied", action="store_true", help="a separate LM head (default: tied to the embedding)")
    p.add_argument("--noise-run", action=argparse.BooleanOptionalAction, default=True,
                   help="train the baseline again at another seed, for the agreement rule (default on)")
    p.add_argument("--noise-vary", choices=("init", "data", "both"), default="init",
                   help="what the noise run changes: the initial weights (default), the batches, or both")
    return p


def add_training_options(p, *, steps, batch, seq_len, chunk):
    """The task's, the model's, the optimizer's and the outputs' options, at these defaults for
    the first four (``train_context_parallel.py`` trains the same model at others)."""
    for name, default in (("--steps", steps), ("--batch", batch), ("--seq-len", seq_len),
                          ("--vocab", 64), ("--pairs", 8), ("--queries", 8), ("--d-model", 128),
                          ("--layers", 2), ("--headdim", 32), ("--dstate", 32), ("--chunk", chunk)):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0, help="the initial weights' seed")
    p.add_argument("--data-seed", type=int, default=0, help="the batches' seed")
    p.add_argument("--smooth", type=int, default=10, help="trailing-mean window, in logged points")
    p.add_argument("--log-every", type=int, default=1, help="steps between CSV rows")
    p.add_argument("--print-every", type=int, default=25, help="steps between progress lines")
    p.add_argument("--out", help="CSV file to write")
    p.add_argument("--plot", help="figure (PNG) to write")


def check_training_args(p, args, on_gpu):
    """``add_training_options``' options checked (``p.error`` naming the option), and
    ``--precision auto`` resolved for the device."""
    for name in ("steps", "batch", "d_model", "layers", "headdim", "dstate", "chunk", "smooth",
                 "log_every", "print_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.d_model * 2 % args.headdim:
        p.error(f"--headdim ({args.headdim}) must divide 2 * --d-model ({2 * args.d_model})")
    if args.chunk & (args.chunk - 1):
        p.error(f"--chunk must be a power of two; got {args.chunk}")
    if args.seed < 0 or args.data_seed < 0:
        p.error("--seed and --data-seed must be >= 0")
    if args.steps >= EVAL_STEP:
        p.error(f"--steps must be below {EVAL_STEP}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0; got {args.lr}")
    if args.precision == "auto":
        args.precision = "bf16" if on_gpu else "fp32"
    try:
        RecallTask(args.vocab, args.pairs, args.queries, args.seq_len)
    except ValueError as e:
        p.error(str(e))


def check_args(p, args):
    scans = [s.strip() for s in args.scans.split(",") if s.strip()]
    if not scans:
        p.error("--scans: give at least one scan")
    for s in scans:
        if s not in SCANS:
            p.error(f"--scans: unknown scan {s!r}; choose from {', '.join(SCANS)}")
    if len(set(scans)) != len(scans):
        p.error(f"--scans: a scan is named twice in {args.scans!r}")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        p.error(f"--device must be cpu or cuda; got {args.device!r}")
    on_gpu = args.device != "cpu"
    if on_gpu and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA GPU here")
    for s in scans:
        if s == "interpret" and on_gpu:
            p.error("--scans interpret runs the kernels on the CPU: use --device cpu (or the cutile scan)")
        if s in ("cutile", "triton") and not on_gpu:
            p.error(f"--scans {s} needs a CUDA GPU (--device cuda); on the CPU use interpret,reference")
    check_training_args(p, args, on_gpu)
    try:
        for s in scans:
            scan_options(s)
    except ValueError as e:
        p.error(str(e))
    args.scan_list = scans
    return args


def main(argv=None, log=print):
    p = parser()
    args = check_args(p, p.parse_args(argv))
    task = RecallTask(args.vocab, args.pairs, args.queries, args.seq_len)
    chance = task.chance
    n_params = sum(t.numel() for t in model_for(args, "reference", args.seed).parameters())
    log(f"multi-query associative recall: vocab {args.vocab} ({task.n_keys} keys, {task.n_values} "
        f"values), {args.pairs} pairs, {args.queries} queries, seq len {args.seq_len}, batch "
        f"{args.batch}; chance: loss {chance[0]:.3f}, accuracy {chance[1]:.3f}")
    log(f"model: d_model {args.d_model}, {args.layers} layers, headdim {args.headdim}, dstate "
        f"{args.dstate}, chunk {args.chunk}, {'untied' if args.untied else 'tied'} head, "
        f"{n_params / 1e6:.2f}M parameters; {args.device}, {args.precision}; {args.steps} steps")
    runs, held_out = {}, {}
    for scan in args.scan_list:
        runs[scan], model = train(args, scan, args.seed, args.data_seed, log=log)
        held_out[scan] = evaluate(model, args, args.data_seed)
    baseline, noise = args.scan_list[-1], None
    if args.noise_run and len(args.scan_list) > 1:
        seed = args.seed + (args.noise_vary in ("init", "both"))
        data_seed = args.data_seed + (args.noise_vary in ("data", "both"))
        noise = f"{baseline}@seed{seed},data{data_seed}"
        runs[noise], model = train(args, baseline, seed, data_seed, label=noise, log=log)
        held_out[noise] = evaluate(model, args, data_seed)
    if args.out:
        write_csv(args.out, runs)
        log(f"wrote {args.out}")
    if args.plot:
        title = (f"MQAR: vocab {args.vocab}, {args.pairs} pairs, {args.queries} queries, L {args.seq_len}; "
                 f"d_model {args.d_model} x {args.layers} layers, {args.precision}")
        write_plot(args.plot, runs, chance, title)
        log(f"wrote {args.plot}")
    for label, rows in runs.items():
        tail = rows[-max(1, len(rows) // 10):]
        log(f"{label:>24}: final loss {rows[-1]['loss']:.4f}, accuracy {rows[-1]['accuracy']:.3f} "
            f"(mean of the last {len(tail)} logged: {sum(r['loss'] for r in tail) / len(tail):.4f}, "
            f"{sum(r['accuracy'] for r in tail) / len(tail):.3f}); held out: loss "
            f"{held_out[label][0]:.4f}, accuracy {held_out[label][1]:.3f}; {rows[-1]['wall_s']:.1f} s")
    verdict = {}
    if noise is not None:
        verdict = agreement(runs, baseline, noise, args.smooth)
        for label, (gap, spread, ok) in verdict.items():
            log(f"{label} vs {baseline}: mean gap of the smoothed loss curves {gap:.4g}; "
                f"seed-to-seed ({noise} vs {baseline}) {spread:.4g} -> "
                f"{'AGREE within run-to-run noise' if ok else 'DISAGREE: beyond run-to-run noise'}")
    return {"runs": runs, "held_out": held_out, "verdict": verdict, "chance": chance, "args": args}


if __name__ == "__main__":
    result = main()
    sys.exit(0 if all(ok for _, _, ok in result["verdict"].values()) else 1)
