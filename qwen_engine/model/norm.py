"""RMSNorms of Qwen3.5/3.6-MoE: the zero-centred one used everywhere, and the gated one closing each GDN layer.

Mirrors `Qwen3_5MoeRMSNorm` / `Qwen3_5MoeRMSNormGated` in transformers 5.24
`models/qwen3_5_moe/modeling_qwen3_5_moe.py`.
Both normalise in fp32 (eps inside the rsqrt); they differ in where the result is cast back, which matters in bf16.

Kernels: on CUDA each norm is one launch of the registry ops "rms_norm_zc" / "rms_norm_gated" (`kernels/rms_norm.py`,
the same casts; ~10 kernels -> 1, ~130 norms per decode step of the full model); elsewhere the plain torch code
below runs (it is also the ops' reference). `fused` on a module (class default None) overrides: True always goes
through the registry (tests: the Triton interpreter on the CPU), False never does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _through_registry(fused: bool | None, x: torch.Tensor) -> bool:
    return fused if fused is not None else x.is_cuda


def _registry():
    from engine_core.registry import default_registry

    return default_registry()


class ZeroCentredRMSNorm(nn.Module):
    """`y = x / rms(x) * (1 + w)`, all in fp32, cast back once at the end. `w` is stored zero-centred (init 0).

    Used for input/post-attention norms, the final norm and the per-head q/k norms (vLLM's `GemmaRMSNorm`).
    """

    fused: bool | None = None  # module docstring

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if _through_registry(self.fused, x):
            return _registry().call("rms_norm_zc", x, self.weight, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm, per value head: `y = w * (x / rms(x)).to(dtype) * silu(z.float())`, weight init 1 (not centred).

    NOTE the cast order (from transformers): the normalised x is cast to the input dtype *before* the weight multiply,
    and the SiLU gate is applied in fp32 before the final cast.
    """

    fused: bool | None = None  # module docstring

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # x, z: [..., dim]
        if _through_registry(self.fused, x):
            return _registry().call("rms_norm_gated", x, z, self.weight, self.eps)
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * y * F.silu(z.float())).to(x.dtype)
