"""GELU then dynamic per-row FP8 quantisation in one pass: h [M, K] (the ViT MLP's fc1 output, pre-activation) ->
(e4m3 [M, K], fp32 scales [M, 1]) of gelu(h) -- the input of an FP8 `mlp.fc2` (`sammie.model.fp8`).

Reference: `gelu_quantize_rows_reference(h) = quantize_rows_reference(F.gelu(h))`: torch's exact (erf) GELU, whose
output is rounded to h's dtype, then `kernels.fp8_quant`'s per-row rule (scale = absmax / 448, codes RNE).

Why a kernel: under inductor the same ops (GELU, per-token amax, divide, cast) compiled to a looped reduction that
reads the 4,736-wide row twice and recomputes the GELU: 0.91 ms a call at batch 8 (H200, waterfall run 6's
profile: 22.7% of the FP8 engine's GPU time), more than fc2's FP8 GEMM saves over bf16 (0.33 against 0.57 ms), so
fc2 stays bf16 by default (`EngineConfig.vit_fp8_linears`). Here each row is read once and written once as codes:
393 MB read + 196 MB written at batch 8 (M = 41,472, K = 4,736), ~0.12-0.15 ms at the H200's bandwidth. Measured
(waterfall run 8): SLOWER than inductor's fusion -- fc2 in FP8 with it cost 0.40 ms per ViT block (batch of 8)
more than fc2 in bf16 (inductor's: 0.27 ms), ~0.9 ms a call by inference; not profiled (candidates: the fp32 erf on
a row padded from 4,736 to 8,192 lanes, the exact divisions, one row per program). fc2 stays bf16 by default; this
kernel runs for an FP8 fc2 in eager mode only (under inductor the engine takes inductor's fusion).

Numerics: the GELU in fp32 as torch computes it (0.5 x (1 + erf(x / sqrt 2)), x * M_SQRT1_2), rounded to bf16 by
bit operations (`kernels.rms_norm._round`: the compiler can neither drop nor contract it); then `row_codes`. The
codes equal the reference's wherever the kernel's erf and torch's agree to the bf16 rounding: libdevice's erff on
the GPU, the interpreter's and torch's CPU erf may differ in the last fp32 bit, which moves a GELU value by one bf16
ulp where it lies on a rounding boundary (tests/test_kernel_fp8.py states the bound).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels.fp8_quant import MAX_K, quantize_rows_reference, rows_outputs, rows_tiling

try:
    import triton
    import triton.language as tl

    from kernels.fp8_quant import row_codes
    from kernels.rms_norm import _round
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "fp8_gelu_quant_rows"
IN_DTYPES = (torch.bfloat16, torch.float32)  # the GELU's output rounded to bf16 (`_round`) or kept in fp32


def gelu_quantize_rows_reference(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, K] -> (e4m3 [M, K], fp32 [M, 1]) of F.gelu(h) (exact erf GELU in h's dtype). No host sync."""
    return quantize_rows_reference(F.gelu(h))


if triton is not None:
    SQRT1_2 = tl.constexpr(0.7071067811865476)  # M_SQRT1_2, torch's GELU constant (as fp32: 0.70710677)

    @triton.jit
    def _gelu_quant_rows_kernel(h_ptr, q_ptr, s_ptr, M, K, stride_hm, stride_qm, DTYPE: tl.constexpr,
                                INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # one program: BLOCK_M whole rows ([BLOCK_M, BLOCK_K], BLOCK_K >= K): read once, codes written once
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols[None, :] < K)
        h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :], mask=mask, other=0.0)
        h = h.to(tl.float32)
        g = _round(0.5 * h * (1.0 + tl.math.erf(h * SQRT1_2)), DTYPE, INTERPRET)  # F.gelu's value, stored in DTYPE
        q, scale = row_codes(g)  # masked entries: gelu(0) = 0, so they never raise a row's amax
        tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + rows, scale, mask=row_ok)


def _interpreted() -> bool:
    return triton is not None and type(_gelu_quant_rows_kernel).__name__ == "InterpretedFunction"


@torch.library.custom_op("sammie::fp8_gelu_quant_rows", mutates_args=())
def gelu_quantize_rows_triton(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gelu_quantize_rows_reference`; one launch, one read of h (last dim contiguous or copied)."""
    if h.dim() != 2 or h.dtype not in IN_DTYPES or h.shape[1] > MAX_K:
        raise ValueError(f"{NAME}: need a 2-D {IN_DTYPES} tensor with K <= {MAX_K}, got {h.dtype} {tuple(h.shape)}")
    h = h if h.stride(1) == 1 else h.contiguous()
    (m, k), (q, scale) = h.shape, rows_outputs(h)
    if m == 0 or k == 0:
        return q, scale.fill_(1.0)
    block_m, block_k = rows_tiling(m, k)
    dtype = tl.bfloat16 if h.dtype == torch.bfloat16 else tl.float32
    _gelu_quant_rows_kernel[(triton.cdiv(m, block_m),)](h, q, scale, m, k, h.stride(0), q.stride(0), DTYPE=dtype,
                                                        INTERPRET=_interpreted(), BLOCK_M=block_m,
                                                        BLOCK_K=block_k, num_warps=8)
    return q, scale


@gelu_quantize_rows_triton.register_fake
def _(h):
    return rows_outputs(h)


def supports(*, device: str, dtype: torch.dtype, shape: tuple[int, ...], **_: Any) -> bool:
    """Triton able to run on `device` (the interpreter: CPU); a 2-D bf16 / fp32 tensor with K <= MAX_K."""
    if triton is None or device != ("cpu" if _interpreted() else "cuda"):
        return False
    return dtype in IN_DTYPES and len(shape) == 2 and shape[1] <= MAX_K
