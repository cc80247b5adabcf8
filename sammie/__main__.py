"""Command line: `python -m sammie segment IMAGE "prompt" [...]` (and, later, `serve`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import numpy as np


def _dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def overlay(image, instances, alpha: float = 0.5):
    """RGB PIL image with each instance's mask tinted and its box drawn."""
    from PIL import Image, ImageDraw, ImageOps

    base = np.asarray(ImageOps.exif_transpose(image).convert("RGB")).astype(np.float32)
    rng = np.random.default_rng(0)
    colours = []
    for inst in instances:
        colour = rng.integers(64, 256, size=3).astype(np.float32)
        base[inst.mask] = (1 - alpha) * base[inst.mask] + alpha * colour
        colours.append(tuple(int(c) for c in colour))
    out = Image.fromarray(base.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(out)
    for inst, colour in zip(instances, colours):
        draw.rectangle(inst.box, outline=colour, width=2)
        draw.text((inst.box[0] + 2, inst.box[1] + 2), f"{inst.score:.2f}", fill=colour)
    return out


def cmd_segment(args) -> int:
    from PIL import Image

    from sammie.config import PRESETS
    from sammie.segmenter import Segmenter

    image = Image.open(args.image)
    seg = Segmenter.load(args.checkpoint, PRESETS[args.config](), args.device, _dtype(args.dtype))
    results = seg.segment(image, args.prompts, threshold=args.threshold, max_instances=args.max_instances)[0]
    report = {"image": args.image, "width": image.width, "height": image.height,
              "random_weights": bool(getattr(seg.detector, "random_weights", False)), "prompts": []}
    for prompt, instances in zip(args.prompts, results):
        report["prompts"].append({
            "prompt": prompt,
            "instances": [{"score": round(i.score, 4), "box_xyxy": [round(v, 1) for v in i.box], "area": i.area}
                          for i in instances],
        })
    print(json.dumps(report, indent=2))
    if args.out:
        overlay(image, [i for instances in results for i in instances]).save(args.out)
        print(f"overlay written to {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sammie", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("segment", help="segment one image with one or more text prompts")
    p.add_argument("image")
    p.add_argument("prompts", nargs="+", help='one or more prompts, e.g. "water bottle" person')
    p.add_argument("--checkpoint", default=None,
                   help="sam3.pt, sam3.1_multiplex.pt, model.safetensors or a local HF snapshot dir "
                        "(default: $SAMMIE_CHECKPOINT, else random weights)")
    p.add_argument("--config", default="sam3", choices=["sam3", "sam3.1", "tiny"])
    p.add_argument("--device", default=None, help="cuda, cpu, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--threshold", type=float, default=None, help="score threshold (default 0.5)")
    p.add_argument("--max-instances", type=int, default=None)
    p.add_argument("--out", default=None, help="write an overlay PNG here")
    p.set_defaults(func=cmd_segment)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
