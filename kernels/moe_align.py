"""MoE routing alignment in one Triton program: (token, slot) pairs grouped by expert, each expert's group padded
to a multiple of BLOCK_M rows -- the `MoeRouting` that the grouped W4A16 kernel reads.

Reference: `kernels.w4a16_gemm.moe_align` (torch: a stable sort, scatter_add counts, cumsums, a scatter and a
searchsorted: ~25 kernel launches). This computes the identical tensors in 1 launch (it also writes the padding rows),
which matters in a decode step: 40 MoE layers x ~25 launches were ~1,000 of its ~5,000 kernels (benchmarks/RESULTS.md).

Algorithm (one program; P = T * top_k pairs <= MAX_PAIRS, E experts <= MAX_EXPERTS; flat expert ids e[P]):
    counts[j]  = #{p : e[p] = j}                                   (compare-and-sum over chunks of pairs)
    padded[j]  = ceil(counts[j] / BLOCK_M) * BLOCK_M;   ends = cumsum(padded);   pstart = ends - padded
    rank[p]    = #{q < p : e[q] = e[p]}                            (the stable order of the reference's sort)
    sorted_pairs[:] = P (padding), then  row[p] = pstart[e[p]] + rank[p];   sorted_pairs[row[p]] = p
    block_expert[b] = #{j : ends[j] <= b * BLOCK_M}                (= searchsorted(ends, b BLOCK_M, right=True))
Exact integer arithmetic: equal to the reference bit for bit (tests). Register gathers are written as one-hot
compare-and-sum products ([chunk, E] tiles), so nothing goes through memory between phases; the one barrier orders
the padding fill before the scatter.
Cost: O(P^2 + P E + R E / BLOCK_M) integer ops in one program: ~0.1-0.3 M at decode sizes (P <= 256, E = 256),
a few microseconds (unmeasured); larger P uses the torch reference (MAX_PAIRS).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the reference works, supported() says no
    triton = None

MAX_PAIRS = 256  # P = tokens x top_k: decode batches up to 32 tokens at top-8 (larger tiles spill registers: ptxas
#                  sm_90 reports 4 KB of spills at P = 1024; prefill-sized P uses the torch version)
MAX_EXPERTS = 512
CHUNK = 32  # pairs per compare tile ([CHUNK, BLOCK_E] and [CHUNK, BLOCK_P] int32 tiles)


if triton is not None:

    @triton.jit
    def _moe_align_kernel(ids, sorted_pairs, block_expert, P, E, NUM_BLOCKS,
                          BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_B: tl.constexpr, CHUNK_P: tl.constexpr):
        # every row starts as padding (pair id P); the scatter below overwrites the used ones. The barrier orders
        # the two writes of a row, which different threads of this one program make.
        for r0 in range(0, NUM_BLOCKS * BLOCK_M, 1024):
            rs = r0 + tl.arange(0, 1024)
            tl.store(sorted_pairs + rs, tl.full((1024,), 0, tl.int32) + P, mask=rs < NUM_BLOCKS * BLOCK_M)
        tl.debug_barrier()
        ej = tl.arange(0, BLOCK_E)  # expert ids
        qs = tl.arange(0, BLOCK_P)
        e_all = tl.load(ids + qs, mask=qs < P, other=-1).to(tl.int32)  # [BLOCK_P]; -1 matches no expert
        # counts per expert
        counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for c in range(0, tl.cdiv(P, CHUNK_P)):
            ps = c * CHUNK_P + tl.arange(0, CHUNK_P)
            e_c = tl.load(ids + ps, mask=ps < P, other=-1).to(tl.int32)
            counts += tl.sum((e_c[:, None] == ej[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        pstart = ends - padded
        # each pair's row: its expert's padded start + its rank among earlier pairs of the same expert
        for c in range(0, tl.cdiv(P, CHUNK_P)):
            ps = c * CHUNK_P + tl.arange(0, CHUNK_P)
            ok = ps < P
            e_c = tl.load(ids + ps, mask=ok, other=-1).to(tl.int32)
            same_before = (e_all[None, :] == e_c[:, None]) & (qs[None, :] < ps[:, None])  # [CHUNK, BLOCK_P]
            rank = tl.sum(same_before.to(tl.int32), axis=1)
            start = tl.sum(tl.where(e_c[:, None] == ej[None, :], pstart[None, :], 0), axis=1)  # pstart[e_c]
            tl.store(sorted_pairs + start + rank, ps.to(tl.int32), mask=ok)
        # expert of each row block
        bs = tl.arange(0, BLOCK_B)
        at = (bs * BLOCK_M)[:, None]
        owner = tl.sum(((ends[None, :] <= at) & (ej[None, :] < E)).to(tl.int32), axis=1)
        tl.store(block_expert + bs, owner, mask=bs < NUM_BLOCKS)


def _interpreted() -> bool:
    return triton is not None and type(_moe_align_kernel).__name__ == "InterpretedFunction"


def supported(idx: torch.Tensor, num_experts: int) -> bool:
    """Triton can run here (CUDA, or the interpreter on CPU) and the sizes fit one program."""
    if triton is None:
        return False
    device_ok = idx.device.type == ("cpu" if _interpreted() else "cuda")
    return device_ok and 0 < idx.numel() <= MAX_PAIRS and 0 < num_experts <= MAX_EXPERTS


def moe_align_triton(idx: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """idx [T, k] expert ids -> (sorted_pairs int32 [R], block_expert int32 [R / block_m]) with R as in the
    reference `kernels.w4a16_gemm.moe_align` (a function of (P, E, block_m) only: no host sync)."""
    flat = idx.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    p = flat.numel()
    rows = -(-(p + min(num_experts, p) * (block_m - 1)) // block_m) * block_m
    nblocks = rows // block_m
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=flat.device)  # padding written by the kernel
    block_expert = torch.empty(nblocks, dtype=torch.int32, device=flat.device)
    _moe_align_kernel[(1,)](flat, sorted_pairs, block_expert, p, num_experts, nblocks, BLOCK_M=block_m,
                            BLOCK_P=triton.next_power_of_2(p), BLOCK_E=triton.next_power_of_2(num_experts),
                            BLOCK_B=triton.next_power_of_2(nblocks), CHUNK_P=min(CHUNK, triton.next_power_of_2(p)),
                            num_warps=4)
    return sorted_pairs, block_expert
