"""RMSNorms of Qwen3.5/3.6-MoE: the zero-centred one used everywhere, and the gated one closing each GDN layer.

Mirrors `Qwen3_5MoeRMSNorm` / `Qwen3_5MoeRMSNormGated` in transformers 5.24
`models/qwen3_5_moe/modeling_qwen3_5_moe.py`.
Both normalise in fp32 (eps inside the rsqrt); they differ in where the result is cast back, which matters in bf16.

Kernels: on CUDA each norm is one launch of the registry ops "rms_norm_zc" / "rms_norm_gated" (`kernels/rms_norm.py`,
the same casts; ~10 kernels -> 1, ~130 norms per decode step of the full model); elsewhere the plain torch code
below runs (it is also the ops' reference). `fused` on a module (class default None) overrides: True always goes
through the registry (tests: the Triton interpreter on the CPU), False never does. Fused glue on the same path:
`ZeroCentredRMSNorm.forward_add` (the decoder's residual add + norm, "add_rms_norm_zc") and `GatedRMSNorm` taking
the GDN core's fp32 output (rounded to z's dtype inside the kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.rms_norm import rounds_x


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
        return self._plain(x)

    def through_registry(self, x: torch.Tensor) -> bool:
        """Whether this norm of x runs the registry op (the fused path) rather than the plain torch code."""
        return _through_registry(self.fused, x)

    def forward_add(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before the norm: (s, norm(s)) with s = x + h rounded to x.dtype, both [..., dim]. Fused,
        one launch of "add_rms_norm_zc" (the same sum, bit for bit, and the norm of that rounded sum); else the two
        torch ops. Saves the add's launch: one per decoder layer (40 per decode step)."""
        if _through_registry(self.fused, x):
            return _registry().call("add_rms_norm_zc", x, h, self.weight, self.eps)
        s = x + h
        return s, self._plain(s)

    def forward_fp8(self, x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x), its e4m3 codes with the static `input_scale` of the FP8 projections reading it): one launch of
        "rms_norm_zc_fp8" fused, else the norm then `fp8_quant.quantize_static_reference`."""
        if _through_registry(self.fused, x):
            return _registry().call("rms_norm_zc_fp8", x, self.weight, self.eps, input_scale)
        from kernels.fp8_quant import with_static_codes

        return with_static_codes(self(x), input_scale)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
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
        """x may be fp32 with z in bf16/fp16 (the GDN core's output): x is then first rounded to z.dtype, inside the
        fused kernel (no separate cast launch: 30 per decode step), by `.to` here."""
        if _through_registry(self.fused, x):
            return _registry().call("rms_norm_gated", x, z, self.weight, self.eps)
        if rounds_x(x, z):
            x = x.to(z.dtype)
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * y * F.silu(z.float())).to(x.dtype)

    def forward_fp8(self, x: torch.Tensor, z: torch.Tensor, input_scale: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the gated norm, its e4m3 codes with `input_scale`): "rms_norm_gated_fp8" fused, else the two steps."""
        if _through_registry(self.fused, x):
            return _registry().call("rms_norm_gated_fp8", x, z, self.weight, self.eps, input_scale)
        from kernels.fp8_quant import with_static_codes

        return with_static_codes(self(x, z), input_scale)
