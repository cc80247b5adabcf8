"""FP8 W8A8 linear with static scales (the checkpoint's Gated-DeltaNet `in_proj_qkv` / `in_proj_z` / `out_proj` and
attention `q/k/v/o_proj`): activations quantised with the checkpoint's `input_scale` (e4m3, saturating at +-448), then
one `torch._scaled_mm` (cuBLASLt FP8 GEMM with fp32 accumulation) that applies `input_scale * weight_scale`.

Reference: `kernels.nvfp4.fp8_linear_reference` (quantise x the same way, exact e4m3 products summed in fp32, times the
two scales). Format: design doc sections 2.2-2.3 (`weight` e4m3 [N, K], `weight_scale` = amax / 448 fp32 scalar,
`input_scale` fp32 scalar). A per-output-row weight scale `[N]` is accepted too (q/k/v or in_proj_qkv/z fused at load
without requantising, each row keeping its projection's scale): that is `_scaled_mm`'s row-wise mode (scale_a [M, 1],
scale_b [1, N], bf16 output), CUTLASS on sm_90.

Guard: FP8 tensor cores need compute capability >= 8.9 (Ada, Hopper, Blackwell); row-wise scaling needs >= 9.0 and a
bf16 output; `_scaled_mm` needs K and N multiples of 16. Anything else (A100, fp32 out with row-wise scales, no
input_scale) goes to the reference through the registry, which records and logs the fallback (STYLE P4, A2).

Numerics: the quantised activations are identical to the reference's (same fp32 division, clamp and RNE cast); the
GEMM differs only by summation order and by where the two fp32 scales multiply (cuBLASLt: in the epilogue, on the
fp32 accumulator), so the result agrees to fp32 rounding before the one rounding to bf16 (tests: <= 2^-8 relative +
an fp32 summation bound; on CPU `_scaled_mm` even returns the reference's bf16 bit for bit at the tested shapes).

Napkin math (decode, one token; H200 4.8 TB/s; FP8 = 1 B/param):
  GDN layer: in_proj_qkv 8192 x 2048 (16.8 MB) + in_proj_z 4096 x 2048 (8.4 MB) + out_proj 2048 x 4096 (8.4 MB)
      = 33.6 MB -> 7.0 us; x 30 layers = 1.007 GB -> 210 us.
  attention layer: q(+gate) 8192 x 2048 + k, v 512 x 2048 + o 2048 x 4096 = 27.3 MB -> 5.7 us; x 10 = 273 MB -> 57 us.
  Total 1.28 GB -> 267 us per token: more than the NVFP4 experts (design doc section 5), so this GEMV matters.
  The activation quantisation reads 4-16 KB and writes half that: launch-bound (~2-3 us each, 70 per token; fuse it
  into the preceding RMSNorm / conv if it shows in the profile). cuBLASLt's FP8 GEMM at M = 1 is not guaranteed to
  reach bandwidth; benchmark against the bf16 reference before trusting it for decode.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.tolerance import compare  # noqa: F401  (re-exported for tests and the registry)

from kernels.nvfp4 import E4M3_MAX, FP8Tensor, fp8_linear_reference

NAME = "fp8_linear"
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: sm_89 (Ada), sm_90 (Hopper), sm_100 (Blackwell)
ROWWISE_MIN_CAPABILITY = (9, 0)  # row-wise scaled FP8 GEMM (CUTLASS) in torch._scaled_mm
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_input_fp8(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> e4m3 x / input_scale, saturating at +-448 (static activation quantisation; the arithmetic of
    `kernels.nvfp4.quantize_fp8`, which the reference uses)."""
    return (x.float() / input_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_linear_scaled_mm(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Same contract as `fp8_linear_reference`: x [..., K] -> [..., N] in out_dtype (default x.dtype)."""
    if w.input_scale is None:
        raise ValueError("fp8_linear_scaled_mm needs a static input_scale (weight-only FP8 is the reference path)")
    out_dtype = out_dtype or x.dtype
    k = x.shape[-1]
    n = w.data.shape[0]
    xq = quantize_input_fp8(x.reshape(-1, k), w.input_scale)  # [M, K] row-major
    s_in = w.input_scale.float().reshape(())
    s_w = w.scale.float()
    if s_w.dim() == 0:  # tensor-wise: one alpha = input_scale * weight_scale in the epilogue
        y = torch._scaled_mm(xq, w.data.t(), scale_a=s_in, scale_b=s_w, out_dtype=out_dtype)
    else:  # row-wise: per-token (here: one static value) x per-output-row scales
        scale_a = s_in.expand(xq.shape[0], 1).contiguous()
        y = torch._scaled_mm(xq, w.data.t(), scale_a=scale_a, scale_b=s_w.reshape(1, n), out_dtype=out_dtype)
    return y.reshape(*x.shape[:-1], n)


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None = None) -> dict[str, Any]:
    cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
    s = w.scale
    rowwise = s.dim() == 1
    return dict(device=x.device.type, capability=cap, dtype=x.dtype, out_dtype=out_dtype or x.dtype,
                k=x.shape[-1], weight_shape=tuple(w.data.shape), weight_dtype=w.data.dtype,
                weight_contiguous=w.data.is_contiguous(), rowwise=rowwise,
                scale_ok=s.dim() == 0 or tuple(s.shape) == (w.data.shape[0],),
                has_input_scale=w.input_scale is not None and w.input_scale.numel() == 1)


def supports(*, device: str, capability, dtype: torch.dtype, out_dtype: torch.dtype, k: int,
             weight_shape: tuple[int, ...], weight_dtype: torch.dtype, weight_contiguous: bool, rowwise: bool,
             scale_ok: bool, has_input_scale: bool, **_: Any) -> bool:
    """CUDA with FP8 tensor cores (cc >= 8.9; row-wise scales: cc >= 9.0 and bf16 out); a contiguous e4m3 [N, K]
    weight with K, N multiples of 16 (cuBLASLt FP8 alignment) matching x; a static scalar input_scale."""
    if device != "cuda" or capability is None or tuple(capability) < MIN_CAPABILITY:
        return False
    if rowwise and (tuple(capability) < ROWWISE_MIN_CAPABILITY or out_dtype != torch.bfloat16):
        return False
    return (dtype in IN_DTYPES and out_dtype in OUT_DTYPES and weight_dtype == torch.float8_e4m3fn
            and weight_contiguous and len(weight_shape) == 2 and weight_shape[1] == k and k % 16 == 0
            and weight_shape[0] % 16 == 0 and scale_ok and has_input_scale)




def _sample(device) -> tuple[tuple, dict]:
    from kernels.nvfp4 import quantize_fp8

    g = torch.Generator().manual_seed(0)
    data, scale = quantize_fp8(torch.randn(96, 128, generator=g) * 0.02)
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    input_scale = x.float().abs().amax() / E4M3_MAX * 0.9  # a calibrated scale a little below this batch's amax
    w = FP8Tensor(data.to(device), scale.to(device), input_scale.to(device))
    return (x.to(device), w), {}


def register(registry) -> None:
    registry.add_op(NAME, fp8_linear_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="max |diff| <= 1e-2 x max |ref| (identical quantised activations; fp32 accumulation; "
                              "bf16 output rounding 2^-9)")
    # a vendor GEMM through torch (cuBLASLt), not Triton: the registry's "torch" kind
    registry.add_implementation(NAME, "scaled_mm", fp8_linear_scaled_mm, supports, kind="torch")
