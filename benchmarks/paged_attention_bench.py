"""The paged decode attention (`kernels/paged_attention.py`, with the output gate and o_proj's FP8 codes in its
combine: the engine's path) per call at Qwen3.6's shapes, over its launch knobs: splits of each sequence's context,
tokens a loop step (BLOCK_N) and warps a program, beside the heuristics' choice.

    python benchmarks/paged_attention_bench.py --out benchmarks/results/paged_attention_bench     # GPU; ~1-2 min
    ... --kv-dtypes bf16,fp8     # also on e4m3 pools (QwenEngineConfig.kv_cache_dtype "fp8": half the bytes a token)

Why: at 32 streams and a 1k context the kernel took 35.1 us a layer (qwen_profile_fp8sw run 2, PDL off) for 64 MB of
keys and values -- ~1.8 TB/s, ~0.35 ms of a 7.5 ms step against a ~0.16 ms floor at ~4 TB/s -- and its heuristics
(splits for ~one program an SM: 3 at 32 streams x 2 kv heads; BLOCK_N 32; 8 warps at Dh 256) were never swept on a
GPU. Each case is one CUDA graph of 10 calls (the step's 10 attention layers, each on its own KV pool), replayed; us
per call = replay / 10 (median of 5). Every output is compared with the heuristics' (`compare_gated`: the splits
change the softmax's summation order, so within the op's tolerance, not bit for bit) and the first with the
reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/paged_attention_bench")
    ap.add_argument("--streams", default="32,1", help="decoding sequences per case (each at --context tokens)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--splits", default="0,1,2,3,4,6,8", help="0: the heuristic")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--kv-dtypes", default="bf16", help="the pools' dtypes, comma-separated: bf16, fp8 (e4m3 codes)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("paged_attention_bench needs a CUDA GPU")
    from cuda_timing import graph_per_call_us  # benchmarks/ (the script's directory) is on sys.path
    from kernels import paged_attention as pa
    from kernels import pdl

    pdl.set_enabled(pdl.device_supports())  # as the engine on Hopper
    dev, layers = torch.device("cuda"), 10
    heads, kv_heads, head_dim, block_size = 16, 2, 256, 16  # Qwen3.6's full-attention layers, the engine's blocks
    from kernels.fp8_quant import kv_pool_cast

    pool_dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    rows = []
    for kv, streams in itertools.product(args.kv_dtypes.split(","), (int(v) for v in args.streams.split(","))):
        cases = [pa.random_inputs([args.context] * streams, heads, kv_heads, head_dim, block_size,
                                  dtype=torch.bfloat16, seed=layer, device=dev) for layer in range(layers)]
        cases = [(c[0], kv_pool_cast(c[1], pool_dtypes[kv]), kv_pool_cast(c[2], pool_dtypes[kv]), *c[3:])
                 for c in cases]
        gen = torch.Generator().manual_seed(0)
        gates = [(2 * torch.randn(c[0].shape, generator=gen)).to(torch.bfloat16).to(dev) for c in cases]
        scale_in = torch.tensor(0.004, device=dev)
        default = None
        grid = [(0, None, None)] + list(itertools.product(
            (int(v) for v in args.splits.split(",") if int(v) > 0), (int(v) for v in args.block_n.split(",")),
            (int(v) for v in args.warps.split(","))))
        for splits, block_n, warps in grid:
            def call(i, splits=splits, block_n=block_n, warps=warps):
                return pa.paged_decode_attention_launch(*cases[i], num_splits=splits or None, block_n=block_n,
                                                        gate=gates[i], input_scale=scale_in, num_warps=warps)
            row = dict(kv=kv, streams=streams, context=args.context, splits=splits or "auto",
                       block_n=block_n or "auto", warps=warps or "auto")
            try:
                out = call(0)
                if default is None:
                    default = out
                    ref = pa.paged_decode_attention_gated_fp8_reference(*cases[0], gates[0], scale_in)
                    row["vs_reference"] = pa.compare_gated(out, ref) or "ok"
                else:
                    row["vs_auto"] = pa.compare_gated(out, default) or "ok"
                row["us"] = round(graph_per_call_us([lambda i=i: call(i) for i in range(layers)]), 2)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or launch is recorded
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                pdl=pdl.enabled())
    (out_dir / "paged_attention_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# paged_attention_bench ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}, PDL "
             f"{meta['pdl']}); us per call, context {args.context}", "",
             "| KV pools | streams | splits | BLOCK_N | warps | us | check |", "|---|---:|---:|---:|---:|---:|---|"]
    for kv, streams in dict.fromkeys((r["kv"], r["streams"]) for r in rows):
        ok = [r for r in rows if (r["kv"], r["streams"]) == (kv, streams) and "us" in r]
        for r in sorted(ok, key=lambda r: r["us"])[:8] + [r for r in ok if r["splits"] == "auto"]:
            check = r.get("vs_reference", r.get("vs_auto", ""))
            lines.append(f"| {kv} | {streams} | {r['splits']} | {r['block_n']} | {r['warps']} | {r['us']:.2f} | "
                         f"{check} |")
    (out_dir / "paged_attention_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
