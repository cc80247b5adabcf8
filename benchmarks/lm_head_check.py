"""lm_head on the swap-AB kernel (op "w4a16_linear_frag", weights in fragment order) checked at full size on a GPU
against the engine's checkpoint-layout path, to find what gave Qwen runs 39-41 one wrong step: in one mixed
(prefill + decode) eager step, every row's greedy token landed on ~6 adjacent vocab ids of one 64-row weight tile,
in 3 of 4 split_frag engines (with and without async_decode), never in the checkpoint layout's engines.

    python benchmarks/lm_head_check.py --out benchmarks/results/lm_head_check      # GPU; ~1-2 min

1. every row count 1-64, one call each: the largest difference per 64-column tile relative to the checkpoint path's
   max |y|, and whether each row's argmax agrees (deterministic bugs: a row count, a partial row block, a tile);
2. the engine's eager chain repeated (`--iters` times, row counts 17-40 at random, the allocator churned between
   iterations): gather rows -> the final RMSNorm (a PDL participant) -> lm_head -> argmax; its output compared bit for
   bit with the same call after a device sync (the kernel is deterministic), with PDL on, then off (timing bugs).

Random weights in the checkpoint's layout; the values change no timing, and both paths see the same bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/lm_head_check")
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=400)
    args = ap.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("lm_head_check needs a CUDA GPU")
    from random_packed import random_nvfp4

    from kernels import pdl
    from kernels.rms_norm import rms_norm_zc_op
    from kernels.w4a16_gemm import w4a16_linear_triton
    from kernels.w4a16_gemv import w4a16_linear_gemv
    from kernels.w4a16_swapped import linear_to_frag, w4a16_linear_frag_triton

    dev, n, k = torch.device("cuda"), args.vocab, args.hidden
    gen = torch.Generator(device=dev).manual_seed(0)
    w = random_nvfp4((n, k), dev, gen)
    frag = linear_to_frag(w)

    def checkpoint_path(x):
        return w4a16_linear_gemv(x, w) if x.shape[0] == 1 else w4a16_linear_triton(x, w)

    out: dict = dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                               triton=triton.__version__, vocab=n, hidden=k))
    pdl.set_enabled(pdl.device_supports())
    sweep = []
    for rows in range(1, 65):
        x = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
        ref, got = checkpoint_path(x).float(), w4a16_linear_frag_triton(x, frag).float()
        torch.cuda.synchronize()
        tile_err = ((got - ref).abs().amax(0).reshape(-1, 64).amax(1) / ref.abs().max())  # [N / 64]
        worst = int(tile_err.argmax())
        sweep.append(dict(rows=rows, max_rel=float(tile_err.max()), worst_tile=worst,
                          argmax_equal=int((got.argmax(1) == ref.argmax(1)).sum()),
                          nonfinite=int((~torch.isfinite(got)).sum())))
    bad = [s for s in sweep if s["max_rel"] > 1e-2 or s["nonfinite"]]
    out["sweep"] = dict(rows=sweep, bad=bad)
    print("[lm_head_check] sweep: worst max_rel", max(s["max_rel"] for s in sweep), "bad rows", bad[:8], flush=True)

    norm_w = (0.1 * torch.randn(k, device=dev, generator=gen)).to(torch.bfloat16)
    for use_pdl in (True, False):
        pdl.set_enabled(use_pdl and pdl.device_supports())
        mismatches, samples = 0, []
        for it in range(args.iters):
            rows = int(torch.randint(17, 41, (1,)))
            tokens = rows + int(torch.randint(0, 2048, (1,)))  # a mixed step: more tokens than sampled rows
            hidden = torch.randn(tokens, k, device=dev, generator=gen).to(torch.bfloat16)
            idx = torch.randperm(tokens, device=dev, generator=gen)[:rows]
            churn = torch.empty(int(torch.randint(1, 64, (1,))) << 18, dtype=torch.uint8, device=dev).fill_(0x7F)
            x = rms_norm_zc_op(hidden[idx], norm_w, 1e-6)
            y1 = w4a16_linear_frag_triton(x, frag)
            ids = y1.argmax(1)
            del churn, hidden
            torch.cuda.synchronize()
            y2 = w4a16_linear_frag_triton(x, frag)  # the same call after a sync: the kernel is deterministic
            torch.cuda.synchronize()
            ref = checkpoint_path(x).float()
            if not torch.equal(y1, y2):
                mismatches += 1
                cols = (y1 != y2).any(0).nonzero().flatten()
                if len(samples) < 8:
                    samples.append(dict(iter=it, rows=rows, differing_columns=int(cols.numel()),
                                        first_columns=cols[:8].tolist(),
                                        rows_with_wrong_argmax=int((ids != ref.argmax(1)).sum())))
        key = "chain_pdl" if use_pdl else "chain_no_pdl"
        out[key] = dict(iters=args.iters, mismatching_iters=mismatches, samples=samples, pdl=pdl.enabled())
        print(f"[lm_head_check] {key}: {mismatches} of {args.iters} iterations whose output differs from the same "
              f"call after a sync; {samples[:3]}", flush=True)
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "lm_head_check.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
