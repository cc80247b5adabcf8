"""Can a layer's big weight read come from L2 if a kernel one layer ahead prefetches it? A graphed chain that has a
lone decode step's shape, with and without that prefetch, with programmatic dependent launch (kernels/pdl.py).

Why. A lone Qwen decode step is ~415 dependent kernels in ~2.27 ms on the H200. Per layer, one big read (the FP8
in_proj: 25 MB, ~7 us at ~3.7 TB/s: chain_floor run 1) is followed by ~9 latency-bound kernels (router, experts,
combine, ...) that use a fraction of the DRAM bandwidth for ~40 us. Prefetching each kernel's own weights just before
its PDL wait gave no gain (Qwen run 54): the lead was one predecessor's tail, ~2-3 us. Here the lead is a layer: the
first small kernel after a big read issues `cp.async.bulk.prefetch.L2` of the NEXT layer's big buffer, whose read then
may hit L2 (50 MB on the H200) if the small kernels between do not evict it.

    python benchmarks/prefetch_ahead.py --out DIR [--big-mb 25] [--small 9] [--layers 40] [--replays 20]

Rows (us, median of graph replays):
  - "resident": one big buffer read by every launch of a 200-launch chain (L2-resident after the first): the big read's
    time from L2, against "streamed" (buffers cycled over > 2x the L2: from DRAM);
  - "layers, no prefetch" / "layers, prefetch ahead": per layer, the big read (its own buffer; 40 layers, > 2x the L2)
    then `--small` launches of `--small-mb` each (their buffers cycled through a small set, like the step's small
    kernels; L2-resident) -- per layer, and the difference.
  - "--warm": the next layer's big buffer read by a warm-up launch (`_warm_kernel`) on a side stream that the chain
    joins only after its last layer, forked at the layer's start or after its big read, per mode and program count;
    and each warm launch alone (us and GB/s). Modes: "load" (every word loaded, ld.global.cg, folded into one xor a
    program: stored, so the loads are not dead; checked against `warm_reference`), "load_last" (evict_last loads),
    "prefetch" (one prefetch.global.L2::evict_last per 128-byte line, nothing waited for). Prefetch_ahead runs 2-3
    (H200, 2026-12-03): no mode gained -- the loads stream at ~12 GB/s a program, so the side chain bounds the layers;
    the line prefetches made each layer 1.1-5.1 us slower. The engine option built on it (`weight_warm_ahead`) lost
    43% / 8% of the lone decode rate (Qwen run 62) and was removed.
Every read kernel's sums are checked once. The numbers are a model of the step, not the step.

    python benchmarks/prefetch_ahead.py --out DIR --warm [--warm-programs 16,32,64] [--warm-modes load,prefetch]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import pdl  # noqa: E402
from benchmarks.cuda_timing import graph_per_call_us  # noqa: E402  (the scripts' shared GPU timer)

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
    from kernels.pdl import prefetch_l2
except ImportError:  # pragma: no cover - the benchmark needs triton
    triton = None

WORDS = 2048  # int32 words a program reads (8 KB), as benchmarks/chain_floor.py
PIECE = 64 * 1024  # bytes per cp.async.bulk.prefetch.L2 (a 32-bit size; pieces keep each one modest)

if triton is not None:
    _PIECE = tl.constexpr(PIECE)  # jit functions may only read constexpr globals

    @triton.jit
    def _read_kernel(buf, sums, ahead, ahead_bytes, WORDS: tl.constexpr, PIECES: tl.constexpr,
                     PREFETCH: tl.constexpr, USE_PDL: tl.constexpr = False):
        # program p: sums[p] = sum of buf[p WORDS : (p + 1) WORDS]; PREFETCH: also prefetch its share of `ahead`
        # (ahead_bytes in total, PIECES pieces of PIECE bytes a program) into L2 -- memory no kernel of the chain writes
        pdl_enter(USE_PDL)
        p = tl.program_id(0)
        if PREFETCH:
            piece = p * PIECES + tl.arange(0, PIECES)
            start = piece.to(tl.int64) * _PIECE
            n = tl.minimum(ahead_bytes - start, _PIECE).to(tl.int32)
            prefetch_l2(ahead + start, n)  # pieces past the end: n <= 0, nothing issued
        tl.store(sums + p, tl.sum(tl.load(buf + p.to(tl.int64) * WORDS + tl.arange(0, WORDS))))


WARM_MODES = ("load", "load_last", "prefetch")
WARM_STEP = 4096  # int32 words a warm program loads per loop step (16 KB)
WARM_LINE = 32  # a 128-byte line in words (the prefetch mode's stride)

if triton is not None:

    @triton.jit
    def _warm_kernel(src, out, n_words, STEP: tl.constexpr, MODE: tl.constexpr, LINE: tl.constexpr):
        # program p reads words [p STEP, (p + 1) STEP), then every num_programs-th step after; out[p]: their xor
        p = tl.program_id(0)
        stride = tl.num_programs(0) * STEP
        if MODE == 2:
            lines = tl.arange(0, STEP // LINE) * LINE
            for start in range(p * STEP, n_words, stride):
                offs = start + lines
                tl.inline_asm_elementwise(
                    """{
                    .reg .pred q;
                    setp.lt.s32 q, $2, $3;
                    @q prefetch.global.L2::evict_last [$1];
                    mov.u32 $0, 0;
                    }""",
                    "=r,l,r,r", [(src + offs).to(tl.int64, bitcast=True), offs, n_words + tl.zeros_like(offs)],
                    dtype=tl.int32, is_pure=False, pack=1)
            tl.store(out + p, 0)
        else:
            acc = tl.zeros([STEP], dtype=tl.int32)
            words = tl.arange(0, STEP)
            for start in range(p * STEP, n_words, stride):
                offs = start + words
                if MODE == 1:
                    x = tl.load(src + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
                else:
                    x = tl.load(src + offs, mask=offs < n_words, other=0, cache_modifier=".cg")
                acc = acc ^ x
            tl.store(out + p, tl.xor_sum(acc, 0))


def warm(buf: torch.Tensor, mode: str, programs: int, out: torch.Tensor) -> None:
    """One warm launch over the int32 buffer `buf` (module docstring, "--warm")."""
    _warm_kernel[(programs,)](buf, out, buf.numel(), STEP=WARM_STEP, MODE=WARM_MODES.index(mode), LINE=WARM_LINE,
                              num_warps=4)


def warm_reference(words: torch.Tensor, programs: int) -> torch.Tensor:
    """What the load modes store: out[p] = xor of the words of program p's steps -> int32 [programs] (xor is order
    free)."""
    import numpy as np

    n = words.numel()
    w = np.zeros(n + (-n) % (programs * WARM_STEP), dtype=np.int32)
    w[:n] = words.reshape(-1).cpu().numpy()
    return torch.from_numpy(np.bitwise_xor.reduce(w.reshape(-1, programs, WARM_STEP), axis=(0, 2)))


def programs_for(mb: float) -> int:
    return max(1, int(mb * 2**20) // (WORDS * 4))


def launch(buf, sums, ahead=None) -> None:
    """One read launch over all of `buf`; `ahead`: a buffer whose bytes this launch prefetches into L2."""
    programs = buf.numel() // WORDS
    pieces = 1 if ahead is None else triton.next_power_of_2(-(-ahead.numel() * 4 // (programs * PIECE)))
    _read_kernel[(programs,)](buf, sums, buf if ahead is None else ahead, 0 if ahead is None else ahead.numel() * 4,
                              WORDS=WORDS, PIECES=pieces, PREFETCH=ahead is not None, num_warps=4,
                              **pdl.launch_options())


def graph_us(body, replays: int) -> float:
    """Median us of one replay of a CUDA graph of body() (`cuda_timing.graph_per_call_us` of one call)."""
    return graph_per_call_us([body], replays=replays)


def check(buf, sums) -> None:
    want = buf.view(-1, WORDS).sum(1, dtype=torch.int32)
    assert torch.equal(sums[: want.numel()], want), "prefetch_ahead: wrong sums"


def warm_rows(args, bigs, n_big, smalls, sums, rows: dict) -> list[str]:
    """The side-stream warm-up rows (module docstring, "--warm"); adds their us to `rows`, returns table lines."""
    side = torch.cuda.Stream()
    lines = []
    big_bytes = bigs[0].numel() * 4
    for mode in args.warm_modes.split(","):
        for programs in map(int, args.warm_programs.split(",")):
            out = torch.zeros(programs, dtype=torch.int32, device=bigs[0].device)
            alone = graph_us(lambda: [warm(bigs[i % n_big], mode, programs, out) for i in range(8)],
                             args.replays) / 8
            if mode != "prefetch":
                assert torch.equal(out.cpu(), warm_reference(bigs[7 % n_big], programs)), "warm: wrong xor"
            key = f"warm_{mode}_{programs}"
            rows[f"{key}_alone_us"] = alone
            lines.append(f"| warm launch alone ({mode}, {programs} programs) | {alone:.2f} | "
                         f"{big_bytes / alone / 1e3:.0f} GB/s |")
            for at in ("start", "after"):
                def body(at=at):
                    main = torch.cuda.current_stream()
                    for i in range(args.layers):
                        if at == "start":
                            side.wait_stream(main)
                            with torch.cuda.stream(side):
                                warm(bigs[(i + 1) % n_big], mode, programs, out)
                        launch(bigs[i % n_big], sums)
                        for j in range(args.small):
                            if at == "after" and j == 0:
                                side.wait_stream(main)
                                with torch.cuda.stream(side):
                                    warm(bigs[(i + 1) % n_big], mode, programs, out)
                            launch(smalls[j % len(smalls)], sums)
                    main.wait_stream(side)

                us = graph_us(body, args.replays) / args.layers
                rows[f"{key}_layers_{at}_us"] = us
                lines.append(f"| layer, next big buffer warmed on a side stream ({mode}, {programs} programs, forked "
                             f"at the layer's {'start' if at == 'start' else 'big read end'}) | {us:.2f} | "
                             f"{us - rows['layers_us']:+.2f} us a layer |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--big-mb", type=float, default=25.0)
    ap.add_argument("--small", type=int, default=9, help="small launches per layer after the big read")
    ap.add_argument("--small-mb", type=float, default=0.5)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--warm", action="store_true", help="also the side-stream warm-up rows (`_warm_kernel`)")
    ap.add_argument("--warm-programs", default="16,32,64")
    ap.add_argument("--warm-modes", default=",".join(WARM_MODES))
    ap.add_argument("--skip-prefetch", action="store_true", help="leave out the bulk-prefetch row (run 1: 420 us)")
    args = ap.parse_args()
    if triton is None or not torch.cuda.is_available() or not pdl.device_supports():
        print("prefetch_ahead: needs triton and an sm_90+ CUDA GPU (cp.async.bulk.prefetch.L2, PDL)", file=sys.stderr)
        return 2
    pdl.set_enabled(True)
    dev = torch.device("cuda", 0)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    gen = torch.Generator(device=dev).manual_seed(0)

    def buffer(mb: float) -> torch.Tensor:
        return torch.randint(0, 7, (programs_for(mb) * WORDS,), dtype=torch.int32, device=dev, generator=gen)

    n_big = max(args.layers, -(-2 * l2 // int(args.big_mb * 2**20)))
    bigs = [buffer(args.big_mb) for _ in range(n_big)]
    smalls = [buffer(args.small_mb) for _ in range(4)]
    sums = torch.empty(max(programs_for(args.big_mb), programs_for(args.small_mb)), dtype=torch.int32, device=dev)
    rows: dict = dict(l2_bytes=l2, big_mb=args.big_mb, small=args.small, small_mb=args.small_mb, layers=args.layers,
                      big_buffers=n_big)
    chain = 200
    rows["resident_us"] = graph_us(lambda: [launch(bigs[0], sums) for _ in range(chain)], args.replays) / chain
    check(bigs[0], sums)
    rows["streamed_us"] = graph_us(lambda: [launch(bigs[i % n_big], sums) for i in range(chain)], args.replays) / chain

    def layers(prefetch: bool) -> None:
        for i in range(args.layers):
            launch(bigs[i % n_big], sums)
            for j in range(args.small):
                ahead = bigs[(i + 1) % n_big] if prefetch and j == 0 else None
                launch(smalls[j % len(smalls)], sums, ahead)

    plan = (("layers_us", False), ("layers_prefetch_us", True), ("layers_again_us", False))
    for key, prefetch in plan[::2] if args.skip_prefetch else plan:
        rows[key] = graph_us(lambda prefetch=prefetch: layers(prefetch), args.replays) / args.layers
    warm_lines = warm_rows(args, bigs, n_big, smalls, sums, rows) if args.warm else []
    check(smalls[(args.small - 1) % len(smalls)], sums)
    rows["small_only_us"] = graph_us(lambda: [launch(smalls[j % len(smalls)], sums)
                                              for _ in range(args.layers) for j in range(args.small)],
                                     args.replays) / args.layers
    meta = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefetch_ahead.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    big_bytes = programs_for(args.big_mb) * WORDS * 4
    lines = [f"# prefetch_ahead ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}, PDL on, "
             f"{meta['date']})", "",
             "| what | us | note |", "|---|---:|---|",
             f"| big read ({args.big_mb:g} MB), L2-resident | {rows['resident_us']:.2f} | "
             f"{big_bytes / rows['resident_us'] / 1e6:.2f} TB/s |",
             f"| big read, streamed from DRAM | {rows['streamed_us']:.2f} | "
             f"{big_bytes / rows['streamed_us'] / 1e6:.2f} TB/s |",
             f"| layer: big read + {args.small} x {args.small_mb:g} MB, no prefetch | {rows['layers_us']:.2f} | |",
             *([] if "layers_prefetch_us" not in rows else [
                 f"| layer, the next big buffer prefetched by the first small launch | "
                 f"{rows['layers_prefetch_us']:.2f} | "
                 f"{rows['layers_prefetch_us'] - rows['layers_us']:+.2f} us a layer |"]),
             f"| layer, no prefetch, again | {rows['layers_again_us']:.2f} | order effects |",
             f"| the small launches alone | {rows['small_only_us']:.2f} | |", *warm_lines]
    (out / "prefetch_ahead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
