"""Full-size parity of Sammie's detector with Meta's `sam3` on a GPU, at identical random weights.

One run: builds Meta's SAM 3 image model (PyPI sam3==0.1.4) at full size with seeded random
weights, copies them into Sammie through the checkpoint loader (Meta layout), then

  1. raw outputs, fp32 (TF32 off), batched: Meta's `forward_grounding` over all images x prompts
     vs Sammie's encode_images / encode_prompts / ground: relative error per output;
  2. the user contract on real photographs (skimage.data), two prompts each, through the oracle:
     Sammie fp32 vs Meta fp32, Sammie bf16 vs Meta fp32, and Meta's own bf16 autocast vs Meta
     fp32 (what bf16 costs the reference itself); per pair the threshold sits in the widest score
     gap of the middle half (random weights give no scores near Meta's 0.5 default);
  3. first timings at 640x480, one prompt per image (issue 4 builds the real waterfall).

Random weights: speed does not depend on the values; parity is meaningful because both models
hold the same values. Writes parity.json and parity.md under --out.

    python benchmarks/gpu_parity.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

PAIRS = [("astronaut", ["person", "a flag"]), ("coffee", ["a cup", "spoon"]), ("chelsea", ["cat", "whiskers"]),
         ("rocket", ["rocket", "tree"]), ("camera", ["man", "camera"]), ("immunohistochemistry", ["cell", "nucleus"])]


def photos():
    from PIL import Image
    from skimage import data

    return {name: Image.fromarray(getattr(data, name)()) for name, _ in PAIRS}


def threshold_between(scores: np.ndarray) -> float:
    s = np.sort(scores)
    lo, hi = len(s) // 4, 3 * len(s) // 4
    k = lo + int(np.argmax(s[lo + 1:hi + 1] - s[lo:hi]))
    return float((s[k] + s[k + 1]) / 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, iters: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        _sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--config", default="sam3")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu runs the same checks (slowly) for a dry run")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    import sam3  # noqa: F401  (its import turns TF32 on; parity needs it off)

    from engine_core.oracle import instance_metrics, run_oracle, Threshold
    from sammie.checkpoint import load_into
    from sammie.config import PRESETS
    from sammie.model.detector import Sam3Detector
    from sammie.preprocess import Preprocessor, to_rgb_uint8
    from sammie.reference import build_reference_model, cpu_safe, randomize_, reference_segment
    from sammie.segmenter import Segmenter
    from sammie.tokenizer import ClipTokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(args.device)
    cfg = PRESETS[args.config]()
    result: dict = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu", "torch": torch.__version__, "python": platform.python_version(),
                    "config": args.config, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    t0 = time.time()
    meta = randomize_(build_reference_model(cfg, device=dev, seed=0), seed=0).eval()
    ours = Sam3Detector(cfg).to(dev).eval()
    report = load_into(ours, {"detector." + k: v for k, v in meta.state_dict().items()}, "meta")
    result["build_s"] = round(time.time() - t0, 1)
    result["load"] = report.summary()
    images = photos()
    tok = ClipTokenizer()

    # 1. raw outputs, batched, fp32
    from sam3.model.data_misc import FindStage

    names = [n for n, _ in PAIRS]
    prompts = sorted({p for _, ps in PAIRS for p in ps})
    img_idx = torch.tensor([i for i, (_, ps) in enumerate(PAIRS) for _ in ps], device=dev)
    txt_idx = torch.tensor([prompts.index(p) for _, ps in PAIRS for p in ps], device=dev)
    pre = Preprocessor(cfg)
    with torch.inference_mode(), cpu_safe(dev):
        pixels = pre.batch([to_rgb_uint8(images[n]) for n in names], dev)
        bo = meta.backbone.forward_image(pixels)
        bo.update(meta.backbone.forward_text(prompts, device=dev))
        find = FindStage(img_ids=img_idx, text_ids=txt_idx, input_boxes=None, input_boxes_mask=None,
                         input_boxes_label=None, input_points=None, input_points_mask=None)
        ref = meta.forward_grounding(backbone_out=bo, find_input=find, find_target=None,
                                     geometric_prompt=meta._get_dummy_prompt(num_prompts=len(img_idx)))
        feats = ours.encode_images(pixels)
        pf = ours.encode_prompts(tok(prompts).to(dev))
        g = ours.ground(feats, pf, img_idx, txt_idx)
        raw = {f"fpn{i}": rel(a, b) for i, (a, b) in enumerate(zip(feats.fpn, bo["backbone_fpn"]))}
        raw["text"] = rel(pf.features, bo["language_features"].transpose(0, 1))
        raw.update(logits=rel(g.logits, ref["pred_logits"][..., 0]), presence=rel(g.presence_logits, ref["presence_logit_dec"][:, 0]),
                   boxes=rel(g.boxes, ref["pred_boxes"]), mask_logits=rel(g.mask_logits, ref["pred_masks"]))
    result["raw_fp32_rel_error"] = raw
    print("raw fp32 relative errors:", json.dumps(raw, indent=1), flush=True)

    # 2. instance-level oracle
    cases = [(n, p) for n, ps in PAIRS for p in ps]
    thresholds = {}
    ref_fp32 = {}
    for n, p in cases:
        everything, _ = reference_segment(meta, cfg, images[n], p, -1.0, dev)
        thresholds[(n, p)] = threshold_between(np.array([i.score for i in everything]))
        ref_fp32[(n, p)] = reference_segment(meta, cfg, images[n], p, thresholds[(n, p)], dev)[0]
    seg32 = Segmenter(ours, cfg, tok, dev)
    rules = [Threshold("mask_iou", "mean", ">=", 0.99), Threshold("count_mismatch", "mean", "<=", 0.01)]
    tables = {}

    def ours_at(seg):
        return lambda c: seg.segment(images[c[0]], [c[1]], threshold=thresholds[c])[0][0]

    reports = {"sammie_fp32": run_oracle(cases, ours_at(seg32), ref_fp32.__getitem__, [instance_metrics], rules, name_of=str)}

    def meta_bf16(c):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            return reference_segment(meta, cfg, images[c[0]], c[1], thresholds[c], dev)[0]

    reports["meta_bf16_autocast"] = run_oracle(cases, meta_bf16, ref_fp32.__getitem__, [instance_metrics], rules, name_of=str)
    ours_bf16 = Sam3Detector(cfg).to(dev)
    ours_bf16.load_state_dict(ours.state_dict())
    ours_bf16 = ours_bf16.to(torch.bfloat16).eval()
    seg16 = Segmenter(ours_bf16, cfg, tok, dev)
    reports["sammie_bf16"] = run_oracle(cases, ours_at(seg16), ref_fp32.__getitem__, [instance_metrics], rules, name_of=str)
    for name, r in reports.items():
        tables[name] = r.table(per_case=False)
        result[f"oracle_{name}"] = r.to_json()
        print(f"\n### {name} vs Meta fp32\n{tables[name]}", flush=True)

    # 3. first timings: 640x480, one prompt per image
    img640 = images["astronaut"].resize((640, 480))
    timings = {}
    for label, ctx in (("meta_processor_fp32", None), ("meta_processor_bf16_autocast", torch.bfloat16)):
        def run_meta(ctx=ctx):
            if ctx is None:
                return reference_segment(meta, cfg, img640, "person", 0.5, dev)
            with torch.autocast(dev.type, dtype=ctx):
                return reference_segment(meta, cfg, img640, "person", 0.5, dev)
        timings[label] = timed(run_meta, args.iters)
    timings["sammie_fp32_batch1"] = timed(lambda: seg32.segment(img640, ["person"]), args.iters)
    timings["sammie_bf16_batch1"] = timed(lambda: seg16.segment(img640, ["person"]), args.iters)
    batch = [img640] * 8
    timings["sammie_bf16_batch8_per_image"] = [t / 8 for t in timed(lambda: seg16.segment(batch, ["person"]), args.iters)]
    result["timings_ms_median"] = {k: round(statistics.median(v), 2) for k, v in timings.items()}
    if dev.type == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print("\nmedian ms per image:", json.dumps(result["timings_ms_median"], indent=1))

    (out_dir / "parity.json").write_text(json.dumps(result, indent=1, default=str))
    md = [f"# GPU parity ({result['gpu']}, torch {result['torch']}, {result['date']})", "",
          "Raw fp32 outputs (TF32 off), relative error vs Meta:", "",
          "| output | rel. error |", "|---|---|"] + [f"| {k} | {v:.2e} |" for k, v in raw.items()]
    for name, t in tables.items():
        md += ["", f"## {name} vs Meta fp32 ({len(cases)} image/prompt pairs)", "", t]
    md += ["", "| timing (median ms/img) | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in result["timings_ms_median"].items()]
    (out_dir / "parity.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
