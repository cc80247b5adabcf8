"""Grouped NVFP4 W4A16 GEMM with the weights as the MMA's A operand ("swap-AB"): the routed experts' kernel on
Hopper (`w4a16_gemm.w4a16_moe_op` with layout SPLIT_HALVES, the loader's default there), beside
`kernels/w4a16_gemm.py`'s `_w4a16_grouped_kernel` (same routing contract, `_routed_block`; same exact dequant; still
the path of the other two layouts).

Why. The engine's grouped kernel computes acc[BM, BN] = X[BM, BK] @ W^T: the dequantised weight tile is the B
operand. On Hopper, wgmma takes B only from shared memory and needs M >= 64, so at BM = 16-32 routed rows Triton
falls back to mma.sync (sm_90 offline compile: ~5.8 SASS instructions per weight, 186 registers, ~0.6 TB/s at prefill
sizes). Here acc^T[BN, BM] = W[BN, BK] @ X^T[BK, BM]: the weights (BN = 64 rows per warpgroup) are wgmma's A operand,
which may live in registers straight out of the dequant, and the gathered activations X^T (N = BM tokens, 8-256) are
the B operand, a plain cp.async-pipelined tile in shared memory.

Weight layout "split halves" (`split_halves`): within each (row tile of TILE_N rows, K tile of BK) byte j of a row
holds k = j (low nibble) and k = j + BK/2 (high nibble) of that K tile, so the low nibbles are the first half of the
K tile and the high nibbles the second: the activation tile needs no even/odd split (two contiguous [BM, BK/2] loads),
and each byte's two nibbles have their own block scale (groups of 16 bytes = one 16-block per half). Stored
tile-major like `w4a16_gemm.tile_major`: each (row tile, K tile) one contiguous block of TILE_N x BK/2 bytes, rows
of BK/2 bytes. Block scales ([E, N, K/16] e4m3) and the global scale stay in the checkpoint layout.

Arithmetic: exactly `_dequant`'s (DEQ 0 / 1 / 2; the interpreter emulates 1 and 2 in fp32; the fragment-order
layout's bf16 path converts the block scales by another, exact route to the same values: `_e4m3_bf16_gained`), so
the result differs from `w4a16_grouped_reference` only by fp32 summation order (the same bound as the existing
kernel).
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.nvfp4 import BLOCK, NVFP4Tensor
from kernels.split_k import effective_split  # noqa: F401  (re-exported: tests, benchmarks)
from kernels.w4a16_gemm import MoeRouting, _global_2d, _interpreted, frag_capability_ok, tile_major, untile_major

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
    from kernels.split_k import last_arrival, rearm
    from kernels.w4a16_gemm import (
        _TWO_119,
        _dequant_gain,
        _e2m1_bf16_tiny,
        _e2m1_fp16,
        _e2m1x2_bf16_tiny_ptx,
        _e4m3_fp16,
        _mma,
        _routed_block,
    )
except ImportError:  # CPU-only installs without triton: the layout helpers still work
    triton = None

# The engine's launch: stored tiles of SPLIT_TILE = 64 weight rows (one wgmma M per warpgroup of 4 warps) x 128 K
# (4 KB of packed weight per stage), BLOCK_N = 64, 4 warps, 3 stages, for both projections and every batch size.
# H200, 2026-11-30 (benchmarks/w4a16_swapped_bench.py, results/w4a16_swapped_bench_run1), per call against the
# engine's grouped kernel on tile-major experts at the same routing:
#   32 tokens:   gate_up 178.8 -> 147.7 us, down 103.9 -> 77.0 us   (BLOCK_M 16)
#   256 tokens:  gate_up 264.6 -> 206.9 us, down 154.0 -> 113.1 us  (BLOCK_M 16)
#   1024 tokens: gate_up 463.3 -> 292.1 us (BLOCK_M 64; 321.2 at 32), down 272.5 -> 179.0 us (BLOCK_M 32; 180.4 at 64)
# 4 stages, 128-wide programs and 8 warps were slower in every row but two: down at 1,024 tokens with BLOCK_M 32,
# 128 wide, 8 warps (178.6 us: noise) and with BLOCK_M 64, 128 wide, 8 warps (166.7 us, but 4.5e-2 of max |ref| from
# the other kernel where every other config is within 2.3e-3; not understood). So the launcher refuses 8 warps
# unless asked for (`unverified`, benchmarks only). One token was not benched per call (the engine's lone decode was
# 11% slower than with the grouped kernel: RESULTS.md, Qwen run 13). 2026-12-03: the 4-warp build with BLOCK_M 32,
# fragment order, DEQ 2 and 3 stages was nondeterministic before SETTLE (below); the 8-warp outlier above may have
# been the same fault (not re-measured).
SPLIT_TILE = (64, 128)  # (rows, K) of a stored tile
DEFAULT_CONFIG = dict(num_warps=4, num_stages=3)
# The race, and SETTLE. Without SETTLE, some builds gave nondeterministic results on the H200: a repeated identical
# call now and then differed in 8 consecutive output columns (weight rows 16w..16w+7 of a warp's 16: the rows of one
# A-fragment register) for every activation row (benchmarks/race_anatomy.py, results/race_anatomy_run1: lm_head's
# 16-row build at 3 stages, 119 and 153 of 20,000 calls at 1 and 16 rows). The cause is the assembler: Triton 3.6's
# own ptxas (CUDA 12.8) may reuse the registers of a wgmma's A operand while that wgmma, asynchronous, still reads
# them (triton issue 9433; NVIDIA's fix is in CUDA 13.3's ptxas). The loop leaves each K tile's second wgmma group
# in flight while the next tile's dequant writes registers; offline, ptxas 12.8 then writes into in-flight A
# registers 74-108 times per loop in every dense and plain build, at 2 stages too, and never in the SwiGLU builds,
# which never raced (`sass_loop.writes_into_in_flight_a_registers`). Under CUDA 13.5's ptxas (TRITON_PTXAS_PATH) the
# racing builds gave 0 of 20,000 (results/ptxas_race_run1), with more registers (lm_head 70 -> 94): down 7-9% and
# lm_head's 32-row build 12% slower, its 16-row build at 3 stages and gate_up unchanged. SETTLE (the default:
# `settle=True`) instead waits for the tile's wgmma groups at the end of each K tile (`_settled`), so no wgmma is in
# flight across tiles and no A register is written while read (offline: 0 in every build; a CPU test). With
# Triton's own ptxas (results/settle_run1): 0 differing of 30,000-60,000 calls in the 16- and 32-row builds,
# including those that raced, and of 5,000 in the 1,024-token expert builds; the decode builds got 3-8% faster per
# call (registers freed: gate_up 16 rows 121 -> 96), the 1,024-token gate_up and lm_head's 64-row build 1-3% slower
# at equal stages. Which builds raced without it moved with the kernel's code (twenty-sixth to twenty-eighth
# sessions); `settle=False` is for benchmarks only (`unverified=True`).
# Pipeline stages per (call kind, BLOCK_M) for the engine's builds (fragment order, PTX dequant), the faster of 3 and
# 2 with SETTLE per call in CUDA graphs (results/settle_run1, H200, us: 3 against 2 stages):
#   lm_head 16 rows (1-16): 119.0 / 124.4;   32 rows (17-32): 134.3 at 3 (145.5 at 2 without SETTLE, run 4);
#   64 rows (33-64): 187.5 / 176.9;   gate_up 32 tokens (16-row blocks): 90.9 / 87.2;   1,024 tokens (64): 186.2 /
#   210.1;   down 32 tokens: 49.7 / 50.0;   1,024 tokens: 135.0 / 127.8.
# gate_up's 16-row build keeps 3: the next run (results/swapped_ab_run2, other routings, old tree beside this one,
# outputs bit-equal) timed it at 2 stages with SETTLE 94.1 us against 90.0 for the old 3 stages without it, the
# opposite order, while SETTLE at 3 was 3% faster than without it in run 93; the other builds' choices held there
# (down 32 tokens 48.9 against 50.8; lm_head 1 / 16 / 32 rows 119.7 / 119.9 / 135.9 against 125.5 / 129.6 / 147.1;
# gate_up 1,024 tokens 188.2 against 205.6; down 1,024 tokens 130.7 against 130.4).
# Keyed by the call's kind (FRAG_KINDS): "dense" (lm_head, `dense_routing`), "swiglu" (routed gate_up) or "plain"
# (routed, no SwiGLU: down); any other build gets DEFAULT_CONFIG's 3.
FRAG_KINDS = ("dense", "swiglu", "plain")
FRAG_STAGES = {("dense", 16): 3, ("dense", 32): 3, ("dense", 64): 2,
               ("swiglu", 16): 3, ("swiglu", 64): 3,
               ("plain", 16): 3, ("plain", 64): 2}


def default_stages(block_m: int, frag: bool, deq: int, kind: str = "dense") -> int:
    """The launcher's num_stages for a build: FRAG_STAGES' for fragment-order bytes with the PTX dequant (`kind`:
    "dense" | "swiglu" | "plain"), DEFAULT_CONFIG's otherwise."""
    if kind not in FRAG_KINDS:
        raise ValueError(f"default_stages: kind must be {' | '.join(FRAG_KINDS)}, got {kind!r}")
    if frag and deq == 2:
        return FRAG_STAGES.get((kind, block_m), DEFAULT_CONFIG["num_stages"])
    return DEFAULT_CONFIG["num_stages"]


def split_halves(packed: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """Checkpoint-layout packed weights [E, N, K/2] (or [N, K/2]; byte j = k 2j low nibble, 2j+1 high) -> the split-
    halves tile-major bytes of the same shape: per K tile byte j holds k = j (low) and j + BK/2 (high), then tiles of
    block_n rows x block_k are made contiguous (`tile_major`)."""
    flat = packed.dim() == 2
    p = packed.unsqueeze(0) if flat else packed
    e, n, kh = p.shape
    if n % block_n or (2 * kh) % block_k or block_k % (2 * BLOCK):
        raise ValueError(f"[{e}, {n}, {kh}] packed weights do not split into {block_n} x {block_k} tiles "
                         f"(block_k a multiple of {2 * BLOCK})")
    codes = torch.stack((p & 0xF, p >> 4), -1).view(e, n, 2 * kh // block_k, 2, block_k // 2)  # k-ordered codes
    halves = (codes[..., 0, :] | (codes[..., 1, :] << 4)).view(e, n, kh)  # lo: first half of each K tile, hi: second
    out = tile_major(halves, block_n, block_k)
    return out[0] if flat else out


def unsplit_halves(packed_split: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """The inverse of `split_halves`: split-halves tile-major bytes back to the checkpoint layout."""
    flat = packed_split.dim() == 2
    p = packed_split.unsqueeze(0) if flat else packed_split
    e, n, kh = p.shape
    h = untile_major(p, block_n, block_k).view(e, n, 2 * kh // block_k, 1, block_k // 2)
    codes = torch.cat((h & 0xF, h >> 4), -2).view(e, n, kh, 2)  # back in k order, pairs (2j, 2j+1)
    out = (codes[..., 0] | (codes[..., 1] << 4)).contiguous()
    return out[0] if flat else out


# Fragment order ("split frag", layout SPLIT_FRAG): split halves with the bytes of every 16-byte group (16 K of a
# half) reordered so that the four a wgmma A-fragment thread holds per row and K step -- k = 2c, 2c + 1, 2c + 8,
# 2c + 9 for thread column c = lane % 4 -- are adjacent: stored position 4c + 2h + b holds the group's byte 8h + 2c + b.
# The kernel undoes it in registers (`_frag_to_k`), so shared memory is read 4 bytes at a time instead of 2 and the
# bytes need no PRMT shaping (offline sm_90 SASS, swap-AB SwiGLU BLOCK_M 16: 903 -> 754 loop instructions per K tile,
# and the tile's 16 HGMMAs issue in batches of 4 instead of each waiting for the last; 690 with the scale conversion
# below). H200 (results/w4a16_swapped_bench_run2, one call each): 32 tokens gate_up 149.3 -> 118.6 us, down 77.6 ->
# 61.6; 1,024 tokens gate_up 297.3 -> 216.3 (BLOCK_M 64), down 184.1 -> 156.3 (BLOCK_M 32); bit-equal in the GPU tests.
# A quarter-order layout (`split_quad`: four codes per 16-bit element, one dot per K quarter; offline sm_90 SASS 689 ->
# 465 loop instructions per K tile, but the A tiles went to wgmma through shared memory) was tried and measured slower
# on the H200 on 2026-12-01 (results/w4a16_swapped_bench_run3, per call, fragment order vs quarter order: 32 tokens
# gate_up 118.5 vs 158.3 us; 1,024 tokens gate_up 216.7 vs 285.8, down 155.1 vs 181.4 (BLOCK_M 64; 17-34% slower at
# every tile timed); and 2 of its GPU tests not bit-equal to split halves), so it was removed.
# Words of 8 weights: fragment-order bytes also store each 32-bit input of the dequant's asm as one word whose 32
# bits are its 8 codes placed where the GPU dequant (`_e2m1x2_bf16_frag_ptx`) reads them. Which 4 bytes that input
# holds is Triton's choice: `pack=4` takes 4 consecutive registers of the thread, and in the wgmma A operand's layout
# (TTGIR #linear, register bases [0,0,1], [8,0,0], ...) those are stored bytes 4j, 4j + 1 of row r, then the same
# two of row r + 8 (the SASS assembles them with one PRMT 0x5410 / 0x7632 from two LDSM registers, rows r and
# r + 8); bytes 4j + 2, 4j + 3 of the two rows make the next word (`_word_elements`; programs narrower than 64 rows
# lay the input out otherwise, so the launcher refuses them). Its four bf16x2 outputs -- the low nibbles' values of
# elements (0, 1), (2, 3), then the high nibbles' of (0, 1), (2, 3); each 16-bit half an E2M1 code (s e1 e0 m) with
# m, e0, e1 at bits 6-8 and s at 15, i.e. the code's value x 2^-126 in bf16, before the HMUL2 by the block scale x
# 2^119 -- are
#     w & M,   rotl(w, 10) & M,   rotl(w, 13) & M,   ((w & 0x001B001B) * 0x1084) & M,   M = 0x81C081C0
# (the multiply's three shifted copies, by 2, 7 and 12, never carry into a bit of M: checked for all 2^8 values of
# its input bits). 8 instructions per 8 weights (sm_90 SASS: 5 LOP3, 2 SHF.L.W, 1 IMAD) against the sign-first
# bytes' 14 (two PRMTs and four shift-shift-or-mask rows; those bytes stored each high nibble rotated, thirty-seventh
# session). Found by `benchmarks/frag_decode_search.py` (RESULTS.md, thirty-ninth session, item 9). The loader's side
# (`frag_words`) is derived from the same formulas (`frag_decode_word`) by following each word bit through them,
# so the two cannot disagree; the other decode routes (interpreter, DEQ 0 / 1, fp16) decode the word by the same
# formulas in Triton first (`_frag_plain`).
FRAG_GROUP = 16
FRAG_ORDER = [8 * h + 2 * c + b for c in range(4) for h in range(2) for b in range(2)]  # stored m -> group byte
FRAG_INVERSE = [FRAG_ORDER.index(j) for j in range(FRAG_GROUP)]  # group byte -> stored m
E2M1_BF16_MASK = 0x81C081C0  # the bf16 pair's bits that carry a code: m, e0, e1 at 6-8 (22-24), s at 15 (31)
FRAG_ROTATIONS = (10, 13)  # the second and third outputs' left rotations
FRAG_O3 = (0x001B001B, 0x1084)  # the fourth output's input bits and multiplier (copies shifted by 2, 7, 12)
_CODE_BITS = (6, 7, 8, 15)  # bit of a 16-bit half that takes code bit 0 (m), 1 (e0), 2 (e1), 3 (s)


# The two inline-PTX routines of the fragment-order dequant, shared with `kernels/w4a16_regs.py` (Gluon): one
# 32-bit word of 8 codes -> four bf16x2 registers (`_e2m1x2_bf16_frag_ptx`), and four e4m3 scale bytes -> two
# bf16x2 registers of scale x 2^119 (`_e4m3_bf16_gained`).
FRAG_DECODE_PTX = """{
        .reg .b32 a, b, c;
        and.b32 $0, $4, 0x81C081C0;
        shf.l.wrap.b32 a, $4, $4, 10; and.b32 $1, a, 0x81C081C0;
        shf.l.wrap.b32 b, $4, $4, 13; and.b32 $2, b, 0x81C081C0;
        and.b32 c, $4, 0x001B001B; mul.lo.u32 c, c, 0x1084; and.b32 $3, c, 0x81C081C0;
        }"""
E4M3_GAINED_PTX = """{
        .reg .b32 a, b, g1, g2;
        mov.b32 g1, 0x7B807B80;
        mov.b32 g2, 0x7B007B00;
        prmt.b32 a, $2, 0, 0x4140;
        prmt.b32 b, $2, 0, 0x4342;
        shl.b32 a, a, 4; and.b32 a, a, 0x07F007F0;
        shl.b32 b, b, 4; and.b32 b, b, 0x07F007F0;
        mul.rn.bf16x2 a, a, g1; mul.rn.bf16x2 $0, a, g2;
        mul.rn.bf16x2 b, b, g1; mul.rn.bf16x2 $1, b, g2;
        }"""


def frag_decode_word(w: int) -> list[int]:
    """The GPU dequant's four bf16x2 registers of one stored word (`_e2m1x2_bf16_frag_ptx`, in Python)."""
    rotl = [((w << r) | (w >> (32 - r))) & 0xFFFFFFFF for r in FRAG_ROTATIONS]
    o3 = ((w & FRAG_O3[0]) * FRAG_O3[1]) & 0xFFFFFFFF
    return [v & E2M1_BF16_MASK for v in (w, *rotl, o3)]


def _frag_word_bits() -> list[int]:
    """plain[b]: the bit of the plain 4-byte word (byte e = element e, low nibble the first K half's code) that
    stored bit b holds. Output register j, half h carries the code of element 2 (j % 2) + h, nibble j // 2; a single
    stored bit lands on exactly one bit of one output (checked here; the multiply's carries by the tests)."""
    plain = []
    for b in range(32):
        hits = [(j, p) for j, v in enumerate(frag_decode_word(1 << b)) for p in range(32) if v >> p & 1]
        if len(hits) != 1:
            raise AssertionError(f"frag_decode_word: word bit {b} reaches {hits}")
        j, p = hits[0]
        e, nibble, role = 2 * (j % 2) + p // 16, j // 2, _CODE_BITS.index(p % 16)
        plain.append(8 * e + 4 * nibble + role)
    if sorted(plain) != list(range(32)):
        raise AssertionError("frag_decode_word: the stored bits are not a permutation of the plain word's")
    return plain


FRAG_WORD_BITS = _frag_word_bits()  # stored bit b <- plain bit FRAG_WORD_BITS[b]


def frag_words(b: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """uint8 bytes [..., 4] (each 4 one word's elements 0-3, the first the lowest byte) in plain order -> stored
    words (FRAG_WORD_BITS; `inverse`: back). One masked shift per distinct bit distance, in chunks of 2^22 words to
    bound the temporaries."""
    src, dst = (range(32), FRAG_WORD_BITS) if inverse else (FRAG_WORD_BITS, range(32))
    moves: dict[int, int] = {}  # distance (to - from) -> mask of the from-bits
    for f, t in zip(src, dst):
        moves[t - f] = moves.get(t - f, 0) | (1 << f)
    words = b.contiguous().view(-1).view(torch.int32)
    out = torch.empty_like(words)
    for lo in range(0, words.numel(), 1 << 22):
        w = words[lo:lo + (1 << 22)].to(torch.int64) & 0xFFFFFFFF
        acc = torch.zeros_like(w)
        for d, mask in moves.items():
            acc |= (w & mask) << d if d >= 0 else (w & mask) >> -d
        out[lo:lo + (1 << 22)] = acc.to(torch.int32)  # bit 31 wraps to the sign: the same 32 bits
    return out.view(torch.uint8).view(b.shape)


def _word_elements(t: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """Tile-major bytes (blocks of block_n rows x block_k / 2) as a view [..., 4]: each word's elements in order,
    element 2h + v = row 16q + 8h + i, byte 4j + v, of its (q, i, j); block_n a multiple of 16."""
    v = t.reshape(-1, block_n // 16, 2, 8, block_k // 8, 2, 2)  # blocks, q, h (rows +8), i, j, byte pair, v
    return v.permute(0, 1, 3, 4, 5, 2, 6)  # [..., h, v]


def tile_words(t: torch.Tensor, block_n: int, block_k: int, inverse: bool = False) -> torch.Tensor:
    """Fragment-order tile-major bytes -> the same with every word stored for the GPU dequant (`frag_words` on the
    words `_word_elements` names; `inverse`: back)."""
    if block_n % 16:
        raise ValueError(f"fragment-order words pair rows r and r + 8 of 16-row groups: block_n {block_n}")
    out = torch.empty_like(t)
    w = _word_elements(t, block_n, block_k)
    _word_elements(out, block_n, block_k).copy_(frag_words(w.contiguous(), inverse).view(w.shape))
    return out


def split_frag(packed: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """Checkpoint-layout packed weights -> `split_halves` bytes with each 16-byte group in fragment order and each
    word of 4 bytes (2 of row r, 2 of row r + 8) stored for the GPU dequant (`tile_words`)."""
    s = split_halves(packed, block_n, block_k)
    return tile_words(s.reshape(-1, FRAG_GROUP)[:, FRAG_ORDER].reshape(s.shape), block_n, block_k)


def unsplit_frag(packed_frag: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """The inverse of `split_frag`."""
    s = tile_words(packed_frag, block_n, block_k, inverse=True)
    return unsplit_halves(s.reshape(-1, FRAG_GROUP)[:, FRAG_INVERSE].reshape(s.shape), block_n, block_k)


def split_halves_ok(w13: NVFP4Tensor, w2: NVFP4Tensor) -> bool:
    """Whether stacked gate_up [E, 2I, H] and down [E, H, I] split into SPLIT_TILE's tiles (gate_up's up rows must
    start on a tile: I a multiple of the tile's rows, so the SwiGLU launch's rows n + I stay tile-aligned)."""
    bn, bk = SPLIT_TILE
    i, h = w13.packed.shape[-2] // 2, 2 * w13.packed.shape[-1]
    return i % bn == 0 and h % bk == 0 and w2.packed.shape[-2] % bn == 0 and 2 * w2.packed.shape[-1] % bk == 0


def experts_split_halves(w13: NVFP4Tensor, w2: NVFP4Tensor, inverse: bool = False,
                         frag: bool = False) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """Both expert stacks into the split-halves layout of SPLIT_TILE (`frag`: in fragment order, `split_frag`), or
    back to the checkpoint's with `inverse`; block and global scales stay."""
    f = (unsplit_frag if inverse else split_frag) if frag else (unsplit_halves if inverse else split_halves)
    return tuple(NVFP4Tensor(f(w.packed, *SPLIT_TILE), w.scales, w.global_scale) for w in (w13, w2))


# Split K of decode-sized expert calls (`w4a16_gemm.w4a16_moe_op` on swapped layouts at <= DECODE_SPLIT_TOKENS
# tokens): (gate_up, down). (1, 1) = unsplit, the default: the engine's <= 4-token calls read the dual copy through the
# decode GEMV (`NVFP4Experts.repack_dual`), so this applies only to engines without one (expert_layout split_halves /
# split_frag); `benchmarks/qwen_gpu.py --swapped-split` sets it for a side-by-side engine. H200, Qwen run 32: without
# the dual copy a lone request decodes at 311.1 tok/s, with splits (2, 2) / (4, 4) / (8, 4) 310.8 / 314.4 / 312.7,
# the default (dual copy, GEMV) 369.4: split K does not close the gap. Per-call timings at 1-4
# tokens were host-bound (results/w4a16_swapped_bench_run4: 24-140 us against the ~7 us a decode expert call takes in
# the engine's CUDA graphs), so only the engine can rank the splits.
DECODE_SPLIT: tuple[int, int] = (1, 1)
DECODE_SPLIT_TOKENS = 4


def decode_split(tokens: int, k_tiles: tuple[int, int]) -> tuple[int, int]:
    """(gate_up, down) split of a call of `tokens` tokens whose projections have `k_tiles` K tiles: DECODE_SPLIT
    (each capped at its projection's K tiles) at <= DECODE_SPLIT_TOKENS tokens, else unsplit."""
    if tokens > DECODE_SPLIT_TOKENS:
        return 1, 1
    return tuple(max(1, min(int(s), k)) for s, k in zip(DECODE_SPLIT, k_tiles))


def dense_routing(rows: int, block_m: int) -> MoeRouting:
    """A dense call ([rows, K] x one [N, K] weight) as a one-expert `MoeRouting` without tensors: row r is pair r, and
    every row block is expert 0, which the kernel computes (`DENSE`) instead of loading. Sizes only, so nothing is
    allocated, cached or captured: a routing tensor cached by its first use would, when that use sits inside a CUDA
    graph capture, hold bytes nobody wrote until the graph replays (Qwen run 39: an eager 29-row call read one and
    every stream's next token went wrong)."""
    if rows < 1 or block_m < 1:
        raise ValueError(f"dense_routing: rows and block_m must be >= 1, got {rows}, {block_m}")
    return MoeRouting(None, None, rows, block_m)


def swapped_block_m(num_pairs: int, num_experts: int) -> int:
    """Routed rows per program (the MMA's N) from the mean pairs per expert: 16 at decode sizes; 64 from 16 pairs per
    expert on (at 1,024 tokens x top-8 of 256, 32 per expert, 64 measured 9% faster than 32 for gate_up and equal
    for down: each weight tile is dequantised once per program, so fewer, fuller programs dequantise less)."""
    return 16 if num_pairs / num_experts <= 16 else 64


# ---- Triton kernel --------------------------------------------------------------------------------------------------
if triton is not None:
    _BLK = tl.constexpr(BLOCK)
    _FRAG_DECODE, _E4M3_GAINED = tl.constexpr(FRAG_DECODE_PTX), tl.constexpr(E4M3_GAINED_PTX)  # jit reads constexprs

    @triton.jit
    def _frag_to_k(v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FRAG: tl.constexpr):
        """Weights [BN, BK/32, 16] in stored byte order -> [BN, BK/2] in K order (FRAG: stored 4c + 2h + b is K
        offset 8h + 2c + b of its group, `split_frag`; a relabelling of registers, no data movement on the GPU)."""
        if FRAG:
            v = tl.permute(tl.reshape(v, (BLOCK_N, BLOCK_K // 32, 4, 2, 2)), (0, 1, 3, 2, 4))
        return tl.reshape(v, (BLOCK_N, BLOCK_K // 2))

    @triton.jit
    def _e4m3_bf16_gained(b):
        """uint8 e4m3 bytes of non-negative scales -> scale x 2^119 as exact bf16 (`_dequant_groups`' scale factor),
        in PTX, four bytes per 32-bit register: two PRMTs spread the bytes into 16-bit halves; per pair of halves the
        bits (b & 0x7F) << 4 are scale x 2^-120 as bf16 (subnormals included; one shift, one mask), then two exact
        power-of-two products (x 2^120, x 2^119: one HMUL2 each). 2.5 instructions a scale against ~4.5 for the same
        formula in Triton (16-bit integer ops and a PRMT to pair the results; offline sm_90 SASS of the SwiGLU
        16-row build: 689 -> 565 loop instructions per K tile). GPU only (the interpreter runs the fp32 route);
        tests/ptx_emu.py runs the text on the CPU."""
        return tl.inline_asm_elementwise(_E4M3_GAINED, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)

    @triton.jit
    def _e2m1x2_bf16_frag_ptx(pw):
        """Fragment-order words (`frag_words`) -> bf16 weights x 2^-126 (before the block scale): 4 bytes a call, the
        word of elements 0-3; outputs the low nibbles' values of elements (0, 1), (2, 3), then the high nibbles' (the
        comment above FRAG_GROUP). 8 instructions per 8 weights: w & M, two rotations (shf.l.wrap) and masks, one
        masked multiply and its mask (`frag_decode_word` is the same in Python)."""
        return tl.inline_asm_elementwise(_FRAG_DECODE, "=r,=r,=r,=r,r", [pw], dtype=(tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=4)

    _MASK = tl.constexpr(E2M1_BF16_MASK)  # `frag_decode_word`'s constants, for `_frag_plain`
    _ROT1, _ROT2 = tl.constexpr(FRAG_ROTATIONS[0]), tl.constexpr(FRAG_ROTATIONS[1])
    _O3_BITS, _O3_MUL = tl.constexpr(FRAG_O3[0]), tl.constexpr(FRAG_O3[1])

    @triton.jit
    def _frag_codes(o):
        """A decoded uint32 register (two halves of code x 2^-126, `frag_decode_word`) -> its two codes."""
        return ((o >> 6) & 7) | ((o >> 12) & 8), ((o >> 22) & 7) | ((o >> 28) & 8)

    @triton.jit
    def _frag_plain(pw, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Stored words [BN, BK/32, 16] (`tile_words`: element 2h + v of a word is row 16q + 8h + i, byte 4j + v) ->
        the fragment-order bytes without the word layout (low nibble the first K half's code), by the PTX's own
        formulas in Triton (`frag_decode_word`'s constants): the decode routes other than `_e2m1x2_bf16_frag_ptx` (the
        interpreter, DEQ 0 / 1, fp16)."""
        v = tl.reshape(pw, (BLOCK_N // 16, 2, 8, BLOCK_K // 32, 4, 2, 2))  # q, h, i, group, c, byte pair, v
        v0, v1 = tl.split(tl.permute(v, (0, 2, 3, 4, 5, 1, 6)))  # [q, i, group, c, pair, h, v]: split v
        b0, b2 = tl.split(v0)  # then h
        b1, b3 = tl.split(v1)
        w = b0.to(tl.uint32) | (b1.to(tl.uint32) << 8) | (b2.to(tl.uint32) << 16) | (b3.to(tl.uint32) << 24)
        lo0, lo1 = _frag_codes(w & _MASK)
        lo2, lo3 = _frag_codes(((w << _ROT1) | (w >> (32 - _ROT1))) & _MASK)
        hi0, hi1 = _frag_codes(((w << _ROT2) | (w >> (32 - _ROT2))) & _MASK)
        hi2, hi3 = _frag_codes(((w & _O3_BITS) * _O3_MUL) & _MASK)
        e0, e1, e2, e3 = lo0 | (hi0 << 4), lo1 | (hi1 << 4), lo2 | (hi2 << 4), lo3 | (hi3 << 4)
        words = tl.join(tl.join(e0, e2), tl.join(e1, e3))  # [q, i, group, c, pair, h, v]
        v = tl.permute(words, (0, 5, 1, 2, 3, 4, 6))  # [q, h, i, group, c, pair, v]
        return tl.reshape(v, (BLOCK_N, BLOCK_K // 32, 16)).to(tl.uint8)

    @triton.jit
    def _halves(v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """[BN, BK/16] per-16 values of a K tile -> (first half, second half) [BN, BK/32] each."""
        return tl.split(tl.permute(tl.reshape(v, (BLOCK_N, 2, BLOCK_K // 32)), (0, 2, 1)))

    @triton.jit
    def _dequant_halves(pw, s8, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DEQ: tl.constexpr, INTERPRET: tl.constexpr, FRAG: tl.constexpr):
        """Split-halves bytes [BN, BK/32, 16] + the K tile's scale bytes [BN, BK/16] (`_load_tile_scales`) ->
        (first-half, second-half) weights [BN, BK/2] in DTYPE, times `_dequant_gain`'s inverse: `w4a16_gemm._dequant`
        with one scale per nibble half instead of one per byte. FRAG: bytes in fragment order (`split_frag`), and on
        the GPU the scales converted by `_e4m3_bf16_gained` (the same values), the whole tile's at once."""
        if FRAG and (INTERPRET or DTYPE != tl.bfloat16 or DEQ != 2):  # only the PTX reads the stored words
            pw = _frag_plain(pw, BLOCK_N, BLOCK_K)
        if DTYPE == tl.bfloat16 and DEQ > 0:
            if FRAG and not INTERPRET:  # scale x 2^119 straight from the bits (bf16)
                slo, shi = _halves(_e4m3_bf16_gained(s8), BLOCK_N, BLOCK_K)
                slo, shi = slo[:, :, None], shi[:, :, None]
            else:
                s_lo, s_hi = _halves(s8, BLOCK_N, BLOCK_K)  # via fp16 and fp32: a normal bf16, exact (see `_dequant`)
                slo = _e4m3_fp16(s_lo.to(tl.uint16))[:, :, None].to(tl.float32) * _TWO_119
                shi = _e4m3_fp16(s_hi.to(tl.uint16))[:, :, None].to(tl.float32) * _TWO_119
            if INTERPRET:  # the same bits in fp32 (the interpreter flushes bf16 subnormals; see `_dequant`)
                p = pw.to(tl.uint32)
                lo = (((p & 7) << 22) | ((p & 8) << 28)).to(tl.float32, bitcast=True) * slo
                hi = ((((p >> 4) & 7) << 22) | (((p >> 4) & 8) << 28)).to(tl.float32, bitcast=True) * shi
                lo, hi = lo.to(DTYPE), hi.to(DTYPE)
            else:
                if DEQ == 2 and FRAG:
                    lo, hi = _e2m1x2_bf16_frag_ptx(pw)
                elif DEQ == 2:
                    lo, hi = _e2m1x2_bf16_tiny_ptx(pw)
                else:
                    p = pw.to(tl.uint16)
                    lo, hi = _e2m1_bf16_tiny(p & 0xF), _e2m1_bf16_tiny(p >> 4)
                lo, hi = lo * slo.to(tl.bfloat16), hi * shi.to(tl.bfloat16)  # exact
            return _frag_to_k(lo, BLOCK_N, BLOCK_K, FRAG), _frag_to_k(hi, BLOCK_N, BLOCK_K, FRAG)
        s_lo, s_hi = _halves(s8, BLOCK_N, BLOCK_K)
        slo = _e4m3_fp16(s_lo.to(tl.uint16))[:, :, None]
        shi = _e4m3_fp16(s_hi.to(tl.uint16))[:, :, None]
        p = pw.to(tl.uint16)
        lo = _frag_to_k(_e2m1_fp16(p & 0xF) * slo, BLOCK_N, BLOCK_K, FRAG)
        hi = _frag_to_k(_e2m1_fp16(p >> 4) * shi, BLOCK_N, BLOCK_K, FRAG)
        return lo.to(DTYPE), hi.to(DTYPE)

    @triton.jit
    def _settled(acc, INTERPRET: tl.constexpr):
        """acc as it is, through one `mov` per register: a use outside the MMAs, so Triton waits for this K tile's
        wgmma groups (`wgmma.wait_group 0`) before the loop goes on, and no wgmma reading its A operand from registers
        is still in flight while the next tile's dequant writes registers (`SETTLE`). The interpreter: acc."""
        if INTERPRET:
            return acc
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _load_split_tile(w, rows, t, K, BLOCK_K: tl.constexpr, TILE_N: tl.constexpr):
        """Split-halves bytes [BN, BK/32, 16] of K tile t of weight rows `rows` [BN] (aligned to TILE_N, in range):
        len(rows) / TILE_N contiguous blocks of TILE_N x BK/2 bytes (one block when BLOCK_N = TILE_N)."""
        local = tl.arange(0, BLOCK_K // (2 * _BLK))[None, :, None] * _BLK + tl.arange(0, _BLK)[None, None, :]
        base = (rows // TILE_N) * (K // 2 * TILE_N) + t * (TILE_N * (BLOCK_K // 2)) + (rows % TILE_N) * (BLOCK_K // 2)
        return tl.load(w + base[:, None, None] + local)

    @triton.jit
    def _load_tile_scales(s, rows, t, K, s_sn, BLOCK_K: tl.constexpr):
        """Block-scale bytes of K tile t, [BN, BK/16] (the first half's BK/32, then the second's: `_halves` splits
        them), zero past the last tile (the look-ahead load). One load and one conversion per K tile instead of one
        per half: 4 bytes a thread instead of 2, and the scale tile crosses to the dequant's layout once (offline
        sm_90 SASS of the SwiGLU 16-row build: 533 -> 512 loop instructions, 5 -> 3 barriers per K tile)."""
        g = t * (BLOCK_K // _BLK) + tl.arange(0, BLOCK_K // _BLK)
        ok = (t * BLOCK_K < K) & (rows[:, None] >= 0)
        return tl.load(s + rows[:, None] * s_sn + g[None, :], mask=ok, other=0)

    @triton.jit
    def _load_xt_halves(x, a_rows, a_ok, t, s_xm, BLOCK_K: tl.constexpr):
        """K tile t of the gathered activation rows as two contiguous tiles [BM, BK/2] (first, second half)."""
        ks = t * BLOCK_K + tl.arange(0, BLOCK_K // 2)
        ptr = x + a_rows[:, None] * s_xm + ks[None, :]
        return (tl.load(ptr, mask=a_ok[:, None], other=0.0),
                tl.load(ptr + BLOCK_K // 2, mask=a_ok[:, None], other=0.0))

    @triton.jit
    def _w4a16_grouped_swapped_kernel(x, w, s, g, rs, y, sorted_pairs, block_expert, P, N, K, E, A_DIV,
                                      s_xm, s_we, s_se, s_sn, s_ge, s_gn, s_ym, ws, counters,
                                      SWIGLU: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, INTERPRET: tl.constexpr,
                                      DEQ: tl.constexpr, TILE_N: tl.constexpr,
                                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                      FRAG: tl.constexpr = False, SPLIT: tl.constexpr = 1,
                                      DENSE: tl.constexpr = False, SETTLE: tl.constexpr = False,
                                      USE_PDL: tl.constexpr = False):
        # grid (R / BM (DENSE: cdiv(P, BM)), N_out / BN); one program = BN output columns (weight rows: the MMA's M)
        # x BM sorted pairs of one expert (the MMA's N). Weights in split halves (`split_halves`, tiles of TILE_N rows
        # x BK; BN a multiple of TILE_N, N_out of BN, K of BK: the launcher checks). SWIGLU: N = 2 N_out rows, column
        # n uses n, n + N_out. FRAG: the split-halves bytes in fragment order (`split_frag`). DENSE: `dense_routing`
        # (no routing tensors: sorted_pairs / block_expert unused, row block pid_m = pairs pid_m BM.., expert 0).
        # SPLIT > 1 (grid (.., .., SPLIT)): program_id(2) takes its share of the K tiles and stores its fp32 partials
        # to ws [SPLIT, tiles, 2 (gate, up; 1 without SwiGLU), BN, BM]; the last of a tile's SPLIT programs to arrive
        # (`split_k`: one counter per tile, re-armed to 0) sums them in split order and runs the epilogue. SPLIT = 1:
        # none of it. SETTLE: each K tile's wgmma groups are waited for at the end of the tile (`_settled`; the
        # comment above FRAG_STAGES).
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if DENSE:  # `dense_routing`: row block pid_m is rows pid_m BM.., all of expert 0
            e = 0
        else:
            e = tl.load(block_expert + pid_m)
        if e < E:  # blocks past the last used one hold the sentinel E
            pairs, p_ok, a_rows, n_out = _routed_block(sorted_pairs, pid_m, P, A_DIV, N, SWIGLU, BLOCK_M, DENSE)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            we = w + e.to(tl.int64) * s_we
            se = s + e.to(tl.int64) * s_se
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # acc^T: weight rows x pairs
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            # block scales one K tile ahead in registers (byte loads are too narrow for cp.async; see
            # `w4a16_gemm._load_scale_tile`)
            sl = _load_tile_scales(se, offs_n, 0, K, s_sn, BLOCK_K)
            if SWIGLU:
                ul = _load_tile_scales(se, offs_n + n_out, 0, K, s_sn, BLOCK_K)
            t_lo, t_hi = 0, K // BLOCK_K
            if SPLIT > 1:  # this program's share of the K tiles (the launcher gives every split at least one)
                per = tl.cdiv(K // BLOCK_K, SPLIT)
                t_lo = tl.program_id(2) * per
                t_hi = tl.minimum(t_lo + per, K // BLOCK_K)
                sl = _load_tile_scales(se, offs_n, t_lo, K, s_sn, BLOCK_K)
                if SWIGLU:
                    ul = _load_tile_scales(se, offs_n + n_out, t_lo, K, s_sn, BLOCK_K)
            for t in range(t_lo, t_hi):
                xlo, xhi = _load_xt_halves(x, a_rows, p_ok, t, s_xm, BLOCK_K)
                pw = _load_split_tile(we, offs_n, t, K, BLOCK_K, TILE_N)
                cl = sl
                sl = _load_tile_scales(se, offs_n, t + 1, K, s_sn, BLOCK_K)
                lo, hi = _dequant_halves(pw, cl, x.dtype.element_ty, BLOCK_N, BLOCK_K, DEQ, INTERPRET, FRAG)
                acc = _mma(lo, tl.trans(xlo), acc, INTERPRET)
                acc = _mma(hi, tl.trans(xhi), acc, INTERPRET)
                if SWIGLU:
                    pw = _load_split_tile(we, offs_n + n_out, t, K, BLOCK_K, TILE_N)
                    cl = ul
                    ul = _load_tile_scales(se, offs_n + n_out, t + 1, K, s_sn, BLOCK_K)
                    lo, hi = _dequant_halves(pw, cl, x.dtype.element_ty, BLOCK_N, BLOCK_K, DEQ, INTERPRET,
                                             FRAG)
                    acc_up = _mma(lo, tl.trans(xlo), acc_up, INTERPRET)
                    acc_up = _mma(hi, tl.trans(xhi), acc_up, INTERPRET)
                if SETTLE:
                    acc = _settled(acc, INTERPRET)
                    if SWIGLU:
                        acc_up = _settled(acc_up, INTERPRET)
            last = True
            if SPLIT > 1:
                tile = pid_m * tl.num_programs(1) + pid_n
                HALVES: tl.constexpr = 2 if SWIGLU else 1  # partials per tile: gate and up, or one
                rows_bn = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [BN, BM]
                part = ws + tile * (HALVES * BLOCK_N * BLOCK_M) + rows_bn  # this tile's slots of split 0
                step = tl.num_programs(0) * tl.num_programs(1) * (HALVES * BLOCK_N * BLOCK_M)  # between splits
                tl.store(part + tl.program_id(2) * step, acc)
                if SWIGLU:
                    tl.store(part + tl.program_id(2) * step + BLOCK_N * BLOCK_M, acc_up)
                last = last_arrival(counters, tile, SPLIT)
                if last:  # every split's partial is visible: their sum in split order (deterministic)
                    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                    for sp in tl.static_range(SPLIT):  # ".cg": L2, never a stale L1 line
                        acc += tl.load(part + sp * step, cache_modifier=".cg")
                        if SWIGLU:
                            acc_up += tl.load(part + sp * step + BLOCK_N * BLOCK_M, cache_modifier=".cg")
                    rearm(counters, tile)
            if last:
                _swapped_epilogue(acc, acc_up, g, rs, y, e, s_ge, s_gn, s_ym, offs_n, pairs, p_ok, n_out,
                                  x.dtype.element_ty, SWIGLU, HAS_ROW_SCALE, DEQ)

    @triton.jit
    def _swapped_epilogue(acc, acc_up, g, rs, y, e, s_ge, s_gn, s_ym, offs_n, pairs, p_ok, n_out,
                          DT: tl.constexpr, SWIGLU: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, DEQ: tl.constexpr):
        """acc / acc_up [BN, BM] fp32 (weight rows x pairs) -> y: the gain and global scales, SwiGLU, row scale."""
        ge = g + e * s_ge
        gain = _dequant_gain(DT, DEQ)
        acc = acc * (tl.load(ge + offs_n * s_gn) * gain)[:, None]
        if SWIGLU:
            acc_up = acc_up * (tl.load(ge + (offs_n + n_out) * s_gn) * gain)[:, None]
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if HAS_ROW_SCALE:
            acc = acc * tl.load(rs + pairs, mask=p_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y + pairs[None, :] * s_ym + offs_n[:, None], acc.to(y.dtype.element_ty), mask=p_ok[None, :])


def w4a16_grouped_swapped_launch(x: torch.Tensor, packed_split: torch.Tensor, scales: torch.Tensor,
                                 global_scale: torch.Tensor, routing: MoeRouting, *, a_div: int = 1,
                                 swiglu: bool = False, row_scale: torch.Tensor | None = None,
                                 block_n: int = SPLIT_TILE[0], block_k: int = SPLIT_TILE[1],
                                 config: dict | None = None, deq: int = 2, unverified: bool = False,
                                 frag: bool = False, split: int = 1, settle: bool = True) -> torch.Tensor:
    """`w4a16_gemm.w4a16_grouped_launch`'s contract on split-halves weights: y[p] = f(x[p // a_div] @ W[e_p]^T) *
    row_scale[p]. x [R, K] (unit k stride); packed_split [E, N, K/2] from `split_halves(packed, block_n, block_k)`;
    scales [E, N, K/16] e4m3; global_scale [], [E] or [E, N] -> y [P, N (N/2 with swiglu)] in x.dtype. `frag`: the
    bytes are `split_frag`'s (fragment order) instead.
    `config`: BLOCK_N (a multiple of block_n dividing N_out, of 64 with `frag`; default block_n), num_warps (4: 8 warps
    gave one wrong result on the H200, see DEFAULT_CONFIG's comment; `unverified=True` lets a benchmark try them),
    num_stages (default `default_stages`: FRAG_STAGES for the engine's builds, else 3).
    `settle` (default True): wait for each K tile's wgmma groups before the next tile (`SETTLE`; without it, builds
    raced under Triton 3.6's ptxas: the comment above FRAG_STAGES); False only with `unverified=True` (benchmarks).
    `split` > 1: the K tiles shared among that many programs per output tile, reduced inside the kernel by the last to
    arrive (`split_k`; for decode-sized calls, where a launch has too few tiles to fill the GPU: one token's gate_up is
    8 experts x 8 tiles = 64 programs walking all of K). Same result as split 1 up to the fp32 summation order of the
    partials (split order, deterministic). Falls back to 1 where no counters can be had (`split_counters`: more tiles
    than SPLIT_COUNTERS, or a first use inside a CUDA-graph capture). H200 (2026-12-01): its GPU tests pass; in the
    engine without the dual copy, split K at <= 4 tokens moved lone decode -0.1% to +1.0% (Qwen run 32), so the
    engine keeps it off (`DECODE_SPLIT`)."""
    if triton is None:
        raise RuntimeError("w4a16_grouped_swapped_launch needs triton")
    e, n, kh = packed_split.shape
    k = 2 * kh
    n_out = n // 2 if swiglu else n
    kind = "dense" if routing.block_expert is None else "swiglu" if swiglu else "plain"
    cfg = {**DEFAULT_CONFIG, "num_stages": default_stages(routing.block_m, frag, deq, kind), **(config or {})}
    bn = cfg.pop("BLOCK_N", block_n)
    if x.shape[-1] != k or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} (strides {x.stride()}) does not match weights of K = {k}")
    if n_out % bn or bn % block_n or k % block_k or block_k % (2 * BLOCK) or (swiglu and n % 2):
        raise ValueError(f"BLOCK_N {bn} must be a multiple of the stored tile's {block_n} rows and divide N_out "
                         f"{n_out}; block_k {block_k} must divide K {k} and be a multiple of {2 * BLOCK}")
    if frag and bn % 64:
        raise ValueError(f"frag: BLOCK_N {bn} must be a multiple of 64: the dequant's words are the wgmma A operand's "
                         "(rows r and r + 8 of a 64-row warpgroup tile, `_word_elements`); narrower programs give the "
                         "asm other bytes (H200, words_run2)")
    if cfg.get("num_warps") != 4 and not unverified:
        raise ValueError(f"num_warps {cfg.get('num_warps')}: only 4 warps (one warpgroup) are verified on a GPU "
                         "(8 warps gave 4.5e-2 relative error in one configuration: RESULTS.md, the swap-AB kernel)")
    if not settle and not unverified:
        raise ValueError("settle=False: builds without SETTLE gave nondeterministic results on the H200 under Triton "
                         "3.6's ptxas (the comment above FRAG_STAGES); only with unverified=True (benchmarks)")
    if deq == 2 and _interpreted():
        deq = 1  # the interpreter has no PTX; `_dequant_halves` runs one fp32 emulation of modes 1 and 2 anyway
    g, s_ge, s_gn = _global_2d(global_scale, e, n)
    interp = _interpreted()
    out_dtype = torch.float32 if interp else x.dtype  # the interpreter truncates fp32 -> bf16: torch rounds
    if isinstance(split, bool) or not isinstance(split, int) or not 1 <= split <= k // block_k:
        raise ValueError(f"split must be an int in 1..{k // block_k} (the K tiles), got {split!r}")
    y = torch.empty((routing.num_pairs, n_out), dtype=out_dtype, device=x.device)
    if routing.num_pairs == 0:
        return y.to(x.dtype)
    sc = scales.view(torch.uint8)
    rs = row_scale.reshape(-1) if row_scale is not None else g  # any tensor when HAS_ROW_SCALE is off
    dense = routing.sorted_pairs is None  # `dense_routing`
    if dense and e != 1:
        raise ValueError(f"a dense routing needs one expert, got {e}")
    grid = (triton.cdiv(routing.num_pairs, routing.block_m) if dense else routing.block_expert.numel(), n_out // bn)
    split, counters = effective_split(split, k // block_k, grid[0] * grid[1], x.device)
    ws = (torch.empty((split, grid[0] * grid[1], 2 if swiglu else 1, bn, routing.block_m), dtype=torch.float32,
                      device=x.device) if split > 1 else g)  # any tensor when SPLIT is 1
    _w4a16_grouped_swapped_kernel[grid + (split,)](
        x, packed_split, sc, g, rs, y, y if dense else routing.sorted_pairs, y if dense else routing.block_expert,
        routing.num_pairs, n, k, e, a_div,
        x.stride(0), packed_split.stride(0), sc.stride(0), sc.stride(1),
        s_ge, s_gn, y.stride(0), ws, counters if counters is not None else g, SPLIT=split, SWIGLU=swiglu,
        HAS_ROW_SCALE=row_scale is not None, INTERPRET=interp, DEQ=deq,
        TILE_N=block_n, BLOCK_M=routing.block_m, BLOCK_N=bn, BLOCK_K=block_k, FRAG=frag, DENSE=dense, SETTLE=settle,
        **cfg,
        **pdl.launch_options())
    return y.to(x.dtype)


# ---- dense calls on fragment-order weights: lm_head (registry op "w4a16_linear_frag") ------------------------------
# lm_head (NVFP4 [248,320, 2048], 286 MB) as a one-expert swap-AB launch (`dense_routing`) on its bytes in fragment
# order. H200 (benchmarks/lm_head_bench.py, results/lm_head_bench_run1, 2026-12-02, per call in CUDA graphs, PDL on):
# 1 row 142-143 us against the decode GEMV's 198 (2.0 against 1.4 TB/s); 2-16 rows 141-145 against the dense
# tensor-core kernel's 330-333; 32 rows 165 against 390. BLOCK_N 128 / 256 were slower (255-290 us), 4 stages equal
# to 3. The layout is the module's (`qwen_engine.model.quantized.NVFP4Linear.repack_frag`).
FRAG_DENSE = "w4a16_linear_frag"
FRAG_DENSE_TILES = ((64, 128), (64, 64))  # stored (rows, K) tiles, the first that divides the weight is used


def frag_dense_tile(n: int, k: int) -> tuple[int, int] | None:
    """The stored tile of a dense [N, K] weight in fragment order: the first of FRAG_DENSE_TILES dividing it (the
    full-size lm_head takes the experts' SPLIT_TILE; the tiny test model's K = 64 the second), or None."""
    return next(((bn, bk) for bn, bk in FRAG_DENSE_TILES if n % bn == 0 and k % bk == 0), None)


def _frag_tile_of(w: NVFP4Tensor) -> tuple[int, int]:
    n, kh = w.packed.shape
    tile = frag_dense_tile(n, 2 * kh)
    if tile is None:
        raise ValueError(f"w4a16_linear_frag: a [{n}, {2 * kh}] weight splits into none of the tiles "
                         f"{FRAG_DENSE_TILES}")
    return tile


def linear_to_frag(w: NVFP4Tensor, inverse: bool = False) -> NVFP4Tensor:
    """A dense checkpoint-layout NVFP4 weight [N, K] into fragment order at `frag_dense_tile` (or back, `inverse`);
    block and global scales stay."""
    f = unsplit_frag if inverse else split_frag
    return NVFP4Tensor(f(w.packed, *_frag_tile_of(w)), w.scales, w.global_scale)


def w4a16_linear_frag_reference(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """`kernels.nvfp4.w4a16_linear_reference` of the weight `w` holds in fragment order (`linear_to_frag`)."""
    from kernels.nvfp4 import w4a16_linear_reference

    return w4a16_linear_reference(x, linear_to_frag(w, inverse=True))


def _frag_dense_launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                       swiglu: bool = False) -> torch.Tensor:
    """x [M, K] (unit inner stride) @ W^T -> [M, N], W [N, K] in fragment order: one swap-AB launch, the M rows as
    the pairs of one expert (16 per program up to 16 rows, 32 up to 32, then 64), BLOCK_N = the stored tile's 64
    rows, `default_stages` (FRAG_STAGES), SETTLE. `w4a16_gemm._dense_any_rank`'s launcher signature (no SwiGLU)."""
    if swiglu:
        raise ValueError("w4a16_linear_frag: no SwiGLU epilogue")
    n = packed.shape[0]
    bn, bk = _frag_tile_of(NVFP4Tensor(packed, scales, global_scale))
    m = x.shape[0]
    if m == 0:
        return x.new_empty(0, n)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    return w4a16_grouped_swapped_launch(x, packed[None], scales[None], g.reshape(1, -1) if g.dim() else g,
                                        dense_routing(m, block_m), block_n=bn, block_k=bk, frag=True)


def w4a16_linear_frag_triton(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x.dtype, W in fragment order (`_frag_dense_launch` over x's leading dims).
    Same numbers as `w4a16_linear_reference` up to fp32 summation order."""
    from kernels.w4a16_gemm import _dense_any_rank

    return _dense_any_rank(x, *w, swiglu=False, launch=_frag_dense_launch)


def describe_frag_dense(x: torch.Tensor, w: NVFP4Tensor) -> dict:
    """`supports_frag_dense`'s facts of a call."""
    from kernels.w4a16_gemm import _capability

    n, kh = w.packed.shape
    return dict(device=x.device.type, capability=_capability(x), dtype=x.dtype,
                tile_ok=frag_dense_tile(n, 2 * kh) is not None and x.shape[-1] == 2 * kh)


def supports_frag_dense(*, device: str, capability, dtype: torch.dtype, tile_ok: bool, **_) -> bool:
    """Compiled Triton (or the interpreter) on an sm_90+ GPU (`frag_capability_ok`), bf16 / fp16 activations, a weight
    that splits."""
    from kernels.w4a16_gemm import ACT_DTYPES, _device_ok

    return _device_ok(device, capability) and frag_capability_ok(device, capability) and dtype in ACT_DTYPES and tile_ok


def _sample_frag_dense(device) -> tuple[tuple, dict]:
    from kernels.nvfp4 import quantize_nvfp4

    g = torch.Generator().manual_seed(0)
    w = quantize_nvfp4(torch.randn(128, 256, generator=g) * 0.02)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    return (x.to(device), linear_to_frag(NVFP4Tensor(*(t.to(device) for t in w)))), {}


def register_frag_dense(registry) -> None:
    """Op "w4a16_linear_frag" (called from `w4a16_gemm.register`): reference and "triton" (the swap-AB launch)."""
    from kernels.w4a16_gemm import compare

    registry.add_op(FRAG_DENSE, w4a16_linear_frag_reference, sample=_sample_frag_dense, compare=compare,
                    describe=describe_frag_dense,
                    tolerance="max |diff| <= 1e-2 x max |ref| (as w4a16_linear: exact dequant, fp32 accumulation, "
                              "only summation order differs)")
    registry.add_implementation(FRAG_DENSE, "triton", w4a16_linear_frag_triton, supports_frag_dense)
