"""Does a kernel launched with programmatic dependent launch (PDL) right after a CUDA graph replay wait for the graph?

Why. gpu_next step 133 (thirty-seventh session) ran the greedy argmax (`kernels/argmax_rows.py`) with PDL after the
decode / prefill graph replays, and every stream's greedy tokens changed, deterministically: the kernel's
`griddepcontrol.wait` seemed not to wait for the graph's last kernel (lm_head), so it read the logits buffer before
lm_head wrote it. Here, on the GPU alone: a graph whose last work writes logits [B, V] from inputs refreshed before
each replay, then `argmax_rows_triton` on them with PDL and without, each against `torch.argmax` after a sync.

    python benchmarks/pdl_after_graph.py [--iters 50]

Prints one JSON line a mode: the replays whose argmax differed from torch's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("pdl_after_graph: needs a CUDA GPU", file=sys.stderr)
        return 2
    from kernels import argmax_rows, pdl

    dev = torch.device("cuda")
    v, h = 248_320, 2048
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16, generator=gen)  # an lm_head-sized GEMM: ~100 us
    x = torch.randn(args.rows, h, device=dev, dtype=torch.bfloat16, generator=gen)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        logits = x @ w.T  # warm-up, then the capture
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = x @ w.T
    results = {}
    for mode in ("pdl", "plain", "pdl"):
        pdl.set_enabled(mode == "pdl" and pdl.device_supports())
        argmax_rows.PDL_LAUNCH = mode == "pdl"
        bad = 0
        for _ in range(args.iters):
            x.copy_(torch.randn(args.rows, h, device=dev, dtype=torch.bfloat16, generator=gen))
            graph.replay()
            got = argmax_rows.argmax_rows_triton(logits)
            torch.cuda.synchronize()
            bad += int(not torch.equal(got, torch.argmax(logits, dim=-1)))
        results.setdefault(mode, []).append(bad)
        print(json.dumps(dict(mode=mode, pdl_enabled=pdl.enabled(), replays=args.iters, argmax_differed=bad)),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
