"""fc1 + exact GELU as one Triton GEMM (`kernels/linear_gelu.py`) against what the bf16 detector runs (issue 4).

The GELU after the ViT's fc1 is a separate pass over the [M, 4,736] activation (7.7% of the engine's GPU time in
waterfall run 14); cuBLASLt can take it into its epilogue only as the tanh approximation (`vit_fused_gelu`), and
inductor's max-autotune kept cuBLAS because its Triton templates lost the bare GEMM by 13-17% (run 9). The question
here: does a Triton GEMM with the exact GELU in its epilogue beat cuBLAS + the GELU pass? At the ViT's shapes (K
1,024, N 4,736; M = 5,184 tokens an image: batch 1 and 8), median ms of:
- `cublas_then_gelu`: F.linear then F.gelu, eager (two kernels; the reference);
- `inductor`: the same two ops under torch.compile (cuBLAS + inductor's GELU kernel: what the engine runs);
- `inductor_cdt`: the `inductor` path compiled with `coordinate_descent_tuning` (inductor tunes its GELU kernel's
  block size and warps; part of the max-autotune mode, which run 9 measured as a whole);
- `cublaslt_tanh`: `torch._addmm_activation(use_gelu=True)` (one kernel, tanh GELU: `vit_fused_gelu`);
- `cublas_linear_only`: F.linear alone (the bare GEMM: what any fusion must approach);
- `triton <launch>`: each launch configuration of `linear_gelu_triton` (one tile per program, and persistent: one
  program per SM, the tile and K loops flattened into one pipelined loop);
- `triton_linear_only <launch>`: two of them without the GELU (`linear_triton`), the GEMM's own rate;
and for each Triton variant the largest difference from the reference (F.linear for the linear-only ones) and the
share of outputs bit-identical to it.

    python benchmarks/linear_gelu_probe.py --out DIR                   # CUDA (Hopper)
    TRITON_INTERPRET=1 python benchmarks/linear_gelu_probe.py --out DIR --m 64 --n 256 --k 64 --iters 1   # CPU smoke

Random weights and inputs (speed does not depend on the values).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: kernels
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: cuda_timing

from cuda_timing import median_ms  # noqa: E402
from kernels.linear_gelu import Launch, linear_gelu_reference, linear_gelu_triton, linear_triton  # noqa: E402

LAUNCHES = {  # name -> Launch (block_m, block_n, block_k, group_m, num_warps, num_stages)
    "128x256x64_w8_s3": Launch(128, 256, 64, 8, 8, 3),
    "128x256x64_w8_s4": Launch(128, 256, 64, 8, 8, 4),
    "256x128x64_w8_s3": Launch(256, 128, 64, 8, 8, 3),
    "128x128x64_w4_s4": Launch(128, 128, 64, 8, 4, 4),
    "128x128x64_w8_s4": Launch(128, 128, 64, 8, 8, 4),
    "128x256x32_w8_s5": Launch(128, 256, 32, 8, 8, 5),
    "64x256x64_w4_s4": Launch(64, 256, 64, 8, 4, 4),
    # one program per SM walking the tiles, the tile and K loops flattened (next tile's loads during the epilogue)
    "persistent_128x256x64_w8_s3": Launch(128, 256, 64, 8, 8, 3, persistent=True),
    "persistent_128x256x64_w8_s4": Launch(128, 256, 64, 8, 8, 4, persistent=True),
    "persistent_128x256x64_w8_s3_unflattened": Launch(128, 256, 64, 8, 8, 3, persistent=True, flatten=False),
    "persistent_128x128x64_w8_s4": Launch(128, 128, 64, 8, 8, 4, persistent=True),
}
# launches also timed without the GELU (`linear_triton`): the GEMM's own rate against cuBLAS's, so the epilogue's
# cost reads off the difference (run 1: 349 TFLOP/s with it, unknown without)
LINEAR_ONLY = ("128x256x64_w8_s4", "persistent_128x256x64_w8_s3")
SMOKE_LAUNCHES = {"smoke": Launch(32, 32, 16, 2, 4, 2),  # the interpreter's dry run: small tiles
                  "persistent_smoke": Launch(32, 32, 16, 2, 4, 2, persistent=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", type=int, nargs="*", default=[41_472, 5_184], help="tokens (5,184 per image)")
    ap.add_argument("--n", type=int, default=4_736)
    ap.add_argument("--k", type=int, default=1_024)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--skip-triton", action="store_true", help="only cuBLAS / ATen / inductor paths")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(args.n, args.k, generator=gen) / args.k ** 0.5).to(device, torch.bfloat16)
    b = (0.1 * torch.randn(args.n, generator=gen)).to(device, torch.bfloat16)
    launches = LAUNCHES if device.type == "cuda" else SMOKE_LAUNCHES
    linear_only = LINEAR_ONLY if device.type == "cuda" else ("persistent_smoke",)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "n": args.n, "k": args.k, "rows": []}
    compiled = {}
    if device.type == "cuda":  # (run 2 also timed ATen's GELU as a custom op opaque to inductor: 0.978x; removed)
        compiled = {"inductor": torch.compile(lambda x: F.gelu(F.linear(x, w, b)), dynamic=False),
                    "inductor_cdt": torch.compile(lambda x: F.gelu(F.linear(x, w, b)), dynamic=False,
                                                  options={"coordinate_descent_tuning": True})}
    for m in args.m:
        x = torch.randn(m, args.k, generator=gen).to(device, torch.bfloat16)
        ref = linear_gelu_reference(x, w, b)
        flop = 2 * m * args.n * args.k
        paths = {"cublas_then_gelu": lambda: linear_gelu_reference(x, w, b),
                 "cublas_linear_only": lambda: F.linear(x, w, b),
                 "cublaslt_tanh": lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)}
        paths |= {name: (lambda fn=fn: fn(x)) for name, fn in compiled.items()}
        if not args.skip_triton:
            paths |= {f"triton {name}": (lambda c=c: linear_gelu_triton(x, w, b, c)) for name, c in launches.items()}
            paths |= {f"triton_linear_only {name}": (lambda c=launches[name]: linear_triton(x, w, b, c))
                      for name in linear_only}
        for name, fn in paths.items():
            row = {"m": m, "path": name}
            try:
                got = fn()
                ms = median_ms(fn, device, iters=args.iters)
                row |= {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)}
                want = F.linear(x, w, b) if name.startswith("triton_linear_only") else ref
                if got.shape == want.shape and name != "cublas_linear_only":
                    diff = (got.float() - want.float()).abs()
                    row |= {"max_abs_diff": diff.max().item(), "max_abs_ref": want.float().abs().max().item(),
                            "identical_pct": round(100 * (got == want).float().mean().item(), 3)}
            except Exception as e:  # one configuration failing (shared memory, a compile error) must not lose the rest
                row["error"] = repr(e)[:400]
            print(f"[linear_gelu_probe] {json.dumps(row)}", flush=True)
            result["rows"].append(row)
            (out / "linear_gelu_probe.json").write_text(json.dumps(result, indent=1))
        del x, ref
    for m in args.m:  # the question, one line per M
        rows = {r["path"]: r for r in result["rows"] if r["m"] == m and "ms" in r}
        base = rows.get("inductor", rows.get("cublas_then_gelu"))
        for path in ("inductor_cdt",):
            if path in rows and base:
                print(f"[linear_gelu_probe] M={m}: {path} {rows[path]['ms']:.4f} ms against {base['path']} "
                      f"{base['ms']:.4f} ms ({base['ms'] / rows[path]['ms']:.3f}x)", flush=True)
        best = min((r for p, r in rows.items() if p.startswith("triton ")), key=lambda r: r["ms"], default=None)
        if best and base:
            bare = rows.get("cublas_linear_only", {}).get("ms", float("nan"))
            print(f"[linear_gelu_probe] M={m}: best Triton {best['path']} {best['ms']:.4f} ms against "
                  f"{base['path']} {base['ms']:.4f} ms ({base['ms'] / best['ms']:.3f}x); cuBLAS GEMM alone "
                  f"{bare:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
