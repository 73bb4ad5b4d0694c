"""What every kernel call does to its inputs first, forward and backward alike: the checks that
read values (sequence ids and bounds), and each tensor as the kernels read it (in place where a
launch compiles it to the same loads as a contiguous tensor, else a copy).

``ops.ssd_combined`` checks the arguments' shapes and dtypes before any of this
(``ops.checks`` holds the size rules the kernels share)."""
import torch


def check_values(x, seq_idx, cu_seqlens, check=True):
    """The checks that read values: seq_idx non-negative and non-decreasing; cu_seqlens from 0
    to L, increasing, and where seq_idx is given its ids changing exactly at those bounds.
    Returns seq_idx (derived from cu_seqlens when only that is given).

    While a CUDA graph is being captured the checks are skipped: reading a value would
    synchronise with the GPU, which a capture forbids (the eager warm-up call before a capture
    has checked the same tensors). ``check=False`` skips them too."""
    L = x.shape[1]
    if check and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        if seq_idx is not None:
            _check_seq_idx(seq_idx)
        if cu_seqlens is not None:
            _check_cu_seqlens(cu_seqlens.long(), L, seq_idx)
    if cu_seqlens is not None and seq_idx is None:
        lengths = cu_seqlens[1:].long() - cu_seqlens[:-1].long()
        ids = torch.arange(len(lengths), device=x.device)
        seq_idx = torch.repeat_interleave(ids, lengths, output_size=L)[None].to(torch.int32)
    return seq_idx


def _check_seq_idx(seq_idx):
    # One small reduction each; a decreasing id would silently mix sequences.
    if seq_idx.shape[1] > 1 and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
        raise ValueError("seq_idx must be non-decreasing along the sequence (packed sequences in order)")
    if bool((seq_idx[:, 0] < 0).any()):
        raise ValueError("seq_idx must be non-negative")


def _check_cu_seqlens(cu, L, seq_idx):
    if int(cu[0]) != 0 or int(cu[-1]) != L:
        raise ValueError(f"cu_seqlens must start at 0 and end at seqlen ({L}); got "
                         f"{int(cu[0])} ... {int(cu[-1])}")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError("cu_seqlens must be increasing: every packed sequence has at least one "
                         "token (a decreasing or repeated bound was found)")
    if seq_idx is not None:
        changes = torch.nonzero(seq_idx[0, 1:] != seq_idx[0, :-1]).flatten() + 1
        if changes.shape != cu[1:-1].shape or not bool((changes == cu[1:-1]).all()):
            raise ValueError("seq_idx and cu_seqlens disagree: the ids in seq_idx must change "
                             "exactly at the bounds in cu_seqlens")


def as_kernel_input(t):
    """``t`` as the kernels read it: the tensor itself where they read it in place, else a
    contiguous copy; in both, size-1 dimensions get canonical strides.

    A Mamba-2 layer passes slices of its projection (``ops/mixer.py``): z and dt (and x, B, C
    where the convolution keeps channels last) with a contiguous last dimension and the row
    length as token stride. The kernels index only through ``ct.load`` / ``ct.store``, which
    follow each array's strides (the interpreter indexes the tensor itself), so such views need
    no copy, which saves a full read and write of each (``_readable_in_place`` says which).

    A size-1 dimension's stride is never stepped, yet a batch-1 slice of a longer tensor keeps
    its parent's there (2**33 in a 1M-token layer), which the launch would pass to the kernel,
    out of the 32-bit index range: it is replaced without copying (``_canonical_strides``)."""
    if t is None:
        return None
    if not _readable_in_place(t):
        t = t.contiguous()
    return with_canonical_strides(t)


def with_canonical_strides(t):
    """``t`` itself, or where a size-1 dimension's stride differs from its canonical one, a view
    of the same elements with canonical strides there (``_canonical_strides``; never a copy).
    For tensors that reach the kernels as they are, not through ``as_kernel_input``: the
    backward's ``dout`` is, in a call made in pieces (``ops.ssd_combined``), a batch-1 slice of
    the whole output's gradient, with that gradient's stride(0) (past 2**32 at 1M tokens of 80
    heads of 64), which a launch would refuse."""
    if t is None:
        return None
    strides = _canonical_strides(t)
    return t if t.stride() == strides else t.as_strided(t.shape, strides)


ALIGN = 16      # bytes


def _readable_in_place(t):
    """Whether the kernels read ``t`` where it lies: a contiguous tensor always (as ever); a view
    when a launch compiles it to the same loads as a contiguous, aligned tensor (TMA copies,
    16-byte vectors), which needs

    * the last dimension contiguous (a strided one makes every load gather single elements);
    * the first element and every stepped stride 16-byte aligned: a launch specialises on both,
      and without them compiles element-by-element loads (4-5 times the instructions in
      fwd_pass_state and compute_out for sm_90); a copy keeps the fast code for one pass;
    * no two elements at one address (no broadcast, stride-0 or overlapping dimension: cuTile
      may compile an array as one whose elements never alias). Taken by increasing stride, each
      dimension of size > 1 must step past all elements of the smaller ones: true of every
      slice or permutation of a contiguous tensor.

    Traced by torch.compile, only the reference backend runs here (the kernels run inside the
    opaque operator, on real tensors), so the base address, unknown then, is not asked for."""
    if t.is_contiguous():
        return True
    size = t.element_size()
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return False
    if not torch.compiler.is_compiling() and t.data_ptr() % ALIGN:
        return False
    reach = 1                        # one past the largest offset reached by the dims so far
    for stride, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride < reach or (stride != 1 and stride * size % ALIGN):
            return False
        reach += (n - 1) * stride
    return True


def _canonical_strides(t):
    """``t``'s strides, each size-1 dimension's replaced by the reach of the dimensions inside it
    (one past their largest offset): for a contiguous tensor its contiguous strides, as before
    (so the same compiled code), and never more than ``ops.runtime.launch.element_reach(t)``, which
    picks the index width."""
    strides, reach = [], 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if size == 1:
            stride = reach
        strides.append(stride)
        reach += (max(size, 1) - 1) * stride
    return tuple(reversed(strides))
