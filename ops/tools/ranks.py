"""A few CPU processes that form one torch.distributed group, for trying context parallelism
without GPUs (notebook 09).

    results = run_on_ranks(scan_on_slice, 3, problem, lengths, options, weights)

``run_on_ranks`` spawns ``world_size`` fresh Python processes, joins them into a gloo group (a
rendezvous through a file in a temporary folder, so no port is opened), calls
``fn(rank, world_size, *args)`` on each and returns what each returned, in rank order. The
function must be importable by name (defined in a module, not in a notebook cell): a spawned
process starts from nothing and finds it by import. Each process uses one thread, so a world of
three fits on a small laptop.

The workers below are what notebook 09 runs on each rank: the scan and the Mamba-2 layer on the
rank's own slice of one sequence, each returning its outputs and gradients for the notebook to
compare against the single-process call.
"""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ops import Mamba2Mixer, context_parallel_chunk_scan
from ops.context_parallel import previous_tokens

SLICED = ("x", "dt", "B", "C", "z")        # the scan's inputs with a sequence axis


def run_on_ranks(fn, world_size, *args, timeout_s=120):
    """[fn(rank, world_size, *args) for each rank], each run in its own process of one gloo group."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_entry, args=(world_size, folder, fn, args, timeout_s), nprocs=world_size,
                 join=True)
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]


def _entry(rank, world_size, folder, fn, args, timeout_s):
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))


def bounds(lengths, rank):
    """(first, last + 1): the global token positions of ``rank``'s slice."""
    lo = sum(lengths[:rank])
    return lo, lo + lengths[rank]


def scan_on_slice(rank, world_size, problem, lengths, options, weights):
    """One rank's part of a context-parallel scan and its backward.

    ``problem``: the whole sequence's inputs (every rank gets all of them and keeps its slice, as
    a data loader would hand each rank its part); ``weights``: (w_out, w_final), random weights
    of the loss sum(out * w_out) + sum(final * w_final). Each rank backpropagates its share: its
    slice of the first sum, and rank 0 alone the second (the final state is the same on every
    rank, so it is counted once). The shares add up to the single-process loss, so the gradients
    of sliced inputs, concatenated, and of whole inputs, summed over ranks, are its gradients.
    """
    lo, hi = bounds(lengths, rank)
    mine = {k: (v[:, lo:hi] if k in SLICED else v).detach().clone().requires_grad_()
            for k, v in problem.items()}
    out, final = context_parallel_chunk_scan(**mine, **options, return_final_states=True)
    w_out, w_final = weights
    loss = (out * w_out[:, lo:hi]).sum()
    if rank == 0:
        loss = loss + (final * w_final).sum()
    loss.backward()
    return dict(out=out.detach(), final=final.detach(),
                grads={k: v.grad for k, v in mine.items()})


def mixer_on_slice(rank, world_size, layer_kwargs, lengths, u, w_out):
    """One rank's part of a Mamba-2 layer (``ops.mixer.Mamba2Mixer``) over a split sequence.

    Every rank builds the same layer (same seed) with the whole world as its process group and
    runs it on its slice of ``u`` (b, L, d_model), ``lengths`` the slices' sizes; the loss share is sum(out * w_out) over the
    slice. Also returns the convolution's halo of the slice's input, ``previous_tokens`` of
    ``u`` itself with the layer's reach (d_conv - 1), to compare with the tokens it stands for."""
    lo, hi = bounds(lengths, rank)
    layer = Mamba2Mixer(**layer_kwargs, generator=torch.Generator().manual_seed(0),
                        process_group=dist.group.WORLD)
    mine = u[:, lo:hi].clone().requires_grad_()
    out = layer(mine)
    (out * w_out[:, lo:hi]).sum().backward()
    reach = layer.conv1d.kernel_size[0] - 1
    halo = previous_tokens(mine.detach(), reach)
    return dict(out=out.detach(), du=mine.grad, halo=halo,
                grads={n: p.grad for n, p in layer.named_parameters()})


def in_turn(rank, world_size, *jobs):
    """Several workers in one spawn, one after the other: jobs are (fn, args) pairs; returns
    [fn(rank, world_size, *args)]. Starting the processes is the slow part (each imports torch),
    so a notebook pays it once."""
    return [fn(rank, world_size, *args) for fn, args in jobs]
