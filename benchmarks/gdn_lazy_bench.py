"""The GDN decode step on the lazy state (`kernels/gdn_decode_lazy.py`, `QwenEngineConfig.gdn_lazy_rank`) beside the
plain step (`kernels/gdn_decode.py` "gdn_decode_rows"), per token, at the engine's shapes: Qwen3.6's 32 value heads
of 128 x 128 fp32 state, B decode rows of a pool of B + 1, CUDA-graph replays with PDL as the engine launches them.

A lazy row writes its state on one token in R (its fold), so a call's cost depends on where the rows are in their
windows: each case replays R consecutive tokens, a positions tensor advancing on the device after each (so the folds
keep their rhythm across replays; the plain step is timed with the same increments, and the increment alone is
reported), the rows' folds aligned (every row on the same token, as the benchmark's equal 1k prompts have them) or
staggered over the R tokens (as sequences of different lengths have them); us per token. In the aligned case every
token's o over 2R tokens is first compared with the plain step's on the same inputs (max relative error: the lazy
form is the same recurrence in another fp32 order). Random values; speed does not depend on them.

    python benchmarks/gdn_lazy_bench.py --out DIR [--rows 1,8,32,64] [--ranks 4,8,16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--ranks", default="4,8,16")
    ap.add_argument("--launches", default="auto,32x4,64x4,64x4x168,64x8,16x4",
                    help="BLOCK_VxWARPS[xMAXNREG] of the lazy kernel (auto: gdn_decode's column rule, 4 warps, "
                         "ptxas' registers)")
    ap.add_argument("--heads", type=int, default=32, help="value heads (Qwen3.6: 32)")
    ap.add_argument("--device", default="cuda",
                    help="cpu: a dry run of the bench's logic under TRITON_INTERPRET=1 (small --heads; the calls run "
                         "once eagerly, the 'us' are host wall time, not kernel time)")
    args = ap.parse_args()
    import torch
    import triton

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gdn_lazy_bench needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1: a dry run)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_timing import graph_per_call_us

    if dev.type != "cuda":
        def graph_per_call_us(calls, replays=5):  # noqa: F811 -- the dry run's stand-in: each call once, eagerly
            t0 = time.perf_counter()
            for c in calls:
                c()
            return (time.perf_counter() - t0) * 1e6 / len(calls)

    from kernels import gdn_decode_lazy, pdl
    from kernels.gdn_decode import gdn_decode_rows_, random_inputs
    from kernels.gdn_decode_lazy import gdn_decode_lazy_, random_lazy_state

    pdl.set_enabled(dev.type == "cuda" and pdl.device_supports())
    heads, dk, dv = args.heads, 128, 128
    results = []
    for b in [int(v) for v in args.rows.split(",")]:
        slots = b + 1
        rows = torch.randperm(slots, device=dev)[:b].contiguous()
        steps = [random_inputs(b, heads, dk, dv, seed=s, device=dev)[:5] for s in range(16)]
        pool = torch.randn(slots, heads, dk, dv, device=dev) * 0.5
        plain_pool = pool.clone()
        # every token also advances a positions tensor on the device (the lazy step's fold points move with it,
        # across graph replays too); the plain step is timed with the same increments, so both carry their cost
        pos_t = torch.zeros(b, dtype=torch.int64, device=dev)
        tick = lambda: pos_t.add_(1)  # noqa: E731
        plain = [c for x in steps for c in (lambda x=x: gdn_decode_rows_(*x, plain_pool, rows), tick)]
        plain_us = graph_per_call_us(plain) * 2
        mb = b * heads * dk * dv * 4 * 2 / 1e6
        results.append(dict(rows=b, kernel="plain", us=round(plain_us, 2), mb_per_token=round(mb, 1),
                            tb_s=round(mb / plain_us / 1e6, 3)))
        print("[gdn_lazy_bench]", json.dumps(results[-1]), flush=True)
        for rank in [int(v) for v in args.ranks.split(",")]:
            for launch in args.launches.split(","):
                bv, warps, *cap = (None, 4) if launch == "auto" else map(int, launch.split("x"))
                gdn_decode_lazy.LAUNCH_BLOCK_V, gdn_decode_lazy.NUM_WARPS = bv, warps
                gdn_decode_lazy.MAXNREG = cap[0] if cap else None
                for stagger in (False, True):
                    lazy = random_lazy_state(slots, heads, dk, dv, rank, device=dev)
                    lazy[0].copy_(pool)
                    pos_t.fill_(1024)
                    # aligned: no pending term (every row folds on the same token, as equal prompts do); staggered:
                    # row i starts with i % R pending (random) terms, so the rows' folds spread over the R tokens
                    pending = torch.arange(b, device=dev) % rank if stagger else torch.zeros_like(pos_t)
                    lazy[1][rows] = (1023 - pending).to(torch.int32)[:, None, None]
                    worst = None
                    if not stagger:  # correctness, eagerly, beside the plain step from the same state
                        ref_pool, worst = pool.clone(), 0.0
                        for t in range(2 * rank):
                            want = gdn_decode_rows_(*steps[t % len(steps)], ref_pool, rows)
                            got = gdn_decode_lazy_(*steps[t % len(steps)], *lazy, rows, pos_t,
                                                   gdn_decode_lazy.FOLD_BELOW_ROWS)
                            tick()
                            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
                    calls = [c for t in range(rank) for c in (lambda x=steps[t % len(steps)]: gdn_decode_lazy_(
                        *x, *lazy, rows, pos_t, gdn_decode_lazy.FOLD_BELOW_ROWS), tick)]
                    row = dict(rows=b, kernel="lazy", rank=rank, launch=launch, stagger=stagger,
                               folds_every=1 if b < gdn_decode_lazy.FOLD_BELOW_ROWS else rank)
                    try:
                        us = graph_per_call_us(calls * 2) * 2  # us per token (a step and its tick)
                        row.update(us=round(us, 2), vs_plain=round(us / plain_us, 4), max_rel_err=worst)
                    except Exception as exc:  # noqa: BLE001 -- a launch that fails to compile is a result
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    results.append(row)
                    print("[gdn_lazy_bench]", json.dumps(row), flush=True)
        gdn_decode_lazy.LAUNCH_BLOCK_V, gdn_decode_lazy.NUM_WARPS, gdn_decode_lazy.MAXNREG = None, 4, None
        tick_us = graph_per_call_us([tick] * 16)
        results.append(dict(rows=b, kernel="tick alone (in both rows above)", us=round(tick_us, 2)))
        print("[gdn_lazy_bench]", json.dumps(results[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)",
                torch=torch.__version__, triton=triton.__version__,
                pdl=pdl.enabled(), fold_below=gdn_decode_lazy.FOLD_BELOW_ROWS)
    (out / "gdn_lazy_bench.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    md = [f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, PDL {meta['pdl']}", "",
          "| rows | kernel | rank | launch | staggered | us a token | vs plain | max rel err |",
          "|---:|---|---:|---|---|---:|---:|---:|"]
    for r in results:
        err = f"{r['max_rel_err']:.1e}" if r.get("max_rel_err") is not None else ""
        md.append(f"| {r['rows']} | {r['kernel']} | {r.get('rank', '')} | {r.get('launch', '')} | "
                  f"{r.get('stagger', '')} | {r.get('us', r.get('error', ''))} | {r.get('vs_plain', '')} | {err} |")
    (out / "gdn_lazy_bench.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
