"""The read floor of the 32-stream expert calls: how fast a kernel that only READS the bytes the gate_up and down calls
read -- the same routed experts' thread-order tiles and block scales, the same grid of (row block, column tile)
programs, no decode and no math -- can run on this GPU, beside a plain sequential read of as many bytes. The gap
between the expert kernel (`w4a16_regs`) and this floor is its compute / latency overhead; the gap between this
floor and the sequential read is the access pattern's and the grid's (short programs, the routing's empty row blocks,
the wave tail).

    python benchmarks/expert_read_floor.py --out DIR

Cases (32 tokens, top-8 of 256 experts, 8-row blocks, 4 routings, CUDA-graph replays, us per call):
  - `routed`: grid (row blocks, column tiles) as the expert kernels launch it, empty blocks exiting at once;
  - `compact`: only the row blocks that hold pairs (the grid a compacted routing would launch);
  - `sequential`: the same number of bytes as one contiguous read, 4 or 8 programs an SM, grid-stride.
Each streams its words with Triton's software pipeline (num_stages 2-4 swept) as 16-byte loads and XORs them into a
value it stores (the XOR of every word it read: nothing optimised away, checkable). Random bytes; speed does not
depend on the values.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def _routed_read_kernel(w, s, block_expert, out, E, s_we, s_se, up_words, up_swords, KT: tl.constexpr,
                        SWORDS: tl.constexpr, SWIGLU: tl.constexpr):
    # one program = one (row block, column tile of 64 rows): its KT 4 KB word tiles (and the up projection's) and its
    # 64 scale rows of SWORDS int32 words each, as the expert kernels read them
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert + pid_m)
    if e < E:
        wb = w + e.to(tl.int64) * s_we + pid_n * (KT * 1024)
        offs = tl.arange(0, 1024)
        acc = tl.zeros([1024], tl.int32)
        for t in tl.range(KT):
            acc ^= tl.load(wb + t * 1024 + offs)
            if SWIGLU:
                acc ^= tl.load(wb + up_words + t * 1024 + offs)
        r = tl.arange(0, 64)[:, None] * SWORDS + tl.arange(0, SWORDS)[None, :]
        sb = s + e.to(tl.int64) * s_se + pid_n * (64 * SWORDS)
        sacc = tl.load(sb + r)
        if SWIGLU:
            sacc ^= tl.load(sb + up_swords + r)
        tl.store(out + pid_m * tl.num_programs(1) + pid_n,
                 tl.xor_sum(acc, axis=0) ^ tl.xor_sum(tl.xor_sum(sacc, axis=1), axis=0))


@triton.jit
def _sequential_read_kernel(w, out, n_tiles, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for t in tl.range(pid, n_tiles, tl.num_programs(0)):
        acc ^= tl.load(w + t * BLOCK + offs)  # < 2^31 words at these sizes
    tl.store(out + pid, tl.xor_sum(acc, axis=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="2,3,4")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("expert_read_floor needs a CUDA GPU")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_timing import graph_per_call_us

    from kernels.w4a16_gemm import moe_align

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes = {"gate_up": (1024, 2048, True), "down": (2048, 512, False)}  # N rows, K, SwiGLU
    rows, routings = [], []
    for _ in range(4):
        idx = torch.stack([torch.randperm(256, device=dev, generator=gen)[:8] for _ in range(32)])
        routings.append(moe_align(idx, 256, 8))
    for proj, (n, k, swiglu) in shapes.items():
        w = torch.randint(-2**31, 2**31 - 1, (256, n, k // 8), dtype=torch.int32, device=dev, generator=gen)
        s = torch.randint(-2**31, 2**31 - 1, (256, n, k // 64), dtype=torch.int32, device=dev, generator=gen)
        kt, swords, n_out = k // 128, k // 64, n // 2 if swiglu else n
        cols = n_out // 64
        used = [int((r.block_expert < 256).sum()) for r in routings]
        uniq = [int(r.block_expert[r.block_expert < 256].unique().numel()) for r in routings]
        nbytes = sum(u * n * (k // 2 + k // 16) for u in uniq) / len(uniq)  # each used expert's words + scales once
        out = torch.empty(routings[0].block_expert.numel() * cols, dtype=torch.int32, device=dev)
        compact = [r.block_expert[r.block_expert < 256].contiguous() for r in routings]
        for stages in [int(v) for v in args.stages.split(",")]:
            for case, blocks in (("routed", [r.block_expert for r in routings]), ("compact", compact)):
                calls = [lambda b=b, st=stages: _routed_read_kernel[(b.numel(), cols)](
                    w, s, b, out, 256, w.stride(0), s.stride(0), (n_out // 64) * kt * 1024, n_out * swords, KT=kt,
                    SWORDS=swords, SWIGLU=swiglu, num_warps=4, num_stages=st) for b in blocks]
                us = graph_per_call_us(calls * 5)
                rows.append(dict(proj=proj, case=case, stages=stages, us=round(us, 2), mb=round(nbytes / 1e6, 1),
                                 tb_s=round(nbytes / us / 1e6, 3), programs=sum(b.numel() for b in blocks) // 4 * cols,
                                 used_blocks=sum(used) / 4))
                print("[expert_read_floor]", json.dumps(rows[-1]), flush=True)
        flat = torch.randint(-2**31, 2**31 - 1, (int(nbytes) // 4096 * 1024,), dtype=torch.int32, device=dev,
                             generator=gen)
        for stages in [int(v) for v in args.stages.split(",")]:
            for per_sm in (4, 8):
                grid = sms * per_sm
                o2 = torch.empty(grid, dtype=torch.int32, device=dev)
                call = lambda g=grid, o=o2, st=stages: _sequential_read_kernel[(g,)](  # noqa: E731
                    flat, o, flat.numel() // 1024, BLOCK=1024, num_warps=4, num_stages=st)
                us = graph_per_call_us([call] * 20)
                rows.append(dict(proj=proj, case=f"sequential {per_sm}/SM", stages=stages, us=round(us, 2),
                                 mb=round(flat.numel() * 4 / 1e6, 1), tb_s=round(flat.numel() * 4 / us / 1e6, 3)))
                print("[expert_read_floor]", json.dumps(rows[-1]), flush=True)
    outd = Path(args.out)
    outd.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    (outd / "expert_read_floor.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1))


if __name__ == "__main__":
    main()
