"""lm_head at full size (NVFP4 [248,320, 2048]: 286 MB of packed weights + block scales) per decode step, 1-32 rows:
the engine's path (the CUDA-core GEMV at one row, `kernels/w4a16_gemv.py`; the dense tensor-core kernel of
`kernels/w4a16_gemm.py` above) beside the swap-AB kernel (`kernels/w4a16_swapped.py`, weights in fragment order) run
as a one-expert grouped call (`w4a16_swapped.dense_routing`), at a few of its tiles.

    python benchmarks/lm_head_bench.py --out benchmarks/results/lm_head_bench      # GPU; ~1-2 min
    python benchmarks/lm_head_bench.py --rows 1,4 --sweep "" --mma                # the engine's lm_head beside MMA

Why. Profiles put lm_head at ~204 us of a ~2.7 ms lone decode step (1.4 TB/s) and ~0.39 ms of a 32-stream step
(0.7 TB/s); the GEMV's K loop issues ~10.5 instructions per weight (offline sm_90 SASS), which alone bounds it near
~160 us, and the swap-AB kernel's loop ~4.4-5 (the MMA does the multiply-adds).

Random packed weights in the checkpoint's layout (speed does not depend on the values), 10 calls per CUDA graph
(`cuda_timing.graph_per_call_us`), PDL as the engine launches it on Hopper. Each row also reports the largest
difference of the swap-AB output from the engine path's, relative to the latter's max |y| (bf16 rounding level: the
two sum in different orders), and TB/s over the packed bytes + block scales.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/lm_head_bench")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--sweep", default="64:3,128:3,128:4,256:3,64:4",
                    help="swap-AB BLOCK_N:num_stages tiles timed at every row count (4 warps)")
    ap.add_argument("--mma", action="store_true",
                    help="also the engine's Hopper lm_head (w4a16_linear_frag: the swap-AB kernel on linear_to_frag "
                         "bytes, its own tile and stages) and the tensor-core decode GEMV (kernels/w4a16_mma.py, "
                         "<= 8 rows, autotuned: the registry's triton_mma_wide for lm_head_layout checkpoint)")
    args = ap.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("lm_head_bench needs a CUDA GPU")
    from cuda_timing import graph_per_call_us
    from random_packed import random_nvfp4

    from kernels import pdl
    from kernels.w4a16_gemm import w4a16_linear_triton
    from kernels.w4a16_gemv import w4a16_linear_gemv
    from kernels.w4a16_mma import MMA_MAX_ROWS, w4a16_mma_launch
    from kernels.w4a16_swapped import (SPLIT_TILE, dense_routing, linear_to_frag, split_frag,
                                       w4a16_grouped_swapped_launch, w4a16_linear_frag_triton)

    pdl.set_enabled(pdl.device_supports())
    dev, n, k, calls = torch.device("cuda"), args.vocab, args.hidden, 10
    gen = torch.Generator(device=dev).manual_seed(0)
    w = random_nvfp4((n, k), dev, gen)
    frag = split_frag(w.packed[None], *SPLIT_TILE)  # [1, N, K/2]
    w_frag = linear_to_frag(w) if args.mma else None  # the engine's split_frag lm_head (lm_head_layout auto, Hopper)
    nbytes = n * k // 2 + n * k // 16
    rows_out = []
    for t in (int(v) for v in args.rows.split(",")):
        xs = [torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16) for _ in range(calls)]
        engine = w4a16_linear_gemv if t == 1 else w4a16_linear_triton
        block_m = 16 if t <= 16 else 32
        routing = dense_routing(t, block_m)

        def swapped(x, bn=SPLIT_TILE[0], stages=3):
            return w4a16_grouped_swapped_launch(x, frag, w.scales[None], w.global_scale[None], routing, frag=True,
                                                config=dict(BLOCK_N=bn, num_warps=4, num_stages=stages),
                                                unverified=True)  # the sweep times 3-4 stages at 32 rows too

        ref = engine(xs[0], w).float()
        got = swapped(xs[0]).float()
        row = dict(rows=t, engine_path="gemv" if t == 1 else "tensor-core dense", block_m=block_m,
                   swapped_vs_engine_rel=float((got - ref).abs().max() / ref.abs().max()))
        row["engine_us"] = graph_per_call_us([lambda x=x: engine(x, w) for x in xs])
        row["engine_TBps"] = nbytes / (row["engine_us"] * 1e-6) / 1e12
        if args.mma:  # the engine's two candidates for a lone step's lm_head, each against the engine path
            paths = [("frag", lambda x: w4a16_linear_frag_triton(x, w_frag))]
            if t <= MMA_MAX_ROWS:
                paths.append(("mma", lambda x: w4a16_mma_launch(x, *w)))
            for label, fn in paths:
                row[f"{label}_vs_engine_rel"] = float((fn(xs[0]).float() - ref).abs().max() / ref.abs().max())
                row[f"{label}_us"] = graph_per_call_us([lambda x=x, fn=fn: fn(x) for x in xs])
                row[f"{label}_TBps"] = nbytes / (row[f"{label}_us"] * 1e-6) / 1e12
        for spec in (v for v in args.sweep.split(",") if v):
            bn, stages = (int(u) for u in spec.split(":"))
            us = graph_per_call_us([lambda x=x: swapped(x, bn, stages) for x in xs])
            row[f"swapped_us[{spec}]"] = us
            row[f"swapped_TBps[{spec}]"] = nbytes / (us * 1e-6) / 1e12
        rows_out.append(row)
        print("[lm_head_bench]", json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                pdl=pdl.enabled(), vocab=n, hidden=k, bytes=nbytes)
    (out / "lm_head_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows_out), indent=1))
    print("[lm_head_bench]", json.dumps(meta))


if __name__ == "__main__":
    main()
