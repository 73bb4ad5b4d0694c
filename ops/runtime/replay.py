"""Eager calls like an earlier one, replayed: the same launches on the new call's tensors.

At small shapes a forward pass is tens of microseconds of GPU work and several times that of
Python: the input checks, the config lookups, three plans built and bound, three launches
(``tests/benchmark/results/host_time_h200.csv``; PERF_NOTES.md, "An eager call replays the
previous call's launches"). But
an eager call whose tensors have the shapes, dtypes, strides and devices of an earlier call, with
the same options, passes the same checks, picks the same configs and makes the same launches;
only the tensors differ. So ``ops.ssd_combined`` records the launches of such a call once
(``Recording``) and replays them for the next ones (``Replay.run``): it allocates the output
buffers afresh and launches each kernel with the new call's tensors in place of the old.

Not replayed: calls that need a gradient, traced calls, varlen calls (their bounds are read from
``cu_seqlens``), a call's first run while configs are searched (it may search, launching every
candidate; its second run is recorded), poisoned outputs (tests), and any call whose launches use
a tensor that is neither one of its inputs, a buffer of the call nor a marked stand-in the
kernels never read (``ops.runtime.launch.unread_stand_in``): a derived tensor -- a copy of a view the
kernels cannot read in place, say -- must be recomputed each time. (int64 sequence ids are
converted to int32 before the call is keyed.) What reads values (the seq_idx checks) runs on
every call, replayed or not.
"""
import torch

# Replays of recent calls, by call key; the oldest goes first when full.
_REPLAYS = {}
CACHE_SIZE = 256

# The tensor types a replay takes as inputs (a model's A, D, dt_bias are parameters).
PLAIN = (torch.Tensor, torch.nn.Parameter)


def call_key(tensors, options):
    """What an eager call's launches depend on, or None for a call that is never replayed (one
    that needs a gradient, is traced, or has a tensor subclass). Per tensor: its shape, strides,
    dtype, device, which earlier argument it is (the same object), and its base address's
    16-byte alignment -- which decides whether a view is read in place
    (``ops.torch_op.as_kernel_input``), and a launch compiles other code for unaligned arrays.
    Built in one pass: it runs on every eager call."""
    if torch.compiler.is_compiling():
        return None
    grad = torch.is_grad_enabled()
    ids = [id(t) for t in tensors]
    parts = []
    for i, t in enumerate(tensors):
        if t is None:
            parts.append(None)
            continue
        if type(t) not in PLAIN or (grad and t.requires_grad):
            return None
        parts.append((t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16,
                      ids.index(ids[i])))
    return (tuple(parts), options)


def lookup(key, stamp):
    """The replay recorded for ``key`` under ``stamp`` (what else decides the launches: the
    autotuner in use); ``NEVER`` for a key whose calls were found not replayable (so they are
    not recorded again and again); else None (also for a key with an unhashable option)."""
    return lookup_in(_REPLAYS, key, stamp)


NEVER = "never"      # lookup's answer for calls that are not replayable


def lookup_in(cache, key, stamp):
    """``lookup`` in ``cache`` (this module's replays, or ``ops.runtime.tape``'s tapes): each
    entry has the ``stamp`` it was recorded under; NEVER for an unhashable key, too."""
    try:
        entry = cache.get(key)
    except TypeError:
        return NEVER
    if entry is None or entry.stamp is not stamp:
        return None
    return NEVER if isinstance(entry, _Never) else entry


def keep_in(cache, key, recorded, size):
    """Store ``recorded`` (a recording with ``stamp`` and ``usable``) in ``cache`` for ``key``,
    or, where it is not usable, a note that the key's calls are never replayed; the oldest entry
    goes first when the cache holds ``size``. An unhashable key is not stored."""
    try:
        hash(key)
    except TypeError:                                   # an unhashable option
        return
    if len(cache) >= size:
        try:
            cache.pop(next(iter(cache)), None)          # the oldest (another thread may too)
        except (RuntimeError, StopIteration):
            pass
    cache[key] = recorded if recorded.usable else _Never(recorded.stamp)


class Recording:
    """``with Recording(key, stamp, inputs) as rec:`` around a call records the launches that
    ``ops.runtime.launch.run`` makes; ``rec.keep(results)`` then stores them as a ``Replay`` for ``key``
    (if every tensor they use is an input, a buffer or a marked stand-in; else a note that the
    key is not replayable)."""

    def __init__(self, key, stamp, inputs):
        self.key, self.stamp, self.inputs = key, stamp, inputs
        self.plans = []

    def __enter__(self):
        from ops.runtime import launch      # cuda.tile: looking a call up needs none
        self._recorder = launch.RECORDER            # per thread
        self._outer = getattr(self._recorder, "plans", None)
        self._recorder.plans = self.plans
        return self

    def __exit__(self, *exc):
        self._recorder.plans = self._outer
        return False

    def keep(self, results):
        keep_in(_REPLAYS, self.key, Replay(self.plans, self.inputs, results, self.stamp),
                CACHE_SIZE)


class _Never:
    """A key's entry when its call was not replayable (under the tuner ``stamp``): a replay's
    or a tape's."""

    def __init__(self, stamp):
        self.stamp = stamp


def _restrides(t, inputs):
    """The position of the input that ``t`` is a restriding of (same first element, shape and
    dtype, other strides), or None; None too where two inputs would match, since the next call's
    inputs need not share their memory."""
    found = [j for j, inp in enumerate(inputs)
             if isinstance(inp, torch.Tensor) and inp.data_ptr() == t.data_ptr()
             and inp.shape == t.shape and inp.dtype == t.dtype and inp.device == t.device]
    return found[0] if len(found) == 1 else None


class Replay:
    """The launches of one call as (grid, kernel, argument indices) into a list made per call:
    the call's inputs, then the buffers it returns (fresh each call), its other buffers, inputs
    restrided as the call did, then the values kept as they were (scalars, constants, the
    stand-ins the kernels never read)."""

    def __init__(self, plans, inputs, results, stamp):
        from ops.runtime.launch import is_unread_stand_in
        self.stamp = stamp
        self.usable = bool(plans)
        where = {id(t): i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
        made = {}
        for plan in plans:
            for out in plan.outputs:
                if id(out) not in where:
                    made.setdefault(id(out), out)
        returned = [t for i, t in made.items() if i in {id(r) for r in results}]
        internal = [t for i, t in made.items() if i not in {id(r) for r in results}]
        for k, t in enumerate(returned + internal):
            where[id(t)] = len(inputs) + k
        spec = lambda ts: [(tuple(t.shape), t.dtype, t.device) for t in ts]
        self.returned, self.internal = spec(returned), spec(internal)
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        self.device = tensors[0].device if tensors else torch.device("cpu")
        # Small intermediates are kept from call to call on a GPU (``_internal_buffers``).
        self.keep_internal = self.device.type == "cuda" and sum(
            t.numel() * t.element_size() for t in internal) <= KEPT_BYTES
        # An input seen through other strides (its size-1 dimensions' made canonical), made
        # again from the new input each call: (input position, shape, strides).
        self.restrided = []
        first_view = len(inputs) + len(made)
        for plan in plans:
            for arg in plan.args:
                if isinstance(arg, torch.Tensor) and id(arg) not in where:
                    j = _restrides(arg, inputs)
                    if j is not None:
                        where[id(arg)] = first_view + len(self.restrided)
                        self.restrided.append((j, tuple(arg.shape), arg.stride()))
        values = []
        first_value = first_view + len(self.restrided)

        def index(arg):
            if isinstance(arg, torch.Tensor):
                if id(arg) in where:
                    return where[id(arg)]
                if not is_unread_stand_in(arg):         # derived from the inputs: not replayable
                    self.usable = False
            values.append(arg)
            return first_value + len(values) - 1

        self.launches = []
        for plan in plans:
            grid = (plan.grid,) if isinstance(plan.grid, int) else tuple(plan.grid)
            self.launches.append((grid, plan.kernel, tuple(index(a) for a in plan.args)))
        self.values = tuple(values)
        self.results = tuple(where.get(id(r)) for r in results)
        if any(i is None or i < len(inputs) for i in self.results):
            self.usable = False                         # a result must be a buffer of the call

    def _internal_buffers(self, stream):
        """The intermediates' buffers for a call on ``stream`` (a raw CUDA stream handle).

        Allocating a tensor costs about as much host time as a launch. Intermediates no
        caller sees (the processed dt, the cumsum, the entry states) are kept for the next
        call of the same replay on the same stream: the stream runs the calls in order, so the
        next call's kernels overwrite them only after this call's have read them. Kept only
        while small (``KEPT_BYTES``), for the latest replay per stream, and never inside a
        CUDA-graph capture (the graph would bake in buffers that eager calls then overwrite)."""
        if self.keep_internal and not torch.cuda.is_current_stream_capturing():
            kept = _KEPT.get(stream)
            if kept is not None and kept[0] is self:
                return kept[1]
            buffers = [torch.empty(s, dtype=d, device=v) for s, d, v in self.internal]
            _KEPT[stream] = (self, buffers)
            return buffers
        return [torch.empty(s, dtype=d, device=v) for s, d, v in self.internal]

    def run(self, inputs):
        """Launch the recorded kernels on ``inputs`` (tensors like the recorded call's, in the same
        positions) and new output buffers; returns the results."""
        fresh = [torch.empty(s, dtype=d, device=v) for s, d, v in self.returned]
        views = [inputs[j].as_strided(shape, strides) for j, shape, strides in self.restrided]
        if self.device.type == "cuda":
            handle = torch._C._cuda_getCurrentRawStream(self.device.index)
            slots = [*inputs, *fresh, *self._internal_buffers(handle), *views, *self.values]
            _launch_all(self.launches, slots.__getitem__, handle, self.device)
        else:
            from ops import interpreter
            slots = [*inputs, *fresh, *self._internal_buffers(None), *views, *self.values]
            for grid, kernel, index in self.launches:
                interpreter.launch(grid, kernel, tuple(map(slots.__getitem__, index)))
        return tuple(map(slots.__getitem__, self.results))


# Intermediates kept per stream: raw stream handle -> (the replay, its buffers).
_KEPT = {}
KEPT_BYTES = 4 << 20

# Whether ct.launch takes torch's raw stream handle (an int: no Stream object to build per call,
# which costs host time); None until the first launch has tried it.
_RAW_STREAM = None


def _launch_all(launches, pick, handle, device):
    for grid, kernel, index in launches:
        launch_on(handle, device, grid, kernel, tuple(map(pick, index)))


def launch_on(handle, device, grid, kernel, args):
    """``ct.launch`` on the stream whose raw handle is ``handle`` (torch's Stream object of
    ``device``'s current stream where ``ct.launch`` does not take the handle)."""
    global _RAW_STREAM
    import cuda.tile as ct
    if _RAW_STREAM is not False:
        try:
            ct.launch(handle, grid, kernel, args)
            _RAW_STREAM = True
            return
        except TypeError:
            if _RAW_STREAM:                             # a handle is taken: the error is the call's
                raise
            _RAW_STREAM = False                         # refused before anything ran
    ct.launch(torch.cuda.current_stream(device), grid, kernel, args)
