"""The SAM 3 / SAM 3.1 image detector for text prompts, as three separately callable costs:

    encode_images(pixels [B, 3, S, S])         -> ImageFeatures    once per image (96% of FLOPs)
    encode_prompts(token_ids [P, 32])          -> PromptFeatures   once per prompt string (cacheable)
    ground(images, prompts, image_index [N], prompt_index [N]) -> Grounding   per (image, prompt) pair

Submodule names are Meta's (`Sam3Image`: backbone.vision_backbone / backbone.language_backbone,
geometry_encoder, transformer.encoder / transformer.decoder, segmentation_head, dot_prod_scoring),
so a Meta state dict with `detector.` stripped loads 1:1 (`sammie.checkpoint`).

Flow of one pair, as Meta's `Sam3Image.forward_grounding` for a text prompt:
    prompt = [text tokens (32) ; geometry CLS token (1)]        # [N, 33, d], padding mask True = pad
    memory = fusion_encoder(stride-14 image tokens + pos, prompt)   # [N, G*G, d]
    queries, boxes, presence, logits = decoder(memory, pos, prompt) (+ dot-product scoring)
    mask_logits = mask_head(neck levels, memory, prompt, queries)   # [N, Q, 4G, 4G]

One deliberate reorganisation: the geometry token of a text-only prompt depends only on the
image (its dummy box prompt is empty), so it is computed in `encode_images`, once per image,
instead of once per pair; the arithmetic is identical.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from sammie.config import Sam3Config
from sammie.model.decoder import Decoder
from sammie.model.fusion_encoder import FusionEncoder
from sammie.model.geometry import GeometryEncoder
from sammie.model.mask_head import MaskHead
from sammie.model.scoring import DotProductScoring
from sammie.model.text_encoder import TextEncoder
from sammie.model.vision import VisionBackbone


class ImageFeatures(NamedTuple):
    fpn: list[torch.Tensor]  # 3 neck levels [B, d, 4G, 4G], [B, d, 2G, 2G], [B, d, G, G]
    pos: list[torch.Tensor]  # their sine position encodings [1, d, ., .] (input independent)
    geometry: torch.Tensor  # [B, 1, d] geometry CLS token of an empty (text-only) box prompt

    def select(self, index: torch.Tensor) -> "ImageFeatures":
        """Rows `index` of every per-image tensor (e.g. to cache or batch images)."""
        return ImageFeatures([f.index_select(0, index) for f in self.fpn], self.pos, self.geometry.index_select(0, index))


class PromptFeatures(NamedTuple):
    features: torch.Tensor  # [P, L, d] text token states (L = context length, 32)
    padding: torch.Tensor  # [P, L] bool, True = padding token


class Grounding(NamedTuple):
    logits: torch.Tensor  # [N, Q] per-query class logits (clamped to +-12, as Meta)
    presence_logits: torch.Tensor  # [N] "is the concept in the image at all" logit
    boxes: torch.Tensor  # [N, Q, 4] float32 cxcywh in [0, 1] of the resized square image
    mask_logits: torch.Tensor  # [N, Q, 4G, 4G]
    semantic_logits: torch.Tensor  # [N, 1, 4G, 4G]


class _Backbone(nn.Module):
    def __init__(self, cfg: Sam3Config):
        super().__init__()
        self.vision_backbone = VisionBackbone(cfg)
        self.language_backbone = TextEncoder(cfg)


class _Transformer(nn.Module):
    def __init__(self, cfg: Sam3Config):
        super().__init__()
        self.encoder = FusionEncoder(cfg)
        self.decoder = Decoder(cfg)


class Sam3Detector(nn.Module):
    def __init__(self, cfg: Sam3Config):
        super().__init__()
        self.cfg = cfg
        self.backbone = _Backbone(cfg)
        self.geometry_encoder = GeometryEncoder(cfg)
        self.transformer = _Transformer(cfg)
        self.segmentation_head = MaskHead(cfg)
        self.dot_prod_scoring = DotProductScoring(cfg)
        self.random_weights = True  # set False by the checkpoint loader's caller

    def encode_images(self, pixels: torch.Tensor) -> ImageFeatures:
        """pixels: [B, 3, S, S] normalised (see `sammie.preprocess`), in the model dtype."""
        fpn, pos = self.backbone.vision_backbone(pixels)
        geometry, _ = self.geometry_encoder(fpn[-1], pos[-1])  # [B, 1, d]
        return ImageFeatures(fpn, pos, geometry)

    def encode_prompts(self, token_ids: torch.Tensor) -> PromptFeatures:
        """token_ids: [P, L] long from `sammie.tokenizer`."""
        return PromptFeatures(*self.backbone.language_backbone(token_ids))

    def ground(
        self,
        images: ImageFeatures,
        prompts: PromptFeatures,
        image_index: torch.Tensor,  # [N] long, row of `images` for each pair
        prompt_index: torch.Tensor,  # [N] long, row of `prompts` for each pair
    ) -> Grounding:
        text = prompts.features.index_select(0, prompt_index)  # [N, L, d]
        text_padding = prompts.padding.index_select(0, prompt_index)  # [N, L]
        geometry = images.geometry.index_select(0, image_index)  # [N, 1, d]
        prompt = torch.cat([text, geometry], dim=1)  # [N, L+1, d]
        prompt_padding = torch.cat([text_padding, torch.zeros_like(text_padding[:, :1])], dim=1)

        tokens = images.fpn[-1].index_select(0, image_index).flatten(2).transpose(1, 2)  # [N, G*G, d]
        pos = images.pos[-1].flatten(2).transpose(1, 2)  # [1, G*G, d]
        memory = self.transformer.encoder(tokens, pos, prompt, prompt_padding)  # [N, G*G, d]
        dec = self.transformer.decoder(memory, pos.expand_as(memory), prompt, prompt_padding, self.dot_prod_scoring)
        mask_logits, semantic_logits = self.segmentation_head(
            images.fpn, image_index, memory, prompt, prompt_padding, dec.queries
        )
        return Grounding(dec.logits, dec.presence_logits[:, 0], dec.boxes, mask_logits, semantic_logits)

    def forward(self, pixels: torch.Tensor, token_ids: torch.Tensor) -> Grounding:
        """One prompt per image (row i of token_ids goes with image i): for tracing and export."""
        index = torch.arange(pixels.shape[0], device=pixels.device)
        return self.ground(self.encode_images(pixels), self.encode_prompts(token_ids), index, index)
