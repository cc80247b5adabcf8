"""The grouped W4A16 kernel at Qwen3.6-35B-A3B's prefill sizes (issue 5: time to first token), on tile-major experts.

    python benchmarks/moe_prefill_bench.py --out DIR          # on the GPU machine; moe_prefill_bench.{json,md}

At a 1k-token prefill the routed experts see 8,192 (token, expert) pairs, ~32 per expert: every expert's weights
are read and used by tens of rows, so the decode tiles (TILE_MAJOR_TILES: 16-32 rows x 32 columns, 4 warps) dequantise
each weight once per row tile and re-read each activation row for every 32 output columns. This times, per
projection (gate_up with SwiGLU, down with the routing weight) and token count, the routing tile height BLOCK_M
(`moe_align`'s padding) x the program width BLOCK_N (a multiple of the stored tile: `TILE_N`) x warps x stages, on
the engine's weight layout (`tile_major` with TILE_MAJOR_TILES), and the whole `w4a16_moe` op with the engine's
choice (`_tile_major_config`) against the decode tiles. Times: medians of CUDA-graph replays (no host launch cost).
Weights: random bytes (speed does not depend on the values); one copy (a call reads all 256 experts, 403 MB per
layer: far past the 50 MB L2). Every output is compared with the decode tile's (same values; only the fp32
summation order of other tiles may differ).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.w4a16_bench import E, H, I, TOP_K, nbytes, rand_nvfp4  # noqa: E402
from kernels import w4a16_gemm  # noqa: E402
from kernels.nvfp4 import NVFP4Tensor  # noqa: E402
from kernels.w4a16_gemm import TILE_MAJOR_MODES, TILE_MAJOR_TILES, moe_align, tile_major, w4a16_grouped_launch  # noqa

PROGRAMS = {True: [(32, 4, 4), (64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 8, 3)],  # gate_up (stored tiles: 32 rows)
            False: [(64, 4, 4), (128, 4, 3), (128, 8, 3), (256, 8, 3)]}  # down (stored tiles: 64 rows)


def ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/moe_prefill")
    ap.add_argument("--tokens", default="256,1024,2048")
    ap.add_argument("--block-m", default="32,64")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    w = {True: rand_nvfp4(E, 2 * I, H), False: rand_nvfp4(E, H, I)}
    tiled = {sw: NVFP4Tensor(tile_major(w[sw].packed, *TILE_MAJOR_TILES[sw]), w[sw].scales, w[sw].global_scale)
             for sw in (True, False)}
    rows, t0 = [], time.time()
    for t in (int(s) for s in args.tokens.split(",")):
        x = torch.randn(t, H, generator=g).to(torch.bfloat16).cuda()
        idx = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(t)]).cuda()
        wts = torch.softmax(torch.randn(t, TOP_K, generator=g), -1).to(torch.bfloat16).cuda()
        h = torch.randn(t * TOP_K, I, generator=g).to(torch.bfloat16).cuda()
        for sw in (True, False):
            stored_n, bk = TILE_MAJOR_TILES[sw]
            ref = None
            for bm in (int(s) for s in args.block_m.split(",")):
                routing = moe_align(idx, E, bm)
                for bn, nw, ns in PROGRAMS[sw]:
                    cfg = dict(BLOCK_N=bn, BLOCK_K=bk, TILE_N=stored_n, num_warps=nw, num_stages=ns)

                    def call():
                        if sw:
                            return w4a16_grouped_launch(x, tiled[sw], routing, a_div=TOP_K, swiglu=True, config=cfg,
                                                        modes=TILE_MAJOR_MODES)
                        return w4a16_grouped_launch(h, tiled[sw], routing, row_scale=wts, config=cfg,
                                                    modes=TILE_MAJOR_MODES)

                    try:
                        y = call().float()
                        ref = y if ref is None else ref
                        err = float((y - ref).abs().max() / ref.abs().max())
                        t_ms = ms(call)
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory / registers: recorded
                        rows.append(dict(tokens=t, proj="gate_up" if sw else "down", block_m=bm, config=cfg,
                                         error=repr(exc)[:200]))
                        print(json.dumps(rows[-1]), flush=True)
                        continue
                    flop = 2 * t * TOP_K * (2 * I if sw else I) * H
                    rows.append(dict(tokens=t, proj="gate_up" if sw else "down", block_m=bm, config=cfg,
                                     us=t_ms * 1e3, tb_s=nbytes(w[sw]) / (t_ms * 1e-3) / 1e12,
                                     tflop_s=flop / (t_ms * 1e-3) / 1e12, max_rel_diff=err))
                    print(json.dumps(rows[-1]), flush=True)
        # the whole op: the engine's choice vs the decode tiles at every size
        t13, t2 = tiled[True], tiled[False]
        for label, prefill_bm in (("engine (_tile_major_config)", w4a16_gemm.PREFILL_BLOCK_M), ("decode tiles", 10**9)):
            saved = w4a16_gemm.PREFILL_BLOCK_M
            w4a16_gemm.PREFILL_BLOCK_M = prefill_bm
            try:
                def op():
                    return w4a16_gemm.w4a16_moe_op(x, *t13, *t2, idx, wts, False, w4a16_gemm.TILE_MAJOR)

                op()
                t_ms = ms(op)
            finally:
                w4a16_gemm.PREFILL_BLOCK_M = saved
            rows.append(dict(tokens=t, proj="w4a16_moe op (align + gate_up + down)", label=label, us=t_ms * 1e3,
                             block_m=w4a16_gemm.moe_block_m(t * TOP_K, E)))
            print(json.dumps(rows[-1]), flush=True)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, seconds=round(time.time() - t0, 1),
                engine_prefill=dict(PREFILL_BLOCK_M=w4a16_gemm.PREFILL_BLOCK_M,
                                    TILE_MAJOR_PREFILL={str(k): v for k, v in w4a16_gemm.TILE_MAJOR_PREFILL.items()}))
    (out / "moe_prefill_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# grouped W4A16 at prefill sizes ({meta['gpu']}, {meta['date']}, torch {meta['torch']}, "
             f"triton {meta['triton']})", "",
             "| tokens | proj | BLOCK_M | BLOCK_N | warps | stages | us | TB/s | TFLOP/s | max rel diff |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r.get("config", {})
        if "error" in r:
            lines.append(f"| {r['tokens']} | {r['proj']} | {r['block_m']} | {c['BLOCK_N']} | {c['num_warps']} | "
                         f"{c['num_stages']} | failed | | | {r['error'][:60]} |")
        elif "label" in r:
            lines.append(f"| {r['tokens']} | {r['proj']}: {r['label']} | {r['block_m']} | | | | {r['us']:.1f} | | | |")
        else:
            lines.append(f"| {r['tokens']} | {r['proj']} | {r['block_m']} | {c['BLOCK_N']} | {c['num_warps']} | "
                         f"{c['num_stages']} | {r['us']:.1f} | {r['tb_s']:.2f} | {r['tflop_s']:.0f} | "
                         f"{r['max_rel_diff']:.1e} |")
    (out / "moe_prefill_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
