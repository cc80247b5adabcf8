"""The TMA-ring expert kernel (`kernels/w4a16_tma.py`) beside the register-streamed one it would replace
(`kernels/w4a16_regs.py` at its ENGINE_BUILDS), per call, on the same inputs: every output compared bit for bit with
the register kernel's (the two should agree exactly: same decode, same wgmma order), and us per call from CUDA-graph
replays of 4 routings (`cuda_timing.graph_per_call_us`), PDL as the engine launches them. Random packed weights in
the checkpoint's format, 256 experts of Qwen3.6's shapes (gate_up [256, 1024, 2048], down [256, 2048, 512]); speed
does not depend on the values. Tokens: decode at 1 (a lone stream) and 32 streams (top-8, 8-row blocks).

    python benchmarks/w4a16_tma_bench.py --out DIR [--builds '[[2, 4, 256], [4, 2, 256]]'] [--tokens 1,32]

Writes DIR/w4a16_tma_bench.json and .md, and DIR/best_builds.json: the fastest bit-exact TMA build per projection
at the largest token count, as qwen_gpu.py --regs-builds JSON (the register build kept where no TMA build beat it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# [tiles, stages, w_cols, cols]: the forty-eighth session's first sweep (H100: 2 x 2 best, deeper rings no help, one
# program an SM -- 2 x 6, 4 x 3 -- far worse), then column tiles a program (one routing load and activation fill for
# several column tiles, the next one's first stages in flight while the last ones of the one before are read); then
# (forty-ninth session, for the H200, whose 4.8 TB/s needs ~1.4x the H100's bytes in flight) 4 stages of 2 tiles at
# one column (107 KB of shared memory a program at gate_up: still 2 programs an SM)
DEFAULT_BUILDS = [[2, 2, 256, 1], [2, 3, 256, 1], [2, 4, 256, 1], [4, 2, 256, 1], [2, 2, 256, 2],
                  [2, 3, 256, 2], [2, 4, 256, 2], [2, 3, 256, 4], [2, 4, 256, 4], [4, 2, 256, 2], [2, 4, 256, 8]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--builds", default=json.dumps(DEFAULT_BUILDS),
                    help="JSON list of [tiles, stages, w_cols(, cols)]; a build a projection cannot take (cols not "
                         "dividing its column tiles) is skipped for it")
    ap.add_argument("--tokens", default="1,32")
    args = ap.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("w4a16_tma_bench needs a CUDA GPU")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_timing import graph_per_call_us
    from random_packed import random_nvfp4

    from kernels import pdl, w4a16_regs
    from kernels.w4a16_gemm import moe_align
    from kernels.w4a16_regs import ENGINE_BUILDS, fit_build, launch_build, thread_order

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    pdl.set_enabled(pdl.device_supports())
    w13, w2 = random_nvfp4((256, 1024, 2048), dev, gen), random_nvfp4((256, 2048, 512), dev, gen)
    w13t, w2t = thread_order(w13.packed), thread_order(w2.packed)
    builds = json.loads(args.builds)
    rows, regs_us = [], {}
    for tokens in [int(v) for v in args.tokens.split(",")]:
        inputs = []
        for _ in range(4):
            idx = torch.stack([torch.randperm(256, device=dev, generator=gen)[:8] for _ in range(tokens)])
            routing = moe_align(idx, 256, w4a16_regs.BLOCK_M)
            x = torch.randn(tokens, 2048, device=dev, generator=gen).to(torch.bfloat16)
            h = torch.randn(tokens * 8, 512, device=dev, generator=gen).to(torch.bfloat16)
            wts = torch.rand(tokens * 8, device=dev, generator=gen).to(torch.bfloat16)
            inputs.append((routing, x, h, wts))

        def calls(proj, build):
            if proj == "gate_up":
                b = fit_build({**build, "early": False}, 2048, 512)
                return [lambda r=r, x=x, b=b: launch_build(x, w13t, w13.scales, w13.global_scale, r, b, a_div=8,
                                                           swiglu=True) for r, x, _, _ in inputs]
            b = fit_build(build, 512, 2048)
            return [lambda r=r, h=h, w=w, b=b: launch_build(h, w2t, w2.scales, w2.global_scale, r, b, row_scale=w)
                    for r, _, h, w in inputs]

        for proj in ("gate_up", "down"):
            base = calls(proj, ENGINE_BUILDS[proj])
            want = [c() for c in base]
            torch.cuda.synchronize()
            us = graph_per_call_us(base * 5)
            regs_us[(tokens, proj)] = us
            row = dict(tokens=tokens, proj=proj, build=dict(ENGINE_BUILDS[proj]), us=round(us, 2))
            rows.append(row)
            print("[tma_bench]", json.dumps(row), flush=True)
            for tiles, stages, w_cols, *rest in builds:
                build = dict(kernel="tma", tiles=tiles, stages=stages, w_cols=w_cols, cols=rest[0] if rest else 1)
                if (512 if proj == "gate_up" else 2048) % (64 * build["cols"]):
                    continue
                row = dict(tokens=tokens, proj=proj, build=build)
                try:
                    cs = calls(proj, build)
                    got = [c() for c in cs]
                    torch.cuda.synchronize()
                    row["equal_to_regs"] = all(torch.equal(a, b) for a, b in zip(got, want))
                    if not row["equal_to_regs"]:
                        row["max_abs_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
                    row["us"] = round(graph_per_call_us(cs * 5), 2)
                    row["vs_regs"] = round(row["us"] / us, 4)
                except Exception as exc:  # noqa: BLE001 -- a build that fails to compile or launch is a result
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                rows.append(row)
                print("[tma_bench]", json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                pdl=pdl.enabled(), block_m=w4a16_regs.BLOCK_M)
    (out / "w4a16_tma_bench.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    md = [f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, PDL {meta['pdl']}, "
          f"{meta['block_m']}-row blocks", "", "| tokens | proj | build | us a call | vs regs | bits |",
          "|---:|---|---|---:|---:|---|"]
    for r in rows:
        b = r["build"]
        name = (f"tma tiles {b['tiles']} stages {b['stages']} w_cols {b['w_cols']} cols {b['cols']}"
                if b.get("kernel") == "tma"
                else "regs " + ", ".join(f"{k} {v}" for k, v in b.items()))
        bits = "" if "equal_to_regs" not in r else ("same" if r["equal_to_regs"] else "DIFFER")
        md.append(f"| {r['tokens']} | {r['proj']} | {name} | {r.get('us', r.get('error', ''))} | "
                  f"{r.get('vs_regs', '')} | {bits} |")
    (out / "w4a16_tma_bench.md").write_text("\n".join(md) + "\n")
    # the fastest bit-exact TMA build per projection at the largest token count, if it beats the register build
    top = max(r["tokens"] for r in rows)
    best = {"block_m": w4a16_regs.BLOCK_M}
    for proj in ("gate_up", "down"):
        ok = [r for r in rows if r["tokens"] == top and r["proj"] == proj and r.get("equal_to_regs") and "us" in r]
        pick = min(ok, key=lambda r: r["us"], default=None)
        best[proj] = (pick["build"] if pick and pick["us"] < regs_us[(top, proj)]
                      else {k: v for k, v in ENGINE_BUILDS[proj].items()})
    (out / "best_builds.json").write_text(json.dumps(best))
    print("[tma_bench] best", json.dumps(best), flush=True)


if __name__ == "__main__":
    main()
