"""How every stage is checked against the one before it."""
import torch


def rel_err(out, ref):
    """||out - ref|| / ||ref||, computed in float64. Any NaN or inf in ``out`` gives inf."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def check(name, out, ref, tol):
    """Assert that ``out`` matches ``ref`` to relative error ``tol``; print a line that does not
    depend on the machine (the exact error does, in its last digits), return the error."""
    err = rel_err(out, ref)
    assert err < tol, f"{name}: relative error {err:.3g} exceeds {tol:g}"
    print(f"{name}: OK, relative error < {tol:g}")
    return err
