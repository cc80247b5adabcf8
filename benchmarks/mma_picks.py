"""Every configuration of the tensor-core decode GEMV (`kernels/w4a16_mma.py`) timed at the routed experts' decode
calls, and the fastest of each key written as autotune picks (`kernels/autotune_table.py` format).

Why. `kernels/tuned/nvidia_h200.json` ships no picks for this kernel, so every engine start tunes its keys afresh
(`do_bench` on ~5 us launches): Qwen run 63's three processes of the same engines picked differently for the lone
step's two expert launches and decoded 364.8, 424.6 and 452.5 tok/s. Timed here as the engine runs them: one CUDA
graph of `--calls` launches (each its own token's random top-8 of one 256-expert stack, PDL on), us per call.

    python benchmarks/mma_picks.py --out DIR [--tokens 1,2,4] [--merge-into kernels/tuned/nvidia_h200.json]

Token counts above `w4a16_mma.MMA_MAX_TOKENS` (4) time the sorted path (the pairs grouped by expert, 8 a program: the
engine's `small_batch_tokens` > 4), each call's routing (`moe_align_fast`) made once outside the timed graphs.

Writes DIR/mma_picks.md (us per configuration and key), DIR/mma_picks.json (the picks, a table of its own) and, with
--merge-into, DIR/tuned_merged.json: that table with these w4a16_mma picks in it (replacing its picks of the same
keys, keeping the others).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, INTER, E, TOP_K = 2048, 512, 256, 8  # hidden, expert intermediate, experts, top-k


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--calls", type=int, default=40, help="launches per graph (the model's 40 MoE layers)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--merge-into", default=None, help="an autotune table to copy with these w4a16_mma picks")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("mma_picks: needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.cuda_timing import graph_per_call_us
    from benchmarks.random_packed import random_nvfp4  # the benchmarks' random checkpoint-layout weights
    from kernels import autotune_table, pdl
    from kernels import w4a16_mma as mm
    from kernels.w4a16_gemm import moe_align_fast

    pdl.set_enabled(pdl.device_supports())  # as the engine on Hopper
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    tuner = mm._w4a16_mma_autotuned
    w13, w2 = random_nvfp4((E, 2 * INTER, H), dev, gen), random_nvfp4((E, H, INTER), dev, gen)  # speed is value-free
    rows, best = [], {}
    for t in (int(v) for v in args.tokens.split(",")):
        xs = [torch.randn(t, H, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(args.calls)]
        idx = [torch.stack([torch.randperm(E, device=dev, generator=gen)[:TOP_K] for _ in range(t)])
               for _ in range(args.calls)]
        wts = [torch.softmax(torch.randn(t, TOP_K, device=dev, generator=gen), -1).to(torch.bfloat16)
               for _ in range(args.calls)]
        # the sorted path above MMA_MAX_TOKENS tokens: each call's pairs grouped by expert (as the engine's MoE does
        # once per layer for both launches), made here outside the timed graphs
        rts = [moe_align_fast(idx[i], E, mm.SORTED_BLOCK_M) if t > mm.MMA_MAX_TOKENS else None
               for i in range(args.calls)]
        known = set(tuner.cache)  # the keys of earlier token counts
        hs = [mm.w4a16_mma_launch(xs[i], *w13, pair_expert=idx[i], a_div=TOP_K, swiglu=True, routing=rts[i])
              for i in range(args.calls)]  # (tunes the gate_up key: the tuner's own pick at start)
        launches = {"gate_up + SwiGLU": lambda i: mm.w4a16_mma_launch(xs[i], *w13, pair_expert=idx[i], a_div=TOP_K,
                                                                      swiglu=True, routing=rts[i]),
                    "down x weight": lambda i: mm.w4a16_mma_launch(hs[i], *w2, pair_expert=idx[i], row_scale=wts[i],
                                                                   routing=rts[i])}
        for name, fn in launches.items():
            # the reference output; for down this call tunes its key (gate_up's was tuned making `hs`): the tuner's
            # own pick at start, recorded beside the timed ones
            ref = fn(0).float()
            torch.cuda.synchronize()
            new_keys = [k for k in tuner.cache if k not in known]
            assert len(new_keys) == 1, f"{name}: expected one new autotune key, got {new_keys}"
            key = new_keys[0]
            known.add(key)
            tuned = tuner.cache[key]
            times = {}
            for cfg in tuner.configs:
                tuner.cache[key] = cfg
                out = fn(0).float()
                assert torch.equal(out, ref) or float((out - ref).abs().max()) <= 1e-2 * float(ref.abs().max()), \
                    f"{name} {cfg}: output off"
                times[str(cfg.kwargs)] = graph_per_call_us([lambda i=i: fn(i) for i in range(args.calls)],
                                                           replays=args.replays)
            pick = min(tuner.configs, key=lambda c: times[str(c.kwargs)])
            tuner.cache[key] = pick
            best[key] = pick
            rows.append(dict(tokens=t, launch=name, key=str(key)[:120], tuned_at_start=str(tuned.kwargs),
                             picked=str(pick.kwargs), us=times))
            print(json.dumps(rows[-1]), flush=True)
    tuner.cache.clear()
    tuner.cache.update(best)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(dev)
    table = autotune_table.dump(name, out / "mma_picks.json")  # every tuner's cache: only w4a16_mma's is filled
    if args.merge_into:
        merged = json.loads(Path(args.merge_into).read_text())
        ours = {json.dumps(k): [k, c] for k, c in table["kernels"]["w4a16_mma"]}  # by key: these replace, others stay
        kept = [[k, c] for k, c in merged["kernels"].get("w4a16_mma", []) if json.dumps(k) not in ours]
        merged["kernels"]["w4a16_mma"] = kept + list(ours.values())
        (out / "tuned_merged.json").write_text(json.dumps(merged, indent=1))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    meta = f"{name}, torch {torch.__version__}, PDL {pdl.enabled()}, {when}"
    configs = [str(c.kwargs) for c in tuner.configs]
    lines = [f"# mma_picks ({meta}): us per launch, {args.calls} launches per graph", "",
             "| tokens | launch | " + " | ".join(configs) + " | picked | tuned at start |",
             "|---:|---|" + "---:|" * len(configs) + "---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['launch']} | " + " | ".join(f"{r['us'][c]:.2f}" for c in configs)
                     + f" | {r['picked']} | {r['tuned_at_start']} |")
    (out / "mma_picks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
