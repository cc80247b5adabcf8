"""The decode GEMV (`kernels/w4a16_gemv.py`, CUDA cores) beside the tensor-core W4A16 kernels it takes decode calls
from, at Qwen3.6-35B-A3B's shapes, per token count: the routed-expert block (top-8 of 256 experts, H 2048, I 512;
the tensor-core path on the tile-major copy the engine read until now, and on the checkpoint layout the GEMV reads),
the shared expert's two dense calls, and lm_head (one row: the GEMV takes it at any size, `gemv_ok`).

    python benchmarks/w4a16_gemv_bench.py --out benchmarks/results/w4a16_gemv_bench     # GPU; ~2 min on an H200
    python benchmarks/w4a16_gemv_bench.py --deq 2,3 ...   # also the GEMV's DEQ_WIDE mode (int32 words, fp32 PTX)
    python benchmarks/w4a16_gemv_bench.py --deq 3 --mma ... # also kernels/w4a16_mma.py (the GEMV on tensor cores)

Timing as the engine runs them (`benchmarks/cuda_timing.py: graph_per_call_us`): one CUDA graph of R calls
replayed, us per call = replay time / R (median of 5).
Dense calls cycle through weight copies >= 2 x the 50 MB L2 (every call reads HBM); the MoE calls share one stack of
256 experts (453 MB) and each routes its tokens to a fresh random top-8 (8 of 256 experts: mostly HBM reads too).
Random weights (speed does not depend on the values). Each GEMV result is compared with the reference (max |diff|
/ max |ref|).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

L2_BYTES = 50 * 2**20
H, I, E, TOP_K, VOCAB = 2048, 512, 256, 8, 248320


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/w4a16_gemv_bench")
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--calls", type=int, default=40, help="calls per graph (the MoE: 40 = the model's layers)")
    ap.add_argument("--deq", default="2", help="the GEMV's dequant modes to time: 2 (always: the \"GEMV\" columns), "
                                               "3 (DEQ_WIDE, the engine's default since 2026-12-01)")
    ap.add_argument("--pdl", action="store_true", help="launch the Triton kernels with programmatic dependent launch, "
                                                       "as the engine does on Hopper (kernels/pdl.py)")
    ap.add_argument("--mma", action="store_true", help="also the tensor-core decode GEMV (kernels/w4a16_mma.py, "
                                                       "\"MMA\" columns; its max rel err against the same reference)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("w4a16_gemv_bench needs a CUDA GPU")
    if args.pdl:
        from kernels import pdl

        pdl.set_enabled(pdl.device_supports())
    from cuda_timing import graph_per_call_us  # benchmarks/ (the script's directory) is on sys.path
    from kernels import w4a16_gemm as tc
    from kernels import w4a16_gemv as gv
    from kernels import w4a16_mma as mm
    from kernels.nvfp4 import NVFP4Tensor, w4a16_linear_reference

    dev = torch.device("cuda")
    wide = "3" in args.deq.split(",")
    gen = torch.Generator(device=dev).manual_seed(0)

    def nvfp4(*shape) -> NVFP4Tensor:  # random bytes, scales in [1, 2), per-row globals
        packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), device=dev, dtype=torch.uint8, generator=gen)
        scales = (1 + torch.rand(*shape[:-1], shape[-1] // 16, device=dev, generator=gen)).to(torch.float8_e4m3fn)
        return NVFP4Tensor(packed, scales, torch.full(shape[:-1], 1e-2, device=dev))

    def rel(a, b) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    results = []

    def record(row: dict) -> None:
        results.append(row)
        print(json.dumps(row), flush=True)

    # routed experts: one stack, checkpoint layout and the tile-major copy
    w13, w2 = nvfp4(E, 2 * I, H), nvfp4(E, H, I)
    t13, t2 = tc.experts_repack(w13, w2, tc.TILE_MAJOR)
    moe_bytes = TOP_K * (w13.packed[0].numel() + w2.packed[0].numel()) * 1.125  # packed + scales, per token
    for t in (int(v) for v in args.tokens.split(",")):
        xs = [torch.randn(t, H, device=dev, dtype=torch.bfloat16) for _ in range(args.calls)]
        idx = [torch.stack([torch.randperm(E, device=dev, generator=gen)[:TOP_K] for _ in range(t)])
               for _ in range(args.calls)]
        wts = [torch.softmax(torch.randn(t, TOP_K, device=dev), -1).to(torch.bfloat16) for _ in range(args.calls)]
        paths = {"GEMV (checkpoint layout)": lambda i: gv.moe_experts_w4a16_gemv(xs[i], w13, w2, idx[i], wts[i],
                                                                                deq=2),
                 **({"GEMV DEQ_WIDE": lambda i: gv.moe_experts_w4a16_gemv(xs[i], w13, w2, idx[i], wts[i],
                                                                          deq=gv.DEQ_WIDE)} if wide else {}),
                 "tensor cores, tile-major (run 15)": lambda i: tc.moe_experts_w4a16_triton(
                     xs[i], t13, t2, idx[i], wts[i], True, tc.TILE_MAJOR),
                 "tensor cores, checkpoint layout": lambda i: tc.moe_experts_w4a16_triton(
                     xs[i], w13, w2, idx[i], wts[i]),
                 **({"MMA": lambda i: mm.moe_experts_w4a16_mma(xs[i], w13, w2, idx[i], wts[i])} if args.mma else {})}
        row = dict(call="routed experts (gate_up + SwiGLU, down x weight, sum)", tokens=t,
                   bytes_per_call=moe_bytes * len(set(idx[0].view(-1).tolist())) / TOP_K)
        for label, fn in paths.items():
            us = graph_per_call_us([lambda i=i: fn(i) for i in range(args.calls)])
            row[label] = dict(us=us, tb_s=row["bytes_per_call"] / (us * 1e-6) / 1e12)
        row["gemv_rel_err_vs_tensor_cores"] = rel(paths["GEMV (checkpoint layout)"](0),
                                                  paths["tensor cores, checkpoint layout"](0))
        if wide:
            row["wide_rel_err_vs_tensor_cores"] = rel(paths["GEMV DEQ_WIDE"](0),
                                                      paths["tensor cores, checkpoint layout"](0))
        if args.mma:
            row["mma_rel_err"] = rel(paths["MMA"](0), paths["tensor cores, checkpoint layout"](0))
            # its two launches apart (the engine sums the top-8 in moe_combine, not in the bench's torch sum), each
            # with the calls' own experts and with one expert set for all 40 (weights L2-resident after the first:
            # what DRAM costs)
            hs = [mm.w4a16_mma_launch(xs[i], *w13, pair_expert=idx[i], a_div=TOP_K, swiglu=True)
                  for i in range(args.calls)]
            launches = {"MMA gate_up + SwiGLU only": lambda i, j: mm.w4a16_mma_launch(
                            xs[i], *w13, pair_expert=idx[j], a_div=TOP_K, swiglu=True),
                        "MMA down x weight only": lambda i, j: mm.w4a16_mma_launch(
                            hs[i], *w2, pair_expert=idx[j], row_scale=wts[i])}
            for (label, fn), share in zip(launches.items(), (2 / 3, 1 / 3)):  # gate_up [2I, H], down [H, I]
                for suffix, same in (("", False), (", one expert set (L2-warm)", True)):
                    us = graph_per_call_us([lambda i=i: fn(i, 0 if same else i) for i in range(args.calls)])
                    row[label + suffix] = dict(us=us, tb_s=share * row["bytes_per_call"] / (us * 1e-6) / 1e12)
        record(row)


    # dense: the shared expert's gate_up (+ SwiGLU) and down, lm_head
    dense = [("shared expert gate_up + SwiGLU", 2 * I, H, True), ("shared expert down", H, I, False),
             ("lm_head", VOCAB, H, False)]
    for name, n, k, swiglu in dense:
        nbytes = n * k // 2 * 1.125
        copies = max(2, min(args.calls, -(-2 * L2_BYTES // int(nbytes))))
        ws = [nvfp4(n, k) for _ in range(copies)]
        for t in (int(v) for v in args.tokens.split(",")):
            if n * k > 64e6 and t > 1:
                continue  # lm_head: one row (the lone decode step)
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            gemv = lambda w: gv.w4a16_gemv_launch(x, *w, swiglu=swiglu, deq=2)  # noqa: E731
            gemv_wide = lambda w: gv.w4a16_gemv_launch(x, *w, swiglu=swiglu, deq=gv.DEQ_WIDE)  # noqa: E731
            core = (lambda w: tc.w4a16_swiglu_triton(x, w)) if swiglu else (lambda w: tc.w4a16_linear_triton(x, w))
            row = dict(call=name, tokens=t, n=n, k=k, bytes_per_call=nbytes, copies=copies)
            mma = lambda w: mm.w4a16_mma_launch(x, *w, swiglu=swiglu)  # noqa: E731
            timed = [("GEMV", gemv)] + ([("GEMV DEQ_WIDE", gemv_wide)] if wide else []) + (
                [("MMA", mma)] if args.mma else [])
            for label, fn in timed + [("tensor cores (dense kernel)", core)]:
                us = graph_per_call_us([lambda w=w: fn(w) for w in ws])
                row[label] = dict(us=us, tb_s=nbytes / (us * 1e-6) / 1e12)
            ref = core(ws[0]) if swiglu else w4a16_linear_reference(x, ws[0])
            row["gemv_rel_err"] = rel(gemv(ws[0]), ref)
            if wide:
                row["wide_rel_err"] = rel(gemv_wide(ws[0]), ref)
            if args.mma:
                row["mma_rel_err"] = rel(mma(ws[0]), ref)
            record(row)
        del ws

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, calls_per_graph=args.calls,
                gemv_configs={str(k): str(v) for k, v in gv._w4a16_gemv_autotuned.cache.items()},  # the tuner's picks
                mma_configs={str(k): str(v) for k, v in mm._w4a16_mma_autotuned.cache.items()})
    (out / "w4a16_gemv_bench.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = [f"# w4a16_gemv_bench ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})", "",
             "| call | tokens | path: us per call (TB/s) | ... | GEMV max rel err |", "|---|---:|---|---|---:|"]
    for r in results:
        cells = [f"{k}: {v['us']:.2f} ({v['tb_s']:.2f})" for k, v in r.items() if isinstance(v, dict)]
        err = r.get("gemv_rel_err", r.get("gemv_rel_err_vs_tensor_cores"))
        wide_err = r.get("wide_rel_err", r.get("wide_rel_err_vs_tensor_cores"))
        errs = f"{err:.1e}" + (f" (DEQ_WIDE {wide_err:.1e})" if wide_err is not None else "") + (
            f" (MMA {r['mma_rel_err']:.1e})" if "mma_rel_err" in r else "")
        lines.append(f"| {r['call']} | {r['tokens']} | " + " | ".join(cells) + f" | {errs} |")
    (out / "w4a16_gemv_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
