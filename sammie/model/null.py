"""NullDetector: the detector's interface with the model taken out, to measure the serving path's ceiling.

`SammieEngine(EngineConfig(null_model=True))` serves with this in place of `Sam3Detector`: HTTP, body parsing, image
decoding, the scheduler, pre-processing (the real registry op), prompt tokenisation and the prompt cache,
post-processing and encoding all run as usual; only the three model calls become one tiny device op each. Every
logit is -1e4, so sigmoid(logit) * sigmoid(presence) is exactly 0.0 in fp32 and no instance passes any threshold in
[0, 1] (the comparison is strict): answers carry no instances, and the mask path after the selection never runs.
Throughput measured with it is an upper bound for the server around the model, not a model speed.

Shapes follow `sammie.model.detector` with d = 1 and one feature level, as far as the engine reads them:
ImageFeatures(fpn=[[B, 1, 1, 1]], pos=[[1, 1, 1, 1]], geometry [B, 1, 1]); PromptFeatures([P, L, 1], [P, L]);
Grounding(logits [N, Q], presence [N], boxes [N, Q, 4], mask_logits [N, Q, M, M], semantic [N, 1, M, M]) where the
[N, Q, ...] outputs are expanded views of constant buffers made once (no per-call allocation beyond the one op).
"""

from __future__ import annotations

import logging

import torch

from sammie.config import Sam3Config
from sammie.model.detector import Grounding, ImageFeatures, PromptFeatures

log = logging.getLogger(__name__)

NULL_LOGIT = -1e4  # sigmoid(-1e4) == 0.0 exactly in fp32 (exp(1e4) overflows): no score can exceed a threshold >= 0

NULL_MODEL_BANNER = (
    "\n" + "#" * 78 + "\n"
    "## NULL MODEL: the detector is replaced by sammie.model.null.NullDetector.     ##\n"
    "## Every answer has NO instances. For measuring the serving path's ceiling only. ##\n"
    + "#" * 78
)


class NullDetector:
    """Same `encode_images` / `encode_prompts` / `ground` contract as `Sam3Detector`, at the cost of one tiny device
    op per call (so the calls still queue on the device stream and a wedged device still shows)."""

    random_weights = True  # no trained weights are involved: every "random weights" label applies
    null_model = True

    def __init__(self, cfg: Sam3Config, device: torch.device | str, dtype: torch.dtype):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        m = cfg.mask_size
        self._logit = torch.full((1, 1), NULL_LOGIT, dtype=dtype, device=self.device)  # -> logits [N, Q]
        self._box = torch.full((1, 1, 4), 0.5, dtype=torch.float32, device=self.device)  # -> boxes [N, Q, 4]
        self._mask = torch.full((1, 1, 1, 1), NULL_LOGIT, dtype=dtype, device=self.device)  # -> [N, Q, M, M]
        self._pos = torch.zeros((1, 1, 1, 1), dtype=dtype, device=self.device)
        self._no_padding = torch.zeros((1, 1), dtype=torch.bool, device=self.device)
        self.mask_size = m
        log.warning(NULL_MODEL_BANNER)

    def eval(self) -> NullDetector:  # nn.Module's, for callers that call it
        return self

    def parameters(self):  # `Segmenter` reads the dtype from the first parameter
        yield self._logit

    def encode_images(self, pixels: torch.Tensor) -> ImageFeatures:
        """pixels [B, 3, S, S] -> features whose only content is one pixel per image (one strided copy)."""
        b = pixels.shape[0]
        corner = pixels[:, :1, :1, :1].to(self.dtype, copy=True)  # [B, 1, 1, 1]: the one device op
        return ImageFeatures([corner], [self._pos], corner.view(b, 1, 1))

    def encode_prompts(self, token_ids: torch.Tensor) -> PromptFeatures:
        """token_ids [P, L] long -> features [P, L, 1] (one cast), no padding."""
        p, length = token_ids.shape
        return PromptFeatures(token_ids[:, :, None].to(self.dtype), self._no_padding.expand(p, length))

    def ground(self, images: ImageFeatures, prompts: PromptFeatures, image_index: torch.Tensor,
               prompt_index: torch.Tensor) -> Grounding:
        """[N] pairs -> outputs with no instance: presence [N] is the one fill; the rest are expanded views."""
        n, q, m = int(image_index.shape[0]), self.cfg.num_queries, self.mask_size
        presence = torch.full((n,), NULL_LOGIT, dtype=self.dtype, device=self.device)
        return Grounding(self._logit.expand(n, q), presence, self._box.expand(n, q, 4),
                         self._mask.expand(n, q, m, m), self._mask.expand(n, 1, m, m))
