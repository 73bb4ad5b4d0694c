"""ops.tools.source: a kernel's source with the branches its constants rule out left out.

Faithfulness is checked by running: the specialised text is compiled back into a kernel (in the
module's namespace, so it calls the same helpers) and launched through the interpreter on the
same inputs as the original kernel; the outputs must be bitwise equal. The text rules are
checked on small functions whose expected output is written out by hand.
"""
import ast
import inspect
import textwrap

import pytest
import torch

import cuda.tile as ct

from ops.kernels import chunk_cumsum as cumsum_mod
from ops.kernels import compute_out as out_mod
from ops.kernels import fwd_pass_state as state_mod
from ops.forward import KERNELS
from ops.runtime.launch import launch
from ops.tools.source import function_of, launch_constants, source_diff, specialised_source
from tests.kernels import helpers as kh

# A helper in the style of the kernels' helpers (never launched: only its text is read).
LAT_MAX = 10


def latency_hint(n):
    return n or None


def sample_helper(t, dtype, SWAP, HB, LOAD_LAT, MODE):
    NK = HB * 2
    if SWAP:
        t = ct.transpose(t)             # transposed
    elif HB == 1:
        t = ct.reshape(t, (4, 4))
    else:
        t = ct.reshape(t, (HB, 4, 4))
    if NK == 2:
        t = t + 1
    if dtype == ct.float16:             # not a constant: kept
        t = t * 2
    shape = (4, 4) if HB == 1 else (HB, 4, 4)
    t = ct.load(t, (0, 0), shape=shape, padding_mode=ct.PaddingMode.ZERO,
                latency=latency_hint(LOAD_LAT))
    if MODE == "a" and not SWAP:
        t = t - 1
    return t


def test_branches_expressions_and_hints_follow_the_constants():
    text = specialised_source(sample_helper, dict(SWAP=False, HB=1, LOAD_LAT=0, MODE="a"),
                              header=False)
    assert text == textwrap.dedent('''\
        def sample_helper(t, dtype, SWAP, HB, LOAD_LAT, MODE):
            NK = HB * 2
            t = ct.reshape(t, (4, 4))
            t = t + 1
            if dtype == ct.float16:             # not a constant: kept
                t = t * 2
            shape = (4, 4)
            t = ct.load(t, (0, 0), shape=shape, padding_mode=ct.PaddingMode.ZERO)
            t = t - 1
            return t
        ''')


def test_the_other_branches():
    text = specialised_source(sample_helper, dict(SWAP=True, HB=2, LOAD_LAT=3), header=False)
    # MODE unknown: its test stays, whole; SWAP's elif chain reduces to its first branch.
    assert "t = ct.transpose(t)             # transposed" in text
    assert "reshape" not in text                         # both reshaping branches are gone
    assert "t = t + 1" not in text                       # NK = 4, derived from HB
    assert "latency=latency_hint(LOAD_LAT)" in text      # a real hint is kept
    assert "MODE" not in text.split("return")[0].split("shape =")[1]   # `... and not SWAP`: false
    assert "t = t - 1" not in text
    ast.parse(text)
    text = specialised_source(sample_helper, dict(SWAP=False, HB=2, LOAD_LAT=3), header=False)
    assert "    if MODE == \"a\":\n        t = t - 1\n" in text      # MODE decides; `not SWAP` is true


def flag_helper(t, FLAG, c):
    if FLAG or c > 0:
        t = t + 1
    if FLAG and c > 0:
        t = t * 2
    if not FLAG or c > 1:
        t = t - 3
    if abs(c) > 2 or FLAG:          # a call: its text is never dropped
        t = t + 5
    return t


def test_and_or_not_decided_by_one_known_operand():
    """``or`` with an operand known true is taken, ``and`` with one known false is not, whatever
    the other operands, when those are plain expressions (a call keeps its test); a test left
    undecided loses the operands that change nothing."""
    assert specialised_source(flag_helper, dict(FLAG=True), header=False) == textwrap.dedent('''\
        def flag_helper(t, FLAG, c):
            t = t + 1
            if c > 0:
                t = t * 2
            if c > 1:
                t = t - 3
            if abs(c) > 2 or FLAG:          # a call: its text is never dropped
                t = t + 5
            return t
        ''')
    assert specialised_source(flag_helper, dict(FLAG=False), header=False) == textwrap.dedent('''\
        def flag_helper(t, FLAG, c):
            if c > 0:
                t = t + 1
            t = t - 3
            if abs(c) > 2:          # a call: its text is never dropped
                t = t + 5
            return t
        ''')
    # an operand that is itself an or/and keeps its parentheses beside another
    text = specialised_source(mixed, dict(F=False), header=False)
    assert "if (G or v > 9) and v > 1:" in text


def test_an_elif_chain_becomes_an_if():
    text = specialised_source(sample_helper, dict(SWAP=False), header=False)
    assert "    if HB == 1:\n        t = ct.reshape(t, (4, 4))\n    else:" in text
    assert "elif" not in text
    ast.parse(text)


def test_header_names_the_values_and_unknown_names_are_ignored():
    text = specialised_source(sample_helper, dict(SWAP=False, NOT_A_PARAMETER=1))
    assert text.startswith("# as compiled for a call with SWAP=False\n")
    assert specialised_source(sample_helper).startswith("# as compiled for a call with no constants")
    kernel_text = specialised_source(cumsum_mod.chunk_cumsum_kernel, {"LOAD_LAT": 0}, index64=True)
    assert kernel_text.startswith("# as compiled with LOAD_LAT=0, 64-bit indices\n")


def test_refuses_what_is_not_a_function():
    with pytest.raises(TypeError, match="expected a @ct.kernel or a function, got int"):
        specialised_source(42)


def test_int64_annotations_dropped_with_their_comments_in_column():
    text = specialised_source(cumsum_mod.chunk_cumsum_kernel, index64=False, header=False)
    assert "IndexedWithInt64" not in text
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith("dt,"))
    original = next(ln for ln in inspect.getsource(function_of(cumsum_mod.chunk_cumsum_kernel))
                    .splitlines() if ln.lstrip().startswith("dt:"))
    assert line.index("#") == original.index("#")
    assert "IndexedWithInt64" in specialised_source(cumsum_mod.chunk_cumsum_kernel, header=False)


def test_launch_constants_are_the_constant_parameters():
    plan = kh.small_plan("chunk_cumsum", None)
    assert launch_constants(plan) == dict(CHUNK=64, BLOCK_H=8, HAS_DT_BIAS=True,
                                          DT_SOFTPLUS=True, LOAD_LAT=0, STORE_LAT=0)


def test_source_diff_shows_a_knob_as_a_code_change():
    diff = source_diff(state_mod.chunk_inputs, {"LOAD_LAT": 0}, {"LOAD_LAT": 8})
    removed = [ln for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    added = [ln for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert diff.startswith("--- chunk_inputs LOAD_LAT=0\n+++ chunk_inputs LOAD_LAT=8\n")
    assert sum("latency=latency_hint(LOAD_LAT)" in ln for ln in added) == 2 and removed


def _configs(module):
    shape = kh.variant_shape(torch.float32)
    return module.search_space(**shape)


@pytest.mark.parametrize("name", list(KERNELS))
def test_every_config_specialises_to_valid_python(name):
    module = KERNELS[name]
    helpers = [f for _, f in inspect.getmembers(module, inspect.isfunction)
               if f.__module__ == module.__name__]
    for cfg in _configs(module):
        plan = kh.small_plan(name, cfg)
        constants = launch_constants(plan)
        constants["HB"] = constants.get("HEADS_PER_BLOCK", 1)
        ast.parse(specialised_source(plan))
        for helper in helpers:
            ast.parse(specialised_source(helper, constants))


def _run(plan, kernel):
    for out in plan.outputs:
        out.fill_(float("nan"))
    launch(plan.grid, kernel, plan.args)
    return [out.clone() for out in plan.outputs]


def _specialised_kernel(plan, helpers=()):
    """The plan's kernel rebuilt from its specialised text (and ``helpers`` from theirs), in a
    copy of its module's namespace."""
    f = function_of(plan.kernel)
    constants = launch_constants(plan)
    constants["HB"] = constants.get("HEADS_PER_BLOCK", 1)
    namespace = dict(f.__globals__)
    for helper in helpers:
        exec(compile(specialised_source(helper, constants, header=False), "<helper>", "exec"),
             namespace)
    text = specialised_source(plan, header=False).replace("@ct.kernel\n", "", 1)
    exec(compile(text, "<specialised>", "exec"), namespace)
    return ct.kernel(namespace[f.__name__])


def _plans(dtype_name):
    kw, dt_out, dA, entry = kh.problem(dtype_name, "cpu")
    dt = kw["dt"]
    yield "chunk_cumsum", lambda cfg: cumsum_mod.chunk_cumsum_plan(
        dt, kw["A"], kh.VARIANT_CHUNK, dt_bias=kw["dt_bias"], config=cfg, **kh.OPTIONS)
    yield "fwd_pass_state", lambda cfg: state_mod.fwd_pass_state_plan(
        kw["x"], kw["B"], dt_out, dA, kw["initial_states"], kw["seq_idx"],
        states_dtype=kw["x"].dtype, config=cfg)
    yield "compute_out", lambda cfg: out_mod.compute_out_plan(
        kw["x"], kw["B"], kw["C"], dt_out, dA, entry, D=kw["D"], z=kw["z"],
        seq_idx=kw["seq_idx"], config=cfg)


# Configs whose constants flip a branch somewhere (the default, and one or two variants each).
FLIPS = {"chunk_cumsum": [None, {"LOAD_LAT": 3}],
         "fwd_pass_state": [None, {"SWAP": True}, {"CHUNKS_PER_ITER": 2, "BLOCK_N": 32}],
         "compute_out": [None, {"SWAP": True}, {"HEADS_PER_BLOCK": 2}, {"DSTATE_TILE": 32},
                         {"PERSISTENT": True}]}


@pytest.mark.parametrize("name", list(KERNELS))
def test_specialised_kernel_computes_what_the_kernel_computes(name):
    """Bitwise equal outputs, for each config of FLIPS. With the default config the module's
    helpers are specialised too: there every helper's constant parameters take the kernel's
    values at every call (with SWAP, compute_out's load_tokens is also called with SWAP=False,
    so only the kernel is rebuilt)."""
    module = KERNELS[name]
    make_plan = dict(_plans("fp32"))[name]
    helpers = [f for _, f in inspect.getmembers(module, inspect.isfunction)
               if f.__module__ == module.__name__ and not f.__name__.endswith(
                   ("_plan", "_config", "search_space", name))
               and any(p.isupper() for p in inspect.signature(f).parameters)]
    for cfg in FLIPS[name]:
        plan = make_plan(cfg)
        expected = _run(plan, plan.kernel)
        kernel = _specialised_kernel(plan, helpers if cfg is None else ())
        got = _run(plan, kernel)
        for e, g in zip(expected, got, strict=True):
            assert not e.isnan().any() and torch.equal(e, g), (name, cfg)


# Running the text ------------------------------------------------------------------------------
# Plain-Python functions in the kernels' style, with every construct the tool edits. For every
# choice of which constants are known and every value of all of them, the specialised text,
# executed, must return what the function returns.

def chain(v, A, K, J):
    if A:
        v = v + 1
    elif K:
        v = v * 2
        if J:                       # nested, inside an elif
            v = v - 3
        elif A == K:
            v = v + 100
    elif J:
        v = -v
    else:
        v = v + 7
    w = v if K else -v
    if K and not J:
        pass
    else:
        w = w * 5
    return v, w


def with_derived(v, HB, SWAP):
    NK = HB * 2
    if NK == 2:
        v = v + 1
    for _ in range(2):
        if SWAP:
            v = v * 3
    shape = (4, 4) if HB == 1 else (HB, 4, 4)
    return v, shape


def reassigned(v, HB, SWAP):
    if SWAP:
        HB = 1                      # HB is no longer the caller's value below
    if HB == 1:
        v = v + 10
    return v


def call_with_hint(v, LAT, FLAG):
    def op(a, padding=0, latency=None):
        return (a, padding, latency)
    r = op(v, padding=1, latency=latency_hint(LAT))
    if FLAG:
        r = op(v,
               latency=latency_hint(LAT))
    return r


def mixed(v, F, G):
    if F or v > 4:                  # v is not a constant: or/and decided by F and G alone
        v = v + 1
    if F and G:
        v = v * 2
    if not F and v > 5:
        v = v - 3
    if abs(v) > 2 or F:
        v = v + 10
    if (G or v > 9) and v > 1 and not F:
        v = v * 3
    w = v if (G or v < 0) else -v
    return v, w


TOYS = {chain: dict(A=(False, True), K=(False, True), J=(False, True)),
        mixed: dict(F=(False, True), G=(False, True)),
        with_derived: dict(HB=(1, 2), SWAP=(False, True)),
        reassigned: dict(HB=(1, 2), SWAP=(False, True)),
        call_with_hint: dict(LAT=(0, 3), FLAG=(False, True))}


@pytest.mark.parametrize("fn", list(TOYS), ids=lambda f: f.__name__)
def test_specialised_text_runs_like_the_function(fn):
    import itertools
    domains = TOYS[fn]
    names = list(domains)
    for values in itertools.product(*domains.values()):
        full = dict(zip(names, values))
        expected = fn(5, **full)
        for r in range(len(names) + 1):
            for known_names in itertools.combinations(names, r):
                known = {k: full[k] for k in known_names}
                text = specialised_source(fn, known, header=False)
                namespace = dict(globals())
                exec(compile(text, "<specialised>", "exec"), namespace)
                assert namespace[fn.__name__](5, **full) == expected, (fn.__name__, known, text)


def test_undecided_chains_keep_their_elifs():
    # A unknown: the chain stays as written (its elif K is not decided on its own), while the
    # expression and the if after it, which test only K and J, are.
    text = specialised_source(chain, {"K": True}, header=False)
    original = textwrap.dedent(inspect.getsource(chain))
    assert text.split("    w = ")[0] == original.split("    w = ")[0]
    assert "    w = v\n" in text
    text = specialised_source(chain, {"A": False, "K": False}, header=False)
    assert "    if J:\n        v = -v\n    else:\n        v = v + 7" in text


def test_layouts_it_does_not_edit_are_left_as_written():
    def one_liners(v, K):
        if K: v = v + 1
        if K:
            v = v * 2
        else: v = v - 1
        return v
    text = specialised_source(one_liners, {"K": True}, header=False)
    assert text == textwrap.dedent(inspect.getsource(one_liners))
