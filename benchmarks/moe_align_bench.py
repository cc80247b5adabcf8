"""The one-program Triton `moe_align` (`kernels/moe_align.py`) per call at decode sizes, by warps per program, beside
the torch version. At 32 streams (P = 256 pairs, E = 256, BLOCK_M 16): 3.3 us per call with the sorted kernel
against 26.1 us for the removed compare-tile version in the same run (results/moe_align_bench_run2), 40 calls per
decode step.

    python benchmarks/moe_align_bench.py --out benchmarks/results/moe_align_bench     # GPU; ~30 s

One CUDA graph of 40 calls (each its own random top-8 routing), replayed; us per call = replay time / 40 (median
of 5). Every Triton result is checked against the torch version (bit-equal).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/moe_align_bench")
    ap.add_argument("--tokens", default="1,4,8,16,32,64,128")
    ap.add_argument("--warps", default="4,8")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("moe_align_bench needs a CUDA GPU")
    from cuda_timing import graph_per_call_us  # benchmarks/ (the script's directory) is on sys.path
    from kernels import moe_align as align
    from kernels.w4a16_gemm import moe_align
    from kernels.w4a16_swapped import swapped_block_m

    dev, e, top_k, calls = torch.device("cuda"), 256, 8, 40
    gen = torch.Generator(device=dev).manual_seed(0)

    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        idx = [torch.stack([torch.randperm(e, device=dev, generator=gen)[:top_k] for _ in range(t)])
               for _ in range(calls)]
        bm = swapped_block_m(t * top_k, e)
        row = dict(tokens=t, pairs=t * top_k, block_m=bm)
        for w in (int(v) for v in args.warps.split(",")):
            sp, be = align.moe_align_triton(idx[0], e, bm, num_warps=w)
            ref = moe_align(idx[0], e, bm)
            row[f"ok_{w}"] = bool(torch.equal(sp, ref.sorted_pairs) and torch.equal(be, ref.block_expert))
            row[f"triton_{w}_warps_us"] = graph_per_call_us(
                [lambda i=i, w=w: align.moe_align_triton(idx[i], e, bm, num_warps=w) for i in range(calls)])
        row["torch_us"] = graph_per_call_us([lambda i=i: moe_align(idx[i], e, bm) for i in range(calls)])
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__)
    (out / "moe_align_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    keys = [k for k in rows[0] if k.endswith("_us")]
    lines = [f"# moe_align_bench ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})", "",
             "| tokens | pairs | BLOCK_M | " + " | ".join(keys) + " | all equal |", "|" + "---:|" * (len(keys) + 4)]
    for r in rows:
        ok = all(v for k, v in r.items() if k.startswith("ok_"))
        cells = " | ".join(f"{r[k]:.2f}" for k in keys)
        lines.append(f"| {r['tokens']} | {r['pairs']} | {r['block_m']} | {cells} | {ok} |")
    (out / "moe_align_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
