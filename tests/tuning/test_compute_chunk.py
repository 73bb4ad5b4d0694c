"""The chunk the kernels compute with (ops/tuning/compute_chunk.py): the switch, the rules of "auto",
that the chunk chosen is the one the kernels run at, forward and backward, and the rounding
difference a change of chunk makes."""
import pytest
import torch

import ops
from ops.tuning import compute_chunk
from ops.backward import kernel_backward
from ops.forward import kernel_forward
from reference.problems import make_problem
from reference.validate import rel_err

H200 = dict(gpu="NVIDIA H200", dtype=torch.bfloat16, batch=8, seqlen=2048, nheads=80,
            headdim=64, dstate=128)


@pytest.fixture
def env(monkeypatch):
    def set_mode(value):
        if value is None:
            monkeypatch.delenv(compute_chunk.ENV, raising=False)
        else:
            monkeypatch.setenv(compute_chunk.ENV, value)
    set_mode(None)
    return set_mode


def test_the_switch(env):
    assert compute_chunk.mode() == "auto"
    for value, want in (("auto", "auto"), (" Caller ", "caller"), ("128", 128), ("16", 16)):
        env(value)
        assert compute_chunk.mode() == want, value
    for bad in ("0", "96", "512", "fast", "1e2"):
        env(bad)
        with pytest.raises(ValueError, match=f"{compute_chunk.ENV} must be 'auto', 'caller' or"):
            compute_chunk.mode()


def test_auto_computes_at_128_only_where_the_rules_say():
    """An H200 in bf16, headdim up to 64, dstate 65-256 from 2K tokens and 33-64 from 4K, for a
    caller's 256, while the entry states at 128 stay under 2**31 elements (the sizes measured
    faster there, and those compiling to the same tiles); any other GPU (other Hopper parts
    included: not measured), dtype, size or caller's chunk keeps the caller's."""
    assert compute_chunk.auto_chunk(256, **H200) == 128
    assert compute_chunk.auto_chunk(256, **{**H200, "dstate": 64, "seqlen": 4096}) == 128
    assert compute_chunk.auto_chunk(256, **{**H200, "dstate": 256, "headdim": 32}) == 128
    assert compute_chunk.auto_chunk(256, **{**H200, "dstate": 96, "seqlen": 4096}) == 128
    long = dict(batch=1, nheads=80, dstate=128)      # 256K tokens measured faster at 128
    assert compute_chunk.auto_chunk(256, **{**H200, **long, "seqlen": 262144}) == 128
    for change in (dict(gpu="NVIDIA H100 80GB HBM3"), dict(gpu="NVIDIA B200"),
                   dict(gpu="NVIDIA A100-SXM4-80GB"), dict(gpu=None),
                   dict(dtype=torch.float16), dict(dtype=torch.float32), dict(headdim=128),
                   dict(dstate=32), dict(dstate=512), dict(seqlen=1024),
                   dict(dstate=64, seqlen=2048), dict(dstate=64, seqlen=4095),
                   # entry states at 128 past 2**31 elements: 64-bit kernels, not measured
                   dict(long, seqlen=524288), dict(long, dstate=256, seqlen=262144)):
        assert compute_chunk.auto_chunk(256, **{**H200, **change}) == 256, change
    for caller in (64, 128):
        assert compute_chunk.auto_chunk(caller, **H200) == caller


def test_the_chunk_for_a_call(env):
    x = torch.empty(1, 4096, 2, 64, dtype=torch.bfloat16)        # on the CPU: the interpreter
    B = torch.empty(1, 4096, 1, 128, dtype=torch.bfloat16)
    assert compute_chunk.kernel_chunk(256, x, B) == 256           # auto: nothing measured here
    env("64")
    assert compute_chunk.kernel_chunk(256, x, B) == 64
    env("caller")
    assert compute_chunk.kernel_chunk(256, x, B) == 256
    assert compute_chunk.kernel_chunk(32, x, B) == 32


def _problem(dtype, seqlen=160):
    return make_problem(batch=2, seqlen=seqlen, nheads=4, headdim=16, ngroups=2, dstate=16,
                        dtype=dtype, seed=2, z=True, initial_states=False)


def test_the_op_runs_the_kernels_at_the_chunk_chosen(env):
    """With a chunk forced, the op's output and gradients are the kernels' at that chunk, bit for
    bit, and not at the caller's; switching the mode between two like calls is not hidden by
    the replay of the first (the mode is in its key)."""
    kw = _problem(torch.float32)
    args = [kw[k] for k in ("x", "dt", "A", "B", "C")]
    opts = dict(D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"], dt_softplus=True)
    at = {c: kernel_forward(*args, c, **opts)[0] for c in (32, 64)}
    assert not torch.equal(at[32], at[64])          # rounding differs, so the chunk shows
    env("caller")
    assert torch.equal(ops.mamba_chunk_scan_combined(*args, 64, **opts, backend="interpret"),
                       at[64])
    env("32")
    for _ in range(2):                              # the second call replays the first's launches
        assert torch.equal(ops.mamba_chunk_scan_combined(*args, 64, **opts, backend="interpret"),
                           at[32])
    leaves = [t.detach().clone().requires_grad_() for t in args]
    out = ops.mamba_chunk_scan_combined(*leaves, 64, **opts, backend="interpret")
    assert torch.equal(out.detach(), at[32])
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.backward(dout)
    want = kernel_backward(dout, None, *args, 32, **opts, wanted=["x", "dt", "A", "B", "C"],
                           input_dtypes=True)
    for name, leaf in zip(("x", "dt", "A", "B", "C"), leaves):
        assert torch.equal(leaf.grad, want["d" + name]), name


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 4e-3)],
                         ids=["fp32", "bf16"])
def test_the_rounding_a_change_of_chunk_makes(dtype, tol):
    """Against the float64 reference at the caller's chunk 256 (1 x 1024 tokens, 2 heads of
    64 x 64, D, dt_bias, softplus), the kernels' output at chunk 128 (what "auto" computes
    with on the H200) is as close as the output at 256: measured through the interpreter,
    fp32 5.1e-7 at 128 against 9.4e-7 at 256 (9.2e-7 apart), bf16 2.34e-3 against 2.33e-3 (the
    output's own rounding to bf16; 6.6e-4 apart). Asserted: each within ``tol`` of the float64
    result (fp32: a few ulps of the sums; bf16: the output rounding), and 128 within 1.5 times
    256's error, plus 1e-7."""
    kw = make_problem(batch=1, seqlen=1024, nheads=2, headdim=64, ngroups=1, dstate=64,
                      dtype=dtype, seed=4, z=False, initial_states=False)
    exact = {k: (v.double() if v.is_floating_point() else v) for k, v in kw.items()}
    ref = ops.mamba_chunk_scan_combined(**exact, chunk_size=256, dt_softplus=True,
                                        backend="reference")
    err = {c: rel_err(ops.mamba_chunk_scan_combined(**kw, chunk_size=c, dt_softplus=True,
                                                    backend="interpret"), ref)
           for c in (256, 128)}
    assert max(err.values()) < tol, err
    assert err[128] <= 1.5 * err[256] + 1e-7, err


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-3)],
                         ids=["fp32", "bf16"])
def test_the_gradients_at_another_chunk(dtype, tol):
    """The backward computes at the forward's chunk ("auto": 128 for a caller's 256 on the H200):
    the kernels' gradients at 128 are as close to float64 autograd through the reference at the
    caller's 256 as those at 256 (1 x 512 tokens, 2 heads of 64 x 64, D, dt_bias, softplus).
    Measured through the interpreter, at 128 / 256: fp32 dx 1.2e-6 / 2.5e-6, dA 7.6e-6 / 3.7e-5
    (a sum over every token with cancellation), the others at most 3.1e-6 / 1.0e-5; bf16 every
    gradient 3.4e-4 to 2.6e-3 at either chunk (the gradients' own rounding to bf16). Asserted:
    each within ``tol``, and at 128 within 1.5 times the error at 256, plus 1e-6."""
    kw = make_problem(batch=1, seqlen=512, nheads=2, headdim=64, ngroups=1, dstate=64,
                      dtype=dtype, seed=6, z=False, initial_states=False)
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias")
    exact = {k: kw[k].double().requires_grad_() for k in names}
    out = ops.mamba_chunk_scan_combined(**exact, chunk_size=256, dt_softplus=True,
                                        backend="reference")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ref = dict(zip(names, torch.autograd.grad(out, [exact[k] for k in names], dout)))
    err = {}
    for c in (256, 128):
        g = kernel_backward(dout.to(dtype), None, *(kw[k] for k in ("x", "dt", "A", "B", "C")), c,
                            D=kw["D"], dt_bias=kw["dt_bias"], dt_softplus=True)
        err[c] = {k: rel_err(g["d" + k], ref[k]) for k in names}
    for name in names:
        assert max(err[c][name] for c in err) < tol, (name, err)
        assert err[128][name] <= 1.5 * err[256][name] + 1e-6, (name, err)


@pytest.mark.gpu
def test_auto_on_the_gpu(env):
    """A Mamba-2 layer's call (bf16, 1 x 4K tokens, 8 heads of 64 x 128, chunk 256) on the GPU:
    on an H200 "auto" computes at 128, elsewhere at 256 (nothing else was measured);
    either way the op's output and gradients are the kernels' at that chunk, bit for bit, and
    the change of chunk moves the output no further from the float64 reference than rounding
    (the CPU test's bound)."""
    kw = {k: v.cuda() for k, v in make_problem(batch=1, seqlen=4096, nheads=8, headdim=64,
                                               ngroups=1, dstate=128, dtype=torch.bfloat16,
                                               seed=3, z=False, initial_states=False).items()}
    args = [kw[k] for k in ("x", "dt", "A", "B", "C")]
    opts = dict(D=kw["D"], dt_bias=kw["dt_bias"], dt_softplus=True)
    want_chunk = 128 if "H200" in torch.cuda.get_device_name() else 256
    assert compute_chunk.kernel_chunk(256, kw["x"], kw["B"]) == want_chunk
    with torch.no_grad():
        out = ops.mamba_chunk_scan_combined(*args, 256, **opts, backend="cutile")
        at = {c: kernel_forward(*args, c, **opts)[0] for c in (128, 256)}
        ref = ops.mamba_chunk_scan_combined(*[t.double() for t in args], 256,
                                            **{**opts, "D": kw["D"].double(),
                                               "dt_bias": kw["dt_bias"].double()},
                                            backend="reference")
    assert torch.equal(out, at[want_chunk])
    err = {c: rel_err(at[c], ref) for c in at}
    assert max(err.values()) < 1e-2, err
    assert err[128] <= 1.5 * err[256] + 1e-7, err
    leaves = [t.detach().clone().requires_grad_() for t in args]
    out = ops.mamba_chunk_scan_combined(*leaves, 256, **opts, backend="cutile")
    dout = torch.randn_like(out)
    out.backward(dout)
    want = kernel_backward(dout, None, *args, want_chunk, **opts,
                           wanted=["x", "dt", "A", "B", "C"], input_dtypes=True)
    for name, leaf in zip(("x", "dt", "A", "B", "C"), leaves):
        assert torch.equal(leaf.grad, want["d" + name]), name
