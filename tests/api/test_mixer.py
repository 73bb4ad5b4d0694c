"""ops.mixer.Mamba2Mixer: a model layer calling the scan, as a model engineer would use it.

CPU (CI): the kernels through the interpreter against the reference backend in one mixer with
the same weights, torch.compile without graph breaks, a training step through the reference
backend and through the kernels (forward and backward kernels). GPU: the same
mixer with this project's scan against mamba_ssm's Triton scan, eagerly, compiled and replayed
from a CUDA graph.
"""
import pytest
import torch

from ops.mixer import Mamba2Mixer
from reference.validate import rel_err


def mixer(backend="interpret", dtype=torch.float32, device="cpu", **kw):
    g = torch.Generator().manual_seed(0)
    return Mamba2Mixer(d_model=32, d_state=16, headdim=16, ngroups=2, chunk_size=32,
                       backend=backend, generator=g, dtype=dtype, **kw).to(device)


def inputs(dtype=torch.float32, device="cpu", batch=2, seqlen=70):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, seqlen, 32, generator=g).to(device=device, dtype=dtype)


def test_kernels_and_reference_give_the_same_layer():
    u = inputs()
    kernels, reference = mixer("interpret"), mixer("reference")
    with torch.no_grad():
        a, b = kernels(u), reference(u)
    # float32 both; the kernels and the chunked reference differ in summation order only
    assert a.shape == u.shape and rel_err(a, b) < 1e-5


def test_the_layer_compiles_with_no_graph_break():
    torch._dynamo.reset()
    m, u = mixer("interpret"), inputs()
    with torch.no_grad():
        eager = m(u)
        compiled = torch.compile(m, backend="aot_eager", fullgraph=True)(u)
    assert torch.equal(eager, compiled)


def test_a_training_step_through_the_reference_backend():
    m, u = mixer("reference"), inputs()
    loss = m(u).square().mean()
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_a_training_step_through_the_kernels():
    """The kernels' forward and backward: the same parameter gradients
    as the reference backend's layer (float32; summation order only, 1e-4)."""
    u = inputs()
    grads = {}
    for backend in ("interpret", "reference"):
        m = mixer(backend)
        m(u).square().mean().backward()
        grads[backend] = {name: p.grad for name, p in m.named_parameters()}
    for name, g in grads["interpret"].items():
        assert rel_err(g, grads["reference"][name]) < 1e-4, name


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="multiple of headdim"):
        Mamba2Mixer(d_model=30, headdim=16)
    with pytest.raises(ValueError, match="ngroups"):
        Mamba2Mixer(d_model=32, headdim=16, ngroups=3)


@pytest.mark.gpu
def test_equals_the_same_layer_on_mamba_ssms_scan():
    mamba_ssm = pytest.importorskip("mamba_ssm.ops.triton.ssd_combined")
    from tests.benchmark import capture_graph
    torch._dynamo.reset()
    u = inputs(torch.bfloat16, "cuda", batch=2, seqlen=1000)
    ours = mixer("cutile", torch.bfloat16, "cuda")
    theirs = mixer("cutile", torch.bfloat16, "cuda", scan=mamba_ssm.mamba_chunk_scan_combined)
    with torch.no_grad():
        ref = theirs(u)
        eager = ours(u)
        compiled = torch.compile(ours, fullgraph=True)(u)
        graph, captured = capture_graph(lambda: ours(u))
        graph.replay()
    torch.cuda.synchronize()
    # bf16 layers: the two scans round differently (entry states, summation order), and the
    # projections around them are the same; 1e-2 as the forward's bf16 tolerance.
    for name, out in (("eager", eager), ("compiled", compiled), ("graph", captured)):
        assert rel_err(out, ref) < 1e-2, name


def test_the_norm_is_per_group():
    from ops.mixer import GatedRMSNorm
    y, z = torch.randn(3, 8), torch.randn(3, 8)
    norm = GatedRMSNorm(8, groups=2)
    v = (y * torch.nn.functional.silu(z)).reshape(3, 2, 4)
    expected = (v / v.square().mean(-1, keepdim=True).add(1e-5).sqrt()).reshape(3, 8)
    assert torch.allclose(norm(y, z), expected, atol=1e-6)
