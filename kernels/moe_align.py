"""MoE routing alignment in Triton (one program at decode sizes, three launches at prefill sizes): (token, slot) pairs
grouped by expert, each expert's group padded to a multiple of BLOCK_M rows -- the `MoeRouting` that the grouped
W4A16 kernels read.

Reference: `kernels.w4a16_gemm.moe_align` (torch: a stable sort, scatter_add counts, cumsums, a scatter and a
searchsorted: ~25 kernel launches). This computes the identical tensors in 1 launch (it also writes the padding rows),
which matters in a decode step: 40 MoE layers x ~25 launches were ~1,000 of its ~5,000 kernels (benchmarks/RESULTS.md).

Algorithm at decode sizes (one program, `_moe_align_sort_kernel`; P = T * top_k pairs <= MAX_PAIRS, E experts <=
MAX_EXPERTS; flat expert ids e[P]):
    key    = sort(e[p] * BLOCK_P + p)                              (a bitonic sort in registers: the reference's
                                                                    stable sort by expert, pair ids in order)
    es[i]  = key[i] / BLOCK_P;  first[i], last[i] = the ends of i's run of equal es (two scans, forward and reverse)
    pad    = (-(last - first + 1)) mod BLOCK_M at each run's last position, else 0
    row[i] = i + (exclusive cumsum of pad)[i];   sorted_pairs[row[i]] = key[i] mod BLOCK_P;
    block_expert[row[i] / BLOCK_M] = es[i]                          (every block of a run holds >= 1 real pair)
after filling sorted_pairs with P and block_expert with E (the padding; one barrier orders the two writes of a row).
Exact integer arithmetic: equal to the reference bit for bit (tests). O(P log^2 P) compare-exchanges.
H200 (2026-12-01, results/moe_align_bench_run2; one CUDA graph of 40 calls): 1.7 / 2.3 / 3.3 / 5.2 / 12.0 us per call
at 8 / 64 / 256 / 512 / 1,024 pairs, against 2.1 / 6.4 / 26.1 us for the first one-program version at 8 / 64 / 256
(O(P^2 + P E) one-hot compare tiles for counts, ranks and gathers; limited to 256 pairs by register spills; removed)
and 40-76 us for the torch version. At 32 streams that is ~0.9 ms of a ~14 ms decode step (40 calls), measured in the
engine as 2,120 -> 2,284 tok/s (Qwen runs 18 -> 19, two processes).

Prefill sizes (MAX_PAIRS < P <= MAX_PAIRS_MULTI) run counts and ranks as one-hot compare tiles over
G = cdiv(P, CHUNK_MULTI) programs in three launches (seventh session; on the H200 since Qwen run 14, where its
start-up self-check passed -- `moe_align_fast` checks every path against the torch version on first use per device
and switches it off on a mismatch); padded[j] = ceil(counts[j] / BLOCK_M) * BLOCK_M:
    count    program g: counts of its chunk of pairs per expert -> partial[g, E]
    offsets  one program: totals, padded starts pstart = cumsum(padded) - padded, then
             starts[g, j] = pstart[j] + sum_{h < g} partial[h, j] (each chunk's first row per expert, in chunk
             order: the stable sort's order); the padding fill of sorted_pairs, and
             block_expert[b] = #{j : ends[j] <= b * BLOCK_M} (ends = cumsum(padded): searchsorted, right=True)
    scatter  program g: row[p] = starts[g, e[p]] + #{q < p in chunk g : e[q] = e[p]}
O(P CHUNK_MULTI + P E + G E + R E / BLOCK_M) in total, spread over G programs but the middle one. The torch version
it replaces at 1,024 tokens is ~25 launches and ~2 ms of a 1k-token prefill's GPU time (Qwen run 12 profile).
"""

from __future__ import annotations

import torch

from kernels import pdl

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
except ImportError:  # CPU-only installs without triton: the reference works, supported() says no
    triton = None

MAX_PAIRS = 1024  # P = tokens x top_k of the one-program path: decode batches up to 128 tokens at top-8 (one
#                   sorted [BLOCK_P] key vector; prefill-sized P takes the multi-program path)
MAX_EXPERTS = 512
CHUNK = 32  # pairs per compare tile of the multi-program path ([CHUNK, BLOCK_E] and [CHUNK, CHUNK_MULTI] int32)
CHUNK_MULTI = 256  # pairs per program of the multi-program path (compared in tiles of CHUNK against the chunk)
MAX_PAIRS_MULTI = 1 << 16  # 8,192 tokens at top-8; more: the torch version
ONE_PROGRAM_WARPS = 4  # warps of the one-program path (`benchmarks/moe_align_bench.py --warps`; only 4 measured
#                        for the sorted kernel: more may help at 1,024 pairs, 12 us)


if triton is not None:

    @triton.jit
    def _run_start(e_a, f_a, e_b, f_b):
        """Scan combine over expert-sorted positions: (expert of the range's last element, first index of its run).
        Written symmetric in (a, b), and associative for sorted input (a run is contiguous)."""
        return tl.maximum(e_a, e_b), tl.where(e_a == e_b, tl.minimum(f_a, f_b), tl.where(e_a > e_b, f_a, f_b))

    @triton.jit
    def _run_end(e_a, l_a, e_b, l_b):
        """The reverse scan's combine: (expert of the range's first element, last index of its run)."""
        return tl.minimum(e_a, e_b), tl.where(e_a == e_b, tl.maximum(l_a, l_b), tl.where(e_a < e_b, l_a, l_b))

    @triton.jit
    def fill_i32(ptr, n, value):
        """ptr[0:n] = value (int32), 1,024 elements a trip: the alignments' padding (pair id P in sorted_pairs,
        owner E in block_expert) before their scatter overwrites the used rows; the caller orders the two writes."""
        for r0 in range(0, n, 1024):
            rs = r0 + tl.arange(0, 1024)
            tl.store(ptr + rs, tl.full((1024,), 0, tl.int32) + value, mask=rs < n)

    @triton.jit
    def _moe_align_sort_kernel(ids, sorted_pairs, block_expert, P, E, NUM_BLOCKS, BLOCK_M: tl.constexpr,
                               BLOCK_P: tl.constexpr, USE_PDL: tl.constexpr = False):
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        # padding everywhere first (pair id P; block owner E), the scatter below overwrites the used rows / blocks;
        # the barrier orders the two writes of a row, which different threads of this one program make
        fill_i32(sorted_pairs, NUM_BLOCKS * BLOCK_M, P)
        fill_i32(block_expert, NUM_BLOCKS, E)
        tl.debug_barrier()
        i = tl.arange(0, BLOCK_P)
        e = tl.load(ids + i, mask=i < P, other=E).to(tl.int32)  # past P: expert E, sorted after every real pair
        key = tl.sort(e * BLOCK_P + i)  # (expert, pair) ascending: the reference's stable sort by expert
        es = key // BLOCK_P  # [BLOCK_P] expert of sorted position i
        first = tl.associative_scan((es, i), 0, _run_start)[1]  # first position of i's expert run
        last = tl.associative_scan((es, i), 0, _run_end, reverse=True)[1]  # its last position
        count = last - first + 1
        used = es < E
        pad = tl.where(used & (i == last), (BLOCK_M - count % BLOCK_M) % BLOCK_M, 0)  # each run's padding rows
        row = i + tl.cumsum(pad, 0) - pad  # + the padding of every earlier run
        tl.store(sorted_pairs + row, key % BLOCK_P, mask=used)
        tl.store(block_expert + row // BLOCK_M, es, mask=used)  # every row of a block writes the same owner

    @triton.jit
    def _count_kernel(ids, partial, P, E, CHUNK_G: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr):
        g = tl.program_id(0)
        ej = tl.arange(0, BLOCK_E)
        counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for s in tl.static_range(CHUNK_G // SUB):
            ps = g * CHUNK_G + s * SUB + tl.arange(0, SUB)
            e_c = tl.load(ids + ps, mask=ps < P, other=-1).to(tl.int32)
            counts += tl.sum((e_c[:, None] == ej[None, :]).to(tl.int32), axis=0)
        tl.store(partial + g * E + ej, counts, mask=ej < E)

    @triton.jit
    def _offsets_kernel(partial, starts, sorted_pairs, block_expert, P, E, G, NUM_BLOCKS, BLOCK_M: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
        ej = tl.arange(0, BLOCK_E)
        e_ok = ej < E
        total = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for g in range(0, G):
            total += tl.load(partial + g * E + ej, mask=e_ok, other=0)
        padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        run = ends - padded  # pstart, then advanced past each chunk's pairs
        for g in range(0, G):  # into their own buffer: `partial` is only read (no in-place order to rely on)
            c = tl.load(partial + g * E + ej, mask=e_ok, other=0)
            tl.store(starts + g * E + ej, run, mask=e_ok)
            run += c
        fill_i32(sorted_pairs, NUM_BLOCKS * BLOCK_M, P)  # padding rows (the scatter launch overwrites the used ones)
        for b0 in range(0, NUM_BLOCKS, BLOCK_B):
            bs = b0 + tl.arange(0, BLOCK_B)
            at = (bs * BLOCK_M)[:, None]
            owner = tl.sum(((ends[None, :] <= at) & e_ok[None, :]).to(tl.int32), axis=1)
            tl.store(block_expert + bs, owner, mask=bs < NUM_BLOCKS)

    @triton.jit
    def _scatter_kernel(ids, starts, sorted_pairs, P, E, CHUNK_G: tl.constexpr, SUB: tl.constexpr):
        g = tl.program_id(0)
        qs = g * CHUNK_G + tl.arange(0, CHUNK_G)
        e_all = tl.load(ids + qs, mask=qs < P, other=-1).to(tl.int32)  # the chunk's experts
        for s in tl.static_range(CHUNK_G // SUB):
            ps = g * CHUNK_G + s * SUB + tl.arange(0, SUB)
            ok = ps < P
            e_c = tl.load(ids + ps, mask=ok, other=-1).to(tl.int32)
            rank = tl.sum(((e_all[None, :] == e_c[:, None]) & (qs[None, :] < ps[:, None])).to(tl.int32), axis=1)
            start = tl.load(starts + g * E + e_c, mask=ok, other=0)
            tl.store(sorted_pairs + start + rank, ps.to(tl.int32), mask=ok)


def aligned_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """R, an alignment's rows (a function of the sizes only, so no host sync): every non-empty expert wastes at most
    block_m - 1 padding rows. The one formula of `w4a16_gemm.moe_align`, this module's kernels and
    `kernels/router_align.py`."""
    return -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m


def _interpreted() -> bool:
    return triton is not None and type(_moe_align_sort_kernel).__name__ == "InterpretedFunction"


def path(idx: torch.Tensor, num_experts: int) -> str | None:
    """Which Triton path runs this routing: "one" (one program, P <= MAX_PAIRS), "multi" (three launches,
    P <= MAX_PAIRS_MULTI), or None (no Triton here -- it needs CUDA, or the interpreter on CPU -- or sizes past both:
    the torch version)."""
    if triton is None or idx.device.type != ("cpu" if _interpreted() else "cuda"):
        return None
    p = idx.numel()
    if not 0 < num_experts <= MAX_EXPERTS or p == 0:
        return None
    return "one" if p <= MAX_PAIRS else "multi" if p <= MAX_PAIRS_MULTI else None


def supported(idx: torch.Tensor, num_experts: int) -> bool:
    """Triton can run here (CUDA, or the interpreter on CPU) and the sizes fit one of its paths (`path`)."""
    return path(idx, num_experts) is not None


def moe_align_triton(idx: torch.Tensor, num_experts: int, block_m: int,
                     num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """idx [T, k] expert ids -> (sorted_pairs int32 [R], block_expert int32 [R / block_m]) with R as in the
    reference `kernels.w4a16_gemm.moe_align` (a function of (P, E, block_m) only: no host sync). `num_warps`: the
    one-program path's (default ONE_PROGRAM_WARPS; benchmarks)."""
    flat = idx.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    p = flat.numel()
    rows = aligned_rows(p, num_experts, block_m)
    nblocks = rows // block_m
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=flat.device)  # padding written by the kernel
    block_expert = torch.empty(nblocks, dtype=torch.int32, device=flat.device)
    if p > MAX_PAIRS:  # prefill sizes: three launches (module docstring)
        g = triton.cdiv(p, CHUNK_MULTI)
        partial = torch.empty((2, g, num_experts), dtype=torch.int32, device=flat.device)  # counts, then starts
        block_e = triton.next_power_of_2(num_experts)
        _count_kernel[(g,)](flat, partial[0], p, num_experts, CHUNK_G=CHUNK_MULTI, SUB=CHUNK, BLOCK_E=block_e,
                            num_warps=4)
        _offsets_kernel[(1,)](partial[0], partial[1], sorted_pairs, block_expert, p, num_experts, g, nblocks,
                              BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_B=CHUNK, num_warps=4)
        _scatter_kernel[(g,)](flat, partial[1], sorted_pairs, p, num_experts, CHUNK_G=CHUNK_MULTI, SUB=CHUNK,
                              num_warps=4)
        return sorted_pairs, block_expert
    _moe_align_sort_kernel[(1,)](flat, sorted_pairs, block_expert, p, num_experts, nblocks, BLOCK_M=block_m,
                                 BLOCK_P=max(16, triton.next_power_of_2(p)),
                                 num_warps=num_warps or ONE_PROGRAM_WARPS, **pdl.launch_options())
    return sorted_pairs, block_expert
