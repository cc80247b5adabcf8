"""FP8 W8A8 static-scale linear for skinny activations (decode: M <= SKINNY_MAX_M rows) in one Triton launch: the
static activation quantiser fused into a split-K GEMM. Same contract as `kernels.nvfp4.fp8_linear_reference` (the
checkpoint's GDN in_proj_qkv / in_proj_z / out_proj and attention q/k/v/o_proj), equal to it within fp32 summation
rounding (below).

Outcome (H200, 2026-11-30): it is FASTER than what it replaces only for narrow layers -- k_proj / v_proj, N = 512 --
and 1.3-3.5x slower for N >= 2048, streaming weights at 0.4-0.8 TB/s where cuBLASLt reaches 0.9-1.9 (SKINNY_MAX_N's
comment). Since the tenth session the registry puts the decode GEMV (`kernels/fp8_gemv.py`) ahead of it, which also
beats it on k/v_proj (4.5 vs 4.6 us at one row, 6.2 vs 6.8 at four; results/fp8_gemv_bench_run1) and takes every
call it would at Qwen3.6's shapes (N <= 1,024 with K <= 4,096: rows x N x K <= 16 MiB, `fp8_gemv.gemv_ok`); it stays
registered as the next choice if the GEMV is disabled.

Why it was written. A lone decode step runs 130 of these layers, each two launches: the one-launch Triton quantiser
(`kernels.fp8_quant.quantize_static_triton`, ~1.5 us) and cuBLASLt's FP8 GEMM through `torch._scaled_mm`. At M = 1
cuBLASLt picks 64-row tiles and no split-K: out_proj / o_proj (N = 2048) run 32 CTAs on the H200's 132 SMs, k / v_proj
(N = 512) 8. Measured on the H200 (Qwen run 9 profile, lone decode step): the FP8 GEMMs 0.80 ms for 1.28 GB (~1.6
TB/s of 4.8) plus 0.20 ms of quantiser launches. The hope was 1.28 GB at ~3.5 TB/s = 0.37 ms in one launch per layer.

Computation (per program: one BLOCK_N slice of the output rows, one K split; BLOCK_M = next power of two of M):
    q[m, k]   = e4m3 value of RNE(clamp(x[m, k] / input_scale, -448, 448))   (`fp8_quant.static_grid`: the same
                fp32 operations as the reference quantiser, IEEE division; NaN stays NaN)
    acc[m, n] = sum_k q[m, k] * w[n, k]        on CUDA cores: fp32 products (exact: 4 x 4 significant bits), fp32 sums
    y[m, n]   = acc[m, n] * (input_scale * weight_scale[n])     then one rounding to the output dtype
The reference sums the same exact products in fp32 in another order: the outputs agree to fp32 summation rounding
(<= (K - 1) 2^-24 of sum |products|) before the one rounding to bf16 -- tighter than cuBLASLt's FP8 path, whose
Hopper accumulator keeps ~14 bits between fp32 promotions (`kernels.fp8_linear`'s docstring).
History: the first version ran the products on the tensor cores (fp16 mma.sync on 16-row tiles, the quantiser over
all 16 rows every K tile); on the H200 (2026-11-30, results/fp8_skinny_bench_run1) it was 1.25-2.4x SLOWER than the
quantiser + cuBLASLt at M = 1 (8192 x 2048: 21.4 vs 8.9 us) -- hence CUDA cores and M <= 4.

Split K (`skinny_split`: until the 32-row tiles x splits give each SM a few programs): each split writes its fp32
partial to a workspace and bumps the tile's arrival counter; the split that arrives last sums the partials in split
order (deterministic) and writes y. The counters and that protocol are `kernels/split_k.py`'s (one int32 per output
tile, re-armed by the last split, so CUDA-graph replays start from zero; shared with the other split-K kernels).

Larger M (prefill, many streams) is the tensor-core regime where cuBLASLt is the right GEMM: `fp8_linear_skinny`
hands those calls, and those with N > SKINNY_MAX_N, to `fp8_linear.fp8_linear_triton_quant`.
"""

from __future__ import annotations

import torch

from kernels.fp8_quant import IN_DTYPES, decode_linear_args
from kernels.split_k import num_sms, split_counters

try:
    import triton
    import triton.language as tl

    from kernels.fp8_quant import static_grid
    from kernels.split_k import last_arrival, rearm
except ImportError:  # CPU-only installs without triton: the registry's other implementations and the reference
    triton = None

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Calls with more activation rows than this go to cuBLASLt (`fp8_linear_skinny`): the kernel's CUDA-core products
# grow with M (M x BN x BK per K tile) where the tensor cores' do not. 4 = the decode graphs' smallest buckets
# (1, 2, 4).
SKINNY_MAX_M = 4
# ... and calls with more output features (N) than this: measured on the H200 (2026-11-30, results/
# fp8_skinny_bench_run2, M = 1 / 2 / 4) this kernel beats the quantiser + cuBLASLt only where cuBLASLt's 64-row tiles
# leave most SMs idle: k_proj / v_proj (N = 512) 4.8 / 5.3 / 6.5 us against 6.2 / 6.6 / 7.6; at N = 2048-8192 it is
# 1.3-3.5x SLOWER (0.4-0.8 TB/s: it does not stream the weights at HBM speed; not profiled; that run's prefetch also
# read one tile past each K split, and M = 4 ran one spilling config: both fixed since, not re-measured). 1,024 lies
# between the measured win (512) and loss (2,048). With every FP8 layer on it the engine decoded a lone request at
# 180 tok/s against 213 (results/qwen_gpu_run14); on k/v_proj only, 213.6 either way (run 15: within noise).
SKINNY_MAX_N = 1024
MAX_SPLIT_K = 8
TARGET_PROGRAMS_PER_SM = 4  # no cp.async staging on this loop: bytes in flight come from resident programs


def skinny_split(n: int, k: int, sms: int) -> int:
    """K splits so that (32-row tiles) x splits >= TARGET_PROGRAMS_PER_SM x SMs, each split keeping >= 256 of K;
    a power of two <= MAX_SPLIT_K. H200 (132 SMs): N 8192 -> 4 (1,024 programs), 4096 / 2048 / 512 -> 8."""
    tiles, split = -(-n // 32), 1
    while split < MAX_SPLIT_K and tiles * split < TARGET_PROGRAMS_PER_SM * sms and k // (split * 2) >= 256:
        split *= 2
    return split


if triton is not None:
    # (BLOCK_N, BLOCK_K, warps): the [BLOCK_M, BLOCK_N, BLOCK_K] fp32 products of one K tile live in registers, at most
    # MAX_PRODUCTS_PER_THREAD (`_prune`): 2,048 products per warp serve M <= 2, 1,024 per warp M = 4
    MAX_PRODUCTS_PER_THREAD = 128
    _CONFIGS = [triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=1)
                for bn, bk, w in [(16, 256, 2), (32, 256, 4), (32, 128, 2), (64, 128, 4), (16, 512, 4), (64, 256, 8),
                                  (32, 512, 8), (16, 128, 2), (32, 128, 4), (16, 256, 4), (32, 256, 8)]]

    def _products_per_thread(c: "triton.Config", bm: int) -> int:
        return bm * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] // (32 * c.num_warps)

    def _prune(configs, named_args, **_):
        bm = named_args["M_BUCKET"]  # = BLOCK_M (the next power of two of M)
        fit = [c for c in configs if _products_per_thread(c, bm) <= MAX_PRODUCTS_PER_THREAD]
        return fit or [min(configs, key=lambda c: _products_per_thread(c, bm))]

    @triton.jit
    def _skinny_tile(x, w, offs_m, m_ok, offs_n, n_ok, t, k_end, s_xm, s_wn, BLOCK_K: tl.constexpr):
        """K tile t: activations [BM, BK] (model dtype) and e4m3 weights [BN, BK], zero at and past k_end (the end of
        the program's K split: the prefetch past its last tile reads nothing)."""
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        xt = tl.load(x + offs_m[:, None] * s_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                     other=0.0)
        return xt, wt

    @triton.jit
    def _fp8_skinny_kernel(x, w, s_in, s_w, y, ws, counters, M, N, K, M_BUCKET, s_xm, s_wn, s_swn, s_ym,
                           SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        # grid (cdiv(N, BLOCK_N), SPLIT_K); x [M, K] float, w [N, K] e4m3 (unit K stride), s_in fp32 [], s_w fp32 []
        # (s_swn = 0) or [N]; y [M, N]; ws [SPLIT_K, M, N] fp32 partials (SPLIT_K > 1). M_BUCKET: autotune key only.
        # CUDA cores, not tensor cores: at M <= 4 an MMA tile (>= 16 rows) would quantise and multiply >= 4x the
        # rows there are (the first version did, on fp16 mma.sync: 1.25-2.4x slower than cuBLASLt on the H200).
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = offs_m < M, offs_n < N
        k_tiles = tl.cdiv(K, BLOCK_K)
        per = tl.cdiv(k_tiles, SPLIT_K)
        t0 = pid_k * per
        t1 = tl.minimum(t0 + per, k_tiles)
        k_end = tl.minimum(t1 * BLOCK_K, K)
        sx = tl.load(s_in)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # the next tile's loads are issued before this tile's arithmetic (register double buffering: more bytes in
        # flight per program; the loop has no dot for Triton's pipeliner to stage)
        xt, wt = _skinny_tile(x, w, offs_m, m_ok, offs_n, n_ok, t0, k_end, s_xm, s_wn, BLOCK_K)
        for t in range(t0, t1):
            xn, wn = _skinny_tile(x, w, offs_m, m_ok, offs_n, n_ok, t + 1, k_end, s_xm, s_wn, BLOCK_K)  # t1: zeros
            q = static_grid(xt.to(tl.float32), sx)  # [BM, BK] e4m3 values (fp32)
            # e4m3 x e4m3 products are exact in fp32; summed in fp32
            acc += tl.sum(q[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
            xt, wt = xn, wn
        alpha = sx * tl.load(s_w + offs_n * s_swn, mask=n_ok, other=0.0)  # input_scale * weight_scale, as the ref
        out_ok = m_ok[:, None] & n_ok[None, :]
        y_ptr = y + offs_m[:, None] * s_ym + offs_n[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptr, (acc * alpha[None, :]).to(y.dtype.element_ty), mask=out_ok)
        else:
            w_ptr = ws + offs_m[:, None] * N + offs_n[None, :]
            tl.store(w_ptr + pid_k * M * N, acc, mask=out_ok)
            if last_arrival(counters, pid_n, SPLIT_K):  # the last split of this tile: the others' partials are visible
                tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for p in tl.static_range(SPLIT_K):  # split order (deterministic); ".cg": L2, never a stale L1 line
                    tot += tl.load(w_ptr + p * M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr, (tot * alpha[None, :]).to(y.dtype.element_ty), mask=out_ok)
                rearm(counters, pid_n)

    _fp8_skinny_autotuned = triton.autotune(configs=_CONFIGS, key=["M_BUCKET", "N", "K", "SPLIT_K"],
                                            prune_configs_by={"early_config_prune": _prune})(_fp8_skinny_kernel)


def _interpreted() -> bool:
    """True when the kernel was built by Triton's interpreter (TRITON_INTERPRET=1 at import): CPU tensors only."""
    return triton is not None and type(_fp8_skinny_kernel).__name__ == "InterpretedFunction"


# The interpreter cannot benchmark configs; it runs this one (small tiles keep masked edges and K loops exercised).
INTERPRETER_CONFIG = dict(BLOCK_N=32, BLOCK_K=64)
_MIN_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in _CONFIGS) if triton is not None else 32  # counters cover this grid


def supported(m: int, k: int, n: int, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Triton installed; shapes and dtypes the kernel takes: 1 <= M <= SKINNY_MAX_M rows, float activations and
    output (any N: the N <= SKINNY_MAX_N rule is `fp8_linear.fp8_linear_skinny`'s, where it is faster)."""
    return (triton is not None and 0 < m <= SKINNY_MAX_M and k > 0 and n > 0 and dtype in IN_DTYPES
            and out_dtype in OUT_DTYPES)


@torch.library.custom_op("sammie::fp8_skinny_linear", mutates_args=())
def fp8_skinny_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
                  out_dtype: torch.dtype, split_k: int = 0, block_n: int = 0, block_k: int = 0) -> torch.Tensor:
    """x [M, K] (unit K stride; M <= SKINNY_MAX_M), weight e4m3 [N, K] (unit K stride), weight_scale fp32 [] or [N],
    input_scale fp32 [] -> y [M, N] in out_dtype. `split_k` 0: `skinny_split`'s choice; `block_n` / `block_k` 0: the
    autotuner's (tests and benchmarks pin them). One launch; no host syncs (CUDA-graph capturable)."""
    m, k = x.shape
    n = weight.shape[0]
    x, weight, s_w, s_in = decode_linear_args("fp8_skinny_linear", x, weight, weight_scale, input_scale,
                                              SKINNY_MAX_M, supported(m, k, n, x.dtype, out_dtype))
    interp = _interpreted()
    split = split_k or skinny_split(n, k, num_sms(x.device.index))
    bn_min = block_n or (INTERPRETER_CONFIG["BLOCK_N"] if interp else _MIN_BLOCK_N)
    counters = None if split == 1 else split_counters(x.device, triton.cdiv(n, bn_min))
    if split > 1 and counters is None:  # more tiles than counters (N > 65,536 at 16-row tiles), or a first use inside
        split = 1  #                  a CUDA-graph capture (`split_counters`): no split
    # the interpreter truncates fp32 -> bf16 / fp16 casts (`w4a16_gemm`'s note): it writes fp32 and torch rounds
    y = torch.empty((m, n), dtype=torch.float32 if interp else out_dtype, device=x.device)
    ws = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    args = (x, weight, s_in, s_w, y, ws, counters if counters is not None else s_w, m, n, k,
            triton.next_power_of_2(m), x.stride(0), weight.stride(0), 1 if s_w.numel() > 1 else 0, y.stride(0))
    meta = dict(SPLIT_K=split, BLOCK_M=triton.next_power_of_2(m))
    if interp or block_n or block_k:
        cfg = dict(INTERPRETER_CONFIG) if interp else dict(BLOCK_N=32, BLOCK_K=256)
        cfg.update({kk: v for kk, v in (("BLOCK_N", block_n), ("BLOCK_K", block_k)) if v})
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), split)
        _fp8_skinny_kernel[grid](*args, **meta, **cfg, num_warps=4)
    else:
        grid = lambda c: (triton.cdiv(n, c["BLOCK_N"]), split)  # noqa: E731
        _fp8_skinny_autotuned[grid](*args, **meta)
    return y if y.dtype == out_dtype else y.to(out_dtype)


@fp8_skinny_op.register_fake
def _(x, weight, weight_scale, input_scale, out_dtype, split_k=0, block_n=0, block_k=0):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)
