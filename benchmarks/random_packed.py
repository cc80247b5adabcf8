"""Random NVFP4 weights in the checkpoint's layout for the GPU benchmarks (speed does not depend on the values)."""

from __future__ import annotations

import torch

from kernels.nvfp4 import NVFP4Tensor


def random_nvfp4(shape: tuple[int, ...], device: torch.device, generator: torch.Generator) -> NVFP4Tensor:
    """[..., N, K]: random bytes (every E2M1 code) [..., N, K/2], e4m3 block scales in [0.5, 2) [..., N, K/16], fp32
    global scales ~1e-2 per row [..., N]; drawn on `device` in that order from `generator`."""
    *lead, k = shape
    packed = torch.randint(0, 256, (*lead, k // 2), dtype=torch.uint8, device=device, generator=generator)
    scales = (0.5 + 1.5 * torch.rand((*lead, k // 16), device=device, generator=generator)).to(torch.float8_e4m3fn)
    return NVFP4Tensor(packed, scales, 1e-2 * (0.5 + torch.rand(lead, device=device, generator=generator)))
