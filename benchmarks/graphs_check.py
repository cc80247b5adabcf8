"""GraphedDetector on the GPU: eager vs compiled + CUDA-graphed stages per bucket, full-size SAM 3 (issue #4).

    python benchmarks/graphs_check.py                                   # eager model captured (no inductor), ~1-2 min
    python benchmarks/graphs_check.py --compile default --image-buckets 1,8 --pair-buckets 1,16   # inductor

Builds `sammie.build.build_detector(config "sam3", random weights, bf16)`, wraps it in `GraphedDetector`, captures
the image buckets and pair buckets, then per bucket prints: eager ms vs graphed ms (CUDA events, median of warm
runs; graphed = copy-in + replay + clone-out, as the engine calls it), max abs and relative (||a-b|| / ||b||) diff of
every output vs eager, capture seconds, and the peak device memory of the eager and graphed call. Writes JSON to
--out (default $OUT/graphs_check.json, else benchmarks/results/graphs_check.json) after every phase, so a run
stopped by a time limit still leaves what it measured.

Expected diffs: `--compile none` replays the eager kernels: 0 or cuBLAS-algorithm-level; inductor reorders bf16
reductions: ~1e-2 relative (bf16 has 8 mantissa bits; see tests/test_end_to_end.py's bf16 tolerance).
Inductor cold-compiles each bucket shape separately (dynamic=False): budget ~30-60 s per bucket at full size, so
pass fewer buckets with --compile.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from cuda_timing import cuda_median_ms  # benchmarks/ (the script's directory) is on sys.path


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def diffs(got, want) -> dict[str, dict[str, float]]:
    """Per output field (list fields per level): max abs diff and ||a - b|| / ||b|| in float64."""
    out = {}
    for name in want._fields:
        a, b = getattr(got, name), getattr(want, name)
        pairs = list(zip(a, b)) if isinstance(b, list) else [(a, b)]
        for i, (x, y) in enumerate(pairs):
            x, y = x.double(), y.double()
            key = f"{name}[{i}]" if isinstance(b, list) else name
            out[key] = {"max_abs": float((x - y).abs().max()),
                        "rel": float((x - y).norm() / y.norm()) if y.norm() > 0 else float((x - y).norm())}
    return out


def worst(d: dict[str, dict[str, float]]) -> tuple[float, float]:
    return max(v["max_abs"] for v in d.values()), max(v["rel"] for v in d.values())


def compare_bucket(key: str, n: int, eager, graphed, capture_s: float, iters: int) -> dict:
    """One bucket of size n (key "B" images / "P" pairs): graphed vs eager outputs, times and peak memory; prints
    the table row and returns it as a dict."""
    want, got = eager(), graphed()
    d = diffs(got, want)
    te = cuda_median_ms(eager, iters, warmup=2)
    tg = cuda_median_ms(graphed, iters, warmup=2)
    pe, pg = peak_mib(eager), peak_mib(graphed)
    mx, rel = worst(d)
    print(f"| {n} | {te:.2f} | {tg:.2f} | {te / tg:.2f}x | {tg / n:.2f} | {mx:.3g} | {rel:.3g} | {capture_s:.1f} "
          f"| {pe:.0f} / {pg:.0f} |", flush=True)
    return {key: n, "eager_ms": te, "graphed_ms": tg, "max_abs": mx, "max_rel": rel, "capture_s": capture_s,
            "peak_mib_eager": pe, "peak_mib_graphed": pg, "diffs": d}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="sam3")
    ap.add_argument("--image-buckets", type=ints, default=[1, 2, 4, 8])
    ap.add_argument("--pair-buckets", type=ints, default=[1, 2, 4, 8, 16], help="the engine's powers of two")
    ap.add_argument("--compile", default="none", help="none | default | max-autotune-no-cudagraphs")
    ap.add_argument("--iters", type=int, default=10, help="timed runs per measurement (median)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graphs_check.py needs a CUDA device")
    out_path = Path(args.out) if args.out else (
        Path(os.environ["OUT"]) / "graphs_check.json" if os.environ.get("OUT") else
        Path(__file__).parent / "results" / "graphs_check.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)

    from sammie.build import build_detector
    from sammie.config import PRESETS
    from sammie.model.graphs import GraphedDetector

    t0 = time.perf_counter()
    det, cfg, tokenizer, _ = build_detector(None, PRESETS[args.config](), "cuda", torch.bfloat16, seed=0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": args.config,
              "dtype": "bf16", "compile": args.compile, "image_buckets": args.image_buckets,
              "pair_buckets": args.pair_buckets, "build_s": round(time.perf_counter() - t0, 2),
              "images": [], "pairs": []}

    def save():
        out_path.write_text(json.dumps(result, indent=1))

    mode = None if args.compile == "none" else args.compile
    base_mib = torch.cuda.memory_allocated() / 2**20
    g = GraphedDetector(det, args.image_buckets, args.pair_buckets, compile_mode=mode)
    torch.cuda.reset_peak_memory_stats()
    capture_s = g.capture()
    result["capture_s"] = round(capture_s, 2)
    result["weights_mib"] = round(base_mib, 1)
    result["graphs_static_mib"] = round(torch.cuda.memory_allocated() / 2**20 - base_mib, 1)  # buffers + pools
    result["capture_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    print(f"built in {result['build_s']} s; captured in {capture_s:.1f} s; static buffers + graph pools "
          f"{result['graphs_static_mib']:.0f} MiB over {base_mib:.0f} MiB of weights", flush=True)
    save()

    gen = torch.Generator(device="cuda").manual_seed(0)
    side = cfg.image_size
    stats = g.stats()
    with torch.inference_mode():
        print("\n| images B | eager ms | graphed ms | speed-up | ms/img graphed | max abs | max rel | capture s "
              "| peak MiB eager / graphed |\n|---|---|---|---|---|---|---|---|---|", flush=True)
        for b in args.image_buckets:
            px = torch.randn(b, 3, side, side, generator=gen, device="cuda").to(torch.bfloat16)
            result["images"].append(compare_bucket("B", b, lambda: det.encode_images(px), lambda: g.encode_images(px),
                                                   stats["encode_images"]["capture_s"][b], args.iters))
            save()

        # grounding inputs: 4 distinct images, 8 distinct prompts; pairs mix them (repeats included)
        images = det.encode_images(torch.randn(4, 3, side, side, generator=gen, device="cuda").to(torch.bfloat16))
        prompts = det.encode_prompts(tokenizer([f"object number {i}" for i in range(8)]).cuda())
        print("\n| pairs P | eager ms | graphed ms | speed-up | ms/pair graphed | max abs | max rel | capture s "
              "| peak MiB eager / graphed |\n|---|---|---|---|---|---|---|---|---|", flush=True)
        for p in args.pair_buckets:
            ii = torch.arange(p, device="cuda") % 4
            pi = (torch.arange(p, device="cuda") * 3) % 8
            result["pairs"].append(compare_bucket(
                "P", p, lambda: det.ground(images, prompts, ii, pi), lambda: g.ground(images, prompts, ii, pi),
                stats["ground"]["capture_s"][p], args.iters))
            save()

    result["stats"] = g.stats()
    result["total_s"] = round(time.perf_counter() - t0, 1)
    save()
    print(f"\ncompiles {result['stats']['compiles']}, recompiles {result['stats']['recompiles']} "
          f"(must be 0); total {result['total_s']} s; wrote {out_path}")
    if result["stats"]["recompiles"]:
        raise SystemExit("recompiles observed after capture()")


if __name__ == "__main__":
    main()
