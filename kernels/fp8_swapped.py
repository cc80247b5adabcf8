"""FP8 W8A8 static-scale linear for 5-64 activation rows (decode at 8-64 streams) on the tensor cores, the weight as
the MMA's M operand ("swap AB"): y^T [N, M] = W [N, K] @ q^T [K, M]. Same contract as
`kernels.nvfp4.fp8_linear_reference` (the checkpoint's GDN in_proj_qkv / in_proj_z / out_proj and attention
q/k/v/o_proj, and the decode steps' fused projections with per-row weight scales).

Why. At 32 streams the engine ran these projections on cuBLASLt's FP8 GEMM (`torch._scaled_mm`): 0.78 ms of an
8.65 ms decode step's kernel time for 1.28 GB of weights, ~1.6 TB/s of the H200's 4.8 (sorted_profile run 1: four
`nvjet_sm90_qqtst` kernels, 130 launches; the fifth nvjet there, 0.22 ms, is the router's bf16 GEMM). At M <= 64 a
GEMM's cost is the weight stream: one [BLOCK_N, BLOCK_K] e4m3 tile per K step and per program, the M rows as the
MMA's narrow N (16-64), so a program is a pipelined weight stream with a few wgmmas per tile; split K fills the SMs
where N / BLOCK_N tiles do not.

Outcome (H200, 2026-12-04, benchmarks/RESULTS.md "Forty-first session"): per call on codes against cuBLASLt on codes
(fp8_swapped_run2, M = 32): 8192 x 2048 6.89 against 7.69 us, 4096 x 2048 5.50 / 5.95, 2048 x 4096 6.01 / 6.68,
512 x 2048 4.01 / 4.47; the decode steps' fused projections (`quantized.fused_fp8_projections`, now also at 5-64
rows) 12,288 x 2048 8.89 against 15.36 (row-wise cuBLASLt), 9,216 x 2048 8.20 against 13.46. At 64 rows the
unfused 2048 x 4096 and 512 x 2048 calls are 4-8% slower than cuBLASLt (the fused ones 27-29% faster). In the
engine the step's FP8 kernels went 0.78 -> 0.61 ms (80 launches instead of 130) and 32 streams +1.9% together with
the gated norm reading z in place (qwen_fp8sw run 2; the norm alone had cost 0.105 ms a step as a copy); still
2.1-2.8 TB/s, not HBM speed: short programs (8-16 K tiles) whose prologue and epilogue the grid does not hide.

Computation (grid (cdiv(N, BLOCK_N), SPLIT); BLOCK_M = max(16, next power of two of M)):
    q[m, k]    the e4m3 activation codes (`fp8_quant.quantize_static_triton`'s, or the producing op's: same bits)
    acc[n, m]  = sum_k w[n, k] q[m, k]    wgmma e4m3 x e4m3 -> fp32, promoted (below)
    y[m, n]    = acc[n, m] * (input_scale * weight_scale[n])    then one rounding to the output dtype
SPLIT > 1: program (i, s) sums its share of the K tiles, stores the fp32 partial to a workspace, and the last of a
tile's SPLIT programs to arrive sums the partials in split order (deterministic) and runs the epilogue
(`kernels/split_k.py`'s counters, re-armed to 0: CUDA-graph replays start clean).

Numerics. The products are exact (4 x 4 significant bits); the Hopper FP8 wgmma adds them into an accumulator of ~14
bits, so the kernel promotes into fp32 registers every PROMOTE_EVERY = 128 products (Triton's
`max_num_imprecise_acc`, the same interval as CUTLASS's non-fast-accum schedule): the error bound is
`fp8_linear.ACC_REL_BOUND_HOPPER` x sum |products| plus the output rounding, what cuBLASLt's path is held to. Under
the interpreter (CPU tests) the sums are plain fp32: (K - 1) 2^-24 x sum |products|.

Napkin math (H200, 4.8 TB/s; M = 32): 8192 x 2048 = 16.8 MB -> 3.5 us; a 32-stream step's 130 projections read
1.28 GB -> 0.27 ms at full bandwidth. The codes [M, K] are re-read by every program from L2 (BLOCK_M x BLOCK_K bytes
per K tile against BLOCK_N x BLOCK_K of weight: half the weight bytes at M = 32, BLOCK_N = 64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import pdl
from kernels.fp8_quant import IN_DTYPES, decode_linear_args, quantize_static_triton
from kernels.split_k import effective_split

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
    from kernels.split_k import last_arrival, rearm
except ImportError:  # CPU-only installs without triton: supported() says no
    triton = None

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SWAPPED_MIN_M = 5  # 1-4 rows: the CUDA-core decode GEMV (`fp8_gemv.gemv_ok`) is the engine's choice there
SWAPPED_MAX_M = 64  # BLOCK_M <= 64 (one [64, 64] fp32 accumulator per warpgroup); beyond: cuBLASLt's GEMM
PROMOTE_EVERY = 128  # products per fp32 promotion of the FP8 accumulator (module docstring)
MIN_BLOCK_M = 16  # tl.dot's smallest dimension
MAX_SPLIT_K = 16
SWAPPED_MAJORS = (9,)  # where the registry uses it: Hopper (e4m3 wgmma), measured on the H200 only


def swapped_ok(m: int, n: int, k: int) -> bool:
    """The engine's rule for this kernel: SWAPPED_MIN_M..SWAPPED_MAX_M rows, K a multiple of 16 (16-byte weight and
    code rows for the cp.async tiles)."""
    return SWAPPED_MIN_M <= m <= SWAPPED_MAX_M and n > 0 and k > 0 and k % 16 == 0


@dataclass(frozen=True)
class SwappedConfig:
    """One launch's tiling: BLOCK_N weight rows x BLOCK_K of K per program and K step, SPLIT programs per output
    tile, `num_stages` tiles in flight (cp.async pipeline), `num_warps` (4: one warpgroup)."""

    block_n: int = 64
    block_k: int = 128
    split: int = 1
    num_stages: int = 6
    num_warps: int = 4


# The tiling rule, from the sweep at 32 rows (H200, PDL on, per call in CUDA graphs from HBM; fp8_swapped_run1,
# 5 BLOCK_N x BLOCK_K x stages tilings x splits 1-16 per shape): 64-row programs with 128-wide K tiles won or tied
# everywhere (128-row programs and 256-wide tiles never won); 6 stages won or came within 6% of the best; a split
# costs more than the SMs it fills once the output tiles alone give >= 64 programs (4096 x 2048: split 1 5.44 us,
# 2 5.78, 4 6.96, 16 14.8 -- a program's prologue, partial store and reduction against 8-16 K tiles of work), and
# pays below that (2048 x 4096, 32 tiles: split 1 7.99, 4 6.09; 512 x 2048, 8 tiles: split 1 4.60, 4 4.00).
SPLIT_BELOW_TILES = 64  # output tiles from which the launch runs unsplit
SPLIT_TARGET_PROGRAMS = 128  # below it: split until tiles x split reaches this ...
MIN_K_TILES_PER_SPLIT = 4  # ... while every split keeps this many K tiles


def swapped_config(n: int, k: int) -> SwappedConfig:
    """The tiling the op uses when not given one, for an [N, K] weight (the rule above, measured at 32 rows on the
    H200's 132 SMs)."""
    bn, bk = 64, 128
    tiles, k_tiles, split = -(-n // bn), -(-k // bk), 1
    if tiles < SPLIT_BELOW_TILES:
        while (split < MAX_SPLIT_K and tiles * split < SPLIT_TARGET_PROGRAMS
               and k_tiles >= 2 * split * MIN_K_TILES_PER_SPLIT):
            split *= 2
    return SwappedConfig(block_n=bn, block_k=bk, split=split)


if triton is not None:

    @triton.jit
    def _fp8_swapped_kernel(q, w, s_in, s_w, y, ws, counters, M, N, K, s_qm, s_wn, s_swn, s_ym,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            SPLIT: tl.constexpr, EVEN: tl.constexpr, PROMOTE: tl.constexpr,
                            USE_PDL: tl.constexpr = False):
        # one program: output features rows [BN] (weight rows, the MMA's M) x all M activation rows (the MMA's N),
        # K tiles [t_lo, t_hi) of its split. EVEN: N % BN == 0 and K % BK == 0 (every Qwen3.6 projection): no masks.
        pid_n, sp = tl.program_id(0), tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        toks = tl.arange(0, BLOCK_M)
        k_tiles = tl.cdiv(K, BLOCK_K)
        per = tl.cdiv(k_tiles, SPLIT)
        t_lo = sp * per
        t_hi = tl.minimum(t_lo + per, k_tiles)
        w_rows = w + rows.to(tl.int64)[:, None] * s_wn
        q_rows = q + toks[:, None] * s_qm
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # acc^T: weight rows x activation rows
        for t in range(t_lo, t_hi):
            ks = t * BLOCK_K + tl.arange(0, BLOCK_K)
            if EVEN:
                wt = tl.load(w_rows + ks[None, :])  # [BN, BK] e4m3
                qt = tl.load(q_rows + ks[None, :], mask=(toks < M)[:, None], other=0.0)  # [BM, BK] e4m3
            else:
                wt = tl.load(w_rows + ks[None, :], mask=(rows < N)[:, None] & (ks < K)[None, :], other=0.0)
                qt = tl.load(q_rows + ks[None, :], mask=(toks < M)[:, None] & (ks < K)[None, :], other=0.0)
            acc = tl.dot(wt, tl.trans(qt), acc, max_num_imprecise_acc=PROMOTE)
        last = True
        if SPLIT > 1:
            tile_bn = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [BN, BM]
            part = ws + pid_n * (BLOCK_N * BLOCK_M) + tile_bn  # this tile's slots of split 0
            step = tl.num_programs(0) * (BLOCK_N * BLOCK_M)  # between splits
            tl.store(part + sp * step, acc)
            last = last_arrival(counters, pid_n, SPLIT)
            if last:  # every split's partial is visible: their sum in split order (".cg": L2, never stale L1)
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for i in tl.static_range(SPLIT):
                    acc += tl.load(part + i * step, cache_modifier=".cg")
                rearm(counters, pid_n)
        if last:
            row_ok = rows < N
            scale = tl.load(s_in) * tl.load(s_w + rows * s_swn, mask=row_ok, other=0.0)  # [BN] fp32
            out = acc * scale[:, None]
            ok = row_ok[:, None] & (toks < M)[None, :]
            tl.store(y + toks[None, :] * s_ym + rows[:, None], out.to(y.dtype.element_ty), mask=ok)


def _interpreted() -> bool:
    """True when the kernel was built by Triton's interpreter (TRITON_INTERPRET=1 at import): CPU tensors only."""
    return triton is not None and type(_fp8_swapped_kernel).__name__ == "InterpretedFunction"


def supported(m: int, k: int, n: int, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Triton installed; 1 <= M <= SWAPPED_MAX_M rows, float activations and output (SWAPPED_MIN_M is the
    registry's rule for where the engine uses it, not the op's)."""
    return (triton is not None and 0 < m <= SWAPPED_MAX_M and k > 0 and n > 0 and dtype in IN_DTYPES
            and out_dtype in OUT_DTYPES)


@torch.library.custom_op("sammie::fp8_swapped_linear", mutates_args=())
def fp8_swapped_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
                   out_dtype: torch.dtype, codes: torch.Tensor | None = None, block_n: int = 0, block_k: int = 0,
                   split_k: int = 0, num_stages: int = 0) -> torch.Tensor:
    """x [M, K] (M <= SWAPPED_MAX_M), weight e4m3 [N, K], weight_scale fp32 [] or [N], input_scale fp32 [] -> y [M, N]
    in out_dtype. `codes`: x's e4m3 codes [M, K] with this input_scale, made by the op that produced x (else one
    quantiser launch first: the same bits). `block_n` / `block_k` / `split_k` / `num_stages` 0: `swapped_config`'s
    (tests and benchmarks pin them). No host syncs (CUDA-graph capturable)."""
    m, k = x.shape
    n = weight.shape[0]
    x, weight, s_w, s_in = decode_linear_args("fp8_swapped_linear", x, weight, weight_scale, input_scale,
                                              SWAPPED_MAX_M, supported(m, k, n, x.dtype, out_dtype))
    if codes is None:
        codes = quantize_static_triton(x, s_in)
    elif codes.shape != (m, k) or codes.dtype != torch.float8_e4m3fn or codes.device != x.device:
        raise ValueError(f"fp8_swapped_linear: codes must be e4m3 {(m, k)} on {x.device}, got {codes.dtype} "
                         f"{tuple(codes.shape)} on {codes.device}")
    elif codes.stride(1) != 1:
        codes = codes.contiguous()
    interp = _interpreted()
    base = swapped_config(n, k)
    cfg = SwappedConfig(block_n=block_n or base.block_n, block_k=block_k or base.block_k,
                        split=split_k or base.split, num_stages=num_stages or base.num_stages)
    tiles, k_tiles = triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k)
    # 1 without counters (more tiles than SPLIT_COUNTERS; a first use inside a capture), else every split a K tile
    split, counters = effective_split(cfg.split, k_tiles, tiles, x.device)
    # the interpreter truncates fp32 -> bf16 / fp16 casts (`w4a16_gemm`'s note): it writes fp32 and torch rounds
    y = torch.empty((m, n), dtype=torch.float32 if interp else out_dtype, device=x.device)
    bm = max(MIN_BLOCK_M, triton.next_power_of_2(m))
    ws = (torch.empty((split, tiles, cfg.block_n, bm), dtype=torch.float32, device=x.device) if split > 1
          else y)  # any tensor when SPLIT is 1
    even = n % cfg.block_n == 0 and k % cfg.block_k == 0
    _fp8_swapped_kernel[(tiles, split)](
        codes, weight, s_in, s_w, y, ws, counters if counters is not None else s_w, m, n, k,
        codes.stride(0), weight.stride(0), 1 if s_w.numel() > 1 else 0, y.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split, EVEN=even,
        PROMOTE=min(PROMOTE_EVERY, cfg.block_k),  # tl.dot: at most the tile's K
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options())
    return y if y.dtype == out_dtype else y.to(out_dtype)


@fp8_swapped_op.register_fake
def _(x, weight, weight_scale, input_scale, out_dtype, codes=None, block_n=0, block_k=0, split_k=0, num_stages=0):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)
