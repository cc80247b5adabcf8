"""Command line: `python -m sammie segment IMAGE "prompt" [...]` and `python -m sammie serve [...]`."""

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


def cmd_serve(args) -> int:
    """Start a local Ray, Serve on host:port and the app; block until Ctrl-C (or SIGTERM), then shut down."""
    import os

    from engine_core.local_serve import on_cuda, parse_set, serve_locally

    config = args.config
    if config == "auto":
        # Full size wherever it is useful; on a CPU-only machine without weights the full model
        # would spend minutes per request on random numbers, so the tiny random model stands in.
        checkpoint = args.checkpoint or os.environ.get("SAMMIE_CHECKPOINT")
        config = "sam3" if (checkpoint or on_cuda(args.device)) else "tiny"
    engine_args = {"config": config, "checkpoint": args.checkpoint, "device": args.device, "dtype": args.dtype}
    engine_args |= parse_set(args.set)
    from sammie.engine import EngineConfig

    cfg = EngineConfig.from_dict(engine_args)  # fail on a typo before starting Ray
    from sammie.serve import make_app

    # GPU: one GPU and a CPU. CPU: every core, since Ray sets the replica's OMP_NUM_THREADS to its num_cpus
    # and torch then computes with that many threads.
    actor = {"num_cpus": 1, "num_gpus": 1} if on_cuda(cfg.device) else {"num_cpus": os.cpu_count() or 1, "num_gpus": 0}
    return serve_locally(
        make_app(cfg, ray_actor_options=actor), name="sammie", host=args.host, port=args.port,
        dashboard=args.dashboard, access_log=args.access_log,
        banner=f"Sammie is serving on http://{args.host}:{args.port} (POST /v1/segment, GET /readyz, /docs); "
               "Ctrl-C to stop")


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

    p = sub.add_parser("serve", help="serve the HTTP API on a local Ray (POST /v1/segment)",
                       description="Starts a local Ray and the Sammie app; Ctrl-C stops both. For clusters use "
                                   "`serve run serve_configs/cluster.yaml`.")
    p.add_argument("--config", default="auto", choices=["auto", "sam3", "sam3.1", "tiny"],
                   help="auto: sam3 with a checkpoint or a GPU, else the tiny random model (CPU demo)")
    p.add_argument("--checkpoint", default=None, help="as for segment (default: $SAMMIE_CHECKPOINT, else random)")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: bf16 on cuda, fp32 on cpu")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other sammie.engine.EngineConfig field, e.g. --set max_image_batch=4 (repeatable)")
    p.add_argument("--dashboard", action="store_true", help="also start Ray's dashboard (needed by `serve status`)")
    p.add_argument("--access-log", action="store_true", help="log one line per request in the HTTP proxy")
    p.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
