"""The speed waterfall of issue 4: Meta's reference, then Sammie one optimisation at a time, in ONE process and run,
with accuracy against Meta's fp32 model on every row that produces instances. One markdown table out.

    python benchmarks/waterfall.py --out benchmarks/results/waterfall            # on the H200 (~8 min for the
    #                                                       first runs' rows; today's full table needs --rows splits)
    python benchmarks/waterfall.py --out /tmp/wf --config tiny --device cpu --seconds 1 \
        --rows meta_processor_fp32,ours_fp32_b1                         # CPU dry run (tests/test_waterfall.py)

Set-up (once): Meta's SAM 3 image model (PyPI sam3) at `--config` with seeded random weights
(`sammie.reference.randomize_`, as `gpu_parity.py`), saved as a Meta-layout checkpoint that every Sammie engine row
loads through `EngineConfig.checkpoint` (identical weights, no patching of the engine). Inputs: `gpu_parity.py`'s six
`skimage.data` photographs, 4:3 centre crop, 640x480, JPEG quality 90 (the Locust load test's recipe), with its two
prompts each = 12 (image, prompt) cases; throughput rows cycle through them, one prompt per request. Ground truth:
Meta's `Sam3Processor` in fp32 with TF32 off on the decoded JPEGs. Per case the score threshold sits in the widest gap
between the 5th and 20th highest Meta fp32 score (random weights put no score near 0.5 and pack ~200 queries within a
few 1e-3; a gap keeps small rounding from flipping queries, and 5-20 instances per request keeps post-processing
realistic); every row, Meta's and ours, uses these thresholds.

Rows (`ROWS`; `--rows` picks a subset: Meta's and the engine rows run in the order given, so A/B rounds can alternate;
the rows that measure an earlier row's engine, and the HTTP slot, follow them in table order): Meta per image (fp32
with TF32 as Meta's import sets it, and bf16 autocast), Meta's batched Datapoint path at batch 8 (end to end, and
model forward only), then Sammie's engine in-process (asyncio, JPEG bytes in, instances out incl. decode and
post-processing; `--clients` requests in flight): fp32 and bf16 one request at a time, bf16 batched, + CUDA graphs, +
Triton kernels, + FP8 ViT; then the best bf16 engine's detector alone on a pre-processed batch of 8, a lone request's
latency, a second prompt on a cached image, and an HTTP slot filled from `--http-results` (`benchmarks/serve_gpu.sh`).
Later rows added variants (FP8 subsets and static scales, the fused GELU, stage streams, batch-1 engines) and capped
rows (an engine driven again with every answer capped at `max_instances`). Engine rows warm up for `--warmup-s`
(default 3 s; before 2026-12-02 one round of requests) before their `--seconds` of measurement.
Every row runs in try/except: a failing row records its error and the run goes on. Engine rows are built only from
`EngineConfig` values; a baseline value (compile "none", kernels "reference", vit_fp8 False) for a field this
EngineConfig lacks is dropped and noted.

Columns: img/s; p50/p99 ms per request (per batch for batched Meta and model-only rows); peak GB =
`torch.cuda.max_memory_allocated` during the row minus what other live objects held at its start (plus the weights of
a model reused from an earlier row); TFLOP/s = rate x FLOPs counted on our detector (`flops.py`) and its share of the
804 TFLOP/s bf16 matmul rate measured on this H200 (`../shared/design/sam3-reference.md` section 12); oracle vs Meta
fp32 (`engine_core/oracle.py` instance metrics): mean (min) mask IoU, count mismatch in % of cases, and the largest
score difference of matched instances. Targets of issue 4 are checked on the rows they concern. A torch.profiler
breakdown of the best bf16 configuration (top CUDA kernels by self time, named stages) goes to waterfall.json.

Files in --out: waterfall.json (everything), waterfall.md (header + table + legend + profile summary).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: sammie, engine_core
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_parity (photos, prompts), flops

from waterfall_bench import (GAP_RANKS, IMAGE_SIZE, JPEG_QUALITY, Bench, Skipped,  # noqa: E402
                             threshold_in_gap, versions)
from waterfall_runs import (BEST_CANDIDATES, best_engine, close_engine, free_device_memory,  # noqa: E402
                            profile_engine, run_engine, run_extra_prompt, run_http, run_latency, run_meta_batched,
                            run_meta_processor, run_model_only)

# What callers (tests/test_waterfall.py) use, some of it re-exported from waterfall_bench / waterfall_runs.
__all__ = ["BEST_CANDIDATES", "ROWS", "ROW_NAMES", "Row", "Skipped", "Target", "main", "markdown", "run_http",
           "run_rows", "table", "threshold_in_gap", "versions"]

CEILING_TFLOPS = 804.0  # bf16 matmul rate measured on the lent H200 (sam3-reference.md section 12)
META_BATCH = 8  # Meta's Datapoint path batch (issue 4's 24.5 / 42 img/s) and the model-only batch


# --------------------------------------------------------------------------------------------------------------
# Rows


@dataclass(frozen=True)
class Target:
    """Issue 4's goal on one column of one row, e.g. Target("img_per_s", ">=", 95)."""

    metric: str  # key of the row's result dict
    op: str  # ">=" | "<="
    value: float

    def check(self, observed: float | None) -> bool | None:
        if observed is None or (isinstance(observed, float) and math.isnan(observed)):
            return None
        return observed >= self.value if self.op == ">=" else observed <= self.value

    def __str__(self) -> str:
        short = {"img_per_s": "img/s", "p50_ms": "p50 ms", "iou_mean": "IoU", "count_mismatch_pct": "mismatch %"}
        return f"{short.get(self.metric, self.metric)} {self.op} {self.value:g}"


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    kind: str  # meta_processor | meta_batched(_model) | engine | model_only | batched_idle | capped | latency
    #            | extra_prompt | http
    engine: dict = field(default_factory=dict)  # EngineConfig values (engine rows)
    clients: int = 0  # requests in flight (engine rows); 0 = --clients
    autocast: bool = False  # Meta rows: bf16 autocast
    targets: tuple[Target, ...] = ()
    reuse: str = ""  # model_only / latency / extra_prompt rows: the engine row whose engine they measure ("" = the
    #                  fastest bf16 engine of BEST_CANDIDATES); that row's engine is kept alive for them
    max_instances: int = 0  # capped and latency_capped* rows: every request's max_instances


ACC_BF16 = (Target("iou_mean", ">=", 0.99), Target("count_mismatch_pct", "<=", 1.0))
ACC_FP8 = (Target("iou_mean", ">=", 0.98), Target("count_mismatch_pct", "<=", 2.0))
B1 = {"max_image_batch": 1, "max_pair_batch": 1, "compile": "none", "kernels": "reference", "vit_fp8": False}
BATCHED = {"dtype": "bf16", "max_image_batch": 8, "max_pair_batch": 16, "compile": "none", "kernels": "reference",
           "vit_fp8": False}
# the bf16 inductor engine with one bucket per stage (images 8 / pairs 8): quicker to start than
# ours_bf16_inductor's four, the base of the max-autotune rows
BF16_INDUCTOR_B8 = {**BATCHED, "compile": "inductor", "kernels": "triton", "max_pair_batch": 8, "image_buckets": [8],
                    "pair_buckets": [8]}
# the FP8 engine rows: inductor, Triton kernels, batch-8 buckets, the default FP8 linears (qkv, proj, fc1)
FP8_INDUCTOR = {**BATCHED, "compile": "inductor", "kernels": "triton", "vit_fp8": True, "max_pair_batch": 8,
                "vit_fp8_linears": ["attn.qkv", "attn.proj", "mlp.fc1"], "image_buckets": [8], "pair_buckets": [8]}
FP8_ALL_LINEARS = ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"]
FP8_STATIC_FC2 = {**FP8_INDUCTOR, "vit_fp8_linears": FP8_ALL_LINEARS, "vit_fp8_static": ["mlp.fc2"]}

ROWS: tuple[Row, ...] = (
    Row("meta_processor_fp32", "Meta Sam3Processor, one image at a time (JPEG decode, set_image, set_text_prompt, "
        "masks to host), fp32 with TF32 on (Meta's import default); at most 24 requests", "meta_processor"),
    Row("meta_processor_bf16", "the same, bf16 autocast", "meta_processor", autocast=True),
    Row("meta_batched_bf16", "Meta's batched Datapoint path, batch 8: JPEG decode, CPU transform, collate_fn_api, "
        "copy to device, Sam3Image forward, PostProcessImage (notebook settings); bf16 autocast; latency per batch",
        "meta_batched", autocast=True),
    Row("meta_batched_model_bf16", "Meta's Sam3Image forward only, on a collated batch of 8 already on the device; "
        "bf16 autocast; latency per batch", "meta_batched_model", autocast=True),
    Row("ours_fp32_b1", "Sammie engine in-process, fp32, one request at a time (batches of 1), eager, reference "
        "kernels", "engine", engine={**B1, "dtype": "fp32"}, clients=1, targets=ACC_BF16),
    Row("ours_bf16_b1", "the same in bf16", "engine", engine={**B1, "dtype": "bf16"}, clients=1, targets=ACC_BF16),
    Row("ours_bf16_batched", "engine, bf16, image batches <= 8 / pair batches <= 16, --clients requests in flight, "
        "eager, reference kernels", "engine", engine=BATCHED, targets=(Target("img_per_s", ">=", 95), *ACC_BF16)),
    Row("ours_bf16_graphs", "+ compile='graphs' (CUDA graphs)", "engine", engine={**BATCHED, "compile": "graphs"},
        targets=(Target("img_per_s", ">=", 95), *ACC_BF16)),
    Row("ours_bf16_triton", "+ kernels='triton' (Triton preprocess and mask post-processing)", "engine",
        engine={**BATCHED, "compile": "graphs", "kernels": "triton"},
        targets=(Target("img_per_s", ">=", 95), *ACC_BF16)),
    Row("ours_bf16_inductor", "+ compile='inductor' (torch.compile per bucket, then CUDA graphs); buckets: images "
        "1, 8 and pairs 1, 8 (max_pair_batch 8) to keep start-up compile to 4 x ~35 s", "engine",
        engine={**BATCHED, "compile": "inductor", "kernels": "triton", "max_pair_batch": 8, "image_buckets": [1, 8],
                "pair_buckets": [1, 8]},
        targets=(Target("img_per_s", ">=", 95), *ACC_BF16)),
    Row("ours_bf16_inductor_b8", "ours_bf16_inductor with one bucket per stage (images 8 / pairs 8): the base "
        "of ours_bf16_autotune, same start-up work but the autotuning", "engine", engine=BF16_INDUCTOR_B8,
        targets=(Target("img_per_s", ">=", 95), *ACC_BF16)),
    Row("ours_bf16_b8_shared_stream", "ours_bf16_inductor_b8 with stage_streams=False: both stages on the default "
        "stream (the engine before 2026-12-02), whose grounding syncs waited behind queued image batches", "engine",
        engine={**BF16_INDUCTOR_B8, "stage_streams": False}, targets=(Target("img_per_s", ">=", 95), *ACC_BF16)),
    Row("ours_bf16_autotune", "ours_bf16_inductor_b8 with image_inductor_mode='max-autotune-no-cudagraphs': "
        "inductor benchmarks Triton GEMM templates against cuBLAS for the image stage's matmuls (a winning template "
        "can take the GELU after fc1 in its epilogue: 9.4 ms of 117 per batch of 8 unfused) and tunes its "
        "pointwise / reduction kernels (coordinate descent)", "engine",
        engine={**BF16_INDUCTOR_B8, "image_inductor_mode": "max-autotune-no-cudagraphs"},
        targets=(Target("img_per_s", ">=", 95), *ACC_BF16)),
    Row("ours_bf16_fused_gelu", "ours_bf16_inductor_b8 with vit_fused_gelu=True: each ViT block's fc1 + GELU as one "
        "cuBLASLt GEMM with its GELU epilogue (the tanh approximation, not Meta's exact GELU), no separate GELU pass "
        "(9.4 ms of ~117 per batch of 8)", "engine", engine={**BF16_INDUCTOR_B8, "vit_fused_gelu": True},
        targets=(Target("img_per_s", ">=", 95), *ACC_BF16)),
    Row("ours_fp8_vit", "+ vit_fp8=True (FP8 ViT linears, quantisation fused by inductor; the engine's FP8 gate "
        "decides) on all four linears of each block (qkv, proj, fc1, fc2; fc2's input GELU + quantiser fused by "
        "inductor, as in runs 6-7: run 8's one-pass Triton kernel, kernels/gelu_fp8_quant.py, was slower); "
        "inductor, buckets images 8 / pairs 8 only",
        "engine", engine={**FP8_INDUCTOR, "vit_fp8_linears": FP8_ALL_LINEARS},
        targets=(Target("img_per_s", ">=", 140), *ACC_FP8)),
    Row("ours_fp8_vit_no_fc2", "ours_fp8_vit with mlp.fc2 kept in bf16 (vit_fp8_linears: qkv, proj, fc1, the "
        "default since waterfall run 7): its per-token quantiser of the GELU's 4,736-wide output cost more than its "
        "FP8 GEMM saves (waterfall run 6)",
        "engine", engine=FP8_INDUCTOR,
        targets=(Target("img_per_s", ">=", 140), *ACC_FP8)),
    Row("ours_fp8_vit_b1", "ours_fp8_vit_no_fc2 (the default FP8 linears) with buckets images 1, 8 and pairs 1, 8, "
        "like ours_bf16_inductor: the engine of latency_single_fp8", "engine",
        engine={**FP8_INDUCTOR, "image_buckets": [1, 8], "pair_buckets": [1, 8]},
        targets=(Target("img_per_s", ">=", 140), *ACC_FP8)),
    Row("ours_fp8_static_b1", "ours_fp8_static_fc2 (all four linears in FP8, fc2 on a static scale) with buckets "
        "images 1, 8 and pairs 1, 8: the engine of latency_single_fp8_static", "engine",
        engine={**FP8_STATIC_FC2, "image_buckets": [1, 8], "pair_buckets": [1, 8]},
        targets=(Target("img_per_s", ">=", 140), *ACC_FP8)),
    Row("ours_fp8_static_all_b1", "ours_fp8_static_all (every ViT linear in FP8 on a static input scale) with "
        "buckets images 1, 8 and pairs 1, 8: the engine of latency_capped_fp8_static_all (run 19: the LayerNorm / "
        "per-token quantiser kernels among a lone request's top 15 took 0.82 ms; how much of it static scales remove "
        "is what this measures)", "engine",
        engine={**FP8_STATIC_FC2, "vit_fp8_static": FP8_ALL_LINEARS, "image_buckets": [1, 8], "pair_buckets": [1, 8]},
        targets=(Target("img_per_s", ">=", 140), *ACC_FP8)),
    Row("ours_fp8_attn_fused_gelu", "the FP8 engine with only the attention's linears in FP8 (vit_fp8_linears: qkv, "
        "proj) and each block's fc1 + GELU as one bf16 cuBLASLt GEMM (vit_fused_gelu; the tanh GELU): the two gains "
        "together, as an FP8 fc1 cannot take the fused GELU", "engine",
        engine={**FP8_INDUCTOR, "vit_fp8_linears": ["attn.qkv", "attn.proj"], "vit_fused_gelu": True},
        targets=(Target("img_per_s", ">=", 140), *ACC_FP8)),
    Row("ours_fp8_static_fc2", "ours_fp8_vit (all four linears in FP8) with fc2's input quantised with ONE "
        "calibrated scale per block (vit_fp8_static: mlp.fc2; 2 x the amax over the engine's calibration sample / "
        "448) instead of one per token: the GELU + quantiser elementwise, which inductor can fuse into the GELU pass "
        "the bf16 path runs anyway (the per-token reduction made an FP8 fc2 lose: runs 6-8)", "engine",
        engine=FP8_STATIC_FC2,
        targets=(Target("img_per_s", ">=", 140), *ACC_FP8)),
    Row("ours_fp8_static_all", "ours_fp8_static_fc2 with every FP8 linear's input on a calibrated scale "
        "(vit_fp8_static: all four; the LayerNorms' and the attention output's quantisers lose their per-token "
        "reduction too)", "engine",
        engine={**FP8_STATIC_FC2, "vit_fp8_static": FP8_ALL_LINEARS},
        targets=(Target("img_per_s", ">=", 140), *ACC_FP8)),
    Row("model_only_best", "the best bf16 engine's detector alone: encode_images + ground on a pre-processed batch "
        "of 8 (one prompt each, prompt features cached); no decode, no post-processing; latency per batch",
        "model_only", targets=(Target("img_per_s", ">=", 105),)),
    Row("model_only_fp8", "the same with the FP8 engine's detector (ours_fp8_vit's engine, kept for this row): the "
        "FP8 ViT's gain without the post-processing, whose cost follows the instance count (random weights)",
        "model_only", reuse="ours_fp8_vit"),
    Row("model_only_fp8_no_fc2", "the same with ours_fp8_vit_no_fc2's detector (mlp.fc2 in bf16)", "model_only",
        reuse="ours_fp8_vit_no_fc2"),
    Row("model_only_fp8_attn_fused_gelu", "the same with ours_fp8_attn_fused_gelu's detector", "model_only",
        reuse="ours_fp8_attn_fused_gelu"),
    Row("model_only_fp8_static_fc2", "the same with ours_fp8_static_fc2's detector", "model_only",
        reuse="ours_fp8_static_fc2"),
    Row("model_only_fp8_static_all", "the same with ours_fp8_static_all's detector", "model_only",
        reuse="ours_fp8_static_all"),
    Row("model_only_fp8_static_b1", "the same with ours_fp8_static_b1's detector (its batch-8 bucket)",
        "model_only", reuse="ours_fp8_static_b1"),
    Row("model_only_bf16_b8", "the same with ours_bf16_inductor_b8's detector", "model_only",
        reuse="ours_bf16_inductor_b8", targets=(Target("img_per_s", ">=", 105),)),
    Row("model_only_autotune", "the same with ours_bf16_autotune's detector (the ViT's matmuls autotuned)",
        "model_only", reuse="ours_bf16_autotune", targets=(Target("img_per_s", ">=", 105),)),
    Row("model_only_fused_gelu", "the same with ours_bf16_fused_gelu's detector (fc1 + GELU fused)", "model_only",
        reuse="ours_bf16_fused_gelu", targets=(Target("img_per_s", ">=", 105),)),
    Row("capped_bf16_b8", "ours_bf16_inductor_b8's engine again, --clients requests in flight, each answer capped at "
        "9 instances (max_instances; Meta fp32's answers hold 8.7 a case at these thresholds): the post-processing "
        "at a real model's load, where random weights' near-threshold scores give 27-68 a request", "capped",
        reuse="ours_bf16_inductor_b8", max_instances=9, targets=(Target("img_per_s", ">=", 95),)),
    Row("capped_fp8_static_fc2", "the same with ours_fp8_static_fc2's engine", "capped",
        reuse="ours_fp8_static_fc2", max_instances=9, targets=(Target("img_per_s", ">=", 140),)),
    Row("best_batched_idle", "the best bf16 engine again, --clients requests in flight, with release_when_idle "
        "(on by default since waterfall run 5; this row forces it on)", "batched_idle",
        targets=(Target("img_per_s", ">=", 95),)),
    Row("best_batched_waits", "the same with release_when_idle off (the wait budgets always: the option's "
        "throughput cost or gain, beside the row it reuses)", "batched_idle", targets=(Target("img_per_s", ">=", 95),)),
    Row("latency_single", "one request alone (1 client, >= --latency-requests), the best bf16 engine as configured "
        "(release_when_idle on by default since waterfall run 5)", "latency", targets=(Target("p50_ms", "<=", 20),)),
    Row("latency_single_waits", "the same with release_when_idle off (a lone request waits out both stages' batch "
        "budgets, 5 + 2 ms by default)", "latency", targets=(Target("p50_ms", "<=", 20),)),
    Row("latency_single_idle", "the same with release_when_idle forced on (while no batch runs a partial batch "
        "at once: no wait budgets for a lone request)", "latency", targets=(Target("p50_ms", "<=", 20),)),
    Row("latency_single_fp8", "one request alone through ours_fp8_vit_b1's engine (FP8 ViT at batch 1; "
        "release_when_idle on by default): the ViT's 14.5 ms at batch 1 is most of a lone request's 23 ms", "latency",
        reuse="ours_fp8_vit_b1", targets=(Target("p50_ms", "<=", 20),)),
    Row("latency_single_fp8_static", "one request alone through ours_fp8_static_b1's engine (every ViT linear in "
        "FP8 at batch 1, fc2 on a static scale)", "latency", reuse="ours_fp8_static_b1",
        targets=(Target("p50_ms", "<=", 20),)),
    Row("latency_capped", "latency_single with the answer capped at 9 instances (max_instances): a lone request's "
        "post-processing at a real model's load (random weights' near-threshold scores give 27-68 a request)",
        "latency", max_instances=9, targets=(Target("p50_ms", "<=", 20),)),
    Row("latency_capped_fp8_static", "latency_single_fp8_static with the answer capped at 9 instances", "latency",
        reuse="ours_fp8_static_b1", max_instances=9, targets=(Target("p50_ms", "<=", 20),)),
    Row("latency_capped_fp8_static_all", "one request alone through ours_fp8_static_all_b1's engine, the answer "
        "capped at 9 instances", "latency", reuse="ours_fp8_static_all_b1", max_instances=9,
        targets=(Target("p50_ms", "<=", 20),)),
    Row("extra_prompt", "second prompt on an image whose features are cached: ground + post-processing of one pair, "
        "prompt features cached (with the text encoder: see extra_prompt.uncached; ground alone and the answer capped "
        "at 9 instances: extra_prompt.ground_only, .capped)", "extra_prompt",
        targets=(Target("p50_ms", "<=", 3),)),
    Row("extra_prompt_fp8_static", "extra_prompt on ours_fp8_static_b1's engine (the ViT's FP8 does not enter: "
        "the image features are cached; its pair bucket 1 does)", "extra_prompt", reuse="ours_fp8_static_b1",
        targets=(Target("p50_ms", "<=", 3),)),
    Row("http", "HTTP end-to-end (Ray Serve + Locust, benchmarks/serve_gpu.sh), read from --http-results", "http",
        targets=(Target("img_per_s", ">=", 95),)),
)
ROW_NAMES = [r.name for r in ROWS]
# BEST_CANDIDATES, the bf16 engines the last rows reuse, lives in waterfall_runs beside best_engine.


# --------------------------------------------------------------------------------------------------------------
# Table


def _f(v, fmt: str) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def table(rows: list[Row], results: dict) -> str:
    head = ("| step | img/s | p50 ms | p99 ms | peak GB | TFLOP/s | % of 804 | mask IoU mean (min) | count mismatch % "
            "| max score diff | targets |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        r = results.get(row.name, {})
        if r.get("error") or r.get("skipped"):
            note = f"error: {r['error'][:140]}" if r.get("error") else f"skipped: {r['skipped'][:140]}"
            lines.append(f"| {row.name} | {note} |" + " |" * 9)  # 11 columns
            continue
        rate = r.get("img_per_s") if r.get("img_per_s") is not None else r.get("pairs_per_s")
        rate_s = _f(rate, ".1f") + (" pairs/s" if r.get("img_per_s") is None and rate is not None else "")
        iou = "" if r.get("iou_mean") is None else f"{r['iou_mean']:.4f} ({r['iou_min']:.4f})"
        checks = []
        for t in row.targets:
            ok = t.check(r.get(t.metric))
            checks.append(f"{t} {'n/a' if ok is None else '✓' if ok else '✗'}")
        lines.append(" | ".join([
            f"| {row.name}", rate_s, _f(r.get("p50_ms"), ".1f"), _f(r.get("p99_ms"), ".1f"),
            _f(r.get("peak_gb"), ".1f"),
            _f(r.get("tflops"), ".0f"), _f(r.get("pct_of_ceiling"), ".1f"), iou,
            _f(r.get("count_mismatch_pct"), ".1f"), _f(r.get("score_max_abs_diff"), ".2g"), "; ".join(checks)]) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# Main


def _flop_per_unit(row: Row, flops: dict) -> float | None:
    if row.kind == "model_only":
        return flops["image"] + flops["pair"]  # prompt features cached
    if row.kind == "extra_prompt":
        return flops["pair"]
    return flops["total"]  # one image + one prompt (text encoder included, as the design doc's 6.06 TFLOP)


def _forced_idle(row: Row) -> bool | None:
    """A latency / batched_idle row's release_when_idle: forced on (`*_idle`), off (`*_waits`), else as configured."""
    return True if row.name.endswith("_idle") else False if row.name.endswith("_waits") else None


# rows that build what they measure; the others (model_only, batched_idle, capped, latency, extra_prompt, http)
# measure an engine an earlier row built, or fill a slot, so they follow
_BUILDING_KINDS = ("meta_processor", "meta_batched", "meta_batched_model", "engine")


def run_order(wanted: list[str]) -> list[Row]:
    """The rows named in `wanted`: the building rows in the order given, then the others in table order. (Until
    2026-12-02 every row ran in table order whatever the order given: streams A/B run 1's rounds did not alternate.)"""
    by_name = {r.name: r for r in ROWS}
    building = [by_name[n] for n in dict.fromkeys(wanted) if by_name[n].kind in _BUILDING_KINDS]
    return building + [r for r in ROWS if r.name in wanted and r.kind not in _BUILDING_KINDS]


def _engine_for(b: Bench, reuse: str, results: dict) -> tuple[str, object]:
    """(name, engine) a reusing row (or the profile) measures: engine row `reuse`'s, else ("") the fastest bf16."""
    if not reuse:
        return best_engine(b, results)
    if reuse not in b.engines:
        raise Skipped(f"needs the engine of row {reuse}, which did not run or failed")
    return reuse, b.engines[reuse]


async def run_rows(b: Bench, rows: list[Row], flops: dict, deadline: float, on_row) -> tuple[dict, dict | None]:
    """Run `rows` in order; `on_row(results, profile)` after each (the files are rewritten, so a run killed at the
    device's time limit still leaves every finished row). Rows that would start after `deadline` are skipped."""
    results: dict[str, dict] = {}
    profile = None
    meta_last = max((i for i, r in enumerate(rows) if r.kind.startswith("meta")), default=-1)
    for i, row in enumerate(rows):
        t0 = time.perf_counter()
        print(f"[waterfall] {row.name} ...", flush=True)
        try:
            if t0 > deadline:
                raise Skipped(f"the run's time budget (--budget-s {b.args.budget_s:g}) is spent")
            if row.kind == "meta_processor":
                r = run_meta_processor(b, row)
            elif row.kind in ("meta_batched", "meta_batched_model"):
                r = run_meta_batched(b, row, model_only=row.kind == "meta_batched_model")
            elif row.kind == "engine":
                r, engine = await run_engine(b, row)
                reused = {later.reuse for later in rows[i + 1:]}  # kept to the end
                if b.args.profile:
                    reused.add(b.args.profile_engine)
                if row.name in BEST_CANDIDATES or row.name in reused:
                    b.engines[row.name] = engine
                    if row.name in BEST_CANDIDATES:  # keep only the fastest bf16 engine for the rows that reuse it
                        best = best_engine(b, {**results, row.name: r})[0]
                        for name in [n for n in b.engines if n != best and n in BEST_CANDIDATES and n not in reused]:
                            await close_engine(b.engines.pop(name))
                else:
                    await close_engine(engine)
                # the loop's own reference: until 2026-12-02 a closed engine stayed alive through the next row
                # (streams A/B runs 1-2: the process's first engine read up to ~4% faster; run 3, freed: ~0.9%)
                del engine
            elif row.kind == "model_only":
                r = run_model_only(b, *_engine_for(b, row.reuse, results))
            elif row.kind in ("batched_idle", "capped", "latency"):  # latency: one client, the others --clients;
                #                                                       rows with max_instances cap every answer
                r = await run_latency(b, *_engine_for(b, row.reuse, results),
                                      clients=1 if row.kind == "latency" else b.args.clients,
                                      release_when_idle=_forced_idle(row), max_instances=row.max_instances or None)
            elif row.kind == "extra_prompt":
                r = run_extra_prompt(b, *_engine_for(b, row.reuse, results))
            elif row.kind == "http":
                r = run_http(b)
            else:
                raise ValueError(f"unknown row kind {row.kind!r}")
        except Skipped as exc:
            r = {"skipped": str(exc)}
        except Exception as exc:  # noqa: BLE001  (one failing row must not hide the others)
            r = {"error": f"{type(exc).__name__}: {exc}".replace("\n", " "), "traceback": traceback.format_exc()}
            print(r["traceback"], flush=True)
        if row.kind == "engine":  # after the except block: a failed engine's traceback (its frames) is gone by now
            free_device_memory()
        rate = r.get("img_per_s") if r.get("img_per_s") is not None else r.get("pairs_per_s")
        fpu = _flop_per_unit(row, flops)
        if rate is not None and "error" not in r and "skipped" not in r:
            r["flop_per_unit"] = fpu
            r["tflops"] = rate * fpu / 1e12
            r["pct_of_ceiling"] = 100 * r["tflops"] / CEILING_TFLOPS
        r.update(what=row.what, row_s=time.perf_counter() - t0,
                 targets=[{"rule": str(t), "observed": r.get(t.metric), "passed": t.check(r.get(t.metric))}
                          for t in row.targets])
        results[row.name] = r
        print(f"[waterfall] {row.name}: " + (r.get("error") or r["skipped"] if "error" in r or "skipped" in r else
              f"{_f(rate, '.1f')}/s p50 {_f(r.get('p50_ms'), '.1f')} ms IoU {_f(r.get('iou_mean'), '.4f')}"
              f" ({r['row_s']:.0f} s)"), flush=True)
        if i == meta_last:
            b.free_meta()
        on_row(results, profile)
    if b.args.profile:
        try:
            if time.perf_counter() > deadline:
                raise Skipped("the run's time budget is spent")
            named = b.args.profile_engine if b.args.profile_engine != "best" else ""
            profile = await profile_engine(b, *_engine_for(b, named, results),
                                           clients=b.args.profile_clients or b.args.clients,
                                           max_instances=b.args.profile_max_instances or None)
        except Exception as exc:  # noqa: BLE001
            profile = {"error": f"{type(exc).__name__}: {exc}"}
        on_row(results, profile)
    for name in list(b.engines):
        await close_engine(b.engines.pop(name))
    return results, profile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for waterfall.json and waterfall.md")
    ap.add_argument("--rows", default=",".join(ROW_NAMES), help=f"comma list, from: {', '.join(ROW_NAMES)}")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per row (after warm-up)")
    ap.add_argument("--warmup-s", type=float, default=3.0,
                    help="untimed closed-loop seconds before an engine row's measurement (at least one request per "
                         "client of the row); before 2026-12-02 one round of requests: run 16's first engine read "
                         "89.9%% of its detector's rate, the second 95.0%%")
    ap.add_argument("--config", default="sam3", help="sammie.config.PRESETS key (tiny for dry runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--clients", type=int, default=32, help="requests in flight for the batched engine rows")
    ap.add_argument("--latency-requests", type=int, default=50, help="minimum requests of latency_single")
    ap.add_argument("--http-results", default=None,
                    help="Locust *_stats.csv or JSON from benchmarks/serve_gpu.sh (comma list) for the http row")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the torch.profiler breakdown")
    ap.add_argument("--profile-engine", default="best",
                    help="the engine row to profile (kept open for it), e.g. ours_fp8_vit; best = the fastest bf16")
    ap.add_argument("--profile-clients", type=int, default=0,
                    help="requests in flight while profiling (0 = --clients; 1 = a lone request's kernels)")
    ap.add_argument("--profile-max-instances", type=int, default=0,
                    help="cap every profiled answer at this many instances (0 = no cap; 9: the capped rows' load)")
    ap.add_argument("--profile-extra-prompt", action="store_true",
                    help="extra_prompt rows: torch.profiler over 50 ground calls at one pair (JSON: ground_profile)")
    ap.add_argument("--cases", type=int, default=None, help="use only the first N (image, prompt) cases (dry runs)")
    ap.add_argument("--meta-batch", type=int, default=META_BATCH, help="batch of the Meta batched and model-only rows")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="rows that would start after this many seconds from launch are skipped (device call limit)")
    ap.add_argument("--merge", default=None, help="an earlier waterfall.json: its rows not run now join the table")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    wanted = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(ROW_NAMES))
    if unknown:
        ap.error(f"unknown row(s) {unknown}; valid: {', '.join(ROW_NAMES)}")
    rows = run_order(wanted)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(Path(args.merge).read_text())["rows"] if args.merge else {}

    from flops import DESIGN_DOC_TFLOP, count_detector_flops

    b = Bench(args)
    info = {**versions(b.dev), "command": " ".join(sys.argv), "config": args.config, "device": str(b.dev),
            "seconds_per_row": args.seconds, "warmup_s_per_engine_row": args.warmup_s, "clients": args.clients,
            "cases": [list(c) for c in b.cases],
            "image_size": IMAGE_SIZE, "thresholds": {f"{p}/{q}": t for (p, q), t in b.thresholds.items()},
            "truth_instances_per_case": statistics.fmean(len(v) for v in b.truth.values()),
            "build_s": b.build_s, "truth_s": b.truth_s, "merged_from": args.merge,
            "weights": "random (sammie.reference.randomize_, seed 0) in Meta's model, loaded by every engine row "
                       "from a Meta-layout checkpoint"}
    flops = count_detector_flops(b.cfg, b.dev)
    info["flops"] = {**flops, "design_doc_tflop": DESIGN_DOC_TFLOP}
    print(f"[waterfall] FLOP per image + prompt: {flops['total'] / 1e12:.3f} TFLOP counted "
          f"(image {flops['image'] / 1e12:.3f}, prompt {flops['prompt'] / 1e12:.4f}, pair {flops['pair'] / 1e12:.3f});"
          f" design doc {DESIGN_DOC_TFLOP}", flush=True)

    def write(results: dict, profile: dict | None, final: bool = False) -> str:
        merged = {**{k: v for k, v in earlier.items() if k not in results}, **results}
        shown = [r for r in ROWS if r.name in merged]
        info["total_s"] = time.perf_counter() - t_start
        info["complete"] = final
        text = markdown(info, args, b, shown, merged, profile, flops)
        (out_dir / "waterfall.md").write_text(text)
        (out_dir / "waterfall.json").write_text(json.dumps({"info": info, "rows": merged, "profile": profile},
                                                           indent=1, default=str))
        return text

    results, profile = asyncio.run(run_rows(b, rows, flops, t_start + args.budget_s, write))
    print("\n" + write(results, profile, final=True), flush=True)
    b.tmp.cleanup()
    return 0


def markdown(info: dict, args, b: Bench, rows: list[Row], results: dict, profile: dict | None, flops: dict) -> str:
    from flops import DESIGN_DOC_TFLOP

    md = [f"# Waterfall ({info.get('gpu') or info.get('cpu')}, driver {info.get('driver')}, torch {info['torch']}, "
          f"triton {info['triton']}, sam3 {info['sam3']}, transformers {info['transformers']}, {info['date']})", "",
          f"`{info['command']}`" + ("" if info["complete"] else " (**incomplete: written after each row**)"), "",
          f"Config `{args.config}`, {info['weights']}. Inputs: {len({p for p, _ in b.cases})} photographs at "
          f"{IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} JPEG q{JPEG_QUALITY}, {len(b.cases)} (image, prompt) cases, one prompt per "
          f"request; {args.seconds:g} s per row (engine rows after {args.warmup_s:g} s of warm-up), {args.clients} "
          f"requests in flight on batched engine rows. FLOP per "
          f"image + prompt {flops['total'] / 1e12:.3f} TFLOP counted on our detector (design doc: {DESIGN_DOC_TFLOP});"
          f" % of {CEILING_TFLOPS:.0f} TFLOP/s (measured bf16 matmul rate). Oracle: vs Meta fp32 (TF32 off) at "
          f"identical weights, {len(b.cases)} cases, {info['truth_instances_per_case']:.1f} instances per case "
          f"(threshold in the widest score gap between ranks {GAP_RANKS[0]} and {GAP_RANKS[1]}). "
          f"Total {info['total_s']:.0f} s.", "", table(rows, results), "", "| step | what |", "|---|---|"]
    md += [f"| {r.name} | {r.what} |" for r in rows]
    if profile and not profile.get("error"):
        md += ["", f"Profile of {profile['engine_row']} ({profile['requests']} requests, {profile['clients']} in flight, "
               f"{profile['img_per_s']:.1f} img/s under the profiler): top kernels by self device time", "",
               "| kernel | self ms | share % | calls |", "|---|---|---|---|"]
        md += [f"| `{k.get('kernel', k.get('op'))[:90]}` | {k['self_ms']:.1f} | {k['share_pct']:.1f} | {k['calls']} |"
               for k in profile["top_kernels"]]
        md += ["", "Engine stage means (ms per request): " + ", ".join(
            f"{k} {v:.1f}" for k, v in profile["engine_stage_ms_mean"].items())]
    elif profile:
        md += ["", f"Profile: error: {profile['error']}"]
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    sys.exit(main())
