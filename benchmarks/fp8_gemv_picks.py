"""The FP8 decode GEMV (`kernels/fp8_gemv.py`) timed at the lone decode step's projection shapes for every tiling of
its autotuner and for whole-K tilings (BLOCK_K = K or K / 2: every weight word of a program loaded at once) that the
autotuner does not hold.

Why. Nsight Compute (decode_ncu run 1) put the lone step's out_proj (2,048 x 4,096 e4m3, 8.4 MB) at 5.95 us and
30% of DRAM peak, waiting on global loads: its shipped tiling (8 rows x 1,024 K, 4 warps) keeps one K tile ahead in
flight, ~4 MB over its 256 programs, where the whole matrix in flight would take one DRAM round trip. Timed as the
engine runs it: one CUDA graph of `--calls` launches, each on its own weight copy (the step reads every projection
from DRAM), activation codes given (the producing norm's), PDL on; us per call.

    python benchmarks/fp8_gemv_picks.py --out DIR

Writes DIR/fp8_gemv_picks.md and .json: us per tiling and shape, the shipped table's pick marked, and each tiling's
largest difference from the shipped pick's output (the K tiling moves the fp32 summation order only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, N, K): the lone step's FP8 GEMV calls (Qwen3.6: the GDN in_proj_qkv + z fused, the attention q / k / v
# fused, the GDN out_proj and attention o_proj share 2,048 x 4,096)
SHAPES = [("GDN in_proj (qkv + z)", 12288, 2048), ("attention q/k/v", 9216, 2048), ("out_proj / o_proj", 2048, 4096)]
# whole-K tilings (BLOCK_N, BLOCK_K as a fraction of K, warps) beside the autotuner's own
WHOLE_K = [(4, 1, 1), (8, 1, 2), (8, 1, 4), (16, 1, 4), (4, 2, 1), (8, 2, 2), (8, 2, 4), (16, 2, 4)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=40, help="launches (weight copies) per graph")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("fp8_gemv_picks: needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.cuda_timing import graph_per_call_us
    from kernels import autotune_table, pdl
    from kernels import fp8_gemv as fg

    pdl.set_enabled(pdl.device_supports())  # as the engine on Hopper
    dev = torch.device("cuda")
    print(f"[fp8_gemv_picks] autotune picks loaded: {autotune_table.load_for_device(dev)}")
    gen = torch.Generator(device=dev).manual_seed(0)
    tuner = fg._fp8_gemv_autotuned
    rows = []
    for name, n, k in SHAPES:
        ws = [(torch.randn(n, k, device=dev, generator=gen) * 40).to(torch.float8_e4m3fn) for _ in range(args.calls)]
        wscale = torch.rand(n, device=dev, generator=gen) * 0.01
        s_in = torch.tensor(0.05, device=dev)
        codes = (torch.randn(1, k, device=dev, generator=gen) * 20).to(torch.float8_e4m3fn)
        x = torch.zeros(1, k, device=dev, dtype=torch.bfloat16)  # unread: the codes stand for it

        def call(i: int, cfg: dict | None):
            extra = {} if cfg is None else dict(block_n=cfg["BLOCK_N"], block_k=cfg["BLOCK_K"], num_warps=cfg["w"])
            return fg.fp8_gemv_op(x, ws[i], wscale, s_in, torch.bfloat16, codes=codes, **extra)

        shipped = call(0, None).float()  # the autotuned launch: the shipped table's pick (or this start's tuning)
        torch.cuda.synchronize()
        key = next((kk for kk in tuner.cache if kk[1] == n and kk[2] == k and kk[0] == 1), None)
        pick = tuner.cache.get(key)
        tilings = [dict(BLOCK_N=c.kwargs["BLOCK_N"], BLOCK_K=c.kwargs["BLOCK_K"], w=c.num_warps)
                   for c in tuner.configs]
        tilings += [dict(BLOCK_N=bn, BLOCK_K=k // frac, w=w) for bn, frac, w in WHOLE_K
                    if bn * (k // frac) // 4 <= 64 * 32 * w]  # <= 64 weight words a thread (x3 with acc, next)
        us = {"autotuned": graph_per_call_us([lambda i=i: call(i, None) for i in range(args.calls)],
                                             replays=args.replays)}
        diff = {}
        for cfg in tilings:
            label = f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']}/w{cfg['w']}"
            out = call(0, cfg).float()
            diff[label] = float((out - shipped).abs().max() / shipped.abs().max().clamp_min(1e-30))
            us[label] = graph_per_call_us([lambda i=i, c=cfg: call(i, c) for i in range(args.calls)],
                                          replays=args.replays)
        picked = (f"{pick.kwargs['BLOCK_N']}x{pick.kwargs['BLOCK_K']}/w{pick.num_warps}" if pick is not None
                  else "?")
        best = min((v, lab) for lab, v in us.items() if lab != "autotuned")
        rows.append(dict(shape=name, n=n, k=k, autotuned_pick=picked, us=us, rel_diff_vs_autotuned=diff,
                         fastest=best[1]))
        print(json.dumps(dict(shape=name, pick=picked, autotuned_us=round(us["autotuned"], 2),
                              fastest=best[1], fastest_us=round(best[0], 2))), flush=True)
        ws.clear()  # the next shape's copies need the memory
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    meta = f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, PDL {pdl.enabled()}, {when}"
    (out / "fp8_gemv_picks.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# fp8_gemv_picks ({meta}): us per launch, {args.calls} launches (weight copies) per graph", ""]
    for r in rows:
        lines += [f"## {r['shape']} ({r['n']} x {r['k']}); shipped pick {r['autotuned_pick']}, fastest {r['fastest']}",
                  "", "| tiling | us | max rel. diff vs the autotuned launch |", "|---|---:|---:|"]
        lines += [f"| {lab} | {v:.2f} | {r['rel_diff_vs_autotuned'].get(lab, 0.0):.1e} |" for lab, v in r["us"].items()]
        lines.append("")
    (out / "fp8_gemv_picks.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
