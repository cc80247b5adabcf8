"""Routed NVFP4 W4A16 experts at decode sizes, the weights streamed by TMA through a shared-memory ring (Gluon,
Hopper): `kernels/w4a16_regs.py`'s kernel with its weight loads moved from registers to the copy engine -- the same
thread-order weights, routing contract, decode, wgmma order and epilogue, so the same bits.

Why. The register-streamed kernel is latency-bound, not issue-bound: ncu at 32 tokens (H100, forty-eighth session,
results/profile48_run1) puts gate_up at 74% of DRAM read with long-scoreboard stalls 57% of the time and 22%
occupancy (128 registers, 3-4 programs an SM); on the H200 gate_up streams 184 MB in 59.7 us, ~3.1 TB/s of its ~4.8.
Its bytes in flight are what registers can hold -- AHEAD tiles of words a thread, and ptxas issues those loads late
(w4a16_regs' docstring) -- and the 4-deep register build lost to 3 programs an SM. Here the copy engine holds them:
each program keeps STAGES - 1 stages of TILES K tiles (gate_up: 2 x 4 KB words + 2 x 512 B scales a tile) in flight
in shared memory whatever its registers, one TMA instruction a 8-16 KB copy, so a gate_up program at 4 stages of 2
tiles has ~54 KB in flight against ~16-32 KB.

Layout and order. Words: the thread-order tiles (`w4a16_regs.thread_order`: 4 KB each, [E][N / 64][K / 128]) read as
int32 rows of W_COLS words, so a stage of TILES consecutive K tiles of one column tile is one box of
TILES x 1024 / W_COLS rows (contiguous); the up projection's column tile N_out / 64 tiles further. Scales: the
checkpoint's e4m3 bytes [E, N, K / 16] read as a 2D [E N, K / 16] uint8 tensor, one box of 64 rows x 8 TILES bytes a
stage and projection (TMA needs 16-byte inner boxes: TILES >= 2). Both land unswizzled: each thread then reads its
own two 16-byte runs of a tile's words (`w4a16_regs._word_offsets`' layout: LDS.128, conflict-free) and its scale
word (row 16 w + 8 rh + i, word 2 t + s_hi of the row's stage bytes), which `w4a16_regs._weights` decodes into the
wgmma A fragment exactly as from registers. One mbarrier a slot (expect-tx of the stage's bytes); a slot is refilled
with stage i + STAGES after stage i's last wgmma has been waited for and a CTA barrier (every thread's reads of it
done). The activations: `w4a16_regs`' cp.async gather into the stacked wgmma B tiles, after the first stages' TMA
have been issued (their latency overlaps).

Outcome (H100, 2026-12-05, forty-eighth session; benchmarks/RESULTS.md, results/tma48_run1-3; not yet on an H200):
bit for bit the register kernel (43 CUDA cases, every benched build on the bench's inputs). Per call at 32 tokens,
gate_up 72.3 against 73.1-74.0 us at 2 tiles x 2 stages (3 programs an SM; 4 stages the same, 6 stages or 4 x 3
-- one program an SM by shared memory -- 28-38% slower), down no gain (37.4-37.8 against 36.9-37.2); at one token
gate_up 9.0-9.3 against 11.7-12.0 us. The engine with gate_up on it: 32 streams 3,637.9 against 3,641.4 tok/s, the
same tokens -- no gain, so `w4a16_regs.ENGINE_BUILDS` keeps the register builds. Why: a read-only kernel over the
same bytes and grid (`benchmarks/expert_read_floor.py`) takes 67.7 us for gate_up at 32 tokens there, so both
kernels were already within 7-9% of their access pattern's read floor on that GPU: bytes in flight were not what
held them, and neither were the programs' prologues: `cols` (several column tiles a program, one run) gained
nothing either (results/tma48_run4). The H200 streams gate_up at ~3.2 TB/s of its 4.8 (the H100 at ~2.6 of
3.35), where more bytes in flight may still pay: `gpu_next.sh` steps 174 / 172 / 173 measure the floor, this kernel
and the engine there.
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.w4a16_gemm import MoeRouting, _global_2d
from kernels import w4a16_regs
from kernels.w4a16_regs import check_call, stacked_tiles_layout

gluon = w4a16_regs.gluon
if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

TILES = 2  # K tiles a stage (one TMA box a projection); 2 or 4 (the scales' box is 8 TILES bytes wide: >= 16)
STAGES = 4  # ring slots; STAGES - 1 stages stay in flight while one is read
COLS = 1  # output column tiles of 64 a program (their tiles streamed as one run)
W_COLS = 256  # int32 words a row of the words' 2D view (a tile is 1024 / W_COLS rows): 256 or 32
STAGE_CHOICES = (2, 3, 4, 6)
TILE_CHOICES = (2, 4)


def smem_bytes(k: int, block_m: int, swiglu: bool, tiles: int, stages: int) -> int:
    """Shared memory of one program: the ring's words and scales, its mbarriers, the stacked activations."""
    proj = 2 if swiglu else 1
    return stages * proj * tiles * (4096 + 512) + 8 * stages + block_m * k * 2


if gluon is not None:
    _weights = w4a16_regs._weights
    _epilogue = w4a16_regs._epilogue
    _load_now = w4a16_regs._load_now
    _fill_activations = w4a16_regs._fill_activations
    _WORDS_LAYOUT = w4a16_regs._WORDS_LAYOUT
    _SCALE_WORDS_LAYOUT = w4a16_regs._SCALE_WORDS_LAYOUT
    _X_LAYOUT = w4a16_regs._X_LAYOUT
    _cta_barrier = w4a16_regs._cta_barrier
    pdl_enter = w4a16_regs.pdl_enter

    @gluon.jit
    def _issue_stage(w_desc, s_desc, ring_w, ring_s, ring_v, ring_vc, bars, slot, stage, wrow, wrow_up, srow,
                     srow_up, NS: gl.constexpr, TILES: gl.constexpr, W_ROWS: gl.constexpr, SWIGLU: gl.constexpr):
        """Stage `stage` of the program's stream (column tile stage // NS of its COLS, K stage stage % NS): its words
        and scales (and the up projection's, into their own rings) by TMA into ring slot `slot`, completing on the
        slot's mbarrier (expect-tx of all of their bytes first). The words of a program's column tiles are
        contiguous (thread order), so stage s's are TILES tiles on from stage s - 1's; its scales are 64 rows further
        a column tile. Four allocations, not one: Triton's shared-memory hazard analysis puts a CTA barrier between
        two TMA writes into one."""
        bar = bars.index(slot)
        if SWIGLU:
            mbarrier.expect(bar, 2 * TILES * (4096 + 512))
        else:
            mbarrier.expect(bar, TILES * (4096 + 512))
        col = stage // NS
        scol = (stage % NS) * (8 * TILES)
        tma.async_copy_global_to_shared(w_desc, [wrow + stage * (TILES * W_ROWS), 0], bar, ring_w.index(slot))
        tma.async_copy_global_to_shared(s_desc, [srow + col * 64, scol], bar, ring_s.index(slot))
        if SWIGLU:
            tma.async_copy_global_to_shared(w_desc, [wrow_up + stage * (TILES * W_ROWS), 0], bar, ring_v.index(slot))
            tma.async_copy_global_to_shared(s_desc, [srow_up + col * 64, scol], bar, ring_vc.index(slot))

    @gluon.jit
    def _as_scale_words(q):
        """[w 4, rh 2, i 8, s_hi 2] int32 -> [128] in `w4a16_regs._scale_offsets`' layout (f = 32 w + 4 i + 2 rh +
        s_hi: lane f % 32 of warp f // 32), a relabelling."""
        q = gl.reshape(gl.permute(q, (0, 2, 1, 3)), [128])
        return gl.convert_layout(q, _SCALE_WORDS_LAYOUT, assert_trivial=True)

    @gluon.jit
    def _stage_scales(sv, TILES: gl.constexpr):
        """A stage's scale words for one projection: its buffer viewed [4 w, 2 rh, 8 i, TILES, 2 s_hi] int32 (rows
        16 w + 8 rh + i; within a row, word 2 tt + s_hi for K tile tt) loaded at once, lane 4 i + 2 rh + s_hi of
        warp w holding its TILES words in registers -> the TILES tiles' [128] scale words (`_as_scale_words`; the
        last two repeat the first two when TILES is 2)."""
        if TILES == 2:
            SL: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 0, 1, 0]],
                lane_bases=[[0, 0, 0, 0, 1], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 0, 4, 0, 0]],
                warp_bases=[[1, 0, 0, 0, 0], [2, 0, 0, 0, 0]], block_bases=[], shape=[4, 2, 8, 2, 2])
            q = gl.permute(sv.load(SL), (0, 1, 2, 4, 3))  # [w, rh, i, s_hi, tile]
            q0, q1 = gl.split(q)
            s0 = _as_scale_words(q0)
            s1 = _as_scale_words(q1)
            return s0, s1, s0, s1
        else:
            SL4: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 0, 1, 0], [0, 0, 0, 2, 0]],
                lane_bases=[[0, 0, 0, 0, 1], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 0, 4, 0, 0]],
                warp_bases=[[1, 0, 0, 0, 0], [2, 0, 0, 0, 0]], block_bases=[], shape=[4, 2, 8, 4, 2])
            q = gl.reshape(gl.permute(sv.load(SL4), (0, 1, 2, 4, 3)), [4, 2, 8, 2, 2, 2])  # tile = 2 th + tl
            qa, qb = gl.split(q)  # tl 0 / 1: [w, rh, i, s_hi, th]
            q0, q2 = gl.split(qa)
            q1, q3 = gl.split(qb)
            return _as_scale_words(q0), _as_scale_words(q1), _as_scale_words(q2), _as_scale_words(q3)

    @gluon.jit
    def _w4a16_tma_kernel(x, w_desc, s_desc, g, rs, y, sorted_pairs, block_expert, P, N, E, A_DIV,
                          s_xm, s_ge, s_gn, s_ym,
                          K: gl.constexpr, SWIGLU: gl.constexpr, HAS_ROW_SCALE: gl.constexpr,
                          BLOCK_M: gl.constexpr, XS_STACK: gl.constexpr, TILES: gl.constexpr,
                          STAGES: gl.constexpr, W_COLS: gl.constexpr, COLS: gl.constexpr = 1,
                          USE_PDL: gl.constexpr = False):
        # grid (R / BLOCK_M, N_out / (64 COLS)), 4 warps: one program = COLS x 64 output columns x the BLOCK_M sorted
        # pairs of row block pid_m, its COLS x KT K tiles streamed as one run of COLS x KT / TILES stages through the
        # STAGES-slot ring (module docstring): one routing load and one activation fill for COLS column tiles, and
        # the next column tile's first stages in flight while the last ones of the one before are read
        pdl_enter(USE_PDL)
        KT: gl.constexpr = K // 128
        NS: gl.constexpr = KT // TILES  # stages a column tile
        GS: gl.constexpr = COLS * NS  # stages a program streams
        W_ROWS: gl.constexpr = 1024 // W_COLS  # rows of the words' view a tile
        gl.static_assert(K % 128 == 0 and (KT & (KT - 1)) == 0 and KT % TILES == 0,
                         "K must be 128 x a power of two, a multiple of TILES tiles")
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        XL: gl.constexpr = _X_LAYOUT  # [KT, BLOCK_M, 128] bf16 (w4a16_regs')
        WL: gl.constexpr = _WORDS_LAYOUT  # a tile's words as each thread reads them (w4a16_regs')
        PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # rank 1: the layout of an .index()
        PLAIN5: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [4, 3, 2, 1, 0])
        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
        e = gl.load(block_expert + pid_m)
        rx = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
        px = _load_now(sorted_pairs + pid_m * BLOCK_M + rx)
        if e < E:  # blocks past the last used one hold the sentinel E
            n_out = N // 2 if SWIGLU else N
            ring_w = gl.allocate_shared_memory(gl.int32, [STAGES, TILES * W_ROWS, W_COLS], w_desc.layout)
            ring_s = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, 8 * TILES], s_desc.layout)
            if SWIGLU:  # the up projection's rings
                ring_v = gl.allocate_shared_memory(gl.int32, [STAGES, TILES * W_ROWS, W_COLS], w_desc.layout)
                ring_vc = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, 8 * TILES], s_desc.layout)
            else:
                ring_v, ring_vc = ring_w, ring_s
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(bars.index(i), count=1)
            fence_async_shared()
            # the program's first rows: words of tile (e, column tile c, K tile t) at ((e N/64 + c) KT + t) W_ROWS
            c0 = pid_n * COLS  # the program's first column tile
            wrow = ((e * (N // 64) + c0) * KT) * W_ROWS
            wrow_up = ((e * (N // 64) + c0 + n_out // 64) * KT) * W_ROWS
            srow = e * N + c0 * 64
            srow_up = srow + n_out
            for i in gl.static_range(STAGES):  # the first stages before the activations: their latency overlaps
                if i < GS:
                    _issue_stage(w_desc, s_desc, ring_w, ring_s, ring_v, ring_vc, bars, i, i, wrow, wrow_up, srow,
                                 srow_up, NS, TILES, W_ROWS, SWIGLU)
            xs = _fill_activations(x, px, P, A_DIV, s_xm, KT, BLOCK_M, XS_STACK)  # the B operand (w4a16_regs')
            pairs = gl.load(sorted_pairs + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC)))
            p_ok = pairs < P
            ge = g + e * s_ge
            # the rings read back: words [slot x TILES, 1024], scales [slot, w, rh, i, TILES, s_hi]
            words = ring_w._reinterpret(gl.int32, [STAGES * TILES, 1024], PLAIN1)
            scales = ring_s._reinterpret(gl.int32, [STAGES, 4, 2, 8, TILES, 2], PLAIN5)
            words_up = ring_v._reinterpret(gl.int32, [STAGES * TILES, 1024], PLAIN1)
            scales_up = ring_vc._reinterpret(gl.int32, [STAGES, 4, 2, 8, TILES, 2], PLAIN5)
            zero = gl.zeros([64, BLOCK_M], gl.float32, layout=ACC)
            for j in range(COLS):  # column tile c0 + j: its NS stages, then its output
                acc, acc_up = zero, zero
                for si in range(NS):
                    gi = j * NS + si  # the stage of the program's stream
                    slot = gi % STAGES
                    mbarrier.wait(bars.index(slot), (gi // STAGES) & 1)
                    g0, g1, g2, g3 = _stage_scales(scales.index(slot), TILES)
                    if SWIGLU:
                        h0, h1, h2, h3 = _stage_scales(scales_up.index(slot), TILES)
                    else:
                        h0, h1, h2, h3 = g0, g1, g2, g3
                    for tt in gl.static_range(TILES):
                        b = xs.index(si * TILES + tt).permute((1, 0))  # [128, BLOCK_M]: X^T, K-major
                        u = words.index(slot * TILES + tt).load(WL)
                        sc = g0 if tt == 0 else (g1 if tt == 1 else (g2 if tt == 2 else g3))
                        acc = warpgroup_mma(_weights(u, sc, BLOCK_M), b, acc, is_async=True)
                        if SWIGLU:
                            v = words_up.index(slot * TILES + tt).load(WL)
                            vc = h0 if tt == 0 else (h1 if tt == 1 else (h2 if tt == 2 else h3))
                            acc_up = warpgroup_mma(_weights(v, vc, BLOCK_M), b, acc_up, is_async=True)
                        acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
                    if gi + STAGES < GS:  # every thread's reads of the slot are done: refill it
                        _cta_barrier()
                        _issue_stage(w_desc, s_desc, ring_w, ring_s, ring_v, ring_vc, bars, slot, gi + STAGES, wrow,
                                     wrow_up, srow, srow_up, NS, TILES, W_ROWS, SWIGLU)
                _epilogue(acc, acc_up, c0 + j, pairs, p_ok, ge, s_gn, n_out, rs, y, s_ym, SWIGLU, HAS_ROW_SCALE)


def _descriptors(packed_thread: torch.Tensor, scales: torch.Tensor, tiles: int, w_cols: int):
    """The words' and scales' TMA descriptors (module docstring): words int32 [E N K / 8 / W_COLS, W_COLS], box
    [TILES x 1024 / W_COLS, W_COLS]; scales uint8 [E N, K / 16], box [64, 8 TILES]; both unswizzled."""
    from triton.experimental.gluon import language as gl_

    e, n, kh = packed_thread.shape
    words = packed_thread.view(torch.int32).view(-1, w_cols)
    sc = scales.view(torch.uint8).view(e * n, -1)
    w_desc = TensorDescriptor(words, list(words.shape), list(words.stride()), [tiles * 1024 // w_cols, w_cols],
                              gl_.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    s_desc = TensorDescriptor(sc, list(sc.shape), list(sc.stride()), [64, 8 * tiles],
                              gl_.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))
    return w_desc, s_desc


def w4a16_tma_launch(x: torch.Tensor, packed_thread: torch.Tensor, scales: torch.Tensor,
                     global_scale: torch.Tensor, routing: MoeRouting, *, a_div: int = 1, swiglu: bool = False,
                     row_scale: torch.Tensor | None = None, tiles: int | None = None, stages: int | None = None,
                     w_cols: int | None = None, cols: int | None = None) -> torch.Tensor:
    """`w4a16_regs.w4a16_regs_launch`'s contract (thread-order weights, a routed MoeRouting of 8- or 16-row blocks):
    y[p] = f(x[p // a_div] @ W[e_p]^T) * row_scale[p] -> [P, N (N/2 with swiglu)] bf16, bit for bit its outputs.
    `tiles` (TILES: 2 or 4, dividing the K tiles) K tiles a TMA stage, `stages` (STAGES) ring slots (at most the
    program's stages, `cols` x K tiles / `tiles`, are allocated), `w_cols` (W_COLS: 256 or 32) the words' row width
    in the TMA view (the same bytes either way), `cols` (COLS: 1, 2, 4 or 8, dividing N_out / 64) output column
    tiles a program, streamed as one run (one routing load and activation fill)."""
    if gluon is None:
        raise RuntimeError("w4a16_tma_launch needs Triton with Gluon (>= 3.5)")
    tiles = TILES if tiles is None else tiles
    stages = STAGES if stages is None else stages
    w_cols = W_COLS if w_cols is None else w_cols
    cols = COLS if cols is None else cols
    x, e, n, k, n_out = check_call("w4a16_tma", x, packed_thread, scales, routing, row_scale, swiglu, cols)
    kt = k // 128
    if tiles not in TILE_CHOICES or kt % tiles:
        raise ValueError(f"w4a16_tma: tiles must be one of {TILE_CHOICES} dividing the {kt} K tiles, got {tiles!r}")
    if stages not in STAGE_CHOICES:
        raise ValueError(f"w4a16_tma: stages must be one of {STAGE_CHOICES}, got {stages!r}")
    if w_cols not in (32, 256):
        raise ValueError(f"w4a16_tma: w_cols must be 32 or 256, got {w_cols!r}")
    if not scales.is_contiguous():  # the scales' TMA view is a plain [E N, K / 16]
        raise ValueError(f"w4a16_tma: scales {tuple(scales.shape)} must be contiguous")
    stages = min(stages, cols * kt // tiles)  # no slot past the program's stages (down at 2 tiles, 1 column: 2)
    need = smem_bytes(k, routing.block_m, swiglu, tiles, stages)
    if need > 227 * 1024:
        raise ValueError(f"w4a16_tma: {need} bytes of shared memory a program (tiles {tiles}, stages {stages}) "
                         f"exceed the 227 KB an sm_90 block may have")
    y = torch.empty((routing.num_pairs, n_out), dtype=x.dtype, device=x.device)
    if routing.num_pairs == 0:
        return y
    g, s_ge, s_gn = _global_2d(global_scale, e, n)
    rs = row_scale.reshape(-1) if row_scale is not None else g
    w_desc, s_desc = _descriptors(packed_thread, scales, tiles, w_cols)
    grid = (routing.block_expert.numel(), n_out // (64 * cols))
    _w4a16_tma_kernel[grid](
        x, w_desc, s_desc, g, rs, y, routing.sorted_pairs, routing.block_expert, routing.num_pairs, n, e, a_div,
        x.stride(0) if x.shape[0] > 1 else k, s_ge, s_gn, y.stride(0),
        K=k, SWIGLU=swiglu, HAS_ROW_SCALE=row_scale is not None, BLOCK_M=routing.block_m,
        XS_STACK=stacked_tiles_layout(routing.block_m, kt), TILES=tiles, STAGES=stages, W_COLS=w_cols, COLS=cols,
        num_warps=4, **pdl.launch_options())
    return y
