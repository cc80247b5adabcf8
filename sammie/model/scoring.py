"""Per-query detection logits: dot product of each decoder query with the mean-pooled prompt.

Maths from Meta's `sam3/model/model_misc.py` `DotProductScoring` as built by
`sam3/model_builder.py` `_create_dot_product_scoring` (`prompt_mlp = MLP(d, ffn, d, 2,
residual=True, out_norm=LayerNorm(d))`, `d_proj = d`, `clamp_logits=True`, max 12):

    p = LayerNorm(prompt + linear1(relu(linear0(prompt))))        # prompt_mlp, per token
    pooled = mean of p over the valid (non-padding) prompt tokens # count floored at 1
    logits = clamp(hs_proj(queries) . prompt_proj(pooled) / sqrt(d_proj), -12, 12)

Meta scores every decoder layer's queries (for auxiliary losses); inference only needs the
last. In `Sam3Image` (image model) `supervise_joint_box_scores=False`, so these logits are the
final `pred_logits`; the presence logit is combined only as sigmoid(logit) * sigmoid(presence)
in post-processing. Keys match Meta's `dot_prod_scoring.*`: `prompt_mlp.layers.{0,1}`,
`prompt_mlp.out_norm`, `prompt_proj`, `hs_proj`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sammie.config import Sam3Config
from sammie.model.decoder import MLP

LOGIT_CLAMP = 12.0  # Meta's `clamp_max_val`: keeps the focal loss / matcher finite in training


class DotProductScoring(nn.Module):
    """`forward(queries [N, Q, d], prompt [N, L, d], prompt_padding [N, L] bool True = pad)
    -> logits [N, Q]` (dtype of the weights)."""

    def __init__(self, cfg: Sam3Config):
        super().__init__()
        d = cfg.d_model
        self.prompt_mlp = MLP(d, cfg.ffn_dim, d, 2, residual=True, out_norm=True)
        self.prompt_proj = nn.Linear(d, d)
        self.hs_proj = nn.Linear(d, d)
        self.scale = 1.0 / math.sqrt(d)  # d_proj = d_model

    def forward(self, queries: torch.Tensor, prompt: torch.Tensor, prompt_padding: torch.Tensor) -> torch.Tensor:
        prompt = self.prompt_mlp(prompt)  # [N, L, d]
        valid = (~prompt_padding).to(prompt.dtype)[..., None]  # [N, L, 1]
        pooled = (prompt * valid).sum(1) / valid.sum(1).clamp(min=1.0)  # [N, d]
        key = self.prompt_proj(pooled)  # [N, d]
        logits = (self.hs_proj(queries) @ key[..., None]).squeeze(-1) * self.scale  # [N, Q]
        return logits.clamp(-LOGIT_CLAMP, LOGIT_CLAMP)
