"""The MoE router's post-GEMM step in one Triton launch: softmax over the experts, top-k, renormalisation of the k
selected probabilities, cast to the model dtype.

Reference: `router_topk_reference` below is exactly `qwen_engine.model.moe.TopKRouter.forward` after its F.linear
(which mirrors transformers' `Qwen3_5MoeTopKRouter`):
    probs = softmax(logits, -1, dtype=fp32);   top, idx = topk(probs, k);   top /= top.sum(-1);   top.to(logits.dtype)
logits [N, E] (bf16 on the GPU, fp32 in CPU tests; unit last stride, rows may be strided) -> weights [N, k] in
logits.dtype summing to 1, idx [N, k] int64, both in descending order of weight. The model: E = 256 experts, k = 8.
Custom op `qwen::router_topk` (traceable by torch.compile); no host reads of device values and shapes that depend on
(N, k) only, so it can be captured in a CUDA graph. `extra` >= 0 appends one column (weight 1, expert `extra`) to both
outputs, written by the kernel: the shared expert as a (k+1)-th pair of the MoE launches (`SparseMoE`), where a
torch.cat and a fill per output had followed (H200, Qwen run 30, one run: 32 streams 2,765.7 -> 2,827.6 tok/s).

Why. On the H200 the reference is ~7 small kernels (softmax, gatherTopK, a bitonic sort, sum, div, two casts) per MoE
layer, 40 layers per decode step: ~280 launches of a few microseconds each for ~20 KB of data. This is 40.

Algorithm (one program per BLOCK_R rows x BLOCK_E = next_power_of_2(E) lanes, E <= MAX_EXPERTS, k <= MAX_TOP_K):
    l    = row of logits in fp32 (lanes >= E are never available);   key = l with NaN -> +inf
    for j in 0..k-1:  v_j = max(key over available lanes);   i_j = lowest available lane with key = v_j;
                      make i_j unavailable
    w_j  = exp(v_j - v_0) / sum_j' exp(v_j' - v_0)
Selecting on logits is selecting on probs: softmax is monotonic, so the k largest logits have the k largest probs.
The softmax denominator cancels in the renormalisation (p_j / sum p = e_j / sum e with e_j = exp(l_j - max)), so
only the k selected exps are computed and the other E - k lanes are never exponentiated. Everything stays in
registers: k x (one max + one min-index reduction over the row), then a [BLOCK_R, BLOCK_K] epilogue.
Order: descending value, ties broken by the lowest expert index (like a stable descending sort). torch.topk does not
promise an order among equal values (CPU and CUDA pick differently); `compare` accepts any choice among exact ties.

Numerics. Weights: one fp32 exp per selected logit (libdevice expf on the GPU, the accurate one torch's CUDA softmax
uses, not Triton's ex2.approx tl.exp), one fp32 sum of k terms, one IEEE division (tl.div_rn, not Triton's 2-ulp
div.full). The reference rounds once more per weight (its division by the full softmax sum, which cancels here) and
sums in another order, so fp32 weights differ from it by ~1 fp32 ulp before the cast to the model dtype (CPU,
4,000 rows x top-8 of E = 256: 63% of the weights differ, 16% by 2-5 ulps, max 5 ulps = 6e-7 relative; `compare`
allows 1e-6). In bf16 that flips the rounding of a weight by one bf16 ulp (2^-8 relative) only when the fp32 value
sits at a rounding boundary (none of those 32,000). Indices are exact wherever the selected values are not tied.
Selection on logits vs probs: distinct fp32 logits one ulp apart can round to equal probs, and the reference may then
order (or, at the k-th place, choose) them either way; an exact tie in every sense. bf16 logits (8 significand bits,
the model's case) tie exactly and often: 256 values of a few units share ~2^8 representable numbers per binade.
The interpreter truncates fp32 -> bf16 casts; under it the kernel rounds to nearest even with integer ops (`_cast`,
as kernels/rms_norm.py does), so CPU tests see the GPU's roundings.

Non-finite logits. No NaN or inf reaches an index: idx is always k distinct experts in [0, E) (masked lanes are never
available, and an available lane always matches the maximum, so every iteration selects one). NaN ranks as +inf:
first, as in torch.topk (NaN and +inf lanes by lowest index). A row with any NaN or +inf logit gets NaN weights, and
so does a row of all -inf, as in the reference (whose softmax is NaN for these rows). -inf logits in a finite row get
weight 0.

Napkin math (H200; E = 256, k = 8, bf16). Per row: read 512 B, write 8 x (2 + 8) = 80 B; 8 iterations x 2 warp
reductions over 8 lanes per thread (one warp per row) = ~16 shuffle trees, ~1-2 us of latency (unmeasured). Decode
(N <= 32 rows, one row per program): launch-bound, the saving is the ~6 launches per layer, ~240 per step.
Prefill (N = 8192): 4 MB read, ~1 us of bandwidth; rows are packed BLOCK_R per program from N = PACK_ROWS_FROM.

"router_gemv_topk": the router's F.linear fused in, for decode (N <= MAX_ROWS). x [N, H], W [E, H] (one dtype,
unit last strides) -> (logits [N, E] x.dtype, weights [N, k] x.dtype, idx [N, k] int64); reference
`router_gemv_topk_reference` = F.linear then `router_topk_reference`. At decode the F.linear is a cuBLAS GEMV of 1 MB
(E = 256, H = 2048, bf16) that is latency-bound: in the H200 profile of a lone decode step (Qwen run 9) 5.3 us per call
(~0.2 TB/s) and router_topk 2.6 us, x 40 layers ~0.32 ms of a ~4.3 ms step; router_bench_run2 times the pair at 8.55 us
in CUDA-graph replays. Here one launch (grid: E tiles x H splits x row blocks; `GPU_TILING`)
each reads a slab of W and writes fp32 partial logits to a workspace; the program of a row block that arrives
last (an int32 arrival counter per row block: `split_k.split_counters` and its `last_arrival` / `rearm`; re-armed
to 0 by that program, so CUDA-graph replays work) sums the partials in split order, rounds to x.dtype, stores the
logits and runs `_select_topk` -- router_topk's selection code -- on the rounded rows.
Numerics: logits are the fp32 sum of x*W (bf16 products exact in fp32) rounded once to x.dtype (`_cast`: RNE also
under the interpreter), i.e. F.linear's up to the fp32 summation order: within 1 ulp of x.dtype plus the fp32 bound
2 H 2^-24 (|x| @ |W|^T) of F.linear's (`compare_gemv`), bit-equal where the sums are exact. The top-k is computed from
the ROUNDED logits by the same code as router_topk: weights and idx are exactly router_topk's on the returned logits.
Napkin math: 1 MB over 128 programs x 8 KB, all loads in flight at once: ~1 us at DRAM latency, plus one arrival
atomic, the partials' read and the top-k of one row in the last program (~2 us): ~3-4 us. Measured 6.1 us against
8.6 us for the two launches (N = 1; MAX_ROWS' comment).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels import pdl
from kernels.device import triton_device_ok
from kernels.split_k import split_counters  # the per-device int32 arrival counters, zero between launches

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from kernels.pdl import enter as pdl_enter
    from kernels.pdl import prefetch_l2
    from kernels.rms_norm import _cast  # fp32 -> model dtype, round to nearest even (also under the interpreter)
    from kernels.split_k import last_arrival, rearm
except ImportError:  # CPU-only installs without triton: the reference works, supported() says no
    triton = None

NAME = "router_topk"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_CAPABILITY = (8, 0)  # bf16 loads and casts in hardware
MAX_EXPERTS = 1024  # a [BLOCK_R, BLOCK_E] fp32 tile in registers; the model has 256
MAX_TOP_K = 16  # k unrolled iterations of two reductions each; the model has 8
PACK_ROWS_FROM = 512  # N at which rows are packed several per program (below: one row per program, max parallelism)
TILE = 2048  # elements per program when packing rows (BLOCK_R x BLOCK_E)
RTOL = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # weights: |out - ref| <= rtol |ref|
ATOL = 1e-7  # weights: absolute slack for weights too small to matter (< 1e-7 of the row's total of 1)


# ---- reference ------------------------------------------------------------------------------------------------------
def router_topk_reference(logits: torch.Tensor, k: int, extra: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """`TopKRouter.forward` after the F.linear: (weights [N, k] logits.dtype, idx [N, k] int64). `extra` >= 0: one
    more column (weight 1, expert `extra`: the shared expert as a (k+1)-th pair, `SparseMoE`) -> [N, k + 1] each."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, k, dim=-1)
    return with_extra((top / top.sum(dim=-1, keepdim=True)).to(logits.dtype), idx, extra)


def with_extra(top: torch.Tensor, idx: torch.Tensor, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [N, k] -> [N, k + 1] with the column (1, `extra`) where `extra` >= 0, else as they are: in torch,
    what the kernel's HAS_EXTRA writes (the reference, and `TopKRouter` where the kernel does not run)."""
    if extra < 0:
        return top, idx
    n = idx.shape[0]
    return torch.cat((top, top.new_ones((n, 1))), 1), torch.cat((idx, idx.new_full((n, 1), extra)), 1)


# ---- Triton kernel --------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _select_topk(lf, avail, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr):
        """The module docstring's selection on rows of logits lf [BR, BE] (fp32, as rounded to the model dtype) where
        avail [BR, BE] marks the selectable lanes (never lanes >= E) -> (weights fp32 [BR, BK], expert ids int32
        [BR, BK]), descending, ties by lowest index; positions >= K hold garbage ids and weight 0. Shared by both
        kernels so the fused GEMV + top-k selects exactly as router_topk does."""
        cols = tl.arange(0, BLOCK_E)  # [BE]
        key = tl.where(lf != lf, float("inf"), lf)  # NaN ranks first (torch.topk's order); no NaN in reductions
        kk = tl.arange(0, BLOCK_K)  # [BK]
        e = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)  # exp(pick - max) at the picks' positions, 0 past K
        ids = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.int32)
        m = tl.zeros((BLOCK_R,), dtype=tl.float32)
        den = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for j in tl.static_range(K):
            cur = tl.where(avail, key, float("-inf"))
            mx = tl.max(cur, axis=1)  # [BR]
            # lowest available lane equal to the max: there is one (k <= E available lanes, all >= -inf)
            pick = tl.min(tl.where(avail & (cur == mx[:, None]), cols[None, :], BLOCK_E), axis=1)  # [BR]
            avail = avail & (cols[None, :] != pick[:, None])
            ids = tl.where(kk[None, :] == j, pick[:, None], ids)
            if j == 0:
                m = mx  # the row's max (picks never increase)
            term = _exp(mx - m, INTERPRET)  # [BR]
            e = tl.where(kk[None, :] == j, term[:, None], e)
            # the denominator summed in pick order, one term an iteration: the same fp32 sum whatever the layout and
            # warps (a tl.sum over the K lanes reduces in a tree that follows them: 1 and 4 warps rounded differently)
            den += term
        w = tl.div_rn(e, den[:, None])  # softmax denominator cancelled (module docstring)
        return w, ids

    @triton.jit
    def _exp(x, INTERPRET: tl.constexpr):
        if INTERPRET:  # numpy's exp; libdevice is not interpreted
            return tl.exp(x)
        else:  # accurate expf (tl.exp is ex2.approx on NVIDIA)
            return libdevice.exp(x)

    @triton.jit
    def _row_logits(logits, N, E, s_l, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
        """Program's rows of logits [N, E] (row stride s_l, unit column stride) in fp32 -> (rows [BR], rows < N,
        rows as int64, avail [BR, BE]: the selectable lanes, lf [BR, BE]); masked lanes' values are never looked at
        (not available). Shared by router_topk and kernels/router_align.py's kernel."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
        r_ok = rows < N
        cols = tl.arange(0, BLOCK_E)  # [BE]
        rows64 = rows.to(tl.int64)
        avail = (cols < E)[None, :] & (rows >= 0)[:, None]  # [BR, BE]: never lanes >= E
        lf = tl.load(logits + rows64[:, None] * s_l + cols[None, :], mask=r_ok[:, None] & avail,
                     other=0.0).to(tl.float32)
        return rows, r_ok, rows64, avail, lf

    @triton.jit
    def _store_topk(w_out, i_out, rows64, r_ok, w, ids, s_w, s_i, EXTRA, K: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_R: tl.constexpr, HAS_EXTRA: tl.constexpr, INTERPRET: tl.constexpr):
        """`_select_topk`'s weights (rounded to w_out's dtype) and ids of rows rows64 [BR] (r_ok: those < N) into
        w_out / i_out (row strides s_w, s_i); HAS_EXTRA: column K = (1, EXTRA), the shared expert's pair."""
        kk = tl.arange(0, BLOCK_K)
        ok = r_ok[:, None] & (kk < K)[None, :]
        tl.store(w_out + rows64[:, None] * s_w + kk[None, :], _cast(w, w_out.dtype.element_ty, INTERPRET), mask=ok)
        tl.store(i_out + rows64[:, None] * s_i + kk[None, :], ids.to(tl.int64), mask=ok)
        if HAS_EXTRA:
            tl.store(w_out + rows64 * s_w + K, tl.full((BLOCK_R,), 1.0, tl.float32).to(w_out.dtype.element_ty),
                     mask=r_ok)
            tl.store(i_out + rows64 * s_i + K, tl.full((BLOCK_R,), EXTRA, tl.int64), mask=r_ok)

    @triton.jit
    def _router_topk_kernel(logits, w_out, i_out, N, E, s_l, s_w, s_i, EXTRA, K: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr,
                            HAS_EXTRA: tl.constexpr = False, USE_PDL: tl.constexpr = False):
        # grid (cdiv(N, BLOCK_R),); logits [N, E] with row stride s_l and unit column stride; outputs [N, K] (HAS_EXTRA:
        # [N, K + 1], column K = (1, EXTRA): the shared expert's pair, so no torch.cat / fill launches follow)
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        rows, r_ok, rows64, avail, lf = _row_logits(logits, N, E, s_l, BLOCK_R, BLOCK_E)
        w, ids = _select_topk(lf, avail, K, BLOCK_K, BLOCK_R, BLOCK_E, INTERPRET)
        _store_topk(w_out, i_out, rows64, r_ok, w, ids, s_w, s_i, EXTRA, K, BLOCK_K, BLOCK_R, HAS_EXTRA, INTERPRET)

    @triton.jit
    def _router_gemv_topk_kernel(x, w, logits, w_out, i_out, ws, counters, N, E, H, s_x, s_w,
                                 K: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, REDUCE: tl.constexpr,
                                 BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                                 BLOCK_EF: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr = False,
                                 PREFETCH: tl.constexpr = False):
        # grid (cdiv(E, BLOCK_E), SPLIT, cdiv(N, BLOCK_R)); x [N, H] (row stride s_x), w [E, H] (row stride s_w),
        # unit last strides; logits [N, E], w_out / i_out [N, K] contiguous; ws [SPLIT, N, E] fp32; counters: one
        # int32 per row block, 0 between launches.
        # Each program: the fp32 partial logits of BLOCK_R rows x BLOCK_E experts over its share of the H tiles ->
        # ws[split]. REDUCE: the program of a row block that arrives last (of E tiles x SPLIT) sums the SPLIT partials
        # of the whole rows in split order (deterministic), rounds them to the model dtype, stores the logits, selects
        # the top-k of the rounded rows (`_select_topk`) and re-arms the counter; no launch of its own.
        # PREFETCH (kernels/pdl.py, with PDL): the program's slice of its experts' weight rows into L2 before the wait.
        pid_e, pid_s, pid_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
        r_ok = rows < N
        ex = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE]
        e_ok = ex < E
        hh = tl.arange(0, BLOCK_H)  # [BH]
        h_tiles = tl.cdiv(H, BLOCK_H)
        per = tl.cdiv(h_tiles, SPLIT)
        t0 = pid_s * per
        if PREFETCH:  # hidden elements [t0 BH, min((t0 + per) BH, H)) of each expert row, in bytes
            nh = tl.minimum((t0 + per) * BLOCK_H, H) - t0 * BLOCK_H
            nbytes = nh * (w.dtype.element_ty.primitive_bitwidth // 8)
            prefetch_l2(w + ex.to(tl.int64) * s_w + t0 * BLOCK_H, tl.where(e_ok, nbytes, 0))
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        acc = tl.zeros((BLOCK_R, BLOCK_E), dtype=tl.float32)
        for t in range(t0, tl.minimum(t0 + per, h_tiles)):
            hs = t * BLOCK_H + hh
            h_ok = hs < H
            xt = tl.load(x + rows[:, None] * s_x + hs[None, :], mask=r_ok[:, None] & h_ok[None, :],
                         other=0.0).to(tl.float32)  # [BR, BH]
            wt = tl.load(w + ex[:, None] * s_w + hs[None, :], mask=e_ok[:, None] & h_ok[None, :],
                         other=0.0).to(tl.float32)  # [BE, BH]
            acc += tl.sum(xt[:, None, :] * wt[None, :, :], axis=2)  # bf16 x bf16 products are exact in fp32
        part = ws + rows[:, None] * E  # [BR, 1]: row starts of split 0
        tl.store(part + pid_s * N * E + ex[None, :], acc, mask=r_ok[:, None] & e_ok[None, :])
        if REDUCE:
            if last_arrival(counters, pid_r, tl.num_programs(0) * SPLIT):  # last of this row block: all partials seen
                cols = tl.arange(0, BLOCK_EF)  # [BEF]: the whole row
                c_ok = cols < E
                ok = r_ok[:, None] & c_ok[None, :]
                tot = tl.zeros((BLOCK_R, BLOCK_EF), dtype=tl.float32)
                for p in tl.static_range(SPLIT):  # ".cg": L2, never a stale L1 line
                    tot += tl.load(part + p * N * E + cols[None, :], mask=ok, other=0.0, cache_modifier=".cg")
                lr = _cast(tot, logits.dtype.element_ty, INTERPRET)  # the logits F.linear would return
                tl.store(logits + rows[:, None] * E + cols[None, :], lr, mask=ok)
                avail = c_ok[None, :] & (rows >= 0)[:, None]
                wts, ids = _select_topk(lr.to(tl.float32), avail, K, BLOCK_K, BLOCK_R, BLOCK_EF, INTERPRET)
                kk = tl.arange(0, BLOCK_K)
                k_ok = r_ok[:, None] & (kk < K)[None, :]
                tl.store(w_out + rows[:, None] * K + kk[None, :], _cast(wts, w_out.dtype.element_ty, INTERPRET),
                         mask=k_ok)
                tl.store(i_out + rows[:, None] * K + kk[None, :], ids.to(tl.int64), mask=k_ok)
                rearm(counters, pid_r)


if triton is not None:

    @triton.jit
    def _router_parts_kernel(x, w, ws, N, E, H, s_x, s_w, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                             BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr = False,
                             EARLY: tl.constexpr = False):
        # grid (cdiv(E, BLOCK_E), cdiv(H, BLOCK_H)); x [N, H] (row stride s_x), w [E, H] (row stride s_w), unit last
        # strides, N <= BLOCK_R; ws [cdiv(H, BLOCK_H), N, E] fp32. One program: the fp32 partial logits of every row x
        # BLOCK_E experts over one H tile, x tile @ w tile^T on the tensor cores (bf16 products exact in fp32).
        # EARLY (with PDL; `pdl.early_options`): the weight tile is loaded BEFORE the wait -- no kernel writes the
        # router's weight --, so its DRAM read overlaps the predecessor (the norm that writes x); x after it.
        if not EARLY:
            pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        pid_e, pid_h = tl.program_id(0), tl.program_id(1)
        ex = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE]
        hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
        e_ok, h_ok = ex < E, hs < H
        wt = tl.load(w + ex[:, None].to(tl.int64) * s_w + hs[None, :], mask=e_ok[:, None] & h_ok[None, :],
                     other=0.0)  # [BE, BH]
        if EARLY:
            pdl_enter(USE_PDL)  # now x (the predecessor's output) and the store
        rows = tl.arange(0, BLOCK_R)
        r_ok = rows < N
        xt = tl.load(x + rows[:, None].to(tl.int64) * s_x + hs[None, :], mask=r_ok[:, None] & h_ok[None, :],
                     other=0.0)  # [BR, BH]
        if INTERPRET:  # the interpreter's dot reads 16-bit floats as integers: widen first (the products are exact)
            acc = tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)))
        else:
            acc = tl.dot(xt, tl.trans(wt))  # [BR, BE] fp32
        tl.store(ws + (pid_h * N + rows[:, None]).to(tl.int64) * E + ex[None, :], acc,
                 mask=r_ok[:, None] & e_ok[None, :])

    @triton.jit
    def _row_parts(ws, logits, N, E, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                   INTERPRET: tl.constexpr):
        """`_row_logits` over the router GEMM's fp32 partials ws [SPLIT, N, E] (`_router_parts_kernel`): the program's
        rows summed in split order, rounded once to the model dtype (logits' dtype: the logits a GEMM with fp32 sums
        would return), stored into logits [N, E] (contiguous) -> the same tuple, lf as rounded, widened to fp32.
        Shared by the top-k over the partials and kernels/router_align.py's kernel on them."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
        r_ok = rows < N
        rows64 = rows.to(tl.int64)
        cols = tl.arange(0, BLOCK_E)
        avail = (cols < E)[None, :] & (rows >= 0)[:, None]  # [BR, BE]: never lanes >= E
        ok = r_ok[:, None] & avail
        tot = tl.zeros((BLOCK_R, BLOCK_E), dtype=tl.float32)
        for p in tl.static_range(SPLIT):
            tot += tl.load(ws + (p * N + rows64[:, None]) * E + cols[None, :], mask=ok, other=0.0)
        lr = _cast(tot, logits.dtype.element_ty, INTERPRET)
        tl.store(logits + rows64[:, None] * E + cols[None, :], lr, mask=ok)
        return rows, r_ok, rows64, avail, lr.to(tl.float32)

    @triton.jit
    def _router_parts_topk_kernel(ws, logits, w_out, i_out, N, E, s_w, s_i, EXTRA, K: tl.constexpr,
                                  BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, SPLIT: tl.constexpr,
                                  INTERPRET: tl.constexpr, HAS_EXTRA: tl.constexpr = False,
                                  USE_PDL: tl.constexpr = False):
        # grid (N,): row r sums its SPLIT fp32 partials ws[p, r, :] in split order, rounds them once to the model
        # dtype (the logits, stored), then router_topk's selection on them (`_select_topk`) and its stores
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        rows, r_ok, rows64, avail, lf = _row_parts(ws, logits, N, E, SPLIT, 1, BLOCK_E, INTERPRET)  # one row
        w, ids = _select_topk(lf, avail, K, BLOCK_K, 1, BLOCK_E, INTERPRET)
        _store_topk(w_out, i_out, rows64, r_ok, w, ids, s_w, s_i, EXTRA, K, BLOCK_K, 1, HAS_EXTRA, INTERPRET)


def _interpreted() -> bool:
    """True when the kernel was built by Triton's interpreter (TRITON_INTERPRET=1 at import): CPU tensors only."""
    return triton is not None and type(_router_topk_kernel).__name__ == "InterpretedFunction"


def _tiling(n: int, e: int) -> dict[str, int]:
    """One row per program below PACK_ROWS_FROM rows (decode: every row its own SM); above, ~TILE elements per
    program. One warp per 512 elements (8-16 lanes per thread), 1-4 warps."""
    block_e = triton.next_power_of_2(e)
    if _interpreted():  # the interpreter's cost is per program (~30 ms), not per lane: all rows in a few programs
        block_r = min(triton.next_power_of_2(n), max(1, 2**14 // block_e))
    else:
        block_r = 1 if n < PACK_ROWS_FROM else max(1, TILE // block_e)
    return dict(BLOCK_R=block_r, BLOCK_E=block_e, num_warps=min(4, max(1, block_r * block_e // 512)))


def _launch(logits: torch.Tensor, k: int, block_r: int | None = None, extra: int = -1
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel call; `block_r` overrides the rows per program (tests exercise packing at small N); `extra` >= 0:
    the extra column of `router_topk_reference`, written by the kernel."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"router_topk needs 2-D logits with unit last stride, got {tuple(logits.shape)} strides "
                         f"{logits.stride()}")
    n, e = logits.shape
    if not 1 <= k <= min(e, MAX_TOP_K) or e > MAX_EXPERTS:
        raise ValueError(f"router_topk needs 1 <= k <= min(E, {MAX_TOP_K}) and E <= {MAX_EXPERTS}, got k={k} E={e}")
    width = k + (extra >= 0)
    weights = logits.new_empty((n, width))
    idx = torch.empty((n, width), dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, idx
    cfg = _tiling(n, e)
    if block_r is not None:
        cfg["BLOCK_R"] = block_r
    _router_topk_kernel[(triton.cdiv(n, cfg["BLOCK_R"]),)](
        logits, weights, idx, n, e, logits.stride(0), weights.stride(0), idx.stride(0), max(extra, 0), K=k,
        BLOCK_K=triton.next_power_of_2(k), INTERPRET=_interpreted(), HAS_EXTRA=extra >= 0, **cfg,
        **pdl.launch_options())
    return weights, idx


# ---- custom op (traceable by torch.compile) -------------------------------------------------------------------------
@torch.library.custom_op("qwen::router_topk", mutates_args=())
def router_topk_op(logits: torch.Tensor, k: int, extra: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k] logits.dtype, idx [N, k] int64), [N, k + 1] with `extra` >= 0; contract:
    `router_topk_reference`."""
    return _launch(logits, k, extra=extra)


@router_topk_op.register_fake
def _(logits, k, extra=-1):
    width = k + (extra >= 0)
    return logits.new_empty((logits.shape[0], width)), logits.new_empty((logits.shape[0], width), dtype=torch.int64)


def router_topk_triton(logits: torch.Tensor, k: int, extra: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `router_topk_reference` (ties: lowest expert index first)."""
    return router_topk_op(logits, k, extra)


# ---- guard, comparison, inputs --------------------------------------------------------------------------------------
def supported(logits: torch.Tensor, k: int) -> bool:
    """Triton able to run here (CUDA >= sm_80, or the interpreter on CPU); logits 2-D [N, E] with unit last stride
    (rows may be strided), dtype in DTYPES; 1 <= k <= min(E, MAX_TOP_K) and E <= MAX_EXPERTS (one register tile)."""
    if triton is None or not isinstance(logits, torch.Tensor):
        return False
    cap = torch.cuda.get_device_capability(logits.device) if logits.is_cuda else None
    if (not triton_device_ok(logits.device.type, cap, _interpreted(), MIN_CAPABILITY) or logits.dim() != 2
            or logits.dtype not in DTYPES):
        return False
    e = logits.shape[1]
    return logits.stride(1) == 1 and 1 <= e <= MAX_EXPERTS and 1 <= int(k) <= min(e, MAX_TOP_K)


def compare(out, ref, logits: torch.Tensor | None = None) -> str | None:
    """None if `out` = (weights, idx) is a correct answer where `ref` is the reference's, else why.

    Weights, position by position (both are in descending order, so position j holds the j-th largest selected value
    even where tied experts were chosen differently): |out - ref| <= RTOL[dtype] x |ref| + ATOL, i.e. one unit in
    the last place of bf16/fp16 (eps x |ref| >= 1 ulp), ~8 fp32 ulps (1e-6) for fp32. NaN anywhere fails.
    (kernels/tolerance.py's compare scales by max |ref| over the whole tensor: too loose for small weights and
    tighter than one bf16 ulp for the largest, so it is not used.)
    Indices: k distinct experts per row, non-negative (< E with logits), and
      - with `logits` (exact): the reference's probs (softmax in fp32, as it computes them) gathered at our idx equal,
        position by position, those gathered at its idx -- our experts are a top-k and in order -- and at every
        position whose value is not tied with any other expert of the row the expert itself must match;
      - without: the expert must match at every position whose reference weight is unique among the row's k weights
        (ties between a selected and an unselected expert cannot be seen then: pass logits where they can occur,
        e.g. bf16 logits)."""
    (w, i), (rw, ri) = out, ref
    for name, a, b in (("weights", w, rw), ("idx", i, ri)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} != {tuple(b.shape)} {b.dtype}"
    if i.numel() == 0:
        return None
    wf, rf = w.float(), rw.float()
    if torch.isnan(wf).any() or torch.isnan(rf).any():
        return "NaN in the weights"
    err = (wf - rf).abs()
    bad = err > RTOL[rw.dtype] * rf.abs() + ATOL
    if bad.any():
        r, j = (int(v) for v in bad.nonzero()[0])
        return (f"weights: row {r} position {j}: {float(wf[r, j]):.9g} vs reference {float(rf[r, j]):.9g} "
                f"(> {RTOL[rw.dtype]:.3g} relative; {int(bad.sum())} such)")
    if (i < 0).any() or (logits is not None and (i >= logits.shape[-1]).any()):
        return "idx: expert index out of range"
    srt = i.sort(dim=-1).values
    if (srt[:, 1:] == srt[:, :-1]).any():
        return "idx: an expert selected twice in a row"
    if logits is not None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        po, pr = probs.gather(1, i.to(probs.device)), probs.gather(1, ri.to(probs.device))
        wrong = po != pr
        if wrong.any():
            r, j = (int(v) for v in wrong.nonzero()[0])
            return (f"idx: row {r} position {j}: expert {int(i[r, j])} (prob {float(po[r, j]):.9g}) where the "
                    f"reference has expert {int(ri[r, j])} (prob {float(pr[r, j]):.9g}): not the top-k in order")
        unique = (probs[:, None, :] == pr[:, :, None]).sum(-1) == 1  # [N, k]: value not tied with any expert
    else:
        unique = (rw[:, None, :] == rw[:, :, None]).sum(-1) == 1  # [N, k]: weight unique among the k
    mismatch = unique & (i != ri)
    if mismatch.any():
        r, j = (int(v) for v in mismatch.nonzero()[0])
        return f"idx: row {r} position {j}: expert {int(i[r, j])}, reference {int(ri[r, j])} (value not tied)"
    return None


def random_logits(n: int, e: int, seed: int = 0, dtype=torch.float32, ties: bool = False,
                  device="cpu") -> torch.Tensor:
    """Model-like router logits [N, E] in `dtype`: ~N(0, 1.5) per expert, plus a per-expert popularity bias ~N(0, 1)
    shared by the rows (some experts are hot) and a per-row offset (softmax ignores it; the kernel must too).
    ties=True: values on a coarse grid (multiples of 0.5 in [-4, 1.5], exact in bf16), so the top-k of every row is
    full of exact ties, at the k-th boundary too; with >= 2 rows the last row is all zeros (the zero-initialised
    router of a fresh model: every expert tied)."""
    gen = torch.Generator().manual_seed(seed)
    if ties:
        x = torch.randint(-8, 4, (n, e), generator=gen).float() * 0.5
        if n >= 2:
            x[-1] = 0.0
    else:
        bias = torch.randn(e, generator=gen)
        x = 1.5 * torch.randn(n, e, generator=gen) + bias + 3.0 * torch.randn(n, 1, generator=gen)
    return x.to(dtype).to(device)


# ---- the router GEMV fused with the top-k ("router_gemv_topk") ----------------------------------------------------
GEMV_NAME = "router_gemv_topk"
# Measured on the H200 (2026-11-30, results/router_bench_run1; E 256, H 2048, bf16, CUDA-graph replays over 100
# weight copies): F.linear + router_topk 8.6 / 8.6 / 8.8 us at N = 1 / 4 / 32; this op 6.1 us (N = 1) and 6.6 us
# (N = 4) with GPU_TILING, the best of 11 tilings at both; at N = 32 every tiling lost (12.9-30 us): MAX_ROWS = 4.
MAX_ROWS = 4  # decode-sized N (the decode graphs' 1 / 2 / 4 buckets); above, F.linear + router_topk
GPU_TILING = dict(BLOCK_E=16, BLOCK_H=256, SPLIT=8, num_warps=1)


def router_gemv_topk_reference(x: torch.Tensor, w: torch.Tensor, k: int
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`TopKRouter.forward` whole: logits = F.linear(x, w) [N, E] in x.dtype, then `router_topk_reference` on them."""
    logits = F.linear(x, w)
    weights, idx = router_topk_reference(logits, k)
    return logits, weights, idx


def _gemv_tiling(n: int, e: int, h: int) -> dict[str, int]:
    """Grid (E tiles, SPLIT, row blocks). On the GPU, GPU_TILING: one row per program, 16 experts x 256 of H x 8
    splits, one warp (E = 256, H = 2048, N = 1: 128 programs of 8 KB; N = 4: 512). The epilogue holds BLOCK_R whole
    rows [BLOCK_R, next_power_of_2(E)]."""
    block_ef = triton.next_power_of_2(e)
    if _interpreted():  # the interpreter's cost is per program: a few big ones (tests pass explicit tilings too)
        block_r, block_e = min(triton.next_power_of_2(max(n, 1)), MAX_ROWS), min(block_ef, 64)
        block_h = min(triton.next_power_of_2(h), 64)
        return dict(BLOCK_R=block_r, BLOCK_E=block_e, BLOCK_H=block_h, SPLIT=min(2, triton.cdiv(h, block_h)),
                    num_warps=1)
    t = GPU_TILING
    block_h = min(t["BLOCK_H"], triton.next_power_of_2(h))
    h_tiles = triton.cdiv(h, block_h)
    split = min(t["SPLIT"], h_tiles)
    split = triton.cdiv(h_tiles, triton.cdiv(h_tiles, split))  # no split without an H tile
    return dict(BLOCK_R=1, BLOCK_E=min(block_ef, t["BLOCK_E"]), BLOCK_H=block_h, SPLIT=split,
                num_warps=t["num_warps"])


def _gemv_check(x: torch.Tensor, w: torch.Tensor, k: int) -> str | None:
    """Why (x, w, k) is outside the launcher's contract, or None."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        return f"needs x [N, H] and w [E, H], got {tuple(x.shape)} and {tuple(w.shape)}"
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        return f"needs unit last strides, got x {x.stride()} w {w.stride()}"
    if x.dtype != w.dtype or x.dtype not in DTYPES or x.device != w.device:
        return f"needs x and w of one dtype in {DTYPES} on one device, got {x.dtype} {x.device}, {w.dtype} {w.device}"
    e = w.shape[0]
    if not 1 <= k <= min(e, MAX_TOP_K) or e > MAX_EXPERTS:
        return f"needs 1 <= k <= min(E, {MAX_TOP_K}) and E <= {MAX_EXPERTS}, got k={k} E={e}"
    return None


def _launch_gemv(x: torch.Tensor, w: torch.Tensor, k: int, config: dict | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernel call; `config` overrides `_gemv_tiling` (tests, benchmark sweeps). Without arrival counters
    (`split_k.split_counters`: none yet inside a CUDA-graph capture) the kernel writes the partials only, torch
    sums them and router_topk selects (same rounded logits up to the fp32 order of the split sum)."""
    problem = _gemv_check(x, w, k)
    if problem:
        raise ValueError(f"router_gemv_topk {problem}")
    n, h = x.shape
    e = w.shape[0]
    logits = x.new_empty((n, e))
    weights = x.new_empty((n, k))
    idx = torch.empty((n, k), dtype=torch.int64, device=x.device)
    if n == 0:
        return logits, weights, idx
    cfg = {**_gemv_tiling(n, e, h), **(config or {})}
    r_blocks = triton.cdiv(n, cfg["BLOCK_R"])
    counters = split_counters(x.device, r_blocks)
    ws = torch.empty((cfg["SPLIT"], n, e), dtype=torch.float32, device=x.device)
    _router_gemv_topk_kernel[(triton.cdiv(e, cfg["BLOCK_E"]), cfg["SPLIT"], r_blocks)](
        x, w, logits, weights, idx, ws, counters if counters is not None else ws, n, e, h, x.stride(0), w.stride(0),
        K=k, BLOCK_K=triton.next_power_of_2(k), REDUCE=counters is not None,
        BLOCK_EF=triton.next_power_of_2(e), INTERPRET=_interpreted(), **cfg, **pdl.launch_options(),
        **pdl.prefetch_options(pdl.aligned16(w.data_ptr(), *(v * w.element_size()
                                                             for v in (w.stride(0), h, cfg["BLOCK_H"])))))
    if counters is None:
        logits = ws.sum(0).to(x.dtype)
        weights, idx = _launch(logits, k)
    return logits, weights, idx


@torch.library.custom_op("qwen::router_gemv_topk", mutates_args=())
def router_gemv_topk_op(x: torch.Tensor, w: torch.Tensor, k: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H], w [E, H] -> (logits [N, E], weights [N, k] in x.dtype, idx [N, k] int64); contract:
    `router_gemv_topk_reference` (`compare_gemv`)."""
    return _launch_gemv(x, w, k)


@router_gemv_topk_op.register_fake
def _(x, w, k):
    n, e = x.shape[0], w.shape[0]
    return x.new_empty((n, e)), x.new_empty((n, k)), x.new_empty((n, k), dtype=torch.int64)


def router_gemv_topk_triton(x: torch.Tensor, w: torch.Tensor, k: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `router_gemv_topk_reference` (see `compare_gemv`; ties: lowest expert index first)."""
    return router_gemv_topk_op(x, w, k)


def _gemv_inputs_ok(x: torch.Tensor, w: torch.Tensor, k: int) -> bool:
    """Triton able to run on x's device (as `supported`); x [N, H] and w [E, H] of one dtype in DTYPES, unit last
    strides (rows may be strided); 1 <= k <= min(E, MAX_TOP_K), E <= MAX_EXPERTS. Any H (masked), any N."""
    if triton is None or not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return False
    cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
    if not triton_device_ok(x.device.type, cap, _interpreted(), MIN_CAPABILITY):
        return False
    return _gemv_check(x, w, int(k)) is None


def supported_gemv(x: torch.Tensor, w: torch.Tensor, k: int) -> bool:
    """The fused kernel's guard: `_gemv_inputs_ok` and N <= MAX_ROWS (decode sizes, where it was measured faster)."""
    return _gemv_inputs_ok(x, w, k) and x.shape[0] <= MAX_ROWS


def linear_then_router_topk(x: torch.Tensor, w: torch.Tensor, k: int, extra: int = -1
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op in two launches, F.linear (cuBLAS) then the router_topk kernel: what a decode step ran before the fused
    kernel, and its fallback (without it a disabled fused kernel meant the op's reference, plain torch softmax /
    top-k: 24.7 us per call on the H200 against 8.6, results/router_bench_run2). Logits are F.linear's exactly.
    Also "router_linear_topk"'s fallback, with its `extra` column (written by the router_topk kernel)."""
    logits = F.linear(x, w)
    weights, idx = router_topk_triton(logits, k, extra)
    return logits, weights, idx


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at |v| (fp32 tensor; normal numbers; the smallest normal's below)."""
    fi = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(fi.tiny)))) * fi.eps


def compare_gemv(out, ref, x: torch.Tensor | None = None, w: torch.Tensor | None = None) -> str | None:
    """None if `out` = (logits, weights, idx) is a correct answer where `ref` is the reference's, else why.

    Logits: |out - ref| <= 1 ulp of the dtype at |ref| + slack, where slack covers two fp32 summation orders:
    2 H 2^-24 (|x| @ |w|^T) with the inputs (the worst-case bound of a length-H fp32 dot product, for each of the
    two), else 0 (then use inputs whose sums are exact: small integers, as `_gemv_sample` does). Both round the fp32
    sum to nearest, so with equal sums they are equal, and an fp32 difference d gives at most d + 1 ulp.
    Weights and idx: `compare` against `router_topk_reference` on OUR logits -- the selection is exactly
    router_topk's on the logits this op returns (the reference's own top-k may differ where a logit differs by an
    ulp)."""
    (lo, wo, io), (lr, wr, ir) = out, ref
    for name, a, b in (("logits", lo, lr), ("weights", wo, wr), ("idx", io, ir)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} != {tuple(b.shape)} {b.dtype}"
    a, b = lo.float(), lr.float()
    if (torch.isnan(a) != torch.isnan(b)).any():
        return "logits: NaN where the reference has none (or the other way round)"
    tol = _ulp(b, lr.dtype)
    if x is not None and w is not None:
        tol = tol + 2 * x.shape[1] * 2.0**-24 * (x.float().abs() @ w.float().abs().t())
    fin = torch.isfinite(b)
    bad = (fin & ~((a - b).abs() <= tol)) | (~fin & ~torch.isnan(b) & (a != b))  # +-inf: equal
    if bad.any():
        r, j = (int(v) for v in bad.nonzero()[0])
        return (f"logits: row {r} expert {j}: {float(a[r, j]):.9g} vs reference {float(b[r, j]):.9g} "
                f"(> {float(tol[r, j]):.3g}; {int(bad.sum())} such)")
    k = wo.shape[1]
    problem = compare((wo, io), router_topk_reference(lo, k), lo)
    return None if problem is None else f"top-k of the kernel's own logits: {problem}"


def describe_gemv(x: torch.Tensor, w: torch.Tensor, k: int) -> dict[str, Any]:
    return dict(device=x.device.type, rows=x.shape[0] if x.dim() == 2 else None, supported=supported_gemv(x, w, k),
                two_launch=_gemv_inputs_ok(x, w, k))


def supports_two_launch(*, two_launch: bool, **_: Any) -> bool:
    return two_launch


def _small_int_router_inputs(rows: int, h: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, h] and w [60, h] of small integers in [-2, 2] as bf16 (the registry samples of the router GEMM ops):
    every fp32 sum is exact (|sum| <= 4 h), so any summation order gives F.linear's logits bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (rows, h), generator=gen).to(torch.bfloat16)
    w = torch.randint(-2, 3, (60, h), generator=gen).to(torch.bfloat16)
    return x.to(device), w.to(device)


def _gemv_sample(device) -> tuple[tuple, dict]:
    # small integers: every fp32 sum is exact (|sum| <= 2 x 2 x 72 = 288), and both sides round the same sum to bf16,
    # so the logits must equal the reference's bit for bit and the top-k are router_topk's on them; 3 rows x 60
    # experts x H = 72 (a masked H tail), bf16, top-8
    return (*_small_int_router_inputs(3, 72, 0, device), 8), {}


# ---- the router's GEMM at 5-64 rows in Triton, then the top-k over its partials ("router_linear_topk") -------------
# Why. Above MAX_ROWS the router ran F.linear (cuBLAS, ~5.4 us a call at 32 rows on an H100, 1 MB of weights: latency-
# bound) then router_topk (2.8 us). cuBLAS takes no part in PDL (kernels/pdl.py): it starts only after the norm before
# it has ended, and the top-k after it only after it has ended -- two boundaries a layer whose launch latency nothing
# hides, 40 layers a step. Here two PDL launches: (1) 128 programs (16 experts x 256 of H each at Qwen3.6's shapes),
# each its weight tile (8 KB) -- before the wait with early loads --, x's tile from L2 and one tensor-core dot: fp32
# partials [H / 256, N, E]; (2) router_topk's one program a row, which sums the row's partials in split order, rounds
# them once to the model dtype (the logits), stores them and selects as router_topk does.
# Numerics: the logits are fp32 sums of exact bf16 products in another order than cuBLAS's, rounded once: within one
# ulp of the dtype plus the fp32 bound of F.linear's (`compare_gemv`'s); weights and ids exactly router_topk's on the
# returned logits. A logit one ulp off can change a near-tie's order, so greedy tokens may diverge from an engine on
# F.linear (as router_gemv_topk's at <= MAX_ROWS rows).
LINEAR_NAME = "router_linear_topk"
PARTS_MAX_ROWS = 64  # one [BLOCK_R, BLOCK_H] x tile and [BLOCK_R, BLOCK_E] accumulator a program (decode batches)
PARTS_TILING = dict(BLOCK_E=16, BLOCK_H=256, num_warps=4)  # 128 programs of 8 KB of weights at E 256, H 2048


def router_linear_topk_reference(x: torch.Tensor, w: torch.Tensor, k: int, extra: int = -1
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`TopKRouter.forward` above MAX_ROWS rows: logits = F.linear(x, w) [N, E] in x.dtype, then
    `router_topk_reference(logits, k, extra)` (with `extra` >= 0 the (1, extra) column: [N, k + 1])."""
    logits = F.linear(x, w)
    return (logits, *router_topk_reference(logits, k, extra))


def _parts_check(x: torch.Tensor, w: torch.Tensor, k: int) -> str | None:
    """Why the router GEMM in Triton cannot take (x, w, k), or None (`_gemv_check` and 1..PARTS_MAX_ROWS rows)."""
    problem = _gemv_check(x, w, k)
    if problem or not 0 < x.shape[0] <= PARTS_MAX_ROWS:
        return problem or f"takes 1..{PARTS_MAX_ROWS} rows, got {x.shape[0]}"
    return None


def launch_partials(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> tuple[torch.Tensor, int]:
    """The router GEMM's launch (`_router_parts_kernel`; `config` overrides PARTS_TILING) -> (fp32 partials
    [SPLIT, N, E], SPLIT): the first launch of "router_linear_topk" and of kernels/router_align.py's
    "router_linear_topk_align" (callers check `_parts_check` first)."""
    n, h = x.shape
    e = w.shape[0]
    cfg = {**PARTS_TILING, **(config or {})}
    if _interpreted():  # the interpreter's cost is per program: few big ones
        cfg = {**cfg, "BLOCK_E": max(16, min(64, triton.next_power_of_2(e))), "BLOCK_H": 64}
    split = triton.cdiv(h, cfg["BLOCK_H"])
    ws = torch.empty((split, n, e), dtype=torch.float32, device=x.device)
    _router_parts_kernel[(triton.cdiv(e, cfg["BLOCK_E"]), split)](
        x, w, ws, n, e, h, x.stride(0), w.stride(0), BLOCK_R=max(16, triton.next_power_of_2(n)),
        BLOCK_E=cfg["BLOCK_E"], BLOCK_H=cfg["BLOCK_H"], INTERPRET=_interpreted(), num_warps=cfg["num_warps"],
        **pdl.launch_options(),
        **pdl.early_options())
    return ws, split


def _launch_parts(x: torch.Tensor, w: torch.Tensor, k: int, extra: int = -1, config: dict | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two launches; `config` overrides PARTS_TILING (tests, benchmarks)."""
    problem = _parts_check(x, w, k)
    if problem:
        raise ValueError(f"router_linear_topk {problem}")
    n, e = x.shape[0], w.shape[0]
    ws, split = launch_partials(x, w, config)
    width = k + (extra >= 0)
    logits = x.new_empty((n, e))
    weights = x.new_empty((n, width))
    idx = torch.empty((n, width), dtype=torch.int64, device=x.device)
    _router_parts_topk_kernel[(n,)](
        ws, logits, weights, idx, n, e, weights.stride(0), idx.stride(0), max(extra, 0), K=k,
        BLOCK_K=triton.next_power_of_2(k), BLOCK_E=triton.next_power_of_2(e), SPLIT=split,
        INTERPRET=_interpreted(), HAS_EXTRA=extra >= 0, num_warps=_tiling(1, e)["num_warps"], **pdl.launch_options())
    return logits, weights, idx


@torch.library.custom_op("qwen::router_linear_topk", mutates_args=())
def router_linear_topk_op(x: torch.Tensor, w: torch.Tensor, k: int, extra: int = -1
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H], w [E, H] -> (logits [N, E], weights, idx [N, k (+1 with extra >= 0)]); contract:
    `router_linear_topk_reference` (`compare_linear`)."""
    return _launch_parts(x, w, k, extra)


@router_linear_topk_op.register_fake
def _(x, w, k, extra=-1):
    n, e, width = x.shape[0], w.shape[0], k + (extra >= 0)
    return x.new_empty((n, e)), x.new_empty((n, width)), x.new_empty((n, width), dtype=torch.int64)


def router_linear_topk_triton(x: torch.Tensor, w: torch.Tensor, k: int, extra: int = -1
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `router_linear_topk_reference` (see `compare_linear`)."""
    return router_linear_topk_op(x, w, k, extra)


def compare_linear(out, ref, x: torch.Tensor | None = None, w: torch.Tensor | None = None) -> str | None:
    """`compare_gemv` on the logits and the top-k columns; an extra column (the reference's last column naming an
    expert past the router's E: the shared expert's (1, extra) pair, whose id is E in the engine) must be equal
    exactly. (An `extra` below E is not told from a top-k column here: the registry's sample uses E.)"""
    (lo, wo, io), (lr, wr, ir) = out, ref
    if wo.shape != wr.shape or io.shape != ir.shape:
        return f"weights / idx: shapes {tuple(wo.shape)} / {tuple(io.shape)}, expected {tuple(wr.shape)}"
    width = wr.shape[1]
    if ir.numel() and bool((ir[:, -1] >= lr.shape[1]).all()):
        if not (torch.equal(wo[:, -1], wr[:, -1]) and torch.equal(io[:, -1], ir[:, -1])):
            return "the extra column differs from the reference's (1, extra)"
        width -= 1
    return compare_gemv((lo, wo[:, :width], io[:, :width]), (lr, wr[:, :width], ir[:, :width]), x, w)


def describe_linear(x: torch.Tensor, w: torch.Tensor, k: int, extra: int = -1) -> dict[str, Any]:
    ok = _gemv_inputs_ok(x, w, k)
    return dict(device=x.device.type, parts=ok and 0 < x.shape[0] <= PARTS_MAX_ROWS and x.dtype != torch.float32,
                two_launch=ok)


def supports_parts(*, parts: bool, **_: Any) -> bool:
    """Triton able to run here, x / w of one 16-bit dtype (tensor-core dot), 1..PARTS_MAX_ROWS rows."""
    return parts


def _linear_sample(device) -> tuple[tuple, dict]:
    # 6 rows x 60 experts x H = 600 (a masked H tail; three H tiles of 256 on the GPU), small integers: every fp32
    # sum exact, so the logits equal F.linear's bit for bit; bf16, top-8 and the extra column (expert 60)
    return (*_small_int_router_inputs(6, 600, 1, device), 8, 60), {}


# ---- registry entry -------------------------------------------------------------------------------------------------
def describe(logits: torch.Tensor, k: int, extra: int = -1) -> dict[str, Any]:
    return dict(device=logits.device.type, supported=supported(logits, k))


def supports(*, supported: bool, **_: Any) -> bool:
    """`supported(logits, k)` (decided in `describe`, which has the tensor)."""
    return supported


def distinct_logits(rows: int, device) -> torch.Tensor:
    """[rows, 60] bf16 logits without exact ties in a row (each a permutation of 60 values exact in bf16): a
    registry sample whose top-k has one right answer (the registry's compare gets no logits)."""
    gen = torch.Generator().manual_seed(0)
    grid = torch.arange(60, dtype=torch.float32) * 0.0625 - 2.0  # exact in bf16
    x = torch.stack([grid[torch.randperm(60, generator=gen)] for _ in range(rows)])
    return x.to(torch.bfloat16).to(device)


def _sample(device) -> tuple[tuple, dict]:
    return (distinct_logits(5, device), 8), {}  # 5 rows x 60 experts, top-8


def register(registry) -> None:
    registry.add_op(NAME, router_topk_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="indices exact where values are not tied (ties: lowest index first); weights within "
                              "one ulp of the model dtype (fp32: 1e-6 relative)")
    registry.add_implementation(NAME, "triton", router_topk_triton, supports)
    registry.add_op(GEMV_NAME, router_gemv_topk_reference, sample=_gemv_sample, compare=compare_gemv,
                    describe=describe_gemv,
                    tolerance="logits within one ulp of the model dtype of F.linear's (fp32 summation order); "
                              "weights and idx exactly router_topk's on the returned logits (compare)")
    registry.add_implementation(GEMV_NAME, "triton", router_gemv_topk_triton, supports)
    registry.add_implementation(GEMV_NAME, "linear+router_topk", linear_then_router_topk, supports_two_launch)
    registry.add_op(LINEAR_NAME, router_linear_topk_reference, sample=_linear_sample, compare=compare_linear,
                    describe=describe_linear,
                    tolerance="logits within one ulp of the model dtype of F.linear's (fp32 summation order); "
                              "weights and idx exactly router_topk's on the returned logits; the extra column exact")
    registry.add_implementation(LINEAR_NAME, "triton", router_linear_topk_triton, supports_parts)
    registry.add_implementation(LINEAR_NAME, "linear+router_topk", linear_then_router_topk, supports_two_launch)
