"""FP8 W8A8 linear with static scales (the checkpoint's Gated-DeltaNet `in_proj_qkv` / `in_proj_z` / `out_proj` and
attention `q/k/v/o_proj`): activations quantised with the checkpoint's `input_scale` (e4m3, saturating at +-448), then
one `torch._scaled_mm` (cuBLASLt FP8 GEMM with fp32 accumulation) that applies `input_scale * weight_scale`.

Reference: `kernels.nvfp4.fp8_linear_reference` (quantise x the same way, exact e4m3 products summed in fp32, times the
two scales). Format: design doc sections 2.2-2.3 (`weight` e4m3 [N, K], `weight_scale` = amax / 448 fp32 scalar,
`input_scale` fp32 scalar). A per-output-row weight scale `[N]` is accepted too (the decode steps' fused q/k/v and
in_proj_qkv/z, `qwen_engine.model.quantized.fused_fp8_projections`: each row keeps its projection's scale): the
decode GEMV takes it in any dtype; for `_scaled_mm` it is the row-wise mode (scale_a [M, 1], scale_b [1, N], bf16
output), CUTLASS on sm_90.

Implementations, in the registry's order: decode-sized calls (1-4 rows, `fp8_gemv.gemv_ok`) on the CUDA-core GEMV of
`kernels/fp8_gemv.py` ("triton_quant+gemv", "triton_gemv"); then 5-64 rows (decode at 8-64 streams) on the
tensor-core GEMM with the weight as the MMA's M (`kernels/fp8_swapped.py`, "triton_quant+swapped", Hopper); then
`kernels/fp8_skinny.py` for narrow decode-sized layers; then the one-launch quantiser + cuBLASLt
("triton_quant+scaled_mm": prefill, and decode elsewhere than Hopper); then the torch-op quantiser + cuBLASLt
("scaled_mm").

Guard: FP8 tensor cores need compute capability >= 8.9 (Ada, Hopper, Blackwell); row-wise scaling needs >= 9.0 and a
bf16 output; `_scaled_mm` needs K and N multiples of 16 (the GEMV: cc >= 8.9, K a multiple of 4,
`supports_gemv`). Anything else (A100, fp32 out with row-wise scales beyond the GEMV's rows, no input_scale) goes to
the reference through the registry, which records and logs the fallback (STYLE P4, A2).

Numerics: the quantised activations are identical to the reference's (same fp32 division, clamp and RNE cast); the
GEMM differs only by summation order and by where the two fp32 scales multiply (cuBLASLt: in the epilogue, on the
fp32 accumulator), so the result agrees to fp32 rounding before the one rounding to bf16 (tests: <= 2^-8 relative +
an fp32 summation bound; on CPU `_scaled_mm` even returns the reference's bf16 bit for bit at the tested shapes).

Napkin math (decode, one token; H200 4.8 TB/s; FP8 = 1 B/param):
  GDN layer: in_proj_qkv 8192 x 2048 (16.8 MB) + in_proj_z 4096 x 2048 (8.4 MB) + out_proj 2048 x 4096 (8.4 MB)
      = 33.6 MB -> 7.0 us; x 30 layers = 1.007 GB -> 210 us.
  attention layer: q(+gate) 8192 x 2048 + k, v 512 x 2048 + o 2048 x 4096 = 27.3 MB -> 5.7 us; x 10 = 273 MB -> 57 us.
  Total 1.28 GB -> 267 us per token: more than the NVFP4 experts (design doc section 5), so this GEMV matters.
  The activation quantisation reads 4-16 KB and writes half that: launch-bound (~2-3 us each, 130 per token); the
  torch ops take 4 launches, `quantize_static_triton` one (implementations "triton_quant+scaled_mm", the default
  on CUDA beyond the decode GEMV's rows, and "triton_quant+gemv"). On the H200 the FP8 GEMMs
  of a lone decode step take ~0.8 ms for ~1.3 GB (benchmarks/RESULTS.md, runs 7-8): ~1.6 TB/s, a third of HBM.

Second op, "fp8_rowwise_linear" (the SAM 3 ViT's qkv / proj / fc1 / fc2): DYNAMIC row-wise W8A8. Weights quantised
once at load per output channel (`quantize_weight_rowwise`: e4m3 [N, K] + fp32 [N], scale = row amax / 448),
activations per token at run time (`kernels.fp8_quant`: e4m3 [M, K] + fp32 [M, 1]), then one
`torch._scaled_mm(xq, wq.T, scale_a [M, 1], scale_b [1, N], bias, out_dtype=bf16)` (CUTLASS row-wise kernel on sm_90,
scales and bias applied to the fp32 accumulator in the epilogue). Reference: `fp8_rowwise_linear_reference`, the
dequantise-then-matmul formula in fp32. No host syncs anywhere (scales stay on the device): CUDA-graph capturable;
`torch._scaled_mm` has a meta kernel and the Triton quantiser is a custom op with a fake, so
`torch.compile(fullgraph=True)` traces both paths. Napkin math at the ViT's shapes: `benchmarks/fp8_check.py`.

Accumulation precision on Hopper (why the tests' bound is not an fp32 one). A Hopper FP8 WGMMA adds its products
into an accumulator that keeps only ~13-14 mantissa bits (DeepSeek-V3 report, section 3.3.2, measured ~14 bits on
H800; NVIDIA does not document it), truncating. cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM = 0 -- what
`torch._scaled_mm(use_fast_accum=False)` (the default) selects, and CUTLASS's non-"FastAccum" schedule for the
row-wise kernel -- promotes the partial sums into fp32 registers every few WGMMAs (CUTLASS: every 4 k-blocks of 32,
i.e. 128 products) instead of once at the end (fast accum). So per output, with S = sum_k |xq_k wq_k| s_x s_w:
    |y - y_fp32| <= 2^-8 |y_fp32|  (bf16 output rounding, 2x for a tie)  +  ACC_REL_BOUND x S
where a chunk of <= 4 truncating WGMMA adds loses <= 4 x 2^-13 = 2^-11 of its own |sum|, and ACC_REL_BOUND = 2^-9
leaves 4x for the undocumented details (exact truncation point, cuBLAS choosing a different promotion interval).
Fast accumulation has no such bound short of K x 2^-13 (= 2^-1 at K = 4096): it is not used here.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.tolerance import compare  # noqa: F401  (re-exported for tests and the registry)

from kernels import fp8_gemv, fp8_skinny, fp8_swapped, gelu_fp8_quant
from kernels.fp8_quant import (
    quantize_rows_reference,
    quantize_rows_triton,
    quantize_static_reference,
    quantize_static_triton,
    static_supports,
)
from kernels.fp8_quant import supports as quant_triton_supports
from kernels.nvfp4 import E4M3_MAX, FP8Tensor, fp8_linear_reference

NAME = "fp8_linear"
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: sm_89 (Ada), sm_90 (Hopper), sm_100 (Blackwell)
ROWWISE_MIN_CAPABILITY = (9, 0)  # row-wise scaled FP8 GEMM (CUTLASS) in torch._scaled_mm
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROWWISE_NAME = "fp8_rowwise_linear"
ROWWISE_GELU_NAME = "fp8_rowwise_linear_gelu"  # the same of gelu(x): the ViT MLP's fc2, handed fc1's output
STATIC_ROWWISE_NAME = "fp8_static_rowwise_linear"  # row-wise weights, ONE calibrated activation scale (the ViT)
# Error per output of an FP8 GEMM with fp32 scales, in units of S = sum_k |products| (module docstring):
ACC_REL_BOUND_HOPPER = 2.0**-9  # tensor-core accumulator (~13 bits) promoted to fp32 every <= 128 products
FP32_UNIT_ROUNDOFF = 2.0**-24  # CPU `_scaled_mm` / the reference: fp32 sums, recursive bound (K - 1) x 2^-24


def accumulation_bound(k: int, device_type: str) -> float:
    """Worst-case summation error of an FP8 GEMM over K products on this kind of device, as a fraction of
    S = sum |products|: fp32 recursive summation (gamma_K ~ K u) on the CPU, the Hopper bound on a GPU."""
    return ACC_REL_BOUND_HOPPER if device_type == "cuda" else max(k - 1, 1) * FP32_UNIT_ROUNDOFF


def quantize_input_fp8(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> e4m3 x / input_scale, saturating at +-448 (static activation quantisation; the arithmetic of
    `kernels.nvfp4.quantize_fp8`, which the reference uses). Four torch kernels; `quantize_static_triton` is one."""
    return quantize_static_reference(x, input_scale)


def fp8_linear_scaled_mm(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None = None,
                         quantize=quantize_input_fp8) -> torch.Tensor:
    """Same contract as `fp8_linear_reference`: x [..., K] -> [..., N] in out_dtype (default x.dtype). `quantize`:
    the activation quantiser (torch ops here; the one-launch Triton kernel in `fp8_linear_triton_quant`)."""
    if w.input_scale is None:
        raise ValueError("fp8_linear_scaled_mm needs a static input_scale (weight-only FP8 is the reference path)")
    out_dtype = out_dtype or x.dtype
    k = x.shape[-1]
    n = w.data.shape[0]
    xq = quantize(x.reshape(-1, k), w.input_scale)  # [M, K] row-major
    s_in = w.input_scale.float().reshape(())
    s_w = w.scale.float()
    # use_fast_accum=False (torch's default, spelled out): fp32 promotion of the Hopper accumulator, see the docstring
    if s_w.dim() == 0:  # tensor-wise: one alpha = input_scale * weight_scale in the epilogue
        y = torch._scaled_mm(xq, w.data.t(), scale_a=s_in, scale_b=s_w, out_dtype=out_dtype, use_fast_accum=False)
    else:  # row-wise: per-token (here: one static value) x per-output-row scales
        scale_a = s_in.expand(xq.shape[0], 1).contiguous()
        y = torch._scaled_mm(xq, w.data.t(), scale_a=scale_a, scale_b=s_w.reshape(1, n), out_dtype=out_dtype,
                             use_fast_accum=False)
    return y.reshape(*x.shape[:-1], n)


def fp8_linear_triton_quant(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fp8_linear_scaled_mm` with the activations quantised by one Triton launch (bit-identical codes)."""
    return fp8_linear_scaled_mm(x, w, out_dtype, quantize=quantize_static_triton)


def fp8_linear_skinny(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode-sized calls (at most `fp8_skinny.SKINNY_MAX_M` rows) of narrow layers (at most SKINNY_MAX_N outputs:
    attention k_proj / v_proj) in one Triton launch with the quantiser fused and K split to fill the SMs
    (`kernels/fp8_skinny.py`, where the measurements are); every other call as `fp8_linear_triton_quant`."""
    out_dtype = out_dtype or x.dtype
    if not _skinny_serves(x, w, out_dtype):
        return fp8_linear_triton_quant(x, w, out_dtype)
    k = x.shape[-1]
    y = fp8_skinny.fp8_skinny_op(x.reshape(-1, k), w.data, w.scale.float(), w.input_scale.float(), out_dtype)
    return y.reshape(*x.shape[:-1], w.data.shape[0])


def _skinny_serves(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype) -> bool:
    """Whether `fp8_linear_skinny` runs its own kernel on this call (a static scale, a narrow layer, a supported
    shape) rather than the quantiser + scaled_mm."""
    k = x.shape[-1]
    m, n = (x.numel() // k if k else 0), w.data.shape[0]
    return (w.input_scale is not None and n <= fp8_skinny.SKINNY_MAX_N
            and fp8_skinny.supported(m, k, n, x.dtype, out_dtype))


# ---- activation codes made by the producer (the quantiser fused into the op before the projection) ----------------
def with_codes(impl_name: str):
    """The form of registry implementation `impl_name` of "fp8_linear" that takes the activation codes its input's
    producer already wrote (`kernels/rms_norm.py` / `kernels/attn_prep.py` *_fp8 ops: the same bits as its own
    quantiser), f(x, w, codes, out_dtype=None) -- or None where the implementation makes no separate codes (the
    reference, the in-loop GEMV, the split-K kernel on the layers it serves: they compute the same numbers from x)."""
    return _WITH_CODES.get(impl_name)


def _scaled_mm_codes(x: torch.Tensor, w: FP8Tensor, codes: torch.Tensor, out_dtype: torch.dtype | None = None):
    k = x.shape[-1]
    return fp8_linear_scaled_mm(x, w, out_dtype, quantize=lambda x2, s: codes.reshape(-1, k))


def _gemv_codes(x: torch.Tensor, w: FP8Tensor, codes: torch.Tensor, out_dtype: torch.dtype | None = None):
    return _gemv(x, w, out_dtype, prequantize=True, codes=codes.reshape(-1, x.shape[-1]))


def _skinny_codes(x: torch.Tensor, w: FP8Tensor, codes: torch.Tensor, out_dtype: torch.dtype | None = None):
    if not _skinny_serves(x, w, out_dtype or x.dtype):
        return _scaled_mm_codes(x, w, codes, out_dtype)
    return fp8_linear_skinny(x, w, out_dtype)  # its kernel quantises as it loads x (no separate codes to skip)


def _swapped(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None,
             codes: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if w.input_scale is None:
        raise ValueError("fp8_swapped: needs a static input_scale (weight-only FP8 is the reference path)")
    y = fp8_swapped.fp8_swapped_op(x.reshape(m, k), w.data, w.scale.float(), w.input_scale.float(),
                                   out_dtype or x.dtype, codes=None if codes is None else codes.reshape(m, k))
    return y.reshape(*x.shape[:-1], w.data.shape[0])


def fp8_linear_swapped(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Calls of `fp8_swapped.swapped_ok` rows (5-64: decode at 8-64 streams) as the one-launch quantiser + the
    tensor-core GEMM with the weight as the MMA's M (`kernels/fp8_swapped.py`). Same contract as
    `fp8_linear_reference`."""
    return _swapped(x, w, out_dtype)


def _swapped_codes(x: torch.Tensor, w: FP8Tensor, codes: torch.Tensor, out_dtype: torch.dtype | None = None):
    return _swapped(x, w, out_dtype, codes)


_WITH_CODES = {"triton_quant+gemv": _gemv_codes, "triton_quant+scaled_mm": _scaled_mm_codes,
               "scaled_mm": _scaled_mm_codes, "triton_skinny+scaled_mm": _skinny_codes,
               "triton_quant+swapped": _swapped_codes}


def _gemv(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None, prequantize: bool,
          codes: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    n = w.data.shape[0]
    if w.input_scale is None or not fp8_gemv.gemv_ok(m, n, k):
        raise ValueError(f"fp8_gemv: {m} rows x a {tuple(w.data.shape)} weight (static input_scale: "
                         f"{w.input_scale is not None}) is not a GEMV call (fp8_gemv.gemv_ok)")
    y = fp8_gemv.fp8_gemv_op(x.reshape(m, k), w.data, w.scale.float(), w.input_scale.float(), out_dtype or x.dtype,
                             prequantize, codes=codes)
    return y.reshape(*x.shape[:-1], n)


def fp8_linear_gemv(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode-sized calls (`fp8_gemv.gemv_ok`: 1-4 rows) as one CUDA-core GEMV launch, the activations quantised in
    its loop (`kernels/fp8_gemv.py`). Same contract as `fp8_linear_reference`."""
    return _gemv(x, w, out_dtype, prequantize=False)


def fp8_linear_quant_gemv(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fp8_linear_gemv` with the activation codes from the one-launch quantiser first (two launches, same bits)."""
    return _gemv(x, w, out_dtype, prequantize=True)


# ---- dynamic row-wise W8A8 (the ViT) ------------------------------------------------------------------------------
def quantize_weight_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 [N, K] contiguous, fp32 [N]): one scale per output channel, amax / 448 (done once, at load)."""
    data, scale = quantize_rows_reference(w.detach())
    return data.contiguous(), scale.reshape(-1)


def fp8_rowwise_linear_reference(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype: x quantised per token (`quantize_rows_reference`), both operands
    dequantised in fp32, multiplied in fp32, + bias, one rounding to x.dtype. Any device, any shape."""
    xq, sx = quantize_rows_reference(x.reshape(-1, x.shape[-1]))
    return _dequantised_linear(x, xq, sx, w_fp8, w_scale, bias)


def _dequantised_linear(x: torch.Tensor, xq: torch.Tensor, sx: torch.Tensor, w_fp8: torch.Tensor,
                        w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The references' product: codes xq [M, K] times their scales sx ([M, 1] or one), row-wise weights dequantised,
    multiplied in fp32, + bias, one rounding to x.dtype, in x's leading shape."""
    n = w_fp8.shape[0]
    y = (xq.float() * sx) @ (w_fp8.float() * w_scale.float().reshape(n, 1)).T  # [M, N] fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def rowwise_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None, use_fast_accum: bool = False) -> torch.Tensor:
    """The GEMM alone: e4m3 [M, K] x e4m3 [N, K]^T with scales [M, 1] x [1, N] (+ bf16 bias) -> bf16 [M, N].
    `use_fast_accum=True` is for the benchmark's comparison only (no accuracy bound, see the docstring)."""
    return torch._scaled_mm(xq, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.reshape(1, -1), bias=bias,
                            out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)


def _quantised_rowwise(quantize_rows, x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N]: `quantize_rows` ([M, K] -> codes, scales [M, 1]) on x's rows, then the GEMM."""
    k = x.shape[-1]
    xq, sx = quantize_rows(x.reshape(-1, k))
    return rowwise_scaled_mm(xq, sx, w_fp8, w_scale, bias).reshape(*x.shape[:-1], w_fp8.shape[0])


def fp8_rowwise_linear_scaled_mm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fast path, activations quantised with torch ops (which torch.compile can fuse into the op before)."""
    return _quantised_rowwise(quantize_rows_reference, x, w_fp8, w_scale, bias)


def fp8_rowwise_linear_triton_quant(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fast path, activations quantised by the one-pass Triton kernel (`kernels.fp8_quant`)."""
    return _quantised_rowwise(quantize_rows_triton, x, w_fp8, w_scale, bias)


# ---- the same of gelu(x): fc2 of the ViT MLP, its input's GELU inside the quantiser ------------------------------------
def fp8_rowwise_linear_gelu_reference(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_rowwise_linear_reference(F.gelu(x), ...)`: x is the pre-activation (exact erf GELU in x.dtype)."""
    return fp8_rowwise_linear_reference(torch.nn.functional.gelu(x), w_fp8, w_scale, bias)


def fp8_rowwise_linear_gelu_scaled_mm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GELU and the quantiser as torch ops (what inductor fused into a 0.91 ms looped reduction at batch 8 on the
    H200, waterfall run 6), then the row-wise GEMM."""
    return fp8_rowwise_linear_scaled_mm(torch.nn.functional.gelu(x), w_fp8, w_scale, bias)


def fp8_rowwise_linear_gelu_triton(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GELU and the quantiser in one Triton pass (`kernels.gelu_fp8_quant`), then the row-wise GEMM."""
    return _quantised_rowwise(gelu_fp8_quant.gelu_quantize_rows_triton, x, w_fp8, w_scale, bias)


def supports_rowwise_gelu_triton(*, device: str, dtype: torch.dtype, k: int, **info: Any) -> bool:
    """`supports_rowwise` and the GELU-quantiser's guard."""
    return (supports_rowwise(device=device, dtype=dtype, k=k, **info)
            and gelu_fp8_quant.supports(device=device, dtype=dtype, shape=(1, k)))


def describe_rowwise(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> dict[str, Any]:
    cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
    n = w_fp8.shape[0] if w_fp8.dim() == 2 else -1
    return dict(device=x.device.type, capability=cap, dtype=x.dtype, k=x.shape[-1],
                weight_shape=tuple(w_fp8.shape), weight_dtype=w_fp8.dtype, weight_contiguous=w_fp8.is_contiguous(),
                scale_ok=w_scale.dtype == torch.float32 and tuple(w_scale.shape) == (n,),
                bias_ok=bias is None or (bias.dtype == torch.bfloat16 and tuple(bias.shape) == (n,)))


def supports_rowwise(*, device: str, capability, dtype: torch.dtype, k: int, weight_shape: tuple[int, ...],
                     weight_dtype: torch.dtype, weight_contiguous: bool, scale_ok: bool, bias_ok: bool,
                     **_: Any) -> bool:
    """CUDA with row-wise FP8 GEMMs (cc >= 9.0: torch's CUTLASS kernel; Ada's FP8 tensor cores only get the
    tensor-wise cuBLASLt path); bf16 in and out (the row-wise kernel writes bf16); a contiguous e4m3 [N, K] weight
    with K, N multiples of 16 matching x; fp32 [N] scales; no bias or a bf16 [N] one."""
    if device != "cuda" or capability is None or tuple(capability) < ROWWISE_MIN_CAPABILITY:
        return False
    return (dtype == torch.bfloat16 and weight_dtype == torch.float8_e4m3fn and weight_contiguous
            and len(weight_shape) == 2 and weight_shape[1] == k and k % 16 == 0 and weight_shape[0] % 16 == 0
            and scale_ok and bias_ok)


def supports_rowwise_triton_quant(*, device: str, dtype: torch.dtype, k: int, **info: Any) -> bool:
    """`supports_rowwise` and the Triton quantiser's guard."""
    return (supports_rowwise(device=device, dtype=dtype, k=k, **info)
            and quant_triton_supports(device=device, dtype=dtype, shape=(1, k)))


def compare_rowwise(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Registry check: 1e-2 x max |ref| (bf16 rounding 2^-9 + the Hopper accumulation bound 2^-9 x S, S <~ a few
    x max |ref| for random data); the tests check the per-element bound of the docstring."""
    return compare(out, ref, tol=1e-2)


def _sample_rowwise(device) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(0)
    w_fp8, w_scale = quantize_weight_rowwise(torch.randn(96, 256, generator=g) * 0.02)
    x = torch.randn(70, 256, generator=g).to(torch.bfloat16)
    bias = (torch.randn(96, generator=g) * 0.1).to(torch.bfloat16)
    return (x.to(device), w_fp8.to(device), w_scale.to(device), bias.to(device)), {}


# ---- one static (calibrated) activation scale, row-wise weights: the ViT's `vit_fp8_static` linears ---------------
# Why: a per-token scale needs a reduction over each row before the first code can be written. For fc2, whose input
# is the GELU of fc1's 4,736-wide output, that reduction is what made an FP8 fc2 lose (0.634-0.91 ms a call at 8
# images against a 0.466 ms break-even; RESULTS.md, quant_probe runs 1-2, waterfall runs 6-8). With one scale per
# layer, calibrated once at start (`sammie.model.fp8`), the GELU, the division, the clamp and the cast are
# elementwise, which inductor can fuse into the GELU pass the bf16 path runs anyway (or, eager, one Triton launch).
def fp8_static_rowwise_linear_reference(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                                        bias: torch.Tensor | None, input_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype: x quantised with the one scale `input_scale` (fp32, one element;
    `quantize_static_reference`: RNE e4m3 of x / s saturated at +-448), both operands dequantised in fp32,
    multiplied in fp32, + bias, one rounding to x.dtype. Any device, any shape."""
    s = input_scale.float().reshape(())
    return _dequantised_linear(x, quantize_static_reference(x.reshape(-1, x.shape[-1]), s), s, w_fp8, w_scale, bias)


def _static_rowwise(quantize, x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, input_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N]: `quantize` (x [M, K], s []) -> codes, then the row-wise GEMM (`_quantised_rowwise`)
    with the one scale as every row's (`_scaled_mm` takes no tensor-wise x scale beside row-wise weight scales)."""
    s = input_scale.float().reshape(())

    def rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize(x2, s), s.expand(x2.shape[0], 1).contiguous()  # scales [M, 1] fp32: 4 bytes a token

    return _quantised_rowwise(rows, x, w_fp8, w_scale, bias)


def fp8_static_rowwise_linear_scaled_mm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                                        bias: torch.Tensor | None, input_scale: torch.Tensor) -> torch.Tensor:
    """Fast path, the quantiser as torch ops (elementwise: torch.compile can fuse it into the op before, e.g. the
    GELU), then the row-wise GEMM."""
    return _static_rowwise(quantize_static_reference, x, w_fp8, w_scale, bias, input_scale)


def fp8_static_rowwise_linear_triton_quant(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                                           bias: torch.Tensor | None, input_scale: torch.Tensor) -> torch.Tensor:
    """Fast path, the quantiser in one Triton launch (`quantize_static_triton`, the same codes), then the GEMM."""
    return _static_rowwise(quantize_static_triton, x, w_fp8, w_scale, bias, input_scale)


def describe_static_rowwise(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                            input_scale: torch.Tensor) -> dict[str, Any]:
    return dict(describe_rowwise(x, w_fp8, w_scale, bias),
                input_scale_ok=input_scale.dtype == torch.float32 and input_scale.numel() == 1
                and input_scale.device == x.device)


def supports_static_rowwise(*, input_scale_ok: bool, **info: Any) -> bool:
    """`supports_rowwise` and one fp32 activation scale on x's device."""
    return input_scale_ok and supports_rowwise(**info)


def supports_static_rowwise_triton_quant(*, device: str, dtype: torch.dtype, **info: Any) -> bool:
    """`supports_static_rowwise` and the static Triton quantiser's guard (Triton present)."""
    return (supports_static_rowwise(device=device, dtype=dtype, **info)
            and static_supports(device=device, dtype=dtype))


def _sample_static_rowwise(device) -> tuple[tuple, dict]:
    (x, w_fp8, w_scale, bias), _ = _sample_rowwise(device)
    input_scale = (x.float().abs().amax() / E4M3_MAX * 0.9).reshape(1)  # a little below the batch's amax: saturates
    return (x, w_fp8, w_scale, bias, input_scale.to(device)), {}


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None = None) -> dict[str, Any]:
    cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
    s = w.scale
    rowwise = s.dim() == 1
    k = x.shape[-1]
    word_aligned = k % 4 == 0 and w.data.dim() == 2 and w.data.stride(0) % 4 == 0 and w.data.data_ptr() % 4 == 0
    return dict(device=x.device.type, capability=cap, dtype=x.dtype, out_dtype=out_dtype or x.dtype,
                rows=x.numel() // k if k else 0, k=k, word_aligned=word_aligned, weight_shape=tuple(w.data.shape),
                weight_dtype=w.data.dtype,
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




def supports_triton_quant(*, device: str, dtype: torch.dtype, **info: Any) -> bool:
    """`supports` and the static Triton quantiser's guard (Triton present: not on a bare CPU install)."""
    return supports(device=device, dtype=dtype, **info) and static_supports(device=device, dtype=dtype)


def supports_gemv(*, device: str, capability, dtype: torch.dtype, out_dtype: torch.dtype, rows: int, k: int,
                  weight_shape: tuple[int, ...], weight_dtype: torch.dtype, weight_contiguous: bool, word_aligned: bool,
                  scale_ok: bool, has_input_scale: bool, **_: Any) -> bool:
    """The decode GEMV (`kernels/fp8_gemv.py`): CUDA with cc >= 8.9 (its PTX e4m3x2 -> f16x2 conversion) and Triton;
    the 1-4 rows `fp8_gemv.gemv_ok` accepts (the registry hands other calls on); a contiguous e4m3 [N, K] weight
    matching x, read as int32 words (`word_aligned`: K, the row stride and the address multiples of 4); a static
    input scale; any of the float input / output dtypes, per-tensor or per-row weight scales (no cuBLASLt rules: N
    and K multiples of 16, per-row scales with bf16 output on cc >= 9.0 only -- the fused decode projections,
    `qwen_engine.model.quantized.fused_fp8_projections`, have per-row scales)."""
    if device != "cuda" or capability is None or tuple(capability) < MIN_CAPABILITY or fp8_gemv.triton is None:
        return False
    return (dtype in IN_DTYPES and out_dtype in fp8_gemv.OUT_DTYPES and weight_dtype == torch.float8_e4m3fn
            and weight_contiguous and len(weight_shape) == 2 and weight_shape[1] == k and word_aligned and scale_ok
            and has_input_scale and fp8_gemv.gemv_ok(rows, weight_shape[0], k))


def supports_swapped(*, device: str, capability, dtype: torch.dtype, out_dtype: torch.dtype, rows: int, k: int,
                     weight_shape: tuple[int, ...], weight_dtype: torch.dtype, weight_contiguous: bool,
                     scale_ok: bool, has_input_scale: bool, **_: Any) -> bool:
    """The few-row tensor-core GEMM (`kernels/fp8_swapped.py`): Triton on a Hopper GPU (e4m3 wgmma; measured on the
    H200 only: other majors keep cuBLASLt), the rows `fp8_swapped.swapped_ok` takes (5-64), a contiguous e4m3 [N, K]
    weight matching x with K a multiple of 16 (16-byte rows for its cp.async tiles), a static input scale, per-tensor
    or per-row weight scales, any float input / output dtype."""
    if device != "cuda" or capability is None or capability[0] not in fp8_swapped.SWAPPED_MAJORS:
        return False
    return (fp8_swapped.triton is not None and dtype in IN_DTYPES and out_dtype in fp8_swapped.OUT_DTYPES
            and weight_dtype == torch.float8_e4m3fn and weight_contiguous and len(weight_shape) == 2
            and weight_shape[1] == k and scale_ok and has_input_scale
            and fp8_swapped.swapped_ok(rows, weight_shape[0], k))


def _sample(device) -> list[tuple[tuple, dict]]:
    """Two samples (the registry checks each path on the first it takes): 3 rows -- the decode GEMV, the skinny
    kernel, cuBLASLt -- and 8 rows -- the few-row tensor-core GEMM (5-64 rows, Hopper)."""
    from kernels.nvfp4 import quantize_fp8

    g = torch.Generator().manual_seed(0)
    data, scale = quantize_fp8(torch.randn(96, 128, generator=g) * 0.02)
    out = []
    for rows in (3, 8):
        x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        input_scale = x.float().abs().amax() / E4M3_MAX * 0.9  # a calibrated scale a little below this batch's amax
        w = FP8Tensor(data.to(device), scale.to(device), input_scale.to(device))
        out.append(((x.to(device), w), {}))
    return out


def register(registry) -> None:
    registry.add_op(NAME, fp8_linear_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="max |diff| <= 1e-2 x max |ref| (identical quantised activations; fp32 accumulation; "
                              "bf16 output rounding 2^-9)")
    # first: decode-sized calls (1-4 rows, `fp8_gemv.gemv_ok`) as a CUDA-core GEMV after the one-launch quantiser,
    # or with the quantiser's division in its loop (one launch; offline sm_90 SASS: 6.6-10.6 loop instructions per
    # weight against 3.2-4.3, and slower on the H200 except on k/v_proj, so second) (`kernels/fp8_gemv.py`; the
    # registry hands larger calls on); then decode-sized calls of narrow
    # layers in one Triton launch (quantiser fused, split K), larger ones as the next; then the
    # same cuBLASLt GEMM after a one-launch Triton quantiser (a decode step has ~130 of these layers: 390 launches
    # fewer than the torch-op quantiser); then the vendor GEMM through torch (cuBLASLt) with the torch-op quantiser:
    # the registry's "torch" kind. The registry's sample (3 rows, K = 128: unsplit) checks the skinny kernel at
    # start-up; its split-K path is covered by tests/test_kernel_fp8_skinny.py.
    registry.add_implementation(NAME, "triton_quant+gemv", fp8_linear_quant_gemv, supports_gemv, kind="triton")
    registry.add_implementation(NAME, "triton_gemv", fp8_linear_gemv, supports_gemv, kind="triton")
    # then 5-64 rows (decode at 8-64 streams) on the tensor-core GEMM with the weight as the MMA's M
    # (`kernels/fp8_swapped.py`, where the H200 measurements against cuBLASLt are)
    registry.add_implementation(NAME, "triton_quant+swapped", fp8_linear_swapped, supports_swapped, kind="triton")
    registry.add_implementation(NAME, "triton_skinny+scaled_mm", fp8_linear_skinny, supports_triton_quant,
                                kind="triton")
    registry.add_implementation(NAME, "triton_quant+scaled_mm", fp8_linear_triton_quant, supports_triton_quant,
                                kind="triton")
    registry.add_implementation(NAME, "scaled_mm", fp8_linear_scaled_mm, supports, kind="torch")

    registry.add_op(ROWWISE_NAME, fp8_rowwise_linear_reference, sample=_sample_rowwise, compare=compare_rowwise,
                    describe=describe_rowwise,
                    tolerance="max |diff| <= 1e-2 x max |ref| (identical quantised activations; Hopper FP8 "
                              "accumulation promoted to fp32 every <= 128 products: <= 2^-9 of sum |products|; "
                              "bf16 output rounding 2^-9)")
    # eager: the one-pass Triton quantiser first (~3x less memory traffic than the torch-op chain); the torch-op
    # quantiser is what torch.compile can fuse into the preceding LayerNorm / GELU (preference "torch")
    registry.add_implementation(ROWWISE_NAME, "triton_quant+scaled_mm", fp8_rowwise_linear_triton_quant,
                                supports_rowwise_triton_quant, kind="triton")
    registry.add_implementation(ROWWISE_NAME, "scaled_mm", fp8_rowwise_linear_scaled_mm, supports_rowwise,
                                kind="torch")

    registry.add_op(ROWWISE_GELU_NAME, fp8_rowwise_linear_gelu_reference, sample=_sample_rowwise,
                    compare=compare_rowwise, describe=describe_rowwise,
                    tolerance="as fp8_rowwise_linear (the GELU's bf16 values may differ by an ulp where the kernel's "
                              "erf and torch's differ in the last fp32 bit; one e4m3 step on those codes)")
    # eager: the one-pass Triton GELU-quantiser first; under inductor the engine asks for "torch" (sammie.model.fp8):
    # inductor's fusion of these torch ops measured faster than the Triton kernel there (waterfall run 8)
    registry.add_implementation(ROWWISE_GELU_NAME, "triton_gelu_quant+scaled_mm", fp8_rowwise_linear_gelu_triton,
                                supports_rowwise_gelu_triton, kind="triton")
    registry.add_implementation(ROWWISE_GELU_NAME, "scaled_mm", fp8_rowwise_linear_gelu_scaled_mm,
                                supports_rowwise, kind="torch")

    registry.add_op(STATIC_ROWWISE_NAME, fp8_static_rowwise_linear_reference, sample=_sample_static_rowwise,
                    compare=compare_rowwise, describe=describe_static_rowwise,
                    tolerance="as fp8_rowwise_linear (identical codes: the same fp32 division, clamp and RNE cast)")
    # eager: the one-launch quantiser first; under inductor the engine asks for "torch" (sammie.model.fp8): the torch
    # ops fuse into the GELU / LayerNorm pass before them
    registry.add_implementation(STATIC_ROWWISE_NAME, "triton_quant+scaled_mm", fp8_static_rowwise_linear_triton_quant,
                                supports_static_rowwise_triton_quant, kind="triton")
    registry.add_implementation(STATIC_ROWWISE_NAME, "scaled_mm", fp8_static_rowwise_linear_scaled_mm,
                                supports_static_rowwise, kind="torch")
