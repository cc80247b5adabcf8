"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels: process-wide, on by
default on Hopper (the Qwen engine's `programmatic_launch`).

Why. A lone decode step is a chain of ~600 small dependent kernels (H200, Qwen profile run 16: 2.97 ms of GPU time
at ~5 us a kernel), and each one's launch and start-up (block scheduling, its first loads' latency) waits for the
whole of the previous one. With PDL a kernel launched with the `launch_pdl` option may be scheduled before its
predecessor has finished: its blocks become resident and wait at `griddepcontrol.wait` (`gdc_wait`) until the
predecessor has completed and its memory is visible, so the launch latency overlaps the predecessor's tail. CUDA
graphs keep these programmatic edges (CUDA >= 12.3).

Contract of a kernel that takes part (`USE_PDL` constexpr, default False; `enter(USE_PDL)` before anything that
touches memory -- only index arithmetic and the weight prefetch below come first):
    gdc_wait()                 before any global memory access: every input the predecessor wrote is visible, and
                               no output overwrites memory the predecessor still reads
    gdc_launch_dependents()    right after: the successor may be scheduled once every block of this kernel has
                               started (so it never takes SM slots this grid still needs), and it waits in turn
Launched with `**launch_options()`: {USE_PDL: True, launch_pdl: True} when enabled (`set_enabled`, the Qwen engine's
`programmatic_launch` option), else {} -- the plain launch, the kernel's code unchanged (the constexpr removes both
instructions). A kernel launched without the option after one launched with it waits for it as usual (stream order).
Never under the interpreter (inline PTX).

Weight prefetch (`set_prefetch`, the Qwen engine's `weight_prefetch` option; only with PDL): a kernel that takes a
`PREFETCH` constexpr (`**prefetch_options(aligned)` at its launch) issues, before `enter`, `prefetch_l2` of the
weight bytes its program will read -- memory no kernel of the step writes (projection weights, the router's) -- so
that their DRAM reads run while the predecessor finishes and the kernel's own loads after the wait hit L2. A
prefetch moves no data into registers and reads nothing the predecessor writes, so the contract above still holds
(tests/sm90_compile.py checks that only `cp.async.bulk.prefetch.L2` precedes the wait). Why: each of a lone decode
step's ~550 kernels starts its first weight loads only after its predecessor has ended; its weights' first DRAM
round trips (~1-2 us for the 8-25 MB projections at the H200's ramp-up) then sit on the critical path.
Outcome (H200, 2026-12-03, benchmarks/RESULTS.md Qwen run 54): no gain -- lone decode 428.0 / 430.1 tok/s without,
432.2 with "own", 428.2 with "all"; 32 streams within 0.4% -- and the same greedy tokens; off by default.

Outcome (H200, 2026-12-01, benchmarks/RESULTS.md runs 28-30): the lone decode step 331.1 -> 368.9, 331.0 -> 370.3
and 329.3 -> 368.4 tok/s (three processes, the same engine without and with it; +11-12%); 32 streams +0.4-0.5% with
the 15 lone-step kernels (runs 28-29), +1.5% (2,784.9 -> 2,827.6, one run) with the routing alignment and the
swap-AB experts added (run 30; the two were not isolated in one process); TTFT equal. GPU tests with every
participant launched with PDL (`SAMMIE_PDL=1`, results/pdl_gpu_tests_run1/: 313 + 35 + 175 + 39 passed over four
calls, none failed): test_pdl.py (the late-writer race test among them: the participant reads the final value, the
same launch without its wait the stale one, so the launches overlapped and the wait is what orders them), the
graphed fused-glue engine test, and the files of rms_norm, moe_combine, moe_router, gdn, gdn_prep, fp8_gemv (which
runs the static quantiser), paged_attention, attn_prep, w4a16_gemv, moe_align and the swap-AB kernel. Not run under
PDL: test_kernel_rms_norm_add.py, test_kernel_fp8.py (their kernels ran in the fused-glue and fp8_gemv tests), and
an engine-level check of the MoE chain above 4 tokens (alignment -> swap-AB -> swap-AB, added in run 30; timed, not
compared token for token: `benchmarks/qwen_gpu.py` now records whether side-by-side engines' lone tokens agree).
On by default on Hopper (the engine's "auto", AUTO_MAJORS); sm_10x only when asked for (untested on hardware).
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs without triton (or a triton without GDC): never enabled
    triton = None

_ENABLED = False
_PREFETCH = "off"  # set_prefetch
_EARLY = False  # set_early
# launches issued with a prefetch since import: "own" (PREFETCH), "next" (the MoE gate_up's PREFETCH_NEXT); a captured
# graph's launches count once, at capture. Benchmarks read it to show the prefetch engaged (a misaligned range skips it
# silently)
PREFETCH_LAUNCHES = {"own": 0, "next": 0}
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once, as triton.jit does at import
# `prefetch_l2_once`'s PTX ($1: int64 address, $2: int32 bytes; thread 0 only, nothing when $2 <= 0), shared with
# the Gluon kernels' copy (`kernels/w4a16_regs.py`)
PREFETCH_L2_ONCE_PTX = """{
            .reg .pred p;
            .reg .u32 t;
            mov.u32 t, %tid.x;
            setp.eq.u32 p, t, 0;
            setp.gt.and.s32 p, $2, 0, p;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0;
            }"""
ENV = "SAMMIE_PDL"  # "1": enabled from import on (GPU test runs: every kernel test then launches with PDL; a Qwen
#                     engine still sets it from its own `programmatic_launch` option)


SUPPORTED_MAJORS = (9, 10)  # Hopper (sm_90) and datacenter Blackwell (sm_100): griddepcontrol needs sm_90+; sm_120
#                            is left out (CUDA-graph capture of PDL launches failed there: sglang PR #18596)
AUTO_MAJORS = (9,)  # where the Qwen engine's programmatic_launch "auto" turns it on: measured on the H200 only


def available() -> bool:
    """Triton with GDC support, compiled kernels (not the interpreter)."""
    return triton is not None and not _INTERPRETED


def device_supports(device=None, majors: tuple[int, ...] | None = None) -> bool:
    """A CUDA (not ROCm) GPU whose compute capability major is in `majors` (None: SUPPORTED_MAJORS)."""
    import torch

    return (torch.version.hip is None and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] in (SUPPORTED_MAJORS if majors is None else majors))


def wanted(option: bool | str, device) -> bool:
    """The Qwen engine's `programmatic_launch` option on `device` (a torch.device): "auto" -> a CUDA GPU of a major in
    AUTO_MAJORS (where it was measured), True -> one in SUPPORTED_MAJORS, False -> never."""
    if option is False or getattr(device, "type", None) != "cuda":
        return False
    return device_supports(device, majors=AUTO_MAJORS if option == "auto" else None)


def set_enabled(on: bool) -> bool:
    """Turn PDL on or off for every later launch (process-wide: one engine per replica process); returns whether it
    is on (False where `available()` is not). CUDA graphs keep the setting of their capture."""
    global _ENABLED
    _ENABLED = bool(on) and available()
    return _ENABLED


def enabled() -> bool:
    return _ENABLED


def launch_options() -> dict:
    """Keyword arguments for a participating kernel's launch: the constexpr and Triton's `launch_pdl` option."""
    return {"USE_PDL": True, "launch_pdl": True} if _ENABLED else {}


PREFETCH_MODES = ("off", "own", "next", "all")


def set_prefetch(mode: str | bool) -> str:
    """Weight prefetch (module docstring) for every later launch of the kernels that take it, process-wide like
    `set_enabled` (CUDA graphs keep the setting of their capture): "off"; "own" -- each kernel its own weights
    before its wait; "next" -- only the MoE gate_up launch (the CUDA-core GEMV's or the tensor-core GEMV's)
    prefetching the down projection's bytes of its experts after its wait (`w4a16_gemv.next_prefetch_args`); "all"
    -- both. True / False mean "all" / "off". Returns the mode. It
    takes effect only while PDL is enabled: without PDL a kernel starts after its predecessor has ended."""
    global _PREFETCH
    mode = {True: "all", False: "off"}.get(mode, mode) if isinstance(mode, bool) else mode
    if mode not in PREFETCH_MODES:
        raise ValueError(f"weight prefetch must be one of {PREFETCH_MODES}, got {mode!r}")
    _PREFETCH = mode
    return _PREFETCH


def prefetch_mode() -> str:
    """The mode in force: "off" unless PDL is enabled."""
    return _PREFETCH if _ENABLED else "off"


def prefetch_options(aligned: bool) -> dict:
    """{PREFETCH: True} for a launch whose prefetch ranges are 16-byte aligned and multiples of 16 bytes
    (`cp.async.bulk.prefetch`'s rule; the caller checks its addresses and strides), while PDL and the prefetch ("own"
    or "all") are on; else {} (the kernel's default: no prefetch)."""
    if prefetch_mode() in ("own", "all") and aligned:
        PREFETCH_LAUNCHES["own"] += 1
        return {"PREFETCH": True}
    return {}


def set_early(on: bool) -> bool:
    """Early loads (the Qwen engine's `early_loads`; process-wide like `set_enabled`, CUDA graphs keep the setting of
    their capture): the kernels that take an EARLY constexpr and whose launcher asks for `early_options` read, BEFORE
    their wait, inputs that their predecessor does not write -- the GDN step its state slices
    (`kernels/gdn_decode.py`), the GDN prep its conv windows and gate inputs (`kernels/gdn_prep.py`), the experts'
    down projection its routing and first weight tiles (`kernels/w4a16_regs.py`), the router's GEMM at 5-64 rows its
    weight tile (`kernels/moe_router.py`) -- so that those reads overlap the predecessor's tail. (The few-row FP8
    GEMM's weights as L2 line prefetches before its wait were tried in the fifty-second session: no gain on an H100,
    removed; benchmarks/RESULTS.md.) Each kernel names what its EARLY build reads early and why the predecessor
    cannot write it. It takes effect only while PDL is enabled (without PDL a kernel starts after its predecessor has
    ended). Returns whether it is asked for."""
    global _EARLY
    _EARLY = bool(on)
    return _EARLY


def early() -> bool:
    """Whether early loads are in force: asked for (`set_early`) and PDL enabled."""
    return _EARLY and _ENABLED


def early_options() -> dict:
    """{EARLY: True} for a launch of a kernel that takes EARLY while `early()`, else {} (its default: wait first)."""
    return {"EARLY": True} if early() else {}


def prefetch_next() -> bool:
    """Whether the MoE gate_up launches prefetch their successor's weights (mode "next" or "all", PDL on)."""
    return prefetch_mode() in ("next", "all")


def aligned16(*values: int) -> bool:
    """Every value (addresses, byte strides, byte lengths) a multiple of 16."""
    return all(v % 16 == 0 for v in values)


if triton is not None:

    @triton.jit
    def enter(USE_PDL: tl.constexpr):
        """A participating kernel's first statement (see the module docstring)."""
        if USE_PDL:
            gdc_wait()
            gdc_launch_dependents()

    _PREFETCH_L2_ONCE = tl.constexpr(PREFETCH_L2_ONCE_PTX)  # jit reads constexprs

    @triton.jit
    def prefetch_l2(ptrs, nbytes):
        """Prefetch [ptr, ptr + nbytes) into L2 for each element of the pointer tensor `ptrs` (`nbytes`: int32, a
        scalar or of ptrs' shape; elements with nbytes <= 0 issue nothing). One `cp.async.bulk.prefetch.L2` (sm_90+)
        per element: addresses 16-byte aligned, lengths multiples of 16 (the launch checks: `prefetch_options`).
        No data reaches registers; elements replicated across threads prefetch twice (an L2 hit). Compiled only:
        the interpreter has no PTX, and `prefetch_options` never asks for it there (PDL is off)."""
        tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            setp.gt.s32 p, $2, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0;
            }""",
            "=r,l,r", [ptrs.to(tl.int64), nbytes], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def prefetch_l2_once(ptr, nbytes):
        """`prefetch_l2` of one range [ptr, ptr + nbytes) (scalars: a pointer or an int64 address), issued by the
        program's thread 0 only (every thread of a program holds a scalar: one instruction, not one per thread)."""
        tl.inline_asm_elementwise(_PREFETCH_L2_ONCE, "=r,l,r", [ptr.to(tl.int64), nbytes], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def prefetch_expert_share(nw, ns, e, s_nwe, s_nse, w_bytes, s_bytes):
        """The grouped MoE GEMVs' PREFETCH_NEXT (`w4a16_gemv.next_prefetch_args`): this program's 1 / num_programs(0)
        share, in 16-byte multiples, of expert e's packed slab (w_bytes at nw + e s_nwe) and scale slab (s_bytes at
        ns + e s_nse) of the next launch, by `prefetch_l2_once`."""
        pid_n = tl.program_id(0)
        cw = tl.cdiv(tl.cdiv(w_bytes, tl.num_programs(0)), 16) * 16
        cs = tl.cdiv(tl.cdiv(s_bytes, tl.num_programs(0)), 16) * 16
        prefetch_l2_once(nw + e * s_nwe + pid_n * cw, tl.minimum(cw, w_bytes - pid_n * cw))
        prefetch_l2_once(ns + e * s_nse + pid_n * cs, tl.minimum(cs, s_bytes - pid_n * cs))


if os.environ.get(ENV, "0") == "1":  # (the GPU check initialises CUDA: only when asked for)
    set_enabled(device_supports())
