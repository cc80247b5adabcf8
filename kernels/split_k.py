"""What the split-K kernels share: the SM count their split heuristics aim at, and the per-device int32 arrival
counters with which the split that finishes a tile last reduces the others' partials inside the kernel (CUTLASS's
semaphore pattern: every thread's partial stored, a CTA barrier, one acq_rel atomic_add; the last arrival reads the
partials through L2 and re-arms the counter to 0).

Users: the dense W4A16 kernel (`w4a16_gemm`: one counter per output tile), the decode FP8 linear (`fp8_skinny`: one per
N tile), the router GEMV + top-k (`moe_router`: one per row block) and the GDN decode step with its gated norm
(`gdn_decode`'s `gdn_decode_rows_norm_fp8`: one per (row, head); the last slice of a head norms it). Each launch leaves
every counter it touched at 0, so launches may share them as long as they do not overlap in time. The engine's steps run
on one CUDA stream except for the work it forks onto a second one (`qwen_engine/model/streams.py`), which runs under
`counters_of("side")` and so gets counters of its own: two overlapping launches never share one.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the counters (torch) still work, the jit helpers do not exist
    triton = None

SPLIT_COUNTERS = 4096  # counters per device: more tiles than this in one launch -> no counters (the caller reduces
#                        with torch or does not split); the decode shapes use a few hundred
_COUNTERS: dict[tuple[str, int | None, str], torch.Tensor] = {}
_ROLE = threading.local()  # .name: whose counters split_counters hands out on this thread ("" = the main stream's)


@contextmanager
def counters_of(role: str):
    """Launches issued inside use the counter set `role` (e.g. "side": work forked onto a second stream, which may
    overlap the main stream's launches)."""
    before = getattr(_ROLE, "name", "")
    _ROLE.name = role
    try:
        yield
    finally:
        _ROLE.name = before


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of CUDA device `device_index`; 4 without CUDA (the interpreter: small, so that the
    split heuristics still split in tests)."""
    if not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


def role_buffer(store: dict, device: torch.device, numel: int) -> torch.Tensor | None:
    """`store`'s zeroed int32 buffer of `numel` for the device and the current `counters_of` role, made on first use
    (kept: the kernels leave it zeroed again); None on a first use inside a CUDA-graph capture (allocating there would
    put it in the graph's pool; the engine's eager warm-up allocates it before any capture)."""
    key = (device.type, device.index, getattr(_ROLE, "name", ""))
    buf = store.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = store[key] = torch.zeros(numel, dtype=torch.int32, device=device)
    return buf


def split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's zeroed counters (of the current `counters_of` role), or None where they cannot be used: more
    tiles than SPLIT_COUNTERS, or a first use inside a CUDA-graph capture (`role_buffer`)."""
    return None if tiles > SPLIT_COUNTERS else role_buffer(_COUNTERS, device, SPLIT_COUNTERS)


def effective_split(split: int, k_tiles: int, tiles: int, device: torch.device) -> tuple[int, torch.Tensor | None]:
    """The split a launch of `tiles` output tiles over `k_tiles` K tiles runs with, and its arrival counters: 1 (and
    None) without counters (`split_counters`), else the smallest split with the same K tiles per program (every
    split gets a K tile). Used by the swap-AB kernels (`w4a16_swapped`, `fp8_swapped`)."""
    counters = split_counters(device, tiles) if split > 1 else None
    if counters is None:
        return 1, None
    per = -(-k_tiles // split)  # K tiles per program
    return -(-k_tiles // per), counters


if triton is not None:

    @triton.jit
    def last_arrival(counters, tile, arrivals):
        """Call after this program stored its partial of `tile`: True in the one program that arrives last of
        `arrivals` -- every other partial of the tile is then visible to it (read them with ".cg" loads, L2, never a
        stale L1 line). All threads' stores come before the release: a CTA barrier, then one acq_rel atomic."""
        tl.debug_barrier()
        return tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu") == arrivals - 1

    @triton.jit
    def rearm(counters, tile):
        """The last arrival, done with the partials: the tile's counter back to 0 for the next launch (and the next
        CUDA-graph replay)."""
        tl.atomic_xchg(counters + tile, 0)
