"""`segment(images, prompts)`: text-prompted instance segmentation with Meta's
`Sam3Processor` contract (`../shared/design/sam3-reference.md` section 5):

* pre-processing: `sammie.preprocess` (square resize to image_size, mean/std 0.5);
* score = sigmoid(logit) * sigmoid(presence logit); keep score > threshold (strict);
* box = cxcywh -> xyxy, times (W, H, W, H) of the original image;
* mask = sigmoid(bilinear upsample of the mask logits to (H, W), align_corners=False) > 0.5.

Pre- and post-processing run through the kernel registry (`engine_core/registry.py`) ops "preprocess" (resize +
normalise on the device) and "mask_post" (upsample + cut + column bit-packing on the device), whose references are
exactly the chain above; `kernels=` picks the implementation (`resolve_kernels`). `postprocess_pair` is the plain
per-pair reference of `postprocess_batch`, the batched two-sync serving path that `SammieEngine` shares.

Several prompts on one image reuse its image features; several images batch through the ViT;
each distinct prompt string is encoded once per call. Instances are returned sorted by score
(highest first); Meta returns them in query order, the set is the same.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from engine_core.registry import KernelPreference, resolve_preference
from sammie.config import Sam3Config
from sammie.preprocess import ImageLike, preprocess_batch, to_rgb_uint8

log = logging.getLogger(__name__)

_POPCOUNT = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(1).astype(np.int64)  # byte -> set bits

KERNEL_PREFERENCES = tuple(p.value for p in KernelPreference)  # auto, reference, triton, torch
KERNEL_OPS = ("kernels.preprocess", "kernels.mask_post")  # the registry ops on Sammie's request path


def resolve_kernels(preference: str, device: torch.device | str) -> str:
    """The registry preference actually applied: `engine_core.registry.resolve_preference`'s rule, shared with the
    Qwen engine ("auto" on a CPU device is "reference": Triton runs there only through its interpreter, ~100x slower,
    a correctness tool; "triton" asked for explicitly still gets the interpreter, for tests)."""
    if preference not in KERNEL_PREFERENCES:
        raise ValueError(f"kernels must be one of {list(KERNEL_PREFERENCES)}, got {preference!r}")
    return resolve_preference(preference, torch.device(device)).value


def kernel_registry(preference: str, device: torch.device | str, extra_modules: Sequence[str] = ()):
    """A registry holding the request path's ops (KERNEL_OPS, plus `extra_modules`' ops, e.g. "kernels.fp8_linear"
    for vit_fp8) with `resolve_kernels(preference, device)` applied. One per Segmenter / engine, not the process-wide
    `default_registry()`: two engines in one process (tests, A/B benchmarks) keep their own preferences, self-check
    results and call counts."""
    import importlib

    from engine_core.registry import Registry

    registry = Registry(resolve_kernels(preference, device))
    for module in (*KERNEL_OPS, *extra_modules):
        importlib.import_module(module).register(registry)
    return registry


class Instance:
    """One detected instance. The mask is kept as the device post-processing produced it, bits packed per column
    (`packed`: uint8 [W, ceil(H / 8)], MSB = first row; see `kernels/mask_post.py`), so that the COCO RLE encoder
    (`sammie.masks.encode_instances`) reads it without building a bool image; `mask` unpacks on first use.
    `Instance(score, box, mask)` with a bool mask (the reference path, Meta's oracle, tests) works as before."""

    __slots__ = ("score", "box", "packed", "height", "width", "_mask")

    def __init__(self, score: float, box: tuple[float, float, float, float], mask: np.ndarray | None = None, *,
                 packed: np.ndarray | None = None, height: int | None = None):
        if (mask is None) == (packed is None):
            raise ValueError("an Instance needs exactly one of mask (bool [H, W]) or packed (+ height)")
        if packed is not None and (height is None or packed.ndim != 2 or packed.shape[1] != (height + 7) // 8):
            raise ValueError(f"packed must be uint8 [W, ceil(H / 8)] with height H; got {packed.shape}, {height}")
        self.score = score  # sigmoid(logit) * sigmoid(presence), in (threshold, 1]
        self.box = box  # x0, y0, x1, y1 in original-image pixels
        self.packed = packed  # uint8 [W, ceil(H / 8)] column-packed bits, or None for an unpacked Instance
        self._mask = mask  # bool [H, W], or None until `mask` is first read
        self.height, self.width = (int(mask.shape[0]), int(mask.shape[1])) if mask is not None else \
            (int(height), int(packed.shape[0]))

    @property
    def mask(self) -> np.ndarray:
        """bool [H, W] at the original image size (for packed instances: a transposed view of the [W, H] unpack)."""
        if self._mask is None:
            self._mask = np.unpackbits(self.packed, axis=1, count=self.height).view(np.bool_).T
        return self._mask

    @property
    def area(self) -> int:
        if self.packed is not None:
            return int(_POPCOUNT[self.packed].sum())  # popcount of the packed bits: no unpacking (numpy < 2 too)
        return int(self.mask.sum())

    def __repr__(self) -> str:
        box = ", ".join(f"{v:.1f}" for v in self.box)
        return f"Instance(score={self.score:.4f}, box=({box}), {self.height}x{self.width}, area={self.area})"


def box_cxcywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def select_instances(scores: torch.Tensor, threshold: float, max_instances: int | None) -> torch.Tensor:
    """Query indices kept for one pair: score > threshold (strict), highest first (ties: lower query first), at most
    max_instances. scores: [Q] fp32. (Meta keeps every query over the threshold, in query order; same set.)"""
    keep = torch.nonzero(scores > threshold).flatten()
    keep = keep[scores[keep].argsort(descending=True, stable=True)]
    return keep if max_instances is None else keep[:max_instances]


def postprocess_pair(
    logits: torch.Tensor,  # [Q] raw class logits of one (image, prompt) pair
    presence_logit: torch.Tensor,  # [] presence logit of that pair
    boxes: torch.Tensor,  # [Q, 4] cxcywh in [0, 1]
    mask_logits: torch.Tensor,  # [Q, M, M]
    height: int,
    width: int,
    threshold: float,
    max_instances: int | None = None,
    mask_threshold: float = 0.5,
) -> list[Instance]:
    """The REFERENCE post-processing (Meta's `Sam3Processor._forward_grounding` tail) for one pair, in plain PyTorch,
    with bool masks. `postprocess_batch` is the serving path; tests/test_engine_fastpath.py compares the two."""
    scores = logits.float().sigmoid() * presence_logit.float().sigmoid()
    keep = select_instances(scores, threshold, max_instances)
    if keep.numel() == 0:
        return []
    scale = torch.tensor([width, height, width, height], dtype=torch.float32, device=boxes.device)
    xyxy = box_cxcywh_to_xyxy(boxes[keep].float()) * scale
    masks = F.interpolate(mask_logits[keep].float().unsqueeze(1), (height, width), mode="bilinear",
                          align_corners=False).sigmoid() > mask_threshold  # [K, 1, H, W]; sigmoid kept for exactness
    masks = masks[:, 0].cpu().numpy()
    scores_k = scores[keep].cpu().tolist()
    xyxy = xyxy.cpu().tolist()
    return [Instance(s, tuple(b), m) for s, b, m in zip(scores_k, xyxy, masks)]


def postprocess_batch(
    registry,  # engine_core.registry.Registry holding the "mask_post" op
    logits: torch.Tensor,  # [N', Q] class logits of a grounding batch (N' >= N: padded rows are ignored)
    presence_logits: torch.Tensor,  # [N']
    boxes: torch.Tensor,  # [N', Q, 4] cxcywh in [0, 1]
    mask_logits: torch.Tensor,  # [N', Q, M, M]
    sizes: Sequence[tuple[int, int]],  # N x (height, width) of each pair's original image
    thresholds: Sequence[float],  # N score thresholds
    max_instances: Sequence[int | None],  # N caps
    mask_threshold: float = 0.5,
) -> list[list[Instance]]:
    """`postprocess_pair` for a whole grounding batch with two host syncs in all (not ~4 per pair):

    1. scores [N, Q] and boxes [N, Q, 4] come to the host in ONE copy; instances are selected there (the number kept
       decides every output size, so this sync is unavoidable);
    2. the kept queries' mask logits are gathered on the device (one gather), each group of pairs with the same
       image size goes through the registry op "mask_post" (upsample + sigmoid cut + column bit-packing, one launch),
       and all packed masks come back in ONE copy (8x smaller than bool masks). Skipped when nothing is kept.

    Same results as `postprocess_pair` per pair: the same box arithmetic (on the host instead of the device:
    elementwise IEEE ops), the same selection, masks bit-exact to the reference op (the Triton kernel up to pixels
    within ulps of the cut; see kernels/mask_post.py), and the same score expression, evaluated over [N, Q] instead
    of [Q]: on CPU a score may then differ by 1 ulp (vectorised vs scalar-tail sigmoid), on cuda it is identical."""
    n = len(sizes)
    if n == 0:
        return []
    scores = logits[:n].float().sigmoid() * presence_logits[:n].float().sigmoid()[:, None]  # [N, Q]
    host = torch.cat([scores[..., None], boxes[:n].float()], dim=-1).cpu()  # [N, Q, 5]: sync 1
    keeps = [select_instances(host[i, :, 0], thresholds[i], max_instances[i]) for i in range(n)]
    # kept rows grouped by image size (pairs of one request share it): one mask_post launch per group
    groups: dict[tuple[int, int], list[int]] = {}
    for i, keep in enumerate(keeps):
        if keep.numel():
            groups.setdefault(tuple(sizes[i]), []).append(i)
    packed_of: dict[int, list[np.ndarray]] = {}
    if groups:
        order = [i for members in groups.values() for i in members]  # pair order of the gathered rows
        rows = torch.stack([torch.cat([torch.full_like(keeps[i], i) for i in order]),  # pair of each kept mask
                            torch.cat([keeps[i] for i in order])])  # [2, K_total]: (pair, query)
        rows = rows.to(mask_logits.device, non_blocking=True)  # one small H2D copy
        gathered = mask_logits[rows[0], rows[1]]  # [K_total, M, M]: one gather (no copy of an expanded input)
        outs, start = [], 0
        for (h, w), members in groups.items():
            k = sum(keeps[i].numel() for i in members)
            outs.append(registry.call("mask_post", gathered[start:start + k], h, w, mask_threshold))  # [k, W, HB]
            start += k
        packed_host = torch.cat([o.flatten() for o in outs]).cpu().numpy()  # sync 2
        offset = 0
        for (h, w), members in groups.items():
            row_bytes = w * ((h + 7) // 8)
            for i in members:
                k = keeps[i].numel()
                block = packed_host[offset:offset + k * row_bytes].reshape(k, w, (h + 7) // 8)
                packed_of[i] = list(block)
                offset += k * row_bytes
    results = []
    for i, keep in enumerate(keeps):
        if not keep.numel():
            results.append([])
            continue
        h, w = sizes[i]
        scale = torch.tensor([w, h, w, h], dtype=torch.float32)
        xyxy = (box_cxcywh_to_xyxy(host[i, keep, 1:]) * scale).tolist()
        results.append([Instance(s, tuple(b), packed=p, height=h)
                        for s, b, p in zip(host[i, keep, 0].tolist(), xyxy, packed_of[i])])
    return results


class Segmenter:
    """Holds a detector on one device; `segment` runs images x prompts through it."""

    def __init__(self, detector, cfg: Sam3Config, tokenizer, device: torch.device | str = "cpu",
                 max_image_batch: int = 8, max_pair_batch: int = 16, kernels: str = "auto"):
        self.detector = detector.eval()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = next(detector.parameters()).dtype
        # registry ops "preprocess" and "mask_post", as the engine runs them (kernels: auto | reference | triton |
        # torch; see resolve_kernels)
        self.registry = kernel_registry(kernels, self.device)
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
            pixels = preprocess_batch(self.registry, [rgb[i] for i in chunk], self.cfg, self.device, self.dtype)
            image_feats = self.detector.encode_images(pixels)
            pairs = [(i - start, j) for i in chunk for j in range(len(per_image[i]))]
            for p0 in range(0, len(pairs), self.max_pair_batch):
                part = pairs[p0:p0 + self.max_pair_batch]
                image_index = torch.tensor([i for i, _ in part], device=self.device)
                prompt_index = torch.tensor([prompt_id[per_image[start + i][j]] for i, j in part], device=self.device)
                out = self.detector.ground(image_feats, prompt_feats, image_index, prompt_index)
                found = postprocess_batch(self.registry, out.logits, out.presence_logits, out.boxes, out.mask_logits,
                                          [sizes[start + i] for i, _ in part], [threshold] * len(part),
                                          [max_instances] * len(part), self.cfg.mask_threshold)
                for (i, j), instances in zip(part, found):
                    results[start + i][j] = instances
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
