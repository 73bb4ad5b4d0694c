"""Atomics (ops/interpreter/atomics.py): kernels as a user writes them, checked against torch."""
import pytest
import torch

import cuda.tile as ct

from ops import interpreter
from ops.interpreter import KernelTypeError, KernelValueError
from tests.interpreter.helpers import on_gpu_and_cpu, randint, randn


@ct.kernel
def histogram(values, counts, T: ct.Constant[int]):
    # Many lanes and many blocks hit the same bins; the tail lanes of the last
    # block are masked off by pointing them outside `counts`.
    i = ct.bid(0) * T + ct.arange(T, dtype=ct.int32)
    v = ct.load(values, (ct.bid(0),), (T,), padding_mode=ct.PaddingMode.ZERO)
    bins = ct.where(i < values.shape[0], v, counts.shape[0])
    ct.atomic_add(counts, bins, 1)


@ct.kernel
def global_max(x, out, T: ct.Constant[int]):
    tile = ct.load(x, (ct.bid(0),), (T,), padding_mode=ct.PaddingMode.ZERO)
    ct.atomic_max(out, 0, ct.max(tile))


@ct.kernel
def float_sum(x, out, T: ct.Constant[int]):
    tile = ct.load(x, (ct.bid(0),), (T,), padding_mode=ct.PaddingMode.ZERO)
    ct.atomic_add(out, ct.arange(T, dtype=ct.int32) % 4, tile)


@ct.kernel
def claim_slots(owner, old_out, T: ct.Constant[int]):
    # Lock-free: each block tries to claim every slot still free (-1); the
    # first block wins each slot and every block records what it saw.
    slots = ct.arange(T, dtype=ct.int32)
    old = ct.atomic_cas(owner, slots, -1, ct.bid(0))
    ct.store(old_out, (ct.bid(0), 0), old[None, :])


def test_histogram_matches_bincount():
    values = randint(1000, low=0, high=16, seed=1)
    counts = torch.zeros(16, dtype=torch.int32)
    interpreter.launch(8, histogram, (values, counts, 128))
    assert torch.equal(counts, torch.bincount(values, minlength=16).to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_max_across_blocks(dtype):
    x = randint(700, low=-10**6, high=10**6, dtype=dtype, seed=2)
    out = torch.full((1,), torch.iinfo(dtype).min, dtype=dtype)
    interpreter.launch(6, global_max, (x, out, 128))
    assert out.item() == x.max().item()


def test_float_add_sums_every_lane():
    x = randn(512, seed=3)
    out = torch.zeros(4, dtype=torch.float64)
    interpreter.launch(4, float_sum, (x.double(), out, 128))
    expected = x.double().reshape(-1, 4).sum(0)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_cas_claims_each_slot_once():
    owner = torch.full((8,), -1, dtype=torch.int32)
    seen = torch.zeros(3, 8, dtype=torch.int32)
    interpreter.launch(3, claim_slots, (owner, seen, 8))
    assert torch.equal(owner, torch.zeros(8, dtype=torch.int32))  # block 0 came first
    assert torch.equal(seen, torch.tensor([[-1] * 8, [0] * 8, [0] * 8], dtype=torch.int32))


def run_one(fn, *tensors):
    results = []

    @ct.kernel
    def k(arrays):
        results.append(fn(*arrays))

    interpreter.launch(1, k, (tuple(tensors),))
    return results[0]


def test_duplicate_lanes_are_serialized_in_order():
    a = torch.tensor([10, 20, 30], dtype=torch.int32)
    idx = [0, 2, 0, 0, 1]
    upd = [1, 2, 3, 4, 5]

    def f(arr, i, u):
        return ct.atomic_add(arr, ct.load(i, (0,), (8,), padding_mode=ct.PaddingMode.ZERO)
                             .extract((0,), (4,)), ct.load(u, (0,), (4,)))
    old = run_one(f, a, torch.tensor(idx[:4], dtype=torch.int32), torch.tensor(upd[:4],
                                                                             dtype=torch.int32))
    # Lane order: a[0]: 10 -> 11 -> 14 -> 18; a[2]: 30 -> 32.
    assert old._t.tolist() == [10, 30, 11, 14]
    assert a.tolist() == [18, 20, 32]

    b = torch.tensor([0, 0], dtype=torch.int64)
    old = run_one(lambda arr: ct.atomic_xchg(arr, ct.zeros((4,), ct.int32),
                                             ct.arange(4, dtype=ct.int64) + 1), b)
    assert old._t.tolist() == [0, 1, 2, 3] and b.tolist() == [4, 0]


@pytest.mark.parametrize("name,fn", [("and", torch.bitwise_and), ("or", torch.bitwise_or),
                                     ("xor", torch.bitwise_xor), ("min", torch.minimum),
                                     ("max", torch.maximum)])
def test_rmw_ops_return_old_values(name, fn):
    a = randint(16, low=-1000, high=1000, seed=4)
    u = randint(16, low=-1000, high=1000, seed=5)
    expected = fn(a, u)
    before = a.clone()
    op = getattr(ct, f"atomic_{name}")
    old = run_one(lambda arr, upd: op(arr, ct.arange(16, dtype=ct.int32),
                                      ct.load(upd, (0,), (16,)),
                                      memory_order=ct.MemoryOrder.RELAXED), a, u)
    assert torch.equal(old._t, before) and torch.equal(a, expected)


def test_2d_indices_mask_and_float_cas():
    a = torch.tensor([[0.0, -0.0], [float("nan"), 1.5]])
    old = run_one(lambda arr: ct.atomic_cas(arr, (ct.arange(2, dtype=ct.int32)[:, None],
                                                  ct.arange(4, dtype=ct.int32)[None, :]),
                                            0.0, 7.0), a)
    # Bitwise comparison: -0.0 != 0.0; columns 2, 3 are out of bounds -> `expected`.
    assert a.tolist()[0] == [7.0, -0.0] and a[1, 1] == 1.5
    assert old._t[:, 2:].eq(0.0).all() and old._t[0, 0] == 0.0


def test_bfloat16_add_rounds_every_step():
    a = torch.tensor([1.0], dtype=torch.bfloat16)
    run_one(lambda arr: ct.atomic_add(arr, ct.zeros((4,), ct.int32),
                                      ct.full((4,), 2.0**-8, ct.bfloat16)), a)
    # 1 + 2**-8 rounds back to 1 in bfloat16 each time (ties to even).
    assert a.item() == 1.0


@pytest.mark.parametrize("call,message", [
    (lambda a, f: ct.atomic_max(f, 0, 1.0), "not supported"),
    (lambda a, f: ct.atomic_add(a, 0.5, 1), r"indices\[0\] must be an integer"),
    (lambda a, f: ct.atomic_add(a, ct.full((2,), 0.5, ct.float32), 1), "non-integer dtype"),
    (lambda a, f: ct.atomic_add(a, (0, 0), 1), "indices must be a tuple of length 1"),
    (lambda a, f: ct.atomic_and(a, ct.arange(4, dtype=ct.int32),
                                ct.arange(4, dtype=ct.int64)), "exactly match"),
    (lambda a, f: ct.atomic_add(a, ct.arange(4, dtype=ct.int32), 1.5), "implicitly cast"),
    (lambda a, f: ct.atomic_add(a, ct.arange(4, dtype=ct.int32), ct.arange(8, dtype=ct.int32)),
     "not broadcastable"),
    (lambda a, f: ct.atomic_add(a, 0, 1, memory_order=ct.MemoryOrder.WEAK), "memory_order"),
    (lambda a, f: ct.atomic_add(a, 0, 1, memory_scope=ct.MemoryScope.NONE), "memory_scope"),
    (lambda a, f: ct.atomic_add(a, 0, 1, memory_scope=ct.MemoryScope.CLUSTER), "memory_scope"),
])
def test_wrong_usage(call, message):
    with pytest.raises(KernelTypeError, match=message):
        run_one(call, torch.zeros(4, dtype=torch.int32), torch.zeros(4))


def test_out_of_bounds_without_check_is_an_error():
    with pytest.raises(KernelValueError, match="check_bounds=False"):
        run_one(lambda a: ct.atomic_add(a, 9, 1, check_bounds=False),
                torch.zeros(4, dtype=torch.int32))
    a = torch.zeros(4, dtype=torch.int32)
    old = run_one(lambda a: ct.atomic_add(a, -1, 1), a)  # negative = out of bounds: no-op
    assert a.eq(0).all() and old._t.item() == torch.iinfo(torch.int32).min


# ---------------------------------------------------------------------------
# The same kernels on a GPU (skipped without CUDA): interpreter vs ct.launch
# ---------------------------------------------------------------------------



@pytest.mark.gpu
def test_gpu_histogram():
    values = randint(5000, low=0, high=16, seed=11)
    cpu, gpu = on_gpu_and_cpu(40, histogram, (values, torch.zeros(16, dtype=torch.int32), 128))
    assert torch.equal(gpu[1], cpu[1])  # integer adds: exact


@pytest.mark.gpu
def test_gpu_max_and_cas():
    x = randint(700, low=-10**6, high=10**6, seed=12)
    init = torch.full((1,), torch.iinfo(torch.int32).min, dtype=torch.int32)
    cpu, gpu = on_gpu_and_cpu(6, global_max, (x, init, 128))
    assert torch.equal(gpu[1], cpu[1])
    owner = torch.full((8,), -1, dtype=torch.int32)
    cpu, gpu = on_gpu_and_cpu(3, claim_slots, (owner, torch.zeros(3, 8, dtype=torch.int32), 8))
    # Which block wins is up to the GPU; each slot has exactly one owner, and
    # every block other than the winner saw the winner's id.
    winners = gpu[0]
    assert ((winners >= 0) & (winners < 3)).all()
    for b in range(3):
        seen = gpu[1][b]
        assert torch.where(winners == b, seen == -1, seen == winners).all()


@pytest.mark.gpu
def test_gpu_float_add():
    x = randn(512, seed=13)
    cpu, gpu = on_gpu_and_cpu(4, float_sum, (x, torch.zeros(4), 128))
    # 128 float32 terms of |x| < 5 per element, added in another order on the
    # GPU: at most 128 half-ulps of a sum below 640, so atol 1e-3.
    torch.testing.assert_close(gpu[1], cpu[1], rtol=0, atol=1e-3)
