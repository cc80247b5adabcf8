"""The two RMSNorms of Qwen3.5/3.6-MoE as single Triton launches: the zero-centred one (`rms_norm_zc`) and the gated
one closing each GDN layer (`rms_norm_gated`).

Contract. References `rms_norm_zc_reference` / `rms_norm_gated_reference` below are exactly
`qwen_engine.model.norm.ZeroCentredRMSNorm.forward` / `GatedRMSNorm.forward` with the weight and eps passed in:
    rms_norm_zc(x, weight, eps):        y = (x / rms(x) * (1 + w))                         in fp32, cast once to x.dtype
    rms_norm_gated(x, z, weight, eps):  y = ((w * (x / rms(x)).to(x.dtype)) * silu(z.float())).to(x.dtype)
x (and z) [..., D] in bf16, fp16 or fp32, any leading dims, unit stride in the last dim (rows may be strided: a head
slice of a fused projection is not copied); weight [D] (zero-centred for the first, not for the second); rms(x) =
sqrt(mean(x^2) + eps), over the last dim in fp32. Output: x's shape (contiguous) and dtype. Custom ops
`qwen::rms_norm_zc`, `qwen::rms_norm_gated` (traceable by torch.compile); no host reads of device values, so they can
be captured in a CUDA graph. Two fused variants of the same kernels, each saving a launch of decode-step glue:
    add_rms_norm_zc(x, h, weight, eps): (s, rms_norm_zc(s)), s = x + h rounded to x.dtype -- the decoder layer's
        residual add + post-attention norm (40 launches per step); bf16/fp32; the sum bit-identical to torch's and
        the norm computed from the rounded sum, as the unfused code does (`_round`: no contraction of the rounding)
    rms_norm_gated with an fp32 x and a bf16/fp16 z (`rounds_x`): x rounded to z.dtype first, output z.dtype -- the
        GDN output's `o.to(dtype)` copy (30 launches per step), same numbers as the separate cast.

Why. A decode step of the full model is ~6,000 tiny kernels, and the references are ~10 kernels each (x.float(),
pow, mean, + eps, rsqrt, mul, weight.float(), 1 + w, mul, cast; the gated one ~12). They run ~130 times per step: 2 per
layer x 40 + the per-head q/k norms of the 10 attention layers x 2 + the final norm = 101 zero-centred (each q/k call
covers all heads of all tokens: x [T, H, 256]), and one gated per GDN layer = 30 (x [T, 32 heads, 128]). One launch
each takes ~1,300 kernels out of every step.

Design. A program owns BLOCK_R rows x BLOCK_D = next_power_of_2(D) columns (D <= MAX_DIM = 8192: a 32 KB fp32 row in
registers across 8 warps), loads the tile once, reduces x^2 per row in fp32, and writes the result: one read of x (and
z), one read of the weight, one write. BLOCK_R packs small rows (per-head norms, D = 64-256) into ~1K-element tiles;
rows past R and columns past D are masked.

Numerics. Every reference operation is done in fp32 in the same order ((x * r) * (1 + w); (w * y) * silu(z)), and
each cast of the reference is reproduced where it happens: the gated op rounds the normalised x to x.dtype, then the
product w * y to the dtype torch gives it (promote(w, x): bf16 when both are bf16), before the fp32 gate multiply.
Left: the summation order of the mean, rsqrt / exp ulps (tl.rsqrt on a GPU is the ~2-ulp approximation, as torch's
CUDA rsqrt), so outputs agree to ~1e-7 relative before the final rounding; in bf16/fp16 that flips a rounding of
under 1% of the elements by one ulp. Tolerances (`compare`): max |diff| <= 1e-5 x max |ref| for fp32, 1e-2 for
bf16/fp16 (one output ulp is 2^-8 relative at worst; measured numbers in tests/test_kernel_rms_norm.py).
The interpreter truncates fp32 -> bf16 casts instead of rounding to nearest even (`kernels/w4a16_gemm.py`); under it
the kernel rounds bf16 with the integer round-to-nearest-even trick (`_cast`), so CPU tests see the GPU's numbers
(its fp32 -> fp16 casts already round to nearest even).

Napkin math (H200, 4.8 TB/s). A decode row of the hidden state is D = 2048 bf16 = 4 KB: read x + the weight + write
y = 12 KB -> 2.5 ns of bandwidth against a few us per kernel launch (or ~1-2 us per node in a replayed CUDA graph;
unmeasured for these kernels). Launch-bound, not bandwidth-bound: fusion pays by the kernel count, ~10 -> 1, not by
bytes. Prefill (T = 8192 tokens): 32 MB per norm -> ~7 us, where one fused pass also saves the ~10x traffic of the
unfused chain.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels import pdl, tolerance
from kernels.device import triton_device_ok

try:
    import triton
    import triton.language as tl

    from kernels.fp8_quant import static_codes
    from kernels.pdl import enter as pdl_enter
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

ZC, GATED, ADD_ZC = "rms_norm_zc", "rms_norm_gated", "add_rms_norm_zc"
ZC_FP8, GATED_FP8 = "rms_norm_zc_fp8", "rms_norm_gated_fp8"  # + the e4m3 codes of the output (static scale)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ADD_DTYPES = (torch.bfloat16, torch.float32)  # the residual sum is rounded with `_round`: bf16 (or none in fp32)
MIN_CAPABILITY = (8, 0)  # bf16 loads/stores and casts in hardware
MAX_DIM = 8192  # one BLOCK_D tile per row: 8192 fp32 = 32 KB of registers over 8 warps
TILE = 1024  # elements per program for small rows (BLOCK_R x BLOCK_D): 4-16 per-head rows of D = 64-256
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # x max |ref|, module docstring


# ---- references -----------------------------------------------------------------------------------------------------
def rms_norm_zc_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`ZeroCentredRMSNorm.forward`: fp32 throughout, one cast back to x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def rounds_x(x: torch.Tensor, z: torch.Tensor) -> bool:
    """The gated norm's widened input: x fp32 (the GDN core's output) with z in the model dtype bf16/fp16. x is then
    rounded to z.dtype first -- `GatedDeltaNet._output`'s `o.to(dtype)`, done inside the kernel to save its launch."""
    return x.dtype == torch.float32 and z.dtype in (torch.bfloat16, torch.float16)


def rms_norm_gated_reference(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`GatedRMSNorm.forward`: normalised x cast to x.dtype, times the weight in the weight/x dtype, times the fp32
    SiLU gate, cast to x.dtype. An fp32 x with a bf16/fp16 z (`rounds_x`) is first rounded to z.dtype."""
    if rounds_x(x, z):
        x = x.to(z.dtype)
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * y * F.silu(z.float())).to(x.dtype)


def add_rms_norm_zc_reference(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's `x = x + h; post_attention_layernorm(x)`: (s, y) with s = x + h in x.dtype (torch rounds
    the fp32 sum once) and y = `rms_norm_zc_reference(s, weight, eps)`, the norm of the *rounded* sum."""
    s = x + h
    return s, rms_norm_zc_reference(s, weight, eps)


def rms_norm_zc_fp8_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, input_scale: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, codes): y = `rms_norm_zc_reference`, codes = `fp8_quant.quantize_static_reference(y, input_scale)` -- the
    norm and the quantiser of the FP8 projection that reads it (static per-tensor scale, fp32 [])."""
    from kernels.fp8_quant import with_static_codes

    return with_static_codes(rms_norm_zc_reference(x, weight, eps), input_scale)


def rms_norm_gated_fp8_reference(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                                 input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, codes) as `rms_norm_zc_fp8_reference`, for `rms_norm_gated_reference`."""
    from kernels.fp8_quant import with_static_codes

    return with_static_codes(rms_norm_gated_reference(x, z, weight, eps), input_scale)


# ---- Triton kernels -------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _cast(v, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
        """fp32 v -> DTYPE, rounded to nearest even. The interpreter truncates fp32 -> bf16 (and mangles fp32
        subnormals), so there the bf16 bits are made from v's fp32 bits: add 0x7FFF + the lowest kept bit, keep the
        high 16 (bf16 is the top half of fp32). Finite v only (a NaN may come out as inf): the interpreter is for
        tests."""
        if INTERPRET and DTYPE == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return v.to(DTYPE)

    @triton.jit
    def _round(v, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
        """fp32 v rounded (to nearest even) to DTYPE's precision, returned in fp32. bf16 by integer ops on the bits,
        which the compiler can neither drop nor contract into an FMA with the next add (compiled for the H200, the
        `.to(bf16).to(fp32)` round trips of kernels/moe_combine.py left 2-3% of its outputs an ulp off torch's). For
        intermediates that torch rounds between ops; `_cast` is for a kernel's final store."""
        if DTYPE == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
            return tl.where(v != v, v, r)  # a NaN stays NaN (the GPU's canonical 0x7FFFFFFF would carry into -0)
        return v  # fp32: nothing to round (the callers' supports() admit bf16 and fp32 only)

    @triton.jit
    def _row_tile(R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """This program's rows [BR], columns [BD], column mask [BD] and tile mask [BR, BD] (R rows of D)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        c_ok = cols < D
        return rows, cols, c_ok, (rows < R)[:, None] & c_ok[None, :]

    @triton.jit
    def _load_rows(ptr, rows, cols, stride, ok):
        """[BLOCK_R, BLOCK_D] tile of rows (int64 offsets) in fp32; masked entries 0."""
        return tl.load(ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def _inv_rms(xf, D, eps):
        """[BLOCK_R] 1 / sqrt(mean(x^2) + eps) of an fp32 tile whose masked entries are 0."""
        return tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)

    @triton.jit
    def _static_scale(s_in, QUANT: tl.constexpr):
        """The static scale (fp32 []) the QUANT kernels' codes use, loaded at their start: after their row reduction
        (a CTA barrier, which later loads do not cross) the load would add an L2 round trip to the kernel's chain."""
        if QUANT:
            sc = tl.load(s_in)
        else:
            sc = 0.0
        return sc

    @triton.jit
    def _store_out(out, codes, sc, rows, cols, s_o, s_c, ok, y, INTERPRET: tl.constexpr, QUANT: tl.constexpr):
        """Store fp32 y rounded to out's dtype; QUANT: also the e4m3 codes of that rounded value with the static scale
        sc (fp32, `_static_scale`) -- what `fp8_quant.quantize_static_reference` gives for the stored tensor, bit for
        bit."""
        dt = out.dtype.element_ty
        yo = _cast(y, dt, INTERPRET)
        r64 = rows.to(tl.int64)[:, None]
        tl.store(out + r64 * s_o + cols[None, :], yo, mask=ok)
        if QUANT:
            tl.store(codes + r64 * s_c + cols[None, :], static_codes(_stored_value(y, yo, dt, INTERPRET), sc),
                     mask=ok)

    @triton.jit
    def _stored_value(y, yo, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
        """The fp32 value of the stored yo = `_cast(y, DTYPE)`: for bf16 by `_round`'s bit operations (the same
        round to nearest even, which the compiler can neither drop nor contract, where a `.to(bf16).to(fp32)` round
        trip was seen to be -- kernels/moe_combine.py), else the cast back."""
        if DTYPE == tl.bfloat16:
            return _round(y, DTYPE, INTERPRET)
        return yo.to(tl.float32)

    @triton.jit
    def _rms_norm_zc_kernel(x, w, out, R, D, s_x, s_o, eps, codes, s_c, s_in,
                            BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
                            QUANT: tl.constexpr = False, USE_PDL: tl.constexpr = False):
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        rows, cols, c_ok, ok = _row_tile(R, D, BLOCK_R, BLOCK_D)
        xf = _load_rows(x, rows, cols, s_x, ok)  # [BR, BD]
        wf = tl.load(w + cols, mask=c_ok, other=0.0).to(tl.float32)  # [BD]
        sc = _static_scale(s_in, QUANT)
        y = (xf * _inv_rms(xf, D, eps)[:, None]) * (1.0 + wf)[None, :]
        _store_out(out, codes, sc, rows, cols, s_o, s_c, ok, y, INTERPRET, QUANT)

    @triton.jit
    def _add_rms_norm_zc_kernel(x, h, w, s_out, out, R, D, s_x, s_h, s_s, s_o, eps,
                                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
                                USE_PDL: tl.constexpr = False):
        # s = x + h rounded to the model dtype (bits, `_round`: never contracted), stored as the new residual; the
        # norm then reads the rounded s, as the unfused code's norm reads the stored sum
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        rows, cols, c_ok, ok = _row_tile(R, D, BLOCK_R, BLOCK_D)
        dt = s_out.dtype.element_ty
        sf = _round(_load_rows(x, rows, cols, s_x, ok) + _load_rows(h, rows, cols, s_h, ok), dt, INTERPRET)
        tl.store(s_out + rows.to(tl.int64)[:, None] * s_s + cols[None, :], sf.to(dt), mask=ok)  # exact: rounded
        wf = tl.load(w + cols, mask=c_ok, other=0.0).to(tl.float32)  # [BD]
        y = (sf * _inv_rms(sf, D, eps)[:, None]) * (1.0 + wf)[None, :]
        tl.store(out + rows.to(tl.int64)[:, None] * s_o + cols[None, :], _cast(y, out.dtype.element_ty, INTERPRET),
                 mask=ok)

    @triton.jit
    def _rms_norm_gated_kernel(x, z, w, out, R, D, s_x, s_z, s_o, eps, codes, s_c, s_in, ROUND_PRODUCT: tl.constexpr,
                               ROUND_X: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                               INTERPRET: tl.constexpr, QUANT: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                               Z_HEADS: tl.constexpr = 1, s_zh=0):
        # ROUND_PRODUCT: torch computes `weight * y` in the model dtype (weight of that dtype, bf16/fp16), not fp32.
        # ROUND_X: x is fp32 (the GDN core's output), first rounded to the model dtype = out's (`rounds_x`).
        # Z_HEADS > 1: z's rows are [T, Z_HEADS] of strides (s_z, s_zh) (`_rows_of_heads`: a slice of a fused
        # projection's output, which one row stride cannot describe); 1: row r at r s_z
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        dt = out.dtype.element_ty  # the model dtype: x's, or z's when ROUND_X
        rows, cols, c_ok, ok = _row_tile(R, D, BLOCK_R, BLOCK_D)
        xf = _load_rows(x, rows, cols, s_x, ok)  # [BR, BD]
        wf = tl.load(w + cols, mask=c_ok, other=0.0).to(tl.float32)  # [BD]
        if Z_HEADS > 1:
            z_off = (rows // Z_HEADS).to(tl.int64) * s_z + (rows % Z_HEADS).to(tl.int64) * s_zh
            zf = tl.load(z + z_off[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        else:
            zf = _load_rows(z, rows, cols, s_z, ok)
        sc = _static_scale(s_in, QUANT)
        o = gated_rows(xf, zf, wf, D, eps, dt, ROUND_PRODUCT, ROUND_X, INTERPRET)
        _store_out(out, codes, sc, rows, cols, s_o, s_c, ok, o, INTERPRET, QUANT)

    @triton.jit
    def gated_rows(xf, zf, wf, D, eps, dt: tl.constexpr, ROUND_PRODUCT: tl.constexpr, ROUND_X: tl.constexpr,
                   INTERPRET: tl.constexpr):
        """The gated norm of fp32 rows xf [BR, BD] (masked entries 0) with gates zf [BR, BD] and weight wf [BD], in
        fp32 before the store's rounding to dt (`rms_norm_gated_reference`'s operations and roundings); shared with
        kernels/gdn_decode.py's step + norm."""
        if ROUND_X:
            if dt == tl.bfloat16:
                xf = _round(xf, dt, INTERPRET)  # bit ops: not contracted away
            else:
                xf = _cast(xf, dt, INTERPRET).to(tl.float32)
        y = _cast(xf * _inv_rms(xf, D, eps)[:, None], dt, INTERPRET).to(tl.float32)  # .to(x.dtype)
        p = wf[None, :] * y  # weight * y: exact in fp32 (two <= 11-bit significands) ...
        if ROUND_PRODUCT:  # ... then rounded as torch rounds it
            p = _cast(p, dt, INTERPRET).to(tl.float32)
        return p * (zf / (1.0 + tl.exp(-zf)))  # * silu(z.float())


def _interpreted() -> bool:
    """True when the kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import): CPU tensors only."""
    return triton is not None and type(_rms_norm_zc_kernel).__name__ == "InterpretedFunction"


def _tiling(rows: int, dim: int) -> dict[str, int]:
    """BLOCK_D covers the row; BLOCK_R packs small rows up to ~TILE elements; one warp per 256 elements, 1-8."""
    block_d = triton.next_power_of_2(dim)
    block_r = min(triton.next_power_of_2(rows), max(1, TILE // block_d))
    return dict(BLOCK_R=block_r, BLOCK_D=block_d, num_warps=min(8, max(1, block_r * block_d // 256)))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [R, D] with unit inner stride: a view when the leading dims flatten to one row stride (slices of
    a fused projection do), else a copy."""
    return t.reshape(-1, t.shape[-1])


def _rows_of_heads(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """[..., H, D] -> (base, row stride, head stride, heads): (`_rows(t)`, its row stride, 0, 1) where the rows are
    one view, else t as [T, H, D] -- a slice of a fused projection's output at several tokens (GDN z: [T, 32, 128]
    of row stride 12,288, which `reshape` would copy: 3.5 us a layer at 32 rows on the H200, qwen_profile_fp8sw
    run 1)."""
    if t.dim() < 3 or t.shape[-2] == 1:
        rows = _rows(t)
        return rows, rows.stride(0), 0, 1
    try:
        rows = t.view(-1, t.shape[-1])
        return rows, rows.stride(0), 0, 1
    except RuntimeError:  # the leading dims do not flatten with the heads
        th = t.reshape(-1, t.shape[-2], t.shape[-1])  # a view when the leading dims (not the heads) flatten
        return th, th.stride(0), th.stride(1), th.shape[1]


def _check(name: str, *ts: torch.Tensor) -> None:
    for t in ts:
        if t.dim() and t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride in the last dimension, got strides {t.stride()}")


# ---- custom ops (traceable by torch.compile) ------------------------------------------------------------------------
def _codes_args(out2: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, tuple, dict]:
    """The codes output [R, D] e4m3 (or, without a scale, a placeholder: the kernel never touches it) and its
    launch arguments (codes, row stride, the fp32 [] scale) + QUANT."""
    if input_scale is None:
        return out2, (out2, 0, out2), {}
    codes = torch.empty(out2.shape, dtype=torch.float8_e4m3fn, device=out2.device)
    return codes, (codes, codes.stride(0), input_scale.reshape(()).float()), {"QUANT": True}


def _zc(x: torch.Tensor, weight: torch.Tensor, eps: float, input_scale: torch.Tensor | None):
    _check(ZC, x, weight)
    out = x.new_empty(x.shape)
    x2, o2 = _rows(x), out.view(-1, x.shape[-1])
    codes, cargs, quant = _codes_args(o2, input_scale)
    if o2.numel():
        cfg = _tiling(*x2.shape)
        grid = (triton.cdiv(x2.shape[0], cfg["BLOCK_R"]),)
        _rms_norm_zc_kernel[grid](x2, weight, o2, x2.shape[0], x2.shape[1], x2.stride(0), o2.stride(0), eps, *cargs,
                                  INTERPRET=_interpreted(), **quant, **cfg, **pdl.launch_options())
    return out, codes.view(x.shape)


@torch.library.custom_op("qwen::rms_norm_zc", mutates_args=())
def rms_norm_zc_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> y [..., D] in x.dtype (contiguous); contract: `rms_norm_zc_reference`."""
    return _zc(x, weight, eps, None)[0]


@torch.library.custom_op("qwen::rms_norm_zc_fp8", mutates_args=())
def rms_norm_zc_fp8_op(x: torch.Tensor, weight: torch.Tensor, eps: float, input_scale: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_zc_op` and the e4m3 codes of its output with the static scale `input_scale` (fp32 []), both
    [..., D], in one launch; contract: `rms_norm_zc_fp8_reference`."""
    return _zc(x, weight, eps, input_scale)


@rms_norm_zc_fp8_op.register_fake
def _(x, weight, eps, input_scale):
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=torch.float8_e4m3fn)


@rms_norm_zc_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


def _gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, input_scale: torch.Tensor | None):
    _check(GATED, x, z, weight)
    out = z.new_empty(x.shape)
    x2, o2 = _rows(x), out.view(-1, x.shape[-1])
    z2, s_z, s_zh, z_heads = _rows_of_heads(z)
    codes, cargs, quant = _codes_args(o2, input_scale)
    if o2.numel():
        cfg = _tiling(*x2.shape)
        grid = (triton.cdiv(x2.shape[0], cfg["BLOCK_R"]),)
        # torch.promote_types(weight, y) over DTYPES is y's (the model dtype's) when the dtypes are equal, else fp32
        round_product = weight.dtype == z.dtype != torch.float32
        heads = dict(Z_HEADS=z_heads, s_zh=s_zh) if z_heads > 1 else {}
        _rms_norm_gated_kernel[grid](x2, z2, weight, o2, x2.shape[0], x2.shape[1], x2.stride(0), s_z,
                                     o2.stride(0), eps, *cargs, ROUND_PRODUCT=round_product, ROUND_X=rounds_x(x, z),
                                     INTERPRET=_interpreted(), **quant, **cfg, **heads, **pdl.launch_options())
    return out, codes.view(x.shape)


@torch.library.custom_op("qwen::rms_norm_gated", mutates_args=())
def rms_norm_gated_op(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z [..., D] -> y [..., D] in z.dtype (x's unless `rounds_x`; contiguous); contract:
    `rms_norm_gated_reference`."""
    return _gated(x, z, weight, eps, None)[0]


@torch.library.custom_op("qwen::rms_norm_gated_fp8", mutates_args=())
def rms_norm_gated_fp8_op(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_gated_op` and the e4m3 codes of its output with the static scale `input_scale`, in one launch;
    contract: `rms_norm_gated_fp8_reference`."""
    return _gated(x, z, weight, eps, input_scale)


@rms_norm_gated_fp8_op.register_fake
def _(x, z, weight, eps, input_scale):
    return z.new_empty(x.shape), x.new_empty(x.shape, dtype=torch.float8_e4m3fn)


@rms_norm_gated_op.register_fake
def _(x, z, weight, eps):
    return z.new_empty(x.shape)


@torch.library.custom_op("qwen::add_rms_norm_zc", mutates_args=())
def add_rms_norm_zc_op(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, h [..., D] -> (x + h, rms_norm_zc(x + h)), both [..., D] in x.dtype (contiguous); contract:
    `add_rms_norm_zc_reference`."""
    _check(ADD_ZC, x, h, weight)
    s, out = x.new_empty(x.shape), x.new_empty(x.shape)
    x2, h2, s2, o2 = _rows(x), _rows(h), s.view(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    if o2.numel() == 0:
        return s, out
    cfg = _tiling(*x2.shape)
    grid = (triton.cdiv(x2.shape[0], cfg["BLOCK_R"]),)
    _add_rms_norm_zc_kernel[grid](x2, h2, weight, s2, o2, x2.shape[0], x2.shape[1], x2.stride(0), h2.stride(0),
                                  s2.stride(0), o2.stride(0), eps, INTERPRET=_interpreted(), **cfg,
                                  **pdl.launch_options())
    return s, out


@add_rms_norm_zc_op.register_fake
def _(x, h, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def add_rms_norm_zc_triton(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `add_rms_norm_zc_reference`."""
    return add_rms_norm_zc_op(x, h, weight, eps)


def rms_norm_zc_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `rms_norm_zc_reference`."""
    return rms_norm_zc_op(x, weight, eps)


def rms_norm_gated_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `rms_norm_gated_reference`."""
    return rms_norm_gated_op(x, z, weight, eps)


def rms_norm_zc_fp8_triton(x, weight, eps, input_scale):
    """Same contract as `rms_norm_zc_fp8_reference`."""
    return rms_norm_zc_fp8_op(x, weight, eps, input_scale)


def rms_norm_gated_fp8_triton(x, z, weight, eps, input_scale):
    """Same contract as `rms_norm_gated_fp8_reference`."""
    return rms_norm_gated_fp8_op(x, z, weight, eps, input_scale)


# ---- guard, registry entries ----------------------------------------------------------------------------------------
def _describe(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None) -> dict[str, Any]:
    ts = (x, weight) if z is None else (x, z, weight)
    dim = x.shape[-1] if x.dim() else 0
    shapes_ok = x.dim() >= 1 and tuple(weight.shape) == (dim,) and (z is None or z.shape == x.shape)
    return dict(device=x.device.type, capability=torch.cuda.get_device_capability(x.device) if x.is_cuda else None,
                same_device=len({t.device for t in ts}) == 1,
                dtypes={x.dtype} if z is None else {x.dtype, z.dtype}, weight_dtype=weight.dtype,
                shapes_ok=shapes_ok, dim=dim, unit_strides=all(t.dim() and t.stride(-1) == 1 for t in ts))


def describe_zc(x, weight, eps=None) -> dict[str, Any]:
    return _describe(x, weight, None)


def describe_gated(x, z, weight, eps=None) -> dict[str, Any]:
    info = _describe(x, weight, z)
    if rounds_x(x, z):  # the fp32 x is rounded to z's dtype in the kernel: one model dtype
        info["dtypes"] = {z.dtype}
    return info


def describe_add(x, h, weight, eps=None) -> dict[str, Any]:
    return _describe(x, weight, h)  # h as the second activation: same shape and dtype as x


def supports(*, device: str, capability, same_device: bool, dtypes: set, weight_dtype, shapes_ok: bool, dim: int,
             unit_strides: bool, **_: Any) -> bool:
    """Triton able to run on `device` (cuda >= sm_80, or the interpreter on CPU), all tensors on it; x (and z) of one
    dtype in DTYPES, the weight in DTYPES; weight [D] and z of x's shape; 1 <= D <= MAX_DIM (one register tile per
    row); unit stride in the last dim of every tensor."""
    if triton is None:
        return False
    device_ok = triton_device_ok(device, capability, _interpreted(), MIN_CAPABILITY)
    return (device_ok and same_device and len(dtypes) == 1 and next(iter(dtypes)) in DTYPES
            and weight_dtype in DTYPES and shapes_ok and 1 <= dim <= MAX_DIM and unit_strides)


def describe_zc_fp8(x, weight, eps=None, input_scale=None) -> dict[str, Any]:
    return dict(_describe(x, weight, None), scale_ok=_scale_ok(input_scale, x))


def describe_gated_fp8(x, z, weight, eps=None, input_scale=None) -> dict[str, Any]:
    return dict(describe_gated(x, z, weight), scale_ok=_scale_ok(input_scale, x))


def _scale_ok(s: torch.Tensor | None, x: torch.Tensor) -> bool:
    return s is not None and s.numel() == 1 and s.dtype == torch.float32 and s.device == x.device


def supports_fp8(*, scale_ok: bool, **info: Any) -> bool:
    """`supports`, and a one-element fp32 scale on x's device."""
    return scale_ok and supports(**info)


def compare_fp8(out, ref, tol: float | None = None) -> str | None:
    """The output by `compare`; the codes equal wherever the outputs are bit-identical (a code is a function of its
    output element: where an ulp moved the output, the code may move with it -- the tests also check the kernel's
    codes against the reference quantiser applied to the kernel's own output, everywhere)."""
    problem = compare(out[0], ref[0], tol)
    if problem:
        return f"output: {problem}"
    same = out[0].view(-1).view(torch.int16 if out[0].element_size() == 2 else torch.int32) == \
        ref[0].view(-1).view(torch.int16 if ref[0].element_size() == 2 else torch.int32)
    codes_out, codes_ref = out[1].view(-1).view(torch.uint8), ref[1].view(-1).view(torch.uint8)
    bad = int((same & (codes_out != codes_ref)).sum())
    return f"codes: {bad} differ where the outputs are bit-identical" if bad else None


def supports_add(**info: Any) -> bool:
    """`supports`, and the activations bf16 or fp32 (ADD_DTYPES: the sum is rounded by `_round`)."""
    return supports(**info) and next(iter(info["dtypes"])) in ADD_DTYPES


def compare_add(out, ref, tol: float | None = None) -> str | None:
    """The sum bit-identical (one rounding of an exact fp32 add, as torch does it); the norm by `compare`."""
    if out[0].shape != ref[0].shape or out[0].dtype != ref[0].dtype or not torch.equal(out[0], ref[0]):
        return "sum: not bit-identical to x + h"
    problem = compare(out[1], ref[1], tol)
    return None if problem is None else f"norm: {problem}"


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None) -> str | None:
    """None if max |out - ref| <= tol x max |ref|, tol from TOLERANCE by dtype (module docstring), else why."""
    return tolerance.compare(out, ref, TOLERANCE[ref.dtype] if tol is None else tol)  # NaN fails there too


def random_inputs(shape: tuple[int, ...], dtype=torch.float32, gated: bool = False, seed: int = 0,
                  device="cpu") -> tuple:
    """(x, weight, eps) or, gated, (x, z, weight, eps), model-like: x ~N(0, 1) with row 0 scaled by 1e3 (a massive
    activation) and, given >= 3 rows, the last row by 1e-3 (mean(x^2) ~ eps: eps matters); weights ~N(0, 0.3)
    zero-centred, ~N(1, 0.2) gated, in x's dtype like the model's; z ~N(0, 1); eps 1e-6 (the model's)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).reshape(-1, shape[-1])
    x[0] *= 1e3
    if x.shape[0] >= 3:
        x[-1] *= 1e-3
    x = x.reshape(shape)
    if gated:
        z = torch.randn(shape, generator=gen)
        w = 1.0 + 0.2 * torch.randn(shape[-1], generator=gen)
        return x.to(dtype).to(device), z.to(dtype).to(device), w.to(dtype).to(device), 1e-6
    w = 0.3 * torch.randn(shape[-1], generator=gen)
    return x.to(dtype).to(device), w.to(dtype).to(device), 1e-6


def _sample_zc(device) -> tuple[tuple, dict]:
    # q/k-norm-like [T, H, D]: 3 x 2 rows of a non-power-of-two D (masked tail, BLOCK_R packing), bf16 like the model
    return random_inputs((3, 2, 96), torch.bfloat16, device=device), {}


def _sample_gated(device) -> tuple[tuple, dict]:
    return random_inputs((3, 2, 96), torch.bfloat16, gated=True, seed=1, device=device), {}


def _sample_zc_fp8(device) -> tuple[tuple, dict]:
    # a hidden-state-like row pair; the scale saturates row 0's massive activation (+-448) and rounds the rest
    x, w, eps = random_inputs((2, 96), torch.bfloat16, seed=4, device=device)
    return (x, w, eps, torch.tensor(0.01, device=device)), {}


def _sample_gated_fp8(device) -> tuple[tuple, dict]:
    x, z, w, eps = random_inputs((3, 2, 96), torch.bfloat16, gated=True, seed=5, device=device)
    return (x, z, w, eps, torch.tensor(0.005, device=device)), {}


def _sample_add(device) -> tuple[tuple, dict]:
    # two hidden-state rows of a non-power-of-two D, bf16 like the model; h is the mixer output of the same scale
    x, w, eps = random_inputs((2, 96), torch.bfloat16, seed=2, device=device)
    h, _, _ = random_inputs((2, 96), torch.bfloat16, seed=3, device=device)
    return (x, h, w, eps), {}


def register(registry) -> None:
    tolerance = ("max |diff| <= 1e-2 x max |ref| for bf16/fp16 (one output ulp; the gated op also reproduces the "
                 "reference's intermediate roundings), 1e-5 for fp32 (fp32 math; summation order and rsqrt/exp ulps)")
    registry.add_op(ZC, rms_norm_zc_reference, sample=_sample_zc, compare=compare, describe=describe_zc,
                    tolerance=tolerance)
    registry.add_implementation(ZC, "triton", rms_norm_zc_triton, supports)
    registry.add_op(GATED, rms_norm_gated_reference, sample=_sample_gated, compare=compare, describe=describe_gated,
                    tolerance=tolerance)
    registry.add_implementation(GATED, "triton", rms_norm_gated_triton, supports)
    registry.add_op(ADD_ZC, add_rms_norm_zc_reference, sample=_sample_add, compare=compare_add, describe=describe_add,
                    tolerance="the sum bit-identical; the norm as rms_norm_zc's (" + tolerance + ")")
    registry.add_implementation(ADD_ZC, "triton", add_rms_norm_zc_triton, supports_add)
    fp8 = " and the output's e4m3 codes equal wherever the output is bit-identical"
    registry.add_op(ZC_FP8, rms_norm_zc_fp8_reference, sample=_sample_zc_fp8, compare=compare_fp8,
                    describe=describe_zc_fp8, tolerance="the output as rms_norm_zc's (" + tolerance + ")" + fp8)
    registry.add_implementation(ZC_FP8, "triton", rms_norm_zc_fp8_triton, supports_fp8)
    registry.add_op(GATED_FP8, rms_norm_gated_fp8_reference, sample=_sample_gated_fp8, compare=compare_fp8,
                    describe=describe_gated_fp8, tolerance="the output as rms_norm_gated's (" + tolerance + ")" + fp8)
    registry.add_implementation(GATED_FP8, "triton", rms_norm_gated_fp8_triton, supports_fp8)
