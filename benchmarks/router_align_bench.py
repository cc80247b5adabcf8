"""A MoE layer's routing at decode sizes, per call, as the engine runs it: F.linear then either `router_topk` +
`moe_align` (two launches: the default) or `router_topk_align` (one launch: `kernels/router_align.py`, the
engine's `router_align` option), beside each other on the same inputs.

    python benchmarks/router_align_bench.py --out benchmarks/results/router_align_bench     # GPU; ~30 s

One CUDA graph of 40 calls (each on its own router weight copy and hidden rows: 40 MoE layers), replayed; us per call
= replay time / 40 (median of 5), with programmatic dependent launch off and on (`kernels/pdl.py`; the engine's
default on Hopper). The shape is Qwen3.6's: H 2048, E 256 routed experts + the shared expert as the 257th pair
(`shared_expert_in_moe`), top-8, at the register kernel's 8-row blocks (`w4a16_regs.BLOCK_M`). The fused kernel at
each of `--warps` (1: router_topk's tiling at 256 experts, what the engine launches; its last program builds the
alignment on those warps). Every fused result is checked against the two launches' (weights, ids and alignment bit
for bit: the same selection code, and the alignment is a function of the ids).

`--parts` (the engine's default router since the fifty-second session, `router_parts`): the router GEMM in Triton
instead of F.linear -- "router_linear_topk" (the GEMM, the top-k over its partials) + `moe_align` (three launches,
what the engine runs) against "router_linear_topk_align" (the GEMM, then the top-k + alignment over the partials:
two), the logits compared too; `--early` turns early loads on (kernels/pdl.py set_early, the engine's default) for
the PDL rows; `--gather 0,1` times the fused kernel's last program in both forms (`router_align.GATHER`: register
gathers, columns fused_*_gather; the reload form's keep their names):

    python benchmarks/router_align_bench.py --parts --early --tokens 32 --out benchmarks/results/router_align_parts
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/router_align_bench")
    ap.add_argument("--tokens", default="8,16,32,64,113")
    ap.add_argument("--block-m", type=int, default=8)
    ap.add_argument("--warps", default="1,2,4", help="the fused kernel's warps a program to time")
    ap.add_argument("--parts", action="store_true", help="the router GEMM in Triton (see the docstring)")
    ap.add_argument("--early", action="store_true", help="early loads on in the PDL rows")
    ap.add_argument("--gather", default="0",
                    help="the last program's forms to time (router_align.GATHER): 0 (member / start read back from "
                         "memory, the default form; columns fused_*, as before the option), 1 (register gathers "
                         "where `gather_fits`, else the same; columns fused_*_gather), or 0,1")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        sys.exit("router_align_bench needs a CUDA GPU")
    from cuda_timing import graph_per_call_us  # benchmarks/ (the script's directory) is on sys.path
    from kernels import moe_router, pdl
    from kernels import router_align as ra
    from kernels.router_align import _launch, _launch_linear, router_topk_then_align
    from kernels.w4a16_gemm import moe_align_fast

    def baseline(x, w, e, bm):  # -> the outputs the fused path must equal, in its order
        if not args.parts:
            return router_topk_then_align(F.linear(x, w), top_k, e, e + 1, bm)
        logits, weights, idx = moe_router._launch_parts(x, w, top_k, e)
        routing = moe_align_fast(idx, e + 1, bm)
        return logits, weights, idx, routing.sorted_pairs, routing.block_expert

    def fused(x, w, e, bm, warps):
        if not args.parts:
            return _launch(F.linear(x, w), top_k, e, e + 1, bm, num_warps=warps)
        return _launch_linear(x, w, top_k, e, e + 1, bm, num_warps=warps)

    dev, h, e, top_k, calls, bm = torch.device("cuda"), 2048, 256, 8, 40, args.block_m
    gen = torch.Generator(device=dev).manual_seed(0)
    ws = [torch.randn(e, h, device=dev, generator=gen).to(torch.bfloat16) * 0.02 for _ in range(calls)]
    rows = []
    tokens = [int(v) for v in args.tokens.split(",")]
    if args.parts and any(t > moe_router.PARTS_MAX_ROWS for t in tokens):  # the router GEMM in Triton takes <= 64
        print(f"--parts: skipping {[t for t in tokens if t > moe_router.PARTS_MAX_ROWS]} tokens "
              f"(> moe_router.PARTS_MAX_ROWS = {moe_router.PARTS_MAX_ROWS})", flush=True)
        tokens = [t for t in tokens if t <= moe_router.PARTS_MAX_ROWS]
    for t in tokens:
        xs = [torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16) for _ in range(calls)]
        row = dict(tokens=t, pairs=t * (top_k + 1), block_m=bm)
        warps = [int(v) for v in args.warps.split(",")]
        two = baseline(xs[0], ws[0], e, bm)
        forms = [bool(int(v)) for v in args.gather.split(",")]
        gather_default = ra.GATHER
        row["equal"] = True
        for g in forms:
            ra.GATHER = g
            row["equal"] &= all(bool(torch.equal(a, b)) for w in warps
                                for a, b in zip(fused(xs[0], ws[0], e, bm, w), two))
        for use_pdl in (False, True):
            pdl.set_enabled(use_pdl)
            pdl.set_early(use_pdl and args.early)
            tag = "pdl" if use_pdl else "plain"
            row[f"separate_{tag}_us"] = graph_per_call_us(
                [lambda i=i: baseline(xs[i], ws[i], e, bm) for i in range(calls)])
            for g in forms:
                ra.GATHER = g
                for w in warps:
                    row[f"fused_{w}w{'_gather' if g else ''}_{tag}_us"] = graph_per_call_us(
                        [lambda i=i, w=w: fused(xs[i], ws[i], e, bm, w) for i in range(calls)])
            ra.GATHER = gather_default
        pdl.set_enabled(False)
        pdl.set_early(False)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__)
    (out / "router_align_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    keys = [k for k in rows[0] if k.endswith("_us")]
    lines = [f"# router_align_bench ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}); us per "
             f"call incl. the router GEMM ({'Triton, --parts' if args.parts else 'F.linear'}); "
             f"early loads in the PDL rows: {args.early}", "",
             "| tokens | pairs | BLOCK_M | " + " | ".join(keys) + " | equal |",
             "|" + "---:|" * (len(keys) + 4)]
    for r in rows:
        cells = " | ".join(f"{r[k]:.2f}" for k in keys)
        lines.append(f"| {r['tokens']} | {r['pairs']} | {r['block_m']} | {cells} | {r['equal']} |")
    (out / "router_align_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
