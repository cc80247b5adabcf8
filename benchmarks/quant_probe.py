"""The GELU-quantiser that feeds an FP8 ViT fc2 (`kernels/gelu_fp8_quant.py`), timed alone (issue 4).

Waterfall run 8 found fc2 in FP8 with the one-pass kernel SLOWER than fc2 in bf16, ~0.9 ms a call by inference,
against ~0.12-0.15 ms of memory traffic. This probe measures instead of inferring, at the ViT's batch of 8
(h [41,472, 4,736] bf16, the fc1 output before its GELU):
- each kernel variant (`gelu_fp8_quant.Launch`): the old single padded tile (8,192 lanes a row) against the
  head + tail split (4,096 + 1,024), fp32 rounding to the e4m3 grid against the cast alone, 4 / 8 / 16 warps, and
  the chunked max-first kernel (the row's amax from the GELU of its largest input; chunk width and warps);
- per variant: median ms, effective GB/s (bf16 read + e4m3 and scales written), and how many codes and scales differ
  from `gelu_quantize_rows_reference` (exact GELU, IEEE division) computed on the same GPU;
- what they compete with: the reference eager and under torch.compile (inductor's fusion: the engine's FP8 fc2 under
  inductor), the bf16 path's GELU pass alone, a bare bf16 -> e4m3 cast (memory floor), and fc2's GEMM in bf16
  (after the GELU) and in row-wise FP8 (`torch._scaled_mm`), so the break-even is read off one table:
  bf16 path = GELU + bf16 GEMM, FP8 path = quantiser + FP8 GEMM.

    python benchmarks/quant_probe.py --out DIR          # CUDA; ~1 min on an H200 (the compiles)
    python benchmarks/quant_probe.py --out DIR --m 64 --k 4736 --iters 1     # CPU smoke run (Triton interpreter)
    python benchmarks/quant_probe.py --out DIR --static      # the static-scale quantiser only (below), ~1 min

`--static` (2026-12-02): the quantiser of `vit_fp8_static` (one calibrated scale: elementwise), which inductor fuses
into the GELU pass. Waterfall run 19's lone-request profile put that fused kernel at 47 us a call at batch 1 (9.8% of
the kernels), against a memory floor near 15-18 us. Timed at batch 1 and 8 (M 5,184 and 41,472): the engine's fusion
(exact GELU, IEEE division), the same multiplying by the reciprocal, with the tanh GELU, without the GELU, inductor's
GELU alone, the cast alone and the Triton static quantiser after an eager GELU; codes that differ from the engine's.
Each row: `ms`, CUDA events around one Python call (a compiled function's host time included: quant_probe run 3's
batch-1 rows all read 0.095-0.18 ms), and on CUDA `graph_ms`, ten calls replayed from one CUDA graph (kernels only).

Random inputs (the GELU's negative tail to its linear part, as tests/test_kernel_fp8.py); speed does not depend on
the values.
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

from cuda_timing import graph_per_call_us, median_ms  # noqa: E402
from kernels import gelu_fp8_quant as gq  # noqa: E402


def variants(m: int, k: int) -> dict[str, gq.Launch]:
    """name -> Launch: the default, the old padded tile, and the split at each warp count and rounding."""
    block_m, head, tail = gq.split_tiling(m, k)
    padded = 1 << (k - 1).bit_length()
    out = {"default": gq.default_launch(m, k),
           "padded_fp32round_w8 (the kernel of waterfall run 8)": gq.Launch(1, padded, 0, True, 8)}
    for rnd in (True, False):
        for warps in (4, 8, 16):
            out[f"split_{'fp32round' if rnd else 'cast'}_w{warps}"] = gq.Launch(block_m, head, tail, rnd, warps)
    out["padded_cast_w8"] = gq.Launch(1, padded, 0, False, 8)
    for chunk, warps in ((512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8)):  # the row's largest input first
        out[f"max_first_c{chunk}_w{warps}"] = gq.Launch(1, chunk, 0, False, warps, max_first=True)
    return out


def differ(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Codes that differ from the reference's (count, largest step in e4m3 code units) and scales that differ."""
    step = (got[0].view(torch.uint8).int() - want[0].view(torch.uint8).int()).abs()
    return {"codes_differ": int((step > 0).sum()), "codes_max_step": int(step.max()),
            "scales_differ": int((got[1] != want[1]).sum())}


def graph_ms(call) -> float | str:
    """ms a call of `call`, ten calls replayed from one CUDA graph (kernels only); a capture failure as its text."""
    try:
        return round(graph_per_call_us([call] * 10) / 1e3, 4)
    except Exception as err:  # noqa: BLE001  (a call that cannot be captured is a result, not the end of the probe)
        return f"{type(err).__name__}: {err}"[:200]


def static_rows(args, device: torch.device, out: Path) -> None:
    """--static: the static-scale GELU-quantiser's variants at each M of --static-m (see the module docstring)."""
    from kernels.fp8_quant import quantize_static_reference, quantize_static_triton

    def engine(h, s):  # the engine's FP8 fc2 input under inductor: bf16 GELU, then x / s, clamp, RNE to e4m3
        return quantize_static_reference(F.gelu(h), s)

    def reciprocal(h, s):  # one multiply instead of the IEEE division (not the reference's codes everywhere)
        return (F.gelu(h).float() * (1.0 / s)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    def tanh(h, s):
        return quantize_static_reference(F.gelu(h, approximate="tanh"), s)

    variants = {"engine: exact GELU + x / s (inductor)": engine, "exact GELU + x * (1 / s) (inductor)": reciprocal,
                "tanh GELU + x / s (inductor)": tanh, "x / s alone, no GELU (inductor)": quantize_static_reference,
                "GELU alone, bf16 out (inductor)": lambda h, s: F.gelu(h),
                "cast alone h.to(e4m3) (memory floor)": lambda h, s: h.to(torch.float8_e4m3fn)}
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "k": args.k, "rows": {}}

    def measure(m: int, want: torch.Tensor, label: str, call, codes: bool) -> None:
        """One row: `call` timed (and on CUDA replayed from a graph); `codes`: its e4m3 output against `want`."""
        ms = median_ms(call, device, iters=args.iters, warmup=3 if device.type == "cuda" else 1)
        extra = {}
        if device.type == "cuda":  # the kernels alone: 10 calls replayed from one CUDA graph, no host time
            extra["graph_ms"] = graph_ms(call)
        if codes:  # the variants computing the engine's function: how many codes they change
            extra["codes_differ"] = int((call().view(torch.uint8) != want.view(torch.uint8)).sum())
        report["rows"][f"M={m} {label}"] = {"ms": round(ms, 4), **extra}
        print(f"[quant_probe] M={m:6d} {label:44s} {ms:8.4f} ms {extra}", flush=True)

    g = torch.Generator().manual_seed(0)
    for m in args.static_m:
        h = (torch.randn(m, args.k, generator=g) * 2).to(torch.bfloat16).to(device)
        s = (F.gelu(h).float().abs().amax() * 2 / 448).reshape(()).to(device)  # 2 x amax / 448, as calibrated
        with torch.inference_mode():
            want = engine(h, s)
            for name, fn in variants.items():
                f = fn if args.no_compile else torch.compile(fn, fullgraph=True, dynamic=False)
                measure(m, want, name, lambda f=f, h=h, s=s: f(h, s), "GELU +" in name)
            act = F.gelu(h)
            measure(m, want, "Triton static quantiser after an eager GELU",
                    lambda act=act, s=s: quantize_static_triton(act, s), True)
    (out / "quant_probe_static.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", type=int, default=8 * 5184, help="rows: tokens of the batch (8 images x 72 x 72)")
    ap.add_argument("--k", type=int, default=4736, help="fc1's width, fc2's input")
    ap.add_argument("--n", type=int, default=1024, help="fc2's output width")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--scale-lo", type=float, default=-0.5, help="log10 of the smallest row scale of the input")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row (the CPU smoke run)")
    ap.add_argument("--static", action="store_true", help="only the static-scale quantiser's rows (module docstring)")
    ap.add_argument("--static-m", type=int, nargs="+", default=[5184, 8 * 5184], help="rows of the --static runs")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.static:
        return static_rows(args, device, out)
    m, k, n = args.m, args.k, args.n
    g = torch.Generator().manual_seed(0)
    # row scales 10^-0.5 .. 10^1.5: every row's largest input >= 0.5, as fc1 outputs have it (the max-first kernel's
    # fast branch); quant_probe run 1 used 10^-2 .. 10^1.5 (a third of the rows below: the fallback), which the tile
    # kernels' cost does not depend on
    h = (torch.randn(m, k, generator=g) * torch.logspace(args.scale_lo, 1.5, m)[:, None]).to(torch.bfloat16).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16).to(device)
    bias = torch.randn(n, generator=g).to(torch.bfloat16).to(device)

    def time_ms(fn) -> float:  # 3 warm-up calls on the GPU, 1 in the CPU dry run (the interpreter is slow)
        return median_ms(fn, device, iters=args.iters, warmup=3 if device.type == "cuda" else 1)
    bytes_moved = m * k * 2 + m * k + m * 4  # bf16 read, e4m3 written, fp32 scales written
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "m": m, "k": k, "n": n, "bytes_moved": bytes_moved, "rows": {},
                    "rows_below_max_first_threshold": float((h.float().amax(dim=1) < 0.5).float().mean())}
    print(f"[quant_probe] rows whose largest input is below 0.5 (the max-first fallback): "
          f"{report['rows_below_max_first_threshold']:.1%}", flush=True)

    def row(name: str, ms: float, **extra) -> None:
        report["rows"][name] = {"ms": round(ms, 4), **extra}
        gbs = bytes_moved / ms / 1e6 if "quantiser" in extra.get("kind", "") else None
        tail = " ".join(f"{key}={val}" for key, val in extra.items() if key != "kind")
        print(f"[quant_probe] {name:52s} {ms:8.4f} ms" + (f" {gbs:7.0f} GB/s" if gbs else "") + f" {tail}",
              flush=True)

    with torch.inference_mode():
        want = gq.gelu_quantize_rows_reference(h)
        row("reference, eager torch ops", time_ms(lambda: gq.gelu_quantize_rows_reference(h)),
            kind="quantiser")
        if not args.no_compile:
            compiled = torch.compile(gq.gelu_quantize_rows_reference, fullgraph=True, dynamic=False)
            row("reference under torch.compile (inductor's fusion)", time_ms(lambda: compiled(h)),
                kind="quantiser", **differ(compiled(h), want))
        for name, how in variants(m, k).items():
            try:
                row(f"triton {name}", time_ms(lambda how=how: gq.launch(h, how)), kind="quantiser",
                    **differ(gq.launch(h, how), want), launch=how.__dict__)
            except Exception as err:  # a variant that fails to compile or run is a result, not the end of the probe
                report["rows"][f"triton {name}"] = {"error": f"{type(err).__name__}: {err}"[:400]}
                print(f"[quant_probe] triton {name}: {type(err).__name__}: {err}"[:400], flush=True)
        row("bf16 -> e4m3 cast alone (memory floor, no reduction)", time_ms(lambda: h.to(torch.float8_e4m3fn)),
            kind="quantiser")
        row("F.gelu alone (the bf16 path's GELU pass)", time_ms(lambda: F.gelu(h)))
        act = F.gelu(h)
        row("fc2 GEMM, bf16 (F.linear)", time_ms(lambda: F.linear(act, w, bias)))
        if device.type == "cuda":
            w8, sw = gq.quantize_rows_reference(w)
            q, s = want
            row("fc2 GEMM, FP8 row-wise (_scaled_mm)", time_ms(lambda: torch._scaled_mm(
                q, w8.t(), scale_a=s, scale_b=sw.reshape(1, -1), bias=bias, out_dtype=torch.bfloat16)))
    rows = report["rows"]
    if "fc2 GEMM, FP8 row-wise (_scaled_mm)" in rows:
        bf16_path = rows["F.gelu alone (the bf16 path's GELU pass)"]["ms"] + rows["fc2 GEMM, bf16 (F.linear)"]["ms"]
        fp8_gemm = rows["fc2 GEMM, FP8 row-wise (_scaled_mm)"]["ms"]
        report["break_even_quantiser_ms"] = round(bf16_path - fp8_gemm, 4)
        print(f"[quant_probe] bf16 path (GELU + GEMM) {bf16_path:.4f} ms; the FP8 path wins with a quantiser under "
              f"{bf16_path - fp8_gemm:.4f} ms", flush=True)
    (out / "quant_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
