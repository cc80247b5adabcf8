"""The MoE router at decode sizes on the GPU: F.linear + router_topk vs the fused router_gemv_topk (<= 4 rows) and
router_linear_topk (5-64 rows).

Qwen3.6-35B-A3B's router: F.linear then "router_topk" (two launches) vs "router_gemv_topk" (one launch;
kernels/moe_router.py).

    python benchmarks/router_bench.py --out out/router            # on the GPU machine; router_bench.{json,md}
    python benchmarks/router_bench.py --out out/router --sweep    # also a few fused tilings besides the default

x [N, 2048] bf16, W [256, 2048] bf16 (1 MB), top-8, N = 1, 4, 32 (--rows). Times are medians of CUDA-graph replays
(`triton.testing.do_bench_cudagraph`: no host launch cost, as in the engine's graphed decode step). So that W is not
read from the 50 MB L2, each timed call uses the next of `copies_for(...)` weight copies, together at least twice the
L2 (and >= LAYERS), as the 40 MoE layers of a decode step do. Rows: F.linear + the torch softmax/topk reference (the
plain model), F.linear + router_topk (today's fused path), and the fused op (default tiling, `--sweep`: more). TB/s =
W bytes / time. Every output is checked against the reference with `compare_gemv` (logits within an ulp of
F.linear's plus the fp32-order bound; top-k exactly router_topk's on the returned logits).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

E, H, TOP_K, LAYERS = 256, 2048, 8, 8  # LAYERS: at least this many weight copies
L2_BYTES = 50 * 2**20  # H100 / H200
# (BLOCK_R, BLOCK_E, BLOCK_H, SPLIT, num_warps) tried with --sweep, besides `_gemv_tiling`'s choice (BLOCK_R is
# capped at N's power of two; a split left without an H tile only adds zeros)
SWEEP = [(1, 16, 128, 16, 1), (1, 32, 128, 16, 1), (1, 16, 256, 8, 1), (1, 32, 64, 32, 1), (1, 64, 128, 16, 2),
         (4, 16, 64, 32, 2), (4, 32, 64, 16, 2), (8, 16, 64, 8, 4), (8, 32, 64, 8, 4), (8, 16, 128, 4, 4)]


def copies_for(bytes_per_call: float) -> int:
    """Weight copies to cycle through so that together they are at least twice the L2 (and >= LAYERS)."""
    return max(LAYERS, -(-int(2 * L2_BYTES) // max(1, int(bytes_per_call))))


def ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def bench(rows: list, n: int, sweep: bool, g: torch.Generator) -> None:
    from kernels import moe_router as mr

    copies = copies_for(E * H * 2)
    ws = [(0.02 * torch.randn(E, H, generator=g)).to(torch.bfloat16).cuda() for _ in range(copies)]
    x = torch.randn(n, H, generator=g).to(torch.bfloat16).cuda()
    paths = {"F.linear + torch softmax/topk (plain)": lambda w: mr.router_gemv_topk_reference(x, w, TOP_K),
             "F.linear + router_topk (2 launches)": lambda w: (lambda lg: (lg, *mr.router_topk_triton(lg, TOP_K)))(
                 F.linear(x, w)),
             "router_gemv_topk, default tiling": lambda w: mr.router_gemv_topk_triton(x, w, TOP_K)}
    if mr.MAX_ROWS < n <= mr.PARTS_MAX_ROWS:  # the router GEMM in Triton, then the top-k over its partials
        paths["router_linear_topk (Triton GEMM parts + top-k)"] = lambda w: mr._launch_parts(x, w, TOP_K)
    default = mr._gemv_tiling(n, E, H)
    if sweep:
        for br, be, bh, split, warps in SWEEP:
            cfg = dict(BLOCK_R=min(br, 1 << (n - 1).bit_length()), BLOCK_E=be, BLOCK_H=bh, SPLIT=split,
                       num_warps=warps)
            if cfg == default or f"router_gemv_topk {cfg}" in paths:
                continue
            paths[f"router_gemv_topk {cfg}"] = lambda w, cfg=cfg: mr._launch_gemv(x, w, TOP_K, cfg)
    ref = mr.router_gemv_topk_reference(x, ws[0], TOP_K)
    for name, fn in paths.items():
        out = fn(ws[0])  # eager first: allocates the arrival counters before any capture, and checks
        torch.cuda.synchronize()
        problem = mr.compare_gemv(out, ref, x, ws[0])
        k = [0]

        def call(fn=fn):
            w = ws[k[0] % copies]
            k[0] += 1
            return fn(w)

        t_ms = ms(call)
        again = fn(ws[0])  # after many graph replays: the counters were re-armed every time
        torch.cuda.synchronize()
        if problem is None and not all(torch.equal(a, b) for a, b in zip(out, again)):
            problem = "a later call differs from the first (counter re-arm?)"
        rows.append(dict(rows=n, path=name, us=t_ms * 1e3, tb_s=E * H * 2 / (t_ms * 1e-3) / 1e12,
                         tiling=default if "default" in name else None, check=problem or "ok"))
        print(json.dumps(rows[-1]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/router")
    ap.add_argument("--rows", default="1,4,32", help="decode rows N (comma-separated)")
    ap.add_argument("--sweep", action="store_true", help="also time the fused op at the tilings of SWEEP")
    ap.add_argument("--pdl", action="store_true", help="launch the Triton kernels with programmatic dependent launch, "
                                                       "as the engine does on Hopper (kernels/pdl.py)")
    ap.add_argument("--early", action="store_true", help="with --pdl: early loads (kernels/pdl.py set_early; the "
                                                         "router GEMM's weight tile before its wait)")
    args = ap.parse_args()
    rows_n = [int(v) for v in args.rows.split(",")]
    if not torch.cuda.is_available():
        sys.exit("router_bench.py times CUDA kernels: no CUDA device here (run it on the GPU machine)")
    if args.pdl:
        from kernels import pdl

        pdl.set_enabled(pdl.device_supports())
        pdl.set_early(args.early)
    import triton

    g = torch.Generator().manual_seed(0)
    rows: list = []
    t0 = time.time()
    for n in rows_n:
        bench(rows, n, args.sweep, g)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                shape=dict(E=E, H=H, top_k=TOP_K, dtype="bf16"), weight_copies=copies_for(E * H * 2),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), seconds=round(time.time() - t0, 1))
    (out / "router_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# MoE router (E={E}, H={H}, top-{TOP_K}, bf16), {meta['device']}, torch {meta['torch']}, "
             f"triton {meta['triton']}, {meta['date']}", "",
             f"CUDA-graph replays over {meta['weight_copies']} weight copies (W not L2-resident).", "",
             "| N | path | us | x 40 layers (ms) | TB/s (W) | check |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rows']} | {r['path']} | {r['us']:.2f} | {r['us'] * 40 / 1e3:.3f} | {r['tb_s']:.2f} | "
                     f"{r['check']} |")
    (out / "router_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
