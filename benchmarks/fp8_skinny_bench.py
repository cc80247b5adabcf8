"""The decode-sized FP8 linears beside what they replace (the one-launch Triton quantiser + cuBLASLt's FP8 GEMM,
`fp8_linear_triton_quant`), at Qwen3.6-35B-A3B's FP8 projection shapes, per row count M: `kernels/fp8_skinny.py`
(quantiser fused, split K) and `kernels/fp8_gemv.py` (CUDA-core GEMV, with the quantiser launch before it or its
division in the loop). Where they cross decides `fp8_skinny.SKINNY_MAX_M` / `SKINNY_MAX_N`, `fp8_gemv.gemv_ok` and
the registry order in `kernels.fp8_linear.register`.

    python benchmarks/fp8_skinny_bench.py --out benchmarks/results/fp8_skinny_bench     # GPU; ~1 min on an H200

Timing as the engine runs them: one CUDA graph of R calls, each on its own weight copy (R copies >= 2 x the 50 MB L2,
so every call reads its weights from HBM), replayed; us per call = replay time / R (median of 5 replays). Weights:
random e4m3 bytes with a per-tensor scale (speed does not depend on the values). Each Triton result is compared with
`fp8_linear_reference` (max |diff| / max |ref|; bf16 output). The GEMV's autotuner picks are recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, N, K): the engine's FP8 projections (GDN: in_proj_qkv, in_proj_z, out_proj; attention: q(+gate), k / v, o)
SHAPES = [("gdn in_proj_qkv / attn q_proj", 8192, 2048), ("gdn in_proj_z", 4096, 2048),
          ("gdn out_proj / attn o_proj", 2048, 4096), ("attn k_proj / v_proj", 512, 2048),
          # the engine's fused decode projections (quantized.fused_fp8_projections): GDN in_proj_qkv + z, attention
          # q (with its gate) + k + v -- what a lone decode step's FP8 GEMV runs
          ("gdn in_proj_qkvz (fused)", 12288, 2048), ("attn q/k/v (fused)", 9216, 2048)]
L2_BYTES = 50 * 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/fp8_skinny_bench")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--pdl", action="store_true", help="launch the Triton kernels with programmatic dependent launch, "
                                                       "as the engine does on Hopper (kernels/pdl.py)")
    ap.add_argument("--resident", action="store_true",
                    help="also time every call on ONE weight copy (L2-resident after the first where it fits in the "
                         "L2): what the read costs from L2 -- a bound for prefetching weights into L2 ahead of use")
    ap.add_argument("--shapes", default="", help="only the shapes whose name contains one of these (comma-separated)")
    ap.add_argument("--only", default="", help="only the paths whose label contains this")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("fp8_skinny_bench needs a CUDA GPU")
    if args.pdl:
        from kernels import pdl

        pdl.set_enabled(pdl.device_supports())
    from cuda_timing import graph_per_call_us  # benchmarks/ (the script's directory) is on sys.path
    from kernels import fp8_gemv, fp8_skinny
    from kernels.fp8_linear import fp8_linear_triton_quant
    from kernels.fp8_quant import quantize_static_triton
    from kernels.nvfp4 import FP8Tensor, fp8_linear_reference

    dev = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]

    def skinny(x, w):
        return fp8_skinny.fp8_skinny_op(x, w.data, w.scale, w.input_scale, torch.bfloat16)

    def gemv(prequantize):
        return lambda x, w: fp8_gemv.fp8_gemv_op(x, w.data, w.scale, w.input_scale, torch.bfloat16, prequantize)

    codes_memo: dict = {}

    def on_codes(x, w):
        """The engine's decode call: the input's codes made by the op before (quant_in_producers), not timed here."""
        if x.data_ptr() not in codes_memo:  # (every weight copy has the same input scale)
            codes_memo[x.data_ptr()] = quantize_static_triton(x, w.input_scale)
        return fp8_gemv.fp8_gemv_op(x, w.data, w.scale, w.input_scale, torch.bfloat16, codes=codes_memo[x.data_ptr()])

    # label -> (call, largest M it takes)
    impls = {"quant + cuBLASLt (scaled_mm)": (lambda x, w: fp8_linear_triton_quant(x, w), 1 << 30),
             "fp8_skinny (fused, split K)": (skinny, fp8_skinny.SKINNY_MAX_M),
             "quant + fp8_gemv": (gemv(True), fp8_gemv.GEMV_MAX_ROWS),
             "fp8_gemv (quant in loop)": (gemv(False), fp8_gemv.GEMV_MAX_ROWS),
             "fp8_gemv on codes (the engine's)": (on_codes, fp8_gemv.GEMV_MAX_ROWS)}

    def per_call_us(fn, x, ws) -> float:
        return graph_per_call_us([lambda w=w: fn(x, w) for w in ws])

    impls = {label: v for label, v in impls.items() if args.only in label}
    picked = [s for s in args.shapes.split(",") if s]
    results = []
    for name, n, k in (s for s in SHAPES if not picked or any(p in s[0] for p in picked)):
        copies = max(8, -(-2 * L2_BYTES // (n * k)))
        gen = torch.Generator(device=dev).manual_seed(n + k)
        ws = [FP8Tensor((torch.randn(n, k, device=dev, generator=gen) * 64).to(torch.float8_e4m3fn),
                        torch.tensor(1e-3, device=dev), torch.tensor(2e-2, device=dev)) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = dict(shape=name, n=n, k=k, m=m, copies=copies)
            ref = fp8_linear_reference(x, ws[0], out_dtype=torch.float32)
            for label, (fn, max_m) in impls.items():
                if m > max_m:
                    continue
                us = per_call_us(fn, x, ws)
                err = float((fn(x, ws[0]).float() - ref).abs().max() / ref.abs().max())
                row[label] = dict(us=us, tb_s=n * k / (us * 1e-6) / 1e12, rel_err=err)
                if args.resident:  # the same graph length, every call on ws[0]
                    us = per_call_us(fn, x, [ws[0]] * len(ws))
                    row[label + ", L2-resident"] = dict(us=us, tb_s=n * k / (us * 1e-6) / 1e12, rel_err=err)
            if m <= fp8_gemv.GEMV_MAX_ROWS:
                picks = fp8_gemv._fp8_gemv_autotuned.cache  # {(R_BUCKET, N, K, X_CODES, dtypes..): Config}
                bucket = 1 << (m - 1).bit_length()  # R_BUCKET: the next power of two of M
                row["gemv_configs"] = sorted(f"X_CODES={key[3]}: {c}" for key, c in picks.items()
                                             if tuple(key[:3]) == (bucket, n, k))
            results.append(row)
            print(json.dumps(row), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__)
    (out / "fp8_skinny_bench.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    suffixes = ("", ", L2-resident") if args.resident else ("",)
    labels = [lab + suffix for lab in impls for suffix in suffixes]
    lines = [f"# fp8_skinny_bench ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})", "",
             "| shape (N x K) | M | " + " | ".join(f"{lab}: us (TB/s)" for lab in labels)
             + " | best / cuBLASLt | max rel err (Triton) |", "|---|---:|" + "---:|" * (len(labels) + 2)]
    for r in results:
        cells = [f"{r[lab]['us']:.2f} ({r[lab]['tb_s']:.2f})" if lab in r else "-" for lab in labels]
        best = min(r[lab]["us"] for lab in labels[1:] if lab in r) if any(lab in r for lab in labels[1:]) else None
        ratio = f"{best / r[labels[0]]['us']:.2f}" if best is not None and labels[0] in r else "-"
        errs = [r[lab]["rel_err"] for lab in labels[1:] if lab in r]
        err = f"{max(errs):.1e}" if errs else "-"
        lines.append(f"| {r['shape']} ({r['n']} x {r['k']}) | {r['m']} | " + " | ".join(cells)
                     + f" | {ratio} | {err} |")
    (out / "fp8_skinny_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
