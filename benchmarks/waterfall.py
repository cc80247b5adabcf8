"""The speed waterfall of issue 4: Meta's reference, then Sammie one optimisation at a time, in ONE process and run,
with accuracy against Meta's fp32 model on every row that produces instances. One markdown table out.

    python benchmarks/waterfall.py --out benchmarks/results/waterfall            # on the H200 (~8 min)
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

Rows (`ROWS`; `--rows` picks a subset, in table order): Meta per image (fp32 with TF32 as Meta's import sets it, and
bf16 autocast), Meta's batched Datapoint path at batch 8 (end to end, and model forward only), then Sammie's engine
in-process (asyncio, JPEG bytes in, instances out incl. decode and post-processing; `--clients` requests in flight):
fp32 and bf16 one request at a time, bf16 batched, + CUDA graphs, + Triton kernels, + FP8 ViT; then the best bf16
engine's detector alone on a pre-processed batch of 8, a lone request's latency, a second prompt on a cached image,
and an HTTP slot filled from `--http-results` (`benchmarks/serve_gpu.sh`). Every row runs in try/except: a failing
row records its error and the run goes on. Engine rows are built only from `EngineConfig` values; a baseline value
(compile "none", kernels "reference", vit_fp8 False) for a field this EngineConfig lacks is dropped and noted.

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
import contextlib
import gc
import io
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: sammie, engine_core
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_parity (photos, prompts), flops

CEILING_TFLOPS = 804.0  # bf16 matmul rate measured on the lent H200 (sam3-reference.md section 12)
IMAGE_SIZE = (640, 480)  # width, height of every request image (issue 4's reference numbers use 640x480)
JPEG_QUALITY = 90
GAP_RANKS = (5, 20)  # per-case threshold: widest score gap between these ranks (see the module docstring)
META_FP32_MAX_REQUESTS = 24  # Meta fp32 per image runs ~9 img/s; 24 requests are enough for p50 and save the budget
META_BATCH = 8  # Meta's Datapoint path batch (issue 4's 24.5 / 42 img/s) and the model-only batch


# --------------------------------------------------------------------------------------------------------------
# Rows


class Skipped(Exception):
    """A row not run by design (no --http-results, time budget spent): the table says "skipped", not "error"."""


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
    kind: str  # meta_processor | meta_batched(_model) | engine | model_only | latency | extra_prompt | http
    engine: dict = field(default_factory=dict)  # EngineConfig values (engine rows)
    clients: int = 0  # requests in flight (engine rows); 0 = --clients
    autocast: bool = False  # Meta rows: bf16 autocast
    targets: tuple[Target, ...] = ()


ACC_BF16 = (Target("iou_mean", ">=", 0.99), Target("count_mismatch_pct", "<=", 1.0))
ACC_FP8 = (Target("iou_mean", ">=", 0.98), Target("count_mismatch_pct", "<=", 2.0))
B1 = {"max_image_batch": 1, "max_pair_batch": 1, "compile": "none", "kernels": "reference", "vit_fp8": False}
BATCHED = {"dtype": "bf16", "max_image_batch": 8, "max_pair_batch": 16, "compile": "none", "kernels": "reference",
           "vit_fp8": False}
# An EngineConfig without one of these fields can only behave as this value: dropped (and noted) when absent.
BASELINE_VALUES = {"compile": "none", "kernels": "reference", "vit_fp8": False}

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
    Row("ours_fp8_vit", "+ vit_fp8=True (FP8 ViT linears, quantisation fused by inductor; the engine's FP8 gate "
        "decides); inductor, buckets images 8 / pairs 8 only", "engine",
        engine={**BATCHED, "compile": "inductor", "kernels": "triton", "vit_fp8": True, "max_pair_batch": 8,
                "image_buckets": [8], "pair_buckets": [8]},
        targets=(Target("img_per_s", ">=", 140), *ACC_FP8)),
    Row("model_only_best", "the best bf16 engine's detector alone: encode_images + ground on a pre-processed batch "
        "of 8 (one prompt each, prompt features cached); no decode, no post-processing; latency per batch",
        "model_only", targets=(Target("img_per_s", ">=", 105),)),
    Row("latency_single", "one request alone (1 client, >= --latency-requests), the best bf16 engine as configured "
        "(its batch wait budgets included)", "latency", targets=(Target("p50_ms", "<=", 20),)),
    Row("extra_prompt", "second prompt on an image whose features are cached: ground + post-processing of one pair, "
        "prompt features cached (with the text encoder: see extra_prompt.uncached)", "extra_prompt",
        targets=(Target("p50_ms", "<=", 3),)),
    Row("http", "HTTP end-to-end (Ray Serve + Locust, benchmarks/serve_gpu.sh), read from --http-results", "http",
        targets=(Target("img_per_s", ">=", 95),)),
)
ROW_NAMES = [r.name for r in ROWS]
BEST_CANDIDATES = ("ours_bf16_inductor", "ours_bf16_triton", "ours_bf16_graphs", "ours_bf16_batched")  # bf16 engines for the last rows


# --------------------------------------------------------------------------------------------------------------
# Inputs and ground truth


def jpeg_photos() -> dict[str, bytes]:
    """gpu_parity's photographs as 640x480 JPEG bytes: 4:3 centre crop, LANCZOS, quality 90 (benchmarks/locustfile.py's
    recipe, so the engine rows see what the HTTP row sees)."""
    from gpu_parity import photos
    from PIL import Image

    out = {}
    w_out, h_out = IMAGE_SIZE
    for name, img in photos().items():
        img = img.convert("RGB")
        w, h = img.size
        if w * h_out > h * w_out:  # too wide: crop width
            cw = h * w_out // h_out
            img = img.crop(((w - cw) // 2, 0, (w - cw) // 2 + cw, h))
        else:
            ch = w * h_out // w_out
            img = img.crop((0, (h - ch) // 2, w, (h - ch) // 2 + ch))
        buf = io.BytesIO()
        img.resize(IMAGE_SIZE, Image.Resampling.LANCZOS).save(buf, format="JPEG", quality=JPEG_QUALITY)
        out[name] = buf.getvalue()
    return out


def decode_pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def threshold_in_gap(scores: np.ndarray, ranks: tuple[int, int] = GAP_RANKS) -> float:
    """Midpoint of the widest gap between consecutive scores (highest first) at ranks lo..hi: keeps lo..hi instances."""
    s = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    hi = min(ranks[1], len(s) - 1)
    lo = max(1, min(ranks[0], hi))
    gaps = s[lo - 1:hi] - s[lo:hi + 1]  # gap after rank k (k = lo..hi, 1-based) is s[k-1] - s[k]
    k = lo - 1 + int(np.argmax(gaps))
    return float((s[k] + s[k + 1]) / 2)


@contextlib.contextmanager
def tf32(enabled: bool):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Bench:
    """What every row shares: device, config, inputs, thresholds, ground truth, Meta's model, the checkpoint file."""

    def __init__(self, args):
        from gpu_parity import PAIRS

        import sam3  # noqa: F401  (its import turns TF32 on; every row sets TF32 explicitly)
        from sammie.config import PRESETS
        from sammie.reference import build_reference_model, randomize_

        self.args = args
        self.dev = torch.device(args.device)
        self.cfg = PRESETS[args.config]()
        self.jpeg = jpeg_photos()
        self.cases = [(n, p) for n, ps in PAIRS for p in ps if n in self.jpeg][:args.cases]  # (photo, prompt)
        self.second_prompt = {n: ps[1] for n, ps in PAIRS if (n, ps[1]) in self.cases}  # for extra_prompt
        t0 = time.perf_counter()
        self.meta = randomize_(build_reference_model(self.cfg, device=self.dev, seed=0), seed=0).eval()
        self.meta_bytes = sum(p.numel() * p.element_size() for p in self.meta.parameters())
        self.tmp = tempfile.TemporaryDirectory(prefix="waterfall-")
        self.checkpoint = str(Path(self.tmp.name) / "sam3.pt")  # Meta layout: "detector." + Sam3Image's keys
        torch.save({"detector." + k: v.detach().cpu() for k, v in self.meta.state_dict().items()}, self.checkpoint)
        self.build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.thresholds, self.truth = {}, {}
        with tf32(False):  # ground truth in true fp32
            for case in self.cases:
                every = self.meta_segment(case, -1.0)
                self.thresholds[case] = threshold_in_gap(np.array([i.score for i in every]))
                self.truth[case] = [i for i in every if i.score > self.thresholds[case]]
        self.truth_s = time.perf_counter() - t0
        self.engines: dict[str, Any] = {}  # live bf16 engines kept for the rows that reuse the best one

    def meta_segment(self, case, threshold: float):
        from sammie.reference import reference_segment

        return reference_segment(self.meta, self.cfg, decode_pil(self.jpeg[case[0]]), case[1], threshold, self.dev)[0]

    def free_meta(self) -> None:
        self.meta = None
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def engine_config(self, values: dict) -> tuple[Any, list[str]]:
        """EngineConfig for a row; baseline values of fields this EngineConfig lacks are dropped (returned)."""
        from sammie.engine import EngineConfig

        have = {f.name for f in fields(EngineConfig)}
        dropped = [k for k, v in values.items() if k not in have and BASELINE_VALUES.get(k, object()) == v]
        args = {k: v for k, v in values.items() if k not in dropped}
        args.update(checkpoint=self.checkpoint, config=self.args.config, device=str(self.dev),
                    max_queued=max(64, 2 * self.args.clients), request_timeout_s=300.0)
        return EngineConfig.from_dict(args), dropped


# --------------------------------------------------------------------------------------------------------------
# Measurement helpers


def summarise(latencies_ms: list[float], n_units: int, elapsed_s: float) -> dict[str, float | int]:
    lat = np.asarray(latencies_ms, dtype=np.float64)
    return {"n": len(lat), "rate": n_units / elapsed_s if elapsed_s > 0 else float("nan"),
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "mean_ms": float(lat.mean()), "elapsed_s": elapsed_s}


def timed_loop(step, seconds: float, max_iters: int | None = None, min_iters: int = 1,
               dev: torch.device | None = None) -> list[float]:
    """Run `step(i)` (which must synchronise, or pass dev) until `seconds` passed and >= min_iters; ms per call."""
    out, t_end = [], time.perf_counter() + seconds
    while (time.perf_counter() < t_end or len(out) < min_iters) and (max_iters is None or len(out) < max_iters):
        t = time.perf_counter()
        step(len(out))
        if dev is not None:
            sync(dev)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def oracle_columns(outputs: dict, truth: dict) -> dict[str, Any]:
    """Instance metrics of `outputs[case]` vs `truth[case]` over the cases present in `outputs`."""
    from engine_core.oracle import instance_metrics, run_oracle

    cases = list(outputs)
    report = run_oracle(cases, outputs.__getitem__, truth.__getitem__, [instance_metrics], name_of=str)
    return {
        "iou_mean": report.aggregate("mask_iou", "mean"), "iou_min": report.aggregate("mask_iou", "min"),
        "count_mismatch_pct": 100.0 * report.aggregate("count_mismatch", "mean"),
        "score_max_abs_diff": report.aggregate("max_score_delta", "max"),
        "box_max_abs_diff_px": report.aggregate("max_box_delta_px", "max"),
        "oracle_cases": len(cases), "instances_per_case": report.aggregate("n_ours", "mean"),
        "oracle": report.to_json(),
    }


class MemoryWindow:
    """Peak device memory of one row: max_memory_allocated minus what was allocated at the start, plus `own` bytes
    already resident that belong to the row (a model built earlier)."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.cuda = dev.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            self.base = torch.cuda.memory_allocated(dev)

    def peak_gb(self, own_bytes: int = 0) -> float | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.dev)
        return (torch.cuda.max_memory_allocated(self.dev) - self.base + own_bytes) / 1e9


# --------------------------------------------------------------------------------------------------------------
# Meta rows


def run_meta_processor(b: Bench, row: Row) -> dict:
    dev = b.dev
    amp = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if row.autocast else contextlib.nullcontext
    cap = META_FP32_MAX_REQUESTS if not row.autocast else None
    mem = MemoryWindow(dev)
    with tf32(True):  # Meta's own default (model_builder._setup_tf32 at import)
        def one(case):
            with amp():
                return b.meta_segment(case, b.thresholds[case])

        for case in b.cases[:2]:  # warm-up
            one(case)
        sync(dev)
        t0 = time.perf_counter()
        lat = timed_loop(lambda i: one(b.cases[i % len(b.cases)]), b.args.seconds, cap, dev=dev)
        stats = summarise(lat, len(lat), time.perf_counter() - t0)
        outputs = {case: one(case) for case in b.cases}
    return {**stats, "img_per_s": stats["rate"], "peak_gb": mem.peak_gb(b.meta_bytes), "tf32": True,
            **oracle_columns(outputs, b.truth)}


def _datapoints(b: Bench, cases, qid0: int = 0):
    """One Meta Datapoint per (image, prompt) request, transformed on the CPU as Meta's batched-inference notebook
    does (sam3-reference.md section 6), from the JPEG bytes."""
    from sam3.train.data.sam3_image_dataset import Datapoint, FindQueryLoaded, InferenceMetadata
    from sam3.train.data.sam3_image_dataset import Image as SAMImage
    from sam3.train.transforms.basic_for_api import ComposeAPI, NormalizeAPI, RandomResizeAPI, ToTensorAPI

    s = b.cfg.image_size
    transform = ComposeAPI([RandomResizeAPI(sizes=s, max_size=s, square=True, consistent_transform=False),
                            ToTensorAPI(), NormalizeAPI(mean=list(b.cfg.pixel_mean), std=list(b.cfg.pixel_std))])
    out = []
    for q, (photo, prompt) in enumerate(cases):
        pil = decode_pil(b.jpeg[photo])
        w, h = pil.size
        qid = qid0 + q  # unique per query: PostProcessImage concatenates results with the same id
        dp = Datapoint(find_queries=[], images=[SAMImage(data=pil, objects=[], size=[h, w])])
        dp.find_queries.append(FindQueryLoaded(
            query_text=prompt, image_id=0, object_ids_output=[], is_exhaustive=True, query_processing_order=0,
            inference_metadata=InferenceMetadata(coco_image_id=qid, original_image_id=qid, original_category_id=1,
                                                 original_size=[h, w], object_id=0, frame_index=0)))
        out.append(transform(dp))
    return out


def _collate(b: Bench, datapoints):
    from sam3.model.utils.misc import copy_data_to_device
    from sam3.train.data.collator import collate_fn_api

    batch = collate_fn_api(datapoints, dict_key="waterfall")["waterfall"]
    return copy_data_to_device(batch, b.dev, non_blocking=True)


def _postprocessor(b: Bench, threshold: float):
    from sam3.eval.postprocessors import PostProcessImage

    return PostProcessImage(max_dets_per_img=-1, iou_type="segm", use_original_sizes_box=True,
                            use_original_sizes_mask=True, convert_mask_to_rle=False, detection_threshold=threshold,
                            to_cpu=False, always_interpolate_masks_on_gpu=b.dev.type == "cuda")


def run_meta_batched(b: Bench, row: Row, model_only: bool) -> dict:
    from sammie.reference import cpu_safe
    from sammie.segmenter import Instance

    dev = b.dev
    n = b.args.meta_batch
    batches = [[b.cases[(k * n + j) % len(b.cases)] for j in range(n)] for k in range(len(b.cases))]
    # one threshold per batch (PostProcessImage has one): the median of its cases' thresholds
    post_of = [_postprocessor(b, float(np.median([b.thresholds[c] for c in cs]))) for cs in batches]
    mem = MemoryWindow(dev)
    with tf32(True), torch.inference_mode(), cpu_safe(dev), torch.autocast(dev.type, dtype=torch.bfloat16):
        if model_only:
            collated = [_collate(b, _datapoints(b, cs)) for cs in batches[:2]]

            def step(i):
                b.meta(collated[i % len(collated)])
        else:
            def step(i):
                batch = _collate(b, _datapoints(b, batches[i % len(batches)]))
                results = post_of[i % len(batches)].process_results(b.meta(batch), batch.find_metadatas)
                return results

        for i in range(2):
            step(i)
        sync(dev)
        t0 = time.perf_counter()
        lat = timed_loop(step, b.args.seconds, dev=dev)
        stats = summarise(lat, n * len(lat), time.perf_counter() - t0)
        result = {**stats, "img_per_s": stats["rate"], "peak_gb": mem.peak_gb(b.meta_bytes), "tf32": True,
                  "batch": n}
        if not model_only:  # oracle: the loosest threshold of a batch, then each case's own (same set as running it)
            outputs = {}
            for start in range(0, len(b.cases), n):
                cs = b.cases[start:start + n]
                batch = _collate(b, _datapoints(b, cs))
                res = _postprocessor(b, min(b.thresholds[c] for c in cs)).process_results(
                    b.meta(batch), batch.find_metadatas)
                for q, c in enumerate(cs):
                    r = res[q]
                    keep = [k for k in torch.argsort(r["scores"].float(), descending=True, stable=True).tolist()
                            if float(r["scores"][k]) > b.thresholds[c]]
                    outputs[c] = [Instance(float(r["scores"][k]), tuple(r["boxes"][k].float().tolist()),
                                           r["masks"][k, 0].cpu().numpy()) for k in keep]
            result.update(oracle_columns(outputs, b.truth))
    return result


# --------------------------------------------------------------------------------------------------------------
# Sammie engine rows


async def drive(engine, b: Bench, clients: int, seconds: float, min_requests: int = 0) -> dict:
    """Closed loop: `clients` tasks each send the next (JPEG, prompt) case when their last answer arrives."""
    cases = b.cases
    latencies, stages, kept = [], {}, []
    t_end = time.perf_counter() + seconds
    issued = 0

    async def client(k: int) -> None:
        nonlocal issued
        i = k
        while time.perf_counter() < t_end or issued < min_requests:
            issued += 1
            photo, prompt = cases[i % len(cases)]
            i += clients
            t = time.perf_counter()
            res = await engine.segment(b.jpeg[photo], [prompt], threshold=b.thresholds[(photo, prompt)])
            latencies.append((time.perf_counter() - t) * 1e3)
            kept.append(len(res.prompts[0].instances))
            for name, ms in res.timings_ms.items():
                stages.setdefault(name, []).append(ms)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    stats = summarise(latencies, len(latencies), time.perf_counter() - t0)
    stats["engine_stage_ms_mean"] = {k: statistics.fmean(v) for k, v in stages.items()}
    stats["instances_per_request"] = statistics.fmean(kept) if kept else 0.0
    return stats


async def engine_outputs(engine, b: Bench) -> dict:
    res = await asyncio.gather(*(engine.segment(b.jpeg[p], [q], threshold=b.thresholds[(p, q)]) for p, q in b.cases))
    return {case: r.prompts[0].instances for case, r in zip(b.cases, res)}


def _health(engine) -> dict:
    try:
        return engine.health()
    except Exception as exc:  # noqa: BLE001  (diagnostics only)
        return {"error": repr(exc)}


async def close_engine(engine) -> None:
    with contextlib.suppress(Exception):
        await engine.aclose()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


async def run_engine(b: Bench, row: Row) -> tuple[dict, Any]:
    from sammie.engine import SammieEngine

    cfg, dropped = b.engine_config(row.engine)
    clients = row.clients or b.args.clients
    mem = MemoryWindow(b.dev)
    with tf32(False):  # Sammie sets no global torch flags (STYLE A1): production numerics
        t0 = time.perf_counter()
        engine = SammieEngine(cfg)
        await engine.start()
        start_s = time.perf_counter() - t0
        try:
            gate = getattr(engine, "vit_fp8", None)  # the engine's FP8 accuracy gate report (None: not requested)
            if row.engine.get("vit_fp8") and not getattr(gate, "enabled", False):
                raise RuntimeError(f"FP8 gate did not pass, the engine serves bf16: "
                                   f"{gate.as_dict() if hasattr(gate, 'as_dict') else gate}")
            await drive(engine, b, clients, 0.0, min_requests=clients)  # untimed: caches, allocator, first batches
            stats = await drive(engine, b, clients, b.args.seconds)
            outputs = await engine_outputs(engine, b)
        except BaseException:
            await close_engine(engine)
            raise
    result = {**stats, "img_per_s": stats["rate"], "peak_gb": mem.peak_gb(), "tf32": False, "clients": clients,
              "engine_config": {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "checkpoint"},
              "config_dropped": dropped, "start_s": start_s, "engine_health": _health(engine),
              "vit_fp8_gate": gate.as_dict() if hasattr(gate, "as_dict") else None,
              **oracle_columns(outputs, b.truth)}
    return result, engine


def best_engine(b: Bench, results: dict) -> tuple[str, Any]:
    live = [(results[n]["img_per_s"], n) for n in BEST_CANDIDATES if n in b.engines and n in results
            and results[n].get("img_per_s") is not None]
    if not live:
        raise RuntimeError(f"needs one of the rows {', '.join(BEST_CANDIDATES)} to have run without error")
    name = max(live)[1]
    return name, b.engines[name]


def _detector_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.detector.parameters())


def run_model_only(b: Bench, name: str, engine) -> dict:
    from sammie.decode import decode_image
    from sammie.preprocess import Preprocessor

    det, dev, n = engine.detector, b.dev, b.args.meta_batch
    cases = [b.cases[j % len(b.cases)] for j in range(n)]
    mem = MemoryWindow(dev)
    with tf32(False), torch.inference_mode():
        rgb = [decode_image(b.jpeg[p], 10**8) for p, _ in cases]
        pixels = Preprocessor(b.cfg).batch(rgb, dev).to(engine.dtype)  # [8, 3, S, S], outside the timing
        prompts = det.encode_prompts(engine.tokenizer([q for _, q in cases]).to(dev))
        index = torch.arange(n, device=dev)

        def step(i):
            det.ground(det.encode_images(pixels), prompts, index, index)

        for i in range(3):
            step(i)
        sync(dev)
        t0 = time.perf_counter()
        lat = timed_loop(step, b.args.seconds, dev=dev)
        stats = summarise(lat, n * len(lat), time.perf_counter() - t0)
    return {**stats, "img_per_s": stats["rate"], "peak_gb": mem.peak_gb(_detector_bytes(engine)), "batch": n,
            "engine_row": name, "note": "calls engine.detector directly: CUDA graphs or compilation applied outside "
            "the detector module are not in this row"}


async def run_latency(b: Bench, name: str, engine) -> dict:
    mem = MemoryWindow(b.dev)
    with tf32(False):
        stats = await drive(engine, b, 1, b.args.seconds, min_requests=b.args.latency_requests)
    return {**stats, "img_per_s": stats["rate"], "peak_gb": mem.peak_gb(_detector_bytes(engine)),
            "engine_row": name, "image_wait_ms": engine.cfg.image_wait_ms, "pair_wait_ms": engine.cfg.pair_wait_ms}


def _postprocess_one(engine, out, height: int, width: int, threshold: float):
    """The engine's own post-processing for one pair: the batched serving path when this tree has it, else the
    per-pair reference."""
    from sammie import segmenter

    if hasattr(segmenter, "postprocess_batch") and hasattr(engine, "registry"):
        return segmenter.postprocess_batch(engine.registry, out.logits, out.presence_logits, out.boxes,
                                           out.mask_logits, [(height, width)], [threshold], [None],
                                           engine.model_cfg.mask_threshold)[0]
    return segmenter.postprocess_pair(out.logits[0], out.presence_logits[0], out.boxes[0], out.mask_logits[0],
                                      height, width, threshold)


def run_extra_prompt(b: Bench, name: str, engine) -> dict:
    from sammie.decode import decode_image
    from sammie.preprocess import Preprocessor

    det, dev = engine.detector, b.dev
    photos = list(b.second_prompt)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    mem = MemoryWindow(dev)
    with tf32(False), torch.inference_mode():
        cached = {}  # photo -> (image features, (H, W)); the "cached image"
        for p in photos:
            rgb = decode_image(b.jpeg[p], 10**8)
            pixels = Preprocessor(b.cfg).batch([rgb], dev).to(engine.dtype)
            cached[p] = (det.encode_images(pixels), (int(rgb.shape[1]), int(rgb.shape[2])))
        text = {p: det.encode_prompts(engine.tokenizer([b.second_prompt[p]]).to(dev)) for p in photos}

        def pair(p, with_text: bool):
            feats, (h, w) = cached[p]
            prompt = det.encode_prompts(engine.tokenizer([b.second_prompt[p]]).to(dev)) if with_text else text[p]
            return _postprocess_one(engine, det.ground(feats, prompt, zero, zero), h, w,
                                    b.thresholds[(p, b.second_prompt[p])])

        for p in photos:  # warm-up
            pair(p, True)
        sync(dev)
        p0 = photos[0]
        lat = timed_loop(lambda i: pair(p0, False), b.args.seconds / 2, min_iters=10, dev=dev)
        lat_text = timed_loop(lambda i: pair(p0, True), b.args.seconds / 2, min_iters=10, dev=dev)
        outputs = {(p, b.second_prompt[p]): pair(p, False) for p in photos}
    stats = summarise(lat, len(lat), sum(lat) / 1e3)
    text_stats = summarise(lat_text, len(lat_text), sum(lat_text) / 1e3)
    return {**stats, "img_per_s": None, "pairs_per_s": stats["rate"], "peak_gb": mem.peak_gb(_detector_bytes(engine)),
            "engine_row": name, "photo": p0, "prompt": b.second_prompt[p0],
            "uncached": {"p50_ms": text_stats["p50_ms"], "p99_ms": text_stats["p99_ms"], "n": text_stats["n"]},
            **oracle_columns(outputs, b.truth)}


def run_http(b: Bench) -> dict:
    """The fastest of the `--http-results` files (comma-separated): Locust `*_stats.csv` as `serve_gpu.sh` writes them
    (images/s = Requests/s - Failures/s of the POST /v1/segment row, p50/p99 from its 50% / 99% columns), or JSON (an
    object or a list of them with img_per_s | images_per_s, p50_ms, p99_ms, optional peak_gb)."""
    import csv

    if not b.args.http_results:
        raise Skipped("not run here: pass --http-results u32_stats.csv[,u64_stats.csv] (benchmarks/serve_gpu.sh)")

    def get(d, *keys):
        return next((float(d[k]) for k in keys if d.get(k) not in (None, "", "N/A")), None)

    steps = []
    for path in b.args.http_results.split(","):
        path = Path(path.strip())
        if path.suffix == ".csv":
            rows = list(csv.DictReader(path.read_text().splitlines()))
            row = next((r for r in rows if r.get("Name", "").endswith("/v1/segment")), None) or \
                next((r for r in rows if r.get("Name") == "Aggregated"), None)
            if row is None:
                raise RuntimeError(f"{path}: no /v1/segment or Aggregated row")
            steps.append({"img_per_s": get(row, "Requests/s") - (get(row, "Failures/s") or 0.0),
                          "p50_ms": get(row, "50%"), "p99_ms": get(row, "99%"), "peak_gb": None,
                          "requests": get(row, "Request Count"), "failures": get(row, "Failure Count"),
                          "source": str(path)})
        else:
            data = json.loads(path.read_text())
            items = data if isinstance(data, list) else data.get("steps", [data])
            steps += [{"img_per_s": get(d, "img_per_s", "images_per_s"), "p50_ms": get(d, "p50_ms", "p50"),
                       "p99_ms": get(d, "p99_ms", "p99"), "peak_gb": get(d, "peak_gb"), "source": str(path)}
                      for d in items if isinstance(d, dict)]
    steps = [st for st in steps if st["img_per_s"] is not None]
    if not steps:
        raise RuntimeError(f"{b.args.http_results}: no step with an images/s value")
    return {**max(steps, key=lambda st: st["img_per_s"]), "all_steps": steps}


# --------------------------------------------------------------------------------------------------------------
# Profile of the best configuration


async def profile_engine(b: Bench, name: str, engine) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = b.dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with tf32(False), profile(activities=activities) as prof:
        stats = await drive(engine, b, b.args.clients, min(3.0, b.args.seconds))
    events = prof.key_averages()

    def dev_self(e):
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0)

    def dev_total(e):
        return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0)

    if cuda:
        kernels = [e for e in events if "CUDA" in str(getattr(e, "device_type", "")) and dev_self(e) > 0]
        kernels.sort(key=dev_self, reverse=True)
        total = sum(dev_self(e) for e in kernels) or 1.0
        top = [{"kernel": e.key[:160], "self_ms": dev_self(e) / 1e3, "share_pct": 100 * dev_self(e) / total,
                "calls": e.count} for e in kernels[:15]]
    else:
        cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in cpu) or 1.0
        top = [{"op": e.key[:160], "self_ms": e.self_cpu_time_total / 1e3,
                "share_pct": 100 * e.self_cpu_time_total / total, "calls": e.count} for e in cpu[:15]]
    stages = {e.key: {"calls": e.count, "cpu_total_ms": e.cpu_time_total / 1e3, "device_total_ms": dev_total(e) / 1e3}
              for e in events if e.key.startswith("sammie.")}
    return {"engine_row": name, "seconds": stats["elapsed_s"], "requests": stats["n"], "img_per_s": stats["rate"],
            "top_kernels": top, "device_time_total_ms": total / 1e3, "stages": stages,
            "engine_stage_ms_mean": stats["engine_stage_ms_mean"]}


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


def versions(dev: torch.device) -> dict:
    from importlib import metadata

    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("triton", "sam3", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            out["driver"] = None
    else:
        out["gpu"] = None
        out["cpu"] = platform.processor() or platform.machine()
    return out


# --------------------------------------------------------------------------------------------------------------
# Main


def _flop_per_unit(row: Row, flops: dict) -> float | None:
    if row.kind == "model_only":
        return flops["image"] + flops["pair"]  # prompt features cached
    if row.kind == "extra_prompt":
        return flops["pair"]
    return flops["total"]  # one image + one prompt (text encoder included, as the design doc's 6.06 TFLOP)


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
                if row.name in BEST_CANDIDATES:  # keep the fastest bf16 engine alive for the rows that reuse it
                    b.engines[row.name] = engine
                    best, _ = best_engine(b, {**results, row.name: r})
                    for name in [n for n in b.engines if n != best]:
                        await close_engine(b.engines.pop(name))
                else:
                    await close_engine(engine)
            elif row.kind == "model_only":
                r = run_model_only(b, *best_engine(b, results))
            elif row.kind == "latency":
                r = await run_latency(b, *best_engine(b, results))
            elif row.kind == "extra_prompt":
                r = run_extra_prompt(b, *best_engine(b, results))
            elif row.kind == "http":
                r = run_http(b)
            else:
                raise ValueError(f"unknown row kind {row.kind!r}")
        except Skipped as exc:
            r = {"skipped": str(exc)}
        except Exception as exc:  # noqa: BLE001  (one failing row must not hide the others)
            r = {"error": f"{type(exc).__name__}: {exc}".replace("\n", " "), "traceback": traceback.format_exc()}
            print(r["traceback"], flush=True)
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
            profile = await profile_engine(b, *best_engine(b, results))
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
    ap.add_argument("--config", default="sam3", help="sammie.config.PRESETS key (tiny for dry runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--clients", type=int, default=32, help="requests in flight for the batched engine rows")
    ap.add_argument("--latency-requests", type=int, default=50, help="minimum requests of latency_single")
    ap.add_argument("--http-results", default=None,
                    help="Locust *_stats.csv or JSON from benchmarks/serve_gpu.sh (comma list) for the http row")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the torch.profiler breakdown")
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
    rows = [r for r in ROWS if r.name in wanted]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(Path(args.merge).read_text())["rows"] if args.merge else {}

    from flops import DESIGN_DOC_TFLOP, count_detector_flops

    b = Bench(args)
    info = {**versions(b.dev), "command": " ".join(sys.argv), "config": args.config, "device": str(b.dev),
            "seconds_per_row": args.seconds, "clients": args.clients, "cases": [list(c) for c in b.cases],
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
          f"request; {args.seconds:g} s per row, {args.clients} requests in flight on batched engine rows. FLOP per "
          f"image + prompt {flops['total'] / 1e12:.3f} TFLOP counted on our detector (design doc: {DESIGN_DOC_TFLOP});"
          f" % of {CEILING_TFLOPS:.0f} TFLOP/s (measured bf16 matmul rate). Oracle: vs Meta fp32 (TF32 off) at "
          f"identical weights, {len(b.cases)} cases, {info['truth_instances_per_case']:.1f} instances per case "
          f"(threshold in the widest score gap between ranks {GAP_RANKS[0]} and {GAP_RANKS[1]}). "
          f"Total {info['total_s']:.0f} s.", "", table(rows, results), "", "| step | what |", "|---|---|"]
    md += [f"| {r.name} | {r.what} |" for r in rows]
    if profile and not profile.get("error"):
        md += ["", f"Profile of {profile['engine_row']} ({profile['requests']} requests, "
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
