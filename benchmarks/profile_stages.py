"""Where the time goes: per-stage timings, a kernel profile, torch.compile cost and FP8 GEMM rates on a GPU.

Full-size detector with seeded random weights in bf16 (speed does not depend on the values). One run measures:

  1. eager per stage: encode_images at batch 1 / 8, encode_prompts (8 prompts), ground at 1 / 8 / 16 pairs (ms);
  2. torch.profiler over one batch of 8 (encode_images + ground): the top CUDA kernels by self time, grouped;
  3. torch.compile (inductor, no CUDA graphs, static shapes): compile seconds and compiled ms for the same calls;
  4. the ViT's GEMM shapes at 8 images (M = 8 x 5184 tokens): bf16 vs FP8 e4m3 row-wise `torch._scaled_mm`;
  5. FLOP per image + prompt from torch.utils.flop_counter.

    python benchmarks/profile_stages.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cuda_timing import cuda_median_ms as cuda_ms  # benchmarks/ (the script's directory) is on sys.path


def kernel_rows(prof, repeats: int, name_chars: int) -> list[tuple[str, float, int]]:
    """(name, self device ms per repeat, calls per repeat) of every profiled event with device time, longest
    first; `repeats` = how many times the profiled code ran."""
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)  # us
        if t > 0:
            rows.append((ev.key[:name_chars], t / repeats / 1000.0, ev.count // repeats))
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--only", default="", help="comma list of sections to run: eager,profile,gemm,flops,compile")
    args = ap.parse_args()
    out = Path(args.out)
    sections = set(args.only.split(",")) if args.only else {"eager", "profile", "gemm", "flops", "compile"}
    if args.skip_compile:
        sections.discard("compile")
    out.mkdir(parents=True, exist_ok=True)
    from sammie.build import build_detector
    from sammie.config import PRESETS

    torch.backends.cuda.matmul.allow_tf32 = True
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    t0 = time.perf_counter()
    det, cfg, tok, _ = build_detector(None, PRESETS["sam3"](), "cuda", torch.bfloat16, 0)
    res["build_s"] = time.perf_counter() - t0
    s = cfg.image_size
    px = {b: torch.randn(b, 3, s, s, device="cuda", dtype=torch.bfloat16) for b in (1, 8)}
    prompts = ["person", "a cup", "cat", "rocket", "tree", "man", "camera", "cell"]
    tokens = tok(prompts).to("cuda")

    def save():
        (out / "profile_stages.json").write_text(json.dumps(res, indent=1, default=str))

    with torch.inference_mode():
        feats = {b: det.encode_images(px[b]) for b in (1, 8)}
        pf = det.encode_prompts(tokens)
        idx8 = torch.arange(8, device="cuda")
        eager = {} if "eager" not in sections else {
            f"encode_images_b{b}": cuda_ms(lambda b=b: det.encode_images(px[b])) for b in (1, 8)}
        for p in (1, 8, 16) if "eager" in sections else ():
            idx = torch.arange(p, device="cuda") % 8
            eager[f"ground_p{p}"] = cuda_ms(lambda idx=idx: det.ground(feats[8], pf, idx, idx))
        res["eager_ms"] = eager
        print("eager ms", eager, flush=True)
        save()

        if "eager" in sections:
            eager["encode_prompts_8"] = cuda_ms(lambda: det.encode_prompts(tokens))
        if "profile" in sections:
            # 2. profile one batch of 8
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(2):
                    f = det.encode_images(px[8])
                    det.ground(f, pf, idx8, idx8)
                torch.cuda.synchronize()
            rows = kernel_rows(prof, repeats=2, name_chars=110)
            res["kernels_top"] = [{"kernel": k, "ms_per_batch8": round(ms, 3), "calls": c} for k, ms, c in rows[:40]]
            res["kernels_total_ms_per_batch8"] = sum(r[1] for r in rows)
            print("top kernels", json.dumps(res["kernels_top"][:25], indent=0), flush=True)
            save()

        if "gemm" in sections:
            # 4. FP8 row-wise GEMMs at the ViT's shapes (M = 8 images x 72 x 72 tokens)
            m = 8 * 72 * 72
            d, mlp = cfg.vision.width, cfg.vision.mlp_dim
            gemm = {}
            for name, (k, n) in {"qkv": (d, 3 * d), "proj": (d, d), "fc1": (d, mlp), "fc2": (mlp, d)}.items():
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                bf = cuda_ms(lambda: a @ w.t(), iters=20)
                a8 = a.to(torch.float8_e4m3fn)
                w8 = w.to(torch.float8_e4m3fn)
                sa = torch.ones(m, 1, device="cuda")
                sw = torch.ones(1, n, device="cuda")
                row = {"k": k, "n": n, "bf16_ms": bf, "bf16_tflops": 2 * m * k * n / bf / 1e9}
                for fast in (True, False):
                    try:
                        f8 = cuda_ms(lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw,
                                                              out_dtype=torch.bfloat16,
                                                              use_fast_accum=fast), iters=20)
                        row[f"fp8_rowwise_fast{int(fast)}_ms"] = f8
                        row[f"fp8_rowwise_fast{int(fast)}_tflops"] = 2 * m * k * n / f8 / 1e9
                    except Exception as exc:  # noqa: BLE001 - recorded
                        row[f"fp8_rowwise_fast{int(fast)}_error"] = repr(exc)[:300]

                def quant():
                    amax = a.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12)
                    return (a.float() * (448.0 / amax)).to(torch.float8_e4m3fn)
                row["torch_quant_ms"] = cuda_ms(quant, iters=20)
                gemm[name] = row
            res["vit_gemms_m41472"] = gemm
            print("gemms", json.dumps(gemm, indent=0), flush=True)
            save()

    if "flops" in sections:
        # 5. FLOP count (one image, one prompt). Outside inference_mode: FlopCounterMode's module tracker registers
        # grad hooks, which fail on inference tensors; no_grad + frozen parameters keep it cheap.
        from torch.utils.flop_counter import FlopCounterMode

        det.requires_grad_(False)
        i1 = torch.zeros(1, dtype=torch.long, device="cuda")
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            f1 = det.encode_images(px[1])
            det.ground(f1, det.encode_prompts(tokens[:1]), i1, i1)
        res["tflop_per_image_prompt"] = fc.get_total_flops() / 1e12
        res["tflop_by_module"] = {k: v / 1e12 for k, v in
                                  sorted(((k, sum(d.values())) for k, d in fc.get_flop_counts().items()),
                                         key=lambda kv: -kv[1])[:12]}
        print("TFLOP", res["tflop_per_image_prompt"], flush=True)
        save()

    # 3. torch.compile cost and gain (inductor, static shapes, no CUDA graphs)
    if "compile" in sections:
        comp = {}
        res["compiled"] = comp
        with torch.inference_mode():
            enc = torch.compile(det.encode_images, dynamic=False)
            t0 = time.perf_counter()
            enc(px[8])
            torch.cuda.synchronize()
            comp["encode_images_b8_compile_s"] = time.perf_counter() - t0
            comp["encode_images_b8_ms"] = cuda_ms(lambda: enc(px[8]))
            save()
            gr = torch.compile(det.ground, dynamic=False)
            t0 = time.perf_counter()
            gr(feats[8], pf, idx8, idx8)
            torch.cuda.synchronize()
            comp["ground_p8_compile_s"] = time.perf_counter() - t0
            comp["ground_p8_ms"] = cuda_ms(lambda: gr(feats[8], pf, idx8, idx8))
            save()
            i1 = idx8[:1]  # batch-1 shapes: one more compile each (static shapes); the lone-request latency
            t0 = time.perf_counter()
            enc(px[1])
            gr(feats[1], pf, i1, i1)
            torch.cuda.synchronize()
            comp["b1_compile_s"] = time.perf_counter() - t0
            comp["encode_images_b1_ms"] = cuda_ms(lambda: enc(px[1]))
            comp["ground_p1_ms"] = cuda_ms(lambda: gr(feats[1], pf, i1, i1))
        res["compiled"] = comp
        print("compiled", comp, flush=True)
    # 6. compiled profile (static shapes, batch 8) and one compile with a dynamic batch dimension
    if "compiled_profile" in sections:
        from torch.profiler import ProfilerActivity, profile

        cp = {}
        res["compiled_profile"] = cp
        with torch.inference_mode():
            enc = torch.compile(det.encode_images, dynamic=False)
            gr = torch.compile(det.ground, dynamic=False)
            enc(px[8]); gr(feats[8], pf, idx8, idx8)  # noqa: E702 - compile both
            torch.cuda.synchronize()
            for name, fn in {"encode_images_b8": lambda: enc(px[8]),
                             "ground_p8": lambda: gr(feats[8], pf, idx8, idx8)}.items():
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(2):
                        fn()
                    torch.cuda.synchronize()
                rows = kernel_rows(prof, repeats=2, name_chars=120)
                cp[name] = {"total_ms": sum(r[1] for r in rows), "top": [
                    {"kernel": k, "ms": round(ms, 3), "calls": c} for k, ms, c in rows[:30]]}
                save()
            dyn = torch.compile(det.encode_images, dynamic=None)
            for b in (1, 8):  # mark the batch dimension dynamic: one graph for every bucket
                torch._dynamo.mark_dynamic(px[b], 0)
            t0 = time.perf_counter()
            dyn(px[8])
            torch.cuda.synchronize()
            cp["dynamic_batch_compile_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            dyn(px[1])
            torch.cuda.synchronize()
            cp["dynamic_batch_second_shape_s"] = time.perf_counter() - t0
            cp["dynamic_batch_b8_ms"] = cuda_ms(lambda: dyn(px[8]))
            cp["dynamic_batch_b1_ms"] = cuda_ms(lambda: dyn(px[1]))
        brief = {k: (v if not isinstance(v, dict) else v["top"][:12]) for k, v in cp.items()}
        print("compiled profile", json.dumps(brief, indent=0), flush=True)
    res["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    save()


if __name__ == "__main__":
    main()
