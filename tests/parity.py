"""Shared helpers for the parity tests (ours vs Meta's `sam3` at identical weights)."""

import torch

# fp32 on CPU: reordered reductions (fused vs unfused matmuls, SDPA vs explicit softmax)
# move results by ~1e-6 relative; 1e-4 leaves headroom while catching any real mistake,
# which shows up as >1e-2.
FP32_REL_TOL = 1e-4


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| in float64 (0 when both are zero)."""
    ours, ref = ours.detach().double(), ref.detach().double()
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    denom = ref.norm()
    diff = (ours - ref).norm()
    return float(diff / denom) if denom > 0 else float(diff)


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = FP32_REL_TOL, what: str = ""):
    err = rel_error(ours, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"
