"""A training step's host work recorded once and replayed: the tape of its torch ops and launches.

An eager training step at small shapes is host time: at 1 x 4K x 80 heads the GPU runs a whole
step in well under a millisecond, but building the kernels' plans, resolving their configs,
checking their arguments and the PyTorch ops between them (partial sums, dtype conversions) took
longer (``tests/benchmark/results/host_time_h200.csv``; PERF_NOTES.md, "An eager training step
replays its first step's tape"). Every one of those decisions depends only on what
``ops.torch_op.replay_key`` sees: the tensors' shapes, strides, dtypes, devices and alignment, the
options and the autotuning mode. So a call's work is recorded once (``taped``, ``Tape``) as the
sequence it makes:

  * each PyTorch operator it dispatches (``torch.ops.aten.*``, seen below autograd by a
    ``TorchDispatchMode``), with its tensor arguments replaced by slots: the call's inputs or an
    earlier step's outputs;
  * each kernel launch (``ops.runtime.launch.run``), likewise; the torch ops the CPU interpreter
    runs inside a launch are the launch's, not the call's, and are not recorded;

and a later call with the same key replays that sequence on its own tensors (``Tape.run``): the
same operators on the new inputs and fresh buffers, the same kernels, and none of the Python
between them. An operator that changes no tensor and whose outputs nothing reads is dropped, and
every slot is released after its last reader, so a replay holds no tensor longer than the
recorded call did (the backward's ``del`` statements are honoured by construction).

A recording is kept only if the call can be replayed exactly (``Tape.usable``): every tensor its
steps read is an input, a step's output or a marked stand-in the kernels never read
(``ops.runtime.launch.unread_stand_in``); no operator returned a Python value (reading a tensor's
value on the host, ``.item()`` or ``bool()``, would make the steps depend on the values, not only
the key); and its results are tensors the steps made, or None. Otherwise the key is marked never
to be recorded again. Two things the tape cannot see are rules for what it records: a value read
without an operator (``.tolist()``, ``.numpy()``), and a module-level setting read during the call
(a tile size, a slice length): change one and ``clear()`` the tapes, or calls keep replaying what
the old setting made.
"""
import contextlib
import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ops.runtime.replay import NEVER, keep_in, launch_on, lookup_in

# Recorded calls by key; the oldest goes first when full.
_TAPES = {}
CACHE_SIZE = 256

_OP, _LAUNCH = 0, 1
_SLOT, _VALUE, _SEQUENCE = 0, 1, 2


def clear():
    """Forget every recorded call (after changing a setting the calls read: see above)."""
    _TAPES.clear()


def lookup(key, stamp):
    """The tape recorded for ``key`` under ``stamp`` (what else decides the steps: the autotuner
    in use), ``NEVER`` for a key whose call could not be replayed, else None."""
    return lookup_in(_TAPES, key, stamp)


def taped(key, stamp, fn, inputs, owned=False):
    """``fn(*inputs)`` (-> a tuple or list of tensors), replayed from the tape of an earlier call
    with ``key`` under ``stamp`` when there is one, else run and recorded for the next calls.
    ``key`` None: run, never recorded.

    ``owned``: ``inputs`` is a list handed over with its tensors (the caller holds no other
    reference to those it wants freed early). A replay empties it once its slots hold them, so
    that each is freed after its last reader; a call that runs is ``fn(inputs)``, with the list
    itself, for ``fn`` to empty as it takes what it frees early (``ops.torch_op``'s backward
    takes the forward's intermediates so)."""
    if owned and type(inputs) is not list:
        raise TypeError(f"owned inputs must be a list, got {type(inputs).__name__}")
    call = (lambda: fn(inputs)) if owned else (lambda: fn(*inputs))
    if key is None:
        return call()
    tape = lookup(key, stamp)
    if tape is NEVER:
        return call()
    if tape is not None:
        return tape.run(inputs, owned)
    tape = Tape(inputs, stamp)
    with tape.recording():
        results = call()
    tape.finish(results)
    keep_in(_TAPES, key, tape, CACHE_SIZE)
    return results


class _Recorder(TorchDispatchMode):
    """Sees every operator the recorded call dispatches (below autograd) and writes it down."""

    def __init__(self, tape):
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.tape.paused:
            self.tape._op(func, args, kwargs, out)
        return out


class Tape:
    """One call's steps: operators and launches, their tensors as slot numbers (the inputs first,
    then each new tensor a step made), and after each step the slots no later step reads."""

    def __init__(self, inputs, stamp):
        self.stamp = stamp
        self.usable = True
        self.paused = False
        self.steps = []
        self._ids = {}                  # id(tensor) -> (weak reference, slot)
        self.nslots = 0
        self.ninputs = len(inputs)
        for t in inputs:
            if isinstance(t, torch.Tensor):
                self._ids.setdefault(id(t), (weakref.ref(t), self.nslots))
            self.nslots += 1
        self.results = None

    # recording -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def recording(self):
        from ops.runtime import launch          # cuda.tile: only a recording call needs it
        outer = getattr(launch.RECORDER, "plans", None)
        launch.RECORDER.plans = self
        try:
            with _Recorder(self):
                yield self
        finally:
            launch.RECORDER.plans = outer

    @contextlib.contextmanager
    def pause(self):
        """Around a launch: the interpreter's own torch ops are not the call's."""
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused

    def _slot(self, t):
        entry = self._ids.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return None

    def _new_slot(self, t):
        slot = self.nslots
        self._ids[id(t)] = (weakref.ref(t), slot)
        self.nslots += 1
        return slot

    def _spec(self, value):
        """An argument as (kind, what): a slot, a value kept as it is, or a list of those."""
        from ops.runtime.launch import is_unread_stand_in
        if isinstance(value, torch.Tensor):
            if is_unread_stand_in(value):           # kept as it is (the op making it is dropped)
                return (_VALUE, value)
            slot = self._slot(value)
            if slot is None:                        # computed outside the call: not replayable
                self.usable = False
                return (_VALUE, value)
            return (_SLOT, slot)
        if isinstance(value, (list, tuple)) and _holds_tensor(value):
            return (_SEQUENCE, (type(value), tuple(self._spec(v) for v in value)))
        return (_VALUE, value)

    def _outputs(self, out):
        """The slots of an operator's outputs (one, or a tuple for a tuple of tensors)."""
        if isinstance(out, torch.Tensor):
            slot = self._slot(out)              # an in-place operator returns its argument
            return self._new_slot(out) if slot is None else slot
        if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
            return tuple(self._outputs(t) for t in out)
        if out is None:
            return None
        self.usable = False                     # a Python value read from a tensor
        return None

    def _op(self, func, args, kwargs, out):
        if not isinstance(func, torch._ops.OpOverload):
            self.usable = False
            return
        self.steps.append([_OP, func, tuple(self._spec(a) for a in args),
                           tuple((k, self._spec(v)) for k, v in kwargs.items()),
                           self._outputs(out), func._schema.is_mutable])

    def append(self, plan):
        """A launch ``ops.runtime.launch.run`` made (after the launches it needed)."""
        grid = (plan.grid,) if isinstance(plan.grid, int) else tuple(plan.grid)
        self.steps.append([_LAUNCH, grid, plan.kernel, tuple(self._spec(a) for a in plan.args)])

    def finish(self, results):
        """Close the recording: the results' slots, the steps no one needs dropped, and after
        each step the slots released."""
        specs = [(_VALUE, None) if r is None else self._spec(r) for r in results]
        if not all(kind == _SLOT and slot >= self.ninputs or (kind, slot) == (_VALUE, None)
                   for kind, slot in specs):
            self.usable = False
        self.results = tuple(slot for _, slot in specs)       # (None: a result that is None)
        self.result_type = type(results)
        self._ids = None
        if not self.usable:
            self.steps = []
            return
        self._drop_unread()
        self._release_after_last_read()
        self._compile()

    @staticmethod
    def _reads(step):
        specs = step[2] if step[0] == _OP else step[3]
        if step[0] == _OP:
            specs = specs + tuple(v for _, v in step[3])
        return _slots_in(specs)

    @staticmethod
    def _made(step):
        out = step[4] if step[0] == _OP else None
        return () if out is None else (out if isinstance(out, tuple) else (out,))

    def _drop_unread(self):
        """Operators that change no tensor and whose outputs nothing reads (the stand-ins'
        zeros, a view taken and not used) are dropped, last first; one that returns nothing is
        kept (a check, say: its effect is not an output)."""
        needed = set(self.results) - {None}
        kept = []
        for step in reversed(self.steps):
            if (step[0] == _OP and not step[5] and step[4] is not None
                    and not needed.intersection(self._made(step))):
                continue
            needed.update(self._reads(step))
            kept.append(step)
        self.steps = kept[::-1]

    def _release_after_last_read(self):
        last = {}
        for n, step in enumerate(self.steps):
            for slot in (*self._reads(step), *self._made(step)):
                last[slot] = n
        keep = set(self.results) - {None}
        # inputs no step reads (an owned one is then freed as the replay starts)
        self.unread = tuple(s for s in range(self.ninputs) if s not in last and s not in keep)
        released = [[] for _ in self.steps]
        for slot, n in last.items():
            if slot not in keep:
                released[n].append(slot)
        self.steps = [tuple(step) + (tuple(r),) for step, r in zip(self.steps, released)]

    def _compile(self):
        """Each step as the replay runs it: every argument a position in the call's list of
        slots, whose template holds the kept values after the call's own slots (one list
        indexing per argument, no per-argument branching); an argument list holding a sequence
        of tensors (rare) keeps its specs (a launch's in the place of an operator's outputs).
        An operator is called through its own Python binding where ``_fast_call`` has one
        (kept last in the step; the step's second item stays the operator, for readers)."""
        values = []

        def position(spec):
            kind, what = spec
            if kind == _SLOT:
                return what
            values.append(what)
            return self.nslots + len(values) - 1

        compiled = []
        for step in self.steps:
            if step[0] == _OP:
                _, func, args, kwargs, out, _, released = step
                specs = args + tuple(s for _, s in kwargs)
                if any(kind == _SEQUENCE for kind, _ in specs):
                    compiled.append((_OP, func, (args, kwargs), None, out, released, func))
                    continue
                fixed = {k: w for k, (kind, w) in kwargs if kind == _VALUE}
                taken = tuple((k, what) for k, (kind, what) in kwargs if kind == _SLOT)
                call = _fast_call(func, fixed) if not taken else None
                if call is None:
                    call = getattr(func, "_op", func)      # OpOverload.__call__ without its frame
                else:
                    fixed = {}
                compiled.append((_OP, func, (fixed, taken), tuple(position(a) for a in args),
                                 out, released, call))
            else:
                _, grid, kernel, args, released = step
                if any(kind == _SEQUENCE for kind, _ in args):      # kept as specs
                    compiled.append((_LAUNCH, grid, kernel, None, args, released, None))
                else:
                    compiled.append((_LAUNCH, grid, kernel, tuple(position(a) for a in args),
                                     None, released, None))
        self.steps = compiled
        self.template = [None] * self.nslots + values

    # replaying -------------------------------------------------------------------------------

    def run(self, inputs, owned=False):
        """The recorded call's steps on ``inputs`` (tensors like the recorded call's, in the same
        positions); returns its results, made afresh. ``owned``: ``inputs`` is a list handed
        over, emptied here (each input then lives until its last reader, as the recorded
        call's)."""
        slots = list(self.template)
        slots[:self.ninputs] = inputs
        if owned:
            inputs.clear()
        for slot in self.unread:
            slots[slot] = None
        device = next(t.device for t in slots if isinstance(t, torch.Tensor))  # (inputs first)
        launch = _launcher(device)
        pick = slots.__getitem__
        for kind, what, how, args, out, released, call in self.steps:
            if kind == _LAUNCH:
                if args is None:                    # a sequence of tensors among the arguments
                    launch(what, how, tuple(_arg(slots, s) for s in out))
                else:
                    launch(what, how, tuple(map(pick, args)))
            else:
                if args is None:                    # a sequence of tensors among the arguments
                    specs, kwargs = how
                    value = call(*[_arg(slots, s) for s in specs],
                                 **{k: _arg(slots, s) for k, s in kwargs})
                else:
                    fixed, taken = how
                    if taken:
                        fixed = {**fixed, **{k: slots[i] for k, i in taken}}
                    value = call(*map(pick, args), **fixed)
                if type(out) is int:
                    slots[out] = value
                elif out is not None:
                    for slot, t in zip(out, value):
                        slots[slot] = t
            for slot in released:
                slots[slot] = None
        return self.result_type(None if s is None else slots[s] for s in self.results)


# Operators called through their own Python bindings on replay ----------------------------------
#
# Calling an operator overload (``torch.ops.aten.empty.memory_format(size, dtype=...)``) converts
# its arguments through the operator's schema, generically: several microseconds more per call
# than the function PyTorch binds for it (``torch.empty``), whose argument parsing is generated.
# A tape replays mostly allocations, sums, conversions and views, so those few are replayed
# through their bindings, with the same arguments, where the recorded call used only what the
# binding means too (a strided, unpinned, contiguous allocation, say); any other call, and any
# other operator, is replayed through the overload itself.

def _allocation(function):
    """``function`` (``torch.empty``, ``Tensor.new_empty``) for an allocation whose keyword
    arguments say nothing but its dtype and device (strided, unpinned, contiguous)."""
    def fast(kwargs):
        plain = (kwargs.keys() <= {"dtype", "layout", "device", "pin_memory", "memory_format"}
                 and kwargs.get("layout") in (None, torch.strided)
                 and not kwargs.get("pin_memory")
                 and kwargs.get("memory_format") in (None, torch.contiguous_format))
        return (functools.partial(function, dtype=kwargs.get("dtype"),
                                  device=kwargs.get("device")) if plain else None)
    return fast


def _fast_to_copy(kwargs):
    if kwargs.keys() != {"dtype"}:
        return None
    dtype = kwargs["dtype"]
    return lambda t: t.to(dtype, copy=True)       # a copy in that dtype, strides preserved


def _with_kwargs(function, allowed):
    return lambda kwargs: (functools.partial(function, **kwargs) if kwargs.keys() <= allowed
                           else None)


_FAST = {}


def _fast_call(func, kwargs):
    """A callable equal to ``func(*args, **kwargs)`` for every ``args``, through a faster
    binding, or None (then the overload is called)."""
    if not _FAST:
        aten = torch.ops.aten
        _FAST.update({
            aten.empty.memory_format: _allocation(torch.empty),
            aten.new_empty.default: _allocation(torch.Tensor.new_empty),
            aten._to_copy.default: _fast_to_copy,
            aten.sum.dim_IntList: _with_kwargs(torch.sum, {"dtype"}),
            aten.select.int: _with_kwargs(torch.select, set()),
            aten.add_.Tensor: _with_kwargs(torch.Tensor.add_, {"alpha"}),
            aten.clone.default: _with_kwargs(torch.clone, {"memory_format"}),
        })
    fast = _FAST.get(func)
    return None if fast is None else fast(kwargs)


def _holds_tensor(value):
    return any(isinstance(v, torch.Tensor)
               or (isinstance(v, (list, tuple)) and _holds_tensor(v)) for v in value)


def _slots_in(specs):
    for kind, what in specs:
        if kind == _SLOT:
            yield what
        elif kind == _SEQUENCE:
            yield from _slots_in(what[1])


def _arg(slots, spec):
    kind, what = spec
    if kind == _SLOT:
        return slots[what]
    if kind == _VALUE:
        return what
    seq_type, specs = what
    return seq_type(_arg(slots, s) for s in specs)


def _launcher(device):
    if device.type == "cuda":
        handle = torch._C._cuda_getCurrentRawStream(device.index)
        return lambda grid, kernel, args: launch_on(handle, device, grid, kernel, args)
    from ops.runtime import launch as launch_module   # the interpreter, as any CPU launch
    return lambda grid, kernel, args: launch_module.launch(grid, kernel, args)
