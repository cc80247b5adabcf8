"""Is the swap-AB kernel (`kernels/w4a16_swapped.py`) deterministic on this GPU? The same call repeated on the same
inputs must give the same bits (no atomics; split 1). benchmarks/lm_head_check.py found ~1% of full-size lm_head
calls (NVFP4 [248,320, 2048], fragment order, 20-28 rows) differing from a repeat in 1-2 groups of 8 consecutive
output columns, with PDL on and off (2026-12-03). This script bisects that across the kernel's switches, and runs
the engine's MoE expert shapes the same way.

    python benchmarks/swapped_race.py --out benchmarks/results/swapped_race      # GPU; ~1-2 min

Each case: one reference call, then `--calls` repeats compared bit for bit; reports how many repeats differed and
the first differing output columns. Random weights (values change no control flow or timing).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/swapped_race")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--lm-head-options", action="store_true",
                    help="instead: the lm_head op's candidate settings for 17-32 rows (block_m 16 / 32 / 64, stages, "
                         "dequant mode), each checked for repeats (rows 24, 32) and timed per call in CUDA graphs")
    ap.add_argument("--configs", default="32:3:2,16:3:2,64:3:2,32:2:2,32:3:1,16:2:2",
                    help="with --lm-head-options: BLOCK_M:stages:DEQ settings, ':s' appended: SETTLE (16-row blocks run "
                         "1 / 8 / 16 rows)")
    ap.add_argument("--experts-stages", default="",
                    help="instead: the engine's expert calls (--experts-tokens) at these stages, e.g. 3,2,3s ('s': "
                         "SETTLE): each "
                         "timed per call in CUDA graphs and repeated --calls times (run 43 found 2 of 30,000 down "
                         "calls differing at the default 3)")
    ap.add_argument("--experts-tokens", type=int, default=32,
                    help="with --experts-stages: tokens per call (rows per block as the engine picks them: 16 up to "
                         "16 pairs per expert, else 64)")
    args = ap.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("swapped_race needs a CUDA GPU")
    from random_packed import random_nvfp4

    from kernels import pdl
    from kernels.w4a16_gemm import moe_align
    from kernels.w4a16_swapped import (SPLIT_TILE, dense_routing, split_frag, split_halves, swapped_block_m,
                                       w4a16_grouped_swapped_launch)

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    t_end = time.perf_counter() + args.budget_s

    def rand_w(e, n, k):
        return random_nvfp4((e, n, k), dev, gen)

    @functools.cache
    def engine_experts():
        """The engine's experts, drawn at first use: gate_up [256, 1024, 2048] with SwiGLU, down [256, 2048, 512] ->
        (w13, w2, their fragment-order bytes)."""
        w13, w2 = rand_w(256, 1024, 2048), rand_w(256, 2048, 512)
        return w13, w2, split_frag(w13.packed, *SPLIT_TILE), split_frag(w2.packed, *SPLIT_TILE)

    def expert_calls(tokens: int, bm: int, config: dict | None = None, settle: bool = True) -> list:
        """The engine's two routed calls at `tokens` (top-8 of 256, `bm` rows per block) -> [(name, call)]."""
        w13, w2, w13f, w2f = engine_experts()
        idx = torch.stack([torch.randperm(256, device=dev, generator=gen)[:8] for _ in range(tokens)])
        routing = moe_align(idx, 256, bm)
        x = torch.randn(tokens, 2048, device=dev, generator=gen).to(torch.bfloat16)
        h = torch.randn(tokens * 8, 512, device=dev, generator=gen).to(torch.bfloat16)
        kw = dict(frag=True, config=config, unverified=config is not None or not settle, settle=settle)
        return [("experts gate_up (SwiGLU)", lambda: w4a16_grouped_swapped_launch(
                    x, w13f, w13.scales, w13.global_scale, routing, a_div=8, swiglu=True, **kw)),
                ("experts down", lambda: w4a16_grouped_swapped_launch(
                    h, w2f, w2.scales, w2.global_scale, routing, **kw))]

    def save(name: str, payload) -> None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(payload, indent=1))

    def repeat(fn) -> dict:
        ref = fn()
        torch.cuda.synchronize()
        bad, cols = 0, []
        for _ in range(args.calls):
            y = fn()
            if not torch.equal(y, ref):
                bad += 1
                if len(cols) < 4:
                    c = (y != ref).any(0).nonzero().flatten()
                    cols.append(dict(n=int(c.numel()), first=c[:10].tolist(),
                                     rows=(y != ref).any(1).nonzero().flatten()[:8].tolist()))
        torch.cuda.synchronize()
        return dict(differing_calls=bad, calls=args.calls, samples=cols)

    results = []
    lm = rand_w(1, 248_320, 2048)
    if args.lm_head_options:
        from cuda_timing import graph_per_call_us

        pdl.set_enabled(pdl.device_supports())
        lm_frag = split_frag(lm.packed, *SPLIT_TILE)
        for spec in args.configs.split(","):
            bm, stages, deq = (int(v) for v in spec.split(":")[:3])
            settle = spec.endswith(":s")
            row = dict(block_m=bm, stages=stages, deq=deq, settle=settle, pdl=pdl.enabled())
            for rows in ((17, 24, 32) if bm >= 32 else (1, 8, 16)):
                xs = [torch.randn(rows, 2048, device=dev, generator=gen).to(torch.bfloat16) for _ in range(10)]

                def call(x, rows=rows):
                    return w4a16_grouped_swapped_launch(x, lm_frag, lm.scales, lm.global_scale,
                                                        dense_routing(rows, bm), frag=True, deq=deq,
                                                        config=dict(num_warps=4, num_stages=stages), unverified=True,
                                                        settle=settle)
                row[f"us_{rows}"] = graph_per_call_us([lambda x=x: call(x) for x in xs])
                if rows not in (17, 8):  # repeats at 24 and 32 rows (1 and 16 for 16-row blocks)
                    row[f"differing_{rows}"] = repeat(lambda: call(xs[0]))["differing_calls"]
            results.append(row)
            print("[swapped_race]", json.dumps(row), flush=True)
        save("lm_head_options.json", results)
        return
    if args.experts_stages:
        from cuda_timing import graph_per_call_us

        pdl.set_enabled(pdl.device_supports())
        tokens = args.experts_tokens
        bm = swapped_block_m(tokens * 8, 256)
        for spec in args.experts_stages.split(","):
            stages, settle = int(spec.rstrip("s")), spec.endswith("s")
            for name, fn in expert_calls(tokens, bm, dict(num_warps=4, num_stages=stages), settle):
                r = dict(case=name, tokens=tokens, block_m=bm, stages=stages, settle=settle, pdl=pdl.enabled(),
                         us=graph_per_call_us([fn] * 20))
                r.update(repeat(fn))
                results.append(r)
                print("[swapped_race]", json.dumps(r), flush=True)
        save("experts_stages.json", results)
        return
    lm_frag, lm_halves = split_frag(lm.packed, *SPLIT_TILE), split_halves(lm.packed, *SPLIT_TILE)
    cases = []  # (name, rows, block_m, frag, deq, warps, stages, pdl)
    for pdl_on in (True, False):
        cases.append(("lm_head frag, 3 stages (the op's until 2026-12-03)", 24, 32, True, 2, 4, 3, pdl_on))
    cases += [("lm_head frag bm16", 24, 16, True, 2, 4, 3, False),
              ("lm_head halves (no frag)", 24, 32, False, 2, 4, 3, False),
              ("lm_head frag deq1", 24, 32, True, 1, 4, 3, False),
              ("lm_head frag 2 stages", 24, 32, True, 2, 4, 2, False),
              ("lm_head frag 1 stage", 24, 32, True, 2, 4, 1, False),
              ("lm_head frag 8 rows", 8, 16, True, 2, 4, 3, False)]
    for name, rows, bm, frag, deq, warps, stages, pdl_on in cases:
        if time.perf_counter() > t_end:
            break
        pdl.set_enabled(pdl_on and pdl.device_supports())
        x = torch.randn(rows, 2048, device=dev, generator=gen).to(torch.bfloat16)
        routing = dense_routing(rows, bm)
        packed = lm_frag if frag else lm_halves
        r = repeat(lambda: w4a16_grouped_swapped_launch(
            x, packed, lm.scales, lm.global_scale, routing, frag=frag, deq=deq,
            config=dict(num_warps=warps, num_stages=stages), unverified=True, settle=False))  # the race's bisection
        r.update(case=name, rows=rows, block_m=bm, frag=frag, deq=deq, warps=warps, stages=stages, pdl=pdl.enabled())
        results.append(r)
        print("[swapped_race]", json.dumps(r), flush=True)

    # the engine's experts at their launch defaults (`default_stages`, SETTLE)
    pdl.set_enabled(pdl.device_supports())
    for tokens, bm in ((32, 16), (1024, 64)):
        if time.perf_counter() > t_end:
            break
        for name, fn in expert_calls(tokens, bm):
            r = repeat(fn)
            r.update(case=name, tokens=tokens, block_m=bm, pdl=pdl.enabled())
            results.append(r)
            print("[swapped_race]", json.dumps(r), flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    save("swapped_race.json", dict(meta=meta, results=results))


if __name__ == "__main__":
    main()
