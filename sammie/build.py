"""Build a ready-to-run detector: config, weights (a checkpoint, or loudly-labelled random
weights), tokenizer, device and dtype. The one place that decides these defaults."""

from __future__ import annotations

import logging
import os

import torch

from sammie.config import Sam3Config

log = logging.getLogger(__name__)

RANDOM_WEIGHTS_BANNER = (
    "\n" + "!" * 78 + "\n"
    "!! No checkpoint configured: Sammie is running with RANDOM WEIGHTS.            !!\n"
    "!! Outputs are meaningless. Set SAMMIE_CHECKPOINT (or --checkpoint) to sam3.pt, !!\n"
    "!! sam3.1_multiplex.pt, a transformers model.safetensors or a snapshot dir.     !!\n"
    + "!" * 78
)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_detector(checkpoint: str | None = None, cfg: Sam3Config | None = None, device: str | None = None,
                   dtype: torch.dtype = torch.float32, seed: int = 0):
    """Returns (detector in eval mode on `device`, cfg, tokenizer, load report or None).

    `checkpoint` None falls back to $SAMMIE_CHECKPOINT; if that is unset too the weights are
    random (seeded) and a banner says so. Random init is deterministic per seed and device.
    """
    from sammie.checkpoint import load_checkpoint, resolve
    from sammie.model.detector import Sam3Detector
    from sammie.tokenizer import load_tokenizer

    cfg = cfg or Sam3Config()
    checkpoint = checkpoint or os.environ.get("SAMMIE_CHECKPOINT") or None
    device = torch.device(device) if device else default_device()
    torch.manual_seed(seed)
    with torch.device(device):  # initialise in place: fast on a GPU, no second copy
        detector = Sam3Detector(cfg)
    report = None
    tokenizer_json = None
    if checkpoint:
        report = load_checkpoint(detector, checkpoint)
        tokenizer_json = resolve(checkpoint).tokenizer_json
        log.info(report.summary())
    else:
        log.warning(RANDOM_WEIGHTS_BANNER)
    detector = detector.to(device=device, dtype=dtype).eval()
    detector.random_weights = checkpoint is None
    tokenizer = load_tokenizer(tokenizer_json, cfg.text.context_length)
    return detector, cfg, tokenizer, report
