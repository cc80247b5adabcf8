"""Start the Qwen engine exactly as a serve config's `args:` ask (no Ray, no HTTP) and report what an operator sizes a
GPU by: start-up seconds, memory (weights, KV pool, graph pools, what is left), the graphs captured, and one lone
prompt per prefill bucket (time to first token, through the graph or not).

    python benchmarks/serve_config_start.py serve_configs/qwen_h200.yaml --out DIR [--set key=JSON ...]
        [--autotune-foreign kernels/tuned/nvidia_h200.json]

With `checkpoint: null` the weights are random at full size (speed and memory do not depend on the values). Writes
DIR/serve_config_start.json and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

import yaml


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def cuda_memory(torch) -> dict:
    free, total = torch.cuda.mem_get_info()
    return dict(allocated_gib=gib(torch.cuda.memory_allocated()), reserved_gib=gib(torch.cuda.memory_reserved()),
                free_gib=gib(free), total_gib=gib(total))


async def first_token_ms(engine, n: int, vocab: int) -> float:
    """A lone n-token prompt of distinct ids, one output token: ms to its first (only) chunk."""
    prompt = [(7919 * i) % (vocab - 1) + 1 for i in range(n)]
    t0 = time.perf_counter()
    async for _ in engine.generate(prompt, max_new_tokens=1):
        break
    return round((time.perf_counter() - t0) * 1e3, 1)


async def main(args) -> dict:
    import torch

    from qwen_engine.engine import QwenEngine, QwenEngineConfig

    spec = yaml.safe_load(Path(args.config).read_text())
    app_args = dict(spec["applications"][0]["args"])
    for item in args.set:  # key=JSON overrides, e.g. prefill_buckets=[1024]
        key, _, value = item.partition("=")
        app_args[key] = json.loads(value)
    # the engine's keys only (qwen_engine.serve.split_args, without importing Ray Serve; the HTTP keys are unused)
    names = {f.name for f in dataclasses.fields(QwenEngineConfig)}
    engine_cfg = QwenEngineConfig.from_dict({k: v for k, v in app_args.items() if k in names})
    if args.autotune_foreign:  # another GPU model's picks, loaded first (the engine's own load refuses them)
        from kernels import autotune_table

        r_foreign = autotune_table.load_foreign(args.autotune_foreign)
    else:
        r_foreign = None
    r: dict = dict(config=args.config, overrides=args.set, device=torch.cuda.get_device_name(),
                   torch=torch.__version__, autotune_foreign=r_foreign, before=cuda_memory(torch))
    t0 = time.perf_counter()
    engine = QwenEngine(engine_cfg)
    r["built_s"] = round(time.perf_counter() - t0, 1)
    r["after_build"] = cuda_memory(torch)  # weights + KV pool + GDN states
    t1 = time.perf_counter()
    await engine.start()  # self-checks, warm-up, decode + prefill graph captures
    r["start_s"] = round(time.perf_counter() - t1, 1)
    r["after_start"] = cuda_memory(torch)  # + graph pools, workspaces, the allocator's cache
    h = engine.health()
    runner = h.get("runner") or {}
    r["kv_blocks"] = h.get("kv_blocks")
    r["decode_graphs"] = runner.get("decode_graphs")
    r["prefill_graphs"] = runner.get("prefill_graphs")
    r["lone_prefill_tokens"] = h.get("lone_prefill_tokens")
    buckets = (r["prefill_graphs"] or {}).get("buckets") or []
    vocab = engine.model_config.vocab_size
    ttft = {}
    for n in sorted(set(buckets) | {1024}):
        if n < engine_cfg.max_model_len:
            ttft[n] = [await first_token_ms(engine, n, vocab) for _ in range(3)]
    r["ttft_ms_by_prompt_tokens"] = ttft
    r["prefill_graph_replays"] = ((engine.health().get("runner") or {}).get("prefill_graphs") or {}).get("replays")
    r["after_prompts"] = cuda_memory(torch)
    r["peak_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
    await engine.aclose()
    return r


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a serve config YAML (its first application's args)")
    ap.add_argument("--set", action="append", default=[], help="key=JSON: override one of the args (repeatable)")
    ap.add_argument("--autotune-foreign", default=None, metavar="JSON",
                    help="load this autotune table whatever GPU model measured it (e.g. the H200's on an H100)")
    ap.add_argument("--out", default="benchmarks/results/serve_config_start")
    a = ap.parse_args()
    result = asyncio.run(main(a))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_config_start.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
