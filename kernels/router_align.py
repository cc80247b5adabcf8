"""The MoE router's top-k and the routing alignment in one launch at decode sizes: registry ops "router_topk_align"
(over given logits) and "router_linear_topk_align" (over the router GEMM's fp32 partials; below, after the first).

Contract. `router_topk_align_reference(logits, k, extra, num_experts, block_m)` = `moe_router.router_topk_reference`
(softmax, top-k, renormalised; `extra` >= 0 appends the shared expert's pair (1, extra)) then
`w4a16_gemm.moe_align` of its expert ids over `num_experts` experts at `block_m`-row blocks -> (weights [N, KP]
logits.dtype, idx [N, KP] int64, sorted_pairs int32 [R], block_expert int32 [R / block_m]) with KP = k (+1 with
extra); the alignment is exactly `moe_align`'s of the returned ids (integer outputs: equality, `compare`).

Why. At 32 streams a MoE layer's routing was F.linear, `router_topk` (32 programs, ~2.8 us) and `moe_align`'s one
program (a bitonic sort of next_power_of_2(32 x 9) = 512 keys, ~5.0 us; H200 profile qwen_profile_fp8sw run 2: 0.20
ms of a step's 8.53 ms of kernels), two launch boundaries after the GEMM. Here the top-k's programs also record
which tokens chose each expert, and the program that arrives last builds the alignment from that: no sort, one
launch and one boundary fewer a layer (40 a step). Measured (H200, 2026-12-05, benchmarks/RESULTS.md): per call at
32 tokens with F.linear 14.7 us at one warp against 12.3 for the two launches (12.0 at 4 warps; at 64 tokens 15.2
against 19.1), and in the engine -1.2% at 32 streams: after F.linear it runs only when asked
(`QwenEngineConfig.router_align` true with `router_parts` off; "auto" runs the op over the partials instead).

Algorithm (grid as `router_topk`'s: one row per program on the GPU; N tokens, KP pairs a token, P = N KP pairs with
ids p = t KP + j, NE = `num_experts` experts, WORDS = ceil(N / 32)):
  every program, after storing its rows' weights and ids, for each of its pairs (t, e_p):
      member[e_p, t // 32] |= 1 << (t mod 32)                     (atomic or, relaxed: the order does not matter)
  A token's KP experts are distinct (the top-k picks distinct lanes; extra >= E lies past them), so member[e] is the
  set of tokens that chose e, one bit each. The program that arrives last (`split_k.last_arrival`: every program's
  ids and bits visible to it through L2) then computes
      count[e] = popc(member[e]);   start[e] = exclusive cumsum over e of ceil(count / block_m) block_m
      rank(p)  = popc(member[e_p] & the bits of tokens below t)    = #{q < p : e_q = e_p} (one pair a token and expert)
      row(p)   = start[e_p] + rank(p):   sorted_pairs[row(p)] = p,   block_expert[row(p) / block_m] = e_p
  after filling sorted_pairs with P and block_expert with NE (the padding; a barrier orders the two writes of a row).
  GATHER (sixty-sixth session; off until timed in the engine -- per call on an H100 7.90 against 8.15 us at 32
  tokens, results/h100_67_run1): the last program loads every member word and every pair's
  expert in one round trip after its arrival and takes member[e_p] and start[e_p] from those registers by
  `tl.gather` -- no starts workspace (its store, a barrier, then the ids' round trip, then member[e_p] and
  start[e_p]'s: two dependent round trips fewer); the same integers (`tests/test_kernel_router_align.py` runs every
  case in both forms). Only up to GATHER_MAX_PAIRS pairs and 32 tokens (`gather_fits`); the reload form beyond.
  That is `moe_align`'s stable sort by expert (pairs of one expert in pair order, each expert's group padded to
  block_m rows) and its block owners (every block of a group holds >= 1 real pair: padding < block_m), computed
  without sorting: O(P WORDS + NE WORDS) loads and popcounts in the last program. It then clears member (its rows back
  to 0) and re-arms the arrival counter, so the next launch and CUDA-graph replays find them zeroed. start[e] goes
  through a small workspace (a per-pair gather of a register vector), written and read by that one program across a
  CTA barrier.
Workspace: per device and `split_k.counters_of` role (the main stream's and a forked stream's launches never share
one), zeros of MAX_EXPERTS x (MAX_WORDS + 1) int32, allocated on first use outside a CUDA-graph capture (inside one,
or past the limits, the op's other implementation runs: `router_topk` then `moe_align_fast`, two launches).
Launches sharing a workspace must not overlap in time: the engine's routers run on its main stream, each after the
previous layer's (under PDL every kernel waits for its predecessor's completion before touching memory).

Warps: over given logits router_topk's tiling (`moe_router._tiling`: one warp a row of 256 experts), so the last
program builds the alignment on one warp too (offline sm_90, Triton 3.6: 96 registers, no stack; 168 with
GATHER); over the partials
PARTS_ALIGN_WARPS (4); `benchmarks/router_align_bench.py` times 1, 2 and 4.

Numerics: the weights and ids are `router_topk`'s (the same selection code, `moe_router._select_topk`, whose softmax
denominator is summed in pick order: the same bits at any warps).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from kernels import moe_router, pdl
from kernels.moe_align import aligned_rows
from kernels.split_k import role_buffer, split_counters

try:
    import triton
    import triton.language as tl

    from kernels.moe_align import fill_i32
    from kernels.moe_router import _row_logits, _row_parts, _select_topk
    from kernels.pdl import enter as pdl_enter
    from kernels.rms_norm import _cast
    from kernels.split_k import last_arrival, rearm
except ImportError:  # CPU-only installs without triton: the reference works, supported() says no
    triton = None

NAME = "router_topk_align"
MAX_TOKENS = 128  # N: member rows of MAX_WORDS 32-bit words (a decode batch; prefill chunks keep the two launches)
MAX_WORDS = MAX_TOKENS // 32
MAX_PAIRS = 1024  # P = N KP: one [BLOCK_P] vector of pairs in the last program (kernels/moe_align.py's MAX_PAIRS)
MAX_EXPERTS = 512  # NE: one [BLOCK_NE] vector of counts (moe_align's MAX_EXPERTS)
GATHER = False  # True: the last program's alignment from one round trip and register gathers where `gather_fits`
#                 (docstring; not yet timed on a GPU, so off: the sixty-fifth session's form, which reads member[e_p]
#                 and start[e_p] back from memory, stays the engine's until `gpu_next.sh` step 199 measures both)
GATHER_MAX_PAIRS = 512  # GATHER's limits: BLOCK_P <= 512 pairs and one member word (<= 32 tokens). Beyond, Triton
#                         3.8 fails to lower a 1,024-pair gather at 4 warps (not warp-local) and at 1 warp with 4
#                         words spills (255 registers); the reload form runs there
_WORKSPACE: dict[tuple[str, int | None, str], torch.Tensor] = {}
_CAPTURED_FALLBACK: set = set()  # devices whose first use came inside a CUDA-graph capture (logged once)
log = logging.getLogger(__name__)


# ---- reference ------------------------------------------------------------------------------------------------------
def router_topk_align_reference(logits: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`router_topk_reference` then `moe_align` of its ids (module docstring)."""
    from kernels.w4a16_gemm import moe_align

    weights, idx = moe_router.router_topk_reference(logits, k, extra)
    routing = moe_align(idx, num_experts, block_m)
    return weights, idx, routing.sorted_pairs, routing.block_expert


def router_topk_then_align(logits: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op in two launches, `router_topk` then `moe_align_fast`: what a decode step ran before this kernel, and its
    fallback where the kernel does not run (past its limits, no workspace inside a capture)."""
    from kernels.w4a16_gemm import moe_align_fast

    weights, idx = moe_router.router_topk_triton(logits, k, extra)
    routing = moe_align_fast(idx, num_experts, block_m)
    return weights, idx, routing.sorted_pairs, routing.block_expert


# ---- Triton kernel --------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _popc(v):
        """Set bits of each 32-bit word (int32 or uint32 tensor) -> int32; SWAR, so the interpreter runs it too."""
        u = v.to(tl.uint32, bitcast=True)
        u = u - ((u >> 1) & 0x55555555)
        u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
        u = (u + (u >> 4)) & 0x0F0F0F0F
        return ((u * 0x01010101) >> 24).to(tl.int32)

    @triton.jit
    def _router_topk_align_kernel(logits, w_out, i_out, member, starts, counters, sorted_pairs, block_expert,
                                  N, E, s_l, EXTRA, NE, NUM_BLOCKS, K: tl.constexpr, KP: tl.constexpr,
                                  BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                                  WORDS: tl.constexpr, BLOCK_NE: tl.constexpr, BLOCK_P: tl.constexpr,
                                  BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr = False,
                                  ws=None, SPLIT: tl.constexpr = 0, GATHER: tl.constexpr = False):
        # grid (cdiv(N, BLOCK_R),); logits [N, E] (row stride s_l, unit column stride); w_out / i_out [N, KP]
        # contiguous (column K = (1, EXTRA) when KP > K); member int32 [NE, WORDS] and starts int32 [NE]: the
        # workspace (member zero between launches); counters[0]: the arrival counter (0 between launches).
        # SPLIT > 0 ("router_linear_topk_align"): the logits are the router GEMM's fp32 partials ws [SPLIT, N, E]
        # summed and rounded here (`moe_router._row_parts`, as the top-k over the partials does) and stored into
        # logits (contiguous, an output then)
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        if SPLIT > 0:
            rows, r_ok, rows64, avail, lf = _row_parts(ws, logits, N, E, SPLIT, BLOCK_R, BLOCK_E, INTERPRET)
        else:
            rows, r_ok, rows64, avail, lf = _row_logits(logits, N, E, s_l, BLOCK_R, BLOCK_E)  # router_topk's
        w, ids = _select_topk(lf, avail, K, BLOCK_K, BLOCK_R, BLOCK_E, INTERPRET)  # [BR, BK]: positions >= K unused
        kk = tl.arange(0, BLOCK_K)
        pair_ok = r_ok[:, None] & (kk < KP)[None, :]  # [BR, BK]: this program's pairs
        pair_e = tl.where(kk[None, :] < K, ids, EXTRA)  # column K: the shared expert's pair
        w = tl.where(kk[None, :] < K, w, 1.0)
        out = rows64[:, None] * KP + kk[None, :]
        tl.store(w_out + out, _cast(w, w_out.dtype.element_ty, INTERPRET), mask=pair_ok)
        tl.store(i_out + out, pair_e.to(tl.int64), mask=pair_ok)
        bit = (tl.full((BLOCK_R,), 1, tl.uint32) << (rows % 32).to(tl.uint32)).to(tl.int32, bitcast=True)
        # the bits as a computed [BR, BK] tensor, not tl.broadcast_to: Triton's interpreter (3.8) hands atomics' value
        # arrays to C++ as if contiguous, and a broadcast's zero strides then read past its one row
        bits = bit[:, None] + tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.int32)
        tl.atomic_or(member + pair_e * WORDS + (rows // 32)[:, None], bits, mask=pair_ok, sem="relaxed", scope="gpu")
        if GATHER and last_arrival(counters, 0, tl.num_programs(0)):  # every program's ids and bits are in L2
            # one round trip for everything the alignment reads -- every member word and every pair's expert --, then
            # registers only: start[e_p] and member[e_p] by gathers from the loaded vectors (the module docstring's
            # GATHER; one member word an expert, `gather_fits`)
            tl.static_assert(WORDS == 1, "GATHER's form takes one member word (<= 32 tokens)")
            ej = tl.arange(0, BLOCK_NE)
            e_ok = ej < NE
            p = tl.arange(0, BLOCK_P)
            p_ok = p < N * KP
            t = p // KP
            words = tl.load(member + ej, mask=e_ok, other=0, cache_modifier=".cg")  # [BNE] (".cg": L2, where the
            #                                                                         atomics landed)
            e = tl.load(i_out + p, mask=p_ok, other=0, cache_modifier=".cg").to(tl.int32)  # [BP] pair p's expert
            padded = (_popc(words) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            start = tl.cumsum(padded, 0) - padded
            below = ((tl.full((BLOCK_P,), 1, tl.uint32) << (t % 32).to(tl.uint32)) - 1).to(tl.int32, bitcast=True)
            row = tl.gather(start, e, 0) + _popc(tl.gather(words, e, 0) & below)  # start[e_p] + rank(p)
            fill_i32(sorted_pairs, NUM_BLOCKS * BLOCK_M, N * KP)  # padding everywhere; the scatter overwrites used
            fill_i32(block_expert, NUM_BLOCKS, NE)                # rows and blocks
            tl.debug_barrier()  # the padding written by this program's threads before the scatter
            tl.store(sorted_pairs + row, p, mask=p_ok)
            tl.store(block_expert + row // BLOCK_M, e, mask=p_ok)  # every row of a block writes the same owner
            tl.store(member + ej, tl.zeros((BLOCK_NE,), dtype=tl.int32), mask=e_ok)  # read above, before this
            #                                                 program's barrier: cleared for the next launch
            rearm(counters, 0)
        if not GATHER and last_arrival(counters, 0, tl.num_programs(0)):  # every program's ids and bits are in L2
            ej = tl.arange(0, BLOCK_NE)
            e_ok = ej < NE
            count = tl.zeros((BLOCK_NE,), dtype=tl.int32)
            for wd in tl.static_range(WORDS):  # ".cg": L2, where the atomics landed
                count += _popc(tl.load(member + ej * WORDS + wd, mask=e_ok, other=0, cache_modifier=".cg"))
            padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            tl.store(starts + ej, tl.cumsum(padded, 0) - padded, mask=e_ok)
            p_total = N * KP
            fill_i32(sorted_pairs, NUM_BLOCKS * BLOCK_M, p_total)  # padding everywhere; the scatter overwrites used
            fill_i32(block_expert, NUM_BLOCKS, NE)                  # rows and blocks
            tl.debug_barrier()  # starts and the padding written by this program's threads before the scatter
            p = tl.arange(0, BLOCK_P)
            p_ok = p < p_total
            t = p // KP
            e = tl.load(i_out + p, mask=p_ok, other=0, cache_modifier=".cg").to(tl.int32)  # [BP] pair p's expert
            rank = tl.zeros((BLOCK_P,), dtype=tl.int32)
            tw = t // 32
            for wd in tl.static_range(WORDS):  # tokens below t: whole words below t's, t's word below its bit
                word = tl.load(member + e * WORDS + wd, mask=p_ok, other=0, cache_modifier=".cg")
                low = ((tl.full((BLOCK_P,), 1, tl.uint32) << (t % 32).to(tl.uint32)) - 1).to(tl.int32, bitcast=True)
                below = tl.where(wd < tw, -1, tl.where(wd == tw, low, 0))
                rank += _popc(word & below)
            row = tl.load(starts + e, mask=p_ok, other=0, cache_modifier=".cg") + rank
            tl.store(sorted_pairs + row, p, mask=p_ok)
            tl.store(block_expert + row // BLOCK_M, e, mask=p_ok)  # every row of a block writes the same owner
            tl.debug_barrier()  # every member word read before it is cleared
            for wd in tl.static_range(WORDS):
                tl.store(member + ej * WORDS + wd, tl.zeros((BLOCK_NE,), dtype=tl.int32), mask=e_ok)
            rearm(counters, 0)


def _interpreted() -> bool:
    return triton is not None and type(_router_topk_align_kernel).__name__ == "InterpretedFunction"


def gather_fits(block_p: int, words: int) -> bool:
    """Whether a launch of BLOCK_P pairs and `words` member words takes GATHER's form when GATHER is on: up to
    GATHER_MAX_PAIRS pairs and one word (32 tokens: the 32-stream step's 288 pairs); else the reload form."""
    return block_p <= GATHER_MAX_PAIRS and words == 1


def _workspace(device: torch.device) -> torch.Tensor | None:
    """The device's (and `counters_of` role's) zeroed workspace: member [MAX_EXPERTS x MAX_WORDS] then starts
    [MAX_EXPERTS] int32; None on a first use inside a CUDA-graph capture (`split_k.role_buffer`)."""
    return role_buffer(_WORKSPACE, device, MAX_EXPERTS * (MAX_WORDS + 1))


def _check(logits: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int) -> str | None:
    """Why the kernel cannot run these arguments (None: it can; the device is `supported`'s business)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        return f"needs 2-D logits with unit last stride, got {tuple(logits.shape)} strides {tuple(logits.stride())}"
    return _shape_check(*logits.shape, k, extra, num_experts, block_m)


def _shape_check(n: int, e: int, k: int, extra: int, num_experts: int, block_m: int) -> str | None:
    """The kernel's limits for N tokens' routing over E routed experts (`_check` without the logits' layout)."""
    kp = k + (extra >= 0)
    if not 1 <= k <= min(e, moe_router.MAX_TOP_K) or e > moe_router.MAX_EXPERTS:
        return f"needs 1 <= k <= min(E, {moe_router.MAX_TOP_K}) and E <= {moe_router.MAX_EXPERTS}, got k={k} E={e}"
    if extra >= 0 and not e <= extra < num_experts:
        return f"extra={extra} must lie past the routed experts and inside num_experts: E={e} <= extra < {num_experts}"
    if not e <= num_experts <= MAX_EXPERTS:
        return f"needs E={e} <= num_experts <= {MAX_EXPERTS}, got num_experts={num_experts}"
    if not 1 <= n <= MAX_TOKENS or n * kp > MAX_PAIRS:
        return f"takes 1-{MAX_TOKENS} tokens and <= {MAX_PAIRS} pairs, got {n} tokens x {kp}"
    if block_m < 1:
        return f"block_m must be >= 1, got {block_m}"
    return None


def _workspace_or_none(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(arrival counters, workspace) for the kernel on `device`; None where they cannot be had (a first use inside a
    CUDA-graph capture: the caller runs its two-launch form instead), logged once a device."""
    counters, ws = split_counters(device, 1), _workspace(device)
    if counters is not None and ws is not None:
        return counters, ws
    if device not in _CAPTURED_FALLBACK:
        _CAPTURED_FALLBACK.add(device)
        log.warning("router_topk_align / router_linear_topk_align: first used inside a CUDA-graph capture on %s, so "
                    "no workspace: that graph runs the top-k and moe_align in separate launches (run an eager call "
                    "before capturing)", device)
    return None


def _align_launch(src: torch.Tensor, n: int, e: int, k: int, extra: int, num_experts: int, block_m: int,
                  counters: torch.Tensor, workspace: torch.Tensor, parts: tuple[torch.Tensor, int] | None = None,
                  block_r: int | None = None, num_warps: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel over logits `src` [N, E], or with `parts` = (fp32 partials [SPLIT, N, E], SPLIT) over those, `src`
    then the contiguous logits it writes. `block_r` overrides the rows per program (tests run several programs under
    the interpreter); `num_warps` router_topk's choice unless given (`moe_router._tiling`: one warp a row of 256
    experts, which also runs the last program's alignment)."""
    kp = k + (extra >= 0)
    p = n * kp
    rows = aligned_rows(p, num_experts, block_m)
    weights = src.new_empty((n, kp))
    idx = torch.empty((n, kp), dtype=torch.int64, device=src.device)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=src.device)  # all written by the last program
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=src.device)
    cfg = moe_router._tiling(n, e)
    if block_r is not None:
        cfg["BLOCK_R"] = block_r
    if num_warps is not None:
        cfg["num_warps"] = num_warps
    partials = {} if parts is None else dict(ws=parts[0], SPLIT=parts[1])
    words, block_p = triton.cdiv(n, 32), max(16, triton.next_power_of_2(p))
    _router_topk_align_kernel[(triton.cdiv(n, cfg["BLOCK_R"]),)](
        src, weights, idx, workspace, workspace[MAX_EXPERTS * MAX_WORDS:], counters, sorted_pairs, block_expert, n, e,
        src.stride(0), max(extra, 0), num_experts, rows // block_m, K=k, KP=kp,
        BLOCK_K=triton.next_power_of_2(kp), WORDS=words,
        BLOCK_NE=max(16, triton.next_power_of_2(num_experts)), BLOCK_P=block_p,
        BLOCK_M=block_m, INTERPRET=_interpreted(), GATHER=GATHER and gather_fits(block_p, words), **partials,
        **cfg, **pdl.launch_options())
    return weights, idx, sorted_pairs, block_expert


def _launch(logits: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int, block_r: int | None = None,
            num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel call (`_align_launch`: `block_r`, `num_warps`; benchmarks may ask for more warps); where the
    workspace or counters cannot be had, the two launches (`router_topk_then_align`)."""
    problem = _check(logits, k, extra, num_experts, block_m)
    if problem:
        raise ValueError(f"router_topk_align {problem}")
    held = _workspace_or_none(logits.device)
    if held is None:
        return router_topk_then_align(logits, k, extra, num_experts, block_m)
    return _align_launch(logits, *logits.shape, k, extra, num_experts, block_m, *held, block_r=block_r,
                         num_warps=num_warps)


# ---- custom op (traceable by torch.compile) -------------------------------------------------------------------------
@torch.library.custom_op("qwen::router_topk_align", mutates_args=())
def router_topk_align_op(logits: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contract: `router_topk_align_reference`."""
    return _launch(logits, k, extra, num_experts, block_m)


@router_topk_align_op.register_fake
def _fake(logits, k, extra, num_experts, block_m):
    n = logits.shape[0]
    kp = k + (extra >= 0)
    rows = aligned_rows(n * kp, num_experts, block_m)
    i32 = dict(dtype=torch.int32)
    return (logits.new_empty((n, kp)), logits.new_empty((n, kp), dtype=torch.int64), logits.new_empty(rows, **i32),
            logits.new_empty(rows // block_m, **i32))


def router_topk_align_triton(logits: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `router_topk_align_reference`."""
    return router_topk_align_op(logits, k, extra, num_experts, block_m)


# ---- guard, comparison, registry entry ------------------------------------------------------------------------------
def supported(logits: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int) -> bool:
    """`moe_router.supported` (Triton here, CUDA >= sm_80 or the interpreter; the dtype) and the kernel's limits
    (`_check`: N <= MAX_TOKENS, P <= MAX_PAIRS, E <= num_experts <= MAX_EXPERTS, extra past the routed experts)."""
    return moe_router.supported(logits, k) and _check(logits, k, extra, num_experts, block_m) is None


def compare(out, ref, logits: torch.Tensor | None = None, k: int | None = None, num_experts: int | None = None,
            block_m: int | None = None) -> str | None:
    """None if `out` = (weights, idx, sorted_pairs, block_expert) is correct where `ref` is the reference's.
    Without the keywords (the registry's self-check, whose sample has no tied logits): the ids and the alignment
    exactly the reference's, the weights within `moe_router.compare`'s tolerance. With `logits`, `k`, `num_experts`
    and `block_m`: ties may pick other experts (`moe_router.compare` of the k routed columns, given the logits), a
    column past them must be the reference's (1, extra) exactly, and the alignment exactly `moe_align`'s of OUT's ids
    (its rows and blocks are a function of the ids)."""
    from kernels.w4a16_gemm import moe_align

    (w, i, sp, be), (rw, ri, rsp, rbe) = out, ref
    if i.shape != ri.shape or w.shape != rw.shape:
        return f"weights / idx: shapes {tuple(w.shape)} / {tuple(i.shape)} != {tuple(rw.shape)} / {tuple(ri.shape)}"
    if k is None:
        if not torch.equal(i, ri):
            return "idx: differs from the reference's (a sample without ties)"
        problem = moe_router.compare((w, i), (rw, ri))
        want = (rsp, rbe)
    else:
        if not (torch.equal(i[:, k:], ri[:, k:]) and torch.equal(w[:, k:], rw[:, k:])):
            return "the extra column differs from the reference's (1, extra)"
        problem = moe_router.compare((w[:, :k], i[:, :k]), (rw[:, :k], ri[:, :k]), logits)
        mine = moe_align(i, num_experts, block_m)
        want = (mine.sorted_pairs, mine.block_expert)
    return problem or _alignment_problem(sp, be, *want)


def _alignment_problem(sp: torch.Tensor, be: torch.Tensor, want_sp: torch.Tensor, want_be: torch.Tensor
                       ) -> str | None:
    """None if (sorted_pairs, block_expert) equal the wanted ones exactly (int32, same shapes), else where not."""
    for name, a, b in (("sorted_pairs", sp, want_sp), ("block_expert", be, want_be)):
        if a.dtype != torch.int32 or a.shape != b.shape:
            return f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} != {tuple(b.shape)} torch.int32"
        if not torch.equal(a, b):
            at = int((a != b).nonzero()[0])
            n_bad = int((a != b).sum())
            return f"{name}: row {at} holds {int(a[at])}, moe_align of the ids {int(b[at])} ({n_bad} such)"
    return None


def describe(logits: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int) -> dict[str, Any]:
    return dict(device=logits.device.type, supported=supported(logits, k, extra, num_experts, block_m),
                two_launch=moe_router.supported(logits, k))


def _sample(device) -> tuple[tuple, dict]:
    # 37 rows (two mask words) x 60 experts without ties, top-8 + the shared expert's pair (extra 60 of 61 experts)
    # at 8-row blocks
    return (moe_router.distinct_logits(37, device), 8, 60, 61, 8), {}


# ---- the router's GEMM in Triton, then the top-k and the alignment over its partials ("router_linear_topk_align") --
# Why. With `router_parts` (moe_router "router_linear_topk": the router GEMM in Triton, inside PDL) a 32-stream MoE
# layer's routing is three launches: the GEMM (128 programs), the top-k over its fp32 partials (one program a row)
# and `moe_align` (one program, a bitonic sort: 4.9 us a call, 0.20 ms of the H100's 8.79 ms step, fifty-second
# session). Here the second launch is this file's kernel summing the partials (`moe_router._row_parts`, as the top-k
# over them does): the top-k and the alignment in one launch after the GEMM -- two launches a layer instead of three.
# Same logits, weights and ids as "router_linear_topk" (the same partials summed in the same order, the same
# selection), the alignment `moe_align`'s of the ids; so the same bits as the three launches.
# Warps: PARTS_ALIGN_WARPS for every program (the last one builds the alignment with them): router_align's one warp
# cost more than the launch it saves (forty-fifth session: 14.7 against 12.3 us a call at 32 tokens; 12.0 at 4 warps).
LINEAR_NAME = "router_linear_topk_align"
PARTS_ALIGN_WARPS = 4
# The fold gains only past 256 pairs, where moe_align's bitonic sort doubles to 512 keys: per call on an H100 (PDL,
# early loads; fifty-third session, results/align53_rows) 7.50-8.13 against 6.64-7.29 us for the three launches at
# 8-24 rows (72-216 pairs), 7.98 against 9.22 at 32 rows (288), 10.43 against 17.18 at 64 (576). `SparseMoE` asks for
# it from this many pairs (tokens x (top-k + the shared pair)) with the router GEMM in Triton.
PARTS_MIN_PAIRS = 257


def router_linear_topk_align_reference(x: torch.Tensor, w: torch.Tensor, k: int, extra: int, num_experts: int,
                                       block_m: int) -> tuple[torch.Tensor, ...]:
    """x [N, H], w [E, H] -> (logits = F.linear(x, w) [N, E], then `router_topk_align_reference` on them: weights,
    idx [N, KP], sorted_pairs, block_expert)."""
    logits = F.linear(x, w)
    return (logits, *router_topk_align_reference(logits, k, extra, num_experts, block_m))


def linear_then_topk_align(x: torch.Tensor, w: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int
                           ) -> tuple[torch.Tensor, ...]:
    """F.linear then registry op "router_topk_align" (its kernel, or its two launches where that cannot run): what
    `TopKRouter.route_aligned` ran without `router_parts`, and this op's fallback."""
    from engine_core.registry import default_registry

    logits = F.linear(x, w)
    return (logits, *default_registry().call(NAME, logits, k, extra, num_experts, block_m))


def _linear_check(x: torch.Tensor, w: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int) -> str | None:
    return moe_router._parts_check(x, w, k) or _shape_check(x.shape[0], w.shape[0], k, extra, num_experts, block_m)


def _launch_linear(x: torch.Tensor, w: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int,
                   num_warps: int | None = None, block_r: int | None = None) -> tuple[torch.Tensor, ...]:
    """The two launches: `moe_router.launch_partials` (the GEMM), then the kernel over its partials at
    PARTS_ALIGN_WARPS unless `num_warps` (benchmarks) -- or, without a workspace (a first use inside a CUDA-graph
    capture), the top-k over the partials ("router_linear_topk"'s second launch) and `moe_align_fast`."""
    from kernels.w4a16_gemm import moe_align_fast

    problem = _linear_check(x, w, k, extra, num_experts, block_m)
    if problem:
        raise ValueError(f"router_linear_topk_align {problem}")
    n, e = x.shape[0], w.shape[0]
    held = _workspace_or_none(x.device)
    if held is None:
        logits, weights, idx = moe_router._launch_parts(x, w, k, extra)
        routing = moe_align_fast(idx, num_experts, block_m)
        return logits, weights, idx, routing.sorted_pairs, routing.block_expert
    ws_parts = moe_router.launch_partials(x, w)
    logits = x.new_empty((n, e))
    out = _align_launch(logits, n, e, k, extra, num_experts, block_m, *held, parts=ws_parts, block_r=block_r,
                        num_warps=PARTS_ALIGN_WARPS if num_warps is None else num_warps)
    return (logits, *out)


@torch.library.custom_op("qwen::router_linear_topk_align", mutates_args=())
def router_linear_topk_align_op(x: torch.Tensor, w: torch.Tensor, k: int, extra: int, num_experts: int,
                                block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor]:
    """Contract: `router_linear_topk_align_reference` (`compare_linear`)."""
    return _launch_linear(x, w, k, extra, num_experts, block_m)


@router_linear_topk_align_op.register_fake
def _(x, w, k, extra, num_experts, block_m):
    logits = x.new_empty((x.shape[0], w.shape[0]))
    return (logits, *_fake(logits, k, extra, num_experts, block_m))


def router_linear_topk_align_triton(x: torch.Tensor, w: torch.Tensor, k: int, extra: int, num_experts: int,
                                    block_m: int) -> tuple[torch.Tensor, ...]:
    """Same contract as `router_linear_topk_align_reference` (see `compare_linear`)."""
    return router_linear_topk_align_op(x, w, k, extra, num_experts, block_m)


def compare_linear(out, ref, x: torch.Tensor | None = None, w: torch.Tensor | None = None,
                   num_experts: int | None = None, block_m: int | None = None) -> str | None:
    """None if `out` = (logits, weights, idx, sorted_pairs, block_expert) is correct where `ref` is the reference's:
    the logits, weights and ids as `moe_router.compare_linear` judges "router_linear_topk"'s (logits within an ulp
    of F.linear's, plus the fp32-order bound with `x` and `w`; the selection exactly router_topk's on OUR logits; the
    extra column exact), and the alignment exactly `moe_align`'s of OUR ids -- with `num_experts` and `block_m`; without
    them (the registry's self-check, whose sample's logits are exact and untied) exactly the reference's."""
    from kernels.w4a16_gemm import moe_align

    (lo, wo, io, sp, be), (lr, wr, ir, rsp, rbe) = out, ref
    problem = moe_router.compare_linear((lo, wo, io), (lr, wr, ir), x, w)
    if problem:
        return problem
    if num_experts is None or block_m is None:
        if not torch.equal(io, ir):
            return "idx: differs from the reference's (a sample without ties)"
        want = (rsp, rbe)
    else:
        mine = moe_align(io, num_experts, block_m)
        want = (mine.sorted_pairs, mine.block_expert)
    return _alignment_problem(sp, be, *want)


def describe_linear(x: torch.Tensor, w: torch.Tensor, k: int, extra: int, num_experts: int, block_m: int
                    ) -> dict[str, Any]:
    """supported: the router GEMM in Triton can take the call ("router_linear_topk"'s `parts`: a 16-bit dtype, 1 to
    PARTS_MAX_ROWS rows) and so can the kernel (`_shape_check`); two_launch: Triton runs here at all (as
    "router_linear_topk"'s fallback: F.linear and "router_topk_align", itself falling back to its two launches)."""
    d = moe_router.describe_linear(x, w, k, extra)
    return dict(device=x.device.type, two_launch=d["two_launch"],
                supported=d["parts"] and _shape_check(x.shape[0], w.shape[0], k, extra, num_experts, block_m) is None)


def _linear_sample(device) -> tuple[tuple, dict]:
    # 37 rows (two mask words) x 60 experts x H = 600 (a masked H tail), bf16: each row of x one-hot at its own
    # column h_r, where w's column is a permutation of 60 values exact in bf16 -- every logit an exact single product
    # (F.linear's bit for bit) and no row tied; top-8 + the shared expert's pair (extra 60 of 61) at 8-row blocks
    gen = torch.Generator().manual_seed(2)
    x = torch.zeros(37, 600)
    w = torch.randint(-2, 3, (60, 600), generator=gen).float()
    logits = moe_router.distinct_logits(37, "cpu").float()  # [37, 60]
    cols = torch.randperm(600, generator=gen)[:37]
    x[torch.arange(37), cols] = 1.0
    w[:, cols] = logits.t()
    return (x.to(torch.bfloat16).to(device), w.to(torch.bfloat16).to(device), 8, 60, 61, 8), {}


def register(registry) -> None:
    registry.add_op(NAME, router_topk_align_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="weights and ids as router_topk's; the alignment exactly moe_align's of the ids")
    # the guards decided in `describe` (which has the tensors), as moe_router's two ops read them
    registry.add_implementation(NAME, "triton", router_topk_align_triton, moe_router.supports)
    registry.add_implementation(NAME, "router_topk+moe_align", router_topk_then_align, moe_router.supports_two_launch)
    registry.add_op(LINEAR_NAME, router_linear_topk_align_reference, sample=_linear_sample, compare=compare_linear,
                    describe=describe_linear,
                    tolerance="logits, weights and ids as router_linear_topk's (an ulp of F.linear's; the selection "
                              "exactly router_topk's on the returned logits); the alignment exactly moe_align's of "
                              "the ids")
    registry.add_implementation(LINEAR_NAME, "triton", router_linear_topk_align_triton, moe_router.supports)
    registry.add_implementation(LINEAR_NAME, "linear+router_topk_align", linear_then_topk_align,
                                moe_router.supports_two_launch)
