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
more than fc2 in bf16 (inductor's: 0.27 ms), ~0.9 ms a call by inference. By the arithmetic it is compute-bound
(~90 instructions per lane by the run's time: erf, an IEEE division, two bit-level roundings) over a row padded from
4,736 to 8,192 lanes; so each row is now two power-of-two tiles, 4,096 + 1,024 lanes (`split_tiling`), and the
rounding to the e4m3 grid by fp32 arithmetic (needed by the interpreter) can be left to the GPU's RNE cast
(`Launch.round_in_fp32`). Timed alone on the H200 (`benchmarks/quant_probe.py`, quant_probe run 1, batch 8):
0.846-0.894 ms a call (two timings of this launch; ~680 GB/s) against 1.295 for the padded tile of run 8 and 1.052 for
inductor's fusion (whose codes are not the reference's: 3.3 M of 196 M differ), with the reference's codes but the
erf's last bit. Still too slow for an FP8 fc2 to pay: it must stay under 0.462 ms (the bf16 path's GELU + GEMM less
the FP8 GEMM); the arithmetic per element, not memory (a bare cast runs at 3 TB/s), bounds it -- or its occupancy: a
whole row lives in registers (20 fp32 a thread) until the row's amax is known. Hence a second kernel, NOT YET TIMED
(`Launch.max_first`, bf16 rows): the row's amax is the GELU of its largest input whenever that input is >= 0.5 (gelu
increases above -0.75 and its negative values lie above -0.17), so one cheap pass takes the row's max (no erf), and a
second reads the row again (from L2) in small chunks, each GELU computed once; rows of small values only take a
fallback pass over |gelu|. Bit-identical to the two-tile kernel under the interpreter (tests/test_kernel_fp8.py; on
the GPU: gpu_next.sh steps 57 and 62); the 0.5 is pinned by an exhaustive check over all bf16 inputs; quant_probe
times its chunk widths. Non-finite inputs: like the two-tile kernel, a NaN is left out of the amax and its code clamps
to -448 (the reference propagates it). fc2 stays bf16 by default; this kernel runs for an FP8 fc2 in eager mode only
(under inductor the engine takes inductor's fusion, faster inside the engine in run 8; the two have not been compared
inside the engine since the split).

Numerics: the GELU in fp32 as torch computes it (0.5 x (1 + erf(x / sqrt 2)), x * M_SQRT1_2), rounded to bf16 by
bit operations (`kernels.rms_norm._round`: the compiler can neither drop nor contract it); then the per-row rule
(`_store_codes`). The codes equal the reference's wherever the kernel's erf and torch's agree to the bf16 rounding:
libdevice's erff on the GPU, the interpreter's and torch's CPU erf may differ in the last fp32 bit, which moves a GELU
value by one bf16 ulp where it lies on a rounding boundary (tests/test_kernel_fp8.py states the bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kernels.fp8_quant import MAX_K, quantize_rows_reference, rows_outputs

try:
    import triton
    import triton.language as tl

    from kernels.fp8_quant import row_scale, scaled_codes
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
    def _gelu(h, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
        """gelu of fp32 h (any shape) as F.gelu computes it, rounded to DTYPE as it stores it; gelu(0) = 0."""
        return _round(0.5 * h * (1.0 + tl.math.erf(h * SQRT1_2)), DTYPE, INTERPRET)

    @triton.jit
    def _gelu_tile(h_ptr, rows, cols, stride_hm, ok, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
        """[BLOCK_M, BLOCK] tile of gelu(h) in fp32, rounded to DTYPE as F.gelu stores it; masked entries 0."""
        h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :], mask=ok, other=0.0)
        return _gelu(h.to(tl.float32), DTYPE, INTERPRET)  # masked entries: gelu(0) = 0

    @triton.jit
    def _store_codes(q_ptr, rows, cols, stride_qm, ok, g, scale, ROUND_IN_FP32: tl.constexpr):
        """e4m3 codes of g / scale (`fp8_quant.scaled_codes`): rounded to the e4m3 grid in fp32 arithmetic first where
        the cast alone is not RNE (the interpreter), else by the GPU's cast (cvt.rn.satfinite)."""
        q = scaled_codes(g, scale, ROUND_IN_FP32)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q.to(tl.float8e4nv), mask=ok)

    @triton.jit
    def _gelu_quant_rows_kernel(h_ptr, q_ptr, s_ptr, M, K, stride_hm, stride_qm, DTYPE: tl.constexpr,
                                INTERPRET: tl.constexpr, ROUND_IN_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_HEAD: tl.constexpr, BLOCK_TAIL: tl.constexpr):
        # one program: BLOCK_M whole rows, read once and written once as codes, held in registers as two power-of-two
        # tiles, columns [0, BLOCK_HEAD) and [BLOCK_HEAD, BLOCK_HEAD + BLOCK_TAIL) (0: no tail), so a 4,736-wide row
        # costs 4,096 + 1,024 lanes of erf and division, not the 8,192 of one padded tile (`split_tiling`)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        head = tl.arange(0, BLOCK_HEAD)
        head_ok = row_ok[:, None] & (head < K)[None, :]
        g_head = _gelu_tile(h_ptr, rows, head, stride_hm, head_ok, DTYPE, INTERPRET)
        amax = tl.max(tl.abs(g_head), axis=1)  # [BLOCK_M]
        if BLOCK_TAIL > 0:
            tail = BLOCK_HEAD + tl.arange(0, BLOCK_TAIL)
            tail_ok = row_ok[:, None] & (tail < K)[None, :]
            g_tail = _gelu_tile(h_ptr, rows, tail, stride_hm, tail_ok, DTYPE, INTERPRET)
            amax = tl.maximum(amax, tl.max(tl.abs(g_tail), axis=1))
        scale = row_scale(amax)  # `quantize_rows_reference`'s: amax / 448, 1 for an all-zero row
        _store_codes(q_ptr, rows, head, stride_qm, head_ok, g_head, scale, ROUND_IN_FP32)
        if BLOCK_TAIL > 0:
            _store_codes(q_ptr, rows, tail, stride_qm, tail_ok, g_tail, scale, ROUND_IN_FP32)
        tl.store(s_ptr + rows, scale, mask=row_ok)


if triton is not None:
    # gelu(x) increases for x > -0.7518 and its negative values lie above -0.170: a row whose largest input is at
    # least this has gelu(max) >= gelu(0.5) = 0.3457 as its largest |gelu| (bf16 inputs are >= 2^-8 apart relatively,
    # far more than the fp32 evaluation's error, so no smaller input rounds to a larger GELU)
    MAX_FIRST_SAFE = tl.constexpr(0.5)

    @triton.jit
    def _gelu_quant_rows_max_first_kernel(h_ptr, q_ptr, s_ptr, K, stride_hm, stride_qm, DTYPE: tl.constexpr,
                                          INTERPRET: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
                                          BLOCK_K: tl.constexpr):
        # one program: one row, in BLOCK_K chunks (few registers, so many programs per SM). Pass 1 finds the row's
        # largest INPUT (a max, no erf); its GELU is the row's amax (MAX_FIRST_SAFE), else (rows of small or negative
        # values only) a second pass takes max |gelu| as the tile kernel does. Pass 3 reads the row again (from L2:
        # 9.5 KB a row at the ViT's width), computes each GELU once, and writes the codes.
        rows = tl.program_id(0) + tl.arange(0, 1)  # [1]: the tile helpers' row vector
        cols = tl.arange(0, BLOCK_K)
        top = tl.full([1, BLOCK_K], float("-inf"), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ok = (k0 + cols < K)[None, :]
            h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_hm + k0 + cols[None, :], mask=ok,
                        other=float("-inf"))
            top = tl.maximum(top, h.to(tl.float32))
        hmax = tl.max(tl.max(top, axis=1), axis=0)  # scalar
        if hmax >= MAX_FIRST_SAFE:
            amax = _gelu(hmax, DTYPE, INTERPRET)
        else:
            amax = 0.0
            for k0 in range(0, K, BLOCK_K):
                ok = (k0 + cols < K)[None, :]
                g = _gelu_tile(h_ptr, rows, k0 + cols, stride_hm, ok, DTYPE, INTERPRET)
                amax = tl.maximum(amax, tl.max(tl.max(tl.abs(g), axis=1), axis=0))
        scale = row_scale(tl.zeros([1], tl.float32) + amax)  # [1]
        for k0 in range(0, K, BLOCK_K):
            ok = (k0 + cols < K)[None, :]
            g = _gelu_tile(h_ptr, rows, k0 + cols, stride_hm, ok, DTYPE, INTERPRET)
            _store_codes(q_ptr, rows, k0 + cols, stride_qm, ok, g, scale, ROUND_IN_FP32)
        tl.store(s_ptr + rows, scale)


def _interpreted() -> bool:
    return triton is not None and type(_gelu_quant_rows_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class Launch:
    """How one call runs: BLOCK_M rows a program, each row as a BLOCK_HEAD tile and a BLOCK_TAIL tile (0: none);
    ROUND_IN_FP32 rounds to the e4m3 grid by fp32 arithmetic before the cast (needed by the interpreter, whose cast
    is not RNE; on the GPU the cast alone is RNE). `benchmarks/quant_probe.py` times the choices on the H200."""

    block_m: int
    block_head: int  # max_first: the chunk width (block_m 1, no tail)
    block_tail: int
    round_in_fp32: bool
    num_warps: int = 8
    max_first: bool = False  # the chunked kernel that finds the row's largest input first (bf16 input only)


def split_tiling(m: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_HEAD, BLOCK_TAIL) for rows of k: the head the largest power of two <= k, the tail the smallest
    power of two covering the rest (0 when k is a power of two). k = 4,736: 4,096 + 1,024 = 5,120 lanes (one padded
    tile: 8,192). ~8K lanes per program on the GPU (fp32 in registers: 32 per thread at 8 warps), as `rows_tiling`."""
    head = 1 << max(k.bit_length() - 1, 0)  # k = 0 (an empty row): 1, masked off entirely
    tail = triton.next_power_of_2(k - head) if k > head else 0
    block_m = max(1, (65536 if _interpreted() else 8192) // (head + tail))
    return min(triton.next_power_of_2(m), 1 << (block_m.bit_length() - 1)), head, tail


def default_launch(m: int, k: int) -> Launch:
    """The two-tile split, rounded by the cast alone: on sm_90 Triton emits `cvt.rn.satfinite.e4m3x2.f32` (RNE,
    saturating; tests/sm90_compile.py checks the PTX), the same rounding as torch's cast in the reference; the
    interpreter, whose cast is not RNE, rounds in fp32 whatever this says (`launch`)."""
    return Launch(*split_tiling(m, k), round_in_fp32=False)


def launch(h: torch.Tensor, how: Launch) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on a 2-D h (last dim contiguous) as `how` says -> (e4m3 [M, K], fp32 [M, 1])."""
    (m, k), (q, scale) = h.shape, rows_outputs(h)
    if m == 0 or k == 0:
        return q, scale.fill_(1.0)
    dtype = tl.bfloat16 if h.dtype == torch.bfloat16 else tl.float32
    interpret = _interpreted()
    if how.max_first:
        if h.dtype != torch.bfloat16 or how.block_m != 1 or how.block_tail:
            raise ValueError(f"{NAME}: the max-first kernel takes bf16 rows, one a program, in chunks; got {h.dtype}, "
                             f"{how}")
        _gelu_quant_rows_max_first_kernel[(m,)](h, q, scale, k, h.stride(0), q.stride(0), DTYPE=dtype,
                                                INTERPRET=interpret, ROUND_IN_FP32=how.round_in_fp32 or interpret,
                                                BLOCK_K=how.block_head, num_warps=how.num_warps)
        return q, scale
    if how.block_head + how.block_tail < k or (how.block_tail and how.block_head >= k):
        raise ValueError(f"{NAME}: tiles {how.block_head} + {how.block_tail} do not cover a row of {k} as head + tail")
    _gelu_quant_rows_kernel[(triton.cdiv(m, how.block_m),)](
        h, q, scale, m, k, h.stride(0), q.stride(0), DTYPE=dtype, INTERPRET=interpret,
        ROUND_IN_FP32=how.round_in_fp32 or interpret, BLOCK_M=how.block_m, BLOCK_HEAD=how.block_head,
        BLOCK_TAIL=how.block_tail, num_warps=how.num_warps)
    return q, scale


@torch.library.custom_op("sammie::fp8_gelu_quant_rows", mutates_args=())
def gelu_quantize_rows_triton(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gelu_quantize_rows_reference`; one launch, one read of h (last dim contiguous or copied)."""
    if h.dim() != 2 or h.dtype not in IN_DTYPES or h.shape[1] > MAX_K:
        raise ValueError(f"{NAME}: need a 2-D {IN_DTYPES} tensor with K <= {MAX_K}, got {h.dtype} {tuple(h.shape)}")
    h = h if h.stride(1) == 1 else h.contiguous()
    return launch(h, default_launch(*h.shape))


@gelu_quantize_rows_triton.register_fake
def _(h):
    return rows_outputs(h)


def supports(*, device: str, dtype: torch.dtype, shape: tuple[int, ...], **_: Any) -> bool:
    """Triton able to run on `device` (the interpreter: CPU); a 2-D bf16 / fp32 tensor with K <= MAX_K."""
    if triton is None or device != ("cpu" if _interpreted() else "cuda"):
        return False
    return dtype in IN_DTYPES and len(shape) == 2 and shape[1] <= MAX_K
