"""The swap-AB kernel's calls as the engine makes them, timed per call and their outputs kept, so that two source
trees -- this one and a copy at another commit -- are compared side by side on one GPU, bit for bit. Cases: the
routed experts at 32 tokens (decode at 32 streams: 16-row blocks) and 1,024 tokens (prefill: 64-row blocks), gate_up
with SwiGLU and down, and lm_head (`w4a16_linear_frag`) at 1, 16 and 32 rows; every call at its launch defaults
(`default_stages`, SETTLE), PDL as the engine runs it, random packed weights in the checkpoint's format (speed does not
depend on the values; the same seed in both trees, so the same inputs).

    python benchmarks/swapped_ab.py --out DIR [--save OUT.pt | --compare OTHER.pt] [--stages 2,4] [--configs JSON]

Run it in the other tree with --save, then here with --compare (see gpu_next.sh step 88): each case's us per call
(CUDA-graph replays, `cuda_timing.graph_per_call_us`) and whether its output equals the other tree's exactly.
`--stages`: each case also timed at these pipeline depths (`config=dict(num_stages=...)`, everything else the
engine's), its outputs compared with the default build's (the stage count moves no arithmetic). `--configs`: the same
for each launch config of a JSON list, e.g. '[{"maxnreg": 80}, {"BLOCK_N": 128}]' (a register cap, programs of two
stored tiles); a config a case's launch refuses is recorded with its error. `--regs`: the 32-token expert calls also
on `kernels/w4a16_regs.py` (Gluon, thread-order copies of the same weights, PDL as the engine launches it; no launch
configs; 16- and 8-row blocks x [1 or 2 K tiles loaded ahead into registers, 2 with an L2 prefetch 4 or 8 tiles
ahead, a cp.async ring of 4, 2 with 4 column tiles a program and an L2 prefetch of 0 or 4]), each output compared bit
for bit with the swap-AB kernel's on the same inputs (`equal_to_swapped`). `--regs-lm-head BUILDS`: lm_head at 16
and 32 rows also as a one-expert call on the register kernel (a thread-order copy of its 286 MB; the rows' 8- or
16-row blocks of a column tile adjacent in the grid, so one reads the weights from DRAM and the others from L2), the
builds a JSON list like --regs-builds', compared with the fragment-order swap-AB call (`close_to_swapped`): whether
a decode step's lm_head (131 us of the H200's 32-stream step at ~2.2 TB/s) is worth a register-kernel path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def regs_kw(build: tuple) -> dict:
    """A --regs-builds build (block, ahead, l2_ahead, ring, cols, maxnreg, early, cols_first, mma_v2) as
    `w4a16_regs_launch`'s keywords (the block is the routing's)."""
    _, ahead, l2, ring, cols, maxnreg, early, first, mma = build
    return dict(ahead=ahead, l2_ahead=l2, ring=ring, cols=cols, maxnreg=maxnreg or None, early=bool(early),
                cols_first=bool(first), mma_v2=bool(mma))


def regs_tag(build: tuple) -> str:
    """A build as its cases name it ("ahead A, l2 L, ring R, cols C, block B[, maxnreg N][, early][, cols first]
    [, mma_sync]": gpu_next.sh's best_regs_builds parses it)."""
    bm, ahead, l2, ring, cols, maxnreg, early, first, mma = build
    return (f"ahead {ahead}, l2 {l2}, ring {ring}, cols {cols}, block {bm}"
            + (f", maxnreg {maxnreg}" if maxnreg else "") + (", early" if early else "")
            + (", cols first" if first else "") + (", mma_sync" if mma else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for swapped_ab.json")
    ap.add_argument("--save", help="write the cases' outputs to this .pt file")
    ap.add_argument("--compare", help="compare the outputs with this .pt file (from --save in the other tree)")
    ap.add_argument("--label", default="", help="a name for this tree in the JSON")
    ap.add_argument("--stages", default="", help="comma-separated num_stages to time each case at as well")
    ap.add_argument("--configs", default="[]", help="JSON list of launch configs to time each case at as well")
    ap.add_argument("--expert-tile", default="", help="ROWSxK: the experts' stored tile (default SPLIT_TILE, "
                                                        "64x128), e.g. 64x256; lm_head keeps its own")
    ap.add_argument("--regs", action="store_true", help="also time the 32-token expert calls on kernels/w4a16_regs.py")
    ap.add_argument("--regs-builds", default="",
                    help="--regs: JSON list of [block_m, ahead, l2_ahead, ring, cols(, maxnreg(, early(, "
                         "cols_first(, mma_v2))))] builds to time instead of the default sweep (maxnreg 0: none; "
                         "early 1: the weights' first loads before the PDL wait; cols_first 1: the grid in column "
                         "order; mma_v2 1: the products on mma.sync)")
    ap.add_argument("--regs-lm-head", default="",
                    help="JSON list of --regs-builds' builds: lm_head at 16 and 32 rows on kernels/w4a16_regs.py too")
    args = ap.parse_args()
    sweep = [dict(num_stages=int(v)) for v in args.stages.split(",") if v.strip()] + json.loads(args.configs)
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("swapped_ab needs a CUDA GPU")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_timing import graph_per_call_us
    from random_packed import random_nvfp4

    from kernels import pdl
    from kernels.nvfp4 import NVFP4Tensor
    from kernels.w4a16_gemm import MoeRouting, moe_align
    from kernels.w4a16_swapped import SPLIT_TILE, dense_routing, linear_to_frag, split_frag
    from kernels.w4a16_swapped import w4a16_grouped_swapped_launch
    from kernels.w4a16_swapped import w4a16_linear_frag_triton

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    pdl.set_enabled(pdl.device_supports())
    w13, w2 = random_nvfp4((256, 1024, 2048), dev, gen), random_nvfp4((256, 2048, 512), dev, gen)
    tile = tuple(int(v) for v in args.expert_tile.split("x")) if args.expert_tile else SPLIT_TILE
    w13f, w2f = split_frag(w13.packed, *tile), split_frag(w2.packed, *tile)
    lm = random_nvfp4((248_320, 2048), dev, gen)
    lm_frag = linear_to_frag(NVFP4Tensor(lm.packed, lm.scales, lm.global_scale))

    # the Gluon kernel's builds timed (--regs): (row block, K tiles ahead in registers, K tiles prefetched into L2,
    # cp.async ring depth, column tiles a program, register cap or 0 for none, EARLY, the grid in column order, the
    # products on mma.sync instead of wgmma)
    sweep_builds = ((1, 0, 0, 1), (2, 0, 0, 1), (2, 4, 0, 1), (2, 8, 0, 1), (1, 0, 4, 1), (2, 0, 0, 4), (2, 4, 0, 4))
    regs_builds = [(bm, *b, 0, 0, 0, 0) for bm in (16, 8) for b in sweep_builds]
    if args.regs_builds:
        regs_builds = [tuple(b) + (0,) * (9 - len(b)) for b in json.loads(args.regs_builds)]
    if args.regs or args.regs_lm_head:
        from kernels.w4a16_regs import thread_order, w4a16_regs_launch
    if args.regs:
        w13t, w2t = thread_order(w13.packed), thread_order(w2.packed)
    lm_builds = [tuple(b) + (0,) * (9 - len(b)) for b in json.loads(args.regs_lm_head or "[]")]
    if any(b[0] not in (8, 16) for b in lm_builds):
        sys.exit(f"--regs-lm-head: row blocks of 8 or 16 only, got {args.regs_lm_head}")
    if lm_builds:  # lm_head as the one expert of a [1, N, K/2] thread-order copy; its per-row global scales [1, N]
        lm_t, lm_s1 = thread_order(lm.packed[None]), lm.scales[None]
        lm_g1 = lm.global_scale.float().reshape(1, -1) if lm.global_scale.dim() else lm.global_scale.float()

    def regs_call(cfg=None, **kw):
        if cfg is not None:
            raise ValueError("w4a16_regs takes no launch config")
        return w4a16_regs_launch(**kw)

    cases = []  # (name, [calls], [calls(config)]): several inputs per case, as a graph of decode steps would see;
    #             the second list takes a launch config (the --stages sweep)
    for tokens, bm in ((32, 16), (1024, 64)):
        gate_up, down, regs_gate_up, regs_down = [], [], [], []
        for _ in range(4):
            idx = torch.stack([torch.randperm(256, device=dev, generator=gen)[:8] for _ in range(tokens)])
            routing = moe_align(idx, 256, bm)
            x = torch.randn(tokens, 2048, device=dev, generator=gen).to(torch.bfloat16)
            h = torch.randn(tokens * 8, 512, device=dev, generator=gen).to(torch.bfloat16)
            gate_up.append(lambda cfg=None, x=x, r=routing: w4a16_grouped_swapped_launch(
                x, w13f, w13.scales, w13.global_scale, r, a_div=8, swiglu=True, frag=True, config=cfg,
                block_n=tile[0], block_k=tile[1]))
            down.append(lambda cfg=None, h=h, r=routing: w4a16_grouped_swapped_launch(
                h, w2f, w2.scales, w2.global_scale, r, frag=True, config=cfg, block_n=tile[0], block_k=tile[1]))
            routings = {bm: routing, 8: moe_align(idx, 256, 8)} if args.regs and bm == 16 else {}
            for build in regs_builds if routings else ():
                r, kw = routings[build[0]], regs_kw(build)
                regs_gate_up.append((build, lambda cfg=None, x=x, r=r, kw=kw: regs_call(
                    cfg, x=x, packed_thread=w13t, scales=w13.scales, global_scale=w13.global_scale, routing=r,
                    a_div=8, swiglu=True, **{**kw, "early": False})))  # early: the down projection's only
                regs_down.append((build, lambda cfg=None, h=h, r=r, kw=kw: regs_call(
                    cfg, x=h, packed_thread=w2t, scales=w2.scales, global_scale=w2.global_scale, routing=r, **kw)))
        cases += [(f"experts gate_up, {tokens} tokens", gate_up), (f"experts down, {tokens} tokens", down)]
        for build in dict.fromkeys(v for v, _ in regs_gate_up):
            tag = f"{tokens} tokens, {regs_tag(build)}"
            cases += [(f"regs experts gate_up, {tag}", [c for v, c in regs_gate_up if v == build]),
                      (f"regs experts down, {tag}", [c for v, c in regs_down if v == build])]
    for rows in (1, 16, 32):
        xs = [torch.randn(rows, 2048, device=dev, generator=gen).to(torch.bfloat16) for _ in range(4)]
        block_m = 16 if rows <= 16 else 32  # `_frag_dense_launch`'s
        lm_g = lm_frag.global_scale.float().reshape(1, -1) if lm_frag.global_scale.dim() else lm_frag.global_scale
        cases.append((f"lm_head, {rows} rows", [
            lambda cfg=None, x=x: w4a16_linear_frag_triton(x, lm_frag) if cfg is None else
            w4a16_grouped_swapped_launch(x, lm_frag.packed[None], lm_frag.scales[None], lm_g,
                                         dense_routing(x.shape[0], block_m), frag=True, config=cfg)
            for x in xs]))
        if rows > 1 and lm_builds:
            # the rows in order, all of the one expert, no padding block (moe_align's would add an empty program a
            # column tile): as a dense lm_head path would route them
            one = {bm: MoeRouting(torch.arange(rows, dtype=torch.int32, device=dev),
                                  torch.zeros(rows // bm, dtype=torch.int32, device=dev), rows, bm, 1)
                   for bm in (8, 16)}
            for build in lm_builds:
                cases.append((f"regs lm_head, {rows} rows, {regs_tag(build)}", [
                    lambda cfg=None, x=x, r=one[build[0]], kw=regs_kw(build): regs_call(
                        cfg, x=x, packed_thread=lm_t, scales=lm_s1, global_scale=lm_g1, routing=r, **kw)
                    for x in xs]))

    other = torch.load(args.compare) if args.compare else None
    outputs, rows_out = {}, []
    for name, calls in cases:
        try:
            outs = [c() for c in calls]
            torch.cuda.synchronize()
            outputs[name] = [o.cpu() for o in outs]
            row = dict(case=name, us=round(graph_per_call_us(calls * 5), 2))
        except Exception as exc:  # noqa: BLE001 -- a build that fails to compile or launch is a result (the Gluon
            row = dict(case=name, error=f"{type(exc).__name__}: {exc}"[:400])  # kernel's first runs); the rest go on
            rows_out.append(row)
            print("[swapped_ab]", args.label, json.dumps(row), flush=True)
            continue
        if name.startswith("regs "):  # the Gluon kernel against the swap-AB kernel on the same inputs
            base = name[5:name.index(", ahead")]  # the swap-AB case of the same inputs (16-row blocks)
            row["equal_to_swapped"] = all(torch.equal(a, b) for a, b in zip(outputs[name], outputs[base]))
            # within bf16 rounding (8-row blocks run wgmma N 8, whose sums need not round alike)
            row["close_to_swapped"] = all(torch.allclose(a.float(), b.float(), rtol=2**-7,
                                                         atol=1e-3 * float(b.float().abs().max()))
                                          for a, b in zip(outputs[name], outputs[base]))
        if other is not None:
            row["equal_to_other"] = name in other and all(torch.equal(a, b) for a, b in zip(outputs[name],
                                                                                          other[name]))
        rows_out.append(row)
        print("[swapped_ab]", args.label, json.dumps(row), flush=True)
        for cfg in sweep:
            staged = [lambda c=c, cfg=cfg: c(dict(cfg)) for c in calls]  # a copy: the launcher pops BLOCK_N
            srow = dict(case=name, config=cfg)
            try:
                same = all(torch.equal(o.cpu(), r) for o, r in zip([c() for c in staged], outputs[name]))
                srow.update(us=round(graph_per_call_us(staged * 5), 2), equal_to_default=same)
            except Exception as exc:  # noqa: BLE001 -- a refused or failed config is a result of the sweep
                srow.update(error=f"{type(exc).__name__}: {exc}"[:300])
            rows_out.append(srow)
            print("[swapped_ab]", args.label, json.dumps(srow), flush=True)
    if args.save:
        torch.save(outputs, args.save)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import kernels

    meta = dict(label=args.label, expert_tile=list(tile), device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, pdl=pdl.enabled(), kernels=str(Path(kernels.__file__).parent))
    (out / f"swapped_ab{('_' + args.label) if args.label else ''}.json").write_text(
        json.dumps(dict(meta=meta, results=rows_out), indent=1))


if __name__ == "__main__":
    main()
