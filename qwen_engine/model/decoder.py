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
                      batch: FlatBatch) -> torch.Tensor:
        """x [N, hidden]: the flat tokens of a variable-length step over paged state (see `paged.py`). Where the
        mixer's decode path quantises its input for FP8 projections (`quantized.QUANT_IN_PRODUCERS`), the input norm
        writes those codes too."""
        mixer = self.self_attn if self.layer_type == FULL_ATTENTION else self.linear_attn
        scale = mixer.decode_input_scale(x, batch)
        h, codes = (self.input_layernorm(x), None) if scale is None else self.input_layernorm.forward_fp8(x, scale)
        if self.layer_type == FULL_ATTENTION:
            h = self.self_attn.forward_paged(h, cos, sin, state, batch, codes)
        else:
            h = self.linear_attn.forward_paged(h, state, batch, codes)
        x, h = self.post_attention_layernorm.forward_add(x, h)  # x + h and its norm, one launch on CUDA
        return self.mlp(h, residual=x)  # x + mlp(...), the add fused on CUDA
