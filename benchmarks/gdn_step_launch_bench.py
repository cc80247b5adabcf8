"""The plain GDN decode step's launch (`kernels/gdn_decode.py` `_gdn_decode_kernel` over pool rows, as the engine
runs it) swept per token a layer: state columns a program (BLOCK_V 16 / 32 / 64), warps (2 / 4 / 8) and a register
cap (none / 128 / 168), at 1, 8, 32 and 64 rows of a 32-head, 128 x 128 fp32 state pool. The step is the 32-stream
decode step's second cost after the experts (H200, fifty-first session: 39.2 us a layer, 1.18 of 7.28 ms; 134 MB
read + written a layer = 3.4 TB/s of the H200's 4.8), and its launch (`_block_v`: 64 columns from 264 programs, 4
warps, ptxas' registers: 164 at 64 columns, 3 programs an SM) was never swept on a GPU.

Each launch's outputs (o and the advanced pool rows) are compared with the default launch's on the same inputs: the
tile shape and the warps can reorder tl.sum over Dk, so they agree to ~1e-7, not always bit for bit (reported as the
max abs difference). Timing: CUDA-graph replays of 4 launches on 4 pools (the engine's per-layer pools; at 32 rows
and more the 4 pools exceed the L2, at 1 row they fit in it), PDL on as the engine launches them. Random values:
speed does not depend on them.

    python benchmarks/gdn_step_launch_bench.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROWS = (1, 8, 32, 64)
LAUNCHES = [(bv, w, reg) for bv in (16, 32, 64) for w in (2, 4, 8) for reg in (None, 128, 168)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = ap.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("gdn_step_launch_bench needs a CUDA GPU")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_timing import graph_per_call_us

    from kernels import gdn_decode, pdl

    dev = torch.device("cuda")
    pdl.set_enabled(pdl.device_supports())
    heads, dk, dv = 32, 128, 128
    out_rows = []

    for n in [int(r) for r in args.rows.split(",")]:
        q, k, v, g, beta, _ = gdn_decode.random_inputs(n, heads, dk, dv, device=dev)
        gen = torch.Generator(device=dev).manual_seed(n)
        pools = [torch.randn(n + 1, heads, dk, dv, device=dev, generator=gen) * 0.5 for _ in range(4)]
        rows = torch.arange(n, device=dev)

        def launch(pool, bv, warps, reg):  # the engine's op's launcher with the launch set (in place on pool rows)
            return gdn_decode._launch(q, k, v, g, beta, pool, pool, rows, block_v=bv, num_warps=warps, maxnreg=reg)

        default_bv = gdn_decode._block_v(n * heads, dv)
        base_pool = pools[0].clone()
        ref_pool = base_pool.clone()
        ref_o = launch(ref_pool, default_bv, 4, None)
        default_us = None
        for i, (bv, warps, reg) in enumerate([(default_bv, 4, None)] + LAUNCHES):  # row 0: the default launch
            p = base_pool.clone()
            try:
                o = launch(p, bv, warps, reg)
                torch.cuda.synchronize()
                diff = max((o - ref_o).abs().max().item(), (p - ref_pool).abs().max().item())
                us = graph_per_call_us([lambda pl=pl: launch(pl, bv, warps, reg) for pl in pools] * 5)
            except Exception as exc:  # noqa: BLE001 - reported per launch
                out_rows.append(dict(rows=n, block_v=bv, warps=warps, maxnreg=reg, error=str(exc)[:200]))
                print("[gdn_step_launch_bench]", json.dumps(out_rows[-1]), flush=True)
                if i == 0:  # no default to compare with: the next row count
                    break
                continue
            if i == 0:
                default_us = us
            row = dict(rows=n, block_v=bv, warps=warps, maxnreg=reg, us=round(us, 2),
                       vs_default=round(us / default_us, 4), max_abs_diff=diff, default=i == 0)
            out_rows.append(row)
            print("[gdn_step_launch_bench]", json.dumps(row), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_step_launch_bench.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                                    torch=torch.__version__,
                                                                    triton=triton.__version__, rows=out_rows),
                                                               indent=1))
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, PDL "
             f"{pdl.launch_options() != {}}", "", "| rows | BLOCK_V | warps | maxnreg | us a layer | vs default | "
             "max abs diff |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out_rows:
        lines.append(f"| {r['rows']} | {r['block_v']} | {r['warps']} | {r['maxnreg'] or ''} | {r.get('us', 'error')} | "
                     f"{r.get('vs_default', '')} | {r.get('max_abs_diff', r.get('error', ''))} |")
    (out / "gdn_step_launch_bench.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
