"""Weights pulled into L2 ahead of their use by plain loads on a detached CUDA stream (the Qwen engine's
`weight_warm_ahead`).

Why. A lone Qwen decode step is ~415 dependent kernels in ~2.27 ms on the H200. Its FP8 projections read their
weights from DRAM on the critical path; from L2 they are faster (fp8_skinny_bench run 4, `--resident`: GDN in_proj
9.93 -> 7.16 us, attention q/k/v 7.14 -> 5.40, out_proj 4.69 -> 3.60; up to ~144 us a step). A bulk L2 prefetch
(`cp.async.bulk.prefetch.L2`) issued one layer ahead from a kernel of the chain stalled that kernel until its
prefetches were done, at ~60 GB/s (benchmarks/prefetch_ahead.py run 1: 16.4 -> 420.7 us a layer). Here the reads run
in their own kernel on a stream that the step joins only at its end, so nothing of the chain waits for them: the
chain's kernels use a fraction of the DRAM bandwidth (a lone step moves ~1.8 GB in ~2.27 ms, ~0.8 of ~4.8 TB/s), and a
few programs on the side can stream the next layer's ~35 MB of projections into the 60 MB L2 while this layer runs.

Modes (`warm(..., mode=)`):
    "load"       every 32-bit word loaded (`ld.global.cg`: L2 only, not L1) and folded into one xor per program,
                 stored to `out` (so that the loads are not dead code; `reference` is that xor: the test that every
                 byte was read)
    "load_last"  plain loads with the evict_last policy (the lines stay while normal-priority lines are evicted;
                 ptxas allows no `.cg` with it)
    "prefetch"   one `prefetch.global.L2::evict_last` per 128-byte line: no data reaches registers, the kernel does
                 not wait for the lines (compiled only: inline PTX; `out` keeps zeros)
What reads the weights is unchanged, so a warm-up changes no output bit; the test of a mode is its checksum (loads)
and the engine's tokens (tests/test_l2_warm.py, tests/test_qwen_engine.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: `reference` still works
    triton = None

MODES = ("load", "load_last", "prefetch")
WORDS_PER_STEP = 4096  # int32 words a program loads per loop step (16 KB: 32 a thread at 4 warps, 8 x 16-byte loads
#                        in flight per thread)
LINE_WORDS = 32  # a 128-byte L2 line in words (the prefetch mode's stride)
PROGRAMS = 32  # programs per launch: ~1/4 of the H200's 132 SMs, so the chain's kernels keep most of them; at a few
#                tens of GB/s a program (one loop step in flight) that streams a 25 MB projection in ~10-20 us, well
#                inside a ~55 us layer (benchmarks/prefetch_ahead.py --warm times it)
_MODE_CODE = {m: i for i, m in enumerate(MODES)}

if triton is not None:

    @triton.jit
    def _warm_kernel(src, out, n_words, STEP: tl.constexpr, MODE: tl.constexpr, LINE: tl.constexpr):
        # program p reads words [p STEP, (p + 1) STEP), then every num_programs-th step after; out[p]: their xor
        p = tl.program_id(0)
        stride = tl.num_programs(0) * STEP
        if MODE == 2:
            lines = tl.arange(0, STEP // LINE) * LINE
            for start in range(p * STEP, n_words, stride):
                offs = start + lines
                tl.inline_asm_elementwise(
                    """{
                    .reg .pred q;
                    setp.lt.s32 q, $2, $3;
                    @q prefetch.global.L2::evict_last [$1];
                    mov.u32 $0, 0;
                    }""",
                    "=r,l,r,r", [(src + offs).to(tl.int64, bitcast=True), offs, n_words + tl.zeros_like(offs)],
                    dtype=tl.int32, is_pure=False, pack=1)
            tl.store(out + p, 0)
        else:
            acc = tl.zeros([STEP], dtype=tl.int32)
            words = tl.arange(0, STEP)
            for start in range(p * STEP, n_words, stride):
                offs = start + words
                if MODE == 1:
                    x = tl.load(src + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
                else:
                    x = tl.load(src + offs, mask=offs < n_words, other=0, cache_modifier=".cg")
                acc = acc ^ x
            tl.store(out + p, tl.xor_sum(acc, 0))


def words_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under tensor t (a view of a fused buffer warms the buffer) as int32 words [n]: its bytes
    rounded down to a multiple of 4 (a tail of < 4 bytes shares a line with the words before it)."""
    storage = t.untyped_storage()
    n = storage.nbytes() // 4
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (4 * n,)).view(torch.int32)


def reference(words: torch.Tensor, programs: int, step: int = WORDS_PER_STEP) -> torch.Tensor:
    """What the load modes store: out[p] = xor of words[s : s + step] over the steps s = p step, (p + programs)
    step, ... -> int32 [programs] (xor is associative and commutative: any order gives these bits)."""
    import numpy as np

    n = words.numel()
    w = np.zeros(n + (-n) % (programs * step), dtype=np.int32)
    w[:n] = words.reshape(-1).cpu().numpy()
    return torch.from_numpy(np.bitwise_xor.reduce(w.reshape(-1, programs, step), axis=(0, 2)))


_SCRATCH: dict[tuple[str, int | None], torch.Tensor] = {}


def scratch(device: torch.device, programs: int = PROGRAMS) -> torch.Tensor:
    """The device's int32 [programs] checksum buffer the launches write (made on first use: the engine's eager
    warm-up, before any graph capture; every warm launch of a device is on one stream, so they may share it)."""
    key = (device.type, device.index)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < programs:
        buf = _SCRATCH[key] = torch.zeros(programs, dtype=torch.int32, device=device)
    return buf


def warm(t: torch.Tensor, mode: str = "load", programs: int = PROGRAMS, out: torch.Tensor | None = None) -> None:
    """Read the storage under t into L2 on the current stream (one launch of `programs` programs). Meant for a stream
    that nothing waits on until the reads are long done (`qwen_engine.model.streams.warm_stream`)."""
    if mode not in MODES:
        raise ValueError(f"l2 warm mode must be one of {MODES}, got {mode!r}")
    if triton is None:
        raise RuntimeError("kernels.l2_warm needs triton")
    words = words_of(t)
    if words.numel() == 0:
        return
    if words.numel() >= 2**31 - programs * WORDS_PER_STEP:
        raise ValueError(f"l2 warm: {words.numel()} words exceed the kernel's int32 offsets")
    out = scratch(t.device, programs) if out is None else out
    _warm_kernel[(programs,)](words, out, words.numel(), STEP=WORDS_PER_STEP, MODE=_MODE_CODE[mode], LINE=LINE_WORDS,
                              num_warps=4)
