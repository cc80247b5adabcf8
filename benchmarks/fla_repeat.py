"""Does fla's GDN chunked prefill (`kernels/gdn_chunk.py` -> fla-core's chunk_gated_delta_rule) give the same bits
when repeated on the same inputs? Two builds of its chunk_fwd_kernel_o in the engine's Triton cache (H200) leave
register-input wgmma groups in flight at their loop's back edge -- the PTX pattern under which ptxas before CUDA 13.3
corrupted the swap-AB kernel (kernels/w4a16_swapped.py, SETTLE) -- but their SASS has no write into an in-flight A
register (`benchmarks/sass_loop.py` `writes_into_in_flight_a_registers`: 0 in all 10 cached builds, against 74-108
in the racing swap-AB builds), so no race is expected. This checks that empirically at the engine's prefill shapes;
run it under Triton's own ptxas and a newer one (TRITON_PTXAS_PATH) to compare.

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
    from triton import knobs

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the assembler Triton actually runs (it falls back to its own when TRITON_PTXAS_PATH does not run)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                ptxas=str(knobs.nvidia.ptxas.path), ptxas_version=str(knobs.nvidia.ptxas.version),
                ptxas_env=os.environ.get("TRITON_PTXAS_PATH", ""))
    print("[fla_repeat]", json.dumps(meta), flush=True)
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
        r = dict(tokens=sum(lengths), sequences=len(lengths), calls=calls, differing_calls=bad)
        results.append(r)
        print("[fla_repeat]", json.dumps(r), flush=True)
        # after every case, so a time limit keeps what was measured
        (out / "fla_repeat.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))


if __name__ == "__main__":
    main()
