"""Does the GDN step's state write-back slow the experts' gate_up that follows it? In the 32-stream engine trace
(forty-eighth session, H100) gate_up ran ~81.5 us after a GDN layer and ~76 after a full-attention one. The GDN
step (`kernels/gdn_decode.py`) reads and writes a 64 MB fp32 state a layer at 32 sequences, more than the L2; the
dirty lines it leaves there are written back to DRAM when gate_up's weight stream evicts them. This measures, per
call (CUDA-graph replays, PDL as the engine launches them):

  - gate_up alone (the register kernel's ENGINE_BUILDS, 32 tokens, top-8 of 256, 4 routings), the GDN step alone;
  - the pair [GDN step, gate_up] for each store hint of the state (`gdn_decode.STATE_STORE`: Triton's default,
    `.cs` streaming, `.wt` write-through, `.cg`, `evict_first`), excess = pair - step alone - gate_up alone;
  - the pair with ~25 us of latency-bound work between them (a `torch.cuda._sleep` spin, the time of the small
    kernels between the two in the engine): is the write-back lazy (still inside gate_up) or done in the gap?
  - the pair on a bf16 state pool (`gdn_state_dtype: bfloat16`, 32 MB).

Four state pools (one per routing, like the engine's per-layer pools: none in L2 when its step starts); random
values, speed does not depend on them.

    python benchmarks/l2_writeback_bench.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HINTS = [("", ""), (".cs", ""), (".wt", ""), (".cg", ""), ("", "evict_first")]  # (cache modifier, eviction policy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gap-us", type=float, default=25.0)
    args = ap.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("l2_writeback_bench needs a CUDA GPU")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_timing import graph_per_call_us
    from random_packed import random_nvfp4

    from kernels import gdn_decode, pdl, w4a16_regs
    from kernels.w4a16_gemm import moe_align
    from kernels.w4a16_regs import ENGINE_BUILDS, fit_build, thread_order, w4a16_regs_launch

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    pdl.set_enabled(pdl.device_supports())
    w13 = random_nvfp4((256, 1024, 2048), dev, gen)
    w13t = thread_order(w13.packed)
    build = fit_build({**ENGINE_BUILDS["gate_up"], "early": False}, 2048, 512)
    step_in = gdn_decode.random_inputs(32, 32, 128, 128, device=dev)[:5]  # q, k, v, g, beta of 32 decode rows
    rows = torch.arange(32, device=dev)
    ups, pools = [], {}
    for _ in range(4):
        idx = torch.stack([torch.randperm(256, device=dev, generator=gen)[:8] for _ in range(32)])
        x = torch.randn(32, 2048, device=dev, generator=gen).to(torch.bfloat16)
        ups.append(lambda r=moe_align(idx, 256, w4a16_regs.BLOCK_M), x=x: w4a16_regs_launch(
            x, w13t, w13.scales, w13.global_scale, r, a_div=8, swiglu=True, **build))
    for dtype in (torch.float32, torch.bfloat16):  # 4 pools of 33 rows (32 sequences + the scratch row) each
        pools[dtype] = [torch.randn(33, 32, 128, 128, device=dev, generator=gen).to(dtype) for _ in range(4)]

    def steps(dtype, hint):
        def call(pool):
            gdn_decode.STATE_STORE = hint  # read at launch, so each captured launch keeps its own hint
            try:
                gdn_decode.gdn_decode_rows_(*step_in, pool, rows)
            finally:
                gdn_decode.STATE_STORE = ("", "")
        return [lambda p=p: call(p) for p in pools[dtype]]

    # a spin of ~gap_us at ~1.8 GHz (the SM clock varies by GPU: its measured time is reported and subtracted)
    gap = lambda: torch.cuda._sleep(int(args.gap_us * 1.8e3))  # noqa: E731

    def timed(name, calls, per, **extra):
        us = graph_per_call_us(calls * 5) * len(calls) / per  # us per [pattern] (per = patterns in calls)
        row = dict(case=name, us=round(us, 2), **extra)
        rows_out.append(row)
        print("[l2_writeback_bench]", json.dumps(row), flush=True)
        return us

    rows_out: list[dict] = []
    up = timed("gate_up alone", ups, 4)
    sleep = timed("gap alone", [gap] * 4, 4)
    for dtype in (torch.float32, torch.bfloat16):
        dname = str(dtype).removeprefix("torch.")
        for hint in HINTS if dtype == torch.float32 else HINTS[:1]:
            hname = "+".join(h for h in hint if h) or "default"
            st = timed(f"GDN step alone ({dname}, {hname})", steps(dtype, hint), 4)
            pair = [c for s, u in zip(steps(dtype, hint), ups) for c in (s, u)]
            pu = timed(f"[step, gate_up] ({dname}, {hname})", pair, 4)
            rows_out[-1]["excess_us"] = round(pu - st - up, 2)
            gapped = [c for s, u in zip(steps(dtype, hint), ups) for c in (s, gap, u)]
            pg = timed(f"[step, gap, gate_up] ({dname}, {hname})", gapped, 4, hint=list(hint))
            rows_out[-1]["excess_us"] = round(pg - st - sleep - up, 2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                pdl=pdl.enabled(), gap_us=args.gap_us, gate_up_build=build)
    (out / "l2_writeback_bench.json").write_text(json.dumps(dict(meta=meta, results=rows_out), indent=1, default=str))
    md = [f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, PDL {meta['pdl']}", "",
          "| case | us | excess us |", "|---|---:|---:|"]
    md += [f"| {r['case']} | {r['us']} | {r.get('excess_us', '')} |" for r in rows_out]
    (out / "l2_writeback_bench.md").write_text("\n".join(md) + "\n")
    # the fp32 hint whose [step, gap, gate_up] is fastest, as qwen_gpu.py --gdn-state-store takes it
    gapped = [r for r in rows_out if r["case"].startswith("[step, gap, gate_up] (float32")]
    best = min(gapped, key=lambda r: r["us"])["hint"]
    (out / "best_store.txt").write_text(",".join(best) + "\n")
    print("[l2_writeback_bench] best", best, flush=True)


if __name__ == "__main__":
    main()
