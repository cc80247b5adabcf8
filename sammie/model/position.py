"""Sine position encodings (DETR style) for the FPN feature maps.

Maths from Meta's `sam3/model/position_encoding.py` (`PositionEmbeddingSine`,
normalize=True, scale=2*pi, temperature=10000). The encoding depends only on
(height, width, d_model), never on the image, so callers precompute it once per
feature-map size; `VisionBackbone` keeps one per FPN level as a buffer.

Layout of the `d_model` channels: the first half encodes the row (y), the second
half the column (x). Within each half, channel 2k is sin(p / T^(2k/h)) and channel
2k+1 is cos of the same angle, where h = d_model / 2, T = temperature and p is the
normalised position in (0, 2*pi].
"""

from __future__ import annotations

import math

import torch

# Meta divides the 1-based index by (side + 1e-6) before scaling by 2*pi; the eps only
# mattered for masked (variable-size) inputs in DETR, but it shifts the last decimals, so keep it.
_NORMALIZE_EPS = 1e-6


def sine_embed(coords: torch.Tensor, num_feats: int, temperature: float = 10000.0) -> torch.Tensor:
    """Interleaved sin/cos embedding of already-scaled coordinates.

    coords: [...] float (angles before frequency division, e.g. x * 2*pi for x in [0, 1])
    returns: [..., num_feats] in coords' dtype; channel 2k = sin(c / T^(2k/num_feats)),
    channel 2k+1 = cos(c / T^(2k/num_feats)) (Meta's `_encode_xy` / `forward`).
    """
    i = torch.arange(num_feats, dtype=torch.float32, device=coords.device)
    dim_t = temperature ** (2 * (i // 2) / num_feats)  # [num_feats], pairs share a frequency
    angles = coords[..., None] / dim_t  # [..., num_feats]
    # sin on even channels, cos on odd ones, interleaved back into one axis
    return torch.stack((angles[..., 0::2].sin(), angles[..., 1::2].cos()), dim=-1).flatten(-2)


def sine_position_encoding(
    height: int,
    width: int,
    d_model: int,
    temperature: float = 10000.0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Position encoding of an H x W feature map: [1, d_model, H, W] float32.

    Equals Meta's `PositionEmbeddingSine(d_model, normalize=True)(x)[0:1]` for any x of
    spatial size (H, W). Computed in float32 as Meta does; cast to the feature dtype at use.
    """
    if d_model % 4:
        raise ValueError(f"d_model {d_model} must be divisible by 4 (sin/cos pairs for y and x)")
    half = d_model // 2
    scale = 2 * math.pi
    y = torch.arange(1, height + 1, dtype=torch.float32, device=device)
    x = torch.arange(1, width + 1, dtype=torch.float32, device=device)
    y = y / (height + _NORMALIZE_EPS) * scale  # [H], last row maps to ~2*pi
    x = x / (width + _NORMALIZE_EPS) * scale  # [W]
    pos_y = sine_embed(y, half, temperature)  # [H, half]
    pos_x = sine_embed(x, half, temperature)  # [W, half]
    pos = torch.cat(
        (pos_y[:, None, :].expand(height, width, half), pos_x[None, :, :].expand(height, width, half)),
        dim=-1,
    )  # [H, W, d_model]
    return pos.permute(2, 0, 1).unsqueeze(0).contiguous()  # [1, d_model, H, W]
