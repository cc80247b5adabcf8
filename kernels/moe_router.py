"""The MoE router's post-GEMM step in one Triton launch: softmax over the experts, top-k, renormalisation of the k
selected probabilities, cast to the model dtype.

Reference: `router_topk_reference` below is exactly `qwen_engine.model.moe.TopKRouter.forward` after its F.linear
(which mirrors transformers' `Qwen3_5MoeTopKRouter`):
    probs = softmax(logits, -1, dtype=fp32);   top, idx = topk(probs, k);   top /= top.sum(-1);   top.to(logits.dtype)
logits [N, E] (bf16 on the GPU, fp32 in CPU tests; unit last stride, rows may be strided) -> weights [N, k] in
logits.dtype summing to 1, idx [N, k] int64, both in descending order of weight. The model: E = 256 experts, k = 8.
Custom op `qwen::router_topk` (traceable by torch.compile); no host reads of device values and shapes that depend on
(N, k) only, so it can be captured in a CUDA graph.

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
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.device import triton_device_ok

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from kernels.rms_norm import _cast  # fp32 -> model dtype, round to nearest even (also under the interpreter)
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
def router_topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`TopKRouter.forward` after the F.linear: (weights [N, k] logits.dtype, idx [N, k] int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), idx


# ---- Triton kernel --------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _router_topk_kernel(logits, w_out, i_out, N, E, s_l, s_w, s_i, K: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr):
        # grid (cdiv(N, BLOCK_R),); logits [N, E] with row stride s_l and unit column stride; outputs [N, K]
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
        r_ok = rows < N
        cols = tl.arange(0, BLOCK_E)  # [BE]
        rows64 = rows.to(tl.int64)
        avail = (cols < E)[None, :] & (rows >= 0)[:, None]  # [BR, BE]: lanes still selectable (never lanes >= E)
        lf = tl.load(logits + rows64[:, None] * s_l + cols[None, :], mask=r_ok[:, None] & avail,
                     other=0.0).to(tl.float32)  # masked lanes' values are never looked at (not available)
        key = tl.where(lf != lf, float("inf"), lf)  # NaN ranks first (torch.topk's order); no NaN in reductions
        kk = tl.arange(0, BLOCK_K)  # [BK]
        vals = tl.full((BLOCK_R, BLOCK_K), float("-inf"), tl.float32)
        ids = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.int32)
        for j in tl.static_range(K):
            cur = tl.where(avail, key, float("-inf"))
            mx = tl.max(cur, axis=1)  # [BR]
            # lowest available lane equal to the max: there is one (k <= E available lanes, all >= -inf)
            pick = tl.min(tl.where(avail & (cur == mx[:, None]), cols[None, :], BLOCK_E), axis=1)  # [BR]
            avail = avail & (cols[None, :] != pick[:, None])
            vals = tl.where(kk[None, :] == j, mx[:, None], vals)
            ids = tl.where(kk[None, :] == j, pick[:, None], ids)
        m = tl.max(vals, axis=1)  # = vals[:, 0], the row's max
        x = vals - m[:, None]
        if INTERPRET:  # numpy's exp; libdevice is not interpreted
            e = tl.exp(x)
        else:  # accurate expf (tl.exp is ex2.approx on NVIDIA)
            e = libdevice.exp(x)
        e = tl.where(kk[None, :] < K, e, 0.0)  # [BR, BK]
        w = tl.div_rn(e, tl.sum(e, axis=1)[:, None])  # softmax denominator cancelled (module docstring)
        ok = r_ok[:, None] & (kk < K)[None, :]
        tl.store(w_out + rows64[:, None] * s_w + kk[None, :], _cast(w, w_out.dtype.element_ty, INTERPRET), mask=ok)
        tl.store(i_out + rows64[:, None] * s_i + kk[None, :], ids.to(tl.int64), mask=ok)


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


def _launch(logits: torch.Tensor, k: int, block_r: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel call; `block_r` overrides the rows per program (tests exercise packing at small N)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"router_topk needs 2-D logits with unit last stride, got {tuple(logits.shape)} strides "
                         f"{logits.stride()}")
    n, e = logits.shape
    if not 1 <= k <= min(e, MAX_TOP_K) or e > MAX_EXPERTS:
        raise ValueError(f"router_topk needs 1 <= k <= min(E, {MAX_TOP_K}) and E <= {MAX_EXPERTS}, got k={k} E={e}")
    weights = logits.new_empty((n, k))
    idx = torch.empty((n, k), dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, idx
    cfg = _tiling(n, e)
    if block_r is not None:
        cfg["BLOCK_R"] = block_r
    _router_topk_kernel[(triton.cdiv(n, cfg["BLOCK_R"]),)](
        logits, weights, idx, n, e, logits.stride(0), weights.stride(0), idx.stride(0), K=k,
        BLOCK_K=triton.next_power_of_2(k), INTERPRET=_interpreted(), **cfg)
    return weights, idx


# ---- custom op (traceable by torch.compile) -------------------------------------------------------------------------
@torch.library.custom_op("qwen::router_topk", mutates_args=())
def router_topk_op(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k] logits.dtype, idx [N, k] int64); contract: `router_topk_reference`."""
    return _launch(logits, k)


@router_topk_op.register_fake
def _(logits, k):
    return logits.new_empty((logits.shape[0], k)), logits.new_empty((logits.shape[0], k), dtype=torch.int64)


def router_topk_triton(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `router_topk_reference` (ties: lowest expert index first)."""
    return router_topk_op(logits, k)


# ---- guard, comparison, inputs --------------------------------------------------------------------------------------
def supported(logits: torch.Tensor, k: int) -> bool:
    """Triton able to run here (CUDA >= sm_80, or the interpreter on CPU); logits 2-D [N, E] with unit last stride
    (rows may be strided), dtype in DTYPES; 1 <= k <= min(E, MAX_TOP_K) and E <= MAX_EXPERTS (one register tile)."""
    if triton is None or not isinstance(logits, torch.Tensor):
        return False
    cap = torch.cuda.get_device_capability(logits.device) if logits.is_cuda else None
    if not triton_device_ok(logits.device.type, cap, _interpreted(), MIN_CAPABILITY) or logits.dim() != 2 or logits.dtype not in DTYPES:
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


# ---- registry entry -------------------------------------------------------------------------------------------------
def describe(logits: torch.Tensor, k: int) -> dict[str, Any]:
    return dict(device=logits.device.type, supported=supported(logits, k))


def supports(*, supported: bool, **_: Any) -> bool:
    """`supported(logits, k)` (decided in `describe`, which has the tensor)."""
    return supported


def _sample(device) -> tuple[tuple, dict]:
    # distinct bf16 logits (no exact ties: the registry's compare gets no logits), 5 rows x 60 experts, top-8
    gen = torch.Generator().manual_seed(0)
    grid = torch.arange(60, dtype=torch.float32) * 0.0625 - 2.0  # exact in bf16
    x = torch.stack([grid[torch.randperm(60, generator=gen)] for _ in range(5)])
    return (x.to(torch.bfloat16).to(device), 8), {}


def register(registry) -> None:
    registry.add_op(NAME, router_topk_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="indices exact where values are not tied (ties: lowest index first); weights within "
                              "one ulp of the model dtype (fp32: 1e-6 relative)")
    registry.add_implementation(NAME, "triton", router_topk_triton, supports)
