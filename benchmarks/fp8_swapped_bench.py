"""The few-row FP8 linear (`kernels/fp8_swapped.py`) beside cuBLASLt's FP8 GEMM, both on the activation codes as the
engine calls them at 8-64 decode streams (the producing op wrote the codes: no quantiser launch timed), at
Qwen3.6-35B-A3B's FP8 projection shapes; with --sweep-rows, its tilings swept at those row counts (what
`fp8_swapped.swapped_config` is chosen from).

    python benchmarks/fp8_swapped_bench.py --pdl --out benchmarks/results/fp8_swapped_bench     # GPU; ~3-4 min cold

Timing as `fp8_skinny_bench.py`: one CUDA graph of R calls, each on its own weight copy (R copies >= 2 x the 50 MB
L2: every call reads its weights from HBM), replayed; us per call = replay time / R (median of 5 replays). Weights:
random e4m3 bytes (speed does not depend on the values); the fused shapes with per-row weight scales as the engine's
fused projections have (cuBLASLt's row-wise kernel for them). Every result is compared with `fp8_linear_reference`
(max |diff| / max |ref|; bf16 output).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8_skinny_bench import L2_BYTES, SHAPES  # noqa: E402  (benchmarks/ is the script's directory)

# the sweep: (BLOCK_N, BLOCK_K, num_stages) x the splits that leave each program >= 1 K tile
TILES = [(64, 128, 4), (64, 128, 6), (64, 256, 3), (64, 256, 4), (128, 128, 4), (128, 128, 6), (128, 256, 3),
         (64, 128, 8)]
SPLITS = (1, 2, 4, 8, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/fp8_swapped_bench")
    ap.add_argument("--rows", default="8,16,32,64")
    ap.add_argument("--sweep-rows", default="32", help="row counts at which every tiling of TILES x SPLITS is timed "
                                                       "('' for none)")
    ap.add_argument("--pdl", action="store_true", help="launch the Triton kernel with programmatic dependent launch, "
                                                       "as the engine does on Hopper (kernels/pdl.py)")
    ap.add_argument("--shapes", default="", help="only the shapes whose name contains one of these (comma-separated)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("fp8_swapped_bench needs a CUDA GPU")
    if args.pdl:
        from kernels import pdl

        pdl.set_enabled(pdl.device_supports())
    from cuda_timing import graph_per_call_us
    from kernels import fp8_swapped
    from kernels.fp8_linear import _scaled_mm_codes
    from kernels.fp8_quant import quantize_static_triton
    from kernels.nvfp4 import FP8Tensor, fp8_linear_reference

    dev = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",") if r]
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    picked = [s for s in args.shapes.split(",") if s]

    def timed(fn, x, codes, ws, ref) -> dict:
        us = graph_per_call_us([lambda w=w: fn(x, w, codes) for w in ws])
        err = float((fn(x, ws[0], codes).float() - ref).abs().max() / ref.abs().max())
        n, k = ws[0].data.shape
        return dict(us=round(us, 3), tb_s=round(n * k / (us * 1e-6) / 1e12, 3), rel_err=err)

    def cublas(x, w, codes):
        return _scaled_mm_codes(x, w, codes, torch.bfloat16)

    def swapped(**cfg):
        def call(x, w, codes):
            return fp8_swapped.fp8_swapped_op(x, w.data, w.scale, w.input_scale, torch.bfloat16, codes=codes, **cfg)
        return call

    results = []
    for name, n, k in (s for s in SHAPES if not picked or any(p in s[0] for p in picked)):
        rowwise = "fused" in name
        copies = max(8, -(-2 * L2_BYTES // (n * k)))
        gen = torch.Generator(device=dev).manual_seed(n + k)
        ws = [FP8Tensor((torch.randn(n, k, device=dev, generator=gen) * 64).to(torch.float8_e4m3fn),
                        (torch.rand(n, device=dev, generator=gen) + 0.5) * 1e-3 if rowwise
                        else torch.tensor(1e-3, device=dev), torch.tensor(2e-2, device=dev)) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            codes = quantize_static_triton(x, ws[0].input_scale)
            ref = fp8_linear_reference(x, ws[0], out_dtype=torch.float32)
            base = fp8_swapped.swapped_config(n, k)
            row = dict(shape=name, n=n, k=k, m=m, copies=copies, rowwise=rowwise, default_config=base.__dict__,
                       cublas=timed(cublas, x, codes, ws, ref), swapped=timed(swapped(), x, codes, ws, ref))
            if m in sweep_rows:
                sweep = []
                for (bn, bk, st), sp in itertools.product(TILES, SPLITS):
                    if n % bn or k % bk or sp > k // bk:
                        continue
                    r = timed(swapped(block_n=bn, block_k=bk, split_k=sp, num_stages=st), x, codes, ws, ref)
                    sweep.append(dict(block_n=bn, block_k=bk, num_stages=st, split=sp, **r))
                sweep.sort(key=lambda r: r["us"])
                row["sweep"] = sweep
                row["best"] = sweep[0]
            results.append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "sweep"}), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                pdl=args.pdl)
    (out / "fp8_swapped_bench.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = [f"# fp8_swapped_bench ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"PDL {'on' if args.pdl else 'off'})", "",
             "| shape (N x K) | M | cuBLASLt on codes: us (TB/s) | fp8_swapped default: us (TB/s) | default / cuBLASLt "
             "| best swept (BN, BK, stages, split): us | max rel err |", "|---|---:|---:|---:|---:|---|---:|"]
    for r in results:
        c, s = r["cublas"], r["swapped"]
        best = r.get("best")
        best_txt = (f"{best['block_n']}, {best['block_k']}, {best['num_stages']}, {best['split']}: {best['us']:.2f}"
                    if best else "-")
        errs = [c["rel_err"], s["rel_err"]] + [e["rel_err"] for e in r.get("sweep", [])]
        lines.append(f"| {r['shape']} ({r['n']} x {r['k']}) | {r['m']} | {c['us']:.2f} ({c['tb_s']:.2f}) | "
                     f"{s['us']:.2f} ({s['tb_s']:.2f}) | {s['us'] / c['us']:.2f} | {best_txt} | {max(errs):.1e} |")
    (out / "fp8_swapped_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
