"""The GDN decode prep with b / a inside (`kernels/gdn_prep.py` "gdn_decode_prep_ba") per call at decode sizes, by
launch tiling: the order of the gate inputs (BA_FIRST), the b / a dot products' step (BA_BLOCK_H) and warps.

    python benchmarks/gdn_prep_bench.py --out out/gdn_prep      # on the GPU machine; gdn_prep_bench.{json,md}

Qwen3.6-35B-A3B's GDN layer: Hk 16, Hv 32, Dk = Dv 128, conv K 4 (C = 8,192 channels), hidden 2,048, bf16, D = 1 and
32 rows (a lone request; 32 streams). Each timed graph holds one call per GDN layer (30), each on its own inputs,
weights and conv pool, as a decode step runs them (their w_ba, 256 KB each, are then not all L2-hot from the call
before), with programmatic dependent launch as the engine has it on Hopper; -> us per call (`graph_per_call_us`).
Every tiling's outputs are compared with the default's: q / k / v / the pool bit for bit, b / a by fp32 order (the
fraction of equal bf16 values), and all of them with the reference by the op's `compare_ba`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_per_call_us  # noqa: E402
from kernels import gdn_prep, pdl  # noqa: E402

HK, DK, R, DV, HIDDEN, LAYERS = 16, 128, 2, 128, 2048, 30
# (BA_FIRST, BA_BLOCK_H, NUM_WARPS), timed after the module's default (DEFAULT_TILING; (False, 512, 4) until run 2)
TILINGS = [(False, 512, 4), (True, 512, 4), (True, 1024, 4), (True, 2048, 4), (True, 2048, 8), (False, 2048, 4),
           (True, 1024, 8), (False, 512, 8)]


def layer_inputs(d: int, device) -> list[tuple]:
    return [gdn_prep.random_inputs_ba(d, HK, DK, R, DV, hidden=HIDDEN, slots=d + 1, seed=100 * d + i, device=device)
            for i in range(LAYERS)]


def run(tiling: tuple, layers: list[tuple], pool0: torch.Tensor, split_v: bool = False) -> tuple[float, list]:
    """(us per call, the first layer's outputs on a copy of its pool as it was before any timed call, `pool0`) under
    `tiling`, split over 1 + R programs a k-head or not (`split_v`: gdn_prep.SPLIT_V_ROWS). The timed graphs advance
    the layers' pools in place, so the outputs are taken from `pool0` only."""
    gdn_prep.BA_FIRST, gdn_prep.BA_BLOCK_H, gdn_prep.NUM_WARPS = tiling
    gdn_prep.SPLIT_V_ROWS = layers[0][0].shape[0] if split_v else 0
    out = gdn_prep.gdn_decode_prep_ba_triton(layers[0][0], pool0.clone(), *layers[0][2:])
    calls = [lambda a=a: gdn_prep.gdn_decode_prep_ba_(*a) for a in layers]  # the pools advance: values do not matter
    return graph_per_call_us(calls, replays=20), [t.clone() for t in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gdn_prep_bench")
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--split-v", action="store_true",
                    help="also the default tiling with SPLIT_V (a k-head's work over 1 + R programs; the same bits)")
    ap.add_argument("--default-only", action="store_true", help="no other tilings than the default (and --split-v)")
    args = ap.parse_args()
    device = torch.device("cuda")
    pdl.set_enabled(not args.no_pdl and pdl.device_supports(device))
    default = gdn_prep.DEFAULT_TILING
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, pdl=pdl.enabled(), rows={})
    lines = ["| rows | BA_FIRST | BA_BLOCK_H | warps | us per call | b / a equal to the default's | compare_ba |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for d in (int(r) for r in args.rows.split(",")):
        layers = layer_inputs(d, device)
        pool0 = layers[0][1].clone()
        ref = gdn_prep.gdn_decode_prep_ba_reference(layers[0][0], pool0.clone(), *layers[0][2:])
        base = None
        rows = []
        runs = [(default, False)] + [(t, False) for t in TILINGS if t != default and not args.default_only] + (
            [(default, True)] if args.split_v else [])
        for tiling, split_v in runs:
            us, out = run(tiling, layers, pool0, split_v)
            base = base or out
            same_qkv = all(torch.equal(out[i], base[i]) for i in (0, 1, 2, 6))
            ba_equal = float((out[5] == base[5]).float().mean())
            problem = gdn_prep.compare_ba(out, ref)
            rows.append(dict(ba_first=tiling[0], ba_block_h=tiling[1], warps=tiling[2], split_v=split_v, us=us,
                             qkv_pool_same=same_qkv, ba_equal=ba_equal, compare_ba=problem or "ok"))
            lines.append(f"| {d} | {tiling[0]} | {tiling[1]} | {tiling[2]}{' SPLIT_V' if split_v else ''} | {us:.2f} | "
                         f"{ba_equal:.3f}{'' if same_qkv else ' (q/k/v DIFFER)'} | {problem or 'ok'} |")
            print(f"[gdn_prep_bench] rows {d} {tiling} split_v={split_v}: {us:.2f} us, b/a equal {ba_equal:.3f}, "
                  f"qkv same {same_qkv}, {problem or 'ok'}", flush=True)
        results["rows"][d] = rows
    gdn_prep.BA_FIRST, gdn_prep.BA_BLOCK_H, gdn_prep.NUM_WARPS = default
    gdn_prep.SPLIT_V_ROWS = 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_prep_bench.json").write_text(json.dumps(results, indent=1))
    (out / "gdn_prep_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
