"""The GDN decode prep and recurrent step in one launch (`kernels/gdn_prep_step.py` "gdn_decode_prep_step") per
GDN layer at decode sizes, beside the two launches it replaces (the prep with b / a inside, then the step over the
state pool), by launch: state columns a program, warps, and what its early loads take before the PDL wait.

    python benchmarks/gdn_prep_step_bench.py --out out/prep_step    # on the GPU machine: gdn_prep_step_bench.{json,md}

Qwen3.6-35B-A3B's GDN layer: Hk 16, Hv 32, Dk = Dv 128, conv K 4 (C = 8,192), hidden 2,048, bf16, an fp32 state
pool; D = 1, 8 and 32 rows. Each timed graph holds one layer's work per GDN layer (30), each on its own inputs,
weights, conv pool and state pool (2 MB a row), with programmatic dependent launch and early loads as the engine has
them on Hopper; -> us per layer (`graph_per_call_us`). Every build's outputs (o, both pools, from the first layer's
pools as they were before any timed call) are compared with the two launches' (bit for bit) and with the reference
(the op's `compare`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_per_call_us  # noqa: E402
from kernels import gdn_decode, gdn_prep, gdn_prep_step, pdl  # noqa: E402

HK, DK, R, DV, HIDDEN, LAYERS = 16, 128, 2, 128, 2048, 30
# (BLOCK_V, NUM_WARPS, TAPS_EARLY, BA_EARLY, OWN_GATES): the module's launch variables; BLOCK_V None: the step's rule
KNOBS = ("BLOCK_V", "NUM_WARPS", "TAPS_EARLY", "BA_EARLY", "OWN_GATES")
BUILDS = [(None, 4, False, False, False), (None, 8, False, False, False), (32, 8, False, False, False),
          (32, 8, True, True, False), (64, 8, False, False, False), (32, 4, False, False, False),
          (16, 4, False, False, False), (32, 8, False, False, True), (None, 8, False, False, True)]


def layer_inputs(d: int, device) -> list[tuple]:
    """Each layer's inputs; b / a exact in any summation order (`random_inputs`' exact_ba), so that the comparison
    with the reference is about the rest."""
    return [gdn_prep_step.random_inputs(d, HK, DK, R, DV, hidden=HIDDEN, slots=d + 1, seed=100 * d + i,
                                        device=device, exact_ba=True) for i in range(LAYERS)]


def with_pools(args, conv, pool):
    return (args[0], conv, *args[2:8], pool, *args[9:])


def two_launches(args):
    q, k, v, beta, g = gdn_prep.gdn_decode_prep_ba_(*args[:8], *args[9:])[:5]
    return gdn_decode.gdn_decode_rows_(q, k, v, g, beta, args[8], args[2])


def fused(args):
    return gdn_prep_step._launch(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gdn_prep_step_bench")
    ap.add_argument("--rows", default="32,8,1")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--no-early", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda")
    pdl.set_enabled(not args.no_pdl and pdl.device_supports(device))
    pdl.set_early(not args.no_early)
    saved = tuple(getattr(gdn_prep_step, k) for k in KNOBS)
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, pdl=pdl.enabled(),
                   early=pdl.early(), rows={})
    lines = ["| rows | launch | us per layer | against two launches | bits as two launches | compare |",
             "|---:|---|---:|---:|---|---|"]
    for d in (int(r) for r in args.rows.split(",")):
        layers = layer_inputs(d, device)
        first = layers[0]
        conv0, pool0 = first[1].clone(), first[8].clone()
        ref = gdn_prep_step.gdn_decode_prep_step_reference(*with_pools(first, conv0.clone(), pool0.clone()))
        rows = []
        base_us = graph_per_call_us([lambda a=a: two_launches(a) for a in layers], replays=20)
        conv, pool = conv0.clone(), pool0.clone()
        base = (two_launches(with_pools(first, conv, pool)), conv, pool)
        problem = gdn_prep_step.compare(base, ref)
        rows.append(dict(launch="two launches", us=base_us, compare=problem or "ok"))
        lines.append(f"| {d} | prep + step (two launches) | {base_us:.2f} | 1.000 | - | {problem or 'ok'} |")
        print(f"[prep_step_bench] rows {d} two launches: {base_us:.2f} us, {problem or 'ok'}", flush=True)
        for build in BUILDS:
            for k, v in zip(KNOBS, build):
                setattr(gdn_prep_step, k, v)
            try:
                us = graph_per_call_us([lambda a=a: fused(a) for a in layers], replays=20)
                conv, pool = conv0.clone(), pool0.clone()
                out = (fused(with_pools(first, conv, pool)), conv, pool)
            except Exception as exc:  # noqa: BLE001 - recorded
                rows.append(dict(build=build, error=f"{type(exc).__name__}: {exc}"[:300]))
                print(f"[prep_step_bench] rows {d} {build}: {type(exc).__name__}: {exc}", flush=True)
                continue
            same = [torch.equal(x, y) for x, y in zip(out, base)]
            problem = gdn_prep_step.compare(out, ref)
            rows.append(dict(build=build, us=us, ratio=us / base_us, same_bits=same, compare=problem or "ok"))
            name = (f"fused, BLOCK_V {build[0] or 'rule'}, {build[1]} warps"
                    f"{', taps early' if build[2] else ''}{', b/a early' if build[3] else ''}"
                    f"{', own gates' if build[4] else ''}")
            bits = "yes" if all(same) else "o / conv / state " + "/".join("=" if s else "DIFFER" for s in same)
            lines.append(f"| {d} | {name} | {us:.2f} | {us / base_us:.3f} | {bits} | {problem or 'ok'} |")
            print(f"[prep_step_bench] rows {d} {name}: {us:.2f} us ({us / base_us:.3f}), bits {bits}, "
                  f"{problem or 'ok'}", flush=True)
        results["rows"][d] = rows
        del layers
        torch.cuda.empty_cache()
    for k, v in zip(KNOBS, saved):
        setattr(gdn_prep_step, k, v)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_prep_step_bench.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "gdn_prep_step_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
