"""Dynamic per-row FP8 quantisation: x [M, K] (bf16 / fp16 / fp32) -> (e4m3 [M, K], fp32 scales [M, 1]) with
scale = absmax(row) / 448, the activation half of the ViT's row-wise FP8 linear (`kernels.fp8_linear`,
op "fp8_rowwise_linear") and, applied to W [N, K], the weights' per-output-channel quantisation at load.

Reference: `quantize_rows_reference`, plain PyTorch in fp32:
    amax = max_k |x[m, k]|;  s[m] = amax / 448 (1.0 for an all-zero row, so 0 / s stays 0 instead of NaN);
    q[m, k] = e4m3_RNE(clamp(x[m, k] / s[m], -448, 448))
The clamp only matters for the row's largest value: fp32 `amax / 448` is rounded, and amax / (amax / 448) may come
out a few ulps above 448 (e4m3fn has no inf; the cast must not overflow). Non-finite inputs are not handled: an inf
makes its row NaN / 0 and a NaN propagates (the accuracy gate in `sammie.model.fp8` sees it).

The Triton kernel computes the same three fp32 operations (IEEE division via `div_rn`, not the approximate `/`),
RNE cast to e4m3 (`cvt.rn.satfinite.e4m3x2.f32` on sm_89+), so it should be bit-exact with the reference: tested bit
for bit under the CPU interpreter. On the H200 the first run differed by an ulp of some scales because the reference
then divided by a Python scalar (torch's CUDA kernel multiplies by the reciprocal instead); the reference now divides
tensor by tensor (IEEE on every device), and the GPU re-run of the bit-exact test is still pending.

Napkin math (ViT fc2 input at batch 8: M = 8 x 5184 = 41472, K = 4736, bf16; H200 4.8 TB/s): reads 393 MB, writes
196 MB of e4m3 + 166 KB of scales: 589 MB -> ~123 us in one pass. The same formula in torch ops (abs, amax, div,
clamp, cast) is ~4 passes over fp32 temporaries (~1.8 GB -> ~370 us) unless torch.compile fuses them. The GEMM it
feeds (2 x 41472 x 4736 x 1024 = 402 GFLOP) takes ~400 us in FP8 at ~1000 TFLOP/s achieved (~600 us in bf16), so
an unfused quantiser eats a large part of FP8's gain: fusing it into the preceding LayerNorm / GELU is the next
step if it shows in profiles.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import pdl
from kernels.nvfp4 import E4M3_MAX

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "fp8_quant_rows"
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_K = 8192  # one row per program pass, held in registers (ViT: K <= 4736); longer rows go to the reference


# ---- reference ------------------------------------------------------------------------------------------------------
def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (e4m3 [M, K], fp32 scales [M, 1]); x ~= q.float() * scale. No host sync (CUDA-graph safe)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows expects a 2-D [M, K] tensor, got shape {tuple(x.shape)}")
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)  # [M, 1]
    # tensor / tensor, not tensor / scalar: PyTorch's CUDA kernel turns division by a scalar into multiplication by
    # its reciprocal (not IEEE division), so the reference would differ between CPU and GPU by an ulp of the scale
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


# ---- Triton kernel --------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _round_to_e4m3_grid(q):
        """fp32 q with |q| <= 448 -> the nearest e4m3 value (ties to even), still fp32, sign (and -0) kept.

        Done in fp32 arithmetic so the final cast only converts exactly representable values: the GPU's cast is RNE
        too, but Triton 3.x's interpreter casts fp32 -> fp8 without carry or ties-to-even, so rounding explicitly is
        what makes the kernel bit-exact on both. Round |q| to a multiple of its e4m3 ulp u = 2^(max(e, -6) - 3)
        (3 mantissa bits; subnormals below 2^-6 share u = 2^-9) with the fp32 "magic number" trick
        (|q| + 1.5 u 2^23) - 1.5 u 2^23, exact RNE because |q| < u 2^22."""
        bits = q.to(tl.int32, bitcast=True)
        mag = tl.abs(q)
        e = ((bits >> 23) & 0xFF) - 127  # unbiased fp32 exponent of q (-127 for 0 and fp32 subnormals)
        e = tl.maximum(e, -6)
        magic = (((e - 3 + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)  # 1.5 u 2^23
        r = (mag + magic) - magic
        return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def row_scale(amax):
        """fp32 row amax [BLOCK_M] -> `quantize_rows_reference`'s scale: amax / 448 (IEEE), 1 for an all-zero row.
        Shared with the GELU-quantisers (`kernels.gelu_fp8_quant`)."""
        return tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)

    @triton.jit
    def scaled_codes(x, scale, ROUND_IN_FP32: tl.constexpr):
        """fp32 tile x [BLOCK_M, BLOCK_K], scales [BLOCK_M] -> the e4m3 values of x / scale (IEEE division, clamped
        to +-448) as fp32; ROUND_IN_FP32 rounds them to the e4m3 grid here (`_round_to_e4m3_grid`), else the caller's
        cast does (RNE on the GPU, not in the interpreter). Shared with the GELU-quantisers."""
        q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        if ROUND_IN_FP32:
            q = _round_to_e4m3_grid(q)
        return q

    @triton.jit
    def row_codes(x):
        """fp32 tile x [BLOCK_M, BLOCK_K] of whole rows (masked entries 0) -> (its e4m3 values as fp32, the fp32
        scales [BLOCK_M]): `quantize_rows_reference`'s three fp32 operations."""
        scale = row_scale(tl.max(tl.abs(x), axis=1))  # [BLOCK_M]
        return scaled_codes(x, scale, True), scale

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # one program: BLOCK_M whole rows ([BLOCK_M, BLOCK_K] tile, BLOCK_K >= K): read once, write once
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
        q, scale = row_codes(x.to(tl.float32))
        tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + rows, scale, mask=row_ok)


    @triton.jit
    def static_grid(x, s):
        """fp32 tile x, static scale s (fp32 scalar) -> the e4m3 value of each element as fp32: RNE(clamp(x / s,
        -448, 448)) with IEEE division; NaN stays NaN (torch's clamp propagates it; plain max/min would saturate it
        to -448). Shared by `_quant_static_kernel` (which stores the codes) and `kernels.fp8_skinny` (which
        multiplies the values: every e4m3 value is exact in fp16 and bf16)."""
        q = tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * s)
        q = tl.minimum(tl.maximum(q, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                       propagate_nan=tl.PropagateNan.ALL)
        nan = q != q  # the grid rounding's bit tricks would turn a NaN into a number
        return tl.where(nan, q, _round_to_e4m3_grid(tl.where(nan, 0.0, q)))

    @triton.jit
    def static_codes(x, s):
        """fp32 tile x, static scale s -> e4m3 codes of `static_grid` (NaN -> torch's e4m3fn NaN code 0x7F, set
        explicitly: the interpreter's fp8 cast would turn it into a number). Shared by `_quant_static_kernel` and
        the producers that write codes beside their output (`kernels/rms_norm.py`, `kernels/attn_prep.py`: the
        quantiser fused into the op whose output an FP8 projection reads)."""
        q = static_grid(x, s)
        nan = q != q
        code = tl.where(nan, 0.0, q).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(nan, 0x7F, code).to(tl.uint8).to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def _quant_static_kernel(x_ptr, s_ptr, q_ptr, M, K, stride_xm, stride_qm,
                             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
        # static per-tensor scale s (fp32 [], read on the device: no host sync, CUDA-graph safe); grid
        # (cdiv(M, BLOCK_M), cdiv(K, BLOCK_K)); each element read once, its code written once
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
        code = static_codes(x.to(tl.float32), tl.load(s_ptr))
        tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], code, mask=mask)


def _interpreted() -> bool:
    """True when the kernel was built by Triton's interpreter (TRITON_INTERPRET=1 at import): CPU tensors only."""
    return triton is not None and type(_quant_rows_kernel).__name__ == "InterpretedFunction"


@torch.library.custom_op("sammie::fp8_quant_rows", mutates_args=())
def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `quantize_rows_reference`; one launch, one read of x. x's last dim must be contiguous."""
    if x.dim() != 2 or x.dtype not in IN_DTYPES or x.shape[1] > MAX_K:
        raise ValueError(f"fp8_quant_rows: need a 2-D {IN_DTYPES} tensor with K <= {MAX_K}, got "
                         f"{x.dtype} {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    (m, k), (q, scale) = x.shape, rows_outputs(x)
    if m == 0 or k == 0:
        return q, scale.fill_(1.0)
    block_m, block_k = rows_tiling(m, k)
    _quant_rows_kernel[(triton.cdiv(m, block_m),)](x, q, scale, m, k, x.stride(0), q.stride(0), BLOCK_M=block_m,
                                                   BLOCK_K=block_k, num_warps=8)
    return q, scale


def rows_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (codes e4m3 [M, K], scales fp32 [M, 1]) for a whole-row quantiser of x [M, K]."""
    return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device))


def rows_tiling(m: int, k: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of a whole-row kernel over [m, k]: ~8K elements per program on the GPU (fp32 in registers:
    32 per thread at 8 warps); the interpreter pays per operation, not per element, so it gets few, large
    programs."""
    block_k = triton.next_power_of_2(k)
    block_m = max(1, (65536 if _interpreted() else 8192) // block_k)
    return min(triton.next_power_of_2(m), block_m), block_k


@quantize_rows_triton.register_fake
def _(x):
    return rows_outputs(x)


# ---- static per-tensor scale (the checkpoint's W8A8 layers: Qwen3.6's attention and GDN projections) ------------
def quantize_static_reference(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] float, input_scale fp32 [] (calibrated, static) -> e4m3 [..., K] = RNE(clamp(x / s, -448, 448)).
    Four torch kernels on CUDA (cast to fp32, divide, clamp, cast to e4m3); tensor / tensor, so IEEE division on
    every device (see the module docstring)."""
    return (x.float() / input_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


# the start-up self-check's e4m3-pool samples (`with_e4m3_pools`): set by an engine whose KV pools are e4m3
# (QwenEngineConfig.kv_cache_dtype), so that other engines do not compile those builds at start; read by the
# kernels that write or read the pools (attn_prep, paged_attention); process-wide, like the engine's flags
E4M3_POOL_SAMPLES = False


def with_e4m3_pools(args: tuple, k_index: int) -> list[tuple[tuple, dict]]:
    """A pool kernel's self-check samples: `args` (model-dtype pools at args[k_index], args[k_index + 1]), and while
    E4M3_POOL_SAMPLES the same with those pools as e4m3 pools hold them (`kv_pool_cast`). Below sm_89 the kernels'
    `supports` says no to the second; the registry then skips it."""
    if not E4M3_POOL_SAMPLES:
        return [(args, {})]
    pools = tuple(kv_pool_cast(p, torch.float8_e4m3fn) for p in args[k_index:k_index + 2])
    return [(args, {}), ((*args[:k_index], *pools, *args[k_index + 2:]), {})]


def kv_pool_cast(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """x as a KV pool of `pool_dtype` stores it. e4m3 (the checkpoint's `kv_cache_quant_algo: FP8`): RNE(clamp(x,
    -448, 448)), `quantize_static_reference` at scale 1.0 -- ModelOpt's Qwen3.6 export ships no k / v scales, so 1.0
    is the scale its consumers use (a saturating cast: e4m3fn has no inf, an unclamped cast of a larger value would
    be NaN). Any other pool dtype: a plain cast."""
    if pool_dtype == torch.float8_e4m3fn:
        return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(pool_dtype)
    return x.to(pool_dtype)


def kv_pool_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pool[index] (any int64 index shape): e4m3 pools gathered as bytes, since torch's fp8 indexing is not
    implemented on every device. The readers of `qwen_engine.model.paged.PagedKV` pools and their references."""
    if pool.dtype == torch.float8_e4m3fn:
        return pool.view(torch.uint8)[index].view(pool.dtype)
    return pool[index]


def with_static_codes(y: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, its e4m3 codes with the static scale): what an op that writes the codes of its own output beside it must
    give (`kernels/rms_norm.py`, `kernels/attn_prep.py`: the *_fp8 references; the model norms' unfused path)."""
    return y, quantize_static_reference(y, input_scale)


@torch.library.custom_op("sammie::fp8_quant_static", mutates_args=())
def quantize_static_triton(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Same contract as `quantize_static_reference` in one launch (a decode step has ~130 such quantisations: 390
    launches fewer). Bit-exact, non-finite inputs included (NaN -> 0x7F, +-inf -> +-448): IEEE division (`div_rn`),
    NaN-propagating clamp, explicit RNE to the e4m3 grid. x's rows need not be contiguous with each other; its last
    dim is made unit-stride."""
    if x.dtype not in IN_DTYPES or input_scale.numel() != 1:
        raise ValueError(f"fp8_quant_static: need a {IN_DTYPES} tensor and a one-element scale, got {x.dtype} and "
                         f"a scale of shape {tuple(input_scale.shape)}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]) if x.dim() != 2 else x
    if x2.dim() == 2 and x2.shape[1] and x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if m and k:
        s = input_scale.reshape(())
        s = s if s.dtype == torch.float32 else s.float()
        block_k = min(triton.next_power_of_2(k), 1024 if not _interpreted() else 8192)
        block_m = max(1, min(triton.next_power_of_2(m), (4096 if not _interpreted() else 65536) // block_k))
        grid = (triton.cdiv(m, block_m), triton.cdiv(k, block_k))
        _quant_static_kernel[grid](x2, s, q, m, k, x2.stride(0), q.stride(0), BLOCK_M=block_m, BLOCK_K=block_k,
                                   num_warps=4, **pdl.launch_options())
    return q.view(shape)


@quantize_static_triton.register_fake
def _(x, input_scale):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn)


def decode_linear_args(name: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       input_scale: torch.Tensor, max_rows: int, supported: bool):
    """The decode FP8 linears' argument checks (`kernels/fp8_skinny.py`, `kernels/fp8_gemv.py`): x [M, K] with
    `supported` (the kernel's own shape / dtype rule for M <= max_rows), an e4m3 [N, K] weight, weight_scale [] or
    [N], input_scale [] -> (x, weight) with unit K stride, weight_scale fp32 [1] or [N], input_scale fp32 []."""
    m, k = x.shape
    n = weight.shape[0]
    if not supported or weight.shape[1] != k or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: need x [M <= {max_rows}, K] in {IN_DTYPES} and an e4m3 [N, K] weight, got x "
                         f"{x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    if weight_scale.numel() not in (1, n) or input_scale.numel() != 1:
        raise ValueError(f"{name}: weight_scale must be [] or [{n}] and input_scale [], got "
                         f"{tuple(weight_scale.shape)} and {tuple(input_scale.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    return x, weight, weight_scale.reshape(-1).float(), input_scale.reshape(()).float()


def static_supports(*, device: str, dtype: torch.dtype) -> bool:
    """Triton able to run on `device` (the interpreter: CPU) and a float input."""
    return triton is not None and device == ("cpu" if _interpreted() else "cuda") and dtype in IN_DTYPES


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(x: torch.Tensor) -> dict[str, Any]:
    return dict(device=x.device.type, dtype=x.dtype, shape=tuple(x.shape),
                last_dim_contiguous=x.dim() == 2 and x.stride(-1) == 1)


def supports(*, device: str, dtype: torch.dtype, shape: tuple[int, ...], **_: Any) -> bool:
    """Triton present and able to run on `device` (interpreter: CPU); a 2-D float tensor with K <= MAX_K."""
    if triton is None or device != ("cpu" if _interpreted() else "cuda"):
        return False
    return dtype in IN_DTYPES and len(shape) == 2 and shape[1] <= MAX_K


def compare(out: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """Bit-exact: same fp32 operations (IEEE division), same RNE cast."""
    (q, s), (q_ref, s_ref) = out, ref
    if q.shape != q_ref.shape or q.dtype != q_ref.dtype or s.shape != s_ref.shape or s.dtype != s_ref.dtype:
        return (f"shapes/dtypes {tuple(q.shape)} {q.dtype}, {tuple(s.shape)} {s.dtype} != "
                f"{tuple(q_ref.shape)} {q_ref.dtype}, {tuple(s_ref.shape)} {s_ref.dtype}")
    n_s = int((s.view(torch.int32) != s_ref.view(torch.int32)).sum())
    n_q = int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
    return None if n_s == n_q == 0 else f"{n_s} of {s.numel()} scales and {n_q} of {q.numel()} codes differ"


def _sample(device) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 200, generator=g) * torch.logspace(-3, 3, 37)[:, None]  # rows over 6 decades
    x[5] = 0  # an all-zero row
    return (x.to(torch.bfloat16).to(device),), {}


def register(registry) -> None:
    registry.add_op(NAME, quantize_rows_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="bit-exact codes and scales (same fp32 ops with IEEE division, RNE cast)")
    registry.add_implementation(NAME, "triton", quantize_rows_triton, supports)
