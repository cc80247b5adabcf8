"""Fusion encoder: image tokens attend to themselves and to the prompt (text + geometry tokens).

Maths from Meta's `sam3/model/encoder.py` (`TransformerEncoderFusion`, `TransformerEncoderLayer.
forward_pre`) as built by `sam3/model_builder.py` and called by `sam3/model/sam3_image.py`
`Sam3Image._run_encoder`: `num_feature_levels=1` (only the stride-14 G x G level, so no
`level_embed`), `add_pooled_text_to_img_feat=False` (no `text_pooling_proj`), no image padding
mask, prompt positional encoding all zeros (so it is dropped here). Per layer, pre-norm:

    h = norm1(x);  x = x + self_attn(q=k=h + pos, v=h)            # over the G*G image tokens
    h = norm2(x);  x = x + cross_attn_image(q=h, k=v=prompt)      # prompt padding masked, no pos
    x = x + linear2(relu(linear1(norm3(x))))

There is no final norm. Meta returns `memory["memory"]` sequence-first [HW, N, d]; we return
batch-first [N, HW, d]. Its `memory_text` is the prompt unchanged (the encoder does not update it).

`EncoderLayer` is also the layer of the geometry encoder (`geometry.py`), which adds the image
position encoding to the cross-attention keys instead of the self-attention queries/keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sammie.config import Sam3Config
from sammie.model.attention import MultiheadAttention


class EncoderLayer(nn.Module):
    """Meta's pre-norm `TransformerEncoderLayer` (ReLU FFN, no dropout). Parameter names match:
    `self_attn`, `cross_attn_image`, `linear1`, `linear2`, `norm1..3`."""

    def __init__(self, d_model: int, heads: int, ffn_dim: int):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, heads)
        self.cross_attn_image = MultiheadAttention(d_model, heads)
        self.linear1 = nn.Linear(d_model, ffn_dim)
        self.linear2 = nn.Linear(ffn_dim, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)

    def forward(
        self,
        x: torch.Tensor,  # [N, L, d] the sequence being encoded
        memory: torch.Tensor,  # [N, M, d] cross-attention values
        memory_keys: torch.Tensor | None = None,  # [N, M, d] cross-attention keys; default `memory`
        memory_padding: torch.Tensor | None = None,  # [N, M] bool, True = pad
        query_pos: torch.Tensor | None = None,  # [N or 1, L, d] added to self-attention q and k
        x_padding: torch.Tensor | None = None,  # [N, L] bool, True = pad (self-attention keys)
    ) -> torch.Tensor:
        h = self.norm1(x)
        qk = h if query_pos is None else h + query_pos
        x = x + self.self_attn(qk, qk, h, key_padding_mask=x_padding)
        h = self.norm2(x)
        keys = memory if memory_keys is None else memory_keys
        x = x + self.cross_attn_image(h, keys, memory, key_padding_mask=memory_padding)
        return x + self.linear2(F.relu(self.linear1(self.norm3(x))))


class FusionEncoder(nn.Module):
    """`forward(image_tokens [N, HW, d], image_pos [N or 1, HW, d], prompt [N, L, d],
    prompt_padding [N, L] bool True=pad) -> memory [N, HW, d]` (input dtype).

    N counts (image, prompt) pairs. HW = G*G tokens of the stride-14 level in row-major (y, x)
    order (Meta's `flatten(2)`); L = text context (32) + 1 geometry token for text prompts.
    Each prompt row must keep at least one unpadded token (the geometry CLS token always is);
    an all-padded row gives a zero cross-attention output, not NaN (see `attention.py`).
    """

    def __init__(self, cfg: Sam3Config):
        super().__init__()
        self.layers = nn.ModuleList(
            EncoderLayer(cfg.d_model, cfg.heads, cfg.ffn_dim) for _ in range(cfg.encoder_layers)
        )

    def forward(
        self,
        image_tokens: torch.Tensor,  # [N, HW, d]
        image_pos: torch.Tensor,  # [N or 1, HW, d]
        prompt: torch.Tensor,  # [N, L, d]
        prompt_padding: torch.Tensor,  # [N, L] bool, True = pad
    ) -> torch.Tensor:
        x = image_tokens
        for layer in self.layers:
            x = layer(x, prompt, memory_padding=prompt_padding, query_pos=image_pos)
        return x  # [N, HW, d]
