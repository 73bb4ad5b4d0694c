"""Shape manipulation (ops/interpreter/shapes.py)."""
import pytest
import torch

import cuda.tile as ct

from ops.interpreter import KernelError
from tests.interpreter.helpers import evaluate, randn


def test_shape_operations():
    x = randn(2, 4, 8, seed=36)
    for tile_fn, torch_fn in [
            (lambda t: t.reshape((8, -1)), lambda t: t.reshape(8, -1)),
            (lambda t: ct.permute(t, (2, 0, 1)), lambda t: t.permute(2, 0, 1)),
            (lambda t: t.transpose(0, 2), lambda t: t.transpose(0, 2)),
            (lambda t: ct.reshape(t, (8, 8)).transpose(), lambda t: t.reshape(8, 8).T),
            (lambda t: t[:, None], lambda t: t[:, None]),
            (lambda t: t[..., None], lambda t: t[..., None]),
            (lambda t: ct.expand_dims(t, -1), lambda t: t.unsqueeze(-1)),
            (lambda t: ct.broadcast_to(ct.extract(t, (0, 0, 0), (2, 4, 1)), (2, 4, 8)),
             lambda t: t[:, :, :1].expand(2, 4, 8)),
            (lambda t: ct.cat((t, t * 2), 1), lambda t: torch.cat([t, t * 2], 1)),
            (lambda t: ct.extract(t, (1, 0, 3), (1, 4, 2)), lambda t: t[1:2, 0:4, 6:8]),
            (lambda t: t.extract((0, 1, 1), ()).reshape((1,)), lambda t: t[0, 1, 1].reshape(1)),
            (lambda t: ct.extract(t, (0, 0, 0), (1, 1, 1)).item(), lambda t: t[0, 0, 0])]:
        assert torch.equal(evaluate(tile_fn, x)._t, torch_fn(x))
    expected = x.clone()
    expected[1, 2:4, 4:8] = -1
    got = evaluate(lambda t: ct.insert(t, (1, 1, 1), ct.full((1, 2, 4), -1.0, ct.float32)), x)
    assert torch.equal(got._t, expected)


@pytest.mark.parametrize("fn,message", [
    (lambda t: t.reshape((3, -1)), "cannot reshape"),
    (lambda t: t[0], "directly indexing a tile is not supported"),
    (lambda t: ct.extract(t, (4, 0), (1, 4)), "outside the grid"),
    (lambda t: ct.cat((t, t.astype(ct.float16)), 0), "same dtype"),
    (lambda t: ct.transpose(t.reshape((2, 2, 4))), "give axis0 and axis1"),
    (lambda t: ct.permute(t, (0, 0)), "not a permutation"),
])
def test_shape_errors(fn, message):
    with pytest.raises(KernelError, match=message):
        evaluate(fn, randn(4, 4))
