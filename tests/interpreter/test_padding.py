"""Undetermined padding: what elements of a partial tile past the array read as.

``PaddingMode.UNDETERMINED`` is every load's default, and cuTile promises nothing for those
elements. The interpreter pads them with NaN (integers: their most negative value), so a result
that depends on them shows. ``launch(..., undetermined_padding="gpu")`` (or
``MAMBA2_CUTILE_UNDETERMINED_PADDING=gpu``) reads them as an H200 did instead, the bit pattern of
the integer 1, and warns once per kernel line. The ``gpu`` tests measure that on the GPU: a 1-D
partial tile of an array that is a slice of a larger buffer (so what lies past the array is
known: sevens), loaded by ``ct.load`` (TMA and not) and ``TiledView.load``, in five dtypes.
"""
import math
import warnings

import cuda.tile as ct
import pytest
import torch

from ops import interpreter
from ops.interpreter import UndeterminedPaddingWarning
from ops.runtime.launch import launch
from tests.interpreter.helpers import attention_default_padding, poisoned, randn

ConstInt = ct.Constant[int]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int8]
BITS = {4: torch.int32, 2: torch.int16, 1: torch.int8}


@ct.kernel
def copy_tiles(a, out, T: ConstInt):
    t = ct.load(a, (ct.bid(0),), (T,))
    ct.store(out, (ct.bid(0),), t)


@ct.kernel
def copy_tiles_no_tma(a, out, T: ConstInt):
    t = ct.load(a, (ct.bid(0),), (T,), allow_tma=False)
    ct.store(out, (ct.bid(0),), t)


@ct.kernel
def copy_tiles_of_view(a, out, T: ConstInt):
    t = a.tiled_view((T,)).load((ct.bid(0),))
    ct.store(out, (ct.bid(0),), t)


KERNELS = [copy_tiles, copy_tiles_no_tma, copy_tiles_of_view]
KERNEL_IDS = ["load", "load-no-tma", "tiled-view-load"]


def sliced(n, dtype, device, past=7):
    """(a, its buffer): a = buffer[:n], 1..n, and `past` in the buffer beyond it."""
    buffer = torch.full((4 * n,), past, dtype=dtype, device=device)
    buffer[:n] = (torch.arange(n, device=device) + 1).to(dtype)
    return buffer[:n], buffer


def bits(t):
    return t.view(BITS[t.element_size()])


def copy(kernel, dtype, device, **launch_options):
    n, T = 20, 16                           # the second tile holds 4 elements and 12 of padding
    a, _ = sliced(n, dtype, device)
    out = poisoned(2 * T, dtype=dtype).to(device)
    if device == "cpu":
        interpreter.launch((2,), kernel, (a, out, T), **launch_options)
    else:
        launch((2,), kernel, (a, out, T))
        torch.cuda.synchronize()
    return out.cpu(), n


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_default_reads_nan_or_the_most_negative_integer(kernel, dtype):
    out, n = copy(kernel, dtype, "cpu")
    assert torch.equal(out[:n], (torch.arange(n) + 1).to(dtype))
    if dtype.is_floating_point:
        assert out[n:].isnan().all()
    else:
        assert (out[n:] == torch.iinfo(dtype).min).all()


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_mode_reads_the_bit_pattern_of_one_and_warns(kernel, dtype):
    with pytest.warns(UndeterminedPaddingWarning, match=r"test_padding.py:\d+ in copy_tiles"):
        out, n = copy(kernel, dtype, "cpu", undetermined_padding="gpu")
    assert torch.equal(out[:n], (torch.arange(n) + 1).to(dtype))
    assert (bits(out[n:]) == 1).all()


def test_the_warning_names_each_line_once():
    """One warning per kernel line that reads padding, however many blocks and loads run it."""

    @ct.kernel
    def two_loads(a, out, T: ConstInt):
        first = ct.load(a, (ct.bid(0),), (T,))
        second = ct.load(a, (ct.bid(0),), (T,))
        ct.store(out, (ct.bid(0),), first + second)

    a, _ = sliced(40, torch.float32, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")        # Python's own: once per distinct message
        for _ in range(2):
            interpreter.launch((3,), two_loads, (a, torch.zeros(48), 16),
                               undetermined_padding="gpu")
    lines = sorted(str(w.message).split(":")[1].split()[0] for w in caught
                   if issubclass(w.category, UndeterminedPaddingWarning))
    assert len(lines) == 2 and lines[0] != lines[1]


def test_whole_tiles_and_other_padding_modes_do_not_warn():
    a = torch.arange(32, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UndeterminedPaddingWarning)
        interpreter.launch((2,), copy_tiles, (a, torch.zeros(32), 16),
                           undetermined_padding="gpu")

        @ct.kernel
        def zero_padded(a, out, T: ConstInt):
            ct.store(out, (ct.bid(0),), ct.load(a, (ct.bid(0),), (T,),
                                                padding_mode=ct.PaddingMode.ZERO))

        out = torch.full((32,), math.nan)
        interpreter.launch((2,), zero_padded, (a[:20], out, 16), undetermined_padding="gpu")
    assert (out[20:] == 0).all()


def test_advanced_indexing_load_follows_the_mode():
    @ct.kernel
    def take_rows(a, out, T: ConstInt):
        rows = ct.arange(T, dtype=ct.int32)              # rows 10..15 lie past the array
        ct.store(out, (0, 0), ct.load_advanced_indexing(a, (rows, ct.Slice(0, 4))))

    a = torch.arange(1, 41, dtype=torch.float32).reshape(10, 4)
    out = torch.zeros(16, 4)
    interpreter.launch((1,), take_rows, (a, out, 16))
    assert out[10:].isnan().all()
    with pytest.warns(UndeterminedPaddingWarning, match="load_advanced_indexing"):
        interpreter.launch((1,), take_rows, (a, out, 16), undetermined_padding="gpu")
    assert (bits(out[10:]) == 1).all() and torch.equal(out[:10], a)


def test_the_environment_variable_sets_the_mode(monkeypatch):
    a, _ = sliced(20, torch.float32, "cpu")
    out = torch.zeros(32)
    monkeypatch.setenv("MAMBA2_CUTILE_UNDETERMINED_PADDING", "gpu")
    with pytest.warns(UndeterminedPaddingWarning):
        launch((2,), copy_tiles, (a, out, 16))        # ops.runtime.launch: CPU tensors, the interpreter
    assert (bits(out[20:]) == 1).all()
    monkeypatch.setenv("MAMBA2_CUTILE_UNDETERMINED_PADDING", "nan")
    launch((2,), copy_tiles, (a, out, 16))
    assert out[20:].isnan().all()
    # an explicit launch option wins over the environment
    with pytest.warns(UndeterminedPaddingWarning):
        interpreter.launch((2,), copy_tiles, (a, out, 16), undetermined_padding="gpu")


@pytest.mark.parametrize("value", ["zero", "NaN", ""])
def test_unknown_modes_are_refused(monkeypatch, value):
    a = torch.arange(20, dtype=torch.float32)
    with pytest.raises(ValueError, match="undetermined_padding .* must be one of"):
        interpreter.launch((2,), copy_tiles, (a, torch.zeros(32), 16),
                           undetermined_padding=value or "off")
    monkeypatch.setenv("MAMBA2_CUTILE_UNDETERMINED_PADDING", value or "off")
    with pytest.raises(ValueError, match="MAMBA2_CUTILE_UNDETERMINED_PADDING"):
        interpreter.launch((2,), copy_tiles, (a, torch.zeros(32), 16))


# An attention kernel as often written (`attention_default_padding`, in helpers.py): it loads the
# last, partial key tile with the default padding and relies on the padded values being finite.

def attention_problem():
    S, D, B = 40, 16, 16                  # 40 keys: the last key tile holds 8 and 8 of padding
    q, k, v = (randn(S, D, seed=20 + i) for i in range(3))
    scale = 1 / math.sqrt(D)
    ref = torch.softmax(q.double() @ k.double().T * scale, dim=-1) @ v.double()
    return [q, k, v, poisoned(S, D), scale, B, B, D], (S + B - 1) // B, ref


def test_attention_relying_on_undetermined_padding():
    """NaN by default (the interpreter's strictness shows the reliance); right with "gpu", with a
    warning naming the three loads (q, k, v). Tolerance as tests/interpreter/test_foreign_kernels.py's
    attention: float32 throughout, 2e-5."""
    args, blocks, ref = attention_problem()
    o = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    interpreter.launch((blocks,), attention_default_padding, o)
    assert o[3].isnan().any()
    o = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        interpreter.launch((blocks,), attention_default_padding, o, undetermined_padding="gpu")
    where = {str(w.message).split(": ")[0] for w in caught
             if issubclass(w.category, UndeterminedPaddingWarning)}
    assert len(where) == 3 and all("attention_default_padding" in w for w in where)
    torch.testing.assert_close(o[3].double(), ref, rtol=0, atol=2e-5)


# On the GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_undetermined_padding_is_what_gpu_mode_reads(kernel, dtype):
    """What the GPU returns for a 1-D partial tile's padding (what lies past the array: sevens),
    bit for bit the interpreter's "gpu" mode."""
    gpu, n = copy(kernel, dtype, "cuda")
    with pytest.warns(UndeterminedPaddingWarning):
        cpu, _ = copy(kernel, dtype, "cpu", undetermined_padding="gpu")
    assert torch.equal(bits(gpu), bits(cpu)), (bits(gpu[n:]).tolist(), bits(cpu[n:]).tolist())


@pytest.mark.gpu
def test_gpu_attention_relying_on_undetermined_padding():
    """The same kernel on the GPU: right (2-D padded tiles read small finite values there), and
    equal to the interpreter's "gpu" mode to float32 rounding (2e-5, as above)."""
    args, blocks, ref = attention_problem()
    o = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    launch((blocks,), attention_default_padding, o)
    torch.cuda.synchronize()
    torch.testing.assert_close(o[3].cpu().double(), ref, rtol=0, atol=2e-5)
