"""`segment(images, prompts)`: text-prompted instance segmentation with Meta's
`Sam3Processor` contract (`../shared/design/sam3-reference.md` section 5):

* pre-processing: `sammie.preprocess` (square resize to image_size, mean/std 0.5);
* score = sigmoid(logit) * sigmoid(presence logit); keep score > threshold (strict);
* box = cxcywh -> xyxy, times (W, H, W, H) of the original image;
* mask = sigmoid(bilinear upsample of the mask logits to (H, W), align_corners=False) > 0.5.

Several prompts on one image reuse its image features; several images batch through the ViT;
each distinct prompt string is encoded once per call. Instances are returned sorted by score
(highest first); Meta returns them in query order, the set is the same.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from sammie.config import Sam3Config
from sammie.preprocess import ImageLike, Preprocessor, to_rgb_uint8

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Instance:
    score: float  # sigmoid(logit) * sigmoid(presence), in (threshold, 1]
    box: tuple[float, float, float, float]  # x0, y0, x1, y1 in original-image pixels
    mask: np.ndarray  # bool [H, W] at the original image size

    @property
    def area(self) -> int:
        return int(self.mask.sum())


def box_cxcywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def postprocess_pair(
    logits: torch.Tensor,  # [Q] raw class logits of one (image, prompt) pair
    presence_logit: torch.Tensor,  # [] presence logit of that pair
    boxes: torch.Tensor,  # [Q, 4] cxcywh in [0, 1]
    mask_logits: torch.Tensor,  # [Q, M, M]
    height: int,
    width: int,
    threshold: float,
    max_instances: int | None = None,
) -> list[Instance]:
    """Meta's `Sam3Processor._forward_grounding` tail, for one pair (this is where the host sync
    happens: the number of kept instances decides the output size)."""
    scores = logits.float().sigmoid() * presence_logit.float().sigmoid()
    keep = torch.nonzero(scores > threshold).flatten()
    if max_instances is not None and keep.numel() > max_instances:
        keep = keep[scores[keep].topk(max_instances).indices]
    keep = keep[scores[keep].argsort(descending=True, stable=True)]
    if keep.numel() == 0:
        return []
    scale = torch.tensor([width, height, width, height], dtype=torch.float32, device=boxes.device)
    xyxy = box_cxcywh_to_xyxy(boxes[keep].float()) * scale
    masks = F.interpolate(mask_logits[keep].float().unsqueeze(1), (height, width), mode="bilinear",
                          align_corners=False).sigmoid() > 0.5  # [K, 1, H, W]; sigmoid kept for exactness
    masks = masks[:, 0].cpu().numpy()
    scores_k = scores[keep].cpu().tolist()
    xyxy = xyxy.cpu().tolist()
    return [Instance(s, tuple(b), m) for s, b, m in zip(scores_k, xyxy, masks)]


class Segmenter:
    """Holds a detector on one device; `segment` runs images x prompts through it."""

    def __init__(self, detector, cfg: Sam3Config, tokenizer, device: torch.device | str = "cpu",
                 max_image_batch: int = 8, max_pair_batch: int = 16):
        self.detector = detector.eval()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = next(detector.parameters()).dtype
        self.preprocess = Preprocessor(cfg)
        self.max_image_batch = max_image_batch
        self.max_pair_batch = max_pair_batch

    @classmethod
    def load(cls, checkpoint: str | None = None, cfg: Sam3Config | None = None, device: str | None = None,
             dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs) -> "Segmenter":
        """Build the detector; load `checkpoint` if given, else random weights (logged loudly)."""
        from sammie.build import build_detector

        detector, cfg, tokenizer, _ = build_detector(checkpoint, cfg, device, dtype, seed)
        return cls(detector, cfg, tokenizer, next(detector.parameters()).device, **kwargs)

    @torch.inference_mode()
    def segment(
        self,
        images: ImageLike | Sequence[ImageLike],
        prompts: str | Sequence[str] | Sequence[Sequence[str]],
        threshold: float | None = None,
        max_instances: int | None = None,
    ) -> list[list[list[Instance]]]:
        """Returns result[i][j]: the instances of prompt j on image i.

        `images`: one image or a list. `prompts`: one string, a list of strings applied to every
        image, or one list of strings per image.
        """
        if not isinstance(images, (list, tuple)):
            images = [images]
        per_image = _prompts_per_image(prompts, len(images))
        threshold = self.cfg.score_threshold if threshold is None else threshold
        rgb = [to_rgb_uint8(im) for im in images]
        sizes = [(int(t.shape[1]), int(t.shape[2])) for t in rgb]

        unique = list(dict.fromkeys(p for ps in per_image for p in ps))
        prompt_feats = self.detector.encode_prompts(self.tokenizer(unique).to(self.device))
        prompt_id = {p: k for k, p in enumerate(unique)}

        results: list[list[list[Instance]]] = [[[] for _ in ps] for ps in per_image]
        for start in range(0, len(rgb), self.max_image_batch):
            chunk = range(start, min(start + self.max_image_batch, len(rgb)))
            pixels = self.preprocess.batch([rgb[i] for i in chunk], self.device).to(self.dtype)
            image_feats = self.detector.encode_images(pixels)
            pairs = [(i - start, j) for i in chunk for j in range(len(per_image[i]))]
            for p0 in range(0, len(pairs), self.max_pair_batch):
                part = pairs[p0:p0 + self.max_pair_batch]
                image_index = torch.tensor([i for i, _ in part], device=self.device)
                prompt_index = torch.tensor([prompt_id[per_image[start + i][j]] for i, j in part], device=self.device)
                out = self.detector.ground(image_feats, prompt_feats, image_index, prompt_index)
                for n, (i, j) in enumerate(part):
                    h, w = sizes[start + i]
                    results[start + i][j] = postprocess_pair(
                        out.logits[n], out.presence_logits[n], out.boxes[n], out.mask_logits[n],
                        h, w, threshold, max_instances,
                    )
        return results


def _prompts_per_image(prompts, n_images: int) -> list[list[str]]:
    if isinstance(prompts, str):
        per_image = [[prompts]] * n_images
    elif len(prompts) and all(isinstance(p, str) for p in prompts):
        per_image = [list(prompts)] * n_images
    else:
        per_image = [list(ps) for ps in prompts]
        if len(per_image) != n_images:
            raise ValueError(f"{len(per_image)} prompt lists for {n_images} images")
    for ps in per_image:
        if not ps:
            raise ValueError("every image needs at least one prompt")
        for p in ps:
            if not isinstance(p, str):
                raise TypeError(f"prompts must be strings, got {type(p).__name__}")
    return per_image
