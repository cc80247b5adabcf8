"""The SAM 3 vision backbone: ViT trunk + simple-FPN neck + sine position encodings.

Maths from Meta's `sam3/model/necks.py` (`Sam3DualViTDetNeck`, without the SAM 2 neck),
`sam3/model/position_encoding.py` (`PositionEmbeddingSine`) and `sam3/model/vl_combiner.py`
(`SAM3VLBackbone.forward_image` with scalp=1). From the trunk's [B, width, G, G] map the neck
builds four levels, each ending in conv_1x1 (-> d_model) and conv_3x3:

    convs.0  scale 4    ConvT 2x2 (width -> width/2), GELU, ConvT 2x2 (-> width/4)   [B, d, 4G, 4G]
    convs.1  scale 2    ConvT 2x2 (width -> width/2)                                 [B, d, 2G, 2G]
    convs.2  scale 1    (none)                                                       [B, d,  G,  G]
    convs.3  scale 0.5  MaxPool 2x2                                                  not computed

Meta computes the 0.5x level and then drops it (scalp=1), so we never run convs.3; its weights
stay so that SAM 3 checkpoints load strictly (SAM 3.1 checkpoints do not have them: see
`OPTIONAL_REFERENCE_PREFIX`). State-dict keys equal Meta's `backbone.vision_backbone.*`, apart
from the trunk's RoPE tables (`sammie.model.vit.IGNORED_REFERENCE_SUFFIX`).
"""

from __future__ import annotations

import torch
from torch import nn

from sammie.config import Sam3Config
from sammie.model.position import sine_position_encoding
from sammie.model.vit import ViT, is_ignored_reference_key

# Keys of the unused 0.5x level: present in SAM 3 checkpoints, absent from SAM 3.1 ones.
OPTIONAL_REFERENCE_PREFIX = "convs.3."

# Scale factor of each neck level (Meta's `scale_factors`); the last one is built, never run.
SCALE_FACTORS = (4.0, 2.0, 1.0, 0.5)
NUM_LEVELS = 3  # levels returned (scalp=1 drops the 0.5x one)

__all__ = ["VisionBackbone", "OPTIONAL_REFERENCE_PREFIX", "is_ignored_reference_key"]


def _neck_level(scale: float, width: int, d_model: int) -> nn.Sequential:
    """One neck level with Meta's submodule names (parameter-free ones included for order)."""
    level = nn.Sequential()
    if scale == 4.0:
        level.add_module("dconv_2x2_0", nn.ConvTranspose2d(width, width // 2, kernel_size=2, stride=2))
        level.add_module("gelu", nn.GELU())
        level.add_module("dconv_2x2_1", nn.ConvTranspose2d(width // 2, width // 4, kernel_size=2, stride=2))
        channels = width // 4
    elif scale == 2.0:
        level.add_module("dconv_2x2", nn.ConvTranspose2d(width, width // 2, kernel_size=2, stride=2))
        channels = width // 2
    elif scale == 1.0:
        channels = width
    elif scale == 0.5:
        level.add_module("maxpool_2x2", nn.MaxPool2d(kernel_size=2, stride=2))
        channels = width
    else:
        raise ValueError(f"unsupported neck scale {scale}")
    level.add_module("conv_1x1", nn.Conv2d(channels, d_model, kernel_size=1))
    level.add_module("conv_3x3", nn.Conv2d(d_model, d_model, kernel_size=3, padding=1))
    return level


class VisionBackbone(nn.Module):
    """forward(pixels [B,3,S,S] normalised float) -> (features, positions):

    features:  [B, d, 4G, 4G], [B, d, 2G, 2G], [B, d, G, G] in the weights' dtype (G = S / patch)
    positions: [1, d, 4G, 4G], [1, d, 2G, 2G], [1, d, G, G] sine encodings in the same dtype
               (Meta repeats them over the batch; they are identical for every image, so we
               return them once and let consumers broadcast).
    """

    def __init__(self, cfg: Sam3Config):
        super().__init__()
        self.cfg = cfg
        self.trunk = ViT(cfg.vision)
        self.convs = nn.ModuleList(_neck_level(s, cfg.vision.width, cfg.d_model) for s in SCALE_FACTORS)
        self._register_position_buffers()

    def _register_position_buffers(self, device=None) -> None:
        G = self.cfg.feat_size
        for i, scale in enumerate(SCALE_FACTORS[:NUM_LEVELS]):
            side = int(G * scale)
            pos = sine_position_encoding(side, side, self.cfg.d_model, device=device)  # [1, d, side, side] fp32
            self.register_buffer(f"pos_enc_{i}", pos, persistent=False)

    def reset_buffers(self, device=None) -> None:
        """Recompute all non-persistent buffers (e.g. after `to_empty` from the meta device)."""
        device = device if device is not None else self.trunk.pos_embed.device
        dtype = self.pos_enc_0.dtype
        self.trunk.reset_buffers(device)
        self._register_position_buffers(device)
        for i in range(NUM_LEVELS):
            setattr(self, f"pos_enc_{i}", getattr(self, f"pos_enc_{i}").to(dtype))

    def positions(self) -> list[torch.Tensor]:
        return [getattr(self, f"pos_enc_{i}") for i in range(NUM_LEVELS)]

    def forward(self, pixels: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        x = self.trunk(pixels)  # [B, width, G, G]
        features = [self.convs[i](x) for i in range(NUM_LEVELS)]  # [B, d, 4G/2G/G, ...]
        # Meta computes the encoding in float32 and casts it to the feature dtype.
        positions = [p.to(f.dtype) for p, f in zip(self.positions(), features)]
        return features, positions
