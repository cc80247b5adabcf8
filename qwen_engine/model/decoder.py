"""One decoder layer: pre-norm residual token mixer (Gated DeltaNet or gated attention), then pre-norm residual MoE.

Mirrors `Qwen3_5MoeDecoderLayer` in transformers 5.24 `modeling_qwen3_5_moe.py`:
    h = x + mixer(input_layernorm(x));  out = h + mlp(post_attention_layernorm(h))
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL_ATTENTION, QwenConfig
from .attention import GatedAttention
from .gdn import GatedDeltaNet
from .moe import SparseMoE
from .norm import ZeroCentredRMSNorm
from .paged import FlatBatch, GDNSlots, PagedKV
from .state import GDNState, KVCache


class DecoderLayer(nn.Module):
    def __init__(self, cfg: QwenConfig, layer_type: str, gdn_chunk_size: int = 64):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer_type == FULL_ATTENTION:
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg, chunk_size=gdn_chunk_size)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                state: KVCache | GDNState | None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == FULL_ATTENTION:
            h = self.self_attn(h, cos, sin, state)
        else:
            h = self.linear_attn(h, state)
        x, h = self.post_attention_layernorm.forward_add(x, h)  # x + h and its norm, one launch on CUDA
        return self.mlp(h, residual=x)  # x + mlp(...), the add fused on CUDA

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: PagedKV | GDNSlots,
                      batch: FlatBatch, normed: tuple | None = None, next_norm: tuple | None = None
                      ) -> tuple[torch.Tensor, tuple | None]:
        """x [N, hidden]: the flat tokens of a variable-length step over paged state (see `paged.py`) -> (the
        layer's output [N, hidden], its next norm or None). Where the mixer's decode path quantises its input for
        FP8 projections (`quantized.QUANT_IN_PRODUCERS`), the input norm writes those codes too.
        normed: (this layer's input norm of x, its codes or None), already written by the previous layer's MoE
        combine, else None (the norm runs here). next_norm: (the next layer's input norm or the final norm, the
        static scale of its codes or None) for this layer's MoE combine to write in the same launch
        (`SparseMoE.forward_and_norm`), which returns (norm of the output, codes) where it did, else None."""
        if normed is None:
            scale = self.input_scale(x, batch)
            h, codes = (self.input_layernorm(x), None) if scale is None else self.input_layernorm.forward_fp8(x, scale)
        else:
            h, codes = normed
        if self.layer_type == FULL_ATTENTION:
            h = self.self_attn.forward_paged(h, cos, sin, state, batch, codes)
        else:
            h = self.linear_attn.forward_paged(h, state, batch, codes)
        x, h = self.post_attention_layernorm.forward_add(x, h)  # x + h and its norm, one launch on CUDA
        return self.mlp.forward_and_norm(h, x, *(next_norm or ()))  # x + mlp(...), the add fused on CUDA

    def input_scale(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor | None:
        """The static scale of the FP8 codes this layer's mixer reads beside its normed input x [N, hidden] in this
        step (`decode_input_scale`), or None: no codes."""
        mixer = self.self_attn if self.layer_type == FULL_ATTENTION else self.linear_attn
        return mixer.decode_input_scale(x, batch)
