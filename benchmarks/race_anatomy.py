"""What a racing swap-AB call gets wrong: the anatomy of the nondeterministic 8-column groups that some builds of
`kernels/w4a16_swapped.py` produce at 3 pipeline stages (RESULTS.md, twenty-sixth to twenty-eighth sessions).

    python benchmarks/race_anatomy.py --out benchmarks/results/race_anatomy      # GPU; ~1 min

The build that raced most at d149e84 is the dense (lm_head) 16-row build at 3 stages: ~0.6% of calls at 1 row. This
script repeats it (`--calls`) on one input, takes the same call's 2-stage build (0 of 20,000 differing) as the good
answer, and for every differing call explains the differing output columns against three hypotheses:
  - stale epilogue data: the bad 8 values equal some other aligned 8-column chunk of the good output (the epilogue
    stages each thread's 16-byte chunk through shared memory: `stmatrix.trans`, `bar.sync`, `ld.shared.v4`);
  - a K slice counted wrongly: bad - good (both divided by the row's global scale) equals minus, plus or a swap of
    one half-tile's partial sum (the kernel's two MMAs per K tile of 128, 64 K each), computed in fp32 here from the
    dequantised weights;
  - none of these (the residuals say how far each came).
Random weights; the inputs are fixed, so every call is the same computation and any difference is the kernel's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HALF = 64  # K per MMA in the kernel (a K tile of 128 in two halves)


def explain(good, bad, x_row, w_cols, g_cols) -> dict:
    """One differing group. good / bad [C] (bf16 output values of C columns of one row), x_row [K] fp32, w_cols [C, K]
    fp32 block values (E2M1 x block scale, no global), g_cols [C] global scales -> the hypotheses' residuals."""
    import torch

    z_good = good.float() / g_cols
    z_bad = bad.float() / g_cols
    parts = (w_cols * x_row).unflatten(1, (-1, HALF)).sum(-1)  # [C, K / 64] fp32 half-tile partial sums
    total = parts.sum(1)  # [C]
    d = z_bad - z_good  # [C]
    tol = total.abs() * 2.0**-7 + parts.abs().max(1).values * 2.0**-20  # a bf16 rounding of the output, and slack
    out = dict(d_over_total=(d / total.abs().clamp_min(1e-30)).tolist(), good_vs_fp32=((z_good - total) /
               total.abs().clamp_min(1e-30)).abs().max().item())
    for name, cand in (("missing", -parts), ("doubled", parts)):
        res = (d[:, None] - cand).abs()  # [C, S]
        best = res.argmin(1)
        out[name] = dict(slice=best.tolist(), within_rounding=(res.gather(1, best[:, None])[:, 0] <= tol).tolist())
    # one half-tile replaced by another (a stale or early buffer): d = parts[j'] - parts[j]
    swap = (d[:, None, None] - (parts[:, None, :] - parts[:, :, None])).abs()  # [C, j, j']
    flat = swap.flatten(1).argmin(1)
    s = parts.shape[1]
    out["swapped"] = dict(slice=(flat // s).tolist(), by=(flat % s).tolist(),
                          within_rounding=(swap.flatten(1).gather(1, flat[:, None])[:, 0] <= tol).tolist())
    out["bad_is_zero"] = bool((bad == 0).all())
    out["bad_finite"] = bool(torch.isfinite(bad.float()).all())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/race_anatomy")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rows", default="1,16", help="activation rows per case")
    ap.add_argument("--events", type=int, default=12, help="differing calls explained per case")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--settle", action="store_true", help="the 3-stage build with SETTLE (the launcher's default; "
                    "without this flag the build runs without it, as the race was found)")
    args = ap.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("race_anatomy needs a CUDA GPU")
    from random_packed import random_nvfp4

    from kernels import pdl
    from kernels.nvfp4 import nvfp4_block_values
    from kernels.w4a16_swapped import SPLIT_TILE, dense_routing, split_frag, w4a16_grouped_swapped_launch

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    pdl.set_enabled(pdl.device_supports())
    lm = random_nvfp4((1, 248_320, 2048), dev, gen)
    lm_frag = split_frag(lm.packed, *SPLIT_TILE)
    t_end = time.perf_counter() + args.budget_s
    cases = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 2048, device=dev, generator=gen).to(torch.bfloat16)

        def call(stages, x=x, rows=rows):
            return w4a16_grouped_swapped_launch(x, lm_frag, lm.scales, lm.global_scale, dense_routing(rows, 16),
                                                frag=True, deq=2, config=dict(num_warps=4, num_stages=stages),
                                                unverified=True, settle=args.settle)

        good = call(2)
        again = call(2)
        case = dict(rows=rows, block_m=16, stages=3, settle=args.settle, pdl=pdl.enabled(), two_stage_repeat_equal=bool(torch.equal(
            good, again)), first_three_stage_equal=bool(torch.equal(call(3), good)), events=[])
        bad_calls = calls = 0
        good_chunks = good.view(-1, 8)  # every aligned 8-column chunk of the good output (N % 8 == 0)
        for _ in range(args.calls):
            if time.perf_counter() > t_end:
                break
            y = call(3)
            calls += 1
            if torch.equal(y, good):
                continue
            bad_calls += 1
            if len(case["events"]) >= args.events:
                continue
            where = (y != good).nonzero()  # [n, 2] (row, column)
            ev = dict(n_values=int(where.shape[0]), groups=[])
            for r in where[:, 0].unique().tolist():
                cols = where[where[:, 0] == r, 1]
                for c0 in sorted({int(c) // 8 * 8 for c in cols.tolist()}):
                    cs = torch.arange(c0, c0 + 8, device=dev)
                    chunk = y[r, c0:c0 + 8]
                    same = (good_chunks == chunk).all(1).nonzero().flatten()[:4]
                    w_cols = nvfp4_block_values(lm.packed[0, cs], lm.scales[0, cs])  # [8, K] fp32
                    grp = dict(row=r, col0=c0, cols_differing=[int(c) for c in cols.tolist() if c0 <= c < c0 + 8],
                               bad=chunk.float().tolist(), good=good[r, c0:c0 + 8].float().tolist(),
                               bad_equals_good_chunk_at=[(int(i) // (good.shape[1] // 8), int(i) % (good.shape[1] // 8)
                                                          * 8) for i in same.tolist()])
                    grp.update(explain(good[r, c0:c0 + 8], chunk, x[r].float(), w_cols, lm.global_scale[0, cs]))
                    ev["groups"].append(grp)
            case["events"].append(ev)
        case.update(calls=calls, differing_calls=bad_calls)
        cases.append(case)
        print("[race_anatomy]", json.dumps(dict(rows=rows, calls=calls, differing=bad_calls,
                                                 first=case["events"][:1]))[:1500], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    (out / "race_anatomy.json").write_text(json.dumps(dict(meta=meta, cases=cases), indent=1))


if __name__ == "__main__":
    main()
