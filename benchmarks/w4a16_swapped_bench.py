"""The swap-AB grouped W4A16 kernel (`kernels/w4a16_swapped.py`, split-halves weights) beside the engine's grouped
kernel (`w4a16_grouped_launch` on tile-major experts with `_tile_major_config`, as `w4a16_moe_op` calls it), at
Qwen3.6-35B-A3B's expert shapes (E 256, H 2048, I 512, top-8), per projection and token count.

    python benchmarks/w4a16_swapped_bench.py --out benchmarks/results/w4a16_swapped_bench     # GPU; < 4 min on H200
    python benchmarks/w4a16_swapped_bench.py --dry-run                                          # CPU interpreter, tiny
    python benchmarks/w4a16_swapped_bench.py --tokens 32,1024 --layouts halves,frag --engine-config-only
                                     # split halves beside fragment order (`split_frag`) at the engine's launch config
    python benchmarks/w4a16_swapped_bench.py --tokens 1,2,4 --layouts frag --splits 1,2,4,8 --engine-config-only
                                     # split K at decode sizes, beside the decode GEMV the engine runs there

Times: medians of `triton.testing.do_bench` (CUDA events, L2 flushed between runs). At 1-4 tokens they are launch-
and host-bound (H200, run 4: 24-140 us per call, noisy from row to row, where an expert call takes ~7 us in the
engine's CUDA graphs): rank decode-sized kernels in the engine (`qwen_gpu.py --compare-layout`, `--swapped-split`). Weights: random bytes and
normal-range scales (speed does not depend on the values), one copy per projection (403 MB for all experts: past
the 50 MB L2). Each swapped result is compared with the engine path's output (max |diff| / max |ref|: same exact
products, only the fp32 summation order differs, so ~1 bf16 ulp).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (BLOCK_N, warps, stages) of the swapped kernel; BLOCK_M = moe_block_m's and one larger
SWEEP = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3)]
STORED = (64, 128)  # split-halves tile (rows, K): 64 rows = one wgmma M per warpgroup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/w4a16_swapped_bench")
    ap.add_argument("--tokens", default="1,32,256,1024")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    ap.add_argument("--layouts", default="halves",
                    help="swapped-kernel byte layouts, comma-separated: halves (split_halves), frag (split_frag)")
    ap.add_argument("--splits", default="1",
                    help="split-K factors of the swapped kernel, comma-separated (its `split`: the K tiles shared among "
                         "programs, reduced by the last to arrive); at <= 4 tokens the decode GEMV "
                         "(kernels/w4a16_gemv.py, checkpoint layout) is timed beside it")
    ap.add_argument("--engine-config-only", action="store_true",
                    help="the swapped kernel at the engine's config only (BLOCK_N 64, 4 warps, 3 stages)")
    args = ap.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton reads it (kernel imports below)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("w4a16_swapped_bench needs a CUDA GPU (or --dry-run for the CPU interpreter at tiny shapes)")
    import triton

    from kernels import w4a16_gemm
    from kernels.nvfp4 import NVFP4Tensor
    from kernels.w4a16_gemm import TILE_MAJOR_MODES, TILE_MAJOR_TILES, moe_align, tile_major, w4a16_grouped_launch
    from kernels.w4a16_gemv import GEMV_MAX_TOKENS, w4a16_gemv_launch
    from kernels.w4a16_swapped import effective_split, split_frag, split_halves, w4a16_grouped_swapped_launch

    dev = "cpu" if args.dry_run else "cuda"
    e, h, i, top_k = (4, 256, 128, 2) if args.dry_run else (256, 2048, 512, 8)
    tokens = [1, 5] if args.dry_run else [int(s) for s in args.tokens.split(",")]
    sweep = SWEEP[:1] if args.dry_run or args.engine_config_only else SWEEP
    layouts = args.layouts.split(",")
    splits = [int(v) for v in args.splits.split(",")]
    if not set(layouts) <= {"halves", "frag"}:
        sys.exit(f"--layouts: halves and / or frag, got {args.layouts}")

    def bench(fn) -> float:
        if args.dry_run:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")

    g = torch.Generator().manual_seed(0)

    def rand_nvfp4(*shape) -> NVFP4Tensor:
        *lead, n, k = shape
        packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=g).to(dev)
        scales = torch.randint(0x30, 0x48, (*lead, n, k // 16), dtype=torch.uint8, generator=g).to(dev)
        return NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), torch.ones(lead, device=dev))

    w = {True: rand_nvfp4(e, 2 * i, h), False: rand_nvfp4(e, h, i)}  # gate_up (SwiGLU), down
    engine_w = {sw: NVFP4Tensor(tile_major(w[sw].packed, *TILE_MAJOR_TILES[sw]), w[sw].scales, w[sw].global_scale)
                for sw in w}
    split_w = {(sw, lay): (split_frag if lay == "frag" else split_halves)(w[sw].packed, *STORED)
               for sw in w for lay in layouts}
    rows, t0 = [], time.time()
    for t in tokens:
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
        idx = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).to(dev)
        wts = torch.softmax(torch.randn(t, top_k, generator=g), -1).to(torch.bfloat16).to(dev)
        hh = torch.randn(t * top_k, i, generator=g).to(torch.bfloat16).to(dev)  # the down projection's input rows
        bm0 = w4a16_gemm.moe_block_m(t * top_k, e)
        for sw in (True, False):
            proj = "gate_up" if sw else "down"
            n_out = i if sw else h
            xin, a_div, rs = (x, top_k, None) if sw else (hh, 1, wts)
            routing = moe_align(idx, e, bm0)
            cfg = w4a16_gemm._tile_major_config(sw, bm0, n_out)  # the engine's launch (`w4a16_moe_op`, tiled)
            engine = lambda: w4a16_grouped_launch(  # noqa: E731
                xin, engine_w[sw], routing, a_div=a_div, swiglu=sw, row_scale=rs, config=cfg,
                modes=TILE_MAJOR_MODES)
            ref = engine().float()
            t_ms = bench(engine)
            flop = 2 * t * top_k * (2 * i if sw else i) * h
            used = int(idx.unique().numel())  # only the routed experts' weights are read (8-256 of E)
            wbytes = (w[sw].packed.numel() + w[sw].scales.numel()) * used // e
            rows.append(dict(tokens=t, proj=proj, kernel="engine", block_m=bm0, config=cfg, us=t_ms * 1e3,
                             tb_s=wbytes / (t_ms * 1e-3) / 1e12, tflop_s=flop / (t_ms * 1e-3) / 1e12))
            print(json.dumps(rows[-1]), flush=True)
            if t <= GEMV_MAX_TOKENS and dev == "cuda":  # the decode GEMV the engine runs at these sizes (checkpoint
                def gemv():  # layout, autotuned: its first call tunes)
                    return w4a16_gemv_launch(xin, *w[sw], pair_expert=idx, a_div=a_div, swiglu=sw, row_scale=rs)

                err = float((gemv().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                t_ms = bench(gemv)
                rows.append(dict(tokens=t, proj=proj, kernel="gemv", block_m=0, config={}, us=t_ms * 1e3,
                                 tb_s=wbytes / (t_ms * 1e-3) / 1e12, tflop_s=flop / (t_ms * 1e-3) / 1e12,
                                 max_rel_diff=err))
                print(json.dumps(rows[-1]), flush=True)
            for bm in sorted({bm0, min(2 * bm0, 64)}) if not args.dry_run else [bm0]:
                r_bm = moe_align(idx, e, bm)
                for (bn, nw, ns), lay, split in ((cfg_, lay_, sp) for cfg_ in sweep for lay_ in layouts
                                                 for sp in splits):
                    k_tiles = (h if sw else i) // STORED[1]  # K: H for gate_up, I for down
                    if n_out % bn or split > k_tiles:
                        continue
                    ran = effective_split(split, k_tiles, r_bm.block_expert.numel() * (n_out // bn), xin.device)[0]
                    if ran != split:  # what the launcher would run instead (no counters, or fewer K tiles each)
                        continue
                    c = dict(BLOCK_N=bn, num_warps=nw, num_stages=ns)
                    kernel = ("swapped" if lay == "halves" else "swapped_frag") + (f"_split{split}" if split > 1
                                                                                   else "")

                    def call():
                        return w4a16_grouped_swapped_launch(xin, split_w[sw, lay], w[sw].scales, w[sw].global_scale,
                                                            r_bm, a_div=a_div, swiglu=sw, row_scale=rs,
                                                            block_n=STORED[0], block_k=STORED[1], config=c,
                                                            unverified=True,  # the sweep tries 8 warps too
                                                            frag=lay == "frag", split=split)

                    try:
                        y = call().float()
                        err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                        t_ms = bench(call)
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory / registers: recorded
                        rows.append(dict(tokens=t, proj=proj, kernel=kernel, block_m=bm, config=c,
                                         error=repr(exc)[:200]))
                        print(json.dumps(rows[-1]), flush=True)
                        continue
                    rows.append(dict(tokens=t, proj=proj, kernel=kernel, block_m=bm, config=c, us=t_ms * 1e3,
                                     tb_s=wbytes / (t_ms * 1e-3) / 1e12, tflop_s=flop / (t_ms * 1e-3) / 1e12,
                                     max_rel_diff=err))
                    print(json.dumps(rows[-1]), flush=True)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__, triton=triton.__version__,
                gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter dry run)",
                seconds=round(time.time() - t0, 1), shapes=dict(E=e, H=h, I=i, top_k=top_k), stored_tile=STORED)
    out = Path(args.out + ("_dry" if args.dry_run else ""))
    out.mkdir(parents=True, exist_ok=True)
    (out / "w4a16_swapped_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# swap-AB grouped W4A16 vs the engine's kernel ({meta['gpu']}, {meta['date']}, torch {meta['torch']}, "
             f"triton {meta['triton']})", "",
             "| tokens | proj | kernel | BLOCK_M | BLOCK_N | warps | stages | us | TB/s | TFLOP/s | max rel diff |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r.get("config") or {}
        head = (f"| {r['tokens']} | {r['proj']} | {r['kernel']} | {r['block_m']} | {c.get('BLOCK_N', '')} | "
                f"{c.get('num_warps', '')} | {c.get('num_stages', '')} |")
        if "error" in r:
            lines.append(f"{head} failed | | | {r['error'][:60]} |")
        else:
            diff = f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else "(ref)"
            lines.append(f"{head} {r['us']:.1f} | {r['tb_s']:.2f} | {r['tflop_s']:.1f} | {diff} |")
    (out / "w4a16_swapped_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
