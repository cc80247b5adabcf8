"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels: process-wide, on by
default on Hopper (the Qwen engine's `programmatic_launch`).

Why. A lone decode step is a chain of ~600 small dependent kernels (H200, Qwen profile run 16: 2.97 ms of GPU time
at ~5 us a kernel), and each one's launch and start-up (block scheduling, its first loads' latency) waits for the
whole of the previous one. With PDL a kernel launched with the `launch_pdl` option may be scheduled before its
predecessor has finished: its blocks become resident and wait at `griddepcontrol.wait` (`gdc_wait`) until the
predecessor has completed and its memory is visible, so the launch latency overlaps the predecessor's tail. CUDA
graphs keep these programmatic edges (CUDA >= 12.3).

Contract of a kernel that takes part (`USE_PDL` constexpr, default False; `enter(USE_PDL)` as its first statement):
    gdc_wait()                 before any global memory access: every input the predecessor wrote is visible, and
                               no output overwrites memory the predecessor still reads
    gdc_launch_dependents()    right after: the successor may be scheduled once every block of this kernel has
                               started (so it never takes SM slots this grid still needs), and it waits in turn
Launched with `**launch_options()`: {USE_PDL: True, launch_pdl: True} when enabled (`set_enabled`, the Qwen engine's
`programmatic_launch` option), else {} -- the plain launch, the kernel's code unchanged (the constexpr removes both
instructions). A kernel launched without the option after one launched with it waits for it as usual (stream order).
Never under the interpreter (inline PTX).

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
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once, as triton.jit does at import
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


if triton is not None:

    @triton.jit
    def enter(USE_PDL: tl.constexpr):
        """A participating kernel's first statement (see the module docstring)."""
        if USE_PDL:
            gdc_wait()
            gdc_launch_dependents()


if os.environ.get(ENV, "0") == "1":  # (the GPU check initialises CUDA: only when asked for)
    set_enabled(device_supports())
