"""Image pre-processing, following Meta's `Sam3Processor` exactly
(`sam3/model/sam3_image_processor.py`; `../shared/design/sam3-reference.md` section 5):

    uint8 CHW -> square bilinear resize (antialias) to image_size, on the model's device
              -> float in [0, 1] -> normalise with mean 0.5, std 0.5 -> [3, S, S]

The aspect ratio is NOT preserved (Meta's contract). Images of any size and mode are accepted:
PIL images are converted to RGB after applying their EXIF orientation.

`Preprocessor` is that chain (the reference); `preprocess_batch` is what the engine and `Segmenter` call: the kernel
registry op "preprocess" (`kernels/preprocess.py`: one fused Triton launch per batch on cuda, `Preprocessor` per image
as its reference).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from sammie.config import Sam3Config

ImageLike = Image.Image | np.ndarray | torch.Tensor


def to_rgb_uint8(image: ImageLike) -> torch.Tensor:
    """Any supported image -> uint8 tensor [3, H, W] on the CPU (no copy when already so).

    PIL: EXIF orientation applied, then converted to RGB (grayscale, palette, RGBA, CMYK, 16-bit
    all become 8-bit RGB; alpha is dropped). ndarray: HxW (gray) or HxWxC with C in {1, 3, 4},
    uint8. Tensor: [3, H, W] uint8.
    """
    if isinstance(image, Image.Image):
        image = ImageOps.exif_transpose(image)
        if image.mode == "I;16" or image.mode.startswith("I;16"):
            # 16-bit grayscale: PIL's convert("RGB") clips instead of scaling; scale to 8 bits
            arr = np.asarray(image, dtype=np.uint16)
            image = Image.fromarray((arr >> 8).astype(np.uint8))
        elif image.mode == "I":
            arr = np.asarray(image, dtype=np.int64).clip(0, 65535)
            image = Image.fromarray((arr >> 8).astype(np.uint8))
        if image.mode != "RGB":
            image = image.convert("RGB")
        return TF.pil_to_tensor(image)
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise TypeError(f"numpy images must be uint8, got {image.dtype}")
        if image.ndim == 2:
            image = image[:, :, None]
        if image.ndim != 3 or image.shape[2] not in (1, 3, 4):
            raise ValueError(f"numpy images must be HxW or HxWxC with C in 1, 3, 4; got {image.shape}")
        image = np.ascontiguousarray(image)
        t = torch.from_numpy(image).permute(2, 0, 1)
        if t.shape[0] == 1:
            t = t.expand(3, -1, -1)
        return t[:3].contiguous()
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"tensor images must be uint8 [3, H, W]; got {image.dtype} {tuple(image.shape)}")
        return image
    raise TypeError(f"unsupported image type {type(image).__name__}")


class Preprocessor:
    """uint8 RGB [3, H, W] -> normalised float [3, S, S] on `device` (Meta's processor chain)."""

    def __init__(self, cfg: Sam3Config):
        s = cfg.image_size
        self.transform = v2.Compose([
            v2.ToDtype(torch.uint8, scale=True),
            v2.Resize(size=(s, s)),  # bilinear, antialias=True: torchvision's v2 default
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(cfg.pixel_mean), std=list(cfg.pixel_std)),
        ])

    def __call__(self, rgb: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        return self.transform(rgb.to(device, non_blocking=True))

    def batch(self, images: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
        """[B, 3, S, S]; each image is resized on its own (sizes differ)."""
        return torch.stack([self(im, device) for im in images])


def preprocess_batch(registry, images: list[torch.Tensor], cfg: Sam3Config, device: torch.device | str,
                     dtype: torch.dtype) -> torch.Tensor:
    """uint8 RGB [3, H_i, W_i] images (host, pinned for an async copy, or already on `device`) -> [B, 3, S, S] of
    `dtype` on `device`, through `registry`'s "preprocess" op. Its reference is `Preprocessor.batch(...).to(dtype)`
    exactly; the Triton kernel agrees with it to the tolerance stated in `kernels/preprocess.py`."""
    on_device = [im.to(device, non_blocking=True) for im in images]
    return registry.call("preprocess", on_device, cfg.image_size, dtype, tuple(cfg.pixel_mean),
                         tuple(cfg.pixel_std), layout="chw")
