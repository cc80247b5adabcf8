"""Shared output comparison for the bf16 GEMM kernels (W4A16, FP8) and their references."""

import torch


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-2) -> str | None:
    """None if max |out - ref| <= tol * max |ref|, else the reason. bf16 output rounding is 2^-9
    relative; the rest of the 1e-2 default covers fp32 summation order."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"shape/dtype {tuple(out.shape)} {out.dtype} != {tuple(ref.shape)} {ref.dtype}"
    err = float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0
    scale = float(ref.float().abs().max()) if ref.numel() else 0.0
    return None if err <= tol * scale else f"max abs error {err:.3g} > {tol} x max |ref| {scale:.3g}"
