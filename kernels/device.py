"""Where a Triton kernel can run: the one device check behind the kernels' `supports()` guards."""

from __future__ import annotations

MIN_CAPABILITY = (8, 0)  # bf16 loads, casts and tensor cores in hardware
# Triton's e4m3 type (fp8e4nv) compiles for sm_89 and later ("type fp8e4nv not supported in this architecture" on
# sm_80 / sm_86): the minimum of a kernel that loads or stores e4m3 (the FP8 KV pools)
E4M3_MIN_CAPABILITY = (8, 9)


def triton_device_ok(device: str, capability, interpreted: bool, min_capability=MIN_CAPABILITY) -> bool:
    """A kernel built by Triton's interpreter (TRITON_INTERPRET=1 at import: `interpreted`) runs on CPU tensors only;
    a compiled one on CUDA devices of compute capability >= `min_capability` (`capability`: (major, minor) or None).
    The caller checks that Triton is importable at all."""
    if interpreted:
        return device == "cpu"
    return device == "cuda" and capability is not None and tuple(capability) >= tuple(min_capability)
