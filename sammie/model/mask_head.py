"""Segmentation head: per-(image, prompt) pixel decoder, instance mask logits and semantic logits.

Mirrors Meta's `sam3/model/maskformer_segmentation.py` (`UniversalSegmentationHead`, `PixelDecoder`,
`MaskPredictor`) as `sam3/model/sam3_image.py` `_run_segmentation_heads` drives it in eval mode
(`model_builder.py`: `num_upsampling_stages=3`, nearest interpolation, `aux_masks=False`,
`presence_head=False`, `cross_attend_prompt` = 8-head MultiheadAttention with dropout 0).

Per (image, prompt) pair n:
1. prompt cross-attention, pre-norm, no position encodings, residual:
   `memory = memory + MHA(LN(memory), prompt, prompt, key_padding_mask)`;
2. the result, reshaped to [d, G, G], replaces the neck's G x G level (that level is used for its shape only);
3. pixel decoder, top-down: `x = relu(GN(conv3x3(fpn_2G + nearest_up(x))))`, then the same at 4G with the
   next conv/norm. Meta builds one conv+norm per upsampling stage (3) but 3 levels give only 2 fusions, so
   `conv_layers.2` / `norms.2` are checkpoint parameters that never run; we keep them for strict loading;
4. `semantic_seg_head` (1x1 conv -> 1 channel) on the pixel embedding; `instance_seg_head` (1x1 conv d -> d)
   on it, dotted with `mask_predictor.mask_embed` (3-layer ReLU MLP) of the LAST decoder layer's queries
   (`obj_queries[-1]`; Meta passes all layers but uses only the last when `aux_masks=False`).

No clamps, eps beyond the norms' defaults (LayerNorm 1e-5, GroupNorm 1e-5) or fp32 islands in Meta's head.

Per-image vs per-pair (not implemented, they would reorder floating-point sums):
- conv is linear, so `conv0(fpn_2G + up(x))` = `conv0(fpn_2G)` (once per IMAGE, with bias) + `conv0_nobias(up(x))`
  (per pair); GroupNorm is not linear, so nothing after the first norm can be shared.
- `instance_seg_head` is a 1x1 conv (linear) followed only by the query dot product, so it can be folded into the
  queries: `masks = (W^T e_q) . p + e_q . b` with `e_q = mask_embed(q)`; this removes the d x d conv over 4G x 4G
  pixels (~10.9 GFLOP per pair at full size) and the [N, d, 4G, 4G] intermediate.
- a nearest 2x upsample followed by a 3x3 conv equals four 2x2 "polyphase" convs at the low resolution
  (2.25x fewer FLOPs for that term, combined with the first point).
- with a single image Meta broadcasts the per-image levels instead of gathering them (same numbers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sammie.config import Sam3Config
from sammie.model.attention import MultiheadAttention

# Meta hard-codes GroupNorm(8, d) in `PixelDecoder`; it is a checkpoint constant, not a config choice.
_GROUP_NORM_GROUPS = 8
# `PixelDecoder(num_upsampling_stages=3)` in `model_builder.py`: one conv + norm per stage.
_UPSAMPLING_STAGES = 3

# Every Meta key of `segmentation_head.*` is kept (conv_layers.2 / norms.2 are loaded but unused).
IGNORED_REFERENCE_KEYS: tuple[str, ...] = ()


class _PixelDecoder(nn.Module):
    """Top-down FPN fusion (Meta's `PixelDecoder`): nearest upsample, add, conv3x3, GroupNorm, ReLU."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv_layers = nn.ModuleList(nn.Conv2d(dim, dim, 3, padding=1) for _ in range(_UPSAMPLING_STAGES))
        self.norms = nn.ModuleList(nn.GroupNorm(_GROUP_NORM_GROUPS, dim) for _ in range(_UPSAMPLING_STAGES))

    def forward(self, coarse: torch.Tensor, finer: list[torch.Tensor], image_index: torch.Tensor) -> torch.Tensor:
        # coarse [N, d, G, G] per pair; finer: per-image levels from coarse to fine ([B, d, 2G, 2G], [B, d, 4G, 4G])
        x = coarse
        for i, level in enumerate(finer):
            level = level.index_select(0, image_index)  # [N, d, H, W]: per-image feature for each pair
            x = level + F.interpolate(x, size=level.shape[-2:], mode="nearest")
            x = F.relu(self.norms[i](self.conv_layers[i](x)))
        return x  # [N, d, 4G, 4G]


class _MaskPredictor(nn.Module):
    """Meta's `MaskPredictor`: query MLP (`mask_embed`, 3 layers, ReLU between) dotted with pixel embeddings."""

    def __init__(self, dim: int):
        super().__init__()
        self.mask_embed = _MLP(dim, dim, dim, num_layers=3)

    def forward(self, queries: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        # queries [N, Q, d], pixels [N, d, H, W] -> [N, Q, H, W]
        emb = self.mask_embed(queries)  # [N, Q, d]
        return torch.bmm(emb, pixels.flatten(2)).unflatten(-1, pixels.shape[-2:])


class _MLP(nn.Module):
    """Meta's `model_misc.MLP` without residual/out_norm: Linear layers with ReLU between (`layers.i`)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, num_layers: int):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


class MaskHead(nn.Module):
    """`segmentation_head.*`: instance mask logits and semantic logits for every (image, prompt) pair.

    State-dict keys equal Meta's `UniversalSegmentationHead` keys (see `IGNORED_REFERENCE_KEYS`: none dropped).
    """

    def __init__(self, cfg: Sam3Config):
        super().__init__()
        d = cfg.d_model
        self.pixel_decoder = _PixelDecoder(d)
        self.mask_predictor = _MaskPredictor(d)
        self.cross_attend_prompt = MultiheadAttention(d, cfg.heads)
        self.cross_attn_norm = nn.LayerNorm(d)
        self.semantic_seg_head = nn.Conv2d(d, 1, kernel_size=1)
        self.instance_seg_head = nn.Conv2d(d, d, kernel_size=1)

    def forward(
        self,
        fpn: list[torch.Tensor],
        image_index: torch.Tensor,
        memory: torch.Tensor,
        prompt: torch.Tensor,
        prompt_padding: torch.Tensor,
        queries: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """
        fpn: 3 per-IMAGE neck levels, high -> low resolution: [B, d, 4G, 4G], [B, d, 2G, 2G], [B, d, G, G]
             (the G x G level only supplies its shape: the fused memory replaces it).
        image_index: [N] long, image of each (image, prompt) pair.
        memory: [N, G*G, d] fusion-encoder output (row-major over the G x G grid).
        prompt: [N, L, d] prompt tokens; prompt_padding: [N, L] bool, True = padding (ignored).
        queries: [N, Q, d] last decoder layer's query states.
        Returns mask_logits [N, Q, 4G, 4G] and semantic_logits [N, 1, 4G, 4G] in the input dtype.
        """
        n = memory.shape[0]
        h, w = fpn[-1].shape[-2:]
        # 1. prompt cross-attention (pre-norm, residual, no position encodings)
        memory = memory + self.cross_attend_prompt(
            self.cross_attn_norm(memory), prompt, prompt, key_padding_mask=prompt_padding
        )
        # 2. the prompt-conditioned memory becomes the coarsest level: [N, HW, d] -> [N, d, G, G]
        coarse = memory[:, : h * w].transpose(1, 2).reshape(n, -1, h, w)
        # 3. pixel decoder over the finer per-image levels, coarse to fine
        pixels = self.pixel_decoder(coarse, fpn[-2::-1], image_index)  # [N, d, 4G, 4G]
        # 4. heads
        mask_logits = self.mask_predictor(queries, self.instance_seg_head(pixels))  # [N, Q, 4G, 4G]
        semantic_logits = self.semantic_seg_head(pixels)  # [N, 1, 4G, 4G]
        return mask_logits, semantic_logits
