"""Weights into the L2 cache ahead of their use: one launch that issues `cp.async.bulk.prefetch.L2` (sm_90+) over up
to four byte ranges, for the Qwen engine's `weight_prefetch_ahead` (the next decoder layer's projections, issued on
the MoE's side stream while the routed experts run).

Why. A lone decode step's per-layer chain has one big weight read (the FP8 in_proj, 19-25 MB: ~7 us at ~3.7 TB/s,
benchmarks/chain_floor.py) and ~9 latency-bound kernels (router, experts, combine, ...) that use a fraction of the DRAM
bandwidth for ~40 us. Prefetching each kernel's own weights just before its PDL wait gained nothing measurable
(kernels/pdl.py, Qwen run 54): the lead was one predecessor's tail. Issued a layer ahead, the prefetch has ~15 us to
bring the next in_proj into the 50 MB L2, whose read then may come from L2 (benchmarks/prefetch_ahead.py models it).

Contract: `l2_prefetch(tensors)` reads nothing into registers and writes nothing; it only warms L2, so it is safe
beside any kernel and changes no result. Ranges: each tensor's bytes [data_ptr, data_ptr + nbytes), contiguous, start
16-byte aligned (cp.async.bulk's rule; the length is rounded down to a multiple of 16: at most 15 bytes not
prefetched). A launch only where it can run: a CUDA tensor on compute capability >= 9.0 with compiled Triton (not the
interpreter); otherwise a no-op that returns 0. Capturable in a CUDA graph (no host sync).
"""

from __future__ import annotations

import torch

from kernels.device import triton_device_ok

try:
    import triton
    import triton.language as tl

    from kernels.pdl import prefetch_l2_once
except ImportError:  # CPU-only installs without triton: l2_prefetch is a no-op
    triton = None

PIECE = 64 * 1024  # bytes per bulk prefetch instruction (its size operand is 32-bit; pieces keep each one modest)
PROGRAMS = 128  # programs per range: enough SMs issuing that 25 MB goes out as ~3 instructions a program
MAX_RANGES = 4  # ranges per launch (a layer's projections: q, k, v, o or in_proj_qkv, in_proj_z, out_proj)
MIN_CAPABILITY = (9, 0)  # cp.async.bulk.prefetch.L2

if triton is not None:

    @triton.jit
    def _l2_prefetch_kernel(p0, p1, p2, p3, n0, n1, n2, n3, PIECES: tl.constexpr):
        # grid (PROGRAMS, ranges): program (i, j) prefetches pieces i PIECES .. (i + 1) PIECES - 1 of range j (PIECE
        # bytes each; pieces past the range's end issue nothing), from its thread 0
        i, j = tl.program_id(0), tl.program_id(1)
        base = p0 if j == 0 else p1 if j == 1 else p2 if j == 2 else p3
        nbytes = n0 if j == 0 else n1 if j == 1 else n2 if j == 2 else n3
        for q in tl.static_range(PIECES):
            start = (i * PIECES + q).to(tl.int64) * 65536
            prefetch_l2_once(base + start, tl.minimum(nbytes - start, 65536).to(tl.int32))


def pieces_per_program(nbytes: int, programs: int = PROGRAMS) -> int:
    """PIECE-byte pieces each of `programs` programs issues so that they cover `nbytes` (a power of two: one compiled
    kernel per few sizes)."""
    pieces = max(1, -(-nbytes // (programs * PIECE)))
    return 1 << (pieces - 1).bit_length()


def ranges_of(tensors) -> list[tuple[int, int]]:
    """(address, bytes) of each tensor worth prefetching: contiguous, 16-byte-aligned start, its length rounded down to
    a multiple of 16, non-empty; others (views with gaps, odd addresses) are skipped."""
    out = []
    for t in tensors:
        if t is None or not t.is_contiguous() or t.data_ptr() % 16:
            continue
        n = t.numel() * t.element_size() // 16 * 16
        if n > 0:
            out.append((t.data_ptr(), n))
    return out


def can_launch(device: torch.device) -> bool:
    """Compiled Triton on a CUDA device of compute capability >= MIN_CAPABILITY (`kernels.device`; never the
    interpreter: inline PTX)."""
    if triton is None or device.type != "cuda" or _interpreted():
        return False
    return triton_device_ok("cuda", torch.cuda.get_device_capability(device), False, MIN_CAPABILITY)


def _interpreted() -> bool:
    return triton is not None and type(_l2_prefetch_kernel).__name__ == "InterpretedFunction"


def l2_prefetch(tensors) -> int:
    """Issue L2 prefetches of the tensors' bytes (module docstring), <= MAX_RANGES per launch, on the current stream.
    Returns the launches made (0 where it cannot run: CPU, the interpreter, before Hopper)."""
    tensors = [t for t in tensors if t is not None]
    if not tensors or not can_launch(tensors[0].device):
        return 0
    ranges = ranges_of(tensors)
    launches = 0
    for at in range(0, len(ranges), MAX_RANGES):
        group = ranges[at: at + MAX_RANGES]
        pieces = pieces_per_program(max(n for _, n in group))
        ptrs = [p for p, _ in group] + [group[0][0]] * (MAX_RANGES - len(group))
        sizes = [n for _, n in group] + [0] * (MAX_RANGES - len(group))
        _l2_prefetch_kernel[(PROGRAMS, len(group))](*ptrs, *sizes, PIECES=pieces, num_warps=1)
        launches += 1
    return launches
