"""How much work launches did: each kernel's multiply-adds and the bytes it loaded and stored.

    with count_work() as work:
        ...                          # any interpreter launches, e.g. a whole training step
    for name, k in work.kernels.items():     # "module.function" of each kernel
        print(name, k.launches, k.blocks, k.macs, k.loaded, k.stored)

A timing says how long a kernel took on one GPU; these counts say how much it asked of any GPU,
exactly, from the kernel's own code as it ran: two implementations of one computation can be
compared kernel by kernel (``tests/benchmark/work_count.py``), and a change that should remove
work shows that it did. What is counted, per kernel (by its function's module and name: two
projects' kernels of one name stay apart), over the launches made while counting:

  * ``macs``: multiply-adds of ``ct.mma`` and ``ct.matmul`` (an ``(M, K) @ (K, N)`` product is
    M x K x N, times its batch), whatever the operands' dtype; elementwise arithmetic, reductions
    and scans are not counted;
  * ``loaded`` / ``stored``: bytes of the array elements that box accesses -- ``ct.load``,
    ``ct.store``, a tiled view's loads, stores and atomic stores -- read or wrote inside the
    array (a partial tile's padding is no memory traffic); gathers, scatters, raw-memory
    accesses and the ``ct.atomic_*`` operations are not counted. Each access counts in full: a
    tile read twice (by two blocks, or twice by one) is two reads, as the kernel asks for them;
    what a GPU's caches then serve is not modelled.

Counting costs a few operations per access; off (the default), one context-variable check.
"""
import contextlib
import contextvars
import dataclasses
import math

# The counts being made on this thread (``count_work``); None when not counting.
COUNTING = contextvars.ContextVar("interpreter_work", default=None)


@dataclasses.dataclass
class KernelWork:
    """One kernel's counts: launches, blocks run, multiply-adds, bytes loaded and stored."""
    launches: int = 0
    blocks: int = 0
    macs: int = 0
    loaded: int = 0
    stored: int = 0


class Work:
    """The counts of the launches made inside ``count_work``, per kernel, in the order the kernels
    first ran (``kernels``: "module.function" -> ``KernelWork``)."""

    def __init__(self):
        self.kernels = {}
        self._current = None

    def launch(self, name):
        """A launch of the kernel named ``name`` ("module.function") begins: what follows is
        its."""
        self._current = self.kernels.setdefault(name, KernelWork())
        self._current.launches += 1

    def block(self):
        """One of its blocks begins."""
        self._current.blocks += 1

    def mma(self, x_shape, y_shape):
        """A product of tiles shaped ``(..., M, K)`` and ``(..., K, N)``."""
        self._current.macs += math.prod(x_shape[:-2]) * x_shape[-2] * x_shape[-1] * y_shape[-1]

    def access(self, kind, array, region):
        """A box access of ``kind`` ("load" or "store") to the elements of ``array`` (an
        interpreter ``Array``) that ``region`` selects: one slice per axis, already cut to the
        array (so in whatever axis order the access saw it)."""
        elements = math.prod(part.stop - part.start for part in region)
        nbytes = elements * array._t.element_size()
        if kind == "load":
            self._current.loaded += nbytes
        else:
            self._current.stored += nbytes

    def total(self):
        """Every kernel's counts added up."""
        total = KernelWork()
        for k in self.kernels.values():
            for field in dataclasses.fields(KernelWork):
                setattr(total, field.name, getattr(total, field.name) + getattr(k, field.name))
        return total


@contextlib.contextmanager
def count_work():
    """Count the work of every interpreter launch made inside (on this thread): -> ``Work``."""
    work = Work()
    token = COUNTING.set(work)
    try:
        yield work
    finally:
        COUNTING.reset(token)
