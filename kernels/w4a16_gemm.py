"""NVFP4 W4A16 GEMM in Triton for Hopper (and anything with bf16 tensor cores): 4-bit weights dequantised inside the
K loop, bf16 (or fp16) activations, fp32 accumulation. Dense (`y = x @ W^T`: shared expert, lm_head) and grouped for
the MoE (tokens sorted by expert; gate_up with SwiGLU fused, then down with the routing weight fused).

Format and reference: `kernels/nvfp4.py` (packed uint8 [N, K/2], low nibble = even k; e4m3 block scales [N, K/16];
fp32 global scale [] / [N] per output row, [E] / [E, N] for stacked experts). Design doc sections 2.4, 4.

Arithmetic. A weight tile is dequantised to the activation dtype EXACTLY: E2M1 x e4m3 has at most 6 significant bits
and lies in [2^-10, 2688], representable in fp16 and bf16 alike (`nvfp4_block_values` docstring). The global scale is
applied to the fp32 accumulator in the epilogue. So the kernel differs from `w4a16_linear_reference` (fp32 matmul of
the fp32-dequantised weight, rounded once) only by fp32 summation order and where the global scale multiplies: an
fp32-level difference before the one rounding to bf16 (tests: <= 1 bf16 ulp + an fp32 summation bound).

Dequant without lookup tables or fp8 instructions (so it runs on sm_80 and in the interpreter, and costs a few integer
ops per weight):
  E2M1 code c = s e1 e0 m: `((c & 7) << 9) | ((c & 8) << 12)` read as fp16 puts e1 e0 in the two lowest exponent bits
  and m in the top mantissa bit, which is E2M1 * 2^-14 for all 16 codes (code 1 = 0.5 lands on the fp16 subnormal
  2^-15, exact; GPUs keep fp16 subnormals); `* 2^14` in fp16 is exact.
  e4m3 byte b (sign 0): `(b & 0x7F) << 7` read as fp16 is e4m3 * 2^-8 (normals and subnormals alike); `* 2^8` exact.
  Both products and the cast to bf16 are exact (see above); `tests/test_kernel_w4a16.py` checks every code x scale.
  That fp16 route costs two conversions per weight for a bf16 dot (DEQ 0). DEQ 1 / 2 build bf16 directly:
  `((c & 7) << 6) | ((c & 8) << 12)` read as bf16 is E2M1 * 2^-126 (code 1: the bf16 subnormal 2^-127, kept by the
  GPU's bf16 multiply -- the exact-tile test passes on the H200), times the scale * 2^119 (a normal bf16) = the
  weight * 2^-7, exact, undone by an exact * 2^7 of the fp32 accumulator. DEQ 2 does the bit work in inline PTX on
  32-bit registers (~3 instructions per weight instead of ~7); the interpreter, which has no PTX, runs DEQ 1 and 2
  as one fp32 emulation of the same bits.
Even/odd: the low nibbles of a byte tile are the weights of even k, the high nibbles those of odd k; instead of
interleaving the weight tile, the (small) activation tile is split into even and odd columns and two dots are summed.

Napkin math (Qwen3.6-35B-A3B, decode step of one token; NVFP4 = 0.5625 B/param incl. scales; H200 4.8 TB/s):
  routed experts per layer: 8 x (gate_up 1024 x 2048 + down 2048 x 512) = 25.2 M params = 14.2 MB -> 2.95 us
      (gate_up 9.4 MB -> 1.97 us, down 4.7 MB -> 0.98 us); x 40 layers = 566 MB -> 118 us per token.
  shared expert per layer: gate_up 1024 x 2048 + down 2048 x 512 = 3.1 M params -> 1.77 MB -> 0.37 us; x 40 layers
      = 71 MB -> 15 us.
  lm_head: 248320 x 2048 = 509 M params -> 286 MB -> 60 us.
  activations are noise (x is 4 KB). W4A16 is 923 MB -> 192 us of the ~500 us per-token floor (2,006 tok/s at 1k
  context, design doc section 5).
  At M = 32 (32 streams) ~162 of the 256 experts are hit per layer (256 (1 - (1 - 1/256)^256)): 287 MB -> 60 us per
  layer, weight reads still dominate. A dequantise-then-bf16-matmul baseline moves 0.5625 + 2 (write bf16) + 2 (read
  it back) = 4.56 B/param: ~8x the traffic.
  Work: ~3-7 integer/fp16 ops per weight for the dequant (DEQ 2 / 0). At 4.8 TB/s = 9.6 G weights/ms that is up to
  ~58 Tops/s, inside the H200's ALU budget but not by a wide margin; each weight is dequantised once per M tile.

API. Dense: `w4a16_linear_triton(x, w)` (custom op `qwen::w4a16_linear`; reference `w4a16_linear_reference`);
`w4a16_dense_launch(x2d, packed, scales, global, split_k=, config=, modes=)` underneath. MoE:
`moe_experts_w4a16_triton(x, w13, w2, idx, weights)` (custom op `qwen::w4a16_moe`; reference
`moe_experts_w4a16_reference`) = `moe_align_fast` (sort the (token, slot) pairs by expert, pad each expert to BLOCK_M
rows, no host sync; one Triton program at decode sizes, `kernels/moe_align.py`, else the torch `moe_align`) +
`w4a16_grouped_launch` twice (gate_up with SwiGLU in the epilogue -> [P, I]; down with the routing weight in the
epilogue -> [P, H]) + a sum over top-k (or none: `reduce=False` hands the [T, k, H] rows to `kernels/moe_combine.py`).
Dense SwiGLU: `w4a16_swiglu_triton(x, w)` (custom op `qwen::w4a16_swiglu`, registry op "w4a16_swiglu"; reference
`w4a16_swiglu_reference`): the shared expert's gate/up GEMM with silu(gate) * up in its epilogue.
`dequantize_nvfp4_triton` exposes the in-kernel dequant (exact-tile test; the dequantise-then-matmul baseline).
`register(registry)` adds ops "w4a16_linear", "w4a16_swiglu" and "w4a16_moe".

Decode (M = 1-32): BLOCK_M = 16/32 (tensor-core minimum 16; the wasted rows cost nothing at memory-bound sizes);
dense split-K when the output tiles cannot fill the SMs: fp32 partials, summed in split order by the split of each tile
that arrives last (one arrival counter per tile, re-armed by that split): deterministic, and no reduce / cast launch.
Weights stream through cp.async stages; the block-scale bytes are too narrow for cp.async, so SCALE_AHEAD requests
them K tiles early in registers. Which DEQ / SCALE_AHEAD each kernel runs: GROUPED_MODES, DENSE_MODES (measured).
Where the time goes at 32 streams (H200, 2026-11-30, `benchmarks/w4a16_bench.py`): ~0.9 TB/s of weight reads in
the checkpoint layout, so neither the ALU work (DEQ 2 halves the loop's instructions: 4-6% per call) nor the scale
latency (one tile ahead: 0-5% more) is the main limit; the access pattern was part of it (each K tile reads 64-byte
pieces of rows 1 KB apart): the grouped kernel's TILED mode reads weights repacked by `tile_major`, each (row tile,
K tile) one contiguous block, 20% faster at 32 tokens (~1.1 TB/s; TILE_MAJOR_TILES, TILE_MAJOR_MODES;
`qwen_engine.model.quantized.NVFP4Experts.repack`). The swap-AB kernel (`kernels/w4a16_swapped.py`) on "split halves"
experts is faster again (17-37% per call) and the engine's path on Hopper since 2026-11-30 (seventh session).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from kernels.tolerance import compare  # noqa: F401  (re-exported for tests and the registry)
from kernels.device import triton_device_ok
import torch.nn.functional as F

from kernels import pdl
from kernels.moe_align import aligned_rows
from kernels.nvfp4 import BLOCK, NVFP4Tensor, w4a16_linear_reference
from kernels.split_k import num_sms, split_counters

try:
    import triton
    import triton.language as tl

    from kernels.split_k import last_arrival, rearm
except ImportError:  # CPU-only installs without triton: the references work, supports() says no
    triton = None

log = logging.getLogger(__name__)
DENSE = "w4a16_linear"
SWIGLU = "w4a16_swiglu"
MOE = "w4a16_moe"
ACT_DTYPES = (torch.bfloat16, torch.float16)  # tl.dot operand dtypes the dequantised tile is exact in
MIN_CAPABILITY = (8, 0)  # bf16 tensor cores; the kernel uses no fp8 instructions
MAX_SPLIT_K = 8


# ---- references -----------------------------------------------------------------------------------------------------
def _expert(w: NVFP4Tensor, e: int) -> NVFP4Tensor:
    """Matrix e of a stacked [E, N, K] NVFP4 weight; the global scale [] / [E] / [E, N] follows."""
    g = w.global_scale
    return NVFP4Tensor(w.packed[e], w.scales[e], g if g.dim() == 0 else g[e])


def w4a16_grouped_reference(x: torch.Tensor, w: NVFP4Tensor, pair_expert: torch.Tensor, a_div: int = 1,
                            row_scale: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """y[p] = f(x[p // a_div] @ dequant(W[pair_expert[p]])^T) * row_scale[p]: a loop of the dense reference over the
    experts (empty ones included: they contribute nothing). f = identity, or SwiGLU on the two halves
    (`silu(h[:, :N/2]) * h[:, N/2:]`, in fp32). x [R, K]; pair_expert [P] -> y [P, N or N/2] in x.dtype."""
    n = w.packed.shape[-2]
    out = torch.zeros(pair_expert.numel(), n // 2 if swiglu else n, dtype=torch.float32, device=x.device)
    for e in range(w.packed.shape[0]):
        pairs = (pair_expert == e).nonzero().flatten()
        h = w4a16_linear_reference(x[pairs // a_div].float(), _expert(w, e))  # fp32: no rounding before f
        if swiglu:
            h = F.silu(h[:, : n // 2]) * h[:, n // 2:]
        if row_scale is not None:
            h = h * row_scale[pairs, None].float()
        out[pairs] = h
    return out.to(x.dtype)


def w4a16_swiglu_reference(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """The shared expert's first half with its gate and up fused into one NVFP4 weight W = [gate; up] [2I, K]:
    silu(x @ gate^T) * (x @ up^T) in fp32 with one rounding. x [..., K] -> [..., I] in x.dtype. (The unfused torch
    module rounds both GEMM outputs and the SiLU to the model dtype: up to a few bf16 ulps from this.)"""
    h = w4a16_linear_reference(x.float(), w)  # fp32 [..., 2I]
    i = h.shape[-1] // 2
    return (F.silu(h[..., :i]) * h[..., i:]).to(x.dtype)


def moe_experts_w4a16_reference(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, idx: torch.Tensor,
                                weights: torch.Tensor, reduce: bool = True, layout: int = 0,
                                routing: MoeRouting | None = None) -> torch.Tensor:
    """The routed-expert block of `qwen_engine.model.moe.Experts` with NVFP4 weights, in fp32 with one final rounding.
    x [T, H]; w13 [E, 2I, H] (rows :I gate, I: up); w2 [E, H, I]; idx, weights [T, k] -> [T, H] in x.dtype, or with
    `reduce=False` the k weighted expert outputs of each token unsummed, [T, k, H] (`kernels/moe_combine.py` sums
    them inside its launch). `layout`: the packed bytes' layout (one of EXPERT_LAYOUTS' values, `experts_repack`).
    `routing`: idx's alignment built beforehand (`kernels/router_align.py`), a function of idx: a kernel uses it
    only where it would build that one itself (`_routing_of`), so no result depends on it; unused here."""
    w13, w2 = experts_repack(w13, w2, layout, inverse=True)
    t, k = idx.shape
    h = w4a16_grouped_reference(x.float(), w13, idx.reshape(-1), a_div=k, swiglu=True)  # [P, I] fp32
    y = w4a16_grouped_reference(h, w2, idx.reshape(-1), row_scale=weights.reshape(-1))  # [P, H] fp32
    y = y.view(t, k, y.shape[-1])
    return (y.sum(1) if reduce else y).to(x.dtype)


# ---- routing: pairs sorted by expert, padded per expert to BLOCK_M rows (sync-free) ---------------------------------
class MoeRouting(NamedTuple):
    """(token, slot) pairs p = t * top_k + j grouped by expert, each expert's group padded to a multiple of block_m.
    Sizes depend only on (num_pairs, num_experts, block_m), so building it never syncs with the host."""

    sorted_pairs: torch.Tensor | None  # int32 [R]: pair id per row; num_pairs marks a padding row (None: dense)
    block_expert: torch.Tensor | None  # int32 [R / block_m]: expert of each row block; num_experts past the last used
    #                                    block (None: `w4a16_swapped.dense_routing`, rows in order, all expert 0)
    num_pairs: int  # P = T * top_k
    block_m: int
    num_experts: int = 0  # E the alignment was built over (block_expert's padding value); 0: not recorded


def moe_align(idx: torch.Tensor, num_experts: int, block_m: int) -> MoeRouting:
    """idx [T, k] expert ids -> MoeRouting. R = P + min(E, P) (block_m - 1) rounded up: every non-empty expert
    wastes at most block_m - 1 padding rows."""
    flat = idx.reshape(-1)
    p = flat.numel()
    dev = flat.device
    rows = aligned_rows(p, num_experts, block_m)
    expert_sorted, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int64))  # not bincount: that syncs on CUDA (max())
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    pstart = torch.cumsum(padded, 0) - padded
    pos = pstart[expert_sorted] + torch.arange(p, device=dev) - start[expert_sorted]  # row of each sorted pair
    sorted_pairs = torch.full((rows,), p, dtype=torch.int32, device=dev).scatter_(0, pos, order.to(torch.int32))
    ends = torch.cumsum(padded, 0)  # row block b belongs to the first expert whose padded range ends past b * block_m
    block_starts = torch.arange(0, rows, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)  # E past the used blocks
    return MoeRouting(sorted_pairs, block_expert, p, block_m, num_experts)


_ALIGN_STATE: dict[tuple[str, str, int], str] = {}  # (device type, path, block_m) -> "ok" | why it is off there


def moe_align_fast(idx: torch.Tensor, num_experts: int, block_m: int) -> MoeRouting:
    """`moe_align` in Triton where it runs and the sizes fit (`kernels/moe_align.py`: one program at decode sizes,
    three launches at prefill sizes; identical tensors, instead of ~25 launches); the torch version otherwise.

    The first use of each (path, block_m) on a device type checks it against the torch version, on that call's input
    and on a seeded random routing of the same size (a warm-up's input may route every token alike); one host sync,
    eager: the graphs' warm-ups run before their captures. An exception or a mismatch switches that path off for
    the process, logged at ERROR, so a kernel that fails on some GPU costs speed, never correctness."""
    from kernels import moe_align as align

    key = (idx.device.type, align.path(idx, num_experts), block_m)
    if key[1] is not None and _ALIGN_STATE.get(key, "ok") == "ok":
        try:
            sorted_pairs, block_expert = align.moe_align_triton(idx, num_experts, block_m)
            if key not in _ALIGN_STATE:
                if idx.is_cuda and torch.cuda.is_current_stream_capturing():  # the check syncs: not inside a capture
                    return moe_align(idx, num_experts, block_m)
                probe = torch.randint(0, num_experts, tuple(idx.shape), generator=torch.Generator().manual_seed(0),
                                      dtype=idx.dtype).to(idx.device)
                for x, (sp, be) in ((idx, (sorted_pairs, block_expert)),
                                    (probe, align.moe_align_triton(probe, num_experts, block_m))):
                    ref = moe_align(x, num_experts, block_m)
                    if not (torch.equal(sp, ref.sorted_pairs) and torch.equal(be, ref.block_expert)):
                        raise RuntimeError("differs from the torch moe_align")
                _ALIGN_STATE[key] = "ok"
            return MoeRouting(sorted_pairs, block_expert, idx.numel(), block_m, num_experts)
        except Exception as exc:  # noqa: BLE001 - recorded; the torch version is always correct
            _ALIGN_STATE[key] = f"off: {exc!r}"
            log.error("Triton moe_align (%s path) switched off on %s: %r; the torch version runs", key[1], key[0],
                      exc)
    return moe_align(idx, num_experts, block_m)


def moe_routing_block_m(layout: int, num_pairs: int, num_experts: int) -> int:
    """The row-block size of the alignment that op "w4a16_moe"'s "triton" implementation builds for a call of
    `num_pairs` (token, expert) pairs over `num_experts` experts in `layout`, so that a caller can build it beforehand
    (`kernels/router_align.py`, `SparseMoE.router_align`): the register kernel's BLOCK_M, the swap-AB kernel's
    `swapped_block_m`, else `moe_block_m`."""
    if layout == THREAD_ORDER:
        from kernels.w4a16_regs import BLOCK_M

        return BLOCK_M
    if layout in SWAPPED_LAYOUTS:
        from kernels.w4a16_swapped import swapped_block_m

        return swapped_block_m(num_pairs, num_experts)
    return moe_block_m(num_pairs, num_experts)


def _routing_of(idx: torch.Tensor, num_experts: int, block_m: int, given: MoeRouting | None) -> MoeRouting:
    """`given` where it was built for this call (its pairs, experts and row blocks: `moe_routing_block_m`, and
    buffers of `moe_align`'s sizes), else `moe_align_fast`'s (one launch more; counted in ROUTING_REBUILT, so a
    caller whose routing never fits shows)."""
    p = idx.numel()
    if given is not None:
        rows = aligned_rows(p, num_experts, block_m)
        if ((given.num_pairs, given.num_experts, given.block_m) == (p, num_experts, block_m)
                and given.sorted_pairs is not None and given.sorted_pairs.numel() == rows
                and given.block_expert is not None and given.block_expert.numel() * block_m == rows):
            return given
        ROUTING_REBUILT[0] += 1
    return moe_align_fast(idx, num_experts, block_m)


ROUTING_REBUILT = [0]  # routings handed to the experts op that did not fit the call (`_routing_of`), since import


def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile of the grouped kernel from the mean pairs per expert (decode: 16, the tensor-core minimum)."""
    mean = num_pairs / num_experts
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


# ---- Triton kernels -------------------------------------------------------------------------------------------------
def _pow2_bucket(n: int, lo: int = 16, hi: int = 256) -> int:
    return min(max(lo, triton.next_power_of_2(max(n, 1))), hi)


if triton is not None:
    _BLK = tl.constexpr(BLOCK)  # jit functions may only read constexpr globals
    _TWO_119 = tl.constexpr(2.0 ** 119)

    @triton.jit
    def _e2m1_fp16(c):
        """uint16 E2M1 codes 0..15 -> exact fp16 values (module docstring)."""
        bits = ((c & 7) << 9) | ((c & 8) << 12)
        return bits.to(tl.float16, bitcast=True) * 16384.0

    @triton.jit
    def _e4m3_fp16(b):
        """uint16 e4m3 bytes of non-negative scales -> exact fp16 values (module docstring)."""
        return ((b & 0x7F) << 7).to(tl.float16, bitcast=True) * 256.0

    @triton.jit
    def _e2m1_bf16_tiny(c):
        """uint16 E2M1 codes 0..15 -> E2M1 x 2^-126 as exact bf16 (e1 e0 m into bits 8-6, the sign into bit 15; code
        1 = 0.5 becomes the subnormal 2^-127). Integer ops only: no conversion instructions, which run at 1/8 rate.
        `_dequant_groups` multiplies it by scale x 2^119 (exact)."""
        return (((c & 7) << 6) | ((c & 8) << 12)).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _e2m1x2_bf16_tiny_ptx(pw):
        """`_e2m1_bf16_tiny` of both nibbles of uint8 bytes -> (low-nibble, high-nibble) bf16 tensors, in PTX on 32-bit
        registers: 4 bytes per call, PRMT spreads bytes 0/1 (2/3) into two 16-bit halves, shifts and masks do each
        pair of halves at once. About 3 instructions per weight instead of ~7 for Triton's 16-bit integer code. The
        low nibbles take one mask for both fields, ((r << 6) | (r << 12)) & 0x81C081C0 (r << 6 is zero at bits 15
        and 31, r << 12 below bit 12 and at bits 20-27): two shifts and one LOP3 per pair instead of four
        instructions (offline sm_90 SASS of the swap-AB SwiGLU 16-row build: 565 -> 533 loop instructions per K
        tile). The high nibbles' two fields overlap that way (bit 8), so they keep two masks."""
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 r01, r23, a, b;
            prmt.b32 r01, $4, 0, 0x4140;
            prmt.b32 r23, $4, 0, 0x4342;
            shl.b32 a, r01, 6; shl.b32 b, r01, 12; or.b32 a, a, b; and.b32 $0, a, 0x81C081C0;
            shl.b32 a, r23, 6; shl.b32 b, r23, 12; or.b32 a, a, b; and.b32 $1, a, 0x81C081C0;
            shl.b32 a, r01, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, r01, 8; and.b32 b, b, 0x80008000;
            or.b32 $2, a, b;
            shl.b32 a, r23, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, r23, 8; and.b32 b, b, 0x80008000;
            or.b32 $3, a, b;
            }""",
            "=r,=r,=r,=r,r", [pw], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)

    @triton.jit
    def _dequant_groups(pw, sc, DTYPE: tl.constexpr, DEQ: tl.constexpr, INTERPRET: tl.constexpr):
        """Packed bytes [BN, G, 8] + their scale bytes [BN, G] (G 16-weight groups per row) -> (even-k, odd-k)
        weights [BN, G, 8] in DTYPE, times `_dequant_gain`'s inverse. DEQ (bf16 only, DEQ_MODES): 0 dequantise in
        fp16 and convert; 1 and 2 build E2M1 x 2^-126 with integer ops (in Triton / in PTX) and multiply once by
        scale x 2^119, so the tile holds weight x 2^-7: exact (>= 2^-17, a normal bf16), and the caller's fp32 x 2^7
        undoes it exactly."""
        s = _e4m3_fp16(sc.to(tl.uint16))[:, :, None]  # 1/16 of the weights: its conversions cost little
        if DTYPE == tl.bfloat16 and DEQ > 0:
            s = s.to(tl.float32) * _TWO_119  # <= 448 x 2^119 < 2^128: a normal bf16, exact
            if INTERPRET:  # it multiplies bf16 bit patterns and flushes bf16 subnormals: the same bits in fp32
                p = pw.to(tl.uint32)
                lo = (((p & 7) << 22) | ((p & 8) << 28)).to(tl.float32, bitcast=True) * s
                hi = ((((p >> 4) & 7) << 22) | (((p >> 4) & 8) << 28)).to(tl.float32, bitcast=True) * s
                return lo.to(DTYPE), hi.to(DTYPE)  # exact, so the interpreter's truncating cast is too
            s = s.to(tl.bfloat16)
            if DEQ == 2:
                lo, hi = _e2m1x2_bf16_tiny_ptx(pw)
            else:
                p = pw.to(tl.uint16)
                lo, hi = _e2m1_bf16_tiny(p & 0xF), _e2m1_bf16_tiny(p >> 4)
            return lo * s, hi * s  # bf16 x bf16 (one HMUL2 per two weights), exact
        p = pw.to(tl.uint16)
        return (_e2m1_fp16(p & 0xF) * s).to(DTYPE), (_e2m1_fp16(p >> 4) * s).to(DTYPE)

    @triton.jit
    def _dequant(pw, sc, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEQ: tl.constexpr,
                 INTERPRET: tl.constexpr):
        """`_dequant_groups` of a K tile ([BN, BK/16, 8] bytes, [BN, BK/16] scales) as [BN, BK/2] dot operands."""
        lo, hi = _dequant_groups(pw, sc, DTYPE, DEQ, INTERPRET)
        return tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)), tl.reshape(hi, (BLOCK_N, BLOCK_K // 2))

    @triton.jit
    def _dequant_gain(DTYPE: tl.constexpr, DEQ: tl.constexpr):
        """The power of two by which an accumulator of `_dequant` tiles is multiplied (in fp32, exact)."""
        if DTYPE == tl.bfloat16 and DEQ > 0:
            return 128.0
        return 1.0

    @triton.jit
    def _mma(a, b, acc, INTERPRET: tl.constexpr):
        """acc += a @ b. The interpreter multiplies the raw bit patterns of bf16 dot operands (triton issue #11584,
        unsupported upstream), so there both go through fp32 first: the same numbers, since bf16 x bf16 products are
        exact in fp32 and the accumulation is fp32 either way."""
        if INTERPRET:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _load_scale_tile(s, rows, row_ok, t, K, s_sn, BLOCK_K: tl.constexpr):
        """Block-scale bytes [BN, BK/16] of K tile t of weight rows `rows` [BN], zero outside (t past the end too).
        Byte loads are too narrow for cp.async, so Triton's pipeliner leaves them synchronous in the K loop: the
        kernels issue them SCALE_AHEAD tiles early (registers) instead of waiting on DRAM every tile."""
        grp = t * (BLOCK_K // _BLK) + tl.arange(0, BLOCK_K // _BLK)  # block-scale columns of this tile
        ok = row_ok[:, None] & (grp[None, :] < K // _BLK)  # K % 16 == 0: a 16-group is all in or all out
        return tl.load(s + rows[:, None] * s_sn + grp[None, :], mask=ok, other=0)

    @triton.jit
    def _load_packed_tile(w, rows, row_ok, t, K, s_wn, BLOCK_K: tl.constexpr):
        """Packed weight bytes [BN, BK/16, 8] of K tile t of weight rows `rows` [BN], zero outside."""
        grp = t * (BLOCK_K // _BLK) + tl.arange(0, BLOCK_K // _BLK)
        ok = row_ok[:, None] & (grp[None, :] < K // _BLK)
        j = tl.arange(0, _BLK // 2)
        return tl.load(w + rows[:, None, None] * s_wn + (grp * (_BLK // 2))[None, :, None] + j[None, None, :],
                       mask=ok[:, :, None], other=0)

    @triton.jit
    def _load_packed_tile_major(w, rows, row_ok, t, K, BLOCK_K: tl.constexpr, TILE_N: tl.constexpr):
        """`_load_packed_tile` for weights stored tile-major (`tile_major` with block_n = TILE_N and this BLOCK_K):
        the bytes of (row tile, K tile t) are one contiguous block of TILE_N x BK/2; `rows` (aligned to TILE_N, a
        multiple of it long) cover len(rows) / TILE_N such blocks."""
        BN: tl.constexpr = TILE_N
        local = tl.arange(0, BLOCK_K // _BLK)[None, :, None] * (_BLK // 2) + tl.arange(0, _BLK // 2)[None, None, :]
        base = (rows // BN) * (K // 2 * BN) + t * (BN * (BLOCK_K // 2)) + (rows % BN) * (BLOCK_K // 2)
        return tl.load(w + base[:, None, None] + local, mask=row_ok[:, None, None], other=0)

    @triton.jit
    def _load_packed(w, rows, row_ok, t, K, s_wn, BLOCK_K: tl.constexpr, TILED: tl.constexpr,
                     TILE_N: tl.constexpr):
        """The packed tile of `rows` in the checkpoint layout, or tile-major (TILED; stored tiles of TILE_N rows)."""
        if TILED:
            return _load_packed_tile_major(w, rows, row_ok, t, K, BLOCK_K, TILE_N)
        return _load_packed_tile(w, rows, row_ok, t, K, s_wn, BLOCK_K)

    @triton.jit
    def _scale_pipe_start(s, rows, row_ok, t0, K, s_sn, BLOCK_K: tl.constexpr, SCALE_AHEAD: tl.constexpr):
        """The look-ahead scale tiles t0, t0 + 1 before the K loop (only as many as SCALE_AHEAD loads: the rest fully
        masked, no memory access)."""
        a = _load_scale_tile(s, rows, row_ok & (SCALE_AHEAD >= 1), t0, K, s_sn, BLOCK_K)
        b = _load_scale_tile(s, rows, row_ok & (SCALE_AHEAD >= 2), t0 + 1, K, s_sn, BLOCK_K)
        return a, b

    @triton.jit
    def _scale_pipe_next(a, b, s, rows, row_ok, t, K, s_sn, BLOCK_K: tl.constexpr, SCALE_AHEAD: tl.constexpr):
        """-> (the scales of tile t, the look-ahead tiles after it): SCALE_AHEAD = 0 loads tile t now (and waits on
        it), 1 / 2 return the tile loaded one / two iterations ago and request tile t + 1 / t + 2."""
        if SCALE_AHEAD == 0:
            cur = _load_scale_tile(s, rows, row_ok, t, K, s_sn, BLOCK_K)
        elif SCALE_AHEAD == 1:
            cur = a
            a = _load_scale_tile(s, rows, row_ok, t + 1, K, s_sn, BLOCK_K)
        else:
            cur = a
            a = b
            b = _load_scale_tile(s, rows, row_ok, t + 2, K, s_sn, BLOCK_K)
        return cur, a, b

    @triton.jit
    def _load_x_tile(x, a_rows, a_ok, t, K, s_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """K tile t of activation rows [BM] -> (even-k, odd-k) [BM, BK/2], zero outside."""
        ks = t * BLOCK_K + tl.arange(0, BLOCK_K)
        xt = tl.load(x + a_rows[:, None] * s_xm + ks[None, :], mask=a_ok[:, None] & (ks[None, :] < K), other=0.0)
        return tl.split(tl.reshape(xt, (BLOCK_M, BLOCK_K // 2, 2)))

    @triton.jit
    def _routed_block(sorted_pairs, pid_m, P, A_DIV, N, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                      DENSE: tl.constexpr = False):
        """Row block pid_m of a `MoeRouting` (grouped kernels, both operand orders) -> (pair ids [BM] (P on padding
        rows), which are real, the activation row each reads (gate_up reads token p // top_k; down its own pair row),
        the output columns N_out (SWIGLU: gate rows then up rows, N / 2)). DENSE (`w4a16_swapped.dense_routing`, no
        routing tensors): the pairs are the block's rows in order, computed, sorted_pairs unread."""
        if DENSE:
            pairs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        else:
            pairs = tl.load(sorted_pairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        if SWIGLU:
            n_out = N // 2
        else:
            n_out = N
        return pairs, pairs < P, pairs // A_DIV, n_out

    # Hopper-minded configs: decode tiles of 16/32 rows with 64-256 K per step (8-32 KB of packed weight per stage);
    # 64/128-row tiles for prefill. `_prune_dense` keeps the ones whose BLOCK_M matches the M bucket.
    _SMALL = [(32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (128, 256, 8, 3), (32, 256, 4, 3)]
    _LARGE = [(64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3)]
    _DENSE_CONFIGS = (
        [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=s)
         for bm in (16, 32) for bn, bk, w, s in _SMALL]
        + [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=s)
           for bm in (64, 128) for bn, bk, w, s in _LARGE])

    def _prune_dense(configs, named_args, **_):
        mb = named_args["M_BUCKET"]
        want = (mb,) if mb <= 32 else (64,) if mb == 64 else (64, 128)
        return [c for c in configs if c.kwargs["BLOCK_M"] in want]

    @triton.autotune(configs=_DENSE_CONFIGS,
                     key=["M_BUCKET", "N", "K", "SPLIT_K", "REDUCE", "SWIGLU", "DEQ", "SCALE_AHEAD"],
                     prune_configs_by={"early_config_prune": _prune_dense})
    @triton.jit
    def _w4a16_dense_kernel(x, w, s, g, y, ws, counters, M, N, K, M_BUCKET, s_xm, s_wn, s_sn, s_gn, s_ym,
                            SPLIT_K: tl.constexpr, REDUCE: tl.constexpr, SWIGLU: tl.constexpr,
                            INTERPRET: tl.constexpr, DEQ: tl.constexpr,
                            SCALE_AHEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        # grid (cdiv(M, BM), cdiv(N_out, BN), SPLIT_K); y [M, N_out]. N = weight rows; SWIGLU: N_out = N / 2 and
        # output column n = silu(row n) * row n + N_out (gate then up, fp32, one rounding). M_BUCKET (next power of
        # two of M) is only an autotune key.
        # SPLIT_K > 1: each split writes its fp32 partial(s) to ws [SPLIT_K, 1 + SWIGLU, M, N_out] and bumps the
        # tile's counter; the split that arrives last sums the partials in split order (deterministic), finishes the
        # epilogue and re-arms the counter to 0 -- the split-K reduction and the cast need no launches of their own.
        # REDUCE = False: the partials only (the launcher reduces them with torch).
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if SWIGLU:
            n_out = N // 2
        else:
            n_out = N
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = offs_m < M, offs_n < n_out
        k_tiles = tl.cdiv(K, BLOCK_K)
        per = tl.cdiv(k_tiles, SPLIT_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        t0 = pid_k * per
        sa, sb = _scale_pipe_start(s, offs_n, n_ok, t0, K, s_sn, BLOCK_K, SCALE_AHEAD)
        ua, ub = _scale_pipe_start(s, offs_n + n_out, n_ok & SWIGLU, t0, K, s_sn, BLOCK_K, SCALE_AHEAD)
        for t in range(t0, tl.minimum(t0 + per, k_tiles)):
            xe, xo = _load_x_tile(x, offs_m, m_ok, t, K, s_xm, BLOCK_M, BLOCK_K)
            pw = _load_packed_tile(w, offs_n, n_ok, t, K, s_wn, BLOCK_K)
            sc, sa, sb = _scale_pipe_next(sa, sb, s, offs_n, n_ok, t, K, s_sn, BLOCK_K, SCALE_AHEAD)
            lo, hi = _dequant(pw, sc, x.dtype.element_ty, BLOCK_N, BLOCK_K, DEQ, INTERPRET)
            acc = _mma(xe, tl.trans(lo), acc, INTERPRET)
            acc = _mma(xo, tl.trans(hi), acc, INTERPRET)
            if SWIGLU:
                sc, ua, ub = _scale_pipe_next(ua, ub, s, offs_n + n_out, n_ok, t, K, s_sn, BLOCK_K, SCALE_AHEAD)
                pw = _load_packed_tile(w, offs_n + n_out, n_ok, t, K, s_wn, BLOCK_K)
                lo, hi = _dequant(pw, sc, x.dtype.element_ty, BLOCK_N, BLOCK_K, DEQ, INTERPRET)
                acc_up = _mma(xe, tl.trans(lo), acc_up, INTERPRET)
                acc_up = _mma(xo, tl.trans(hi), acc_up, INTERPRET)
        gain = _dequant_gain(x.dtype.element_ty, DEQ)
        acc = acc * (tl.load(g + offs_n * s_gn, mask=n_ok, other=0.0) * gain)[None, :]
        if SWIGLU:
            acc_up = acc_up * (tl.load(g + (offs_n + n_out) * s_gn, mask=n_ok, other=0.0) * gain)[None, :]
        out_ok = m_ok[:, None] & n_ok[None, :]
        y_ptr = y + offs_m[:, None] * s_ym + offs_n[None, :]
        part = M * n_out  # elements of one [M, N_out] partial
        w_ptr = ws + offs_m[:, None] * n_out + offs_n[None, :]
        if SPLIT_K == 1:
            if SWIGLU:
                acc = acc / (1.0 + tl.exp(-acc)) * acc_up
            tl.store(y_ptr, acc.to(y.dtype.element_ty), mask=out_ok)
        else:
            tl.store(w_ptr + pid_k * (1 + SWIGLU) * part, acc, mask=out_ok)
            if SWIGLU:
                tl.store(w_ptr + (pid_k * 2 + 1) * part, acc_up, mask=out_ok)
        if SPLIT_K > 1 and REDUCE:
            tile = pid_m * tl.num_programs(1) + pid_n
            if last_arrival(counters, tile, SPLIT_K):  # the last split of this tile: the others' partials are visible
                tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                tot_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for p in tl.static_range(SPLIT_K):  # ".cg": L2, never a stale L1 line
                    tot += tl.load(w_ptr + p * (1 + SWIGLU) * part, mask=out_ok, other=0.0, cache_modifier=".cg")
                    if SWIGLU:
                        tot_up += tl.load(w_ptr + (p * 2 + 1) * part, mask=out_ok, other=0.0,
                                          cache_modifier=".cg")
                if SWIGLU:
                    tot = tot / (1.0 + tl.exp(-tot)) * tot_up
                tl.store(y_ptr, tot.to(y.dtype.element_ty), mask=out_ok)
                rearm(counters, tile)

    # narrow tiles for decode, where an expert has 1-2 real rows and a layer's (expert, N-tile) programs must still
    # fill 132 SMs and keep enough weight loads in flight. (A register-prefetch variant, PREFETCH, measured no faster
    # on the H200 on 2026-11-30, run 9, and was removed.)
    _GROUPED_CONFIGS = [triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=s)
                        for bn, bk, w, s in [(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (64, 256, 4, 3),
                                             (128, 128, 8, 3), (128, 64, 4, 4), (16, 128, 4, 4), (16, 256, 4, 4),
                                             (16, 128, 2, 6), (32, 128, 2, 6)]]

    @triton.autotune(configs=_GROUPED_CONFIGS,
                     key=["P_BUCKET", "N", "K", "BLOCK_M", "SWIGLU", "DEQ", "SCALE_AHEAD", "TILED"])
    @triton.jit
    def _w4a16_grouped_kernel(x, w, s, g, rs, y, sorted_pairs, block_expert, P, N, K, E, A_DIV, P_BUCKET,
                              s_xm, s_we, s_wn, s_se, s_sn, s_ge, s_gn, s_ym,
                              SWIGLU: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, INTERPRET: tl.constexpr,
                              DEQ: tl.constexpr, SCALE_AHEAD: tl.constexpr, TILED: tl.constexpr,
                              TILE_N: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # grid (R / BM, cdiv(N_out, BN)); one program = BM sorted pairs of one expert x BN output columns.
        # TILED: weights stored tile-major in tiles of TILE_N rows x BLOCK_K; BLOCK_N a multiple of TILE_N.
        # SWIGLU: N = 2 * N_out weight rows (gate then up); out column n uses rows n and n + N_out.
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e = tl.load(block_expert + pid_m)
        if e < E:  # blocks past the last used one hold the sentinel E
            pairs, p_ok, a_rows, n_out = _routed_block(sorted_pairs, pid_m, P, A_DIV, N, SWIGLU, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < n_out
            we = w + e.to(tl.int64) * s_we
            se = s + e.to(tl.int64) * s_se
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            sa, sb = _scale_pipe_start(se, offs_n, n_ok, 0, K, s_sn, BLOCK_K, SCALE_AHEAD)  # gate (or plain) rows
            ua, ub = _scale_pipe_start(se, offs_n + n_out, n_ok & SWIGLU, 0, K, s_sn, BLOCK_K, SCALE_AHEAD)  # up rows
            for t in range(0, tl.cdiv(K, BLOCK_K)):
                xe, xo = _load_x_tile(x, a_rows, p_ok, t, K, s_xm, BLOCK_M, BLOCK_K)
                pw = _load_packed(we, offs_n, n_ok, t, K, s_wn, BLOCK_K, TILED, TILE_N)
                sc, sa, sb = _scale_pipe_next(sa, sb, se, offs_n, n_ok, t, K, s_sn, BLOCK_K, SCALE_AHEAD)
                lo, hi = _dequant(pw, sc, x.dtype.element_ty, BLOCK_N, BLOCK_K, DEQ, INTERPRET)
                acc = _mma(xe, tl.trans(lo), acc, INTERPRET)
                acc = _mma(xo, tl.trans(hi), acc, INTERPRET)
                if SWIGLU:
                    sc, ua, ub = _scale_pipe_next(ua, ub, se, offs_n + n_out, n_ok, t, K, s_sn, BLOCK_K, SCALE_AHEAD)
                    pw = _load_packed(we, offs_n + n_out, n_ok, t, K, s_wn, BLOCK_K, TILED, TILE_N)
                    lo, hi = _dequant(pw, sc, x.dtype.element_ty, BLOCK_N, BLOCK_K, DEQ, INTERPRET)
                    acc_up = _mma(xe, tl.trans(lo), acc_up, INTERPRET)
                    acc_up = _mma(xo, tl.trans(hi), acc_up, INTERPRET)
            ge = g + e * s_ge
            gain = _dequant_gain(x.dtype.element_ty, DEQ)
            acc = acc * (tl.load(ge + offs_n * s_gn, mask=n_ok, other=0.0) * gain)[None, :]
            if SWIGLU:
                acc_up = acc_up * (tl.load(ge + (offs_n + n_out) * s_gn, mask=n_ok, other=0.0) * gain)[None, :]
                acc = acc / (1.0 + tl.exp(-acc)) * acc_up
            if HAS_ROW_SCALE:
                acc = acc * tl.load(rs + pairs, mask=p_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(y + pairs[:, None] * s_ym + offs_n[None, :], acc.to(y.dtype.element_ty),
                     mask=p_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _dequant_kernel(w, s, out, N, K, s_wn, s_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DEQ: tl.constexpr, INTERPRET: tl.constexpr):
        """Block values E2M1 x scale (no global scale) [N, K] in out's dtype: the kernels' dequant, exposed for the
        exact tile test and as the 'dequantise then matmul' baseline."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.program_id(1)
        n_ok = offs_n < N
        pw = _load_packed_tile(w, offs_n, n_ok, t, K, s_wn, BLOCK_K)
        sc = _load_scale_tile(s, offs_n, n_ok, t, K, s_sn, BLOCK_K)
        lo, hi = _dequant(pw, sc, out.dtype.element_ty, BLOCK_N, BLOCK_K, DEQ, INTERPRET)
        gain = _dequant_gain(out.dtype.element_ty, DEQ)
        lo = (lo.to(tl.float32) * gain).to(out.dtype.element_ty)  # exact: a power of two on normal values
        hi = (hi.to(tl.float32) * gain).to(out.dtype.element_ty)
        ks = t * BLOCK_K + 2 * tl.arange(0, BLOCK_K // 2)
        ok = n_ok[:, None] & (ks[None, :] < K)
        ptr = out + offs_n[:, None] * K + ks[None, :]
        tl.store(ptr, lo, mask=ok)
        tl.store(ptr + 1, hi, mask=ok)


def _interpreted() -> bool:
    """True when the kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import): CPU tensors only."""
    return triton is not None and type(_w4a16_dense_kernel.fn).__name__ == "InterpretedFunction"


# The interpreter cannot benchmark configs; it runs this one (or the caller's `config`). Small tiles keep the tests'
# masked edges and multi-tile loops exercised. Two more interpreter differences are worked around so that the
# interpreter computes the GPU's numbers: bf16 dots (see `_mma`), and fp32 -> bf16 casts, which it truncates instead
# of rounding to nearest even (`interpreter.py: _convert_float`) -- there the kernels write fp32 and torch rounds.
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)

# How a bf16 weight tile is built (constexpr DEQ of the kernels; fp16 activations always take mode 0, where the fp16
# dequant is the operand). All three give identical values; they differ in instructions per weight.
DEQ_MODES = {0: "fp16 dequant, then convert to bf16 (two conversions per weight)",
             1: "bf16 built with integer ops in Triton",
             2: "bf16 built with integer ops in inline PTX (GPU only: the interpreter has no PTX)"}


# Per kernel, from the H200 (benchmarks/RESULTS.md, "The grouped W4A16 kernel" and Qwen run 10): the grouped kernel
# with the PTX dequant and the scales requested ahead is 5-17% faster per call at decode sizes (17.8 -> 14.7 ms per
# step at 32 streams in the engine profile, with one tile ahead for both projections); the down projection (no
# SwiGLU, K = 512) measured 15% faster again with two tiles ahead (120 -> 101 us per call at 32 tokens; kernel bench
# only, the engine not re-run), gate_up slower that way. The dense decode kernel (split-K GEMV) measured slower with
# the new modes (0.66 -> 0.76 ms per step, lone request), so it keeps the fp16 dequant with the scales in the tile.
GROUPED_MODES = {True: dict(DEQ=2, SCALE_AHEAD=1, TILED=0),  # by SWIGLU: gate_up
                 False: dict(DEQ=2, SCALE_AHEAD=2, TILED=0)}  # down
DENSE_MODES = dict(DEQ=0, SCALE_AHEAD=0)
# Experts stored tile-major (`tile_major`; `NVFP4Experts.repack(TILE_MAJOR)`; the engine's layout before split
# halves, still off Hopper and for `dual`'s small batches): each projection's (BLOCK_N, BLOCK_K) is fixed by the
# repack, by SWIGLU. H200, 32 decode tokens (w4a16_bench, 2026-11-30 fifth session): gate_up 212 -> 170 us, down
# 121 -> 97 us per call against the checkpoint layout (~1.1 TB/s instead of ~0.9); one token: the same (15.5 / 15.9
# us, 8.9 / 8.0 us). Scales one tile ahead for both.
TILE_MAJOR_TILES = {True: (32, 128), False: (64, 128)}  # (BLOCK_N, BLOCK_K) by SWIGLU: gate_up, down
TILE_MAJOR_MODES = dict(DEQ=2, SCALE_AHEAD=1, TILED=1)
# Prefill-sized calls (routing BLOCK_M >= PREFILL_BLOCK_M: tens of pairs per expert) on the same tile-major bytes:
# a program covers several stored row tiles (BLOCK_N a multiple of TILE_MAJOR_TILES' rows; BLOCK_K fixed by the
# repack), so each activation row is read for more output columns per program. The decode tiles at a 1k-token
# prefill: 49.5 ms of an 81.7 ms prefill's GPU time in the engine (H200, 2026-11-30, results/qwen_profile_run10).
# Chosen by benchmarks/moe_prefill_bench.py (H200, 2026-11-30, results/moe_prefill_bench_run1), 1,024 tokens,
# BLOCK_M 32: gate_up 985 -> 471 us with 64-wide programs (128 and 256 wide, 4 or 8 warps: 578-744 us); down keeps
# its decode tile (64 wide: 274 us; 128 / 256 wide: 331-364 us). Whole op (alignment included) 1,394 -> ~880 us per
# layer. Still ~0.6 TB/s and ~70 TFLOP/s: far from the H200's limits (the kernel's prefill efficiency is open work).
# From PREFILL_BLOCK_M = 32 rows (`moe_block_m`: more than 16 pairs per expert, i.e. > 512 tokens at top-8 of 256).
PREFILL_BLOCK_M = 32
TILE_MAJOR_PREFILL = {True: dict(BLOCK_N=64, num_warps=4, num_stages=3),  # gate_up (2 stored tiles of 32 rows)
                      False: dict(BLOCK_N=64, num_warps=4, num_stages=4)}  # down (its stored tile: = decode)


def _tile_major_config(swiglu: bool, block_m: int = 16, n_out: int | None = None) -> dict:
    """The grouped launch config for tile-major experts: TILE_MAJOR_TILES' tile (the repack fixes it), 4 warps and 4
    stages (what the bench measured at decode sizes); from PREFILL_BLOCK_M rows per tile, TILE_MAJOR_PREFILL's wider
    programs over the same stored tiles, where they divide the `n_out` output columns (else the decode tile)."""
    bn, bk = TILE_MAJOR_TILES[swiglu]
    wide = TILE_MAJOR_PREFILL[swiglu]
    if block_m >= PREFILL_BLOCK_M and (n_out is None or n_out % wide["BLOCK_N"] == 0):
        return dict(BLOCK_K=bk, TILE_N=bn, **wide)
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=4)


def _launch(kernel, grid, args: tuple, config: dict | None, modes: dict, **meta):
    """Autotuned launch on a GPU; a fixed config under the interpreter or when `config` is given (tests, benchmarks).
    `modes` (DEQ, SCALE_AHEAD; `config` may override them) are part of the autotune key. Under the interpreter
    (no PTX) DEQ 1 and 2 both run `_dequant`'s fp32 emulation of their bit construction; the bf16 and PTX bit
    formulas themselves are checked on the CPU by tests/test_kernel_w4a16.py."""
    meta.update(modes)
    meta["INTERPRET"] = _interpreted()
    if config is None and not _interpreted():
        kernel[grid](*args, **meta)
        return
    cfg = {**meta, **(config or INTERPRETER_CONFIG), "INTERPRET": meta["INTERPRET"]}
    kernel.fn[grid](*args, **{k: v for k, v in cfg.items() if k in kernel.fn.arg_names or k.startswith("num_")})


def split_k_for(m: int, n: int, k: int, sms: int) -> int:
    """Split K when the (16-row, 64-column) output tiles cannot fill the SMs twice: decode of the shared expert
    (N 1024 / 2048 -> 16-32 tiles on 132 SMs). Each split keeps >= 256 of K; power of two <= MAX_SPLIT_K."""
    tiles = triton.cdiv(m, 16) * triton.cdiv(n, 64)
    split = 1
    while split < MAX_SPLIT_K and tiles * split * 2 <= 2 * sms and k // (split * 2) >= 256:
        split *= 2
    return split


def _global_1d(g: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """Dense global scale [] or [N] -> (fp32 tensor, stride along N)."""
    g = g.to(torch.float32)
    if g.dim() == 0:
        return g, 0
    if tuple(g.shape) != (n,):
        raise ValueError(f"global scale of shape {tuple(g.shape)} is neither [] nor [{n}]")
    return g, g.stride(0)


def _global_2d(g: torch.Tensor, e: int, n: int) -> tuple[torch.Tensor, int, int]:
    """Stacked global scale [], [E] or [E, N] -> (fp32 tensor, stride along E, stride along N)."""
    g = g.to(torch.float32)
    if g.dim() == 0:
        return g, 0, 0
    if tuple(g.shape) == (e,):
        return g, g.stride(0), 0
    if tuple(g.shape) == (e, n):
        return g, g.stride(0), g.stride(1)
    raise ValueError(f"global scale of shape {tuple(g.shape)} is neither [], [{e}] nor [{e}, {n}]")


def w4a16_dense_launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                       *, swiglu: bool = False, split_k: int | None = None, config: dict | None = None,
                       modes: dict | None = None) -> torch.Tensor:
    """x [M, K] (row stride free, unit k stride) -> y = x @ W^T [M, N] in x.dtype, or with `swiglu` (W = [gate; up],
    [2 I, K]) silu(x @ gate^T) * (x @ up^T) [M, I] in fp32 with one rounding. `split_k` / `config` override the
    heuristic and the autotuner, `modes` the dequant modes (tests, benchmarks). Split K is reduced inside the kernel
    (`_w4a16_dense_kernel`); without counters (see `split_counters`) torch sums the same fp32 partials and runs
    the epilogue (fp32-level differences: torch's summation order, its SiLU)."""
    m, k = x.shape
    n = packed.shape[0]
    if swiglu and n % 2:
        raise ValueError(f"a SwiGLU weight needs an even number of rows (gate then up), got {n}")
    n_out = n // 2 if swiglu else n
    g, s_gn = _global_1d(global_scale, n)
    if split_k is None:
        split_k = split_k_for(m, n_out, k, num_sms(x.device.index))
    out_dtype = torch.float32 if _interpreted() else x.dtype  # the interpreter truncates fp32 -> bf16: torch rounds
    y = torch.empty((m, n_out), dtype=out_dtype, device=x.device)
    if m == 0:
        return y.to(x.dtype)
    sc = scales.view(torch.uint8)
    # counters must cover the grid of any config the autotuner may try ((16, 32) tiles are the smallest), or of the
    # caller's config
    bm, bn = (16, 32) if config is None else (config["BLOCK_M"], config["BLOCK_N"])
    counters = None if split_k == 1 else split_counters(x.device, triton.cdiv(m, bm) * triton.cdiv(n_out, bn))
    in_kernel = split_k == 1 or counters is not None
    ws = y if split_k == 1 else torch.empty((split_k, 1 + swiglu, m, n_out), dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n_out, meta["BLOCK_N"]), split_k)  # noqa: E731
    args = (x, packed, sc, g, y, ws, counters if counters is not None else g, m, n, k, _pow2_bucket(m), x.stride(0),
            packed.stride(0), sc.stride(0), s_gn, y.stride(0))
    if in_kernel:
        _launch(_w4a16_dense_kernel, grid, args, config, {**DENSE_MODES, **(modes or {})}, SPLIT_K=split_k,
                SWIGLU=swiglu, REDUCE=True)
        return y.to(x.dtype)
    # no counters: the kernel writes the partials, torch sums them in split order and runs the epilogue
    _launch(_w4a16_dense_kernel, grid, args, config, {**DENSE_MODES, **(modes or {})}, SPLIT_K=split_k, SWIGLU=swiglu,
            REDUCE=False)
    tot = ws.sum(0)  # [1 + swiglu, M, N_out] fp32
    return (F.silu(tot[0]) * tot[1] if swiglu else tot[0]).to(x.dtype)


def tile_major(packed: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """Stacked packed weights [E, N, K/2] -> the same shape with the bytes reordered tile by tile ([E, N/BN, K/BK, BN,
    BK/2] in memory), for grouped launches with modes TILED=1 and a config of that BLOCK_N / BLOCK_K: each (row tile,
    K tile) is one contiguous block of BN x BK/2 bytes instead of the checkpoint layout's 64-byte pieces of BN rows
    K/2 bytes apart (20% faster at 32 decode tokens on the H200: TILE_MAJOR_TILES). Block scales stay."""
    e, n, kh = packed.shape
    kb = block_k // 2
    if n % block_n or kh % kb:
        raise ValueError(f"[{e}, {n}, {kh}] packed weights do not split into {block_n} x {block_k} tiles")
    return packed.view(e, n // block_n, block_n, kh // kb, kb).permute(0, 1, 3, 2, 4).contiguous().view(e, n, kh)


def untile_major(packed: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """The inverse of `tile_major`: tile-major bytes [E, N, K/2] back to the checkpoint layout."""
    e, n, kh = packed.shape
    kb = block_k // 2
    return packed.view(e, n // block_n, kh // kb, block_n, kb).permute(0, 1, 3, 2, 4).contiguous().view(e, n, kh)


def tile_major_ok(w13: NVFP4Tensor, w2: NVFP4Tensor) -> bool:
    """Whether stacked gate_up [E, 2I, H] and down [E, H, I] split into TILE_MAJOR_TILES' tiles."""
    (bn13, bk13), (bn2, bk2) = TILE_MAJOR_TILES[True], TILE_MAJOR_TILES[False]
    n13, k13 = w13.packed.shape[-2], 2 * w13.packed.shape[-1]
    n2, k2 = w2.packed.shape[-2], 2 * w2.packed.shape[-1]
    return (n13 // 2) % bn13 == 0 and k13 % bk13 == 0 and n2 % bn2 == 0 and k2 % bk2 == 0


# Byte layouts of stacked experts (`experts_repack`; `NVFP4Experts.layout`; the MoE op's `layout` argument): the
# checkpoint's; tile-major for the grouped kernel's TILED mode; split halves, tile-major too, for the swap-AB kernel
# (`kernels/w4a16_swapped.py`, the engine's layout on CUDA); split halves in fragment order (`split_frag`: the same
# kernel reading shared memory 4 bytes at a time: 15-27% faster per call on the H200, the engine's default on Hopper
# through `qwen_engine.load_packed`'s "dual_frag"). Block and global scales keep the checkpoint layout.
CHECKPOINT, TILE_MAJOR, SPLIT_HALVES, SPLIT_FRAG, THREAD_ORDER = 0, 1, 2, 3, 4
EXPERT_LAYOUTS = {"checkpoint": CHECKPOINT, "tile_major": TILE_MAJOR, "split_halves": SPLIT_HALVES,
                  "split_frag": SPLIT_FRAG, "thread_order": THREAD_ORDER}  # THREAD_ORDER: kernels/w4a16_regs.py
SWAPPED_LAYOUTS = (SPLIT_HALVES, SPLIT_FRAG)  # the layouts the swap-AB kernel reads (`kernels/w4a16_swapped.py`)
LAYOUT_NAMES = {code: name for name, code in EXPERT_LAYOUTS.items()}


def layout_ok(w13: NVFP4Tensor, w2: NVFP4Tensor, layout: int) -> bool:
    """Whether stacked gate_up [E, 2I, H] and down [E, H, I] split into `layout`'s tiles."""
    if layout == CHECKPOINT:
        return True
    if layout == TILE_MAJOR:
        return tile_major_ok(w13, w2)
    if layout in SWAPPED_LAYOUTS or layout == THREAD_ORDER:  # the same 64 x 128 tiles
        from kernels.w4a16_swapped import split_halves_ok

        return split_halves_ok(w13, w2)
    raise ValueError(f"unknown expert layout {layout!r} (one of {EXPERT_LAYOUTS})")


def experts_repack(w13: NVFP4Tensor, w2: NVFP4Tensor, layout: int,
                   inverse: bool = False) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """Both expert stacks from the checkpoint layout into `layout`, or back with `inverse` (`layout_ok` first)."""
    if layout == CHECKPOINT:
        return w13, w2
    if layout == TILE_MAJOR:
        return experts_tile_major(w13, w2, inverse)
    if layout in SWAPPED_LAYOUTS:
        from kernels.w4a16_swapped import experts_split_halves

        return experts_split_halves(w13, w2, inverse, frag=layout == SPLIT_FRAG)
    if layout == THREAD_ORDER:
        from kernels.w4a16_regs import experts_thread_order

        return experts_thread_order(w13, w2, inverse)
    raise ValueError(f"unknown expert layout {layout!r} (one of {EXPERT_LAYOUTS})")


def experts_tile_major(w13: NVFP4Tensor, w2: NVFP4Tensor, inverse: bool = False) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """Both expert stacks repacked tile-major for TILE_MAJOR_TILES, or back with `inverse` (gate_up as a whole: I is
    a multiple of its BLOCK_N, so the up rows' tiles start at I / BLOCK_N, where the SwiGLU kernel reads row n + I).
    Block and global scales stay."""
    f = untile_major if inverse else tile_major
    (bn13, bk13), (bn2, bk2) = TILE_MAJOR_TILES[True], TILE_MAJOR_TILES[False]
    return (NVFP4Tensor(f(w13.packed, bn13, bk13), w13.scales, w13.global_scale),
            NVFP4Tensor(f(w2.packed, bn2, bk2), w2.scales, w2.global_scale))


def w4a16_grouped_launch(x: torch.Tensor, w: NVFP4Tensor, routing: MoeRouting, *, a_div: int = 1,
                         row_scale: torch.Tensor | None = None, swiglu: bool = False,
                         config: dict | None = None, modes: dict | None = None) -> torch.Tensor:
    """Grouped GEMM over the routed pairs: y[p] = f(x[p // a_div] @ dequant(W[e_p])^T) * row_scale[p].
    x [R, K]; w stacked [E, N, K]; -> y [P, N (or N/2 with swiglu)] in x.dtype (pair order = routing's pair ids)."""
    if routing.sorted_pairs is None:
        raise ValueError("w4a16_grouped_launch takes a routing with tensors (`moe_align`); a dense routing runs on "
                         "w4a16_swapped.w4a16_grouped_swapped_launch")
    e, n, kh = w.packed.shape
    k = 2 * kh
    n_out = n // 2 if swiglu else n
    g, s_ge, s_gn = _global_2d(w.global_scale, e, n)
    out_dtype = torch.float32 if _interpreted() else x.dtype  # see _launch
    y = torch.empty((routing.num_pairs, n_out), dtype=out_dtype, device=x.device)
    if routing.num_pairs == 0:
        return y.to(x.dtype)
    sc = w.scales.view(torch.uint8)
    rs = row_scale.reshape(-1) if row_scale is not None else g  # any tensor when HAS_ROW_SCALE is off
    bm = routing.block_m
    grid = lambda meta: (routing.block_expert.numel(), triton.cdiv(n_out, meta["BLOCK_N"]))  # noqa: E731
    cfg = None if config is None else {k_: v for k_, v in config.items() if k_ not in ("BLOCK_M", "TILE_N")}
    tile_n = 0  # rows per stored tile (TILED): `tile_major(packed, TILE_N, BLOCK_K)`, TILE_N = BLOCK_N by default
    if (modes or {}).get("TILED"):  # weights from `tile_major(packed, TILE_N, BLOCK_K)` of this config's BLOCK_K
        bn, bk = (cfg or {}).get("BLOCK_N"), (cfg or {}).get("BLOCK_K")
        tile_n = (config or {}).get("TILE_N", bn)
        if bn is None or bk is None or (n_out % bn) or (k % bk) or not tile_n or bn % tile_n:
            raise ValueError(f"TILED needs a config whose BLOCK_N divides {n_out}, is a multiple of its TILE_N "
                             f"(the stored tile's rows) and whose BLOCK_K divides {k}")
    if cfg is None and _interpreted():
        cfg = {k_: v for k_, v in INTERPRETER_CONFIG.items() if k_ != "BLOCK_M"}
    _launch(_w4a16_grouped_kernel, grid,
            (x, w.packed, sc, g, rs, y, routing.sorted_pairs, routing.block_expert, routing.num_pairs, n, k, e, a_div,
             _pow2_bucket(routing.num_pairs, 16, 4096), x.stride(0), w.packed.stride(0), w.packed.stride(1),
             sc.stride(0), sc.stride(1), s_ge, s_gn, y.stride(0)),
            cfg, {**GROUPED_MODES[swiglu], **(modes or {})}, SWIGLU=swiglu, HAS_ROW_SCALE=row_scale is not None,
            BLOCK_M=bm, TILE_N=tile_n)
    return y.to(x.dtype)


def dequantize_nvfp4_triton(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                            block_n: int = 32, block_k: int = 64, deq: int = 2) -> torch.Tensor:
    """[N, K/2] + [N, K/16] -> block values E2M1 x scale [N, K] in dtype (no global scale), with the GEMMs' dequant
    (`deq`: one of DEQ_MODES; default 2, the grouped kernels' mode)."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    out = torch.empty((n, k), dtype=dtype, device=packed.device)
    sc = scales.view(torch.uint8)
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        packed, sc, out, n, k, packed.stride(0), sc.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        DEQ=deq, INTERPRET=_interpreted())
    return out


# ---- custom ops (traceable by torch.compile) -------------------------------------------------------------------------
def _dense_any_rank(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                    swiglu: bool, launch=None) -> torch.Tensor:
    """`launch` (default `w4a16_dense_launch`; `kernels/w4a16_gemv.py` passes its own, same signature) over x's
    leading dims (flattened to rows; unit inner stride made if missing)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = (launch or w4a16_dense_launch)(x2, packed, scales, global_scale, swiglu=swiglu)
    return y.view(*x.shape[:-1], y.shape[-1])


@torch.library.custom_op("qwen::w4a16_linear", mutates_args=())
def w4a16_linear_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16/fp16 -> [..., N] in x.dtype."""
    return _dense_any_rank(x, packed, scales, global_scale, swiglu=False)


@w4a16_linear_op.register_fake
def _(x, packed, scales, global_scale):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


@torch.library.custom_op("qwen::w4a16_swiglu", mutates_args=())
def w4a16_swiglu_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16/fp16, W = [gate; up] [2I, K] -> silu(x gate^T) * (x up^T) [..., I] in x.dtype."""
    return _dense_any_rank(x, packed, scales, global_scale, swiglu=True)


@w4a16_swiglu_op.register_fake
def _(x, packed, scales, global_scale):
    return x.new_empty((*x.shape[:-1], packed.shape[0] // 2))


@torch.library.custom_op("qwen::w4a16_moe", mutates_args=())
def w4a16_moe_op(x: torch.Tensor, p13: torch.Tensor, s13: torch.Tensor, g13: torch.Tensor, p2: torch.Tensor,
                 s2: torch.Tensor, g2: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                 reduce: bool = True, layout: int = 0, sorted_pairs: torch.Tensor | None = None,
                 block_expert: torch.Tensor | None = None, routing_experts: int = 0,
                 routing_block_m: int = 0) -> torch.Tensor:
    """Routed experts: x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; idx, weights [T, k] -> [T, H] in x.dtype (the k
    weighted outputs summed in fp32, one rounding), or [T, k, H] unsummed with `reduce=False` (no launch).
    `layout` (EXPERT_LAYOUTS): CHECKPOINT -> the grouped kernel, autotuned; TILE_MAJOR -> the grouped kernel on
    TILE_MAJOR_TILES (`_tile_major_config`, no autotuning); SPLIT_HALVES / SPLIT_FRAG -> the swap-AB kernel
    (`kernels/w4a16_swapped.py`, its fixed configs); THREAD_ORDER -> `kernels/w4a16_regs.py` (Gluon, sm_90; its
    BLOCK_M-row blocks and ENGINE_BUILDS whatever the call's size: the engine gives it decode-sized calls only,
    `NVFP4Experts.repack_regs`). `sorted_pairs`, `block_expert`, `routing_experts`, `routing_block_m`: idx's
    alignment built beforehand (`MoeRouting`'s fields, `kernels/router_align.py`), used where it is the one this call
    would build (`_routing_of`), else ignored."""
    t, top_k = idx.shape
    num_experts = p13.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    given = None if sorted_pairs is None or block_expert is None else MoeRouting(
        sorted_pairs, block_expert, t * top_k, routing_block_m, routing_experts)
    routing = _routing_of(idx, num_experts, moe_routing_block_m(layout, t * top_k, num_experts), given)
    if layout == THREAD_ORDER:
        from kernels.w4a16_regs import ENGINE_BUILDS, fit_build, w4a16_regs_launch

        # never EARLY for gate_up: the alignment it follows wrote its routing (w4a16_regs_launch's `early`); each
        # build fitted to the call's shape (`fit_build`: the self-check's small sample too)
        up = fit_build({**ENGINE_BUILDS["gate_up"], "early": False}, x.shape[-1], p13.shape[1] // 2)
        h = w4a16_regs_launch(x, p13, s13, g13, routing, a_div=top_k, swiglu=True, **up)  # [P, I]
        # down EARLY where ENGINE_BUILDS says so or early loads are on (`pdl.set_early`, the engine's
        # `early_loads`): its routing was written two launches before it, by the alignment, not by gate_up
        early = bool(ENGINE_BUILDS["down"].get("early", False)) or pdl.early()
        down = fit_build({**ENGINE_BUILDS["down"], "early": early}, p2.shape[-1] * 2, p2.shape[1])
        y = w4a16_regs_launch(h, p2, s2, g2, routing, row_scale=weights, **down)  # [P, H], weighted
    elif layout in SWAPPED_LAYOUTS:
        from kernels.w4a16_swapped import SPLIT_TILE, decode_split, w4a16_grouped_swapped_launch

        frag = layout == SPLIT_FRAG
        split13, split2 = decode_split(t, (x.shape[-1] // SPLIT_TILE[1], p2.shape[-1] * 2 // SPLIT_TILE[1]))
        h = w4a16_grouped_swapped_launch(x, p13, s13, g13, routing, a_div=top_k, swiglu=True, frag=frag,
                                         split=split13)  # [P, I]
        y = w4a16_grouped_swapped_launch(h, p2, s2, g2, routing, row_scale=weights, frag=frag,
                                         split=split2)  # [P, H], weighted
    else:
        cfg13 = cfg2 = modes = None
        if layout == TILE_MAJOR:
            bm = routing.block_m
            cfg13 = _tile_major_config(True, bm, p13.shape[1] // 2)
            cfg2, modes = _tile_major_config(False, bm, p2.shape[1]), TILE_MAJOR_MODES
        h = w4a16_grouped_launch(x, NVFP4Tensor(p13, s13, g13), routing, a_div=top_k, swiglu=True, config=cfg13,
                                 modes=modes)  # [P, I]
        y = w4a16_grouped_launch(h, NVFP4Tensor(p2, s2, g2), routing, row_scale=weights, config=cfg2,
                                 modes=modes)  # [P, H], weighted
    y = y.view(t, top_k, y.shape[-1])
    return y.sum(1, dtype=torch.float32).to(x.dtype) if reduce else y


@w4a16_moe_op.register_fake
def _(x, p13, s13, g13, p2, s2, g2, idx, weights, reduce=True, layout=0, sorted_pairs=None, block_expert=None,
      routing_experts=0, routing_block_m=0):
    return x.new_empty((x.shape[0], p2.shape[1]) if reduce else (x.shape[0], idx.shape[1], p2.shape[1]))


def w4a16_linear_triton(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """Same contract as `w4a16_linear_reference`."""
    return w4a16_linear_op(x, w.packed, w.scales, torch.as_tensor(w.global_scale, device=x.device))


def w4a16_swiglu_triton(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """Same contract as `w4a16_swiglu_reference`."""
    return w4a16_swiglu_op(x, w.packed, w.scales, torch.as_tensor(w.global_scale, device=x.device))


def moe_experts_w4a16_triton(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, idx: torch.Tensor,
                             weights: torch.Tensor, reduce: bool = True, layout: int = 0,
                             routing: MoeRouting | None = None) -> torch.Tensor:
    """Same contract as `moe_experts_w4a16_reference`."""
    given = () if routing is None else (routing.sorted_pairs, routing.block_expert, routing.num_experts,
                                        routing.block_m)
    return w4a16_moe_op(x, *w13, *w2, idx, weights, reduce, int(layout), *given)


# ---- guards, registry entries ---------------------------------------------------------------------------------------
def _device_ok(device: str, capability: tuple[int, int] | None) -> bool:
    return triton is not None and triton_device_ok(device, capability, _interpreted(), MIN_CAPABILITY)


# Fragment-order bytes (SPLIT_FRAG experts, lm_head's "w4a16_linear_frag") run `w4a16_swapped._e4m3_bf16_gained`,
# inline PTX with mul.rn.bf16x2, which needs sm_90 (the engine picks these layouts on Hopper only).
FRAG_MIN_CAPABILITY = (9, 0)


def frag_capability_ok(device: str, capability) -> bool:
    """Whether fragment-order calls can run: anywhere but CUDA (the interpreter runs no PTX), on CUDA from sm_90."""
    return device != "cuda" or (capability is not None and tuple(capability) >= FRAG_MIN_CAPABILITY)


def _capability(t: torch.Tensor) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def _weight_ok(w: NVFP4Tensor, stacked: bool) -> bool:
    p, s = w.packed, w.scales
    dims = 3 if stacked else 2
    return (p.dtype == torch.uint8 and s.dtype == torch.float8_e4m3fn and p.dim() == dims and s.dim() == dims
            and s.shape[:-1] == p.shape[:-1] and s.shape[-1] * BLOCK == 2 * p.shape[-1]
            and p.stride(-1) == 1 and s.stride(-1) == 1)


def describe_dense(x: torch.Tensor, w: NVFP4Tensor) -> dict[str, Any]:
    return dict(device=x.device.type, capability=_capability(x), dtype=x.dtype, k=x.shape[-1],
                weight_ok=_weight_ok(w, stacked=False), weight_k=w.shape[-1],
                global_ok=tuple(w.global_scale.shape) in ((), (w.packed.shape[0],)),
                rows=x.numel() // max(x.shape[-1], 1), n=w.packed.shape[0])


def supports_dense(*, device: str, capability, dtype: torch.dtype, k: int, weight_ok: bool, weight_k: int,
                   global_ok: bool, **_: Any) -> bool:
    """Triton able to run on `device` (cuda >= sm_80, or the interpreter on CPU); bf16/fp16 activations; a 2-D
    NVFP4 weight with unit inner strides whose K matches x; a scalar or per-row global scale."""
    return (_device_ok(device, capability) and dtype in ACT_DTYPES and weight_ok and global_ok and k == weight_k
            and k % BLOCK == 0)


def describe_swiglu(x: torch.Tensor, w: NVFP4Tensor) -> dict[str, Any]:
    return dict(describe_dense(x, w), even_rows=w.packed.dim() == 2 and w.packed.shape[0] % 2 == 0)


def supports_swiglu(*, even_rows: bool, **kw: Any) -> bool:
    """As `supports_dense`, and W has an even number of rows ([gate; up])."""
    return even_rows and supports_dense(**kw)


def describe_moe(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, idx: torch.Tensor,
                 weights: torch.Tensor, reduce: bool = True, layout: int = 0,
                 routing: MoeRouting | None = None) -> dict[str, Any]:
    e, n13, _ = w13.packed.shape if w13.packed.dim() == 3 else (0, 0, 0)
    e2, n2, _ = w2.packed.shape if w2.packed.dim() == 3 else (0, 0, 0)
    shapes_ok = (_weight_ok(w13, True) and _weight_ok(w2, True) and x.dim() == 2 and e == e2 and n13 % 2 == 0
                 and w13.shape[-1] == x.shape[-1] == n2 and w2.shape[-1] == n13 // 2 and idx.dim() == 2
                 and idx.shape == weights.shape and idx.shape[0] == x.shape[0])
    globals_ok = (tuple(w13.global_scale.shape) in ((), (e,), (e, n13))
                  and tuple(w2.global_scale.shape) in ((), (e2,), (e2, n2)))
    if layout != CHECKPOINT:  # repacked bytes: only the tiles they were repacked for
        shapes_ok = shapes_ok and layout in EXPERT_LAYOUTS.values() and layout_ok(w13, w2, layout)
    return dict(device=x.device.type, capability=_capability(x), dtype=x.dtype, shapes_ok=shapes_ok,
                globals_ok=globals_ok, tokens=x.shape[0] if x.dim() == 2 else -1, layout=layout,
                k=x.shape[-1], k_down=w2.shape[-1] if w2.packed.dim() == 3 else 0)


def supports_moe(*, device: str, capability, dtype: torch.dtype, shapes_ok: bool, globals_ok: bool,
                 layout: int = CHECKPOINT, k: int = 0, k_down: int = 0, **_: Any) -> bool:
    """As `supports_dense`, for stacked [E, 2I, H] gate_up and [E, H, I] down weights and [T, k] routing; fragment-
    order experts (SPLIT_FRAG) only where their PTX runs (`frag_capability_ok`: sm_90 on CUDA); thread-order experts
    (THREAD_ORDER) only where `kernels/w4a16_regs.py` runs (`regs_ok`: compiled Gluon on sm_90, bf16, its K (`k_ok`);
    never in the interpreter, so the reference serves them on the CPU)."""
    if layout == THREAD_ORDER:
        from kernels.w4a16_regs import regs_ok

        return shapes_ok and globals_ok and regs_ok(device, capability, dtype, k, k_down)
    return (_device_ok(device, capability) and dtype in ACT_DTYPES and shapes_ok and globals_ok
            and (layout != SPLIT_FRAG or frag_capability_ok(device, capability)))




def _dense_call(device, n: int, rows: int, seed: int = 0) -> tuple[tuple, dict]:
    """A dense call of `rows` bf16 rows on an NVFP4 [n, K] weight (CUDA: K in whole chunks of kernels/w4a16_mma.py)."""
    from kernels.nvfp4 import quantize_nvfp4

    g = torch.Generator().manual_seed(seed)
    k = 256 if torch.device(device).type == "cuda" else 160
    w = quantize_nvfp4(torch.randn(n, k, generator=g) * 0.02)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    return (x.to(device), NVFP4Tensor(*(t.to(device) for t in w))), {}


def _sample_dense(device) -> tuple[tuple, dict] | list[tuple[tuple, dict]]:
    """3 rows of a 96-row weight; on CUDA also one row of a WIDE_MIN_N-row one (4 MB packed), lm_head's one-row call
    that only "triton_mma_wide" takes (the registry checks each path on every sample it takes)."""
    small = _dense_call(device, 96, 3)
    if torch.device(device).type != "cuda":
        return small
    from kernels.w4a16_mma import WIDE_MIN_N

    return [small, _dense_call(device, WIDE_MIN_N, 1, seed=1)]


def _sample_swiglu(device) -> tuple[tuple, dict]:
    return _dense_call(device, 96, 3)  # 96 rows: gate 48, up 48


def _sample_moe(device, layout: int | None = None, tokens: int = 3) -> tuple[tuple, dict]:
    """The self-check's routed-expert call. `layout` (default: the loader's on that device, `default_expert_layout`):
    experts of H = I = 256 (two K tiles per projection) repacked by `experts_repack`, called with that layout, so that
    the start-up check runs the path the engine runs; `tokens` of them (3: the decode GEMVs' one program a pair).
    Checkpoint-layout experts are H = 64, I = 32 (on CUDA 128:
    K in whole chunks of the tensor-core decode GEMV, kernels/w4a16_mma.py, so that it is checked too)."""
    from kernels.nvfp4 import quantize_nvfp4

    if layout is None:
        layout = default_expert_layout(device)
    g = torch.Generator().manual_seed(0)
    e, h, i, t, k = (4, 256, 256, tokens, 2) if layout != CHECKPOINT else (6, 64, 32, tokens, 2)
    if layout == CHECKPOINT and torch.device(device).type == "cuda":  # whole chunks of kernels/w4a16_mma.py
        h = i = 128
    w13 = quantize_nvfp4(torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.rand(e, generator=g) * 1e-4 + 1e-5)
    w2 = quantize_nvfp4(torch.randn(e, h, i, generator=g) * 0.05, torch.rand(e, generator=g) * 1e-4 + 1e-5)
    w13, w2 = experts_repack(w13, w2, layout)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])  # expert e-1 stays empty
    weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(torch.bfloat16)
    mv = lambda w_: NVFP4Tensor(*(t_.to(device) for t_ in w_))  # noqa: E731
    args = (x.to(device), mv(w13), mv(w2), idx.to(device), weights.to(device))
    return (*args, True, layout) if layout != CHECKPOINT else args, {}  # (reduce, layout)


def default_expert_layout(device) -> int:
    """The routed experts' layout the loader picks on `device` (`load_quantized(expert_layout="auto")`): split halves
    on Hopper (sm_90), where the swap-AB kernel measured 17% shorter TTFT and 15% more at 32 streams than the grouped
    kernel (benchmarks/RESULTS.md, Qwen run 13; its reason, wgmma's A operand in registers, is Hopper's); tile-major
    on other GPUs (no wgmma; not measured there either); the checkpoint's on the CPU (the interpreter's speed does
    not matter; its tests cover every layout)."""
    device = torch.device(device)
    if device.type != "cuda":
        return CHECKPOINT
    return SPLIT_HALVES if torch.cuda.get_device_capability(device)[0] == 9 else TILE_MAJOR


def register(registry) -> None:
    """Ops "w4a16_linear", "w4a16_swiglu", "w4a16_moe". The dense linear first tries `kernels/w4a16_mma.py`'s
    "triton_mma_wide" (its calls of >= WIDE_MIN_N outputs: lm_head in the checkpoint layout). The dense two then try
    `kernels/w4a16_gemv.py`
    ("triton_gemv": the decode-sized calls its `supports_*_gemv` accept, on CUDA cores), then `kernels/w4a16_mma.py`
    ("triton_mma": the same calls on the tensor cores, bf16 on CUDA), then this module's ("triton"); the MoE tries
    "triton_mma" first (its <= 4-token calls on checkpoint-layout experts, bf16 on sm_90+; up to 64 with its sorted
    path when `w4a16_mma.set_sorted_tokens` asks), then "triton_gemv" (the
    CPU interpreter's and fp16's decode path), then "triton". Also
    `kernels/w4a16_swapped.py`'s "w4a16_linear_frag" (dense calls on fragment-order bytes: lm_head on Hopper)."""
    from kernels import w4a16_gemv as gemv
    from kernels import w4a16_mma as mma

    registry.add_op(DENSE, w4a16_linear_reference, sample=_sample_dense, compare=compare, describe=describe_dense,
                    tolerance="max |diff| <= 1e-2 x max |ref| (bf16 output rounding 2^-9; exact dequant, fp32 "
                              "accumulation; only summation order differs)")
    # lm_head-wide calls (N >= WIDE_MIN_N: the checkpoint-layout lm_head) on the tensor-core decode GEMV first
    registry.add_implementation(DENSE, mma.MMA_WIDE, mma.w4a16_linear_mma, mma.supports_dense_mma_wide)
    registry.add_implementation(DENSE, gemv.GEMV, gemv.w4a16_linear_gemv, gemv.supports_dense_gemv)
    registry.add_implementation(DENSE, mma.MMA, mma.w4a16_linear_mma, mma.supports_dense_mma)
    registry.add_implementation(DENSE, "triton", w4a16_linear_triton, supports_dense)
    registry.add_op(SWIGLU, w4a16_swiglu_reference, sample=_sample_swiglu, compare=compare,
                    describe=describe_swiglu,
                    tolerance="max |diff| <= 1e-2 x max |ref| (as w4a16_linear; the SiLU and product in fp32)")
    registry.add_implementation(SWIGLU, gemv.GEMV, gemv.w4a16_swiglu_gemv, gemv.supports_swiglu_gemv)
    registry.add_implementation(SWIGLU, mma.MMA, mma.w4a16_swiglu_mma, mma.supports_swiglu_mma)
    registry.add_implementation(SWIGLU, "triton", w4a16_swiglu_triton, supports_swiglu)
    registry.add_op(MOE, moe_experts_w4a16_reference, sample=_sample_moe, compare=compare, describe=describe_moe,
                    tolerance="max |diff| <= 1e-2 x max |ref| (bf16 rounding of the SwiGLU activations between the "
                              "two GEMMs and of the output; fp32 everywhere else)")
    # the routed experts of <= 4 tokens on the tensor-core decode GEMV first (H200, Qwen runs 57-58: lone decode
    # 440.0 / 440.7 against 432.8-433.2 tok/s with the CUDA-core GEMV); the dense calls keep the GEMV first (the shared
    # expert's 512 outputs are 32 programs on it: 5.95 against 3.34 us)
    registry.add_implementation(MOE, mma.MMA, mma.moe_experts_w4a16_mma, mma.supports_moe_mma)
    registry.add_implementation(MOE, gemv.GEMV, gemv.moe_experts_w4a16_gemv, gemv.supports_moe_gemv)
    registry.add_implementation(MOE, "triton", moe_experts_w4a16_triton, supports_moe)
    from kernels.w4a16_swapped import register_frag_dense

    register_frag_dense(registry)  # "w4a16_linear_frag": dense calls on fragment-order weights (lm_head)
