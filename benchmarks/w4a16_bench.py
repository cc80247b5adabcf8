"""The W4A16 GEMMs at Qwen3.6-35B-A3B's decode shapes on the GPU, in each dequant mode side by side (issue 5).

    python benchmarks/w4a16_bench.py --out out/w4a16      # on the GPU machine; w4a16_bench.{json,md}

Grouped (routed experts: 256 experts, hidden 2048, expert width 512, top-8) at 1 and 32 decode tokens, gate_up with
SwiGLU and down with the routing weight; dense (shared expert, lm_head) at M = 1 and 32. Each mode
(`kernels.w4a16_gemm.DEQ_MODES` x how early the block scales are requested, SCALE_AHEAD) runs the grouped tiles of
GROUPED_TILES and reports its fastest; the dense kernel is autotuned per mode (the autotune key holds the modes).
Times are medians of CUDA-graph replays (`triton.testing.do_bench_cudagraph`: no host launch cost, as in the
engine's graphed step). Weights are random bytes in the checkpoint layout: speed does not depend on the values. So
that a small call's weights (a lone token's 8 experts: 9.4 MB gate_up, 4.7 MB down) are not read from the 50 MB L2,
each timed call uses the next of `copies_for(...)` weight copies, together at least twice the L2, as the 40 layers of
a decode step do (runs 1-3 of 2026-11-30 used 8 copies: their 1-token down rows, 38 MB in all, may be L2 reads).
Bandwidth = bytes of the experts a call touches (packed + block scales) / time; the copy row is torch's device copy
of 1 GB (read + write), for scale. Every output is compared with the first mode's (same values; only the fp32
summation order of different tiles may differ). `--smoke` needs TRITON_INTERPRET=1 in the environment.
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

from kernels import split_k  # noqa: E402
from kernels.nvfp4 import NVFP4Tensor  # noqa: E402
from kernels.w4a16_gemm import _w4a16_dense_kernel, _w4a16_grouped_kernel, moe_align_fast, moe_block_m  # noqa: E402
from kernels.w4a16_gemm import tile_major, w4a16_dense_launch, w4a16_grouped_launch  # noqa: E402

E, H, I, TOP_K, VOCAB = 256, 2048, 512, 8, 248320
LAYERS = 8  # at least this many weight copies per case
L2_BYTES = 50 * 2**20  # H100 / H200
DEV = "cuda"
# decode tiles from the grouped autotune list (BLOCK_N, BLOCK_K, warps, stages); each mode reports its best of these,
# timed directly (the full autotune of every mode would take most of a device call)
GROUPED_TILES = [(32, 128, 4, 4), (64, 128, 4, 4), (16, 256, 4, 4), (32, 256, 4, 3)]
MODES = {"fp16 dequant + convert, scales in the tile (before)": dict(DEQ=0, SCALE_AHEAD=0),
         "fp16 dequant + convert, scales 1 tile ahead": dict(DEQ=0, SCALE_AHEAD=1),
         "bf16 integer ops (PTX), scales in the tile": dict(DEQ=2, SCALE_AHEAD=0),
         "bf16 integer ops (PTX), scales 1 tile ahead": dict(DEQ=2, SCALE_AHEAD=1),
         "bf16 integer ops (PTX), scales 2 tiles ahead": dict(DEQ=2, SCALE_AHEAD=2)}


ONCE = False  # --once: each case runs a few times untimed (for Nsight Compute: benchmarks/w4a16_ncu.sh)


def ms(fn) -> float:
    if DEV == "cpu" or ONCE:  # --smoke: the script's plumbing under the interpreter; --once: under ncu
        for _ in range(1 if DEV == "cpu" else 3):
            fn()
        return float("nan")  # untimed: the tables say nan
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")  # no host launch cost: as in a step


def rand_nvfp4(*shape) -> NVFP4Tensor:
    """Random packed bytes and e4m3 block scales (normal range) in the checkpoint layout, made on the device (GBs);
    global scale 1."""
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=DEV)
    scales = torch.randint(0x30, 0x48, (*lead, n, k // 16), dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    return NVFP4Tensor(packed, scales, torch.ones(lead, dtype=torch.float32, device=DEV))


def nbytes(w: NVFP4Tensor) -> int:
    return w.packed.numel() + w.scales.numel()


def copies_for(bytes_per_call: float) -> int:
    """Weight copies to cycle through so that together they are at least twice the L2 (and >= LAYERS)."""
    return max(LAYERS, -(-int(2 * L2_BYTES) // max(1, int(bytes_per_call))))


def grouped(rows: list, g, tokens=(1, 32)) -> None:
    n = copies_for(TOP_K * (H * I // 2 + H * I // 16))  # the smallest call: one token's 8 experts' down weights
    w13 = [rand_nvfp4(E, 2 * I, H) for _ in range(n)]
    w2 = [rand_nvfp4(E, H, I) for _ in range(n)]
    for t in tokens:
        x = torch.randn(t, H, generator=g).to(torch.bfloat16).to(DEV)
        idx = [torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(t)]).to(DEV) for _ in range(n)]
        wts = torch.softmax(torch.randn(t, TOP_K, generator=g), -1).to(torch.bfloat16).to(DEV)
        routing = [moe_align_fast(i, E, moe_block_m(t * TOP_K, E)) for i in idx]
        touched = [int(i.unique().numel()) for i in idx]
        h = torch.randn(t * TOP_K, I, generator=g).to(torch.bfloat16).to(DEV)
        ref = {}
        for name, modes in MODES.items():
            for proj in ("gate_up", "down"):
                best = None
                for bn, bk, nw, ns in GROUPED_TILES:
                    cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
                    k = [0]
                    w = w13 if proj == "gate_up" else w2
                    if modes.get("TILED"):  # the same weights, each (row tile, K tile) one contiguous block
                        w = [NVFP4Tensor(tile_major(c.packed, bn, bk), c.scales, c.global_scale) for c in w]

                    def call(layer=None, w_=w):
                        layer = k[0] % n if layer is None else layer
                        k[0] += 1
                        if proj == "gate_up":
                            return w4a16_grouped_launch(x, w_[layer], routing[layer], a_div=TOP_K, swiglu=True,
                                                        config=cfg, modes=modes)
                        return w4a16_grouped_launch(h, w_[layer], routing[layer], row_scale=wts, config=cfg,
                                                    modes=modes)

                    out = call(0).float()
                    r = ref.setdefault((t, proj), out)
                    err = float((out - r).abs().max() / r.abs().max())
                    t_ms = ms(call)
                    if best is None or t_ms < best[0]:
                        best = (t_ms, cfg, err)
                    del w
                t_ms, cfg, err = best
                byts = nbytes((w13 if proj == "gate_up" else w2)[0]) / E * sum(touched) / n
                rows.append(dict(kind="grouped", tokens=t, proj=proj, mode=name, us=t_ms * 1e3,
                                 tb_s=byts / (t_ms * 1e-3) / 1e12, experts=sum(touched) / n, best_config=cfg,
                                 max_rel_diff_vs_before=err))
                print(json.dumps(rows[-1]), flush=True)


def dense(rows: list, g) -> None:
    """Each shape and mode, autotuned. Split-K (the shared expert at decode sizes) runs twice: reduced inside the
    kernel (the arrival counters, what the engine runs) and, as before the fifth session, summed and cast by torch
    (two more launches, inside the timed graph). The shared expert's gate/up also runs with the SwiGLU epilogue (its engine
    path), against the plain GEMM + torch SiLU x up."""
    from kernels import w4a16_gemm

    shapes = {"shared gate_up": (2 * I, H, False), "shared gate_up + SwiGLU": (2 * I, H, True),
              "shared down": (H, I, False), "lm_head": (VOCAB, H, False)}
    for name_s, (n, k, swiglu) in shapes.items():
        ws = [rand_nvfp4(n, k) for _ in range(copies_for(n * k * 9 // 16))]
        for m in (1, 32):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
            ref = None
            for name, modes in MODES.items():
                if modes.get("TILED"):  # a grouped-kernel experiment only
                    continue
                modes = {key: modes[key] for key in ("DEQ", "SCALE_AHEAD")}
                for reduce_by in ("kernel", "torch"):
                    counters = split_k.SPLIT_COUNTERS
                    if reduce_by == "torch":
                        split_k.SPLIT_COUNTERS = 0  # no counters: partials summed (and activated) by torch
                    j = [0]

                    def call():
                        j[0] += 1
                        w_ = ws[j[0] % len(ws)]
                        if swiglu and reduce_by == "kernel":  # the engine path: SiLU x up in the GEMM's epilogue
                            return w4a16_dense_launch(x, *w_, swiglu=True, modes=modes)
                        y = w4a16_dense_launch(x, *w_, modes=modes)
                        if swiglu:  # the old engine path: GEMM, then SiLU x up in torch
                            gate, up = y.chunk(2, dim=-1)
                            return torch.nn.functional.silu(gate) * up
                        return y

                    try:
                        j[0] = -1
                        out = call()
                        split = w4a16_gemm.split_k_for(m, n // 2 if swiglu else n, k,
                                                       split_k.num_sms(x.device.index))
                        if reduce_by == "torch" and split == 1 and not swiglu:
                            continue  # the same launch as the kernel row
                        err = None if ref is None else float((out.float() - ref).abs().max() / ref.abs().max())
                        ref = out.float() if ref is None else ref
                        t_ms = ms(call)
                    finally:
                        split_k.SPLIT_COUNTERS = counters
                    what = {"kernel": "", "torch": ", split-K summed / SwiGLU by torch (before)"}[reduce_by]
                    rows.append(dict(kind="dense", shape=name_s, tokens=m, mode=name + what, split_k=split,
                                     us=t_ms * 1e3, tb_s=nbytes(ws[0]) / (t_ms * 1e-3) / 1e12,  # autotuned
                                     max_rel_diff_vs_before=err))
                    print(json.dumps(rows[-1]), flush=True)


def copy_ceiling(rows: list) -> None:
    src = torch.empty(2**30 if DEV == "cuda" else 2**10, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    t_ms = ms(lambda: dst.copy_(src))
    rows.append(dict(kind="copy", bytes=src.numel(), us=t_ms * 1e3, tb_s=2 * src.numel() / (t_ms * 1e-3) / 1e12))
    print(json.dumps(rows[-1]), flush=True)


def tuned(kernel) -> dict:
    return {str(k): str(v) for k, v in getattr(kernel, "cache", {}).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/w4a16")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--skip-grouped", action="store_true")
    ap.add_argument("--tiles", default="", help="grouped tiles 'BN,BK,warps,stages;...' instead of GROUPED_TILES")
    ap.add_argument("--modes", default="", help="'DEQ:SCALE_AHEAD[:TILED],...' instead of MODES, e.g. '2:1,2:1:1' "
                                                "(TILED: the weights repacked by tile_major for each tile)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter (untimed)")
    ap.add_argument("--once", action="store_true", help="run each case 3 times untimed (for a profiler)")
    ap.add_argument("--tokens", default="1,32", help="decode tokens of the grouped cases")
    args = ap.parse_args()
    global ONCE
    ONCE = args.once
    if args.smoke:
        global DEV, E, H, I, VOCAB, LAYERS, L2_BYTES
        DEV, E, H, I, VOCAB, LAYERS, L2_BYTES = "cpu", 16, 128, 64, 512, 2, 0
    if args.tiles:
        GROUPED_TILES[:] = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";")]
    if args.modes:
        MODES.clear()
        for m in args.modes.split(","):
            deq, ahead, tiled = ([int(v) for v in m.split(":")] + [0])[:3]
            MODES[f"DEQ {deq}, scales {ahead} tile(s) ahead{', tile-major weights' if tiled else ''}"] = dict(
                DEQ=deq, SCALE_AHEAD=ahead, TILED=tiled)
    g = torch.Generator().manual_seed(0)
    rows: list = []
    t0 = time.time()
    copy_ceiling(rows)
    if not args.skip_grouped:
        grouped(rows, g, tuple(int(t) for t in args.tokens.split(",")))
    if not args.skip_dense:
        dense(rows, g)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(tiles=GROUPED_TILES, modes=MODES,
                device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)", torch=torch.__version__,
                triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), seconds=round(time.time() - t0, 1),
                tuned_grouped=tuned(_w4a16_grouped_kernel), tuned_dense=tuned(_w4a16_dense_kernel))
    (out / "w4a16_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# W4A16 kernels by dequant mode, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['date']}", "", "| kernel | tokens | mode | us | TB/s | max rel diff vs before |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        what = "copy 1 GB (read + write)" if r["kind"] == "copy" else (
            f"grouped {r['proj']} ({r['experts']:.0f} experts)" if r["kind"] == "grouped" else f"dense {r['shape']}")
        diff = r.get("max_rel_diff_vs_before")
        lines.append(f"| {what} | {r.get('tokens', '-')} | {r.get('mode', '-')} | {r['us']:.1f} | {r['tb_s']:.2f} | "
                     f"{'-' if diff is None else f'{diff:.1e}'} |")
    (out / "w4a16_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
