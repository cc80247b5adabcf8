"""FP8 W8A8 static-scale linear for decode-sized calls (1-4 activation rows) as a GEMV on CUDA cores: one program
per (activation row, slice of BLOCK_N weight rows), the whole K streamed in BLOCK_K tiles, no split K, no tensor
cores. Same contract as `kernels.nvfp4.fp8_linear_reference` (the checkpoint's GDN in_proj_qkv / in_proj_z /
out_proj and attention q/k/v/o_proj), equal to it within fp32 summation rounding.

Why. A lone decode step runs 130 of these layers; on the H200 they took 0.98 ms of its ~3.9 ms of GPU time (Qwen
profile run 13, 2026-11-30: cuBLASLt's FP8 GEMM 0.72 ms in 110 calls + the one-launch quantiser 0.17 ms + the
split-K `fp8_skinny` kernel on k/v_proj 0.09 ms) for ~1.28 GB of weights: ~1.6 TB/s of 4.8. At one row cuBLASLt
runs 64-row tiles (32 CTAs for N = 2048 on 132 SMs) and `kernels/fp8_skinny.py` (CUDA cores, split K) streamed only
0.4-0.8 TB/s at N >= 2048. The NVFP4 decode GEMV (`kernels/w4a16_gemv.py`: few rows per program, the next K tile's
loads in flight during this tile's arithmetic, thousands of programs) beat its tensor-core kernel 1.3-1.5x per call;
this is that structure for e4m3 weights, where a weight costs fewer instructions (one byte, no block scales).

Per program (activation row r, weight rows n0 .. n0 + BLOCK_N), the weights read as int32 words of 4 bytes:
    q[k]    = e4m3 value of RNE(clamp(x[r, k] / input_scale, -448, 448))      "triton_quant+gemv" (X_CODES, the
              default): read from the codes the one-launch quantiser wrote (`fp8_quant.quantize_static_triton`);
              "triton_gemv": computed in the loop with the same fp32 operations (`fp8_quant.static_grid`, IEEE
              division) -- bit-identical values either way
    acc[n, i] += sum_j q[4i + j] * w[n, 4i + j]   (j = byte of word i, four chained fp32 FMAs of exact products:
              4 x 4 significant bits); no reduction in the loop; the next tile's words are loaded before this
              tile's FMAs (register double-buffering: the loop has no dot for Triton's pipeliner)
    y[r, n] = sum_i acc[n, i] * (input_scale * weight_scale[n])               then one rounding to the output dtype
So the result differs from the reference only by fp32 summation order: <= (K - 1) 2^-24 of sum |products| before
the output rounding (tests/test_kernel_fp8_gemv.py), and both quantiser placements give the same bits.

Instruction budget (why words and PTX). At 4.8 TB/s an H200 must retire a weight per ~7 thread-instructions of its
issue rate, so the loop has to stay near 3-4 per weight. Triton's own e4m3 -> fp32 conversion of a uint8 tile
unpacks each loaded word into bytes and repacks byte pairs for `cvt.rn.f16x2.e4m3x2` (5.8-6.6 loop instructions
per weight, offline sm_90 SASS); on int32 words, PTX converts two byte pairs and four halves (`_e4m3x4_f32`): 3.2-4.3
per weight. The in-loop quantiser adds a division, clamp and rounding per activation element for every program of a
row: 6.6-10.6 per weight, hence second in the registry; the per-call benchmark (benchmarks/fp8_skinny_bench.py)
measures both.

Rows > 1 read the weight once per row, adjacent programs sharing a weight slice (program p: row p % R, slice p // R,
so the repeats are L2 hits); `gemv_ok` limits that to where it measured faster (GEMV_MAX_REPEAT_BYTES).

Outcome (H200, 2026-11-30, benchmarks/RESULTS.md run 17): per call at one row, quantiser included, 0.68-0.93x
cuBLASLt's time (8192 x 2048: 8.3 vs 8.8 us, 2.0 TB/s; 2048 x 4096: 7.4 vs 9.8 us); in the engine a lone request
decoded at 293.1 tok/s against 285.6 without it (same process).
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.fp8_quant import IN_DTYPES, decode_linear_args

try:
    import triton
    import triton.language as tl

    from kernels.fp8_quant import quantize_static_triton, static_grid
    from kernels.pdl import enter as pdl_enter
    from kernels.pdl import prefetch_l2_once
except ImportError:  # CPU-only installs without triton: the registry's other implementations and the reference
    triton = None

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GEMV_MAX_ROWS = 4  # the decode graphs' smallest buckets (1, 2, 4); more rows are the tensor cores' regime
# Rows 2-4 read the weight once per row: cuBLASLt's time hardly grows with rows, the GEMV's does. Measured on the
# H200 (2026-11-30, results/fp8_gemv_bench_run1, quantiser included), the GEMV wins at one row for every Qwen3.6
# projection (0.68-0.93x cuBLASLt's time), at 2 rows up to 8 MiB of e4m3 (out_proj 8.2 vs 10.0 us; in_proj_z, also
# 8 MiB, 8.0 vs 7.7: a tie) and at 4 rows only k/v_proj (1 MiB: 6.2 vs 7.5 us; 16 MiB: 17.6 vs 10.8). Hence: one
# row always, else rows x weight bytes <= 16 MiB.
GEMV_MAX_REPEAT_BYTES = 16 << 20


def gemv_ok(m: int, n: int, k: int) -> bool:
    """Whether an [m, k] x [n, k]^T call takes the GEMV: one row always, 2-4 rows while m x n x k <= 16 MiB."""
    return n > 0 and k > 0 and (m == 1 or (0 < m <= GEMV_MAX_ROWS and m * n * k <= GEMV_MAX_REPEAT_BYTES))


if triton is not None:
    # (BLOCK_N, BLOCK_K, warps): a thread holds BLOCK_N x BLOCK_K / (128 warps) fp32 accumulators (<= 32 here) and
    # as many weight words per tile, twice with the prefetch. One-warp programs convert the activation tile without
    # barriers (offline sm_90 SASS: 3.2-3.5 loop instructions per weight; 3.4-4.3 with 2-4 warps, which do).
    _CONFIGS = [triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=1)
                for bn, bk, w in [(4, 512, 1), (8, 512, 1), (4, 1024, 1), (2, 1024, 1), (8, 256, 1), (16, 256, 1),
                                  (4, 512, 2), (8, 512, 2), (8, 1024, 2), (16, 512, 2), (16, 512, 4), (8, 1024, 4),
                                  (16, 1024, 4), (32, 512, 4), (32, 256, 2)]]

    @triton.jit
    def _byte_f32(v, j: tl.constexpr):
        """Byte j of int32 words as e4m3 -> fp32 (the interpreter's path; its fp8 cast turns the NaN codes 0x7F /
        0xFF into +-480, hence the explicit NaN)."""
        b = ((v >> (8 * j)) & 0xFF).to(tl.uint8)
        return tl.where((b & 0x7F) == 0x7F, float("nan"), b.to(tl.float8e4nv, bitcast=True).to(tl.float32))

    @triton.jit
    def _x_quant(xr, sx, i, j: tl.constexpr, K, EVEN: tl.constexpr):
        """Activations k = 4 i + j quantised (`static_grid`: e4m3 values as fp32), zero past K."""
        k = 4 * i + j
        if EVEN:
            xj = tl.load(xr + k)
        else:
            xj = tl.load(xr + k, mask=k < K, other=0.0)
        return static_grid(xj.to(tl.float32), sx)

    @triton.jit
    def _e4m3x4_f32(v, INTERPRET: tl.constexpr):
        """int32 words of 4 e4m3 bytes -> 4 fp32 tensors of v's shape (byte j of each word: k = 4 i + j), exact;
        NaN codes stay NaN. On the GPU in PTX: two `cvt.rn.f16x2.e4m3x2` on the word's halves, four f16 -> f32:
        1.5 instructions per weight where Triton's own conversion of a uint8 tile unpacks and repacks every byte
        pair first (~3; offline sm_90 SASS)."""
        if INTERPRET:  # no PTX
            return _byte_f32(v, 0), _byte_f32(v, 1), _byte_f32(v, 2), _byte_f32(v, 3)
        return tl.inline_asm_elementwise(
            """{
            .reg .b16 a, b, l0, l1, h0, h1;
            .reg .b32 lo, hi;
            mov.b32 {a, b}, $4;
            cvt.rn.f16x2.e4m3x2 lo, a;
            cvt.rn.f16x2.e4m3x2 hi, b;
            mov.b32 {l0, l1}, lo;
            mov.b32 {h0, h1}, hi;
            cvt.f32.f16 $0, l0;
            cvt.f32.f16 $1, l1;
            cvt.f32.f16 $2, h0;
            cvt.f32.f16 $3, h1;
            }""",
            "=r,=r,=r,=r,r", [v], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)

    @triton.jit
    def _weight_words(w_rows, row_ok, t, KW, EVEN: tl.constexpr, BLOCK_W: tl.constexpr):
        """K tile t of the program's weight rows as int32 words of 4 e4m3 bytes [BN, BW] (BW = BLOCK_K / 4), zero
        (no memory access) past K. EVEN (whole tiles, every row in range): no masks; the caller keeps t inside K."""
        i = t * BLOCK_W + tl.arange(0, BLOCK_W)
        if EVEN:
            return tl.load(w_rows + i[None, :])
        return tl.load(w_rows + i[None, :], mask=row_ok[:, None] & (i < KW)[None, :], other=0)

    @triton.jit
    def _x_values(xr, sx, t, K, X_CODES: tl.constexpr, INTERPRET: tl.constexpr, EVEN: tl.constexpr,
                  BLOCK_W: tl.constexpr):
        """K tile t of the activation row as 4 fp32 tensors [BW] of e4m3 values (k = 4 i + j for the j-th), zero
        past K: read as codes (X_CODES: int32 words of the quantiser's bytes) or quantised here (`static_grid`)."""
        i = t * BLOCK_W + tl.arange(0, BLOCK_W)
        if X_CODES:
            if EVEN:
                words = tl.load(xr.to(tl.pointer_type(tl.int32)) + i)
            else:
                words = tl.load(xr.to(tl.pointer_type(tl.int32)) + i, mask=i < K // 4, other=0)
            return _e4m3x4_f32(words, INTERPRET)
        return (_x_quant(xr, sx, i, 0, K, EVEN), _x_quant(xr, sx, i, 1, K, EVEN), _x_quant(xr, sx, i, 2, K, EVEN),
                _x_quant(xr, sx, i, 3, K, EVEN))

    @triton.jit
    def _fp8_gemv_kernel(x, w, s_in, s_w, y, R, N, K, R_BUCKET, s_xm, s_wn, s_swn, s_ym, X_CODES: tl.constexpr,
                         INTERPRET: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
        # 1-D grid of R x cdiv(N, BN) programs; x [R, K] (float, or e4m3 codes when X_CODES), w e4m3 [N, K] (unit K
        # stride), s_in fp32 [], s_w fp32 [] (s_swn = 0) or [N], y [R, N]. K a multiple of 4 (byte offsets of rows
        # and codes multiples of 4: the launch checks); R_BUCKET: an autotune key only.
        # PREFETCH (kernels/pdl.py, with PDL): the program's weight rows (K bytes each) into L2 before the wait.
        BLOCK_W: tl.constexpr = BLOCK_K // 4
        p = tl.program_id(0)
        r = p % R  # the R programs of one weight slice are adjacent: rows 2..R re-read it from L2
        rows = (p // R) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = rows < N
        if PREFETCH:  # the launch checks the rows are contiguous (s_wn == K): one range of <= BN rows
            row0 = (p // R) * BLOCK_N
            prefetch_l2_once(w + row0.to(tl.int64) * s_wn, tl.minimum(BLOCK_N, N - row0) * K)
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        kw = K // 4
        w_rows = w.to(tl.pointer_type(tl.int32)) + rows[:, None].to(tl.int64) * (s_wn // 4)
        xr = x + r.to(tl.int64) * s_xm
        sx = tl.load(s_in)
        # input_scale * weight_scale, as the reference; loaded before the loop, not after it (behind the row sums'
        # reduction, a CTA barrier at more than one warp, it would be one more L2 round trip)
        alpha = sx * tl.load(s_w + rows * s_swn, mask=ok, other=0.0)
        acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        n_tiles = tl.cdiv(K, BLOCK_K)
        wt = _weight_words(w_rows, ok, 0, kw, EVEN, BLOCK_W)
        for t in range(0, n_tiles):
            # the next tile (past K: masked, no access; EVEN: the last tile again, an L1 / L2 hit, unused)
            wn = _weight_words(w_rows, ok, tl.minimum(t + 1, n_tiles - 1) if EVEN else t + 1, kw, EVEN, BLOCK_W)
            q0, q1, q2, q3 = _x_values(xr, sx, t, K, X_CODES, INTERPRET, EVEN, BLOCK_W)  # [BW] each
            w0, w1, w2, w3 = _e4m3x4_f32(wt, INTERPRET)
            # exact products, fp32 sums (four chained FMAs)
            acc += w0 * q0[None, :]
            acc += w1 * q1[None, :]
            acc += w2 * q2[None, :]
            acc += w3 * q3[None, :]
            wt = wn
        tl.store(y + r.to(tl.int64) * s_ym + rows, (tl.sum(acc, axis=1) * alpha).to(y.dtype.element_ty), mask=ok)

    def _even(args) -> bool:
        """Whole K tiles and whole row slices (every Qwen3.6 projection at every config): no masks in the loop."""
        return args["K"] % args["BLOCK_K"] == 0 and args["N"] % args["BLOCK_N"] == 0

    _fp8_gemv_autotuned = triton.autotune(configs=_CONFIGS, key=["R_BUCKET", "N", "K", "X_CODES"])(
        triton.heuristics({"EVEN": _even})(_fp8_gemv_kernel))


def _interpreted() -> bool:
    """True when the kernel was built by Triton's interpreter (TRITON_INTERPRET=1 at import): CPU tensors only."""
    return triton is not None and type(_fp8_gemv_kernel).__name__ == "InterpretedFunction"


# The interpreter cannot benchmark configs; it runs this one (tests also pin smaller tiles for ragged edges).
INTERPRETER_CONFIG = dict(BLOCK_N=16, BLOCK_K=128)


def supported(m: int, k: int, n: int, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Triton installed; 1 <= M <= GEMV_MAX_ROWS rows, float activations and output (`gemv_ok` is the engine's rule
    for where it is faster)."""
    return (triton is not None and 0 < m <= GEMV_MAX_ROWS and k > 0 and n > 0 and dtype in IN_DTYPES
            and out_dtype in OUT_DTYPES)


@torch.library.custom_op("sammie::fp8_gemv_linear", mutates_args=())
def fp8_gemv_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
                out_dtype: torch.dtype, prequantize: bool = False, block_n: int = 0, block_k: int = 0,
                num_warps: int = 0, codes: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS), weight e4m3 [N, K] (read as int32 words: K, the row stride and the address
    multiples of 4), weight_scale fp32 [] or [N], input_scale fp32 [] -> y [M, N] in out_dtype. `prequantize`: the
    activation codes from one quantiser launch first (else quantised in the loop; the same bits). `codes`: those codes
    [M, K] e4m3 already made (by the op that produced x: `kernels/rms_norm.py`'s *_fp8 ops) with this input_scale --
    no quantiser launch. `block_n` / `block_k` / `num_warps` 0: the autotuner's (tests and benchmarks pin them).
    One or two launches, no host syncs (CUDA-graph capturable)."""
    m, k = x.shape
    n = weight.shape[0]
    x, weight, s_w, s_in = decode_linear_args("fp8_gemv_linear", x, weight, weight_scale, input_scale, GEMV_MAX_ROWS,
                                              supported(m, k, n, x.dtype, out_dtype))
    if k % 4 or weight.stride(0) % 4 or weight.data_ptr() % 4:
        raise ValueError(f"fp8_gemv_linear: K ({k}), the weight's row stride ({weight.stride(0)}) and address must "
                         f"be multiples of 4 (rows read as int32 words)")
    if codes is not None:
        if codes.shape != (m, k) or codes.dtype != torch.float8_e4m3fn or codes.device != x.device:
            raise ValueError(f"fp8_gemv_linear: codes must be e4m3 {(m, k)} on {x.device}, got {codes.dtype} "
                             f"{tuple(codes.shape)} on {codes.device}")
        aligned = codes.stride(1) == 1 and codes.stride(0) % 4 == 0 and codes.data_ptr() % 4 == 0  # int32 words
        x, prequantize = (codes if aligned else codes.clone(memory_format=torch.contiguous_format)), True
    elif prequantize:
        x = quantize_static_triton(x, s_in)  # e4m3 [M, K], the codes the loop would compute
    interp = _interpreted()
    # the interpreter truncates fp32 -> bf16 / fp16 casts (`w4a16_gemm`'s note): it writes fp32 and torch rounds
    y = torch.empty((m, n), dtype=torch.float32 if interp else out_dtype, device=x.device)
    args = (x, weight, s_in, s_w, y, m, n, k, triton.next_power_of_2(m), x.stride(0), weight.stride(0),
            1 if s_w.numel() > 1 else 0, y.stride(0))
    # one range of whole rows a program: contiguous rows of K bytes, 16-byte aligned
    prefetch = pdl.prefetch_options(weight.stride(0) == k and pdl.aligned16(weight.data_ptr(), k))
    if interp or block_n or block_k or num_warps:
        cfg = dict(INTERPRETER_CONFIG) if interp else dict(BLOCK_N=4, BLOCK_K=512)
        cfg.update({kk: v for kk, v in (("BLOCK_N", block_n), ("BLOCK_K", block_k)) if v})
        even = k % cfg["BLOCK_K"] == 0 and n % cfg["BLOCK_N"] == 0
        _fp8_gemv_kernel[(m * triton.cdiv(n, cfg["BLOCK_N"]),)](*args, X_CODES=prequantize, INTERPRET=interp,
                                                                EVEN=even, **cfg, num_warps=num_warps or 2,
                                                                **pdl.launch_options(), **prefetch)
    else:
        _fp8_gemv_autotuned[lambda c: (m * triton.cdiv(n, c["BLOCK_N"]),)](*args, X_CODES=prequantize,
                                                                           INTERPRET=False, **pdl.launch_options(),
                                                                           **prefetch)
    return y if y.dtype == out_dtype else y.to(out_dtype)


@fp8_gemv_op.register_fake
def _(x, weight, weight_scale, input_scale, out_dtype, prequantize=False, block_n=0, block_k=0, num_warps=0,
      codes=None):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)
