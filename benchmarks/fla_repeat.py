"""Does fla's GDN chunked prefill (`kernels/gdn_chunk.py` -> fla-core's chunk_gated_delta_rule) give the same bits
when repeated on the same inputs? Some of its compiled kernels (chunk_fwd_kernel_o, from the engine's Triton cache)
leave register-input wgmma groups in flight at their K loop's back edge -- the pattern under which ptxas before CUDA
13.3 corrupted the swap-AB kernel (kernels/w4a16_swapped.py, SETTLE; benchmarks/sass_loop.py
`wgmma_groups_in_flight_at_back_edge`). This repeats the engine's prefill shapes and counts differing calls; run it
under Triton's own ptxas and under a newer one (TRITON_PTXAS_PATH) to compare.

    python benchmarks/fla_repeat.py --out DIR [--calls 3000]      # GPU with fla-core
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--budget-s", type=float, default=60.0, help="per case")
    args = ap.parse_args()
    import torch
    import triton

    from kernels.gdn_chunk import gdn_chunk_fla, random_inputs

    if not torch.cuda.is_available():
        sys.exit("fla_repeat needs a CUDA GPU")
    results = []
    # the engine's prefill: 32 value heads of 128 x 128 (q / k repeated to them), fp32; a lone 1k prompt and a burst
    for lengths in ((1024,), (1024,) * 8):
        args_ = random_inputs(lengths, 32, 128, 128, seed=len(lengths), device="cuda")
        call_args = (*args_, args_[-1].cpu())
        first = gdn_chunk_fla(*call_args)
        torch.cuda.synchronize()
        bad = calls = 0
        t_end = time.perf_counter() + args.budget_s
        while calls < args.calls and time.perf_counter() < t_end:
            out = gdn_chunk_fla(*call_args)
            calls += 1
            if not all(torch.equal(a, b) for a, b in zip(out, first)):
                bad += 1
        torch.cuda.synchronize()
        r = dict(tokens=sum(lengths), sequences=len(lengths), calls=calls, differing_calls=bad,
                 ptxas=os.environ.get("TRITON_PTXAS_PATH", "triton's own"))
        results.append(r)
        print("[fla_repeat]", json.dumps(r), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    (out / "fla_repeat.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))


if __name__ == "__main__":
    main()
