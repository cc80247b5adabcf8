"""Paged decode attention in Triton (flash-decoding): one query token per sequence against its keys/values in a
block-paged KV pool, split over the context so that a small batch still fills the GPU.

Reference: `paged_decode_attention_reference` below (row by row: gather the visible keys, fp32 SDPA), the semantics of
`qwen_engine.model.attention.paged_decode_attention` with the pool and the metadata passed as tensors:
    q [D, H, Dh] (one token per sequence); k_pool, v_pool [num_blocks, block_size, KVH, Dh] (`PagedKV` layout), of
    q's dtype (bf16, fp16 or fp32) or both e4m3 codes at scale 1.0 (`QwenEngineConfig.kv_cache_dtype` "fp8", sm_89+:
    each tile converted to q's dtype after its load, exactly: every e4m3 value is a bf16 / fp16 value); H % KVH == 0
    (query head h reads kv head h // (H / KVH));
    block_tables [D, max_blocks] int64 / int32: position p of sequence i is at block block_tables[i, p // block_size],
    offset p % block_size; entries past the context are arbitrary (never dereferenced);
    context_lens [D] int64: sequence i sees positions 0 .. context_lens[i] - 1 (>= 1; a 0 gives zeros, see below);
    o [D, H, Dh] in q.dtype = softmax(scale q k^T) v over the visible keys, in fp32.

CUDA-graph safe: nothing on the host reads context_lens or block_tables. Shapes and the grid depend only on the input
shapes; each program loads its own context length and derives its loop bounds from it.

Design. Grid (D, KVH, NUM_SPLITS). A program takes all G = H / KVH query heads that share one kv head (a [BLOCK_G, Dh]
tile, BLOCK_G = max(16, G) rows for tl.dot; the padding rows are zero and never stored), so each key/value row is read
once per split, not G times. The sequence's ceil(ctx / block_size) blocks are divided evenly over the NUM_SPLITS
programs in-kernel (per = ceil(blocks / NUM_SPLITS) blocks each; splits past the last block get none). A program walks
its range BLOCK_N tokens at a time (BLOCK_N >= 16 for tl.dot; each token's block id comes from the table, so BLOCK_N
need not equal block_size), masks positions past the range, and keeps the online softmax in fp32: running max m, sum
l and acc [BLOCK_G, Dh]. It writes fp32 partials o_part [D, H, NUM_SPLITS, Dh] = acc / l and lse [D, H, NUM_SPLITS] =
m + log l; a split without keys writes zeros and lse = -inf. A second launch combines the splits (weights
exp(lse - max lse)) and rounds to q.dtype once (`combine_triton`; its torch reference `_combine`).

Splitting per sequence, not over the table's static width: the table is as wide as the longest context the engine
allows (the CUDA-graph bucket), so splitting its width would leave a 1k context in an 8k-wide table on 1/8 of the
splits. `num_splits_for(D * KVH, max_blocks, SMs)` asks for about one program per SM. The split count is the grid's
third dimension, read in-kernel with `tl.num_programs(2)`, not a constexpr: it follows the batch (132 SMs: 16
distinct counts for 1-66 sequences at 2 kv heads), and as a constexpr each new count compiled a variant of the
kernel, some first met in traffic (a process's first burst of requests paid ~0.3-0.5 s a compile, Qwen run 36).

Numerics. Scores q k^T accumulate in fp32 (bf16/fp16 products are exact in fp32; fp32 inputs use tl.dot's "ieee"
precision, not tf32); exp2 with the scale folded into log2(e) units. On a GPU with bf16/fp16 inputs the P V dot takes
p rounded to the value dtype (FlashAttention's convention, as does the SDPA the model calls today): <= 2^-9 relative
per weight, averaged over the keys. The interpreter keeps p in fp32 (its fp32 -> bf16 cast truncates; and its bf16
dots go through fp32, `kernels/w4a16_gemm.py: _mma`) and writes only fp32, which torch rounds. Beyond that only the
summation order and exp ulps differ from the fp32 reference: tolerance max |o - ref| <= 1e-2 x max |ref| for
bf16/fp16 (one output rounding 2^-9 plus the p rounding), 1e-5 for fp32 (measured ~1e-7; `compare`).

Napkin math (Qwen3.6-35B-A3B full-attention layers: H = 16, KVH = 2, Dh = 256, block_size = 16; H200 4.8 TB/s):
  1k context: K + V per layer and sequence = 1024 x 2 (KVH) x 256 x 2 B x 2 (K, V) = 2 MB -> 0.44 us; 8k: 16 MB, 3.5 us.
  q and o are 8 KB each; the partials (16 x NUM_SPLITS x 256 fp32 = 1 MB at 66 splits) stay in the 50 MB L2.
  Why splits matter at batch 1: without them the grid is D x KVH = 2 programs, on 2 of the 132 SMs. One program
  streams only what it keeps in flight (Little's law: ~32 KB of K/V tiles / ~0.6 us DRAM latency = ~50 GB/s), so
  each program's 1 MB takes ~20 us instead of 0.44 us. With NUM_SPLITS = 66 the 1k context becomes 128 programs of
  one 16-token block (16 KB) each; at batch 32 (64 kv-head programs) ~one program an SM (3 splits at 8 warps)
  left the bandwidth at ~1.8 TB/s; ~three an SM (6 splits) at 4 warps ran 21% faster (`launch_tiles`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from kernels import pdl, tolerance
from kernels.device import E4M3_MIN_CAPABILITY, triton_device_ok
from kernels.fp8_quant import kv_pool_rows
from kernels.split_k import num_sms

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from kernels.attn_prep import _gate_store
    from kernels.pdl import enter as pdl_enter
    from kernels.rms_norm import _cast  # fp32 -> out dtype, round to nearest even (also under the interpreter)
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "paged_decode_attention"
GATED_NAME = "paged_decode_attention_gated_fp8"  # the attention, its output gate and o_proj's codes (below)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MIN_CAPABILITY = (8, 0)  # bf16 tensor cores
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # tl.dot needs >= 16; a [BLOCK_G, 256] fp32 accumulator is the register budget
MAX_GROUP = 32  # query heads per kv head in one tile (the model has 8); 32 x 256 fp32 = 32 KB of accumulator
MAX_SPLITS = 128  # an 8k context in 16-token blocks is 512 blocks: >= 4 blocks per split at the cap
# Many sequences (`launch_tiles`). H200, step 169 (forty-fifth session) and step 171 (forty-sixth: 16-64 streams x 1k
# context, Qwen's layer, the gated path, PDL on, splits 2-8 x BLOCK_N 32 / 64 x 4 / 8 warps): from 24 streams on the
# fastest were ~3 programs an SM at 4 warps -- 24 streams 8 splits 25.6 us a call against the lone rule's 38.2, 32
# streams 6 splits 31.2 against 39.6, 48 streams 4 splits 38.5 against 52.9, 64 streams 3 splits 47.3 against 55.7
# (all 32-token steps; 64-token steps were as fast at 32 streams only). So from MANY_PROGRAMS programs (D x KVH; then
# 48, 24 sequences at 2 kv heads) on: ~MANY_PER_SM programs an SM at MANY_WARPS warps. At 16 streams (32 programs) 8
# splits / 4 warps took 23.4 against the lone rule's 29.7, but the rule would give 12 splits there, untimed: not then.
# An H100 (fifty-fourth session, results/attn_fold54_run2 and attn_tiles54_run7, the combine launched): 16 streams 8
# splits / 4 warps 25.2-25.4 us against the lone rule's 31.83 (12 splits 24.36, 4 splits 27.5), 12 streams 8 splits
# 20.28 against the lone rule's 24.31 (12 splits 21.64), 20 streams 8 splits 27.8-28.2, 8 streams 8 splits 18.25 against
# the lone rule's 18.37 (12 splits 16.28); the engine at 16 streams 2,762.2 / 2,760.9 against 2,739.2 tok/s with the
# lone rule (+0.8%). So from MANY_PROGRAMS = 24 programs (12 sequences) on, at most MANY_MAX_SPLITS = 8 splits.
# None: the lone rule at every batch (benchmarks/qwen_gpu.py --attn-lone-tiles compares them in the engine).
MANY_PROGRAMS: int | None = 24
MANY_PER_SM, MANY_WARPS, MANY_MAX_SPLITS = 3, 4, 8
# e4m3 pools (kv_cache_dtype "fp8"): ~2 programs an SM. H100, fifty-eighth session (results/kvfp8_58_run1, 1k context,
# 32 streams, 10 layers in a graph, PDL): 4 splits / BLOCK_N 32 / 4 warps 32.21 us a call against 45.54 with the bf16
# pools' 6 splits (8 splits 37.18), where bf16 pools take 36.88 (6 splits) / 35.72 (their best, 4 splits at 8 warps)
MANY_PER_SM_E4M3 = 2
# A few sequences (`launch_tiles`: from FEW_PROGRAMS programs, 4 sequences at 2 kv heads, below MANY_PROGRAMS):
# ~FEW_PER_SM programs an SM at FEW_WARPS warps instead of the lone rule's ~one an SM at 8 warps. H100, fifty-ninth
# session (results/attn_lone59_run1; Qwen's layer, PDL, BLOCK_N 32, bf16 pools, splits 12-32 x 4 / 8 warps): 8 streams
# x 8k 16 splits / 4 warps 58.7 us a call against the lone rule's (9 splits, 8 warps) 84.5, 4 streams x 8k 32 splits
# 34.8 against 49.9 (17 splits); at 1k 16.1 against 19.2 and 12.4 against 13.4 -- the best of each of the four at ~2
# programs an SM and 4 warps. e4m3 pools the same (results/kvfp8_58_run1: 8 streams x 8k 16 splits / 4 warps 56.5 us
# against the lone rule's 104.7). 1-3 sequences keep the lone rule (lone decode's launch, not swept here). None: the
# lone rule up to MANY_PROGRAMS (benchmarks/qwen_gpu.py --attn-few-lone compares them in the engine).
FEW_PROGRAMS: int | None = 8
FEW_PER_SM, FEW_WARPS = 2, 4
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # x max |ref|, module docstring
LOG2E = 1.4426950408889634


# ---- reference ------------------------------------------------------------------------------------------------------
def paged_decode_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                                     scale: float) -> torch.Tensor:
    """Row by row (host loop, reads context_lens): gather sequence i's keys/values for positions 0..ctx-1 (as
    `qwen_engine.model.attention.gather_kv`), fp32 SDPA with GQA, cast to q.dtype. Shapes: module docstring."""
    bs, kvh, dh = k_pool.shape[1:]
    outs = []
    for i in range(q.shape[0]):
        ctx = int(context_lens[i])
        blocks = block_tables[i, : -(-ctx // bs)].long()
        k = kv_pool_rows(k_pool, blocks).reshape(-1, kvh, dh)[:ctx].transpose(0, 1)[None].float()  # [1, KVH, ctx, Dh]
        v = kv_pool_rows(v_pool, blocks).reshape(-1, kvh, dh)[:ctx].transpose(0, 1)[None].float()
        o = F.scaled_dot_product_attention(q[i][None, :, None].float(), k, v, scale=scale, enable_gqa=True)
        outs.append(o[0, :, 0])  # [H, Dh]
    return torch.stack(outs).to(q.dtype) if outs else q.new_empty(q.shape)


# ---- Triton kernel --------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _qk(q, k, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        """q [BG, Dh] @ k[BN, Dh]^T in fp32. The interpreter gets fp32 operands (bf16 dots: w4a16_gemm._mma); fp32
        inputs use ieee (tl.dot would otherwise round them to tf32)."""
        if INTERPRET:
            return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        if IEEE:
            return tl.dot(q, tl.trans(k), input_precision="ieee")
        return tl.dot(q, tl.trans(k))

    @triton.jit
    def _pv(p, v, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        """p [BG, BN] fp32 @ v [BN, Dh] in fp32; on a GPU with bf16/fp16 values p is rounded to v's dtype first."""
        if INTERPRET:
            return tl.dot(p, v.to(tl.float32), input_precision="ieee")
        if IEEE:
            return tl.dot(p, v, input_precision="ieee")
        return tl.dot(p.to(v.dtype), v)

    @triton.jit
    def _paged_decode_kernel(q, k_pool, v_pool, tables, ctx_lens, o_part, lse, qk_scale, G, BLOCK_SIZE,
                             s_qd, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_td, s_tb, s_cd,
                             s_od, s_oh, s_os, s_ld, s_lh,
                             HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                             IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                             USE_PDL: tl.constexpr = False):
        # grid (D, KVH, NUM_SPLITS); qk_scale = scale * log2(e): scores in log2 units, exp2 throughout
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        i, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ctx = tl.load(ctx_lens + i * s_cd).to(tl.int32)
        # tokens per split, whole blocks; the split count from the grid (runtime: no variant per count)
        per = tl.cdiv(tl.cdiv(ctx, BLOCK_SIZE), tl.num_programs(2)) * BLOCK_SIZE
        lo = split * per
        hi = tl.minimum(lo + per, ctx)  # lo >= hi: no keys in this split

        g = tl.arange(0, BLOCK_G)
        g_ok = g < G
        heads = kvh * G + g  # [BG] query heads of this kv head
        d = tl.arange(0, HEAD_DIM)
        q_t = tl.load(q + i * s_qd + heads[:, None] * s_qh + d[None, :], mask=g_ok[:, None], other=0.0)  # [BG, Dh]

        m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_G,), dtype=tl.float32)  # noqa: E741
        acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [BN] token positions
            ok = pos < hi
            blk = tl.load(tables + i * s_td + (pos // BLOCK_SIZE) * s_tb, mask=ok, other=0).to(tl.int64)
            off = pos % BLOCK_SIZE
            k_t = tl.load(k_pool + (blk * s_kb + off * s_kt + kvh * s_kh)[:, None] + d[None, :],
                          mask=ok[:, None], other=0.0).to(q.dtype.element_ty)  # [BN, Dh]; e4m3 pools: exact
            s = _qk(q_t, k_t, IEEE, INTERPRET) * qk_scale  # [BG, BN]
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every step has >= 1 visible position
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
            v_t = tl.load(v_pool + (blk * s_vb + off * s_vt + kvh * s_vh)[:, None] + d[None, :],
                          mask=ok[:, None], other=0.0).to(q.dtype.element_ty)  # [BN, Dh]
            acc = acc * alpha[:, None] + _pv(p, v_t, IEEE, INTERPRET)
            m = m_new

        has = l > 0.0  # False for an empty split (and for the padding rows only if the split is empty)
        o_t = acc / tl.where(has, l, 1.0)[:, None]
        lse_t = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) / 1.4426950408889634, float("-inf"))
        tl.store(o_part + i * s_od + heads[:, None] * s_oh + split * s_os + d[None, :], o_t, mask=g_ok[:, None])
        tl.store(lse + i * s_ld + heads * s_lh + split, lse_t, mask=g_ok)


    @triton.jit
    def _combine_kernel(o_part, lse, out, S, s_od, s_oh, s_os, s_ld, s_lh, s_outd, s_outh,
                        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                        INTERPRET: tl.constexpr, USE_PDL: tl.constexpr = False, gate=None, s_gd=0, s_gh=0, codes=None,
                        s_cd=0, s_in=None, GATE: tl.constexpr = False, QUANT: tl.constexpr = False):
        # grid (D, H, HEAD_DIM / BLOCK_D): `_combine` for one (row, head, Dh slice) -- the same fp32 operations, one
        # launch for all of them; a [BLOCK_S, BLOCK_D] fp32 tile (<= 128 x 64: no register spills).
        # GATE (`paged_decode_attention_gated`): the output gate too -- out [D, H * HEAD_DIM] = o * sigmoid(gate)
        # with gate [D, H, HEAD_DIM] (strides s_gd, s_gh), `attn_prep._gate_kernel`'s operations on the rounded o;
        # QUANT: and the e4m3 codes of that output with the static scale s_in (codes row stride s_cd)
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        i, h = tl.program_id(0), tl.program_id(1)
        sp = tl.arange(0, BLOCK_S)
        s_ok = sp < S
        d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        lv = tl.load(lse + i * s_ld + h * s_lh + sp, mask=s_ok, other=float("-inf"))  # [BS]
        # the partial outputs now, not after the weights' max and sum (reductions: CTA barriers, which later loads
        # do not cross): one L2 round trip for both loads
        op = tl.load(o_part + i * s_od + h * s_oh + sp[:, None] * s_os + d[None, :], mask=s_ok[:, None], other=0.0)
        if GATE:  # the gate slice in the same round trip (it does not depend on the sums)
            gv = tl.load(gate + i * s_gd + h * s_gh + d)
        top = tl.max(lv, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: weights exp(-inf) = 0, output 0
        if INTERPRET:  # numpy's exp; libdevice is not interpreted
            w = tl.exp(lv - top)
        else:  # torch's accurate expf, not tl.exp's ex2.approx
            w = libdevice.exp(lv - top)
        den = tl.sum(w, axis=0)
        den = tl.full((BLOCK_D,), 1.0, tl.float32) * tl.where(den > 0.0, den, 1.0)
        o = tl.div_rn(tl.sum(op * w[:, None], axis=0), den)
        if GATE:  # the output gate (`attn_prep._gate_store`) on the rounded o of this slice
            _gate_store(_cast(o, out.dtype.element_ty, INTERPRET), gv,
                        out + i * s_outd + h * HEAD_DIM + d, codes + i * s_cd + h * HEAD_DIM + d, s_in, d < HEAD_DIM,
                        out.dtype.element_ty, INTERPRET, QUANT)
        else:
            tl.store(out + i * s_outd + h * s_outh + d, _cast(o, out.dtype.element_ty, INTERPRET))


def _interpreted() -> bool:
    """True when the kernel was built by Triton's interpreter (TRITON_INTERPRET=1 at import): CPU tensors only."""
    return triton is not None and type(_paged_decode_kernel).__name__ == "InterpretedFunction"


def num_splits_for(programs: int, max_blocks: int, sms: int) -> int:
    """Splits of each sequence's blocks so that programs (= D x KVH) x splits reaches about one program per SM;
    never more than the table has blocks (a split holds >= 1 block) or MAX_SPLITS. Shapes only: graph-safe."""
    if programs >= sms:
        return 1
    return max(1, min(-(-sms // programs), max_blocks, MAX_SPLITS))


def launch_tiles(programs: int, max_blocks: int, sms: int, head_dim: int, block_size: int,
                 interpreted: bool = False, kv_bytes: int = 2) -> tuple[int, int, int]:
    """(splits, BLOCK_N, warps) of the kernel's launch for programs = D x KVH. Shapes only: graph-safe.
    Steps of 32 tokens (two 16 KB K / V tiles at Dh 256; 16 under the interpreter, the least tl.dot takes), never
    less than one KV block (a power of two: `supports`). Below FEW_PROGRAMS (the lone rule): `num_splits_for`'s ~one
    program an SM, 8 warps above Dh 128. From FEW_PROGRAMS: ~FEW_PER_SM programs an SM at FEW_WARPS warps. From
    MANY_PROGRAMS on: ~MANY_PER_SM programs an SM (at most MANY_MAX_SPLITS splits) at MANY_WARPS warps;
    ~MANY_PER_SM_E4M3 an SM for e4m3 pools (`kv_bytes` 1: bytes a pool element). Measured: the constants' comments."""
    block_n = max(16 if interpreted else 32, triton.next_power_of_2(block_size))
    if MANY_PROGRAMS is not None and programs >= MANY_PROGRAMS:
        per_sm = MANY_PER_SM_E4M3 if kv_bytes == 1 else MANY_PER_SM
        return max(1, min(round(per_sm * sms / programs), max_blocks, MANY_MAX_SPLITS)), block_n, MANY_WARPS
    if FEW_PROGRAMS is not None and programs >= FEW_PROGRAMS:
        return max(1, min(round(FEW_PER_SM * sms / programs), max_blocks, MAX_SPLITS)), block_n, FEW_WARPS
    return num_splits_for(programs, max_blocks, sms), block_n, 4 if head_dim <= 128 else 8


def combine_triton(o_part: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, gate: torch.Tensor | None = None,
                   input_scale: torch.Tensor | None = None):
    """`_combine(o_part, lse).to(dtype)` in one launch instead of ~11 (amax, exp, sums, where, div, cast) per
    attention layer. The same fp32 operations (accurate expf, IEEE division, one RNE rounding to `dtype`); the sums
    run in another order (fp32 ulps before the rounding). `gate` [D, H, Dh] (and `input_scale`): the output gate in
    the same launch -> (o * sigmoid(gate) [D, H * Dh], its e4m3 codes) as `attn_prep.attn_output_gate_fp8_op`."""
    nd, heads, splits, dh = o_part.shape
    gated = gate is not None
    out = torch.empty((nd, heads * dh) if gated else (nd, heads, dh), dtype=dtype, device=o_part.device)
    codes = torch.empty((nd, heads * dh), dtype=torch.float8_e4m3fn, device=o_part.device) if gated else out
    if out.numel():
        block_d = min(dh, 64)  # Dh is a power of two (supports())
        extra = {}
        if gated:
            extra = dict(gate=gate, s_gd=gate.stride(0), s_gh=gate.stride(1), codes=codes, s_cd=codes.stride(0),
                         s_in=input_scale.reshape(()).float(), GATE=True, QUANT=True)
        _combine_kernel[(nd, heads, dh // block_d)](
            o_part, lse, out, splits, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0),
            lse.stride(1), out.stride(0), out.stride(1) if not gated else 0, HEAD_DIM=dh,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, INTERPRET=_interpreted(), num_warps=4,
            **extra, **pdl.launch_options())
    return (out, codes) if gated else out


def _combine(o_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """o_part [D, H, S, Dh], lse [D, H, S] fp32 -> o [D, H, Dh] fp32 (static shapes, no host sync). Rows whose
    splits are all empty (context 0: CUDA-graph padding rows) give zeros instead of NaN. The reference of
    `combine_triton`, which the launch below uses."""
    if o_part.shape[2] == 1:
        return o_part[:, :, 0]
    top = lse.amax(-1, keepdim=True)
    w = torch.exp(lse - torch.where(torch.isfinite(top), top, 0.0))  # [D, H, S]; empty splits weigh 0
    den = w.sum(-1, keepdim=True)
    return (o_part * w[..., None]).sum(2) / torch.where(den > 0, den, 1.0)


def paged_decode_attention_launch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  num_splits: int | None = None, block_n: int | None = None,
                                  gate: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                                  num_warps: int | None = None):
    """The kernel plus the combine; `num_splits` / `block_n` / `num_warps` override the heuristics (tests,
    benchmarks: `benchmarks/paged_attention_bench.py`). `gate`,
    `input_scale`: the output gate and its codes too (`paged_decode_attention_gated_fp8_triton`'s contract), in the
    combine's launch when the heads are split, else by the gate op after the kernel."""
    nd, heads, dh = q.shape
    bs, kvh = k_pool.shape[1:3]
    group = heads // kvh
    max_blocks = block_tables.shape[1]
    splits, steps, warps = launch_tiles(nd * kvh, max_blocks, num_sms(q.device.index), dh, bs, _interpreted(),
                                        k_pool.element_size())
    num_splits, block_n, num_warps = num_splits or splits, block_n or steps, num_warps or warps
    o_part = torch.empty((nd, heads, num_splits, dh), dtype=torch.float32, device=q.device)
    lse = torch.empty((nd, heads, num_splits), dtype=torch.float32, device=q.device)
    if nd == 0:
        if gate is not None:
            return q.new_empty((0, heads * dh)), q.new_empty((0, heads * dh), dtype=torch.float8_e4m3fn)
        return q.new_empty(q.shape)
    _paged_decode_kernel[(nd, kvh, num_splits)](
        q, k_pool, v_pool, block_tables, context_lens, o_part, lse, scale * LOG2E, group, bs,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), block_tables.stride(0), block_tables.stride(1),
        context_lens.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        HEAD_DIM=dh, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, INTERPRET=_interpreted(),
        num_warps=num_warps, **pdl.launch_options())
    if num_splits == 1:
        o = o_part[:, :, 0].to(q.dtype)
        if gate is None:
            return o
        from kernels.attn_prep import attn_output_gate_fp8_op

        return attn_output_gate_fp8_op(o, gate, input_scale)
    return combine_triton(o_part, lse, q.dtype, gate, input_scale)


# ---- custom op (traceable by torch.compile) -------------------------------------------------------------------------
@torch.library.custom_op("qwen::paged_decode_attention", mutates_args=())
def paged_decode_attention_op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                              num_splits: int = 0) -> torch.Tensor:
    """q [D, H, Dh] -> o [D, H, Dh] in q.dtype; num_splits 0 = the heuristic."""
    for t in (q, k_pool, v_pool):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_decode_attention needs unit stride in the last dimension, got {t.stride()}")
    return paged_decode_attention_launch(q, k_pool, v_pool, block_tables, context_lens, scale,
                                         num_splits=num_splits or None)


@paged_decode_attention_op.register_fake
def _(q, k_pool, v_pool, block_tables, context_lens, scale, num_splits=0):
    return q.new_empty(q.shape)


def paged_decode_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  num_splits: int | None = None) -> torch.Tensor:
    """Same contract as `paged_decode_attention_reference`; `num_splits` overrides the heuristic (tests)."""
    return paged_decode_attention_op(q, k_pool, v_pool, block_tables, context_lens, scale, num_splits or 0)


@torch.library.custom_op("qwen::paged_decode_attention_gated_fp8", mutates_args=())
def paged_decode_attention_gated_fp8_op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                        block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                        gate: torch.Tensor, input_scale: torch.Tensor
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`paged_decode_attention_op`, then the output gate and o_proj's e4m3 codes (`attn_prep.attn_output_gate_fp8_op`)
    in the combine's launch: one launch fewer an attention layer wherever the heads are split (a decode step of up to
    66 sequences on an H200); contract: `paged_decode_attention_gated_fp8_reference`."""
    for t in (q, k_pool, v_pool, gate):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_decode_attention_gated_fp8 needs unit stride in the last dimension, got "
                             f"{t.stride()}")
    return paged_decode_attention_launch(q, k_pool, v_pool, block_tables, context_lens, scale, gate=gate,
                                         input_scale=input_scale)


@paged_decode_attention_gated_fp8_op.register_fake
def _(q, k_pool, v_pool, block_tables, context_lens, scale, gate, input_scale):
    n = q.shape[0]
    return q.new_empty((n, q.shape[1] * q.shape[2])), q.new_empty((n, q.shape[1] * q.shape[2]),
                                                                  dtype=torch.float8_e4m3fn)


def paged_decode_attention_gated_fp8_reference(q, k_pool, v_pool, block_tables, context_lens, scale: float, gate,
                                               input_scale):
    """`attn_prep.attn_output_gate_fp8_reference` of `paged_decode_attention_reference`'s output: (o * sigmoid(gate)
    [D, H * Dh] in q.dtype, its e4m3 codes with the static scale)."""
    from kernels.attn_prep import attn_output_gate_fp8_reference

    o = paged_decode_attention_reference(q, k_pool, v_pool, block_tables, context_lens, scale)
    return attn_output_gate_fp8_reference(o, gate, input_scale)


def paged_decode_attention_gated_fp8_triton(q, k_pool, v_pool, block_tables, context_lens, scale, gate, input_scale):
    """Same contract as `paged_decode_attention_gated_fp8_reference`."""
    return paged_decode_attention_gated_fp8_op(q, k_pool, v_pool, block_tables, context_lens, scale, gate,
                                               input_scale)


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(q, k_pool, v_pool, block_tables, context_lens, scale=None, num_splits=None) -> dict[str, Any]:
    ts = (q, k_pool, v_pool, block_tables, context_lens)
    shapes_ok = (q.dim() == 3 and k_pool.dim() == 4 and k_pool.shape == v_pool.shape
                 and k_pool.shape[3] == q.shape[2] and k_pool.shape[2] > 0 and q.shape[1] % k_pool.shape[2] == 0
                 and block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0]
                 and tuple(context_lens.shape) == (q.shape[0],))
    return dict(device=q.device.type, capability=torch.cuda.get_device_capability(q.device) if q.is_cuda else None,
                same_device=len({t.device for t in ts}) == 1, dtypes={q.dtype},
                pool_dtypes={k_pool.dtype, v_pool.dtype},
                index_dtypes={block_tables.dtype, context_lens.dtype}, shapes_ok=shapes_ok,
                head_dim=q.shape[-1] if q.dim() else 0,
                group=q.shape[1] // k_pool.shape[2] if shapes_ok else 0,
                unit_strides=all(t.stride(-1) == 1 for t in (q, k_pool, v_pool) if t.dim()))


def supports(*, device: str, capability, same_device: bool, dtypes: set, index_dtypes: set, shapes_ok: bool,
             head_dim: int, group: int, unit_strides: bool, pool_dtypes: set = frozenset(), **_: Any) -> bool:
    """Triton able to run on `device` (cuda >= sm_80, or the interpreter on CPU), all tensors on it; q of a dtype in
    DTYPES, k_pool and v_pool both of q's dtype or both e4m3 (`pool_dtypes`; absent: q's); int32/int64 block tables
    and context lengths; consistent shapes (H % KVH == 0); head dim
    a power of two (tl.arange) in [16, 256] (tl.dot minimum, register budget); <= MAX_GROUP query heads per kv head;
    unit inner strides of q and the pools."""
    if triton is None:
        return False
    e4m3 = pool_dtypes == {torch.float8_e4m3fn}  # compiled: sm_89+ (kernels/device.py E4M3_MIN_CAPABILITY)
    device_ok = triton_device_ok(device, capability, _interpreted(), E4M3_MIN_CAPABILITY if e4m3 else MIN_CAPABILITY)
    pools_ok = not pool_dtypes or pool_dtypes <= dtypes or e4m3
    return (device_ok and same_device and len(dtypes) == 1 and next(iter(dtypes)) in DTYPES and pools_ok
            and index_dtypes <= set(INDEX_DTYPES) and shapes_ok and unit_strides
            and MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0
            and 1 <= group <= MAX_GROUP)


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None) -> str | None:
    """None if max |out - ref| <= tol x max |ref|, tol from TOLERANCE by dtype (module docstring), else why."""
    return tolerance.compare(out, ref, TOLERANCE[ref.dtype] if tol is None else tol)  # NaN fails there too


def random_inputs(context_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                  dtype=torch.float32, seed: int = 0, device="cpu", extra_blocks: int = 2,
                  spare_blocks: int = 3) -> tuple:
    """(q, k_pool, v_pool, block_tables, context_lens, scale) for decode rows with the given context lengths.
    Each sequence owns distinct blocks, drawn in shuffled order from a pool with `spare_blocks` unused ones; the
    table is `extra_blocks` wider than the longest context needs, and every entry past a context holds a random
    (valid) block id: garbage that a correct kernel never reads."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in context_lens]
    max_blocks = max(need, default=0) + extra_blocks
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=gen)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used:used + n]
        used += n
    q = torch.randn(len(context_lens), heads, head_dim, generator=gen)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    return (q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device), tables.to(device),
            ctx.to(device), 1.0 / math.sqrt(head_dim))


def _sample(device) -> list[tuple[tuple, dict]]:
    # GQA 4, a context of one token, one at a block boundary, one past it; bf16 like the model; in an engine of e4m3
    # pools the same on e4m3 pools too (`fp8_quant.with_e4m3_pools`: the self-check covers the tile conversion such
    # an engine runs; below sm_89 e4m3 calls take the reference)
    from kernels.fp8_quant import with_e4m3_pools

    return with_e4m3_pools(random_inputs([1, 8, 21], heads=8, kv_heads=2, head_dim=32, block_size=4,
                                         dtype=torch.bfloat16, device=device), 1)


def describe_gated(q, k_pool, v_pool, block_tables, context_lens, scale=None, gate=None, input_scale=None
                   ) -> dict[str, Any]:
    from kernels.rms_norm import _scale_ok

    info = describe(q, k_pool, v_pool, block_tables, context_lens)
    return dict(info, gate_ok=gate is not None and gate.shape == q.shape and gate.dtype == q.dtype
                and gate.device == q.device and gate.stride(-1) == 1, scale_ok=_scale_ok(input_scale, q))


def supports_gated(*, gate_ok: bool, scale_ok: bool, **info: Any) -> bool:
    """`supports`, a gate of q's shape, dtype and device with a unit inner stride, and a one-element fp32 scale."""
    return gate_ok and scale_ok and supports(**info)


def compare_gated(out, ref) -> str | None:
    """The gated output by `compare`'s bound, its codes as `kernels.rms_norm.compare_fp8`'s (equal where the output
    is)."""
    from kernels.rms_norm import compare_fp8

    return compare_fp8(out, ref, TOLERANCE[ref[0].dtype])


def _sample_gated(device) -> list[tuple[tuple, dict]]:
    out = []
    for args, _ in _sample(device):  # bf16 pools, then e4m3 ones
        gen = torch.Generator().manual_seed(4)
        gate = (2 * torch.randn(args[0].shape, generator=gen)).to(args[0].dtype).to(device)
        out.append(((*args, gate, torch.tensor(0.004, device=device)), {}))
    return out


def register(registry) -> None:
    registry.add_op(NAME, paged_decode_attention_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="max |diff| <= 1e-2 x max |ref| for bf16/fp16 (output rounding 2^-9, p rounded for "
                              "the P V dot), 1e-5 for fp32 (fp32 math; summation order and exp ulps only)")
    registry.add_implementation(NAME, "triton", paged_decode_attention_triton, supports)
    registry.add_op(GATED_NAME, paged_decode_attention_gated_fp8_reference, sample=_sample_gated,
                    compare=compare_gated, describe=describe_gated,
                    tolerance="the attention's bound; the gate and codes as attn_output_gate_fp8's (equal to the "
                              "separate launches' bit for bit on the same attention output)")
    registry.add_implementation(GATED_NAME, "triton", paged_decode_attention_gated_fp8_triton, supports_gated)
