"""NVFP4 W4A16 for decode-sized calls on the tensor cores, one warp-wide `mma.sync.m16n8k16` (bf16 in, fp32 out) per
8 weights a thread: the decode GEMV of `kernels/w4a16_gemv.py` without its fp32 FMA per weight.

Why. The CUDA-core GEMV spends ~7.6 instructions per weight (offline sm_90 SASS of its K loop: 2.25 for the E2M1 bit
tricks, 0.5 for the scale, 1 to widen bf16 to fp32, 1 FMA, the rest moving activations and scales through shared
memory); at one token the 40 layers' routed experts take ~18.6 us a layer against ~7.4 us for their bytes (RESULTS,
thirty-second session). Triton's `tl.dot` reaches the tensor cores only through shared-memory layout conversions.
Here each thread loads its own bytes straight into an mma fragment: the MMA's K order is free as long as the A
(weights) and B (activations) fragments use the same one, so a thread takes two 8-byte runs of a 64-byte chunk of
each of its two rows (g and g + 8 of a 16-row tile), bytes [8c, 8c + 8) and [32 + 8c, 32 + 8c + 8) (32 weights, one
scale group each), and the 32 activations of the same k. A warp's load instruction thus reads 32 contiguous bytes of
each of its 8 rows: whole sectors. (Until 2026-12-04 a thread took 16 contiguous bytes, so every instruction read two
sectors of a row half each and every weight sector was requested twice: Nsight Compute counted 45% of gate_up's
global-load sectors excessive, decode_ncu run 1; L1 had merged most of them, so its L2 sectors fell only 2%.)
Per 8 weights: the bit tricks (14 instructions for 2 rows x 4 bytes), 4 bf16x2 scale multiplies, 2 activation
byte permutes and 2 MMAs: ~3 instructions a weight.

Fragments (PTX ISA, "mma.m16n8k16" with .bf16): lane = 4 g + c. A: a0 = (row g, k slots 2c, 2c+1), a1 = (row g + 8,
same), a2 = (row g, slots 2c + 8, 2c + 9), a3 = (row g + 8, same); B: b0 = (slots 2c, 2c+1; column g), b1 = (slots
2c + 8, 2c + 9; column g); D: (row g, columns 2c, 2c + 1), (row g + 8, same). Byte j of a thread's 32-bit weight word
holds k = 2j (low nibble) and 2j + 1 (high nibble); per word two MMAs, h = 0 / 1 over bytes 2h, 2h + 1:
a0 = (low(2h), low(2h + 1)) of row g, a2 = (high(2h), high(2h + 1)) of row g, a1 / a3 the same of row g + 8, and
b0 = (x[4h], x[4h + 2]), b1 = (x[4h + 1], x[4h + 3]) of the word's 8 activations (two PRMTs of its bf16 pairs). The
slot -> k map depends on the lane's c only, so every column's B matches every row's A. B's column n is activation
row n (dense: up to 8 tokens in one launch; grouped: one (token, expert) pair a program, every column its activation
row, column 0 stored).

Arithmetic (as `kernels/w4a16_gemv.py`): each weight built exactly as E2M1 x 2^-126 in bf16 (bit tricks) times its
scale x 2^119 (`mul.rn.bf16x2`, exact: the weight x 2^-7), bf16 x bf16 products summed in fp32 by the tensor core,
the per-warp sums added in fp32, x 2^7 x the global scale (per output row), SwiGLU and the routing weight in fp32,
one rounding. So it differs from `kernels.nvfp4.w4a16_linear_reference` by the summation: its order, and the tensor
core's fp32 accumulation, which is not IEEE round-to-nearest at every addition.

Under TRITON_INTERPRET=1 (CPU tests) the two PTX blocks run as Triton code: the fragments from integer ops on the
same bits (`_frag_words`; tests/test_kernel_w4a16_mma.py checks the PTX text against it with tests/ptx_emu.py) and
the MMA as a sum over each quad's four lanes (`_mma_emulated`): the lane -> fragment bookkeeping is what it tests.

Outcome (H200, 2026-12-03, benchmarks/RESULTS.md thirty-third session): the routed experts per call 16.5 against the
GEMV's 19.4 us at one token, 31.7 against 48.2 at four; the shared expert's gate_up 5.95 against 3.34 (512 outputs:
32 programs). In the engine, the <= 4-token steps' routed experts on it: lone decode 440.0 / 440.7 against
432.8-433.2 tok/s (Qwen runs 57, 58), 32 streams and TTFT unchanged. The sorted path at 5-32 tokens on the
checkpoint copy (`small_batch_tokens` 32): 32 streams 3,004.8 against 3,370.9 on the swap-AB kernel (run 58), so
it is not the default there. Sector-aligned lanes (2026-12-04, thirty-sixth session): L1 global-load sectors of the
lone gate_up 796,672 -> 534,528 (decode_ncu runs 1-2), per call 7.21 against 7.30 us (mma_picks run 3), lone decode
474.1 / 474.5 against 472.0 / 472.7 tok/s beside the tree before it (Qwen run 68).

API: `w4a16_mma_launch(x, packed, scales, global, ...)` (as `w4a16_gemv_launch`: dense or grouped, SwiGLU, row
scales; `routing` for the sorted path); registry implementations "triton_mma" of "w4a16_moe" (first: bf16 on sm_90+,
checkpoint-layout experts, <= MMA_MAX_TOKENS tokens -- up to SORTED_MAX_TOKENS when `set_sorted_tokens` asks, as the
engine's `small_batch_tokens` does -- K a multiple of CHUNK_K) and of "w4a16_linear" / "w4a16_swiglu" (after
"triton_gemv", for the calls it takes: reached with it disabled).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import pdl
from kernels import w4a16_gemv as gemv
from kernels.nvfp4 import NVFP4Tensor
from kernels.w4a16_gemm import (
    CHECKPOINT,
    FRAG_MIN_CAPABILITY,
    _dense_any_rank,
    _global_1d,
    _global_2d,
    _interpreted,
    supports_moe,
)

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
    from kernels.pdl import prefetch_expert_share
    from kernels.w4a16_gemm import _TWO_119, _e4m3_fp16
except ImportError:  # CPU-only installs without triton: supports() says no
    triton = None

MMA = "triton_mma"
MMA_WIDE = "triton_mma_wide"  # the same kernel for the wide dense calls, ahead of the CUDA-core GEMV
WIDE_MIN_N = 32768  # "wide": lm_head's N = vocab (248,320) in the checkpoint layout; no projection is this wide
MMA_MAX_ROWS = 8  # B's eight columns: dense calls of up to 8 activation rows in one launch
MMA_MAX_TOKENS = 4  # the grouped MoE one program per pair: as the GEMV (the decode graphs' 1, 2, 4 buckets)
SORTED_BLOCK_M = 8  # beyond: pairs grouped by expert (moe_align), 8 a program (B's columns)
SORTED_MAX_TOKENS = 64  # the sorted path's calls (decode batches; moe_align's one-program path takes 128 at top-8)
CHUNK_K = 128  # weights of a row per (warp, chunk): 4 lanes x 32; K must be a multiple


def _even(a: dict) -> bool:
    """Every load of a launch in bounds (the kernel's EVEN): N_out a multiple of 16, the K chunks of WARPS x CHUNKS."""
    n_out = a["N"] // 2 if a["SWIGLU"] else a["N"]
    return n_out % 16 == 0 and (a["K"] // CHUNK_K) % (a["WARPS"] * a["CHUNKS"]) == 0


if triton is not None:
    _CHUNK_K = tl.constexpr(CHUNK_K)  # jit functions may only read constexpr globals

    # (WARPS, CHUNKS): warps of a program (they split K, then add their sums) and 128-weight chunks a warp loads
    # before it computes them (bytes in flight: 16 B x rows x CHUNKS a thread). The routed experts' keys ship picks in
    # kernels/tuned (benchmarks/mma_picks.py); other keys tune at start-up.
    _CONFIGS = [triton.Config(dict(WARPS=w, CHUNKS=ch), num_warps=w, num_stages=1)
                for w, ch in [(1, 4), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (16, 1)]]

    @triton.jit
    def _frag_ptx(wa, wb, sa, sb, x0, x1, x2, x3):
        """One weight word of row g (wa) and of row g + 8 (wb), their scales x 2^119 as bf16 in both halves of an int32
        (sa, sb), and the word's 8 activations as bf16 pairs (x0 = (x[0], x[1]), ..., x3 = (x[6], x[7])) -> the A and
        B fragments of the word's two MMAs: (a0, a1, a2, a3, b0, b1) for bytes 0-1, then for bytes 2-3 (int32 bf16
        pairs). Low nibbles: ((r << 6) | (r << 12)) & 0x81C081C0 on r = bytes (2h, 2h+1) spread into 16-bit halves
        (w4a16_gemm._e2m1x2_bf16_tiny_ptx); high nibbles: (r & 0x00F000F0) x 0x104 (fields 6 apart, no carries) &
        0x81C081C0; each times its scale in bf16x2 (exact)."""
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 ra, rb, t, u;
            prmt.b32 ra, $12, 0, 0x4140;
            prmt.b32 rb, $13, 0, 0x4140;
            shl.b32 t, ra, 6; shl.b32 u, ra, 12; or.b32 t, t, u; and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $0, t, $14;
            shl.b32 t, rb, 6; shl.b32 u, rb, 12; or.b32 t, t, u; and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $1, t, $15;
            and.b32 t, ra, 0x00F000F0; mul.lo.u32 t, t, 0x104; and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $2, t, $14;
            and.b32 t, rb, 0x00F000F0; mul.lo.u32 t, t, 0x104; and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $3, t, $15;
            prmt.b32 $4, $16, $17, 0x5410;
            prmt.b32 $5, $16, $17, 0x7632;
            prmt.b32 ra, $12, 0, 0x4342;
            prmt.b32 rb, $13, 0, 0x4342;
            shl.b32 t, ra, 6; shl.b32 u, ra, 12; or.b32 t, t, u; and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $6, t, $14;
            shl.b32 t, rb, 6; shl.b32 u, rb, 12; or.b32 t, t, u; and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $7, t, $15;
            and.b32 t, ra, 0x00F000F0; mul.lo.u32 t, t, 0x104; and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $8, t, $14;
            and.b32 t, rb, 0x00F000F0; mul.lo.u32 t, t, 0x104; and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $9, t, $15;
            prmt.b32 $10, $18, $19, 0x5410;
            prmt.b32 $11, $18, $19, 0x7632;
            }""",
            "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r",
            [wa, wb, sa, sb, x0, x1, x2, x3], dtype=(tl.int32,) * 12, is_pure=True, pack=1)

    @triton.jit
    def _mma_ptx(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C of the warp's m16n8k16 (bf16 fragments in int32 registers, fp32 accumulators)."""
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32,) * 4, is_pure=True, pack=1)

    @triton.jit
    def _bf16_pair(lo_bits, hi_bits):
        """Two 16-bit patterns (int32, < 2^16) -> one int32 bf16 pair (low half first)."""
        return lo_bits | (hi_bits << 16)

    @triton.jit
    def _half(v, HIGH: tl.constexpr):
        """The bf16 in the low / high half of int32 pairs as exact fp32 (its bits, 16 zeros below)."""
        if HIGH:
            return (v & -65536).to(tl.float32, bitcast=True)
        return (v << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _tiny_f32(nib):
        """E2M1 codes (int32, 0..15) -> E2M1 x 2^-126 in fp32 (the bf16 bit trick's value: mag into bits 24-22, sign
        into bit 31; code 1 is the fp32 subnormal 2^-127, which the interpreter keeps)."""
        u = nib.to(tl.uint32)
        return (((u & 7) << 22) | ((u & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _frag_words(w, s):
        """Interpreter form of a word's weights: 8 fp32 values, weight x 2^-7 exactly, in the order of the PTX
        fragments' halves: (low(0), low(1), high(0), high(1)) for bytes 0-1, then for bytes 2-3 (s: the scale x 2^119
        as fp32)."""
        out = []
        for h in tl.static_range(2):
            b0 = (w >> (16 * h)) & 0xFF
            b1 = (w >> (16 * h + 8)) & 0xFF
            out.append(_tiny_f32(b0 & 0xF) * s)
            out.append(_tiny_f32(b1 & 0xF) * s)
            out.append(_tiny_f32(b0 >> 4) * s)
            out.append(_tiny_f32(b1 >> 4) * s)
        return out

    @triton.jit
    def _quad_rows(a, WARPS: tl.constexpr):
        """[32 W] per-lane values of row g -> [W, 8 (g), 1, 4 (c)]."""
        return tl.reshape(a, (WARPS, 8, 1, 4))

    @triton.jit
    def _mma_emulated(aa, ab, bv, acc0, acc1, acc2, acc3, WARPS: tl.constexpr):
        """The interpreter's m16n8k16: aa / ab: 4 fp32 [32 W] slot values of rows g / g + 8 a lane, bv: the 4 matching
        activation slots (column g); D[m, n] = sum over the quad's lanes c' and slots of A[m, c'] B[n, c']; lane
        (g, c) gets columns 2c, 2c + 1 of rows g, g + 8."""
        pa = tl.zeros((WARPS, 8, 8, 4), dtype=tl.float32)
        pb = tl.zeros((WARPS, 8, 8, 4), dtype=tl.float32)
        for j in tl.static_range(4):
            bn = tl.reshape(bv[j], (WARPS, 1, 8, 4))  # column n = the lane's g
            pa += _quad_rows(aa[j], WARPS) * bn
            pb += _quad_rows(ab[j], WARPS) * bn
        da = tl.reshape(tl.sum(pa, axis=3), (WARPS, 8, 4, 2))  # [W, g, n] -> n = 2c + e
        db = tl.reshape(tl.sum(pb, axis=3), (WARPS, 8, 4, 2))
        da0, da1 = tl.split(da)
        db0, db1 = tl.split(db)
        return (acc0 + tl.reshape(da0, acc0.shape), acc1 + tl.reshape(da1, acc0.shape),
                acc2 + tl.reshape(db0, acc0.shape), acc3 + tl.reshape(db1, acc0.shape))

    @triton.jit
    def _scale_pairs(sc):
        """uint16 loads of two e4m3 scale bytes (int32) -> (first, second) as scale x 2^119: bf16 bits in both halves
        of an int32 (the PTX operand) and as fp32 (the interpreter's)."""
        f0 = _e4m3_fp16((sc & 0xFF).to(tl.uint16)).to(tl.float32) * _TWO_119  # exact (w4a16_gemm._dequant_groups)
        f1 = _e4m3_fp16(((sc >> 8) & 0xFF).to(tl.uint16)).to(tl.float32) * _TWO_119
        b0 = f0.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
        b1 = f1.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
        return _bf16_pair(b0, b0), _bf16_pair(b1, b1), f0, f1

    @triton.jit
    def _words(w64):
        """int64 loads -> (low, high) int32 words."""
        return w64.to(tl.int32), (w64 >> 32).to(tl.int32)

    @triton.jit
    def _load(p, ok, other, EVEN: tl.constexpr):
        """A load, masked unless EVEN (every row and chunk of the launch exists)."""
        if EVEN:
            return tl.load(p)
        return tl.load(p, mask=ok, other=other)

    @triton.jit
    def _x_words(px, c_ok, EVEN: tl.constexpr):
        """The lane's 32 activations of a chunk as 8 int64 loads (4 bf16 each): activations [0, 16) then [64, 80)
        after px (the lane's first, 16 c into the chunk), matching its weight words (`_chunk`). Loaded once a chunk
        for both of SwiGLU's row sets."""
        x64 = px.to(tl.pointer_type(tl.int64))
        return (_load(x64, c_ok, 0, EVEN), _load(x64 + 1, c_ok, 0, EVEN), _load(x64 + 2, c_ok, 0, EVEN),
                _load(x64 + 3, c_ok, 0, EVEN), _load(x64 + 16, c_ok, 0, EVEN), _load(x64 + 17, c_ok, 0, EVEN),
                _load(x64 + 18, c_ok, 0, EVEN), _load(x64 + 19, c_ok, 0, EVEN))

    @triton.jit
    def _scale_bytes(ps, sh, ok, EVEN: tl.constexpr):
        """A row's 8 scale bytes of a chunk as one int64 load (the quad's 4 lanes read the same 8 bytes) -> the lane's
        two scale groups, c (bytes 8c.. of the chunk) and 4 + c (bytes 32 + 8c..), as one int32: byte c, then byte
        4 + c above it (sh = 8 c), `_scale_pairs`' input."""
        s64 = _load(ps.to(tl.pointer_type(tl.int64)), ok, 0, EVEN)
        return (((s64 >> sh) & 0xFF) | (((s64 >> (sh + 32)) & 0xFF) << 8)).to(tl.int32)

    @triton.jit
    def _chunk(pa, pb, psa, psb, xw, sh, ma, mb, acc0, acc1, acc2, acc3, INTERPRET: tl.constexpr,
               WARPS: tl.constexpr, EVEN: tl.constexpr):
        """Accumulate one 128-weight chunk of rows g, g + 8 of a weight matrix against the activation row(s): pa / pb
        the lane's first packed byte of each row at this chunk (8 c into its 64 bytes: the lane reads bytes
        [8c, 8c + 8) and [32 + 8c, 32 + 8c + 8), so each load instruction of a warp reads 32 contiguous bytes of each
        of its 8 rows -- whole 32-byte sectors; 16 contiguous bytes a lane read every sector twice), psa / psb the
        row's scale bytes at this chunk, xw the lane's 8 activation words (`_x_words`), sh = 8 c; ma / mb: row and
        chunk exist."""
        pa64 = pa.to(tl.pointer_type(tl.int64))
        pb64 = pb.to(tl.pointer_type(tl.int64))
        wa01, wa23 = _words(_load(pa64, ma, 0, EVEN))
        wa45, wa67 = _words(_load(pa64 + 4, ma, 0, EVEN))
        wb01, wb23 = _words(_load(pb64, mb, 0, EVEN))
        wb45, wb67 = _words(_load(pb64 + 4, mb, 0, EVEN))
        sa0, sa1, fa0, fa1 = _scale_pairs(_scale_bytes(psa, sh, ma, EVEN))
        sb0, sb1, fb0, fb1 = _scale_pairs(_scale_bytes(psb, sh, mb, EVEN))
        for q in tl.static_range(4):  # the lane's 4 words: 8 weights of each row, scale group c (q < 2) or 4 + c
            x01, x23 = _words(xw[2 * q])
            x45, x67 = _words(xw[2 * q + 1])
            wa = wa01 if q == 0 else wa23 if q == 1 else wa45 if q == 2 else wa67
            wb = wb01 if q == 0 else wb23 if q == 1 else wb45 if q == 2 else wb67
            if INTERPRET:
                fa = fa0 if q < 2 else fa1
                fb = fb0 if q < 2 else fb1
                wav = _frag_words(wa, fa)
                wbv = _frag_words(wb, fb)
                for h in tl.static_range(2):
                    xp = x01 if h == 0 else x45
                    xq = x23 if h == 0 else x67
                    # slots in fragment order: (x[4h], x[4h + 2], x[4h + 1], x[4h + 3])
                    bv = [_half(xp, False), _half(xq, False), _half(xp, True), _half(xq, True)]
                    acc0, acc1, acc2, acc3 = _mma_emulated(wav[4 * h: 4 * h + 4], wbv[4 * h: 4 * h + 4], bv,
                                                           acc0, acc1, acc2, acc3, WARPS)
            else:
                sa = sa0 if q < 2 else sa1
                sb = sb0 if q < 2 else sb1
                a0, a1, a2, a3, b0, b1, e0, e1, e2, e3, d0, d1 = _frag_ptx(wa, wb, sa, sb, x01, x23, x45, x67)
                acc0, acc1, acc2, acc3 = _mma_ptx(a0, a1, a2, a3, b0, b1, acc0, acc1, acc2, acc3)
                acc0, acc1, acc2, acc3 = _mma_ptx(e0, e1, e2, e3, d0, d1, acc0, acc1, acc2, acc3)
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _w4a16_mma_kernel(x, w, s, g, rs, y, pair_expert, sorted_pairs, block_expert, N, K, M, A_DIV, R_BUCKET, P,
                          E, s_xm, s_we, s_wn, s_se, s_sn, s_ge, s_gn, s_ym, GROUPED: tl.constexpr,
                          SORTED: tl.constexpr, SWIGLU: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
                          INTERPRET: tl.constexpr, WARPS: tl.constexpr, CHUNKS: tl.constexpr, EVEN: tl.constexpr,
                          USE_PDL: tl.constexpr = False, nw=0, ns=0, s_nwe=0, s_nse=0, NEXT_W_BYTES=0,
                          NEXT_S_BYTES=0, PREFETCH_NEXT: tl.constexpr = False):
        # grid (cdiv(N_out, 16), R). Dense: R = 1, activation rows 0..M-1 (M <= 8) are B's columns; y [M, N_out].
        # Grouped: program r reads activation row r // A_DIV (column 0) and expert pair_expert[r]; y [R, N_out].
        # Sorted (moe_align's routing, BLOCK_M 8): program r is row block r of the P pairs grouped by expert, expert
        # block_expert[r] (E: an unused block, which returns at once); column n = pair sorted_pairs[8 r + n] (P: a
        # padding row), activation row pair // A_DIV; y [P, N_out] by pair.
        # SWIGLU: N = 2 N_out weight rows (gate then up); output n = silu(row n) * row (n + N_out).
        # Byte strides s_wn (row) and s_sn (scale row) must be multiples of 8, K of CHUNK_K (the launcher checks).
        # EVEN (`_even`): N_out a multiple of 16 and the chunks of WARPS x CHUNKS: no masked loads.
        # PREFETCH_NEXT (grouped one program a pair, weight prefetch "next" / "all"; as `w4a16_gemv`'s): once its
        # expert is known, the program prefetches its 1 / cdiv(N_out, 16) share of that expert's slabs in the NEXT
        # launch (nw, ns: int64 addresses of the down projection's packed and scale stacks, NEXT_W_BYTES /
        # NEXT_S_BYTES contiguous bytes an expert at strides s_nwe / s_nse) into L2, so that down's DRAM reads overlap
        # this launch instead of following it (L2-warm, down took 4.31 against 5.14 us a launch: RESULTS, thirty-
        # fourth session). Pairs of one expert prefetch its slabs again: L2 hits.
        pid_n, r = tl.program_id(0), tl.program_id(1)
        if SWIGLU:
            n_out = N // 2
        else:
            n_out = N
        i = tl.arange(0, 32 * WARPS)
        warp = i // 32
        lane = i % 32
        gq = lane // 4  # the lane's row g (and g + 8) of the tile, and its B column
        c = lane % 4
        ra = pid_n * 16 + gq
        rb = ra + 8
        ra_ok = ra < n_out
        rb_ok = rb < n_out
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        if SORTED:
            e = tl.load(block_expert + r)
            if e >= E:  # past the last used block
                return
            pg = tl.load(sorted_pairs + 8 * r + gq)  # the lane's column: its pair, P on a padding row
            xr = x + tl.where(pg < P, pg // A_DIV, 0).to(tl.int64) * s_xm
        elif GROUPED:  # every lane reads the pair's activation row: B's columns all equal, column 0 is stored
            e = tl.load(pair_expert + r)
            if PREFETCH_NEXT:  # 16-byte multiples per program (the launch checks the slabs' alignment)
                prefetch_expert_share(nw, ns, e, s_nwe, s_nse, NEXT_W_BYTES, NEXT_S_BYTES)
            xr = x + (r // A_DIV).to(tl.int64) * s_xm
        else:  # column g = activation row g; lanes past the M rows read row M - 1 (their columns are not stored)
            e = 0
            xr = x + tl.minimum(gq, M - 1).to(tl.int64) * s_xm
        # the epilogue's loads now, beside the first weight loads: after the cross-warp sums (CTA barriers, which
        # later loads do not cross) each would be one more L2 round trip on the kernel's chain. The global scales
        # of the tile's output rows (x 2^7: the weights were x 2^-7), SWIGLU's up rows' too; the pairs' row scales
        lq = tl.arange(0, 32)
        oa = pid_n * 16 + lq // 4
        ob = oa + 8
        col = 2 * (lq % 4)
        ge = g + e * s_ge
        ga = tl.load(ge + oa * s_gn, mask=oa < n_out, other=0.0) * 128.0
        gb = tl.load(ge + ob * s_gn, mask=ob < n_out, other=0.0) * 128.0
        if SWIGLU:
            gua = tl.load(ge + (oa + n_out) * s_gn, mask=oa < n_out, other=0.0) * 128.0
            gub = tl.load(ge + (ob + n_out) * s_gn, mask=ob < n_out, other=0.0) * 128.0
        if SORTED:  # columns col, col + 1 = the block's pairs there
            p0 = tl.load(sorted_pairs + 8 * r + col)
            p1 = tl.load(sorted_pairs + 8 * r + col + 1)
            if HAS_ROW_SCALE:
                r0 = tl.load(rs + p0, mask=p0 < P, other=0.0).to(tl.float32)
                r1 = tl.load(rs + p1, mask=p1 < P, other=0.0).to(tl.float32)
        elif GROUPED:
            if HAS_ROW_SCALE:
                rsc = tl.load(rs + r).to(tl.float32)
        px0 = xr + 16 * c  # the lane's activations: [16 c, 16 c + 16) and [64 + 16 c, ...) of each chunk
        sh = (8 * c).to(tl.int64)  # its scale bytes' shift in a chunk's 8 (`_scale_bytes`)
        e64 = e.to(tl.int64)  # stacks past 2^31 bytes must not wrap
        pa0 = w + e64 * s_we + ra.to(tl.int64) * s_wn + 8 * c
        pb0 = pa0 + 8 * s_wn
        psa0 = s + e64 * s_se + ra.to(tl.int64) * s_sn
        psb0 = psa0 + 8 * s_sn
        acc0 = tl.zeros((32 * WARPS,), dtype=tl.float32)
        acc1 = tl.zeros((32 * WARPS,), dtype=tl.float32)
        acc2 = tl.zeros((32 * WARPS,), dtype=tl.float32)
        acc3 = tl.zeros((32 * WARPS,), dtype=tl.float32)
        up0 = tl.zeros((32 * WARPS,), dtype=tl.float32)
        up1 = tl.zeros((32 * WARPS,), dtype=tl.float32)
        up2 = tl.zeros((32 * WARPS,), dtype=tl.float32)
        up3 = tl.zeros((32 * WARPS,), dtype=tl.float32)
        n_chunks = K // _CHUNK_K
        for it in range(0, tl.cdiv(n_chunks, WARPS * CHUNKS)):
            for u in tl.static_range(CHUNKS):
                chunk = (it * WARPS + warp) * CHUNKS + u
                c_ok = chunk < n_chunks
                ma = ra_ok & c_ok
                mb = rb_ok & c_ok
                pa, psa = pa0 + chunk * 64, psa0 + chunk * 8
                pb, psb = pb0 + chunk * 64, psb0 + chunk * 8
                xw = _x_words(px0 + chunk * _CHUNK_K, c_ok, EVEN)
                acc0, acc1, acc2, acc3 = _chunk(pa, pb, psa, psb, xw, sh, ma, mb, acc0, acc1, acc2, acc3,
                                                INTERPRET, WARPS, EVEN)
                if SWIGLU:  # the up rows, N_out further, against the same activation words
                    up0, up1, up2, up3 = _chunk(pa + n_out * s_wn, pb + n_out * s_wn, psa + n_out * s_sn,
                                                psb + n_out * s_sn, xw, sh, ma, mb, up0, up1, up2, up3,
                                                INTERPRET, WARPS, EVEN)
        # the warps' partial sums over their chunks -> [32] per lane (g, c): D[g, 2c], D[g, 2c+1], D[g+8, 2c], ...
        d0 = tl.sum(tl.reshape(acc0, (WARPS, 32)), axis=0)
        d1 = tl.sum(tl.reshape(acc1, (WARPS, 32)), axis=0)
        d2 = tl.sum(tl.reshape(acc2, (WARPS, 32)), axis=0)
        d3 = tl.sum(tl.reshape(acc3, (WARPS, 32)), axis=0)
        y0, y1, y2, y3 = d0 * ga, d1 * ga, d2 * gb, d3 * gb
        if SWIGLU:
            u0 = tl.sum(tl.reshape(up0, (WARPS, 32)), axis=0)
            u1 = tl.sum(tl.reshape(up1, (WARPS, 32)), axis=0)
            u2 = tl.sum(tl.reshape(up2, (WARPS, 32)), axis=0)
            u3 = tl.sum(tl.reshape(up3, (WARPS, 32)), axis=0)
            y0 = y0 / (1.0 + tl.exp(-y0)) * (u0 * gua)
            y1 = y1 / (1.0 + tl.exp(-y1)) * (u1 * gua)
            y2 = y2 / (1.0 + tl.exp(-y2)) * (u2 * gub)
            y3 = y3 / (1.0 + tl.exp(-y3)) * (u3 * gub)
        if SORTED:  # columns col, col + 1 = the block's pairs there
            dt = y.dtype.element_ty
            if HAS_ROW_SCALE:
                y0, y2 = y0 * r0, y2 * r0
                y1, y3 = y1 * r1, y3 * r1
            y0p = y + p0.to(tl.int64) * s_ym
            y1p = y + p1.to(tl.int64) * s_ym
            tl.store(y0p + oa, y0.to(dt), mask=(p0 < P) & (oa < n_out))
            tl.store(y1p + oa, y1.to(dt), mask=(p1 < P) & (oa < n_out))
            tl.store(y0p + ob, y2.to(dt), mask=(p0 < P) & (ob < n_out))
            tl.store(y1p + ob, y3.to(dt), mask=(p1 < P) & (ob < n_out))
        elif GROUPED:  # column 0 only: y row r
            if HAS_ROW_SCALE:
                y0 = y0 * rsc
                y2 = y2 * rsc
            yr = y + r.to(tl.int64) * s_ym
            tl.store(yr + oa, y0.to(y.dtype.element_ty), mask=(col == 0) & (oa < n_out))
            tl.store(yr + ob, y2.to(y.dtype.element_ty), mask=(col == 0) & (ob < n_out))
        else:  # columns col, col + 1 = activation rows
            dt = y.dtype.element_ty
            tl.store(y + col * s_ym + oa, y0.to(dt), mask=(col < M) & (oa < n_out))
            tl.store(y + (col + 1) * s_ym + oa, y1.to(dt), mask=(col + 1 < M) & (oa < n_out))
            tl.store(y + col * s_ym + ob, y2.to(dt), mask=(col < M) & (ob < n_out))
            tl.store(y + (col + 1) * s_ym + ob, y3.to(dt), mask=(col + 1 < M) & (ob < n_out))

    _w4a16_mma_heuristic = triton.heuristics({"EVEN": _even})(_w4a16_mma_kernel)
    _w4a16_mma_autotuned = triton.autotune(
        configs=_CONFIGS, key=["N", "K", "M", "R_BUCKET", "GROUPED", "SORTED", "SWIGLU", "HAS_ROW_SCALE"])(
        _w4a16_mma_heuristic)


# The interpreter runs one config (tests pin others): two warps, so the cross-warp sum and the K split are exercised.
INTERPRETER_CONFIG = dict(WARPS=2, CHUNKS=1)


def mma_shapes_ok(n: int, k: int) -> bool:
    """K a multiple of CHUNK_K (a lane's 32 weights in four 4-byte words, 16-byte loads of activations) and N > 0."""
    return n > 0 and k > 0 and k % CHUNK_K == 0


def w4a16_mma_launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *,
                     pair_expert: torch.Tensor | None = None, a_div: int = 1, row_scale: torch.Tensor | None = None,
                     swiglu: bool = False, routing=None, config: dict | None = None,
                     then: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Dense (`pair_expert` None): x [M, K] (M <= MMA_MAX_ROWS) -> y [M, N] (or SwiGLU's [M, N/2]) in x.dtype (bf16).
    Grouped: packed [E, N, K/2], scales [E, N, K/16], global [], [E] or [E, N]; `pair_expert` [R] int: output row r
    reads activation row r // a_div with expert pair_expert[r] -> y [R, N (or N/2)], times `row_scale[r]` if given.
    With `routing` (`w4a16_gemm.MoeRouting` of the same pairs, block_m SORTED_BLOCK_M) instead of one program per
    pair, one per (16 rows, block of 8 pairs of one expert): each expert's weights read once for all its pairs.
    `then` (grouped, one program a pair): the next launch's (packed, scales) of the same experts, prefetched into L2
    by this one in weight prefetch mode "next" / "all" (kernels/pdl.py; `w4a16_gemv.next_prefetch_args`).
    `config` pins WARPS / CHUNKS (tests, benchmarks). One launch, no host syncs (CUDA-graph capturable)."""
    if triton is None:
        raise RuntimeError("w4a16_mma needs triton")
    grouped = pair_expert is not None
    sorted_ = routing is not None
    if sorted_ and (not grouped or routing.block_m != SORTED_BLOCK_M or routing.sorted_pairs is None
                    or routing.num_pairs != pair_expert.numel()):
        raise ValueError(f"w4a16_mma: a routing needs the pairs' experts and moe_align's block_m {SORTED_BLOCK_M} "
                         "over the same pairs")
    k = x.shape[-1]
    if x.dtype != torch.bfloat16:
        raise ValueError(f"w4a16_mma: bf16 activations only (the MMA's operands), got {x.dtype}")
    if grouped:
        e, n, kh = packed.shape
        g, s_ge, s_gn = _global_2d(global_scale, e, n)
        r, m = pair_expert.numel(), 1
        pe = pair_expert.reshape(-1)
        s_we, s_wn, s_se, s_sn = packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1)
    else:
        n, kh = packed.shape
        g, s_gn = _global_1d(global_scale, n)
        s_ge, r, m, pe = 0, 1, x.shape[0], g  # pe: any tensor (GROUPED is off)
        s_we, s_wn, s_se, s_sn = 0, packed.stride(0), 0, scales.stride(0)
        if m > MMA_MAX_ROWS:
            raise ValueError(f"w4a16_mma: dense calls of <= {MMA_MAX_ROWS} rows, got {m}")
    if 2 * kh != k or not mma_shapes_ok(n, k):
        raise ValueError(f"w4a16_mma: x has K = {k}, the weight {2 * kh}; K must be a multiple of {CHUNK_K}")
    if swiglu and n % 2:
        raise ValueError(f"a SwiGLU weight needs an even number of rows (gate then up), got {n}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    sc = scales.view(torch.uint8)
    if x.data_ptr() % 8 or (x.dim() > 1 and x.stride(0) % 4):  # activations in 8-byte words: a fresh copy is
        x = x.clone(memory_format=torch.contiguous_format)     # aligned (rows of K, a multiple of CHUNK_K)
    if (packed.stride(-1) != 1 or sc.stride(-1) != 1 or packed.data_ptr() % 8 or s_wn % 8 or s_we % 8
            or sc.data_ptr() % 8 or s_sn % 8 or s_se % 8):  # int64 loads of both (a chunk's 8 scale bytes: K / 16
        raise ValueError("w4a16_mma: weight and scale rows must be 8-byte aligned")  # is a multiple of 8)
    n_out = n // 2 if swiglu else n
    interp = _interpreted()
    # the interpreter truncates fp32 -> bf16 casts (w4a16_gemm's note): it writes fp32 and torch rounds
    rows_out = r if grouped else m
    y = torch.empty((rows_out, n_out), dtype=torch.float32 if interp else x.dtype, device=x.device)
    if rows_out == 0:
        return y.to(x.dtype)
    rs = row_scale.reshape(-1) if row_scale is not None else g
    s_xm = x.stride(0) if x.dim() > 1 else 0
    sp, be = (routing.sorted_pairs, routing.block_expert) if sorted_ else (pe, pe)  # any tensors unless SORTED
    programs = be.numel() if sorted_ else r
    args = (x, packed, sc, g, rs, y, pe, sp, be, n, k, m, a_div, triton.next_power_of_2(r), r,
            packed.shape[0] if grouped else 1, s_xm, s_we, s_wn, s_se, s_sn, s_ge, s_gn, y.stride(0))
    meta = dict(GROUPED=grouped, SORTED=sorted_, SWIGLU=swiglu, HAS_ROW_SCALE=row_scale is not None,
                INTERPRET=interp)
    grid = (triton.cdiv(n_out, 16), programs)
    prefetch = {}
    if grouped and not sorted_ and then is not None and pdl.prefetch_next():
        prefetch = gemv.next_prefetch_args(*then)
        pdl.PREFETCH_LAUNCHES["next"] += bool(prefetch)
    if interp or config:
        cfg = {**INTERPRETER_CONFIG, **(config or {})}
        even = _even(dict(N=n, K=k, SWIGLU=swiglu, **cfg))
        _w4a16_mma_kernel[grid](*args, **meta, **cfg, EVEN=even, num_warps=cfg["WARPS"], num_stages=1,
                                **pdl.launch_options(), **prefetch)
    else:
        _w4a16_mma_autotuned[grid](*args, **meta, **pdl.launch_options(), **prefetch)
    return y.to(x.dtype)


# ---- registry implementations ("triton_mma": where `supports_*_mma` accept; the registry hands the rest on) ---------
def _dense(x: torch.Tensor, w: NVFP4Tensor, swiglu: bool) -> torch.Tensor:
    """`w4a16_mma_launch` over x's leading dims, for the calls `supports_dense_mma` accepts."""
    return _dense_any_rank(x, w.packed, w.scales, torch.as_tensor(w.global_scale, device=x.device), swiglu,
                           launch=w4a16_mma_launch)


def w4a16_linear_mma(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """Same contract as `w4a16_linear_reference`, for the calls `supports_dense_mma` accepts."""
    return _dense(x, w, swiglu=False)


def w4a16_swiglu_mma(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """Same contract as `w4a16_swiglu_reference`, for the calls `supports_swiglu_mma` accepts."""
    return _dense(x, w, swiglu=True)


def moe_experts_w4a16_mma(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, idx: torch.Tensor,
                          weights: torch.Tensor, reduce: bool = True, layout: int = 0,
                          routing: Any = None) -> torch.Tensor:
    """Same contract as `moe_experts_w4a16_reference`, for T <= SORTED_MAX_TOKENS tokens on checkpoint-layout experts:
    gate_up + SwiGLU -> [P, I] rounded to bf16, down x routing weight -> [T, k, H] rounded to bf16, then the sum over
    top_k (fp32, one more rounding) unless `reduce=False` (as `moe_experts_w4a16_gemv`). Up to MMA_MAX_TOKENS tokens
    one program per pair; more, the pairs grouped by expert first (`w4a16_gemm.moe_align_fast`, one launch, or
    `routing` where it was built for this call: `w4a16_gemm._routing_of`)."""
    from kernels.w4a16_gemm import _routing_of

    t, top_k = idx.shape
    if layout != CHECKPOINT or not 0 < t <= SORTED_MAX_TOKENS:
        raise ValueError(f"w4a16_mma: the MoE takes <= {SORTED_MAX_TOKENS} tokens on checkpoint-layout experts, got "
                         f"{t} tokens, layout {layout}")
    routing = _routing_of(idx, w13.packed.shape[0], SORTED_BLOCK_M, routing) if t > MMA_MAX_TOKENS else None
    h = w4a16_mma_launch(x, *w13, pair_expert=idx, a_div=top_k, swiglu=True, routing=routing,
                         then=(w2.packed, w2.scales))  # [P, I]; down's weights prefetched (weight_prefetch)
    y = w4a16_mma_launch(h, *w2, pair_expert=idx, row_scale=weights, routing=routing).view(t, top_k, -1)  # [T, k, H]
    return y.sum(1, dtype=torch.float32).to(x.dtype) if reduce else y


def _mma_call_ok(info: dict) -> bool:
    """bf16 on a CUDA GPU of compute capability >= FRAG_MIN_CAPABILITY (`_frag_ptx`'s mul.rn.bf16x2, as the
    fragment-order kernels'), K a multiple of CHUNK_K."""
    return (info["device"] == "cuda" and tuple(info.get("capability") or (0, 0)) >= FRAG_MIN_CAPABILITY
            and info["dtype"] == torch.bfloat16 and mma_shapes_ok(1, info["k"]))


def supports_dense_mma(**info: Any) -> bool:
    """`w4a16_gemv.supports_dense_gemv` (the GEMV's calls; the GEMV stays first for them: the shared expert is faster
    on it, H200 step 109) and `_mma_call_ok`."""
    return gemv.supports_dense_gemv(**info) and _mma_call_ok(info)


def supports_dense_mma_wide(**info: Any) -> bool:
    """`supports_dense_mma` for calls of N >= WIDE_MIN_N outputs: lm_head in the checkpoint layout (the engine's
    `lm_head_layout: checkpoint`, and its checkpoint-layout copy under `dual_frag`, Hopper's default, for calls of <= 4
    rows; the larger ones there run the swap-AB kernel on fragment-order bytes). There the GEMV's
    ~7.6 instructions a weight bound it (224 us a call, H200 run 16) where this kernel's ~3.1 sit below the bytes'
    ~60 us; registered ahead of the GEMV for these calls only."""
    return info["n"] >= WIDE_MIN_N and supports_dense_mma(**info)


def supports_swiglu_mma(**info: Any) -> bool:
    """`w4a16_gemv.supports_swiglu_gemv` and `_mma_call_ok`."""
    return gemv.supports_swiglu_gemv(**info) and _mma_call_ok(info)


_SORTED_TOKENS = [0]  # calls of MMA_MAX_TOKENS < T <= this take the sorted path via the registry (set_sorted_tokens)


def set_sorted_tokens(tokens: int) -> int:
    """Process-wide (like kernels/pdl.py's settings): the registry hands this kernel's sorted path the MoE calls of
    up to `tokens` (<= SORTED_MAX_TOKENS) tokens; 0 (the default) keeps it to <= MMA_MAX_TOKENS, so that the calls
    above go where they went before (measured: the sorted path lost at 32 streams). The engine sets it from
    `small_batch_tokens`. Returns the value."""
    if not 0 <= tokens <= SORTED_MAX_TOKENS:
        raise ValueError(f"sorted tokens must be in 0..{SORTED_MAX_TOKENS}, got {tokens}")
    _SORTED_TOKENS[0] = tokens
    return tokens


def supports_moe_mma(**info: Any) -> bool:
    """`w4a16_gemm.supports_moe`, checkpoint-layout experts, 1-MMA_MAX_TOKENS tokens (one program a pair) or, past
    them, up to `set_sorted_tokens`'s (off by default), `_mma_call_ok`, and the down projection's K (`describe_moe`'s
    k_down) a multiple of CHUNK_K."""
    return (supports_moe(**info) and info["layout"] == CHECKPOINT
            and 0 < info["tokens"] <= max(MMA_MAX_TOKENS, _SORTED_TOKENS[0])
            and _mma_call_ok(info) and mma_shapes_ok(1, info.get("k_down", 0)))
