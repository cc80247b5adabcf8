"""A decode step's MoE expert work per layer at full size (E = 256, top-8, H = 2048, I = 512, the shared expert):
the fused launch (`kernels/moe_decode.py`) + `moe_combine` over its partial rows, beside the engine's unfused path
(the routed experts' two GEMV launches, the shared expert's two, `moe_combine`), at 1 / 2 / 4 tokens.

    python benchmarks/moe_decode_bench.py --out benchmarks/results/moe_decode_bench     # GPU; ~1 min
    python benchmarks/moe_decode_bench.py --combine-probe --layers 1 --out ...           # moe_combine alone

Random packed weights in the checkpoint's layout (speed does not depend on the values): `--layers` distinct layers'
stacks (default 8: ~3.6 GB, so that the experts a call touches are not L2-resident from the call before), 40 calls
in one CUDA graph, each on layer i % layers with its own routing, replayed (`cuda_timing.graph_per_call_us`); PDL as
the engine launches it on Hopper (`--no-pdl`: off). The outputs of the two paths are compared at every token count
(relative to max |unfused|: bf16 rounding level, the unfused path rounds its intermediates), and the fused partial
rows against `moe_decode_reference` at one token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/moe_decode_bench")
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--combine-probe", action="store_true",
                    help="only moe_combine at one token: over the partial rows and over bf16 rows, PDL on and off, "
                         "in CUDA graphs and one call under torch.profiler (its kernel time)")
    ap.add_argument("--sweep", default="16:128:256:4,16:256:512:4,16:512:512:4,16:256:256:2,32:128:256:4,"
                                       "32:128:512:8,64:64:256:4,16:1024:1024:4,16:512:2048:8,64:128:512:8",
                    help="pinned BLOCK_I:BLOCK_K:BLOCK_H:warps configs timed (kernel only) at one token")
    args = ap.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("moe_decode_bench needs a CUDA GPU")
    from cuda_timing import graph_per_call_us  # benchmarks/ (the script's directory) is on sys.path
    from kernels import moe_combine, moe_decode, pdl
    from kernels.nvfp4 import NVFP4Tensor
    from kernels.w4a16_gemv import moe_experts_w4a16_gemv, w4a16_linear_gemv, w4a16_swiglu_gemv
    from random_packed import random_nvfp4

    pdl.set_enabled(not args.no_pdl and pdl.device_supports())
    dev, e, k, h, i, calls = torch.device("cuda"), 256, 8, 2048, 512, 40
    gen = torch.Generator(device=dev).manual_seed(0)

    def packed(*shape) -> NVFP4Tensor:
        return random_nvfp4(shape, dev, gen)

    layers = [dict(w13=packed(e, 2 * i, h), w2=packed(e, h, i), s13=packed(2 * i, h), s2=packed(h, i),
                   gate=(torch.randn(1, h, device=dev, generator=gen) * 0.02).to(torch.bfloat16))
              for _ in range(args.layers)]
    torch.cuda.synchronize()

    def unfused(lay, x, idx, wts, res):
        routed = moe_experts_w4a16_gemv(x, lay["w13"], lay["w2"], idx, wts, reduce=False)  # [T, k, H]
        shared = w4a16_linear_gemv(w4a16_swiglu_gemv(x, lay["s13"]), lay["s2"])
        return moe_combine.moe_combine_triton(x, lay["gate"], shared, routed, res)

    def fused(lay, x, idx, wts, res):
        parts = moe_decode.moe_decode_triton(x, lay["w13"], lay["w2"], idx, wts, lay["s13"], lay["s2"])
        return moe_combine.moe_combine_triton(x, lay["gate"], parts[:, k], parts[:, :k].flatten(1, 2), res)

    if args.combine_probe:
        return combine_probe(args, layers, k, h, dev, gen)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        inputs = []
        for c in range(calls):
            x = torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(e, device=dev, generator=gen)[:k] for _ in range(t)])
            wts = torch.softmax(torch.randn(t, k, device=dev, generator=gen), -1).to(torch.bfloat16)
            inputs.append((layers[c % args.layers], x, idx, wts, torch.randn(t, h, device=dev,
                                                                              generator=gen).to(torch.bfloat16)))
        a, b = unfused(*inputs[0]), fused(*inputs[0])  # also the autotuners' first calls, outside the graphs
        row = dict(tokens=t, pairs=t * (k + 1),
                   fused_vs_unfused_rel=float((b.float() - a.float()).abs().max() / a.float().abs().max()))
        row["block_i"] = moe_decode._moe_decode_autotuned.best_config.kwargs["BLOCK_I"]
        row["config"] = str(moe_decode._moe_decode_autotuned.best_config)
        if t == 1:
            lay, x, idx, wts, _ = inputs[0]
            parts = moe_decode.moe_decode_triton(x, lay["w13"], lay["w2"], idx, wts, lay["s13"], lay["s2"])
            ref = moe_decode.moe_decode_reference(x, lay["w13"], lay["w2"], idx, wts, lay["s13"], lay["s2"])
            row["parts_vs_reference"] = moe_decode.compare(parts, ref) or "within 1e-4 x max |ref|"
        def kernel(lay, x, idx, wts, _res, **kw):
            return moe_decode.moe_decode_triton(x, lay["w13"], lay["w2"], idx, wts, lay["s13"], lay["s2"], **kw)

        def combine(lay, x, res, parts, summed=False):
            shared, routed = (parts[:, k], parts[:, :k]) if summed else (parts[:, k], parts[:, :k].flatten(1, 2))
            return moe_combine.moe_combine_triton(x, lay["gate"], shared, routed, res)

        row["unfused_us"] = graph_per_call_us([lambda a=a: unfused(*a) for a in inputs])
        row["fused_us"] = graph_per_call_us([lambda a=a: fused(*a) for a in inputs])
        row["fused_kernel_only_us"] = graph_per_call_us([lambda a=a: kernel(*a) for a in inputs])
        # bytes of packed weights + block scales: t k routed experts (distinct ids per token, rarely shared across
        # tokens) and the shared expert once
        touched = (t * k + 1) * (2 * i * h + h * i) * (0.5 + 1 / 16)
        row["fused_kernel_TBps"] = touched / (row["fused_kernel_only_us"] * 1e-6) / 1e12
        # moe_combine alone: over the fused kernel's partial rows, and over the unfused path's [T, k, H] bf16 rows
        parts = [kernel(*a) for a in inputs]
        row["combine_parts_us"] = graph_per_call_us([lambda a=a, p=p: combine(a[0], a[1], a[4], p)
                                                     for a, p in zip(inputs, parts, strict=True)])
        row["combine_bf16_rows_us"] = graph_per_call_us([lambda a=a, p=p: combine(a[0], a[1], a[4], p.sum(2).to(
            torch.bfloat16), summed=True) for a, p in zip(inputs, parts, strict=True)])
        if t == 1:
            for spec in (v for v in args.sweep.split(",") if v):
                bi, bk, bh, w = (int(u) for u in spec.split(":"))
                cfg = dict(BLOCK_I=bi, BLOCK_K=bk, BLOCK_H=bh, num_warps=w)
                row[f"kernel_us[{spec}]"] = graph_per_call_us([lambda a=a, cfg=cfg: kernel(*a, config=dict(cfg))
                                                                for a in inputs])
        rows.append(row)
        print("[moe_decode_bench]", json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                pdl=pdl.enabled(), layers=args.layers)
    (out / "moe_decode_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("[moe_decode_bench]", json.dumps(meta))


def combine_probe(args, layers, k: int, h: int, dev, gen) -> None:
    """moe_combine at one token over the fused kernel's fp32 partial rows and over bf16 [1, k, H] rows, with PDL on
    and off: graph-timed (40 calls) and one call's kernels under torch.profiler (device time by kernel name)."""
    import torch

    from cuda_timing import graph_per_call_us
    from kernels import moe_combine, moe_decode, pdl

    lay = layers[0]
    x = torch.randn(1, h, device=dev, generator=gen).to(torch.bfloat16)
    idx = torch.randperm(256, device=dev, generator=gen)[:k][None]
    wts = torch.softmax(torch.randn(1, k, device=dev, generator=gen), -1).to(torch.bfloat16)
    res = torch.randn(1, h, device=dev, generator=gen).to(torch.bfloat16)
    parts = moe_decode.moe_decode_triton(x, lay["w13"], lay["w2"], idx, wts, lay["s13"], lay["s2"])
    summed = parts.sum(2).to(torch.bfloat16)
    calls = dict(parts=lambda: moe_combine.moe_combine_triton(x, lay["gate"], parts[:, k], parts[:, :k].flatten(1, 2),
                                                              res),
                 bf16_rows=lambda: moe_combine.moe_combine_triton(x, lay["gate"], summed[:, k], summed[:, :k], res))
    row = dict(partial_rows=int(parts.shape[1] * parts.shape[2]))
    for on in (True, False):
        pdl.set_enabled(on and pdl.device_supports())
        for name, fn in calls.items():
            row[f"{name}_pdl_{on}_graph_us"] = graph_per_call_us([fn] * 40)
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            row[f"{name}_pdl_{on}_kernels_us"] = {e.key: round(e.device_time_total, 2)
                                                  for e in prof.key_averages() if e.device_time_total > 0}
    # the partial-rows kernel's tiles (columns per program, rows per load), PDL as the engine (on for Hopper)
    pdl.set_enabled(not args.no_pdl and pdl.device_supports())
    saved = moe_combine.PARTS_BLOCK_C, moe_combine.PARTS_BLOCK_S
    first = calls["parts"]().float()
    try:
        for bc, bs in ((128, 32), (64, 64), (32, 64), (32, 128), (16, 128), (16, 256), (64, 128), (8, 512)):
            moe_combine.PARTS_BLOCK_C, moe_combine.PARTS_BLOCK_S = bc, bs
            out = calls["parts"]()
            row[f"parts_tiles_{bc}x{bs}_graph_us"] = graph_per_call_us([calls["parts"]] * 40)
            row[f"parts_tiles_{bc}x{bs}_max_diff_vs_first"] = float((out.float() - first).abs().max())
    finally:
        moe_combine.PARTS_BLOCK_C, moe_combine.PARTS_BLOCK_S = saved
    print("[moe_decode_bench] combine probe", json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "combine_probe.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
