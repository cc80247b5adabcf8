"""NVFP4 and FP8 (E4M3, per-tensor) weight formats of the ModelOpt checkpoint, in plain PyTorch: the reference that
the loader, the W4A16 GEMM kernels and the accuracy oracle are checked against.

Format (`../shared/design/qwen3.6-nvfp4.md` sections 2.3-2.5; producer code `modelopt/torch/quantization/qtensor/
nvfp4_tensor.py: NVFP4QTensor.get_weights_scaling_factor(_2) / _cast_fp4 / quantize / dequantize`):

    W [..., N, K]  ->  packed      uint8          [..., N, K/2]   two E2M1 codes per byte, LOW nibble = even k
                       scales      float8_e4m3fn  [..., N, K/16]  one per 16 consecutive k
                       global_scale float32       []              amax(W) / (6 * 448)
    W[n, k] = (E2M1[code(n, k)] * float(scales[n, k // 16])) * global_scale     (the first product is exact)

E2M1 code = sign (bit 3) | magnitude index (bits 0-2) into (0, .5, 1, 1.5, 2, 3, 4, 6); rounding to nearest, ties to
even, saturating at 6. A block scale is `block_amax / (6 * global_scale)` cast to e4m3, so the block's largest element
lands on +-6.

FP8 layers: `weight = (W / weight_scale).to(e4m3)`, `weight_scale = amax(W) / 448` (fp32 scalar), static activation
`input_scale` (fp32 scalar) in the same convention.

The Blackwell W4A4 helpers at the bottom (activation quantisation, the 128x4 swizzled scale layout, the
`torch._scaled_mm(float4_e2m1fn_x2)` call) are checked in emulation only: the `torch._scaled_mm` path is UNTESTED ON
HARDWARE (no sm_100 GPU available to this project); see `w4a4_linear_scaled_mm`. `register(registry)` adds them as
op "nvfp4_w4a4_linear" (reference `w4a4_linear_reference`, "torch"-kind fast path `w4a4_linear_scaled_mm` behind
`supports_w4a4`); `qwen_engine.model.quantized.NVFP4Linear` runs it for W4A4 exports on Blackwell.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kernels.tolerance import compare

BLOCK = 16  # elements along K per e4m3 block scale (MXFP4 uses 32 with E8M0 scales)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9  # smallest positive e4m3 value; the floor for nonzero block scales

# value of each 4-bit code; code 8 is -0
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)
# midpoints between consecutive magnitudes; a magnitude exactly on an odd-indexed bound (0.75, 1.75, 3.5) rounds up
# to the even code above it, one on an even-indexed bound (0.25, 1.25, 2.5, 5) stays on the even code below it
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_E2M1_ODD_BOUNDS = _E2M1_BOUNDS[[1, 3, 5]]


class NVFP4Tensor(NamedTuple):
    """A quantised weight `[..., N, K]`. Unpacks like the `(packed, scales, global_scale)` triple.

    `global_scale` is a scalar (as stored in the checkpoint), or one value per matrix (`[...]`), or one value per
    output row (`[..., N]`; what the loader hands the kernels, so that gate/up or other fused projections with
    different ModelOpt global scales stay exact).
    """

    packed: torch.Tensor  # uint8 [..., N, K/2]
    scales: torch.Tensor  # float8_e4m3fn [..., N, K/16]
    global_scale: torch.Tensor  # float32 [] | [...] | [..., N]

    @property
    def shape(self) -> torch.Size:  # logical (unpacked) shape
        return torch.Size((*self.packed.shape[:-1], 2 * self.packed.shape[-1]))


class FP8Tensor(NamedTuple):
    """A per-tensor static FP8 weight `[N, K]` with its activation scale (None where the checkpoint has none)."""

    data: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [] : amax / 448
    input_scale: torch.Tensor | None = None  # float32 [] : static activation scale, same convention

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


# ---- E2M1 codes --------------------------------------------------------------------------------------------------
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> uint8 codes 0..15; RNE, saturating at +-6 (ModelOpt
    `_cast_fp4`)."""
    a = x.float().abs()
    mag = torch.searchsorted(_E2M1_BOUNDS.to(a.device), a.contiguous())  # 0..7: number of bounds strictly below a
    mag = mag + torch.isin(a, _E2M1_ODD_BOUNDS.to(a.device)).long()  # ties at odd bounds go to the even code above
    return (mag | ((x < 0).long() << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> bytes [..., K/2]; element 2i in the low nibble, 2i+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number ({codes.shape[-1]}) of E2M1 codes")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K/2] -> uint8 codes [..., K] (inverse of `pack_e2m1`)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed E2M1 data must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# ---- NVFP4 -------------------------------------------------------------------------------------------------------
def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor `weight_scale_2` = amax / (6 * 448): the largest block scale lands on 448."""
    return w.abs().amax().float() / (E2M1_MAX * E4M3_MAX)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | float | None = None) -> NVFP4Tensor:
    """W [..., N, K] (K % 16 == 0) -> NVFP4Tensor(packed [..., N, K/2], scales [..., N, K/16], global_scale).

    ModelOpt's arithmetic in fp32: `g = amax / 2688` unless given (ModelOpt passes a shared one for gate/up);
    `s = e4m3(block_amax / (6 g))`; `code = e2m1(w / (s g))`. Two deliberate guards on the block scale, neither of
    which changes ModelOpt's output for a block it quantises sensibly: an all-zero block gets scale 1.0 (as ModelOpt
    does), and a nonzero block is clamped to [2^-9, 448] (ModelOpt 0.37 does not clamp; a block whose scale would
    round to 0 in e4m3 -- block amax below ~2e-6 x the tensor amax -- would give it inf/NaN codes and a zero scale).
    A `global_scale` tensor may have shape `[...]` (one per matrix).
    """
    if w.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs K divisible by {BLOCK}, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"quantize_nvfp4 expects a float tensor, got {w.dtype}")
    w = w.float()
    g = nvfp4_global_scale(w) if global_scale is None else torch.as_tensor(global_scale, dtype=torch.float32)
    g = g.to(w.device)
    g_b = g.reshape(*g.shape, *([1] * (w.dim() - g.dim())))  # [...] -> [..., 1, 1]: broadcast over [..., N, K/16]
    blocks = w.unflatten(-1, (-1, BLOCK))  # [..., N, K/16, 16]
    s = blocks.abs().amax(-1) / (E2M1_MAX * g_b)
    s = torch.where(s == 0, torch.ones_like(s), s.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)).to(torch.float8_e4m3fn)
    x = blocks / (s.float() * g_b).unsqueeze(-1)
    codes = e2m1_encode(x).flatten(-2)
    return NVFP4Tensor(pack_e2m1(codes), s, g)


def _broadcast_global(global_scale: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Shape a scalar / per-matrix [...] / per-row [..., N] global scale to broadcast over [..., N, K/16]."""
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    if g.dim() == 0:
        return g
    lead = packed.shape[:-1]  # [..., N]
    if tuple(g.shape) == tuple(lead):
        return g.unsqueeze(-1)
    if tuple(g.shape) == tuple(lead[:-1]):
        return g[..., None, None]
    raise ValueError(f"global scale of shape {tuple(g.shape)} fits neither [], {tuple(lead[:-1])} nor {tuple(lead)}")


def nvfp4_block_values(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E2M1[code] * block_scale, fp32 [..., N, K], without the global scale.

    Every product is exact in fp32 AND in bf16 (2 + 4 significant bits, exponents within [2^-10, 2688]), which is
    why a W4A16 kernel may dequantise a tile to bf16 losslessly and apply the global scale in its epilogue.
    """
    _check_nvfp4_shapes(packed, scales)
    vals = e2m1_decode(unpack_e2m1(packed)).unflatten(-1, (-1, BLOCK))
    return (vals * scales.float().unsqueeze(-1)).flatten(-2)


def dequantize_nvfp4(
    packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., N, K/2] uint8 + [..., N, K/16] e4m3 + global -> [..., N, K] in `dtype`.

    `(E2M1[code] * scale) * global` in fp32: the exact block value times the global scale, one rounding (design doc
    2.5). ModelOpt's own `NVFP4QTensor.dequantize` multiplies `value * (scale * global)`, which rounds twice and
    differs by at most 1 ulp where |value| is 1.5 x a power of two; a kernel that dequantises tiles exactly and applies
    the global scale in its epilogue matches this function's order.
    """
    g = _broadcast_global(global_scale, packed)
    return (nvfp4_block_values(packed, scales) * g).to(dtype)


def _check_nvfp4_shapes(packed: torch.Tensor, scales: torch.Tensor) -> None:
    if packed.dtype != torch.uint8:
        raise TypeError(f"NVFP4 packed weight must be uint8, got {packed.dtype}")
    if scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"NVFP4 block scales must be float8_e4m3fn, got {scales.dtype}")
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * BLOCK != packed.shape[-1] * 2:
        raise ValueError(
            f"NVFP4 scales {tuple(scales.shape)} do not match packed weight {tuple(packed.shape)} "
            f"(expected [..., N, K/{BLOCK}] for [..., N, K/2])"
        )


# ---- FP8 E4M3 per-tensor -----------------------------------------------------------------------------------------
def quantize_fp8(w: torch.Tensor, scale: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W -> (e4m3 W / scale, scale); ModelOpt `to_quantized_weight` FP8 branch with `scale = amax / 448` by default.

    Values are clamped to +-448 first (a no-op for the computed scale; a given static activation scale may be exceeded).
    """
    w = w.float()
    s = w.abs().amax() / E4M3_MAX if scale is None else torch.as_tensor(scale, dtype=torch.float32, device=w.device)
    return (w / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s.float()


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 data must be float8_e4m3fn, got {data.dtype}")
    return (data.float() * torch.as_tensor(scale, dtype=torch.float32, device=data.device)).to(dtype)


# ---- linear layers: the arithmetic the GEMM kernels reproduce -----------------------------------------------------
def w4a16_linear_reference(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """W4A16 (this checkpoint's experts, shared expert, lm_head): x [..., K] unquantised, y = x @ W.T accumulated in
    fp32, W dequantised exactly; returned in x.dtype. `w` may be one matrix [N, K] with a scalar or per-row global."""
    return (x.float() @ dequantize_nvfp4(*w).T).to(x.dtype)


def fp8_linear_reference(x: torch.Tensor, w: FP8Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Static-scale W8A8 (GDN and attention projections): x [..., K] quantised with `w.input_scale` (saturating
    e4m3), exact e4m3 products summed in fp32, times `input_scale * scale`: the arithmetic of
    `torch._scaled_mm(x_fp8, w.data.T, scale_a=input_scale, scale_b=scale)`. Without an input scale: weight-only."""
    out_dtype = out_dtype or x.dtype
    if w.input_scale is None:
        return (x.float() @ dequantize_fp8(w.data, w.scale).T).to(out_dtype)
    xq, _ = quantize_fp8(x, w.input_scale)
    return ((xq.float() @ w.data.float().T) * (w.input_scale * w.scale)).to(out_dtype)


# ---- Blackwell W4A4 (cuBLASLt block-scaled FP4 through torch._scaled_mm) ------------------------------------------
# The scale operand of a block-scaled cuBLAS GEMM is tiled in 128 x 4 blocks (128 rows, 4 scale columns = 64 K
# elements), each block stored as 32 x 16: within a block, row r and scale column c sit at (r % 32) * 16 + (r // 32) * 4
# + c; blocks are laid out row-block-major. Rows are padded to a multiple of 128, scale columns to a multiple of 4.
# Source: cuBLAS docs "1D block scaling factors layout"; torchao `to_blocked`; vLLM `swizzle_blockscale`; Triton's
# 5-D `(M // 128, K // 16 // 4, 32, 4, 4)`; torch `SwizzleType.SWIZZLE_32_4_4` -- all the same memory order.
def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Row-major scales [M, C] -> flat swizzled buffer of 128 * ceil(M/128) * 4 * ceil(C/4) elements (zero padded)."""
    rows, cols = scales.shape
    rb, cb = _ceil_div(rows, 128), _ceil_div(cols, 4)
    padded = scales.new_zeros(rb * 128, cb * 4)
    padded[:rows, :cols] = scales
    # [rb, 4 (r // 32 within block), 32 (r % 32), cb, 4 (c)] -> [rb, cb, r % 32, r // 32, c]
    return padded.view(rb, 4, 32, cb, 4).permute(0, 3, 2, 1, 4).flatten()


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `to_blocked`: flat swizzled buffer -> row-major [rows, cols] (padding dropped)."""
    rb, cb = _ceil_div(rows, 128), _ceil_div(cols, 4)
    if blocked.numel() != rb * cb * 512:
        raise ValueError(
            f"swizzled buffer has {blocked.numel()} elements, expected {rb * cb * 512} for [{rows}, {cols}]"
        )
    padded = blocked.view(rb, cb, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rb * 128, cb * 4)
    return padded[:rows, :cols]


def blocked_offset(row: torch.Tensor, col: torch.Tensor, cols: int) -> torch.Tensor:
    """Offset of scale (row, col) in the swizzled buffer, written from the cuBLAS layout description (for tests)."""
    cb = _ceil_div(cols, 4)
    return (row // 128) * (cb * 512) + (col // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4


def quantize_activation_nvfp4(x: torch.Tensor, input_scale: torch.Tensor | float | None = None) -> NVFP4Tensor:
    """Activations [..., K] -> NVFP4 [M, K] for a W4A4 GEMM; same encoding as weights.

    `input_scale` is ModelOpt's static activation global scale (amax / 2688, only in W4A4 exports); without one the
    global scale is dynamic (this batch's amax / 2688). This checkpoint is W4A16 and ships no usable `input_scale`, so
    W4A4 on it means dynamic activation quantisation: an accuracy change that the oracle must gate (design doc 4).
    """
    return quantize_nvfp4(x.reshape(-1, x.shape[-1]), input_scale)


def _w4a4_weight_global(w: NVFP4Tensor) -> torch.Tensor:
    """The weight's global scale for a W4A4 GEMM: a scalar, or one per output row [N] (the loader's per-row form; a
    fused gate/up keeps each half's own). Either way it multiplies output columns, after the block-scaled GEMM."""
    g = w.global_scale
    if g.dim() != 0 and tuple(g.shape) != (w.packed.shape[-2],):
        raise ValueError(f"W4A4 needs a scalar or per-row [N={w.packed.shape[-2]}] weight global scale, got "
                         f"shape {tuple(g.shape)}")
    return g


def w4a4_linear_reference(x: torch.Tensor, w: NVFP4Tensor, input_scale=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Emulated W4A4 linear, x [..., K] -> [..., N]: quantise x to NVFP4, multiply the exact block values (E2M1 x e4m3
    scale) of both operands in fp32 and apply the product of the two global scales to the result, which is the
    arithmetic of the block-scaled tensor-core GEMM up to fp32 summation order. The weight's global scale may be a
    scalar or per output row [N] (applied per output column: exact in the same way)."""
    g = _w4a4_weight_global(w)
    xq = quantize_activation_nvfp4(x, input_scale)
    y = nvfp4_block_values(xq.packed, xq.scales) @ nvfp4_block_values(w.packed, w.scales).T
    y = y * (xq.global_scale * g)
    return y.to(out_dtype).reshape(*x.shape[:-1], w.packed.shape[-2])


def w4a4_scaled_mm_args(xq: NVFP4Tensor, w: NVFP4Tensor) -> tuple[tuple, torch.Tensor]:
    """Operands of `torch._scaled_mm` for NVFP4 x NVFP4, and the fp32 factor ([] or [N]) to apply to its output.

    a = x packed [M, K/2] as float4_e2m1fn_x2 (row-major), b = w packed viewed [K/2, N] (column-major), scales swizzled
    e4m3; cuBLAS multiplies block scales only, so the two global scales are applied afterwards (torchao does the same).
    The activation's global scale must be a scalar; the weight's a scalar or per output row [N].
    """
    if xq.global_scale.dim() != 0:
        raise ValueError("torch._scaled_mm path needs a scalar activation global scale")
    g = _w4a4_weight_global(w)
    a = xq.packed.contiguous().view(torch.float4_e2m1fn_x2)
    b = w.packed.contiguous().view(torch.float4_e2m1fn_x2).t()
    sa = to_blocked(xq.scales)
    sb = to_blocked(w.scales)
    return (a, b, sa, sb), xq.global_scale * g


W4A4_MIN_CAPABILITY = (10, 0)  # block-scaled FP4 tensor cores with e4m3 1x16 scales in cuBLASLt (B200 = sm_100)


def _has_float4() -> bool:
    return hasattr(torch, "float4_e2m1fn_x2")


def supports_w4a4_scaled_mm(device: torch.device | str | None = None) -> bool:
    """Native NVFP4 `torch._scaled_mm` needs compute capability >= 10 (B200: 10.0) and a torch with float4 dtypes."""
    if not _has_float4() or not torch.cuda.is_available():
        return False
    device = torch.device(device) if device is not None else torch.device("cuda")
    return device.type == "cuda" and tuple(torch.cuda.get_device_capability(device)) >= W4A4_MIN_CAPABILITY


def w4a4_linear_scaled_mm(x: torch.Tensor, w: NVFP4Tensor, input_scale=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Native W4A4 linear on Blackwell. UNTESTED ON HARDWARE: only its operands and the shape/scale-size checks of
    `torch._scaled_mm` (meta device) are tested; numerics are those of `w4a4_linear_reference` by construction."""
    if not supports_w4a4_scaled_mm(x.device):
        raise RuntimeError("native NVFP4 torch._scaled_mm needs a CUDA device of compute capability >= 10")
    xq = quantize_activation_nvfp4(x, input_scale)
    (a, b, sa, sb), alpha = w4a4_scaled_mm_args(xq, w)
    y = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    return (y * alpha).to(out_dtype).reshape(*x.shape[:-1], w.packed.shape[-2])


# ---- registry entry: op "nvfp4_w4a4_linear" -------------------------------------------------------------------------
W4A4_OP = "nvfp4_w4a4_linear"
W4A4_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activation and output dtypes (cast around the GEMM)


def describe_w4a4(x: torch.Tensor, w: NVFP4Tensor, input_scale=None, out_dtype=torch.bfloat16) -> dict[str, Any]:
    """Info for `supports_w4a4` (must not raise: the registry calls it on any arguments of the op)."""
    p, s, g = w.packed, w.scales, torch.as_tensor(w.global_scale)
    weight_ok = (p.dim() == 2 and s.dim() == 2 and p.dtype == torch.uint8 and s.dtype == torch.float8_e4m3fn
                 and s.shape[0] == p.shape[0] and s.shape[1] * BLOCK == 2 * p.shape[1])
    return dict(device=x.device.type, capability=torch.cuda.get_device_capability(x.device) if x.is_cuda else None,
                float4=_has_float4(), dtype=x.dtype, out_dtype=out_dtype, k=x.shape[-1] if x.dim() else -1,
                weight_k=2 * p.shape[-1] if p.dim() else -1, n=p.shape[0] if p.dim() else -1, weight_ok=weight_ok,
                global_ok=g.dim() == 0 or tuple(g.shape) == (p.shape[0],),
                input_scale_ok=input_scale is None or torch.as_tensor(input_scale).numel() == 1)


def supports_w4a4(*, device: str, capability, float4: bool, dtype: torch.dtype, out_dtype: torch.dtype, k: int,
                  weight_k: int, n: int, weight_ok: bool, global_ok: bool, input_scale_ok: bool, **_: Any) -> bool:
    """`w4a4_linear_scaled_mm` can run: CUDA of compute capability >= 10.0 with torch's float4 dtypes; a 2-D NVFP4
    weight [N, K] whose K matches x, with a scalar or per-row global; a scalar (or no) input scale; and cuBLASLt's
    alignment as `_scaled_mm` checks it (`Blas.cpp`: mat1 [M, K/2] with K/2 % 16 == 0, mat2 [K/2, N] with both % 16),
    i.e. K % 32 == 0 and N % 16 == 0. The swizzled scales need nothing more: `to_blocked` pads rows to 128 and scale
    columns to 4."""
    if device != "cuda" or capability is None or tuple(capability) < W4A4_MIN_CAPABILITY or not float4:
        return False
    return (dtype in W4A4_DTYPES and out_dtype in W4A4_DTYPES and weight_ok and global_ok and input_scale_ok
            and k == weight_k and k % 32 == 0 and n % 16 == 0)


def _sample_w4a4(device) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(0)
    w = quantize_nvfp4(torch.randn(96, 160, generator=g) * 0.02)
    w = w._replace(global_scale=w.global_scale.expand(96).clone())  # per-row, as the loader hands it over
    x = torch.randn(3, 160, generator=g).to(torch.bfloat16)
    input_scale = x.float().abs().amax() / (E2M1_MAX * E4M3_MAX) * 0.9  # a calibrated scale a little below amax
    w = NVFP4Tensor(*(t.to(device) for t in w))
    return (x.to(device), w, input_scale.to(device), torch.bfloat16), {}


def register(registry) -> None:
    registry.add_op(W4A4_OP, w4a4_linear_reference, sample=_sample_w4a4, compare=compare, describe=describe_w4a4,
                    tolerance="max |diff| <= 1e-2 x max |ref| (identical quantised activations, exact E2M1 x e4m3 "
                              "products, fp32 accumulation; bf16 output rounding 2^-9)")
    # cuBLASLt's block-scaled FP4 GEMM through torch, not our kernel: the registry's "torch" kind. UNTESTED ON HARDWARE.
    registry.add_implementation(W4A4_OP, "scaled_mm", w4a4_linear_scaled_mm, supports_w4a4, kind="torch")
