"""NVFP4 W4A16 for decode-sized calls (1-4 activation rows) as a GEMV on CUDA cores: one program per (output row, slice
of BLOCK_N weight rows), the whole K streamed in BLOCK_K tiles, no tensor cores, no split K. Dense (`y = x @ W^T`: the
shared expert and lm_head of a lone decode step) and grouped for the MoE, where each (token, expert) pair is its own
output row: the expert is read straight from the router's ids, so a decode step needs no `moe_align` launch.

Outcome (H200, 2026-11-30, benchmarks/RESULTS.md run 16): a lone request decodes at 283.5 tok/s against 235.0 with
it disabled (same process); per call the routed experts at 1 token take 20.4 us against 29-31 us, lm_head 219-224
against 338-345 us. Still 0.7-1.3 TB/s, far from HBM speed: the compiled loop spends ~10 instructions per weight and
moves the activation and scale tiles through shared memory every K tile (layout conversions; offline sm_90 SASS).

Why. At one token the tensor-core kernels of `kernels/w4a16_gemm.py` pad the MMA to 16 rows and stream each expert in
2 KB K tiles per program (H200, Qwen run 15 profile, 2026-11-30: gate_up 15.9 us for 9.4 MB of weights, down 8.0 us,
the shared expert's two dense calls ~9 us each for ~1 MB: 0.6 TB/s and less). Here a program holds a few weight rows
and walks K with the next tile's loads issued before this tile's arithmetic (register double-buffering: the loop has
no dot for Triton's pipeliner), and a launch has hundreds to thousands of programs to keep loads in flight.

Arithmetic (same numbers as the tensor-core kernels): `w4a16_gemm._dequant_groups` builds each weight exactly in the
activation dtype (bf16: E2M1 x 2^-126 in inline PTX, times scale x 2^119 -- the weight x 2^-7); each weight is
widened to fp32 and multiplied by the fp32 activation (exact: <= 6 x 8 significant bits) and summed in fp32, per
16-weight group first, then over groups at the end; the power-of-two gain, the global scale (per output row), SwiGLU
and the routing weight in the fp32 epilogue; one rounding to the output dtype. So it differs from
`kernels.nvfp4.w4a16_linear_reference` by fp32 summation order only (tests/test_kernel_w4a16_gemv.py: the bounds of
tests/test_kernel_w4a16.py).

Byte layout: the checkpoint's (packed [.., N, K/2], low nibble = even k; e4m3 scales [.., N, K/16]), each weight row
one contiguous run of K/2 bytes. A program's tile is [BLOCK_N rows, BLOCK_K/16 groups, 8 bytes].

API: `w4a16_gemv_launch(x, packed, scales, global, ...)` (the kernel launch, dense or grouped); `w4a16_linear_gemv`
/ `w4a16_swiglu_gemv` (registry ops "w4a16_linear" / "w4a16_swiglu", implementation "triton_gemv", for the calls
`gemv_ok` accepts); `moe_experts_w4a16_gemv` (op "w4a16_moe", implementation "triton_gemv": gate_up with SwiGLU, then
down with the routing weight, over T x top_k pairs, for T <= GEMV_MAX_TOKENS on checkpoint-layout experts).
`w4a16_gemm.register` puts them ahead of its "triton" ones; their `supports_*_gemv` guards take the row count from
the call, so the registry hands every other call to "triton" (a disabled "triton" stays disabled), and the model's
choice cache keeps row counts <= 4 apart (`qwen_engine.model.quantized._Dispatch`).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import pdl
from kernels.nvfp4 import NVFP4Tensor
from kernels.w4a16_gemm import (
    CHECKPOINT,
    _dense_any_rank,
    _global_1d,
    _global_2d,
    _interpreted,
    supports_dense,
    supports_moe,
    supports_swiglu,
)

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
    from kernels.pdl import prefetch_expert_share, prefetch_l2_once
    from kernels.w4a16_gemm import (
        _BLK,
        _TWO_119,
        _dequant_gain,
        _dequant_groups,
        _e4m3_fp16,
        _load_packed_tile,
        _load_scale_tile,
    )
except ImportError:  # CPU-only installs without triton: the references work, supports() says no
    triton = None

GEMV = "triton_gemv"
GEMV_MAX_TOKENS = 4  # the decode graphs' smallest buckets (1, 2, 4); more rows are the tensor cores' regime
# Dense calls of 2-4 rows read the weight once per row (one program row per activation row): only up to this size,
# where the repeats are L2 hits (50 MB L2; the shared expert is ~1 MB). One row takes the GEMV at any size: lm_head
# (286 MB) measured 224 us against the tensor-core kernel's 345 us (H200, results/w4a16_gemv_bench_run1).
GEMV_MAX_REPEAT_BYTES = 16 << 20


def gemv_ok(m: int, n: int, k: int) -> bool:
    """Whether a dense [m, k] x [n, k]^T call takes the GEMV (GEMV_MAX_TOKENS, GEMV_MAX_REPEAT_BYTES)."""
    return m == 1 or (0 < m <= GEMV_MAX_TOKENS and n * k // 2 <= GEMV_MAX_REPEAT_BYTES)


if triton is not None:
    # (BLOCK_N, BLOCK_K, warps). A thread holds BLOCK_N x BLOCK_K / (32 warps) weights of a tile (two tiles in flight
    # with the prefetch; twice that for SwiGLU's gate and up rows). The last two take the model's K = 2048 in one tile:
    # every load of a program issued at once, one DRAM round trip instead of a chain of 2-4 (the decode calls are
    # latency-bound: results/w4a16_gemv_bench_run2, 0.7 TB/s for the routed experts at one token); offline sm_90: no
    # spills. Added 2026-12-01, not yet tuned on a GPU.
    _CONFIGS = [triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=1)
                for bn, bk, w in [(4, 512, 2), (4, 1024, 4), (8, 512, 4), (8, 256, 2), (16, 256, 4), (16, 512, 4),
                                  (32, 256, 4), (8, 1024, 8), (16, 512, 8), (32, 128, 4), (4, 256, 1), (2, 1024, 2),
                                  (64, 256, 8), (32, 512, 8), (2, 512, 1), (2, 2048, 4), (4, 2048, 8)]]

    @triton.jit
    def _gemv_tiles(w, s, rows, row_ok, t, K, s_wn, s_sn, BLOCK_K: tl.constexpr, DEQ: tl.constexpr):
        """K tile t of weight rows `rows`: packed bytes [BN, BK/16, 8] (DEQ_WIDE: int32 words [BN, BK/16, 2]) and
        scale bytes [BN, BK/16]; zero (no memory access) past K."""
        if DEQ == 3:
            pw = _gemv_words(w, rows, row_ok, t, K, s_wn, BLOCK_K)
        else:
            pw = _load_packed_tile(w, rows, row_ok, t, K, s_wn, BLOCK_K)
        return pw, _load_scale_tile(s, rows, row_ok, t, K, s_sn, BLOCK_K)

    @triton.jit
    def _gemv_x(x, t, K, BLOCK_K: tl.constexpr):
        """K tile t of one activation row as fp32 (even-k, odd-k) [BK/16, 8], zero past K."""
        grp = t * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        k = grp[:, None] * 16 + 2 * tl.arange(0, 8)[None, :]
        ok = k < K
        return (tl.load(x + k, mask=ok, other=0.0).to(tl.float32),
                tl.load(x + k + 1, mask=ok, other=0.0).to(tl.float32))

    @triton.jit
    def _e2m1x8_f32_scaled_ptx(word, s2):
        """int32 words of 4 packed bytes (8 weights) + their scale x 2^119 as bf16 bits in both halves of an int32 ->
        the 8 weights x 2^-7 as fp32 tensors of the words' shape: (w0, ..., w7) = k offsets (0, 2, 4, 6, 1, 3, 5, 7)
        within the word (the low nibbles of bytes 0-3, then the high nibbles). `_e2m1x2_bf16_tiny_ptx`'s bf16 pairs,
        times the scale in bf16x2 (the product `_dequant_groups` forms, exact), each 16-bit half then moved to the top
        of a 32-bit register (bf16 -> fp32: the same bits and 16 zeros, exact): `_dequant_groups`' values, widened."""
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 r01, r23, a, b, d0, d1, d2, d3;
            prmt.b32 r01, $8, 0, 0x4140;
            prmt.b32 r23, $8, 0, 0x4342;
            shl.b32 a, r01, 6; and.b32 a, a, 0x01C001C0; shl.b32 b, r01, 12; and.b32 b, b, 0x80008000;
            or.b32 d0, a, b;
            shl.b32 a, r23, 6; and.b32 a, a, 0x01C001C0; shl.b32 b, r23, 12; and.b32 b, b, 0x80008000;
            or.b32 d1, a, b;
            shl.b32 a, r01, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, r01, 8; and.b32 b, b, 0x80008000;
            or.b32 d2, a, b;
            shl.b32 a, r23, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, r23, 8; and.b32 b, b, 0x80008000;
            or.b32 d3, a, b;
            mul.rn.bf16x2 d0, d0, $9;
            mul.rn.bf16x2 d1, d1, $9;
            mul.rn.bf16x2 d2, d2, $9;
            mul.rn.bf16x2 d3, d3, $9;
            shl.b32 $0, d0, 16; and.b32 $1, d0, 0xFFFF0000;
            shl.b32 $2, d1, 16; and.b32 $3, d1, 0xFFFF0000;
            shl.b32 $4, d2, 16; and.b32 $5, d2, 0xFFFF0000;
            shl.b32 $6, d3, 16; and.b32 $7, d3, 0xFFFF0000;
            }""",
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [word, s2], dtype=(tl.float32,) * 8, is_pure=True, pack=1)

    @triton.jit
    def _gemv_words(w, rows, row_ok, t, K, s_wn, BLOCK_K: tl.constexpr):
        """`_load_packed_tile` as int32 words [BN, BK/16, 2] (4 bytes each; the launcher checks the alignment)."""
        grp = t * (BLOCK_K // _BLK) + tl.arange(0, BLOCK_K // _BLK)
        ok = row_ok[:, None] & (grp[None, :] < K // _BLK)
        w32 = w.to(tl.pointer_type(tl.int32))
        return tl.load(w32 + rows[:, None, None] * (s_wn // 4) + (grp * 2)[None, :, None] +
                       tl.arange(0, 2)[None, None, :], mask=ok[:, :, None], other=0)

    @triton.jit
    def _gemv_fma_words(acc, pw, sc, x, t, K, BLOCK_K: tl.constexpr):
        """acc [BN, G] += per-group sums of a tile of int32 words [BN, G, 2] (scale bytes [BN, G]) x K tile t of the
        activation row x, in fp32 (the activations in `_e2m1x8_f32_scaled_ptx`'s k order)."""
        s = (_e4m3_fp16(sc.to(tl.uint16)).to(tl.float32) * _TWO_119).to(tl.bfloat16)  # as `_dequant_groups`
        sb = s.to(tl.uint16, bitcast=True).to(tl.int32)
        s2 = tl.broadcast_to((sb | (sb << 16))[:, :, None], pw.shape)
        w0, w1, w2, w3, w4, w5, w6, w7 = _e2m1x8_f32_scaled_ptx(pw, s2)
        grp = t * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        k = grp[:, None] * 16 + tl.arange(0, 2)[None, :] * 8  # [G, 2]: each word's first k
        ok = k < K
        xk = x + k
        part = w0 * tl.load(xk, mask=ok, other=0.0).to(tl.float32)[None]
        part += w1 * tl.load(xk + 2, mask=ok, other=0.0).to(tl.float32)[None]
        part += w2 * tl.load(xk + 4, mask=ok, other=0.0).to(tl.float32)[None]
        part += w3 * tl.load(xk + 6, mask=ok, other=0.0).to(tl.float32)[None]
        part += w4 * tl.load(xk + 1, mask=ok, other=0.0).to(tl.float32)[None]
        part += w5 * tl.load(xk + 3, mask=ok, other=0.0).to(tl.float32)[None]
        part += w6 * tl.load(xk + 5, mask=ok, other=0.0).to(tl.float32)[None]
        part += w7 * tl.load(xk + 7, mask=ok, other=0.0).to(tl.float32)[None]
        return acc + tl.sum(part, axis=2)

    @triton.jit
    def _gemv_fma(acc, pw, sc, xe, xo, DTYPE: tl.constexpr, DEQ: tl.constexpr, INTERPRET: tl.constexpr):
        """acc [BN, G] += per-group sums of the tile's weights x activations, in fp32."""
        lo, hi = _dequant_groups(pw, sc, DTYPE, DEQ, INTERPRET)  # [BN, G, 8], weight / gain, exact
        return acc + tl.sum(lo.to(tl.float32) * xe[None, :, :] + hi.to(tl.float32) * xo[None, :, :], axis=2)

    @triton.jit
    def _gemv_rows(we, se, xr, rows, ok, n_out, K, s_wn, s_sn, SWIGLU: tl.constexpr, DT: tl.constexpr,
                   DEQ: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Per-group fp32 sums [BN, BK/16] of weight rows `rows` (and, SWIGLU, of rows + n_out: the up rows) times
        the activation row at xr, over the whole K, in BLOCK_K tiles; still to be summed over axis 1 and scaled by
        the global scale and `_dequant_gain`. The next tile's weight loads go out before this tile's arithmetic."""
        acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
        pw, sc = _gemv_tiles(we, se, rows, ok, 0, K, s_wn, s_sn, BLOCK_K, DEQ)
        pu, su = pw, sc  # SwiGLU's up rows (else unused)
        if SWIGLU:
            pu, su = _gemv_tiles(we, se, rows + n_out, ok, 0, K, s_wn, s_sn, BLOCK_K, DEQ)
        for t in range(0, tl.cdiv(K, BLOCK_K)):
            # the next tile's weight loads go out before this tile's arithmetic (past K: masked, no access)
            pw_n, sc_n = _gemv_tiles(we, se, rows, ok, t + 1, K, s_wn, s_sn, BLOCK_K, DEQ)
            pu_n, su_n = pw_n, sc_n
            if SWIGLU:
                pu_n, su_n = _gemv_tiles(we, se, rows + n_out, ok, t + 1, K, s_wn, s_sn, BLOCK_K, DEQ)
            if DEQ == 3:  # DEQ_WIDE: int32 words, fp32 weights out of PTX
                acc = _gemv_fma_words(acc, pw, sc, xr, t, K, BLOCK_K)
                if SWIGLU:
                    acc_up = _gemv_fma_words(acc_up, pu, su, xr, t, K, BLOCK_K)
            else:
                xe, xo = _gemv_x(xr, t, K, BLOCK_K)
                acc = _gemv_fma(acc, pw, sc, xe, xo, DT, DEQ, INTERPRET)
                if SWIGLU:
                    acc_up = _gemv_fma(acc_up, pu, su, xe, xo, DT, DEQ, INTERPRET)
            pw, sc, pu, su = pw_n, sc_n, pu_n, su_n
        return acc, acc_up

    @triton.jit
    def _w4a16_gemv_kernel(x, w, s, g, rs, y, pair_expert, N, K, A_DIV, R_BUCKET, s_xm, s_we, s_wn, s_se, s_sn,
                           s_ge, s_gn, s_ym, GROUPED: tl.constexpr, SWIGLU: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
                           DEQ: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                           nw=0, ns=0, s_nwe=0, s_nse=0, NEXT_W_BYTES=0, NEXT_S_BYTES=0,
                           PREFETCH_NEXT: tl.constexpr = False):
        # grid (cdiv(N_out, BN), R): output row r = program_id(1) reads activation row r // A_DIV and, GROUPED, expert
        # pair_expert[r] (int64 router ids, flattened [T * top_k]: pair r = token r // top_k); y [R, N_out].
        # SWIGLU: N = 2 N_out weight rows (gate then up); output column n = silu(row n) * row n + N_out.
        # R_BUCKET (the next power of two of R) is only an autotune key: the best tile depends on the grid's rows.
        # PREFETCH (kernels/pdl.py, with PDL; dense only: a grouped call's experts come from the router's output):
        # the program's packed and scale rows (and SwiGLU's up rows) into L2 before the wait.
        # PREFETCH_NEXT (grouped, weight prefetch "all"): once its expert is known, the program also prefetches its
        # 1 / cdiv(N_out, BN) share of that expert's weights in the NEXT launch (nw, ns: the int64 addresses of the
        # packed and scale stacks -- ints, not tensors, so that the autotuner's key, which lists every tensor
        # argument's dtype, stays the table's; one contiguous slab of NEXT_W_BYTES / NEXT_S_BYTES per expert at
        # strides s_nwe / s_nse): gate_up prefetches the down projection's bytes, whose DRAM reads then overlap
        # gate_up instead of following it.
        pid_n, r = tl.program_id(0), tl.program_id(1)
        if SWIGLU:
            n_out = N // 2
        else:
            n_out = N
        if PREFETCH and not GROUPED:  # contiguous rows (the launch checks): one range of <= BN rows each
            r0 = pid_n * BLOCK_N
            nr = tl.minimum(BLOCK_N, n_out - r0)
            prefetch_l2_once(w + r0.to(tl.int64) * s_wn, nr * (K // 2))
            prefetch_l2_once(s + r0.to(tl.int64) * s_sn, nr * (K // 16))
            if SWIGLU:
                prefetch_l2_once(w + (r0 + n_out).to(tl.int64) * s_wn, nr * (K // 2))
                prefetch_l2_once(s + (r0 + n_out).to(tl.int64) * s_sn, nr * (K // 16))
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        if GROUPED:
            e = tl.load(pair_expert + r)
            if PREFETCH_NEXT:  # 16-byte multiples per program (the launch checks the slabs' alignment)
                prefetch_expert_share(nw, ns, e, s_nwe, s_nse, NEXT_W_BYTES, NEXT_S_BYTES)
        else:
            e = 0
        we = w + e * s_we
        se = s + e * s_se
        xr = x + (r // A_DIV).to(tl.int64) * s_xm
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = rows < n_out
        DT: tl.constexpr = x.dtype.element_ty
        acc, acc_up = _gemv_rows(we, se, xr, rows, ok, n_out, K, s_wn, s_sn, SWIGLU, DT, DEQ, INTERPRET, BLOCK_N,
                                 BLOCK_K)
        gain = _dequant_gain(DT, DEQ)
        ge = g + e * s_ge
        out = tl.sum(acc, axis=1) * (tl.load(ge + rows * s_gn, mask=ok, other=0.0) * gain)
        if SWIGLU:
            up = tl.sum(acc_up, axis=1) * (tl.load(ge + (rows + n_out) * s_gn, mask=ok, other=0.0) * gain)
            out = out / (1.0 + tl.exp(-out)) * up
        if HAS_ROW_SCALE:
            out = out * tl.load(rs + r).to(tl.float32)
        tl.store(y + r.to(tl.int64) * s_ym + rows, out.to(y.dtype.element_ty), mask=ok)

    _w4a16_gemv_autotuned = triton.autotune(
        configs=_CONFIGS, key=["N", "K", "R_BUCKET", "GROUPED", "SWIGLU", "HAS_ROW_SCALE", "DEQ"])(_w4a16_gemv_kernel)


# The interpreter cannot benchmark configs; it runs this one (tests/test_kernel_w4a16_gemv.py also pins smaller tiles,
# which exercise masked edges and the K loop; this one keeps the interpreted engine tests fast).
INTERPRETER_CONFIG = dict(BLOCK_N=32, BLOCK_K=128)
# DEQ_WIDE (this kernel's own mode, beside w4a16_gemm.DEQ_MODES 0-2): the packed bytes loaded as int32 words and
# turned into fp32 weights inside one inline PTX block (`_e2m1x8_f32_scaled_ptx`: mode 2's bf16 pairs times their
# scales, then widened): the same weight values, the products summed in another order. Offline sm_90 SASS of the K
# loop at the tiles the H200's autotuner picked (results/w4a16_gemv_bench_run2), instructions per weight, mode 2 ->
# DEQ_WIDE: routed gate_up (4, 512, 2 warps) 10.4 -> 8.0, routed down (4, 256, 1) 12.1 -> 10.3, shared gate_up
# (4, 1024, 4) 10.5 -> 8.2, shared down (2, 512, 1) 14.2 -> 11.2, lm_head (8, 256, 2) 11.4 -> 10.5. H200
# (results/w4a16_gemv_bench_run3, 2026-12-01), us per call, mode 2 -> DEQ_WIDE: routed experts at 1 / 2 / 4 tokens
# 20.91 -> 18.60, 34.21 -> 30.44, 57.61 -> 49.06; lm_head 218.7 -> 204.1; same errors against the tensor-core path
# (bf16 rounding). Engine side by side (Qwen run 26): lone decode 315.1 -> 322.6 tok/s, 32 streams equal. The
# default for aligned rows (every engine call); others take mode 2 unless DEQ_WIDE is asked for by name.
DEQ_WIDE = 3
DEQ_GPU = DEQ_WIDE  # bf16 activations on a GPU; fp16 activations always take mode 0


def resolve_deq(deq: int | None, dtype: torch.dtype, interp: bool, words_ok: bool, who: str) -> int:
    """The dequantiser mode of a launch reading these weights: for bf16 activations on a GPU `deq` (None: DEQ_GPU),
    DEQ_WIDE falling back to mode 2 on rows it cannot read in 4-byte words (`words_ok` False) unless asked for by name
    (ValueError); the interpreter and fp16 activations have one each (1 for bf16, 0 for fp16). `who` names the caller
    in the errors."""
    if isinstance(deq, bool) or deq not in (None, 0, 1, 2, DEQ_WIDE):
        raise ValueError(f"{who}: deq must be None, 0, 1, 2 or {DEQ_WIDE} (DEQ_WIDE), got {deq!r}")
    if dtype != torch.bfloat16 or interp:
        return 1 if dtype == torch.bfloat16 else 0
    mode = DEQ_GPU if deq is None else deq
    if mode == DEQ_WIDE and not words_ok:
        if deq == DEQ_WIDE:
            raise ValueError(f"{who}: DEQ_WIDE reads weights and activations in 4-byte words: their rows must be "
                             "4-byte aligned")
        return 2  # the default on rows it cannot read in words: mode 2 (the same weights, another summation order)
    return mode


def w4a16_gemv_launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *,
                      pair_expert: torch.Tensor | None = None, a_div: int = 1, row_scale: torch.Tensor | None = None,
                      swiglu: bool = False, config: dict | None = None, deq: int | None = None,
                      then: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Dense (`pair_expert` None): x [M, K] -> y [M, N] (or SwiGLU's [M, N/2]) in x.dtype.
    Grouped: packed [E, N, K/2], scales [E, N, K/16], global [], [E] or [E, N]; `pair_expert` [R] int (the router's
    ids, flattened): output row r reads activation row r // a_div with expert pair_expert[r] -> y [R, N (or N/2)],
    times `row_scale[r]` if given. `then` (grouped): the next launch's (packed, scales) of the same experts, prefetched
    into L2 by this one in weight prefetch mode "all" (kernels/pdl.py; `next_prefetch_args`). `config` pins BLOCK_N /
    BLOCK_K / num_warps (tests, benchmarks). `deq`: the dequantiser for bf16 activations on a GPU (None: DEQ_GPU, mode 2
    where rows are not 4-byte aligned; DEQ_WIDE asked for by name on such rows: ValueError); the interpreter and fp16
    activations have one each. One launch, no host syncs (CUDA-graph capturable)."""
    grouped = pair_expert is not None
    k = x.shape[-1]
    if grouped:
        e, n, kh = packed.shape
        g, s_ge, s_gn = _global_2d(global_scale, e, n)
        r = pair_expert.numel()
        pe = pair_expert.reshape(-1)
        s_we, s_wn, s_se, s_sn = packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1)
    else:
        n, kh = packed.shape
        g, s_gn = _global_1d(global_scale, n)
        s_ge, r, pe = 0, x.shape[0], g  # pe: any tensor (GROUPED is off)
        s_we, s_wn, s_se, s_sn = 0, packed.stride(0), 0, scales.stride(0)
    if 2 * kh != k or k % 16:
        raise ValueError(f"w4a16_gemv: x has K = {k}, the weight {2 * kh} (a multiple of 16 is needed)")
    if swiglu and n % 2:
        raise ValueError(f"a SwiGLU weight needs an even number of rows (gate then up), got {n}")
    n_out = n // 2 if swiglu else n
    interp = _interpreted()
    # the interpreter truncates fp32 -> bf16 casts (w4a16_gemm's note): it writes fp32 and torch rounds
    y = torch.empty((r, n_out), dtype=torch.float32 if interp else x.dtype, device=x.device)
    if r == 0:
        return y.to(x.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    sc = scales.view(torch.uint8)
    rs = row_scale.reshape(-1) if row_scale is not None else g
    words_ok = not (packed.data_ptr() % 4 or s_wn % 4 or s_we % 4 or x.data_ptr() % 4 or x.stride(0) % 2)
    deq = resolve_deq(deq, x.dtype, interp, words_ok, "w4a16_gemv")
    args = (x, packed, sc, g, rs, y, pe, n, k, a_div, triton.next_power_of_2(r), x.stride(0), s_we, s_wn, s_se, s_sn,
            s_ge, s_gn, y.stride(0))
    meta = dict(GROUPED=grouped, SWIGLU=swiglu, HAS_ROW_SCALE=row_scale is not None, DEQ=deq, INTERPRET=interp)
    if not grouped:  # contiguous rows (packed: K / 2 bytes a row, scales K / 16), 16-byte aligned
        prefetch = pdl.prefetch_options(s_wn == k // 2 and s_sn == k // 16
                                        and pdl.aligned16(packed.data_ptr(), sc.data_ptr(), k // 2, k // 16))
    else:
        prefetch = next_prefetch_args(*then) if then is not None and pdl.prefetch_next() else {}
        pdl.PREFETCH_LAUNCHES["next"] += bool(prefetch)
    if interp or config:
        cfg = dict(INTERPRETER_CONFIG) if interp else {}
        cfg.update(config or {})
        warps = cfg.pop("num_warps", 4)
        _w4a16_gemv_kernel[(triton.cdiv(n_out, cfg["BLOCK_N"]), r)](*args, **meta, **cfg, num_warps=warps,
                                                                    **pdl.launch_options(), **prefetch)
    else:
        _w4a16_gemv_autotuned[lambda c: (triton.cdiv(n_out, c["BLOCK_N"]), r)](*args, **meta, **pdl.launch_options(),
                                                                               **prefetch)
    return y.to(x.dtype)


def next_prefetch_args(packed: torch.Tensor, scales: torch.Tensor) -> dict:
    """The grouped kernel's PREFETCH_NEXT arguments for experts packed [E, N, K/2] and scales [E, N, K/16] whose
    per-expert slabs are contiguous and 16-byte aligned (the checkpoint layout's copy); {} otherwise (no prefetch)."""
    if packed.dim() != 3 or scales.dim() != 3 or not packed.is_contiguous() or not scales.is_contiguous():
        return {}
    w_bytes, s_bytes = packed[0].numel() * packed.element_size(), scales[0].numel() * scales.element_size()
    if not pdl.aligned16(packed.data_ptr(), scales.data_ptr(), w_bytes, s_bytes):
        return {}
    return dict(nw=packed.data_ptr(), ns=scales.data_ptr(), s_nwe=w_bytes, s_nse=s_bytes, NEXT_W_BYTES=w_bytes,
                NEXT_S_BYTES=s_bytes, PREFETCH_NEXT=True)


# ---- registry implementations ("triton_gemv": where `supports_*_gemv` accept; the registry hands the rest on) -------
def _dense(x: torch.Tensor, w: NVFP4Tensor, swiglu: bool) -> torch.Tensor:
    """`w4a16_gemv_launch` over x's leading dims (`w4a16_gemm._dense_any_rank`), for the calls `gemv_ok` accepts."""
    rows = x.numel() // x.shape[-1]
    if not gemv_ok(rows, w.packed.shape[0], x.shape[-1]):
        raise ValueError(f"w4a16_gemv: {rows} rows x a {tuple(w.shape)} weight is not a GEMV call (gemv_ok)")
    return _dense_any_rank(x, w.packed, w.scales, torch.as_tensor(w.global_scale, device=x.device), swiglu,
                           launch=w4a16_gemv_launch)


def w4a16_linear_gemv(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """Same contract as `w4a16_linear_reference`, for the calls `gemv_ok` accepts."""
    return _dense(x, w, swiglu=False)


def w4a16_swiglu_gemv(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """Same contract as `w4a16_swiglu_reference`, for the calls `gemv_ok` accepts."""
    return _dense(x, w, swiglu=True)


def moe_experts_w4a16_gemv(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, idx: torch.Tensor,
                           weights: torch.Tensor, reduce: bool = True, layout: int = 0, routing: Any = None, *,
                           deq: int | None = None) -> torch.Tensor:
    """Same contract as `moe_experts_w4a16_reference`, for T <= GEMV_MAX_TOKENS tokens on checkpoint-layout experts:
    two launches over the T x top_k pairs (gate_up + SwiGLU -> [P, I] rounded to x.dtype; down x routing weight ->
    [T, k, H] rounded to x.dtype), then the sum over top_k (fp32, one more rounding) unless `reduce=False`. `deq`:
    `w4a16_gemv_launch`'s. `routing`: unused (the GEMV reads the pairs' experts directly, no alignment)."""
    t, top_k = idx.shape
    if layout != CHECKPOINT or not 0 < t <= GEMV_MAX_TOKENS:
        raise ValueError(f"w4a16_gemv: the MoE GEMV takes <= {GEMV_MAX_TOKENS} tokens on checkpoint-layout experts, "
                         f"got {t} tokens, layout {layout}")
    h = w4a16_gemv_launch(x, *w13, pair_expert=idx, a_div=top_k, swiglu=True, deq=deq,
                          then=(w2.packed, w2.scales))  # [P, I]; down's weights prefetched (weight_prefetch)
    y = w4a16_gemv_launch(h, *w2, pair_expert=idx, row_scale=weights, deq=deq).view(t, top_k, -1)  # [T, k, H]
    return y.sum(1, dtype=torch.float32).to(x.dtype) if reduce else y


def supports_dense_gemv(**info: Any) -> bool:
    """`w4a16_gemm.supports_dense`, and `gemv_ok` for the call's rows (`describe_dense`: rows, n, k)."""
    return supports_dense(**info) and gemv_ok(info["rows"], info["n"], info["k"])


def supports_swiglu_gemv(**info: Any) -> bool:
    """`w4a16_gemm.supports_swiglu`, and `gemv_ok` for the call's rows."""
    return supports_swiglu(**info) and gemv_ok(info["rows"], info["n"], info["k"])


def supports_moe_gemv(**info: Any) -> bool:
    """`w4a16_gemm.supports_moe`, <= GEMV_MAX_TOKENS tokens, experts in the checkpoint layout (`describe_moe`)."""
    return supports_moe(**info) and 0 < info["tokens"] <= GEMV_MAX_TOKENS and info["layout"] == CHECKPOINT
