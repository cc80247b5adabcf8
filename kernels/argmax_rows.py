"""The greedy sampler's argmax over a vocabulary row in one Triton launch spread over the GPU ("argmax_rows").

Reference `argmax_rows_reference` = `torch.argmax(x, dim=-1)`: x [B, V] float -> int64 [B], the first index of the
row's maximum; a NaN counts as larger than every number (the first NaN's index wins), a row of -inf gives 0.

Why. torch reduces a [1, 248,320] row of logits with one block (`reduce_kernel<512, 1>`): 8.7 us of kernel and
12.9 us on a lone decode step's critical path (H200, profile run 23), every step, after lm_head. Here grid (B,
PROGRAMS): each program scans a slice of the row in BLOCK-wide tiles and keeps (value, first index); it
stores that partial, and the program of the row that arrives last (`split_k.last_arrival`, one counter a row) reduces
the row's PROGRAMS partials and writes the index -- one launch, the slices read in parallel.

Exact: values compared in fp32 (bf16 / fp16 widen exactly); ties go to the lower index within a tile, to the earlier
tile within a slice and to the earlier slice across slices, which is the first index overall.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import pdl
from kernels.device import triton_device_ok

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
    from kernels.split_k import last_arrival, rearm, split_counters
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "argmax_rows"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PROGRAMS = 64  # programs a row on the GPU (a 248,320-token row: 3,880 values each); the interpreter: 4
BLOCK = 1024  # values a tile
# A plain launch, never programmatic (PDL), whatever kernels/pdl.py says. Gpu_next step 133 launched it with PDL
# after the decode graph's replay and every stream's greedy tokens changed on the H200 (results/between_steps_run1);
# but PDL after a replay was then shown not to read early (benchmarks/pdl_after_graph.py, results/between_steps_run2:
# 0 of 3 x 50 replays' ids differed, PDL and plain), so the cause was most likely the same run's ids copy on a side
# stream (reverted then; not shown). Plain launches since: the same tokens as torch.argmax (variants runs 1 / 2)
PDL_LAUNCH = False
_NONE = 2**31 - 1  # "no index yet" (larger than any index)


if triton is not None:
    _NONE_C = tl.constexpr(_NONE)  # jit functions may only read constexpr globals

    @triton.jit
    def _best_of(v, idx, ok):
        """(value, index) of values v [N] fp32 at indices idx [N] (ok: present): the first NaN's if any (value NaN),
        else the first maximum's; (-inf, _NONE_C) for nothing present. `idx` need not be in order."""
        nan = (v != v) & ok
        vv = tl.where(ok & (v == v), v, float("-inf"))
        top = tl.max(vv, axis=0)
        first_top = tl.min(tl.where(ok & (vv == top), idx, _NONE_C), axis=0)
        first_nan = tl.min(tl.where(nan, idx, _NONE_C), axis=0)
        any_nan = first_nan != _NONE_C
        return tl.where(any_nan, float("nan"), top), tl.where(any_nan, first_nan, first_top)

    @triton.jit
    def _better(v, i, bv, bi):
        """Whether candidate (v, i) beats the best so far (bv, bi), candidates coming in index order: a first NaN
        beats any number, a number beats only a smaller number (equal: the earlier stays), and anything beats
        nothing yet."""
        n, bn = v != v, bv != bv
        return (i != _NONE_C) & ((bi == _NONE_C) | (n & ~bn) | (~n & ~bn & (v > bv)))

    @triton.jit
    def _argmax_rows_kernel(x, part_v, part_i, out, counters, V, s_xb, SLICE,
                            PROGRAMS_: tl.constexpr, BLOCK_: tl.constexpr, USE_PDL: tl.constexpr = False):
        # grid (B, PROGRAMS_): program p scans x[b, p SLICE : (p + 1) SLICE] (SLICE a multiple of BLOCK_); partials
        # [B, PROGRAMS_] (value fp32, NaN where the slice holds one; index int32); counters: one int32 a row, 0
        # between launches
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        b, p = tl.program_id(0), tl.program_id(1)
        row = x + b.to(tl.int64) * s_xb
        lo = p * SLICE
        bv = tl.full([], float("-inf"), tl.float32)
        bi = tl.full([], _NONE_C, tl.int32)
        for t in range(lo, tl.minimum(lo + SLICE, V), BLOCK_):
            idx = t + tl.arange(0, BLOCK_)
            ok = idx < V
            cv, ci = _best_of(tl.load(row + idx, mask=ok, other=float("-inf")).to(tl.float32), idx, ok)
            take = _better(cv, ci, bv, bi)
            bv, bi = tl.where(take, cv, bv), tl.where(take, ci, bi)
        slot = b * PROGRAMS_ + p
        tl.store(part_v + slot, bv)
        tl.store(part_i + slot, bi)
        if last_arrival(counters, b, PROGRAMS_):  # every slice's partial of row b is visible
            ps = b * PROGRAMS_ + tl.arange(0, PROGRAMS_)
            pi = tl.load(part_i + ps, cache_modifier=".cg")
            _, best = _best_of(tl.load(part_v + ps, cache_modifier=".cg"), pi, pi != _NONE_C)
            tl.store(out + b, tl.where(best == _NONE_C, 0, best).to(tl.int64))
            rearm(counters, b)


def _interpreted() -> bool:
    return triton is not None and type(_argmax_rows_kernel).__name__ == "InterpretedFunction"


def argmax_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of x [B, V] -> int64 [B]."""
    return torch.argmax(x, dim=-1)


def argmax_rows_triton(x: torch.Tensor, programs: int | None = None) -> torch.Tensor:
    """Same contract as `argmax_rows_reference` for the calls `supports` accepts (`programs`: slices a row, tests)."""
    b, v = x.shape
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    p = programs or (4 if _interpreted() else PROGRAMS)
    counters = split_counters(x.device, b)
    if counters is None:  # inside a capture before any eager use, or more rows than counters: torch's
        return torch.argmax(x, dim=-1)
    block = min(BLOCK, triton.next_power_of_2(max(1, -(-v // p))))
    slice_ = -(-(-(-v // p)) // block) * block  # each slice whole tiles; some trailing slices may be empty
    part_v = torch.empty(b * p, dtype=torch.float32, device=x.device)
    part_i = torch.empty(b * p, dtype=torch.int32, device=x.device)
    _argmax_rows_kernel[(b, p)](x, part_v, part_i, out, counters, v, x.stride(0), slice_, PROGRAMS_=p,
                                BLOCK_=block, num_warps=4, **(pdl.launch_options() if PDL_LAUNCH else {}))
    return out


def describe(x: torch.Tensor) -> dict[str, Any]:
    return dict(device=x.device.type, capability=torch.cuda.get_device_capability(x.device) if x.is_cuda else None,
                dtype=x.dtype, dim=x.dim(), unit_stride=x.dim() == 2 and x.stride(-1) == 1,
                vocab=x.shape[-1] if x.dim() else 0)


def supports(*, device: str, capability, dtype: torch.dtype, dim: int, unit_stride: bool, vocab: int,
             **_: Any) -> bool:
    """Triton able to run on `device`; 2-D rows of a float dtype in DTYPES with a unit inner stride, 1 <= V < 2^31."""
    if triton is None:
        return False
    return (triton_device_ok(device, capability, _interpreted()) and dtype in DTYPES and dim == 2 and unit_stride
            and 0 < vocab < _NONE)


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None) -> str | None:
    """Indices must be equal."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"shape / dtype {tuple(out.shape)} {out.dtype} vs {tuple(ref.shape)} {ref.dtype}"
    bad = (out != ref).nonzero()
    return None if bad.numel() == 0 else f"{bad.numel()} rows differ, first row {int(bad[0, 0])}"


def random_inputs(b: int, v: int, dtype=torch.bfloat16, seed: int = 0, device="cpu") -> torch.Tensor:
    """Logit-like rows with ties: values on a coarse grid, so the maximum repeats (the first index must win)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-64, 64, (b, v), generator=gen).float() * 0.25).to(dtype).to(device)


def _sample(device) -> tuple[tuple, dict]:
    return (random_inputs(3, 5000, seed=1, device=device),), {}


def register(registry) -> None:
    registry.add_op(NAME, argmax_rows_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="exact: the same index (the first maximum; a NaN above every number)")
    registry.add_implementation(NAME, "triton", argmax_rows_triton, supports)
