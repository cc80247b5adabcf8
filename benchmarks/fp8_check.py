"""FP8 (e4m3, row-wise) vs bf16 for the SAM 3 ViT on one GPU (issue #4): per-GEMM speed, end-to-end encode_images
speed, and the FP8 error per FPN level. Random weights (no checkpoint needed); ~1-2 minutes on an H200.

    python benchmarks/fp8_check.py --out out/fp8_check.json [--batch 8] [--iters 20]

Per ViT linear shape at M = batch x 5184 tokens (72 x 72 grid): bf16 F.linear; FP8 with each activation quantiser
(Triton one-pass kernel / torch ops) incl. quantisation; the FP8 GEMM alone (use_fast_accum False and True); the
quantisers alone. Times in us (CUDA events, median of --iters after warm-up), TFLOP/s = 2 M N K / time.
Then encode_images at --batch: bf16 ms/img vs FP8 ms/img (after `enable_vit_fp8` on a random batch, whose report --
relative error per FPN level, gate decision -- is included), eager, no CUDA graphs.

Napkin math (H200 SXM dense peaks: ~989 TFLOP/s bf16, ~1979 TFLOP/s FP8): at M = 41472 the four GEMMs of a block are
2 M (3C^2 + C^2 + 2 C H) = 2 x 41472 x 13.9M = 1.15 TFLOP (C = 1024, H = 4736), x 32 blocks = 36.9 TFLOP per batch of
8 -> ~37 ms in bf16 at 100% peak, ~19 ms in FP8 at peak; the activation quantisation reads each GEMM input once and
writes half of it ((3 x 1024 + 4736) x 41472 x 3 B = 0.97 GB per block -> ~0.2 ms at 4.8 TB/s, ~6.5 ms per batch
unfused) -- the number to watch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.fp8_linear import (  # noqa: E402
    fp8_rowwise_linear_scaled_mm,
    fp8_rowwise_linear_triton_quant,
    quantize_weight_rowwise,
    rowwise_scaled_mm,
)
from kernels.fp8_quant import quantize_rows_reference, quantize_rows_triton  # noqa: E402
from cuda_timing import cuda_median_ms  # noqa: E402 - benchmarks/ (the script's directory) is on sys.path


def cuda_time_us(fn, iters: int, warmup: int = 3) -> float:
    return 1e3 * cuda_median_ms(fn, iters, warmup)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def gemm_rows(width: int, mlp: int, m: int, iters: int) -> list[dict]:
    shapes = {"attn.qkv": (width, 3 * width), "attn.proj": (width, width), "mlp.fc1": (width, mlp),
              "mlp.fc2": (mlp, width)}
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (k, n) in shapes.items():
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
        b = (torch.randn(n, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        w8, sw = quantize_weight_rowwise(w)
        xq, sx = quantize_rows_triton(x)
        flop = 2.0 * m * n * k
        t = {
            "bf16_linear": cuda_time_us(lambda: F.linear(x, w, b), iters),
            "fp8_triton_quant+gemm": cuda_time_us(lambda: fp8_rowwise_linear_triton_quant(x, w8, sw, b), iters),
            "fp8_torch_quant+gemm": cuda_time_us(lambda: fp8_rowwise_linear_scaled_mm(x, w8, sw, b), iters),
            "fp8_gemm_only": cuda_time_us(lambda: rowwise_scaled_mm(xq, sx, w8, sw, b), iters),
            "fp8_gemm_only_fast_accum": cuda_time_us(lambda: rowwise_scaled_mm(xq, sx, w8, sw, b, True), iters),
            "quant_triton": cuda_time_us(lambda: quantize_rows_triton(x), iters),
            "quant_torch": cuda_time_us(lambda: quantize_rows_reference(x), iters),
        }
        ref = F.linear(x, w, b)
        row = {"layer": name, "M": m, "K": k, "N": n, "us": {key: round(v, 1) for key, v in t.items()},
               "tflops": {key: round(flop / (v * 1e-6) / 1e12, 1) for key, v in t.items() if "quant_" != key[:6]},
               "speedup_vs_bf16": round(t["bf16_linear"] / t["fp8_triton_quant+gemm"], 3),
               "quant_gbps_triton": round(m * k * 3 / (t["quant_triton"] * 1e-6) / 1e9, 1),
               "rel_err_vs_bf16": {
                   "fp8": rel_err(fp8_rowwise_linear_triton_quant(x, w8, sw, b), ref),
                   "fp8_fast_accum": rel_err(rowwise_scaled_mm(xq, sx, w8, sw, b, True), ref)}}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del x, w, xq, w8
    return rows


def encode_rows(batch: int, iters: int) -> dict:
    from sammie.build import build_detector
    from sammie.config import PRESETS
    from sammie.model.fp8 import disable_vit_fp8, enable_vit_fp8

    detector, cfg, _, _ = build_detector(None, PRESETS["sam3"](), "cuda", torch.bfloat16, 0)
    s = cfg.vision.image_size
    g = torch.Generator(device="cuda").manual_seed(1)
    pixels = torch.randn(batch, 3, s, s, device="cuda", generator=g).to(torch.bfloat16)

    def encode():
        with torch.no_grad():
            detector.encode_images(pixels)

    out = {"batch": batch}
    out["bf16_ms_per_img"] = cuda_time_us(encode, iters, warmup=2) / 1e3 / batch
    print(f"encode_images bf16: {out['bf16_ms_per_img']:.2f} ms/img", flush=True)
    for pref in ("auto", "torch"):
        t0 = time.perf_counter()
        report = enable_vit_fp8(detector, pixels, preference=pref)
        out[f"fp8_{pref}_report"] = {**report.as_dict(), "layers": len(report.layers),
                                     "enable_s": round(time.perf_counter() - t0, 2)}
        print(f"enable_vit_fp8({pref}): {report.reason}; rel err {report.rel_err}", flush=True)
        if report.enabled:
            out[f"fp8_{pref}_ms_per_img"] = cuda_time_us(encode, iters, warmup=2) / 1e3 / batch
            print(f"encode_images FP8 ({report.implementation}): {out[f'fp8_{pref}_ms_per_img']:.2f} ms/img",
                  flush=True)
        disable_vit_fp8(detector)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-encode", action="store_true", help="GEMM table only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_check needs CUDA")
    from sammie.config import PRESETS

    vcfg = PRESETS["sam3"]().vision
    tokens = vcfg.grid_size**2
    result = {"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
              "torch": torch.__version__, "tokens_per_image": tokens}
    result["gemms"] = gemm_rows(vcfg.width, vcfg.mlp_dim, args.batch * tokens, args.iters)
    torch.cuda.empty_cache()
    if not args.skip_encode:
        result["encode_images"] = encode_rows(args.batch, max(5, args.iters // 2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
