"""Routed NVFP4 W4A16 experts at decode sizes with the weights streamed straight into registers (Gluon, Hopper):
the engine's decode-sized expert calls on sm_90 (`QwenEngineConfig.expert_regs`, "auto") instead of
`kernels/w4a16_swapped.py` (same routing contract, same exact dequant, same wgmma K order: bit for bit its outputs).
H200, 2026-12-05: its CUDA tests pass (60); per call at 32 tokens gate_up 60.0 against 79.7 us and down 31.5 against
47.1 us (ENGINE_BUILDS); the engine at 32 streams 4,270.5-4,285.4 against 3,591.2-3,601.8 tok/s, the same tokens
(benchmarks/RESULTS.md, forty-third session). Gluon has no CPU interpreter: `tests/test_kernel_w4a16_regs.py` checks
its layout and offline sm_90 compile on the CPU and its results on CUDA.

Why. At 32 streams each routed expert sees ~1.6 tokens, so the expert calls are a dequant stream: every weight is
loaded, decoded and multiplied once per program. The swap-AB kernel routes each weight tile through shared memory
(cp.async, then ldmatrix in the wgmma A operand's register layout, then two PRMTs a word to rebuild the decode's
input) and waits on three CTA barriers a K tile (the pipeline's and two for the block scales' layout change); ncu at
32 tokens: 48% of HBM, occupancy 36%, stalls short scoreboard / MIO throttle / long scoreboard / barrier
(RESULTS.md, fortieth session). Here each thread loads its own weight words with two 16-byte loads a K tile, in the
order the wgmma A fragment wants them (`thread_order`), so the decode's output registers ARE the fragment
(`gl.convert_layout(..., assert_trivial=True)` proves it at compile time): no shared memory, no barrier, no PRMT for
the weights. The gathered activations of the row block ([BLOCK_M, K] bf16, 64 KB for gate_up) are copied into
shared memory once per program by one run of cp.async (`stacked_tiles_layout`: all K tiles in flight at once, no
barrier between them), the wgmma B operand of every K tile. Block scales stay in the checkpoint layout: each lane of a
quad (the four lanes that share rows r and r + 8) loads one 4-byte word of them a K tile, converts it and takes the
other three lanes' by warp shuffles. Words and scales are loaded AHEAD (1 or 2) K tiles ahead into registers, each
buffer reloaded in place right after its decode (`_k_tile`); optionally the words are also prefetched L2_AHEAD K
tiles ahead into L2 (one bulk prefetch a trip), since ptxas issues the register loads late (below).

Stored layout ("thread order"): tiles of THREAD_TILE = 64 weight rows x 128 K, each 4 KB contiguous, ordered
[E][N / 64][K / 128]. Within a tile, byte (s_hi, w, i, c, s_lo, e) at s_hi * 2048 + (32 w + 4 i + c) * 16 + 4 s_lo + e
-- thread 32 w + 4 i + c of the warpgroup holds 2 x 16 contiguous bytes -- is, before the word scramble, the plain byte
    code(row, k) | code(row, k + 8) << 4,   row = 16 w + 8 (e // 2) + i,   k = 16 (4 s_hi + s_lo) + 2 c + e % 2
(wgmma's A fragment: thread lane 4 i + c of warp w holds rows 16 w + i, + 8 and k 2c, 2c + 1, + 8, + 9 of each 16-K
step), and every 4 bytes (one word: e = 0..3) are stored for the 8-instruction decode (`w4a16_swapped.frag_words`).

Arithmetic: `_dequant`'s exactly (bf16 code x 2^-126 times the e4m3 block scale x 2^119, exact; the accumulator x 2^7
x the global scale in the epilogue), fp32 accumulation in the swap-AB kernel's order (per K tile its 8 steps of 16,
tiles in order), so the two kernels should agree bit for bit (a CUDA test).

Offline sm_90 SASS (Triton 3.6 and 3.8 alike; `tests/test_kernel_w4a16_regs.py` compiles it), K-loop instructions per K
tile of 128 against the swap-AB kernel's 386 / 226 (`benchmarks/sass_loop.py`; forty-third session): gate_up (SwiGLU,
BLOCK_M 16) **289** at AHEAD 2 (578 a trip of two tiles; 128 registers, 64 KB shared), 292 at AHEAD 1 (108); down
**150** / 154 (72 / 66 registers, 16 KB); 8-row blocks (BLOCK_MS: half the activations' shared memory, so 4-5 gate_up
programs an SM instead of 3) the same counts (128 / 98 and 68 / 62 registers, 32 / 8 KB); L2_AHEAD 4 adds 10 a
gate_up tile (the prefetch and its address; down's K fits in the first prefetch, so nothing in its loop). No
shared-memory load or store and no barrier in the loop; per projection and K tile 2 LDG.128 of words, 1 LDG.32 of
scales, 8 SHFL, 32 + 4 HMUL2, 8 HGMMA. ptxas places the register loads of the next tiles after the wgmmas they were
meant to overlap, whatever the source order, with a 168-register cap too and in a fully unrolled loop (just before
their use there); so the loads' lead is what AHEAD leaves after that (~1 tile at 2) and the L2 prefetch is the knob
for more.
The other knob, RING (`_ring_fill`, `_ring_tile`): each thread cp.asyncs its own words and scale word RING - 1 tiles
ahead into a shared-memory ring and reads them back (2 LDS.128 + 1 LDS) one tile ahead: the loads' lead no longer
depends on ptxas, for 4.5 KB of shared memory a tile and projection (gate_up at RING 4: 100 KB with 16-row blocks, 2
programs an SM; 68 KB with 8-row, 3), 317 / 162 instructions a tile, 2 of them barriers that Triton's
shared-memory hazard analysis adds although no thread reads another's ring words.
How it got there: words loaded as bytes were split into bytes and rebuilt for the decode (638 in gate_up's loop); as
int32, decoded by FRAG_DECODE_PTX's formulas in int32 arithmetic (5 LOP3, 2 SHF, 1 IMAD a word), 449; the scales
then took ~80 PRMT (bytes rebuilt for the PTX conversion, each thread converting all 16 of its scales) -- as words
converted in integer arithmetic, 322 with a layout conversion through shared memory (a barrier back in the loop), 305
with the shuffles, 309 with the first tiles' weight loads ahead of the activations' fill; then (forty-third session)
the fill as one cp.async run instead of 16 load / store / barrier rounds with 2-3 tiles in flight (307), the loads
reloading in place and clamped instead of masked (289), AHEAD 2 as two tiles a trip without the ~27 register moves of
rotating its buffers (335 -> 285), the column loop of COLS (289).
COLS (output column tiles a program, streamed as one run of COLS x KT tiles): down's programs stream 4 K tiles each,
so their prologue -- three dependent round trips before the first wgmma -- and the sentinel blocks' empty programs
weigh; COLS 4 has 4x fewer of both, for ~15 more instructions a down tile and 96 registers (72).
Whether a loop with more occupancy-bound latency but no barrier or shared-memory weight traffic streams faster is the
GPU's to say (`gpu_next.sh` step 161).
Forty-fourth session (offline sm_90 SASS, Triton 3.6; not yet timed): the shipped builds stream at ~3 TB/s (gate_up
184 MB in 60 us, down 94 MB in 31.5 us at 32 tokens), far below what their instruction issue would allow (~40% of an
SM's issue slots at that rate), so they are latency-bound: bytes in flight an SM are what to raise. AHEAD 4 (four
buffers, four tiles a trip) holds 4 x 8 KB in flight a gate_up program at 168 registers (3 programs an SM: 96 KB
against 4 x 16 KB), the same 289 instructions a tile; down's 4 K tiles then all load up front (its dead reloads
dropped by ptxas). `maxnreg` caps registers for more programs an SM (gate_up AHEAD 2 at 96: 93 registers, 5
programs; ptxas then serializes the wgmmas, +59 instructions a trip). EARLY targets the tail of gate_up's 2.5 waves
of programs: under PDL the down grid becomes resident as gate_up's last programs start, and with EARLY its programs
load their routing and first tiles' weights before waiting, so their DRAM reads fill the SMs gate_up's tail leaves
idle (`gpu_next.sh` steps 166-167 time all three).
Forty-fifth session (offline; then timed on the H200 per call at 32 tokens: gate_up 58.97 against 59.68 us, down
33.2 against 31.8 -- no gain; benchmarks/RESULTS.md): the routing's sentinel row blocks. The grid has R / BLOCK_M row
blocks for R = the alignment's upper bound on rows (a function of the shapes only, for CUDA graphs): at 32 streams (288
pairs over 257 experts, 8-row blocks) 261, of which ~166 hold pairs. The rest exit at once, but in the default grid
order (row blocks the fast axis) each column tile's sweep ends with them, so their ~95 empty programs a column tile
(760 a gate_up call, 3,040 a down call) are dispatched among the real ones and take SM slots while real programs
wait. COLUMN order (`cols_first`: the grid (column tiles, row blocks), a row block's column tiles adjacent) puts every
empty program at the end of the grid, after all real work is dispatched, where they run in the tail's free slots; a
row block's column tiles (one expert, the same activations) then also run together. The same programs and the same
bits in either order (`gpu_next.sh` step 166 times it).
Sixty-sixth session (offline sm_90, Triton 3.6; not yet timed): MMA_V2, the products on mma.sync m16n8k16 instead of
wgmma. Per warp the wgmma A fragment and mma.sync's are the same registers (the decode's `assert_trivial`
conversion holds for both), so only the MMA changes: the activations' K tile comes into registers by ldmatrix (4 a
tile, shared by gate and up) and each warp issues 8 HMMA a projection and K tile. No asynchronous MMA then holds the
decoded fragments, so they die as each HMMA issues: gate_up at AHEAD 2 needs 80 registers against 128 (6 programs an
SM against 4: half as many bytes in flight again), 60 at AHEAD 1 (98), 128 at AHEAD 4 (168); down 66 / 64 at AHEAD
2 / 4 (68 / 71); 555 loop instructions a gate_up trip of two tiles against 577. ptxas still issues the next tiles'
loads at the end of the trip (a relaxed gpu-scope v4 load, which it may not move past other memory operations,
ends up there too), so the lever is occupancy, not the loads' lead (`gpu_next.sh` step 199 times it).
Sixty-seventh session (H100, results/h100_67_run1-2): its CUDA tests (`-k "mma_v2 and not builds"`, 20) pass, and
every mma_v2 build timed at 32 tokens gave bit for bit the swap-AB kernel's outputs, as the wgmma builds do.
Occupancy did not pay: per call at 32 tokens gate_up at AHEAD 2 78.64 against wgmma's 72.65 us; only AHEAD 4 on
both projections beats the shipped pair (71.60 + 36.55 against 72.65 + 36.89 us, -1.3%), and the engine on it ran
32 streams at 3,932.5 / 3,929.8 against 3,893.0 tok/s (two processes). Off until the H200 says so (`gpu_next.sh`
step 200: side by side in one process).
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.nvfp4 import BLOCK, NVFP4Tensor, pack_e2m1, unpack_e2m1
from kernels.w4a16_gemm import MoeRouting, _global_2d
from kernels.w4a16_swapped import E2M1_BF16_MASK, FRAG_O3, FRAG_ROTATIONS, frag_words

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
except ImportError:  # no Triton, or one without Gluon (< 3.5): the layout helpers still work
    gluon = None

THREAD_TILE = (64, 128)  # (weight rows, K) of a stored tile: one warpgroup's wgmma M x one K tile
BLOCK_M = 8  # routed rows per program (the wgmma's N) of the engine's calls (`w4a16_gemm.w4a16_moe_op`; H200 sweep)
BLOCK_MS = (8, 16)  # the launcher's: 8 halves the activations' shared memory (gate_up: 32 KB, 4 programs an SM)
MAX_K = 2048  # the activations' shared-memory block, BLOCK_M x K bf16: 64 KB at Qwen's hidden size
AHEAD = 2  # the launcher's default K tiles of words in registers ahead (1 where the K tiles are odd in number)
L2_AHEAD = 0  # the launcher's default K tiles of words prefetched into L2 ahead (0: none)
RING = 0  # the launcher's default cp.async ring depth for words and scales (0: none, straight into registers)
COLS = 1  # the launcher's default output column tiles of 64 a program
# the engine's builds per projection (`w4a16_gemm.w4a16_moe_op`'s THREAD_ORDER branch; None = the defaults above):
# the fastest of `benchmarks/swapped_ab.py --regs` on the H200 (2026-12-05, regs_ab run 1, 32 tokens, every build bit
# for bit the swap-AB kernel's outputs): 8-row blocks, gate_up AHEAD 2 60.0 us (swap-AB 79.7), down AHEAD 2 with the
# L2 prefetch 4 tiles ahead 31.5 us (swap-AB 47.1). Down is now AHEAD 4 (all 4 of its K tiles loaded up front), no L2
# prefetch: regs_ab45 run 1 (H200, forty-fifth session) 29.5 against 31.8 us a call; the engine (attn_tiles47 run 2,
# an H100 on the H200's autotune picks, forty-seventh session) 32 streams 3,642.8 against 3,623.0 / 3,625.8 tok/s and
# 3,623.7 against 3,607.4 on the attention's old tiles (+0.5%, two processes), the same greedy tokens lone and on all
# 32 streams; `fit_build` takes ahead 2 where a call has 2 K tiles (the start-up self-check's sample)
ENGINE_BUILDS = {"gate_up": dict(ahead=2, l2_ahead=0, ring=0, cols=1),
                 "down": dict(ahead=4, l2_ahead=0, ring=0, cols=1)}


# ---- the stored layout (host) ---------------------------------------------------------------------------------------
def _tiles(codes: torch.Tensor) -> torch.Tensor:
    """codes [E, N, K] -> [E, N/64, K/128, w 4, rh 2, i 8, s_hi 2, s_lo 4, kh 2, c 4, kl 2]: each tile's (row, k)
    with row = 16 w + 8 rh + i and k = 16 (4 s_hi + s_lo) + 8 kh + 2 c + kl."""
    e, n, k = codes.shape
    bn, bk = THREAD_TILE
    t = codes.view(e, n // bn, 4, 2, 8, k // bk, 2, 4, 2, 4, 2)  # e, rt, w, rh, i, kt, s_hi, s_lo, kh, c, kl
    return t.permute(0, 1, 5, 2, 3, 4, 6, 7, 8, 9, 10)


def thread_order(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint-layout packed weights [E, N, K/2] (or [N, K/2]) -> the same bytes in thread order (the module
    docstring); N a multiple of 64, K of 128."""
    flat = packed.dim() == 2
    p = packed.unsqueeze(0) if flat else packed
    e, n, kh = p.shape
    bn, bk = THREAD_TILE
    if n % bn or (2 * kh) % bk:
        raise ValueError(f"thread_order: [{e}, {n}, {2 * kh}] weights do not split into {bn} x {bk} tiles")
    t = _tiles(unpack_e2m1(p))  # [E, RT, KT, w, rh, i, s_hi, s_lo, kh, c, kl]
    plain = t.select(8, 0) | (t.select(8, 1) << 4)  # [E, RT, KT, w, rh, i, s_hi, s_lo, c, kl]
    plain = plain.permute(0, 1, 2, 6, 3, 5, 8, 7, 4, 9)  # [E, RT, KT, s_hi, w, i, c, s_lo, rh, kl]: e = 2 rh + kl
    out = frag_words(plain.contiguous().view(-1, 4)).view(e, n, kh)
    return out[0] if flat else out


def kernel_codes(stored: torch.Tensor) -> torch.Tensor:
    """The kernel's reading of thread-order bytes [E, N, K/2], mirrored in torch op for op: each 4 KB tile viewed as
    [s_hi, w, i, c, s_lo, e], the words unscrambled (the decode), low / high nibbles as k and k + 8 (lo, hi), e split
    into (rh, kl), lo and hi joined as kh, permuted to [w, rh, i, s_hi, s_lo, kh, c, kl] and read as [64, 128]
    -> codes [E, N, K]. The CPU test that this equals the checkpoint's codes checks the kernel's index chain."""
    e, n, kh = stored.shape
    bn, bk = THREAD_TILE
    rt, kt = n // bn, 2 * kh // bk
    u = frag_words(stored.contiguous().view(-1, 4), inverse=True).view(e, rt, kt, 2, 4, 8, 4, 4, 4)
    lo, hi = (u & 0xF).view(e, rt, kt, 2, 4, 8, 4, 4, 2, 2), (u >> 4).view(e, rt, kt, 2, 4, 8, 4, 4, 2, 2)
    a = torch.stack((lo, hi), -1)  # [.., s_hi, w, i, c, s_lo, rh, kl, kh]  (gl.join: the new axis last)
    a = a.permute(0, 1, 2, 4, 8, 5, 3, 7, 10, 6, 9)  # [.., w, rh, i, s_hi, s_lo, kh, c, kl]
    a = a.reshape(e, rt, kt, bn, bk).permute(0, 1, 3, 2, 4)  # [E, RT, 64, KT, 128]
    return a.reshape(e, n, 2 * kh)


def kernel_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """The block scale the kernel applies to each weight, mirrored in torch op for op (`_scale_offsets`, `_scales`):
    e4m3 bytes [E, N, K/16] -> float32 [E, N, K] (the bf16 scale x 2^119 the kernel multiplies by, / 2^119). Per
    (row tile, K tile), lane 4 i + c of warp w reads the word f = 32 w + 4 i + c (row 16 w + 8 (c // 2) + i, blocks
    4 (c % 2) ..), builds two bf16 pairs from its bytes with integer masks and shifts, joins them as [f, h, j] and
    permutes to [f, j, h] (byte 2 j + h), takes its quad's four words j' = 0..3 by shuffles, joins them as
    [f, s_lo, j' % 2, j' // 2], reads that as [s_hi, w, i, c, s_lo, rh], joins it with itself for kl and multiplies
    it into `kernel_codes`' [s_hi, w, i, c, s_lo, rh, kl] before the same permute to [64, 128]. The CPU test that this
    equals scales[row, k // 16] checks the scale side's bit formulas and index chain."""
    e, n, kb = scales.shape
    bn, bk = THREAD_TILE
    rt, kt = n // bn, kb * BLOCK // bk
    words = scales.contiguous().view(torch.uint8).view(torch.int32).view(e, rt, 4, 2, 8, kt, 2)  # w, rh, i, t, s_hi
    wd = words.permute(0, 1, 5, 2, 4, 3, 6).reshape(e, rt, kt, 128).to(torch.int64) & 0xFFFFFFFF  # f = 32w+4i+c
    p01 = ((wd << 4) & 0x7F0) | ((wd << 12) & 0x7F00000)
    p23 = ((wd >> 12) & 0x7F0) | ((wd >> 4) & 0x7F00000)

    def halves(p):  # int32 bf16 pairs -> [.., 2] values (the low half first)
        bits = torch.stack((p & 0xFFFF, p >> 16), -1)
        return (bits << 16).to(torch.int32).view(torch.float32)  # a bf16's bits are an fp32's top half

    v = torch.stack((halves(p01), halves(p23)), -1).transpose(-1, -2).reshape(e, rt, kt, 128, 4)  # [f, s_lo]
    v = v * 2.0**120 * 2.0**119  # the kernel's two bf16 products: exact, as here in fp32
    v = v.view(e, rt, kt, 4, 8, 4, 4)  # [.., w, i, c, s_lo]
    o = [v[..., j:j + 1, :].expand(v.shape) for j in range(4)]  # o_j: lane quad + j's words, every c
    q = torch.stack((torch.stack((o[0], o[1]), -1), torch.stack((o[2], o[3]), -1)), -1)  # [.., s_lo, j % 2, j // 2]
    q = q.permute(0, 1, 2, 7, 3, 4, 5, 6, 8)  # [.., s_hi, w, i, c, s_lo, rh]
    q = torch.stack((q, q), -1)  # [.., rh, kl]
    a = torch.stack((q, q), -1)  # lo and hi (kh) take the same scale
    a = a.permute(0, 1, 2, 4, 8, 5, 3, 7, 10, 6, 9)  # `kernel_codes`' permute: [.., w, rh, i, s_hi, s_lo, kh, c, kl]
    return a.reshape(e, rt, kt, bn, bk).permute(0, 1, 3, 2, 4).reshape(e, n, kb * BLOCK) * 2.0**-119


def unthread_order(stored: torch.Tensor) -> torch.Tensor:
    """The inverse of `thread_order` (through `kernel_codes`)."""
    flat = stored.dim() == 2
    s = stored.unsqueeze(0) if flat else stored
    c = kernel_codes(s)
    out = pack_e2m1(c).contiguous()
    return out[0] if flat else out


def experts_thread_order(w13: NVFP4Tensor, w2: NVFP4Tensor,
                         inverse: bool = False) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """Both expert stacks in thread order (or back to the checkpoint's with `inverse`); block and global scales stay
    in the checkpoint layout (`kernels.w4a16_gemm.experts_repack`'s THREAD_ORDER)."""
    f = unthread_order if inverse else thread_order
    return tuple(NVFP4Tensor(f(w.packed), w.scales, w.global_scale) for w in (w13, w2))


def stacked_tiles_layout(block_m: int, kt: int):
    """The shared layout of the activations' [KT, BLOCK_M, 128] bf16 block as KT stacked 4 KB tiles, each in the
    128-byte-swizzled layout of the wgmma B operand (`NVMMASharedLayout(128, 16, rank=2)` of [BLOCK_M, 128]: k bits
    1..32, then rows 1, 2, 4 XOR-swizzled into k 8, 16, 32, row 8 when BLOCK_M is 16, k 64), then the tile index.
    One cp.async op fills it whole (no barrier between tiles, which per-tile copies get); the kernel reinterprets it
    as the rank-2 NVMMA layout of each tile. (A rank-3 NVMMA layout is not this: it puts each 64-k half of all
    tiles together.) kt a power of two."""
    if kt & (kt - 1) or block_m not in BLOCK_MS:
        raise ValueError(f"stacked_tiles_layout: {kt} K tiles (a power of two) of {block_m} rows (one of {BLOCK_MS})")
    tile = [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32], [1, 8], [2, 16], [4, 32]]
    tile += [[8, 0]] * (block_m == 16) + [[0, 64]]
    bases = [[0] + b for b in tile] + [[1 << i, 0, 0] for i in range(kt.bit_length() - 1)]
    return gl.SharedLinearLayout(offset_bases=bases, block_bases=[], alignment=1024)


# ---- Gluon kernel ---------------------------------------------------------------------------------------------------
if gluon is not None:
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # the name in Triton >= 3.7 / 3.6
    # the kernel's layouts: a tile's int32 words as loaded (thread t: words 4 t .. 4 t + 3 and 512 + 4 t ..,
    # `_word_offsets`), a K tile's 128 scale words (lane f % 32 of warp f // 32, `_scale_offsets`), and the
    # activations' [KT, BLOCK_M, 128] bf16 gather (`_fill_activations`; the routing's pairs in its slice)
    _WORDS_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[1], [2], [512]],
                                                            lane_bases=[[4], [8], [16], [32], [64]],
                                                            warp_bases=[[128], [256]], block_bases=[], shape=[1024]))
    _SCALE_WORDS_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[], lane_bases=[[1], [2], [4], [8], [16]],
                                                                  warp_bases=[[32], [64]], block_bases=[],
                                                                  shape=[128]))
    _X_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1, 8], [1, 2, 16], [1, 4, 1], [2, 1, 0]))
    _MASK = gl.constexpr(E2M1_BF16_MASK)  # `frag_decode_word`'s constants
    _ROT1, _ROT2 = gl.constexpr(FRAG_ROTATIONS[0]), gl.constexpr(FRAG_ROTATIONS[1])
    _O3_BITS, _O3_MUL = gl.constexpr(FRAG_O3[0]), gl.constexpr(FRAG_O3[1])
    _TWO_120, _TWO_119 = gl.constexpr(2.0**120), gl.constexpr(2.0**119)
    _PREFETCH_L2_ONCE = gl.constexpr(pdl.PREFETCH_L2_ONCE_PTX)

    @gluon.jit
    def pdl_enter(USE_PDL: gl.constexpr):
        """`kernels.pdl.enter` in Gluon: with USE_PDL, wait for the predecessor grid (griddepcontrol.wait) before any
        memory access, then let the successor be scheduled (launch_dependents); nothing without it."""
        if USE_PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _prefetch_l2_once(addr, nbytes):
        """`kernels.pdl.prefetch_l2_once` in Gluon: one bulk L2 prefetch of [addr, addr + nbytes) (int64 address,
        int32 bytes, a multiple of 16; nothing when <= 0) by the program's thread 0 only."""
        gl.inline_asm_elementwise(_PREFETCH_L2_ONCE, "=r,l,r", [addr, nbytes], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _prefetch_l2_lines(ptrs):
        """prefetch.global.L2 of the line holding each element of `ptrs` (one element a thread, no result)."""
        gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _prefetch_tiles(wt, up_bytes, t0, n: gl.constexpr, GT: gl.constexpr, SWIGLU: gl.constexpr):
        """L2 prefetch of the program's weight tiles t0 .. t0 + n - 1 of its stream (those below GT; 4 KB each,
        contiguous from `wt`, an int64 byte address), and of the up projection's, `up_bytes` further, with SWIGLU."""
        nb = gl.maximum(gl.minimum(GT - t0, n), 0) * 4096
        _prefetch_l2_once(wt + t0 * 4096, nb)
        if SWIGLU:
            _prefetch_l2_once(wt + up_bytes + t0 * 4096, nb)

    @gluon.jit
    def _load_now(ptrs):
        """int32 loads issued here: ptxas sinks a plain load below the branch that uses it (even past an EXIT), a
        relaxed gpu-scope one (LDG.E.STRONG.GPU, from L2 like a first read) it may not."""
        return gl.inline_asm_elementwise("ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _halves(o):
        """int32 [..] holding bf16 pairs -> bf16 [.., 2] (the low half first): a relabelling, no instruction."""
        lo = (o & 0xFFFF).to(gl.uint16).to(gl.bfloat16, bitcast=True)
        hi = (o >> 16).to(gl.uint16).to(gl.bfloat16, bitcast=True)
        return gl.join(lo, hi)

    @gluon.jit
    def _decode(u):
        """Stored words (int32) -> (lo, hi) [.., 4] bf16 code x 2^-126: lo[e] the low nibble of the word's plain byte
        e, hi[e] its high nibble -- `w4a16_swapped.frag_decode_word`'s four registers (FRAG_DECODE_PTX's formulas
        in int32 arithmetic, so that each word stays one register from the load to the wgmma)."""
        w = u.to(gl.uint32, bitcast=True)
        o0 = w & _MASK
        o1 = ((w << _ROT1) | (w >> (32 - _ROT1))) & _MASK
        o2 = ((w << _ROT2) | (w >> (32 - _ROT2))) & _MASK
        o3 = ((w & _O3_BITS) * _O3_MUL) & _MASK
        lo = gl.permute(gl.join(_halves(o0), _halves(o1)), (0, 1, 2, 3, 4, 6, 5))  # [.., s_lo, rh, kl]
        hi = gl.permute(gl.join(_halves(o2), _halves(o3)), (0, 1, 2, 3, 4, 6, 5))
        return lo, hi

    @gluon.jit
    def _word_offsets():
        """int32-word offsets within a 4 KB tile in the load's layout: thread t's two 16-byte runs, words 4 t.. and
        512 + 4 t.. (registers: the 4 words, then the second run; lanes and warps: t)."""
        return gl.arange(0, 1024, layout=_WORDS_LAYOUT)

    @gluon.jit
    def _scale_offsets(s_wn):
        """[w 4, i 8, rh 2, s_hi 2] int32-word offsets of a program's block scales for one K tile: lane 4 i + c of
        warp w loads the word of row 16 w + 8 rh + i (c = 2 rh + s_hi) holding blocks 4 s_hi .. + 3 of the tile, so a
        quad loads its two rows' 16 scales once (`s_wn`: words per weight row, K / 64)."""
        f = gl.arange(0, 128, layout=_SCALE_WORDS_LAYOUT)  # w * 32 + i * 4 + rh * 2 + s_hi
        return ((f // 32) * 16 + (f // 2 % 2) * 8 + f // 4 % 8) * s_wn + f % 2

    @gluon.jit
    def _from_lane(v, src):
        """v [.., 4] bf16 (two registers a thread) as held by lane `src` (int32, v's shape) of the warp (shfl.sync.idx;
        every lane of the warp executes it). The result's labels stay the caller's: it relabels them."""
        return gl.inline_asm_elementwise(
            "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r,r", [v, src], dtype=gl.bfloat16,
            is_pure=True, pack=2)

    @gluon.jit
    def _scales(b, like):
        """Scale words [128] (`_scale_offsets`) -> scale x 2^119 as bf16 [s_hi, w, i, c, s_lo, rh, kl] in the layout
        of the decoded weights (`like`, the same shape). Each lane converts its own 4 bytes: (byte & 0x7F) << 4 is
        scale x 2^-120 as bf16 bits (subnormals included), two exact products by powers of two make it scale x 2^119
        (`w4a16_swapped._e4m3_bf16_gained`'s arithmetic); then each lane takes the quad's four converted words by warp
        shuffles (`_from_lane`; a layout conversion went through shared memory and a barrier). The values do not
        depend on c or kl."""
        w = b.to(gl.uint32, bitcast=True)
        p01 = ((w << 4) & 0x7F0) | ((w << 12) & 0x7F00000)  # bytes 0, 1 as the halves' bf16 bits
        p23 = ((w >> 12) & 0x7F0) | ((w >> 4) & 0x7F00000)  # bytes 2, 3
        v = gl.permute(gl.join(_halves(p01), _halves(p23)), (0, 2, 1))  # [f, j, h]: byte s_lo = 2 j + h
        v = gl.reshape(v, [128, 4])  # [f, s_lo]
        v = v * _TWO_120  # bf16 products by powers of two: exact
        v = v * _TWO_119
        lane = gl.arange(0, 128, layout=b.type.layout) % 32  # this thread's lane
        quad = gl.permute(gl.join(gl.join(lane, lane), gl.join(lane, lane)), (0, 2, 1))  # v's chain: its layout
        quad = gl.reshape(quad, [128, 4]) // 4 * 4
        o0, o1 = _from_lane(v, quad), _from_lane(v, quad + 1)  # o_j: lane j's words of the quad, [f, s_lo]
        o2, o3 = _from_lane(v, quad + 2), _from_lane(v, quad + 3)
        q = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [f, s_lo, s_hi, rh]: j = 2 rh + s_hi
        q = gl.permute(gl.reshape(q, [4, 8, 4, 4, 2, 2]), (4, 0, 1, 2, 3, 5))  # [s_hi, w, i, c, s_lo, rh]
        return gl.convert_layout(gl.join(q, q), like.type.layout)  # kl: both k of a pair, one scale

    @gluon.constexpr_function
    def _acc_layout(block_m, mma_v2):
        """The accumulator's [64, BLOCK_M] layout: wgmma's (4 warps, one warpgroup) or, with MMA_V2, mma.sync
        m16n8k16's over the same 4 warps (each warp 16 weight rows; its A fragment is the same registers)."""
        if mma_v2:
            return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_m, 16])

    @gluon.jit
    def _weights(u, sc, BLOCK_M: gl.constexpr, MMA_V2: gl.constexpr = False):
        """One K tile's int32 words [1024] and scale words [128] (`_word_offsets`, `_scale_offsets` layouts) -> the
        MMA's A operand [64, 128] bf16 (code x scale x 2^-7), in the A fragment's layout without a move (that of an
        MMA with BLOCK_M columns: wgmma's, or mma.sync's with MMA_V2 -- per warp the same registers)."""
        ACC: gl.constexpr = _acc_layout(BLOCK_M, MMA_V2)
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        lo, hi = _decode(gl.reshape(u, [2, 4, 8, 4, 4]))  # [s_hi, w, i, c, s_lo] words -> [.., s_lo, rh, kl]
        s = _scales(sc, lo)  # [s_hi, w, i, c, s_lo, rh, kl]
        lo = lo * s
        hi = hi * s
        a = gl.permute(gl.join(lo, hi), (1, 5, 2, 0, 4, 7, 3, 6))  # [w, rh, i, s_hi, s_lo, kh, c, kl]
        return gl.convert_layout(gl.reshape(a, [64, 128]), AL, assert_trivial=True)

    @gluon.jit
    def _tile_words(we, se, g, KT: gl.constexpr, GT: gl.constexpr, sc_col):
        """Pointers to tile g of a program's stream (column tile g // KT, K tile g % KT): its words follow the
        previous tile's (the stored [E][N / 64][K / 128] order), its scale words are K tile x 2 words into the row
        block's, `sc_col` words a column tile (one column tile, GT == KT: no division)."""
        if GT == KT:
            return we + g * 1024, se + g * 2
        else:
            return we + g * 1024, se + (g // KT) * sc_col + (g % KT) * 2

    @gluon.jit
    def _load_tile(we, se, up_w, up_s, g: gl.constexpr, SWIGLU: gl.constexpr):
        """Tile g (< KT: the first column tile's) of the program's stream into registers: words and scale words, and
        the up projection's with SWIGLU (else the same values again: placeholders `_k_tile` passes through
        untouched)."""
        u = gl.load(we + g * 1024)
        sc = gl.load(se + g * 2)
        if SWIGLU:
            v = gl.load(we + up_w + g * 1024)
            vc = gl.load(se + up_s + g * 2)
        else:
            v, vc = u, sc
        return u, sc, v, vc

    @gluon.jit
    def _mma(a, b, acc, MMA_V2: gl.constexpr):
        """acc + a @ b: mma.sync (b in registers) with MMA_V2, else an asynchronous wgmma (b in shared memory; the
        caller waits)."""
        if MMA_V2:
            return mma_v2(a, b, acc)
        else:
            return warpgroup_mma(a, b, acc, is_async=True)

    @gluon.jit
    def _k_tile(xs, t, nxt, u, sc, v, vc, acc, acc_up, we, se, up_w, up_s, sc_col, KT: gl.constexpr,
                GT: gl.constexpr, SWIGLU: gl.constexpr, BLOCK_M: gl.constexpr, MMA_V2: gl.constexpr = False):
        """K tile t (of the activations): decode its words and scales (u, sc; v, vc the up projection's with
        SWIGLU), issue its wgmmas, THEN load stream tile `nxt`'s into the same values (clamped to the last tile: a
        repeat of a just-read line instead of a masked load), and wait for the wgmmas. Loading after the decode lets
        each load reuse the registers its buffer held, so a loop whose trips carry the buffers in the same order
        needs no register moves (loaded before the decode, rotated buffers cost ~27 moves a trip, and ptxas issued
        those loads late all the same: below the trip's last wgmmas, as it does these; the module docstring). The
        wait settles every wgmma before the next decode writes registers (the ptxas hazard of `w4a16_swapped`'s
        SETTLE comment). Where the stream's tiles were all loaded up front (GT == AHEAD, one trip) the reloads are
        dead and ptxas drops them (down at AHEAD 4: the same 19 LDG with or without them)."""
        pw, ps = _tile_words(we, se, gl.minimum(nxt, GT - 1), KT, GT, sc_col)
        b = xs.index(t).permute((1, 0))  # [128, BLOCK_M]: X^T, K-major
        if MMA_V2:  # mma.sync's B comes from registers: the tile by ldmatrix, shared by gate and up
            b = b.load(gl.DotOperandLayout(operand_index=1, parent=acc.type.layout, k_width=2))
        acc = _mma(_weights(u, sc, BLOCK_M, MMA_V2), b, acc, MMA_V2)
        u = gl.load(pw)
        sc = gl.load(ps)
        if SWIGLU:
            acc_up = _mma(_weights(v, vc, BLOCK_M, MMA_V2), b, acc_up, MMA_V2)
            v = gl.load(pw + up_w)
            vc = gl.load(ps + up_s)
        if not MMA_V2:  # mma.sync is synchronous: nothing to wait for
            acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
        return u, sc, v, vc, acc, acc_up

    @gluon.jit
    def _ring_fill(ring_u, ring_sc, ring_v, ring_vc, slot, g, we, se, up_w, up_s, sc_col, KT: gl.constexpr,
                   GT: gl.constexpr, SWIGLU: gl.constexpr):
        """cp.async of stream tile g's words and scale words (and the up projection's; g clamped to the last tile)
        into ring slot `slot`, one commit group: each thread copies exactly the words it will read back."""
        pw, ps = _tile_words(we, se, gl.minimum(g, GT - 1), KT, GT, sc_col)
        async_copy.async_copy_global_to_shared(ring_u.index(slot), pw)
        async_copy.async_copy_global_to_shared(ring_sc.index(slot), ps)
        if SWIGLU:
            async_copy.async_copy_global_to_shared(ring_v.index(slot), pw + up_w)
            async_copy.async_copy_global_to_shared(ring_vc.index(slot), ps + up_s)
        async_copy.commit_group()

    @gluon.jit
    def _ring_tile(xs, t, slot, u, sc, v, vc, acc, acc_up, ring_u, ring_sc, ring_v, ring_vc, RING: gl.constexpr,
                   SWIGLU: gl.constexpr, BLOCK_M: gl.constexpr):
        """`_k_tile` (activations' K tile t) with the next stream tile's words read from the cp.async ring (`slot`
        holds it once all but the RING - 1 newest groups have landed) instead of loaded from global memory."""
        b = xs.index(t).permute((1, 0))  # [128, BLOCK_M]: X^T, K-major
        acc = warpgroup_mma(_weights(u, sc, BLOCK_M), b, acc, is_async=True)
        if SWIGLU:
            acc_up = warpgroup_mma(_weights(v, vc, BLOCK_M), b, acc_up, is_async=True)
        async_copy.wait_group(RING - 1)
        u = ring_u.index(slot).load(u.type.layout)
        sc = ring_sc.index(slot).load(sc.type.layout)
        if SWIGLU:
            v = ring_v.index(slot).load(v.type.layout)
            vc = ring_vc.index(slot).load(vc.type.layout)
        acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
        return u, sc, v, vc, acc, acc_up

    @gluon.jit
    def _fill_activations(x, px, P, A_DIV, s_xm, KT: gl.constexpr, BLOCK_M: gl.constexpr, XS_STACK: gl.constexpr):
        """The row block's activation rows [BLOCK_M, K] (rows px // A_DIV of x, zeros for px >= P; px in the layout
        of `_w4a16_regs_kernel`'s XL slice) into shared memory as KT tiles of [BLOCK_M, 128], in one cp.async run
        (per-tile copies get a barrier between each two from the shared-memory hazard analysis), waited for and
        fenced: the wgmma B operand of every K tile, [KT, BLOCK_M, 128] in the rank-2 NVMMA layout of each tile
        (`stacked_tiles_layout`)."""
        XL: gl.constexpr = _X_LAYOUT  # [KT, BLOCK_M, 128] bf16
        XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        tx = gl.arange(0, KT, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL)))
        kx = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
        xrow = (x + (px // A_DIV).to(gl.int64)[None, :, None] * s_xm + tx[:, None, None] * 128
                + kx[None, None, :])
        xs = gl.allocate_shared_memory(gl.bfloat16, [KT, BLOCK_M, 128], XS_STACK)
        async_copy.async_copy_global_to_shared(xs, xrow, mask=(px < P)[None, :, None])  # cp.async, zeros past P
        xs = xs._reinterpret(gl.bfloat16, [KT, BLOCK_M, 128], XS)
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        _cta_barrier()
        return xs

    @gluon.jit
    def _epilogue(acc, acc_up, col, pairs, p_ok, ge, s_gn, n_out, rs, y, s_ym, SWIGLU: gl.constexpr,
                  HAS_ROW_SCALE: gl.constexpr):
        """Output column tile `col` (64 columns) of the row block: x 2^7 (the dequant's gain) x the global scale,
        SwiGLU, row scale; y[pair, n] for the block's real pairs."""
        offs_n = col * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc.type.layout))
        acc = acc * (gl.load(ge + offs_n * s_gn) * 128.0)[:, None]
        if SWIGLU:
            acc_up = acc_up * (gl.load(ge + (offs_n + n_out) * s_gn) * 128.0)[:, None]
            acc = acc / (1.0 + gl.exp(-acc)) * acc_up
        if HAS_ROW_SCALE:
            acc = acc * gl.load(rs + pairs, mask=p_ok, other=0.0).to(gl.float32)[None, :]
        gl.store(y + pairs[None, :] * s_ym + offs_n[:, None], acc.to(y.dtype.element_ty), mask=p_ok[None, :])

    @gluon.jit
    def _w4a16_regs_kernel(x, w, s, g, rs, y, sorted_pairs, block_expert, P, N, E, A_DIV,
                           s_xm, s_we, s_se, s_sn, s_ge, s_gn, s_ym,
                           K: gl.constexpr, SWIGLU: gl.constexpr, HAS_ROW_SCALE: gl.constexpr,
                           BLOCK_M: gl.constexpr, XS_STACK: gl.constexpr, AHEAD: gl.constexpr = 1,
                           L2_AHEAD: gl.constexpr = 0, RING: gl.constexpr = 0, COLS: gl.constexpr = 1,
                           EARLY: gl.constexpr = False, COLS_FIRST: gl.constexpr = False,
                           USE_PDL: gl.constexpr = False, MMA_V2: gl.constexpr = False):
        # grid (R / BLOCK_M, N_out / (64 COLS)) -- COLS_FIRST: (N_out / (64 COLS), R / BLOCK_M), the module
        # docstring's column order --, 4 warps: one program = COLS x 64 output columns (weight rows, the
        # wgmma M) x the BLOCK_M sorted pairs of row block pid_m (the wgmma N), its COLS x KT weight tiles streamed
        # as one run (they are contiguous in thread order), the activations staged once. SWIGLU: N = 2 N_out stored
        # rows, column n uses n (gate) and n + N_out (up). w: thread-order bytes (`thread_order`) read as int32
        # words, s: block scales [E, N, K/16] e4m3 read as int32 words (4 scales); s_we, s_se, s_sn are byte strides
        # (divided by 4 here). AHEAD (1 | 2 | 4): how many tiles of words and scales are loaded ahead into registers.
        # L2_AHEAD (0: off): how many tiles ahead the words are prefetched into L2 (and every scale row at the
        # start). RING (0: off; else AHEAD 1): the words and scales of the next RING - 1 tiles copied by cp.async
        # into a shared-memory ring (each thread its own words) and read back one tile ahead, instead of loaded
        # straight into registers. EARLY (with PDL): the row block's expert and pairs and the first AHEAD tiles'
        # words and scales are loaded BEFORE waiting for the predecessor grid -- only for a launch whose routing was
        # written two or more launches back (the down projection after gate_up: align -> gate_up -> down; gate_up
        # waited for align before it let this grid launch), so that they stream during the predecessor's tail; the
        # activations, which the predecessor wrote, and every store come after the wait. That the routing a
        # grand-predecessor wrote is visible before this grid's own wait follows from that launch order (and holds on
        # the H200), not from a documented PDL guarantee; the routing is read from L2 (`_load_now`).
        if not EARLY:
            pdl_enter(USE_PDL)  # kernels/pdl.py's contract: a no-op unless launched with PDL
        KT: gl.constexpr = K // 128
        GT: gl.constexpr = COLS * KT  # tiles a program streams a projection
        gl.static_assert(K % 128 == 0 and (KT & (KT - 1)) == 0, "K must be 128 x a power of two")
        gl.static_assert(AHEAD == 1 or ((AHEAD == 2 or AHEAD == 4) and KT % AHEAD == 0 and RING == 0),
                         "AHEAD 2 / 4 needs KT a multiple of it (and no ring)")
        gl.static_assert(not MMA_V2 or RING == 0, "MMA_V2 has no ring")
        ACC: gl.constexpr = _acc_layout(BLOCK_M, MMA_V2)
        XL: gl.constexpr = _X_LAYOUT  # [KT, BLOCK_M, 128] bf16
        pid_m = gl.program_id(1 if COLS_FIRST else 0)
        pid_n = gl.program_id(0 if COLS_FIRST else 1)
        if EARLY:  # before the wait: from L2 (a relaxed gpu-scope load), never a stale L1 line of an earlier routing
            e = gl.max(_load_now(block_expert + pid_m + gl.zeros([1], gl.int32, layout=gl.BlockedLayout(
                [1], [32], [4], [0]))), 0)
        else:
            e = gl.load(block_expert + pid_m)
        # the block's pairs beside its expert: the activations' gather waits on one round trip, not two
        rx = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
        px = _load_now(sorted_pairs + pid_m * BLOCK_M + rx)
        if e < E:  # blocks past the last used one hold the sentinel E
            n_out = N // 2 if SWIGLU else N
            # weights: tile (c, t) of expert e (column tile c = pid_n COLS + j) is 1,024 words at (c KT + t) 1024,
            # so the program's tiles g = j KT + t run on from its first; up rows n_out further
            w0 = w + e.to(gl.int64) * (s_we // 4) + pid_n * (GT * 1024)  # the program's first tile (int32 words)
            we = w0 + _word_offsets()
            se = s + e.to(gl.int64) * (s_se // 4) + pid_n * (COLS * 64) * (s_sn // 4) + _scale_offsets(s_sn // 4)
            sc_col = 64 * (s_sn // 4)  # scale words a column tile
            up_w = (n_out // 64) * (KT * 1024)
            up_s = n_out * (s_sn // 4)
            wt = w0.to(gl.int64)  # a byte address
            if L2_AHEAD > 0:  # tiles 0 .. L2_AHEAD - 1 in one range, and the program's 64 COLS (x 2) scale rows
                _prefetch_tiles(wt, up_w * 4, 0, L2_AHEAD, GT, SWIGLU)
                PL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # one row a thread
                for j in gl.static_range(COLS):
                    f = gl.arange(0, 128, layout=PL)
                    r0 = (pid_n * COLS + j) * 64
                    row = r0 + f % 64 + (f // 64) * n_out if SWIGLU else r0 + f % 64
                    _prefetch_l2_lines(s + e.to(gl.int64) * (s_se // 4) + row * (s_sn // 4))
            # the first tiles' words and scales first: their HBM latency overlaps the activations' fill
            u, sc, v, vc = _load_tile(we, se, up_w, up_s, 0, SWIGLU)  # v, vc: u, sc again without SwiGLU
            if AHEAD >= 2:  # tile 1 as well (KT is even)
                u1, sc1, v1, vc1 = _load_tile(we, se, up_w, up_s, 1, SWIGLU)
            if AHEAD == 4:  # and tiles 2, 3 (KT is a multiple of 4)
                u2, sc2, v2, vc2 = _load_tile(we, se, up_w, up_s, 2, SWIGLU)
                u3, sc3, v3, vc3 = _load_tile(we, se, up_w, up_s, 3, SWIGLU)
            if EARLY:  # now the predecessor's output (the activations) and stores (EARLY's contract, above)
                pdl_enter(USE_PDL)
            xs = _fill_activations(x, px, P, A_DIV, s_xm, KT, BLOCK_M, XS_STACK)
            pairs = gl.load(sorted_pairs + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC)))
            p_ok = pairs < P
            ge = g + e * s_ge
            zero = gl.zeros([64, BLOCK_M], gl.float32, layout=ACC)
            acc, acc_up = zero, zero
            if RING > 0:  # tiles 1 .. RING - 1 into the ring first (tile 0 is in registers)
                RL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # plain: each thread its own words
                ring_u = gl.allocate_shared_memory(gl.int32, [RING, 1024], RL)
                ring_sc = gl.allocate_shared_memory(gl.int32, [RING, 128], RL)
                if SWIGLU:
                    ring_v = gl.allocate_shared_memory(gl.int32, [RING, 1024], RL)
                    ring_vc = gl.allocate_shared_memory(gl.int32, [RING, 128], RL)
                else:
                    ring_v, ring_vc = ring_u, ring_sc
                for i in gl.static_range(RING - 1):  # stream tile i + 1 in slot i
                    _ring_fill(ring_u, ring_sc, ring_v, ring_vc, i, i + 1, we, se, up_w, up_s, sc_col, KT, GT,
                               SWIGLU)
                for j in range(COLS):  # column tile j: its K tiles, then its output
                    for t in range(KT):  # stream tile gi + RING into the slot tile gi + 1 leaves; gi + 1 from gi's
                        gi = j * KT + t
                        _ring_fill(ring_u, ring_sc, ring_v, ring_vc, (gi + RING - 1) % RING, gi + RING, we, se, up_w,
                                   up_s, sc_col, KT, GT, SWIGLU)
                        u, sc, v, vc, acc, acc_up = _ring_tile(xs, t, gi % RING, u, sc, v, vc, acc, acc_up, ring_u,
                                                               ring_sc, ring_v, ring_vc, RING, SWIGLU, BLOCK_M)
                    _epilogue(acc, acc_up, pid_n * COLS + j, pairs, p_ok, ge, s_gn, n_out, rs, y, s_ym, SWIGLU,
                              HAS_ROW_SCALE)
                    acc, acc_up = zero, zero
            elif AHEAD >= 2:  # AHEAD tiles a trip, each buffer reloaded in place (no register rotation)
                for j in range(COLS):
                    for t in range(0, KT, AHEAD):  # KT is a multiple of AHEAD: a trip never spans two column tiles
                        gi = j * KT + t
                        if L2_AHEAD > 0:
                            _prefetch_tiles(wt, up_w * 4, gi + L2_AHEAD, AHEAD, GT, SWIGLU)
                        u, sc, v, vc, acc, acc_up = _k_tile(xs, t, gi + AHEAD, u, sc, v, vc, acc, acc_up, we, se,
                                                            up_w, up_s, sc_col, KT, GT, SWIGLU, BLOCK_M, MMA_V2)
                        u1, sc1, v1, vc1, acc, acc_up = _k_tile(xs, t + 1, gi + AHEAD + 1, u1, sc1, v1, vc1, acc,
                                                                acc_up, we, se, up_w, up_s, sc_col, KT, GT, SWIGLU,
                                                                BLOCK_M, MMA_V2)
                        if AHEAD == 4:
                            u2, sc2, v2, vc2, acc, acc_up = _k_tile(xs, t + 2, gi + AHEAD + 2, u2, sc2, v2, vc2, acc,
                                                                    acc_up, we, se, up_w, up_s, sc_col, KT, GT,
                                                                    SWIGLU, BLOCK_M, MMA_V2)
                            u3, sc3, v3, vc3, acc, acc_up = _k_tile(xs, t + 3, gi + AHEAD + 3, u3, sc3, v3, vc3, acc,
                                                                    acc_up, we, se, up_w, up_s, sc_col, KT, GT,
                                                                    SWIGLU, BLOCK_M, MMA_V2)
                    _epilogue(acc, acc_up, pid_n * COLS + j, pairs, p_ok, ge, s_gn, n_out, rs, y, s_ym, SWIGLU,
                              HAS_ROW_SCALE)
                    acc, acc_up = zero, zero
            else:
                for j in range(COLS):
                    for t in range(KT):
                        gi = j * KT + t
                        if L2_AHEAD > 0:
                            _prefetch_tiles(wt, up_w * 4, gi + L2_AHEAD, 1, GT, SWIGLU)
                        u, sc, v, vc, acc, acc_up = _k_tile(xs, t, gi + 1, u, sc, v, vc, acc, acc_up, we, se, up_w,
                                                            up_s, sc_col, KT, GT, SWIGLU, BLOCK_M, MMA_V2)
                    _epilogue(acc, acc_up, pid_n * COLS + j, pairs, p_ok, ge, s_gn, n_out, rs, y, s_ym, SWIGLU,
                              HAS_ROW_SCALE)
                    acc, acc_up = zero, zero


def regs_ok(device: str, capability, dtype: torch.dtype, k: int, k_down: int) -> bool:
    """Whether the routed-expert op can run on this kernel (`kernels.w4a16_gemm.supports_moe` for THREAD_ORDER):
    Triton with Gluon, compiled (Gluon has no interpreter), an sm_90 CUDA device (wgmma; the shuffles and bf16x2
    products), bf16 activations, both projections' K (gate_up's H, down's I) 128 x a power of two up to MAX_K."""
    from kernels.w4a16_gemm import _interpreted

    return (gluon is not None and not _interpreted() and device == "cuda" and capability is not None
            and tuple(capability) == (9, 0) and dtype == torch.bfloat16 and k_ok(k) and k_ok(k_down))


def fit_build(build: dict, k: int, n_out: int) -> dict:
    """`build` (launcher keywords, e.g. an ENGINE_BUILDS entry) for a projection of K `k` and `n_out` outputs: `ahead`
    halved until it divides the K tiles and `cols` until it divides the column tiles, so that the engine's builds run
    at every shape the op meets -- the start-up self-check's small sample too (H200, 2026-12-05: an ahead-4 down
    build refused the sample's 2 K tiles, the check disabled the kernel and the engine fell back to the reference)."""
    kt, tiles = k // 128, n_out // 64
    ahead = build.get("ahead") or AHEAD
    cols = build.get("cols") or COLS
    while ahead > 1 and kt % ahead:
        ahead //= 2
    while cols > 1 and tiles % cols:
        cols //= 2
    return {**build, "ahead": ahead, "cols": cols}


def k_ok(k: int) -> bool:
    """Whether a projection's K suits the kernel: 128 x a power of two (the activations' stacked shared layout,
    `stacked_tiles_layout`), at most MAX_K."""
    kt = k // 128
    return 0 < k <= MAX_K and k % 128 == 0 and kt & (kt - 1) == 0


def check_call(name: str, x: torch.Tensor, packed_thread: torch.Tensor, scales: torch.Tensor, routing: MoeRouting,
               row_scale: torch.Tensor | None, swiglu: bool, cols: int) -> tuple[torch.Tensor, int, int, int, int]:
    """The checks of the thread-order launcher (`w4a16_regs_launch`), raising ValueError
    prefixed with `name`: bf16 activations [R, K] with a unit k stride, K 128 x a power of two up to MAX_K, N_out a
    multiple of 64, contiguous 16-byte-aligned thread-order bytes, block scales [E, N, K/16], a routed MoeRouting of
    BLOCK_MS rows, one row scale a pair, `cols` column tiles a program (1, 2, 4 or 8, dividing N_out / 64).
    -> (x, E, N, K, N_out), x copied to 16-byte-aligned rows where its rows are not (the activations' cp.async fill
    copies 16 bytes)."""
    e, n, kh = packed_thread.shape
    k = 2 * kh
    n_out = n // 2 if swiglu else n
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[-1] != k or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} (strides {x.stride()}) must be bf16 [R, {k}], unit k stride")
    if not k_ok(k) or n_out % 64 or (swiglu and n % 128):
        raise ValueError(f"{name}: K {k} must be 128 x a power of two up to {MAX_K} and N_out {n_out} a "
                         f"multiple of 64")
    if packed_thread.dtype != torch.uint8 or not packed_thread.is_contiguous() or packed_thread.data_ptr() % 16:
        raise ValueError("packed_thread must be contiguous 16-byte-aligned uint8 (the 16-byte word loads and the "
                         "4 KB tiles of `thread_order`)")
    if routing.block_expert is None or routing.block_m not in BLOCK_MS:
        raise ValueError(f"{name}: a routed MoeRouting of block_m {' or '.join(map(str, BLOCK_MS))} is needed, "
                         f"got block_m "
                         f"{routing.block_m}{' (dense)' if routing.block_expert is None else ''}")
    if row_scale is not None and row_scale.numel() != routing.num_pairs:
        raise ValueError(f"row_scale has {row_scale.numel()} values for {routing.num_pairs} pairs")
    if scales.shape != (e, n, k // BLOCK):
        raise ValueError(f"scales {tuple(scales.shape)} do not match weights [{e}, {n}, {k}]")
    if cols not in (1, 2, 4, 8) or n_out % (64 * cols):
        raise ValueError(f"{name}: cols must be 1, 2, 4 or 8 and divide the {n_out // 64} column tiles of 64, "
                         f"got {cols!r}")
    if x.data_ptr() % 16 or (x.shape[0] > 1 and x.stride(0) % 16):
        x = x.clone(memory_format=torch.contiguous_format)
    return x, e, n, k, n_out


def w4a16_regs_launch(x: torch.Tensor, packed_thread: torch.Tensor, scales: torch.Tensor,
                      global_scale: torch.Tensor, routing: MoeRouting, *, a_div: int = 1, swiglu: bool = False,
                      row_scale: torch.Tensor | None = None, ahead: int | None = None,
                      l2_ahead: int | None = None, ring: int | None = None, cols: int | None = None,
                      maxnreg: int | None = None, early: bool = False, cols_first: bool = False,
                      mma_v2: bool = False) -> torch.Tensor:
    """`w4a16_swapped.w4a16_grouped_swapped_launch`'s contract on thread-order weights (`thread_order`):
    y[p] = f(x[p // a_div] @ W[e_p]^T) * row_scale[p]. x [R, K] bf16 (unit k stride); packed_thread [E, N, K/2];
    scales [E, N, K/16] e4m3; global_scale [], [E] or [E, N] -> y [P, N (N/2 with swiglu)] bf16. `ahead` (1 | 2 | 4;
    None: AHEAD): K tiles of weights loaded ahead into registers (a divisor of the K tiles). `l2_ahead`
    (None: L2_AHEAD; 0 off): K tiles of weights prefetched ahead into L2. `ring` (None: RING; 0 off, else 2, 4 or
    8, with ahead 1 and no L2 prefetch): the words and scales staged through a cp.async ring of that many tiles in
    shared memory (+4.5 KB a tile and projection). `cols` (None: COLS; 1, 2, 4 or 8, dividing N_out / 64): output
    column tiles of 64 a program, their weights streamed as one run and the row block's activations staged once for
    all of them. `maxnreg` (None: ptxas' choice): a register cap per thread, for more programs an SM (ptxas then
    serializes the wgmmas it cannot keep registers for). `early` (with PDL; nothing without): the routing and the
    first tiles' weights are loaded before waiting for the predecessor grid -- ONLY for a launch whose routing an
    earlier launch than its predecessor wrote (the MoE's down projection after gate_up; the kernel's EARLY comment).
    `cols_first`: the grid in column order (column tiles the fast axis: the routing's empty row blocks last; the
    module docstring), the same programs and bits. `mma_v2`: the products on mma.sync (m16n8k16, the activations'
    fragments by ldmatrix) instead of wgmma -- the same A registers, no asynchronous MMA holding them, so fewer
    registers (the module docstring, sixty-sixth session); not with a ring. Which settings are fastest:
    ENGINE_BUILDS' comment."""
    if gluon is None:
        raise RuntimeError("w4a16_regs_launch needs Triton with Gluon (>= 3.5)")
    cols = COLS if cols is None else cols
    x, e, n, k, n_out = check_call("w4a16_regs", x, packed_thread, scales, routing, row_scale, swiglu, cols)
    kt = k // 128
    ring = RING if ring is None else ring
    l2_ahead = L2_AHEAD if l2_ahead is None else l2_ahead
    if ahead is None:
        ahead = AHEAD if kt % 2 == 0 and not ring else 1
    if ahead not in (1, 2, 4) or kt % ahead:
        raise ValueError(f"w4a16_regs: ahead must be 1, 2 or 4, dividing the number of K tiles (here {kt}), "
                         f"got {ahead!r}")
    if not isinstance(l2_ahead, int) or l2_ahead < 0:
        raise ValueError(f"w4a16_regs: l2_ahead must be an int >= 0, got {l2_ahead!r}")
    if ring not in (0, 2, 4, 8) or (ring and (ahead != 1 or l2_ahead)):
        raise ValueError(f"w4a16_regs: ring must be 0, 2, 4 or 8 (a ring with ahead 1 and l2_ahead 0), got ring "
                         f"{ring!r}, ahead {ahead}, l2_ahead {l2_ahead}")
    if mma_v2 and ring:
        raise ValueError("w4a16_regs: mma_v2 has no ring (ring must be 0)")
    if early and swiglu:
        raise ValueError("w4a16_regs: early is for the down projection only (gate_up's routing is written by the "
                         "launch right before it)")
    if maxnreg is not None and (not isinstance(maxnreg, int) or not 32 <= maxnreg <= 255 or maxnreg % 8):
        raise ValueError(f"w4a16_regs: maxnreg must be None or a multiple of 8 in 32..255, got {maxnreg!r}")
    if cols_first and routing.block_expert.numel() > 65535:  # the row blocks on CUDA's grid y axis
        raise ValueError(f"w4a16_regs: cols_first takes at most 65,535 row blocks, got {routing.block_expert.numel()}")
    y = torch.empty((routing.num_pairs, n_out), dtype=x.dtype, device=x.device)
    if routing.num_pairs == 0:
        return y
    g, s_ge, s_gn = _global_2d(global_scale, e, n)
    sc = scales.view(torch.uint8).view(torch.int32)  # [E, N, K/64]: 4 block scales a word
    rs = row_scale.reshape(-1) if row_scale is not None else g
    grid = (routing.block_expert.numel(), n_out // (64 * cols))
    if cols_first:
        grid = grid[::-1]
    _w4a16_regs_kernel[grid](
        x, packed_thread.view(torch.int32), sc, g, rs, y, routing.sorted_pairs, routing.block_expert,
        routing.num_pairs, n, e, a_div,
        x.stride(0) if x.shape[0] > 1 else k, packed_thread.stride(0), 4 * sc.stride(0), 4 * sc.stride(1), s_ge,
        s_gn, y.stride(0),
        K=k, SWIGLU=swiglu, HAS_ROW_SCALE=row_scale is not None, BLOCK_M=routing.block_m,
        XS_STACK=stacked_tiles_layout(routing.block_m, kt), AHEAD=ahead, L2_AHEAD=l2_ahead, RING=ring, COLS=cols,
        EARLY=bool(early), COLS_FIRST=bool(cols_first), MMA_V2=bool(mma_v2), num_warps=4,
        **({} if maxnreg is None else dict(maxnreg=maxnreg)), **pdl.launch_options())
    return y
