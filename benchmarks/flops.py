"""FLOPs of one image + one prompt through Sammie's detector, counted by `torch.utils.flop_counter.FlopCounterMode`.

    from flops import count_detector_flops
    f = count_detector_flops(Sam3Config(), "cuda")   # {"image": ..., "prompt": ..., "pair": ..., "total": ...}

Counted separately per cost of `sammie.model.detector` (encode_images once per image, encode_prompts once per prompt
string, ground once per (image, prompt) pair), so a benchmark row can say which of them it ran. Attention runs under
the math SDPA backend while counting: FlopCounterMode has no formula for every fused SDPA kernel (the CPU flash
kernel is not counted at all, `../shared/design/sam3-reference.md` section 4), while the math path is plain bmm.
The values of the weights do not matter, so the detector is built uninitialised-random, in bf16 on cuda (fast) and
fp32 elsewhere. 1 multiply-add = 2 FLOPs. The design doc measured 5.61 + 0.44 K TFLOP per image with K prompts
(6.06 TFLOP for K = 1) on Meta's model the same way.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

DESIGN_DOC_TFLOP = 6.06  # sam3-reference.md section 4: one 1008^2 image + one text prompt, Meta's model


def count_detector_flops(cfg, device: torch.device | str) -> dict[str, float]:
    """FLOPs of encode_images (1 image), encode_prompts (1 prompt), ground (1 pair) and their sum."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sammie.model.detector import Sam3Detector
    from sammie.tokenizer import load_tokenizer

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        detector = Sam3Detector(cfg)
    detector = detector.to(dtype).eval().requires_grad_(False)
    tokens = load_tokenizer(None, cfg.text.context_length)(["a person"]).to(device)
    pixels = torch.zeros(1, 3, cfg.image_size, cfg.image_size, device=device, dtype=dtype)
    index = torch.zeros(1, dtype=torch.long, device=device)
    out: dict[str, float] = {}
    # no_grad, not inference_mode: FlopCounterMode's module tracker hooks autograd nodes, which inference tensors lack
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as counter:
            images = detector.encode_images(pixels)
        out["image"] = float(counter.get_total_flops())
        with FlopCounterMode(display=False) as counter:
            prompts = detector.encode_prompts(tokens)
        out["prompt"] = float(counter.get_total_flops())
        with FlopCounterMode(display=False) as counter:
            detector.ground(images, prompts, index, index)
        out["pair"] = float(counter.get_total_flops())
    out["total"] = out["image"] + out["prompt"] + out["pair"]
    del detector, images, prompts
    return out


if __name__ == "__main__":
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sammie.config import PRESETS

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="sam3", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    f = count_detector_flops(PRESETS[args.config](), args.device)
    print({k: f"{v / 1e9:.2f} GFLOP" for k, v in f.items()}, f"(design doc: {DESIGN_DOC_TFLOP} TFLOP)")
