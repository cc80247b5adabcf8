"""The lone decode step's hottest kernels launched eagerly at the engine's shapes, for Nsight Compute (issue 5).

Why. The merged PDL critical path (profile run 23) puts the lone step at ~2.1 ms against ~1.07 ms for its bytes
streamed like a copy kernel; per call the routed experts' tensor-core GEMV (gate_up 7.4 us, down 4.4 us against
~4.3 / ~2.7 us chain floors), the router (5.8 against ~1.4), gdn_prep (5.9 against ~1.3) and paged attention (5.7)
are furthest from their bytes. What their warps wait on (long scoreboard: global loads; barrier; MIO; ...), how many
warps are resident and how busy DRAM is cannot be read off a timeline; `ncu` reads it from the counters.

    ncu --clock-control none --nvtx --nvtx-include "measure/" --set full -o REPORT \\
        python benchmarks/decode_ncu.py [--repeat 2]        # gpu_next.sh `decode_ncu` (steps 122-123)
    ncu -i REPORT.ncu-rep --csv --page raw > raw.csv && python benchmarks/decode_ncu.py --summarize raw.csv

Each kernel runs `--repeat` times in this order (weights are random in the checkpoint's formats: speed does not
depend on the values): the routed experts' gate_up + SwiGLU and down x routing weight (1 token, top-8 of 256, the
shipped picks W8C1 / W2C2), the fused FP8 in_proj (12,288 x 2,048, codes given) and out_proj (2,048 x 4,096), the
router GEMV + top-k (256 x 2,048 bf16), gdn_prep with b / a (16 k-heads), paged attention (1,024 tokens, 16 / 2
heads of 256, blocks of 16) and its split combine, moe_combine. ncu serialises and replays each launch with cold
caches (its default cache control), so the numbers are a kernel alone, not its time on the PDL chain.
`--moe32`: instead, the 32-stream step's routed experts only -- gate_up + SwiGLU and down x routing weight on the
swap-AB kernel at 32 tokens (top-8 of 256, 16-row blocks, fragment order, the engine's defaults), the calls that
hold over half of that step's GPU time. `--moe32 --regs`: the same calls on `kernels/w4a16_regs.py` as well (Gluon,
thread-order copies of the same weights; the engine's builds -- `BLOCK_M`-row blocks, `ENGINE_BUILDS` -- then the
launcher's defaults at 16-row blocks), in the same profiled range, so one report has both kernels' stalls side by side
(not with `--tiny`: Gluon has no interpreter).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FULL = dict(H=2048, INTER=512, E=256, TOP_K=8, GDN_IN=12288, GDN_OUT_K=4096, GDN_DK=128, ATTN_DH=256, CTX=1024)
# (hidden, expert intermediate, experts, top-k, fused in_proj_qkv + z outputs, out_proj's K: 32 value heads x 128,
# GDN key / value head dim, attention head dim, attention context); TINY: the same launches at shapes the CPU
# interpreter runs in seconds (tests/test_decode_ncu.py)
TINY = dict(H=256, INTER=128, E=16, TOP_K=8, GDN_IN=512, GDN_OUT_K=256, GDN_DK=16, ATTN_DH=16, CTX=40)


# ncu --page raw metrics a kernel's line shows (name in the CSV header -> label)
SHOWN = {"gpu__time_duration.sum": "us", "dram__bytes_read.sum.pct_of_peak_sustained_elapsed": "DRAM read %",
         "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %", "launch__registers_per_thread": "regs",
         "launch__grid_size": "grid", "launch__block_size": "block",
         "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": "long-sb / issue"}
STALL = "smsp__pcsamp_warps_issue_stalled_"  # the warp-state samples by reason (--set full's WarpStateStats)


def summarize(raw_csv: str, top: int = 5) -> list[str]:
    """One line per profiled kernel of an `ncu --page raw --csv` export: the SHOWN metrics (duration in us) and the
    `top` stall reasons' shares of the kernel's warp-state samples."""
    import csv

    rows = list(csv.reader(raw_csv.splitlines()))
    if len(rows) < 3:
        return ["(no kernels in the ncu export)"]
    head, units, data = rows[0], rows[1], rows[2:]  # raw pages: names, then units, then one row per kernel

    def num(v: str) -> float | None:
        try:
            return float(v.replace(",", ""))
        except ValueError:
            return None

    unit = dict(zip(head, units, strict=False))
    out = []
    for row in data:
        got = dict(zip(head, row, strict=False))
        parts = [got.get("Kernel Name", "?")[:40]]
        for key, label in SHOWN.items():
            v = num(got.get(key, ""))
            if v is not None and key == "gpu__time_duration.sum":
                v = v / {"nsecond": 1e3, "ns": 1e3, "usecond": 1.0, "us": 1.0, "msecond": 1e-3, "ms": 1e-3}.get(
                    unit.get(key, "nsecond"), 1e3)  # ncu 2025.3 writes "us"
            parts.append(f"{label} {v:.4g}" if v is not None else f"{label} -")
        stalls = {k[len(STALL):]: num(v) or 0.0 for k, v in got.items()
                  if k.startswith(STALL) and "not_issued" not in k}
        total = sum(stalls.values())
        if total > 0:
            best = sorted(stalls.items(), key=lambda kv: -kv[1])[:top]
            parts.append("stalls: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in best))
        out.append(" | ".join(parts))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="TINY shapes on the CPU interpreter (a smoke test)")
    ap.add_argument("--moe32", action="store_true", help="the swap-AB experts at 32 tokens only (module docstring)")
    ap.add_argument("--regs", action="store_true", help="with --moe32: kernels/w4a16_regs.py's calls too")
    ap.add_argument("--summarize", metavar="RAW_CSV", help="print `summarize`'s lines of an ncu --page raw --csv file")
    args = ap.parse_args(argv)
    if args.summarize:
        print("\n".join(summarize(Path(args.summarize).read_text())))
        return 0
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("decode_ncu: needs a CUDA GPU", file=sys.stderr)
        return 2
    c = TINY if args.tiny else FULL
    H, INTER, E, TOP_K, GDN_IN, GDN_OUT_K = (c[k] for k in ("H", "INTER", "E", "TOP_K", "GDN_IN", "GDN_OUT_K"))
    from benchmarks.random_packed import random_nvfp4
    from kernels import autotune_table, gdn_prep, moe_combine, paged_attention
    from kernels import w4a16_mma as mm
    from kernels.fp8_gemv import fp8_gemv_op
    from kernels.moe_router import _launch_gemv

    dev = torch.device("cpu" if args.tiny else "cuda")
    if not args.tiny:
        print(f"[decode_ncu] autotune picks loaded: {autotune_table.load_for_device(dev)}")
    gen = torch.Generator(device=dev).manual_seed(0)
    w13, w2 = random_nvfp4((E, 2 * INTER, H), dev, gen), random_nvfp4((E, H, INTER), dev, gen)
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16, generator=gen)
    idx = torch.randperm(E, device=dev, generator=gen)[:TOP_K][None]
    wts = torch.softmax(torch.randn(1, TOP_K, device=dev, generator=gen), -1).to(torch.bfloat16)
    w_in = (torch.randn(GDN_IN, H, device=dev, generator=gen) * 40).to(torch.float8_e4m3fn)
    w_out = (torch.randn(H, GDN_OUT_K, device=dev, generator=gen) * 40).to(torch.float8_e4m3fn)
    s_in, codes = torch.tensor(0.05, device=dev), (x.float() * 20).to(torch.float8_e4m3fn)
    xo = torch.randn(1, GDN_OUT_K, device=dev, dtype=torch.bfloat16, generator=gen)
    codes_o = (xo.float() * 20).to(torch.float8_e4m3fn)
    router_w = (torch.randn(E, H, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    dk = c["GDN_DK"]
    prep = gdn_prep.random_inputs_ba(1, 16, dk, 2, dk, hidden=H, dtype=torch.bfloat16, seed=1, device=dev)
    attn = paged_attention.random_inputs([c["CTX"]], 16, 2, c["ATTN_DH"], 16, dtype=torch.bfloat16, seed=2,
                                         device=dev)
    comb = moe_combine.random_inputs(1, H, dtype=torch.bfloat16, seed=3, device=dev)
    if args.moe32:
        return _moe32(args, dev, gen, w13, w2, H, INTER, E, TOP_K)
    for rep in range(args.repeat):
        last = rep == args.repeat - 1  # the earlier passes compile and tune; ncu profiles the last (NVTX "measure")
        if last and not args.tiny:
            torch.cuda.nvtx.range_push("measure")
        h = mm.w4a16_mma_launch(x, *w13, pair_expert=idx, a_div=TOP_K, swiglu=True)  # [8, 512]
        mm.w4a16_mma_launch(h, *w2, pair_expert=idx, row_scale=wts)  # [8, 2048]
        fp8_gemv_op(x, w_in, torch.rand(GDN_IN, device=dev) * 0.01, s_in, torch.bfloat16, codes=codes)
        fp8_gemv_op(xo, w_out, torch.rand(H, device=dev) * 0.01, s_in, torch.bfloat16, codes=codes_o)
        _launch_gemv(x, router_w, TOP_K)
        gdn_prep.gdn_decode_prep_ba_triton(prep[0], prep[1].clone(), *prep[2:])
        paged_attention.paged_decode_attention_triton(*attn)
        moe_combine.moe_combine_triton(*comb)
        if last and not args.tiny:
            torch.cuda.nvtx.range_pop()
    if not args.tiny:
        torch.cuda.synchronize()
    print("[decode_ncu] done")
    return 0


def _moe32(args, dev, gen, w13, w2, H: int, INTER: int, E: int, TOP_K: int, tokens: int = 32) -> int:
    """`--moe32`: the swap-AB gate_up and down at `tokens` tokens, `--repeat` passes, NVTX "measure" on the last."""
    import torch

    from kernels.w4a16_gemm import moe_align
    from kernels.w4a16_swapped import SPLIT_TILE, split_frag, swapped_block_m, w4a16_grouped_swapped_launch

    tile = SPLIT_TILE  # fragment order needs programs of 64 rows (TINY's 128 / 256 divide)
    w13f, w2f = split_frag(w13.packed, *tile), split_frag(w2.packed, *tile)
    idx = torch.stack([torch.randperm(E, device=dev, generator=gen)[:TOP_K] for _ in range(tokens)])
    routing = moe_align(idx, E, swapped_block_m(tokens * TOP_K, E))
    x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16, generator=gen)
    regs = []  # --regs: (routing, gate_up build, down build): the engine's, then the launcher's defaults
    if args.regs and not args.tiny:
        from kernels import w4a16_regs
        from kernels.w4a16_regs import thread_order, w4a16_regs_launch

        w13t, w2t = thread_order(w13.packed), thread_order(w2.packed)
        builds = w4a16_regs.ENGINE_BUILDS
        regs = [(moe_align(idx, E, w4a16_regs.BLOCK_M), builds["gate_up"], builds["down"]),
                (moe_align(idx, E, 16), {}, {})]
    for rep in range(args.repeat):
        last = rep == args.repeat - 1
        if last and not args.tiny:
            torch.cuda.nvtx.range_push("measure")
        h = w4a16_grouped_swapped_launch(x, w13f, w13.scales, w13.global_scale, routing, a_div=TOP_K, swiglu=True,
                                         frag=True, block_n=tile[0])  # [tokens x top-k, INTER]
        w4a16_grouped_swapped_launch(h, w2f, w2.scales, w2.global_scale, routing, frag=True, block_n=tile[0])
        for r, gate_up, down in regs:
            hr = w4a16_regs_launch(x, w13t, w13.scales, w13.global_scale, r, a_div=TOP_K, swiglu=True, **gate_up)
            w4a16_regs_launch(hr, w2t, w2.scales, w2.global_scale, r, **down)
        if last and not args.tiny:
            torch.cuda.nvtx.range_pop()
    if not args.tiny:
        torch.cuda.synchronize()
    print(f"[decode_ncu] done (moe32: {tokens} tokens, {INTER} x {H}{', with w4a16_regs' if regs else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
