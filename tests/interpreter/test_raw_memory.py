"""Raw memory (ops/interpreter/rawmemory.py), static_iter and grid dependency control.

Expected values come from plain torch on the flat storage of the arrays.
The ``gpu`` tests run the same kernels with ``ct.launch`` and are skipped
without a CUDA GPU.
"""
import cuda.tile as ct
import pytest
import torch

from ops import interpreter
from ops.interpreter import KernelTypeError, KernelValueError
from tests.interpreter.helpers import on_gpu_and_cpu, poisoned, randint, randn


@ct.kernel
def gather_offsets(x, offsets, out, T: ct.Constant[int]):
    off = ct.load(offsets, (ct.bid(0),), (T,))
    raw = x.get_raw_memory()
    tile = raw.load_offset(off, mask=off >= 0, padding_value=-1.5)
    ct.store(out, (ct.bid(0),), tile)


@ct.kernel
def scatter_offsets(x, offsets, values, T: ct.Constant[int]):
    off = ct.load(offsets, (ct.bid(0),), (T,))
    v = ct.load(values, (ct.bid(0),), (T,))
    x.get_raw_memory().store_offset(off, v, mask=off >= 0)


@ct.kernel
def histogram_offsets(values, counts, old_out, T: ct.Constant[int]):
    v = ct.load(values, (ct.bid(0),), (T,))
    old = counts.get_raw_memory().atomic_add_offset(v, 1, mask=v < counts.shape[0])
    ct.store(old_out, (ct.bid(0),), old)


@ct.kernel
def transpose_by_offsets(x, out, M: ct.Constant[int], N: ct.Constant[int]):
    # out[j, i] = x[i, j], addressing both 2-d arrays through element offsets.
    i = ct.arange(M, dtype=ct.int32)[:, None]
    j = ct.arange(N, dtype=ct.int32)[None, :]
    tile = x.get_raw_memory().load_offset(i * N + j)
    out.get_raw_memory().store_offset(j * M + i, tile)


@ct.kernel
def claim_offsets(owner, T: ct.Constant[int]):
    slots = ct.arange(T, dtype=ct.int32)
    owner.get_raw_memory().atomic_cas_offset(slots, -1, ct.bid(0))


def test_load_offset_gathers_flat_elements_with_padding():
    x = randn(64, seed=1)
    offsets = randint(40, low=-5, high=64, seed=2)
    out = poisoned(40)
    interpreter.launch(5, gather_offsets, (x, offsets, out, 8))
    expected = torch.where(offsets >= 0, x[offsets.clamp(min=0).long()], torch.tensor(-1.5))
    assert torch.equal(out, expected)


def test_store_offset_scatters_and_masks():
    x = poisoned(64)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    offsets = torch.where(torch.arange(64) % 5 == 0, -1, perm).to(torch.int32)
    values = randn(64, seed=4)
    interpreter.launch(8, scatter_offsets, (x, offsets, values, 8))
    expected = poisoned(64)
    keep = offsets >= 0
    expected[offsets[keep].long()] = values[keep]
    torch.testing.assert_close(x, expected, rtol=0, atol=0, equal_nan=True)


def test_store_offset_lanes_storing_one_value_to_one_element_are_fine():
    @ct.kernel
    def halves(x):
        lanes = ct.arange(8, dtype=ct.int32)
        x.get_raw_memory().store_offset(lanes // 2, (lanes // 2) * 10)   # pairs of equal values

    x = randint(4, dtype=torch.int32)
    interpreter.launch((1,), halves, (x,))
    assert x.tolist() == [0, 10, 20, 30]


def test_atomic_add_offset_counts_and_returns_old_values():
    values = randint(64, low=0, high=12, seed=5)  # 10, 11 are masked off
    counts = torch.zeros(10, dtype=torch.int32)
    old = poisoned(64, dtype=torch.int32)
    interpreter.launch(4, histogram_offsets, (values, counts, old, 16))
    kept = values[values < 10].long()
    assert torch.equal(counts, torch.bincount(kept, minlength=10).to(torch.int32))
    # Lanes applied in launch (C) order: old value = how many earlier lanes hit the bin.
    for lane in range(64):
        v = int(values[lane])
        if v < 10:
            assert int(old[lane]) == int((values[:lane] == v).sum())
        else:
            assert int(old[lane]) == torch.iinfo(torch.int32).min


def test_offsets_ignore_shape_and_reach_the_gaps_of_strided_views():
    x = randn(8, 16, seed=6)
    out = poisoned(16, 8)
    interpreter.launch(1, transpose_by_offsets, (x, out, 8, 16))
    assert torch.equal(out, x.T)
    # A column view: element offsets run through the storage (row stride 16).
    base = randn(8, 16, seed=7)
    col = base[:, 3]
    got = []

    @ct.kernel
    def probe(a):
        got.append(a.get_raw_memory().load_offset(ct.arange(8, dtype=ct.int32) * 16))

    interpreter.launch(1, probe, (col,))
    assert torch.equal(got[0]._t, base[:, 3])


def test_sliced_array_moves_the_base_pointer():
    x = torch.arange(16, dtype=torch.int32)
    got = []

    @ct.kernel
    def probe(a):
        raw = a.slice(0, 4, 12).get_raw_memory()
        got.append(raw.atomic_xchg_offset(ct.arange(4, dtype=ct.int32), 100))

    interpreter.launch(1, probe, (x,))
    assert got[0]._t.tolist() == [4, 5, 6, 7]
    assert x[4:8].tolist() == [100] * 4 and x[:4].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("name,ref", [
    ("max", torch.maximum), ("min", torch.minimum), ("and", torch.bitwise_and),
    ("or", torch.bitwise_or), ("xor", torch.bitwise_xor), ("xchg", lambda a, b: b)])
def test_every_rmw_offset_matches_torch(name, ref):
    x = randint(16, seed=8, dtype=torch.int64)
    update = randint(16, seed=9, dtype=torch.int64)
    before, got = x.clone(), []

    @ct.kernel
    def probe(a, u):
        t = ct.load(u, (0,), (16,))
        fn = getattr(a.get_raw_memory(), f"atomic_{name}_offset")
        got.append(fn(ct.arange(16, dtype=ct.int32), t))

    interpreter.launch(1, probe, (x, update))
    assert torch.equal(got[0]._t, before)
    assert torch.equal(x, ref(before, update))


def test_atomic_cas_offset_first_block_wins_and_masked_lanes_return_expected():
    owner = torch.full((8,), -1, dtype=torch.int32)
    interpreter.launch(3, claim_offsets, (owner, 8))
    assert owner.tolist() == [0] * 8
    x = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    got = []

    @ct.kernel
    def probe(a):
        off = ct.arange(4, dtype=ct.int32)
        got.append(a.get_raw_memory().atomic_cas_offset(off, 0, 42, mask=off < 3))

    interpreter.launch(1, probe, (x,))
    assert got[0]._t.tolist() == [0, 1, 0, 0]  # lane 3 is masked off: its expected, 0
    assert x.tolist() == [42, 1, 42, 1]


def test_float16_atomic_add_offset_rounds_each_addition():
    x = torch.zeros(1, dtype=torch.float16)
    update = randn(32, dtype=torch.float16, seed=10)

    @ct.kernel
    def probe(a, u):
        t = ct.load(u, (0,), (32,))
        a.get_raw_memory().atomic_add_offset(ct.zeros((32,), dtype=ct.int32), t)

    interpreter.launch(1, probe, (x, update))
    expected = torch.zeros((), dtype=torch.float16)
    for v in update:
        expected = (expected.float() + v.float()).half()
    assert x[0] == expected


def _run(body, *tensors):
    @ct.kernel
    def probe(a):
        body(a.get_raw_memory())

    interpreter.launch(1, probe, tensors or (torch.zeros(8, dtype=torch.int32),))


@pytest.mark.parametrize("body,error,words", [
    (lambda r: r.load_offset(ct.arange(16, dtype=ct.int32)), KernelValueError, "offset 8"),
    (lambda r: r.load_offset(-1), KernelValueError, "offset -1"),
    (lambda r: r.load_offset(ct.full((4,), 1.0, dtype=ct.float32)), KernelTypeError, "offset"),
    (lambda r: r.load_offset(0, mask=ct.full((2,), 1, dtype=ct.int32)), KernelTypeError, "mask"),
    (lambda r: r.load_offset(ct.arange(4, dtype=ct.int32), mask=ct.full((8,), True, ct.bool_)),
     KernelTypeError, "mask shape"),
    (lambda r: r.load_offset(0, padding_value=1.5), KernelTypeError, "padding_value"),
    (lambda r: r.load_offset(0, latency=11), KernelValueError, "latency"),
    (lambda r: r.store_offset(ct.arange(4, dtype=ct.int32), ct.full((8,), 1, ct.int32)),
     KernelTypeError, "value shape"),
    (lambda r: r.store_offset(0, 2.5), KernelTypeError, "value"),
    # two lanes storing different values to one element race on a GPU, as in ct.scatter
    (lambda r: r.store_offset(ct.arange(4, dtype=ct.int32) // 2, ct.arange(4, dtype=ct.int32)),
     KernelValueError, "different values to offset 0"),
    (lambda r: r.atomic_and_offset(0, ct.full((1,), 1, ct.int64)), KernelTypeError, "update"),
    (lambda r: r.atomic_add_offset(0, 1, memory_scope=ct.MemoryScope.NONE),
     KernelTypeError, "memory_scope"),
    (lambda r: r.atomic_cas_offset(0, 1.5, 2), KernelTypeError, "expected"),
])
def test_errors_name_the_argument(body, error, words):
    with pytest.raises(error, match=words):
        _run(body)


def test_unsupported_atomic_dtypes_are_refused():
    with pytest.raises(KernelTypeError, match="float16 are not supported"):
        _run(lambda r: r.atomic_max_offset(0, 1), torch.zeros(4, dtype=torch.float16))


def test_masked_off_lanes_are_not_bounds_checked():
    x = torch.arange(8, dtype=torch.int32)
    got = []

    @ct.kernel
    def probe(a):
        off = ct.arange(16, dtype=ct.int32) - 4
        got.append(a.get_raw_memory().load_offset(off, mask=(off >= 0) & (off < 8)))

    interpreter.launch(1, probe, (x,))
    assert got[0]._t.tolist() == [0] * 4 + list(range(8)) + [0] * 4
    assert got[0].dtype == ct.int32


@ct.kernel
def static_iter_states(out):
    # The example of ct.static_iter's documentation, stored instead of printed.
    tile = ct.zeros((4,), dtype=ct.int32)
    states = ()
    for i in ct.static_iter(range(4)):
        states += (tile + i,)
    new_states = ()
    for i in ct.static_iter(range(4)):
        new_states += (states[(i + 1) % 4] + states[i],)
    for i in ct.static_iter(range(4)):
        ct.store(out, (i, 0), new_states[i][None, :])


def test_static_iter_unrolls_as_a_python_loop():
    out = poisoned(4, 4, dtype=torch.int32)
    interpreter.launch(1, static_iter_states, (out,))
    assert out[:, 0].tolist() == [1, 3, 5, 3]
    assert torch.equal(out, out[:, :1].expand(4, 4))


@ct.kernel
def dependent_copy(x, y, T: ct.Constant[int]):
    ct.grid_dependency_control_wait()
    tile = ct.load(x, (ct.bid(0),), (T,))
    ct.grid_dependency_control_launch_dependents()
    ct.store(y, (ct.bid(0),), tile)


def test_grid_dependency_control_is_a_no_op():
    x, y = randn(32, seed=11), poisoned(32)
    interpreter.launch(4, dependent_copy, (x, y, 8))
    assert torch.equal(x, y)




@pytest.mark.gpu
def test_gpu_raw_memory_parity():
    offsets = randint(40, low=-5, high=64, seed=2)
    cpu, gpu = on_gpu_and_cpu(5, gather_offsets, (randn(64, seed=1), offsets, poisoned(40), 8))
    assert torch.equal(gpu[2], cpu[2])
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    args = (poisoned(64), torch.where(perm % 5 == 0, -1, perm).to(torch.int32),
            randn(64, seed=4), 8)
    cpu, gpu = on_gpu_and_cpu(8, scatter_offsets, args)
    torch.testing.assert_close(gpu[0], cpu[0], rtol=0, atol=0, equal_nan=True)
    cpu, gpu = on_gpu_and_cpu(1, transpose_by_offsets, (randn(8, 16, seed=6), poisoned(16, 8),
                                                       8, 16))
    assert torch.equal(gpu[1], cpu[1])


@pytest.mark.gpu
def test_gpu_atomic_offset_parity():
    args = (randint(64, low=0, high=12, seed=5), torch.zeros(10, dtype=torch.int32),
            poisoned(64, dtype=torch.int32), 16)
    cpu, gpu = on_gpu_and_cpu(4, histogram_offsets, args)
    assert torch.equal(gpu[1], cpu[1])  # counts are exact; old values depend on the order
    owner = torch.full((8,), -1, dtype=torch.int32)
    cpu, gpu = on_gpu_and_cpu(3, claim_offsets, (owner, 8))
    # Some block claims every slot; on the GPU it need not be block 0.
    assert bool(((gpu[0] >= 0) & (gpu[0] < 3)).all()) and cpu[0].tolist() == [0] * 8


@pytest.mark.gpu
def test_gpu_static_iter_and_grid_dependency_parity():
    cpu, gpu = on_gpu_and_cpu(1, static_iter_states, (poisoned(4, 4, dtype=torch.int32),))
    assert torch.equal(gpu[0], cpu[0])
    cpu, gpu = on_gpu_and_cpu(4, dependent_copy, (randn(32, seed=11), poisoned(32), 8))
    assert torch.equal(gpu[1], cpu[1])
