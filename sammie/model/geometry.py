"""Geometry (prompt) encoder, text-only path: the one geometry token every SAM 3 prompt carries.

Maths from Meta's `sam3/model/geometry_encoders.py` `SequenceGeometryEncoder.forward` as built by
`sam3/model_builder.py` and fed by `sam3/model/sam3_image.py` `Sam3Image._encode_prompt`. For a
text prompt `Sam3Processor` passes `Sam3Image._get_dummy_prompt` (zero boxes, zero points), so the
point/box embeddings are empty and the sequence is only the CLS token:

    x = norm(final_proj(cls_embed))                     # [1, d], the same for every prompt
    for layer in encode:                                # pre-norm `TransformerEncoderLayer`
        x = layer(x, memory=img, memory_keys=img + pos) # self-attn over 1 token, cross-attn to image
    x = encode_norm(x)

`img` is the stride-14 neck level (raw: `img_pre_norm` only feeds the unused box/point pooling) and
`pos` its sine position encoding. The result depends on the image only, not on the text, so a
caller may run this once per image and index it per (image, prompt) pair.

NOT IMPLEMENTED: box, point and mask prompts. Their parameters (`label_embed`, `points_*_project`,
`boxes_*_project`, `img_pre_norm`) are kept, unused, so Meta's `geometry_encoder.*` keys load with
strict matching. Meta's image model builds no `mask_encoder`, so there are no mask keys.
"""

from __future__ import annotations

import torch
from torch import nn

from sammie.config import Sam3Config
from sammie.model.fusion_encoder import EncoderLayer

# Meta's `SequenceGeometryEncoder(roi_size=7)` default: box prompts are RoI-aligned to 7 x 7 and
# reduced by a 7 x 7 conv (`boxes_pool_project`). Unused by the text path; sets a parameter shape.
BOX_ROI_SIZE = 7
# `boxes_pos_enc_project` takes the sine encoding of the box centre (d) plus raw (h, w) (+2).
BOX_SIZE_FEATURES = 2


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[N, d, H, W] -> [N, HW, d] (row-major, Meta's `flatten(2)`); [N, HW, d] passes through."""
    return x.flatten(2).transpose(1, 2) if x.dim() == 4 else x


class GeometryEncoder(nn.Module):
    """`forward(image_feats, image_pos) -> (geo_tokens [N, 1, d], geo_padding [N, 1] bool)`.

    image_feats: stride-14 level, [N, d, G, G] or already flattened [N, G*G, d].
    image_pos: its position encoding, same layout, batch N or 1 (it does not depend on the image).
    geo_padding is all False (True = pad): the CLS token is always valid. Output dtype = input dtype.
    """

    def __init__(self, cfg: Sam3Config):
        super().__init__()
        d = cfg.d_model
        # --- box / point prompt parameters: kept for strict checkpoint loading, unused ---
        self.label_embed = nn.Embedding(2, d)  # negative / positive prompt label
        self.points_direct_project = nn.Linear(2, d)
        self.points_pool_project = nn.Linear(d, d)
        self.points_pos_enc_project = nn.Linear(d, d)
        self.boxes_direct_project = nn.Linear(4, d)
        self.boxes_pool_project = nn.Conv2d(d, d, BOX_ROI_SIZE)
        self.boxes_pos_enc_project = nn.Linear(d + BOX_SIZE_FEATURES, d)
        self.img_pre_norm = nn.LayerNorm(d)
        # --- text path ---
        self.cls_embed = nn.Embedding(1, d)
        self.final_proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.encode = nn.ModuleList(EncoderLayer(d, cfg.heads, cfg.ffn_dim) for _ in range(cfg.geometry_layers))
        self.encode_norm = nn.LayerNorm(d)

    def forward(self, image_feats: torch.Tensor, image_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        img = _tokens(image_feats)  # [N, HW, d]
        keys = img + _tokens(image_pos)  # [N, HW, d]; Meta adds pos to the cross-attention keys only
        n, d = img.shape[0], img.shape[-1]
        x = self.norm(self.final_proj(self.cls_embed.weight))  # [1, d]
        x = x.to(img.dtype).expand(n, 1, d)  # [N, 1, d]
        for layer in self.encode:
            x = layer(x, img, memory_keys=keys)
        x = self.encode_norm(x)  # [N, 1, d]
        return x, torch.zeros(n, 1, dtype=torch.bool, device=img.device)
