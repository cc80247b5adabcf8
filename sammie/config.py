"""SAM 3 image-detector configuration: the checkpoint's numbers in one place.

Values follow Meta's `sam3/model_builder.py` (`build_sam3_image_model`); see
`../shared/design/sam3-reference.md` section 2. `Sam3Config.tiny()` is a small
random-weight preset used by the tests: every stage keeps its structure
(windowed + global ViT blocks, tiled abs-pos, RoPE, FPN levels, presence token).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class VisionConfig:
    image_size: int = 1008  # square input side in pixels (the processor resizes to this)
    patch_size: int = 14  # 1008 / 14 = 72 x 72 = 5184 tokens
    width: int = 1024
    depth: int = 32
    heads: int = 16  # head dim 64
    mlp_dim: int = 4736  # int(1024 * 4.625)
    window_size: int = 24  # tokens per window side: 72 / 24 = 3 x 3 windows of 576 tokens
    global_blocks: tuple[int, ...] = (7, 15, 23, 31)
    pretrain_image_size: int = 336  # abs-pos table is 24 x 24 (+cls), tiled to the token grid
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.grid_size % self.window_size:
            raise ValueError(f"token grid {self.grid_size} is not a multiple of window_size {self.window_size}")
        if self.pretrain_image_size % self.patch_size or self.grid_size % self.pretrain_grid_size:
            raise ValueError("the abs-pos table must tile the token grid exactly")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if (self.width // self.heads) % 4:
            raise ValueError("2-D RoPE needs a head dim divisible by 4")
        if any(not 0 <= b < self.depth for b in self.global_blocks):
            raise ValueError(f"global_blocks {self.global_blocks} outside 0..{self.depth - 1}")

    @property
    def grid_size(self) -> int:  # tokens per side: 72
        return self.image_size // self.patch_size

    @property
    def pretrain_grid_size(self) -> int:  # abs-pos table side: 24
        return self.pretrain_image_size // self.patch_size


@dataclass(frozen=True)
class TextConfig:
    width: int = 1024
    depth: int = 24
    heads: int = 16
    context_length: int = 32  # SOT + up to 30 BPE tokens + EOT, zero padded
    vocab_size: int = 49408  # CLIP BPE

    def __post_init__(self):
        if self.width % self.heads:
            raise ValueError(f"text width {self.width} is not divisible by heads {self.heads}")
        if self.context_length < 2:
            raise ValueError("context_length must hold at least SOT and EOT")


@dataclass(frozen=True)
class Sam3Config:
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    d_model: int = 256  # width of neck, geometry encoder, fusion encoder, decoder and heads
    heads: int = 8  # attention heads of the d_model transformers
    ffn_dim: int = 2048  # FFN hidden width of geometry/fusion/decoder layers and the scoring MLP
    geometry_layers: int = 3
    encoder_layers: int = 6
    decoder_layers: int = 6
    num_queries: int = 200
    presence_token: bool = True
    score_threshold: float = 0.5  # keep instances with sigmoid(logit) * sigmoid(presence) > this
    mask_threshold: float = 0.5  # on sigmoid(upsampled mask logits), i.e. logits > 0
    pixel_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    pixel_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by heads {self.heads}")
        if self.d_model % 4:
            raise ValueError("d_model must be divisible by 4 (sine position encodings of x, y, w, h)")
        for name in ("geometry_layers", "encoder_layers", "decoder_layers", "num_queries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("score_threshold", "mask_threshold"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1]")

    @property
    def image_size(self) -> int:
        return self.vision.image_size

    @property
    def feat_size(self) -> int:  # side of the stride-14 map the detector attends to: 72
        return self.vision.grid_size

    @property
    def mask_size(self) -> int:  # side of the predicted mask logits: 4 x 72 = 288
        return 4 * self.vision.grid_size

    @classmethod
    def sam3(cls) -> "Sam3Config":
        """SAM 3 and the SAM 3.1 detector (same text-prompt path)."""
        return cls()

    @classmethod
    def tiny(cls) -> "Sam3Config":
        """Tests only: 112 px input (8 x 8 tokens, 2 x 2 windows of 4 x 4), random weights."""
        return cls(
            vision=VisionConfig(
                image_size=112, patch_size=14, width=64, depth=4, heads=4, mlp_dim=296,
                window_size=4, global_blocks=(1, 3), pretrain_image_size=56,
            ),
            text=TextConfig(width=64, depth=2, heads=4),
            d_model=32, heads=4, ffn_dim=64, geometry_layers=1, encoder_layers=2,
            decoder_layers=2, num_queries=16,
        )

    def with_(self, **changes) -> "Sam3Config":
        return replace(self, **changes)


PRESETS = {"sam3": Sam3Config.sam3, "sam3.1": Sam3Config.sam3, "tiny": Sam3Config.tiny}
