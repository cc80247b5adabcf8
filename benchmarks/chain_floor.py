"""The floor under a lone decode step: what one launch in a chain of dependent launches costs on this GPU, by how
many bytes it reads, with and without programmatic dependent launch (kernels/pdl.py), in one CUDA graph.

Why: a lone Qwen decode step is a chain of ~550 kernels (~415 on the critical path) taking ~2.3 ms on the H200;
removing 30 small launches (the GDN gated norm fused into the recurrent step) or prefetching weights before the PDL
wait changed nothing measurable (benchmarks/RESULTS.md, Qwen runs 54-55). This measures the chain itself: a kernel
whose programs each sum an 8 KB slice of a buffer (int32 words: memory-bound, ~no arithmetic) and store the sum;
chains of N such launches over buffers cycled so that a launch's bytes are not L2-resident; per launch: the graph
replay time / N, and the bytes / that time.

    python benchmarks/chain_floor.py --out DIR [--launches 200] [--replays 20]

Rows: bytes per launch (0: one program reading nothing -- the pure dependent-launch cost), programs (bytes / 8 KB),
us per launch with PDL off and on, TB/s. A step's floor is then roughly the sum over its critical kernels of the row
for their bytes; the gap between that and the measured step is the kernels' own inefficiency.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_per_call_us  # noqa: E402  (the scripts' shared GPU timer)
from kernels import pdl  # noqa: E402

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
except ImportError:  # pragma: no cover - the benchmark needs triton
    triton = None

WORDS = 2048  # int32 words a program reads: 8 KB, the slice size of the decode GEMVs' programs (4-8 rows x 1-2 KB)
SIZES_MB = (0, 0.5, 1, 2, 4, 8, 16, 25)  # the Qwen step's kernels: norms (0), router (1), experts (5-10), FP8 (8-25)

if triton is not None:

    @triton.jit
    def _chain_kernel(buf, sums, WORDS: tl.constexpr, READ: tl.constexpr, USE_PDL: tl.constexpr = False):
        # program p: sums[p] = sum of buf[p WORDS : (p + 1) WORDS] (READ), else sums[p] = p
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        p = tl.program_id(0)
        if READ:
            tl.store(sums + p, tl.sum(tl.load(buf + p.to(tl.int64) * WORDS + tl.arange(0, WORDS))))
        else:
            tl.store(sums + p, p)


def launch(buf: torch.Tensor, sums: torch.Tensor, programs: int, read: bool) -> None:
    """One launch of `programs` programs (PDL per the module setting)."""
    _chain_kernel[(programs,)](buf, sums, WORDS=WORDS, READ=read, num_warps=4, **pdl.launch_options())


def measure(size_mb: float, launches: int, replays: int, device) -> dict:
    """us per launch of a graphed chain of `launches` launches reading size_mb each (buffers cycled: >= 2x the L2)."""
    programs = max(1, int(size_mb * 2**20) // (WORDS * 4))
    read = size_mb > 0
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    nbuf = max(1, -(-2 * l2 // max(1, programs * WORDS * 4))) if read else 1
    bufs = [torch.randint(0, 7, (programs * WORDS,), dtype=torch.int32, device=device) for _ in range(nbuf)]
    sums = torch.empty(programs, dtype=torch.int32, device=device)
    # one CUDA graph of the chain, median of `replays` timed replays (`cuda_timing.graph_per_call_us`: its warm-up
    # calls compile outside the capture)
    us = graph_per_call_us([lambda i=i: launch(bufs[i % nbuf], sums, programs, read) for i in range(launches)],
                           replays=replays)
    if read:  # the chain computed what it should (the last launch's sums)
        want = bufs[(launches - 1) % nbuf].view(programs, WORDS).sum(1, dtype=torch.int32)
        assert torch.equal(sums, want), "chain_floor: wrong sums"
    bytes_ = programs * WORDS * 4 if read else 0
    return dict(size_mb=size_mb, programs=programs, buffers=nbuf, us_per_launch=us,
                tb_per_s=bytes_ / us / 1e6 if read else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES_MB), help="MB per launch, comma-separated")
    args = ap.parse_args()
    if triton is None or not torch.cuda.is_available():
        print("chain_floor: needs triton and a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.perf_counter()
    for size in (float(s) for s in args.sizes.split(",")):
        row = {}
        for on in (False, True):
            if on and not pdl.device_supports(device):
                continue
            pdl.set_enabled(on)
            row["pdl" if on else "plain"] = measure(size, args.launches, args.replays, device)
        pdl.set_enabled(False)
        rows.append(row)
        r, pdl_us = row.get("pdl", row["plain"]), row.get("pdl", {}).get("us_per_launch", float("nan"))
        print(f"[chain_floor] {size:5.1f} MB x {r['programs']:5d} programs: plain "
              f"{row['plain']['us_per_launch']:7.2f} us, PDL {pdl_us:7.2f} us per launch "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    meta = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                launches=args.launches, replays=args.replays, words_per_program=WORDS)
    (out / "chain_floor.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# chain_floor ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}; "
             f"{args.launches} launches a graph, median of {args.replays} replays)", "",
             "| MB a launch | programs | us a launch, plain | us a launch, PDL | TB/s, PDL |",
             "|---:|---:|---:|---:|---:|"]
    for row in rows:
        p, q = row["plain"], row.get("pdl", {})
        tb = q.get("tb_per_s")
        lines.append(f"| {p['size_mb']:g} | {p['programs']} | {p['us_per_launch']:.2f} | "
                     f"{q.get('us_per_launch', float('nan')):.2f} | {'-' if tb is None else f'{tb:.2f}'} |")
    (out / "chain_floor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
