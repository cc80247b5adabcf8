"""SammieEngine: the detector on one device behind `engine_core`'s two-stage batch scheduler.

Request path (one `segment` call)::

    image bytes --(CPU pool thread: sammie.decode)--> uint8 RGB [3, H, W]
        -> PipelineScheduler.submit(SegmentRequest(ImageJob, K prompts, deadline))      (Overloaded at once if full)
        IMAGE stage     (<= max_image_batch images, padded to a bucket): registry op "preprocess" on the device
                        -> encode_images
        GROUNDING stage (<= max_pair_batch (image, prompt) pairs, padded): cached prompt features -> ground
                        -> postprocess_batch (threshold, max instances; registry op "mask_post": masks upsampled to
                           H x W, cut and bit-packed per column on the device; 2 host syncs per batch)
    -> SegmentResult (per prompt: [Instance] with column-packed masks; `sammie.masks.encode_instances` -> RLE)

Fast paths, each one config field away from the plain model (STYLE P8): `kernels` (the registry preference of the
two ops above), `compile` (CUDA graphs per bucket, `sammie.model.graphs`), `vit_fp8` (FP8 ViT linears behind an
accuracy gate, `sammie.model.fp8`), and `null_model` (no model at all: the serving path's ceiling). `health()`
reports what each one resolved to.

Batching lives here and only here (the Ray Serve layer in `sammie/serve.py` adds none). The IMAGE and GROUNDING
runner calls are exactly `Segmenter.segment`'s (same preprocessing, `encode_images`, `ground`, `postprocess_batch`),
so at the same weights, dtype and batch composition the results are bit-identical; across different batch
compositions they agree to float summation order (CPU GEMMs are not batch-size invariant: ~1e-6 relative).

The engine is Ray-free and HTTP-free: `tests/test_engine.py` drives it with plain asyncio. Errors are typed:
`BadRequest` (the client's fault; `.code` names the problem), `NotReady`, and the scheduler's `Overloaded`,
`DeadlineExceeded`, `Cancelled`, `RunFailed` (see `engine_core/request.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from engine_core.config_args import check_field_types, from_args
from engine_core.request import BadRequest, NotReady, client_timeout  # noqa: F401 - re-exported for callers
from engine_core.request import Answer, Batch, Overloaded, SegmentRequest, Stage
from engine_core.batch_loop import AsyncBatchLoop
from engine_core.scheduler import PipelineScheduler, SchedulerConfig, SchedulerStats, StageConfig
from sammie.config import PRESETS
from sammie.decode import InvalidImage, decode_image
from sammie.model.detector import Grounding, ImageFeatures, PromptFeatures
from sammie.preprocess import preprocess_batch
from sammie.segmenter import KERNEL_PREFERENCES, Instance, kernel_registry, postprocess_batch, resolve_kernels

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMPILE_MODES = ("auto", "none", "graphs", "inductor")
INDUCTOR_MODES = ("default", "max-autotune-no-cudagraphs")  # image_inductor_mode (GraphedDetector captures itself)


# --------------------------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class EngineConfig:
    """Everything a Sammie replica is configured with; `serve_configs/*.yaml` `args:` map 1:1 onto these fields."""

    # -- model
    checkpoint: str | None = None  # sam3.pt / sam3.1_multiplex.pt / model.safetensors / snapshot dir; None ->
    #                                $SAMMIE_CHECKPOINT -> seeded random weights (loudly labelled everywhere)
    config: str = "sam3"  # a `sammie.config.PRESETS` key: sam3 | sam3.1 | tiny (tests)
    device: str | None = None  # torch device string; None -> cuda if available else cpu
    dtype: str = "auto"  # auto | fp32 | bf16 | fp16; auto -> bf16 on cuda, fp32 on cpu
    seed: int = 0  # torch seed of the random weights (ignored with a checkpoint)
    # -- batching (scheduler)
    max_image_batch: int = 8  # images per ViT batch; buckets = powers of two up to it
    image_wait_ms: float = 5.0  # ms a partial image batch waits for more images
    max_pair_batch: int = 16  # (image, prompt) pairs per grounding batch; buckets = powers of two up to it
    pair_wait_ms: float = 2.0  # ms a partial grounding batch waits for more pairs
    release_when_idle: bool = True  # a partial batch of either stage goes at once while no batch of either stage
    #                                 runs (engine_core/scheduler.py): a lone request skips both wait budgets. H200,
    #                                 waterfall run 5: lone p50 28.5 -> 23.3 ms, 32 clients 61.3 vs 60.2 img/s (within
    #                                 the row's run-to-run spread, 60.1-61.3); False = the budgets always
    max_queued: int = 64  # requests admitted at once (decoding, queued or running); more -> Overloaded (503)
    request_timeout_s: float | None = 30.0  # default deadline per request, s from arrival (None: none); -> 504
    # -- caches and limits
    prompt_cache_size: int = 1024  # prompt strings whose text features stay on the device (LRU); 0 = no cache
    max_prompts: int = 16  # prompts per request
    max_prompt_chars: int = 256  # characters per prompt (the tokenizer keeps the first 30 BPE tokens anyway)
    max_image_pixels: int = 40_000_000  # decompression-bomb cap, width x height, checked before decoding
    max_body_bytes: int = 20 * 2**20  # request body (HTTP) / encoded image bytes (engine), bytes
    decode_threads: int = 4  # CPU threads that parse bodies, decode images and encode masks
    warmup: bool = True  # run every batch bucket once before reporting ready
    # -- fast paths (each one field away from the plain model)
    kernels: str = "auto"  # kernel registry preference for "preprocess" and "mask_post": auto | reference | triton
    #                        | torch; auto -> the Triton kernels on cuda where they support the call, else the
    #                        reference (logged); on cpu auto = reference (Triton would run in its interpreter)
    kernel_self_check: bool = True  # at start, each kernel `kernels` may choose vs its reference on sample inputs;
    #                                 a failure disables it (ERROR log, health()["kernels"]). ~ms on cuda; on cpu it
    #                                 only runs when kernels="triton" (interpreter, ~1 s), else nothing to check
    compile: str = "auto"  # none | graphs | inductor | auto (graphs on cuda, none on cpu). graphs: CUDA graphs of
    #                        the eager detector per image / pair bucket (sammie.model.graphs.GraphedDetector),
    #                        captured at start in seconds; inductor: torch.compile (inductor) per bucket, then
    #                        graphs: ~40% faster than eager batching (61.0 vs 43.3 img/s, waterfall run 1), ~30-35 s
    #                        of compile per bucket at start
    image_inductor_mode: str = "default"  # the image stage's inductor mode with compile=inductor: default |
    #                        max-autotune-no-cudagraphs (Triton GEMM templates benchmarked against cuBLAS per shape,
    #                        a GELU fused into a winning template's epilogue). H200, waterfall run 9: cuBLAS won all
    #                        four ViT GEMMs, the detector alone +1.3%, the engine -0.6%; the image stage's compile
    #                        35 -> 339 s. The grounding stage always compiles in "default"
    image_buckets: tuple = ()  # image batch sizes the device sees (ascending, last = max_image_batch); () = powers
    #                            of two. Each is one CUDA graph (and, with compile=inductor, one compile)
    pair_buckets: tuple = ()  # grounding batch sizes, likewise (last = max_pair_batch)
    vit_fp8: bool = False  # FP8 e4m3 ViT linears (sammie.model.fp8); kept only if its accuracy gate passes, else
    #                        ERROR log and bf16; the gate's report is in health()["vit_fp8"]
    vit_fp8_linears: tuple = ("attn.qkv", "attn.proj", "mlp.fc1")  # which of each trunk block's linears vit_fp8
    #                        swaps (sammie.model.fp8.VIT_LINEARS: + "mlp.fc2"). fc2 stays bf16 by default: its input
    #                        is the GELU's output, 4.6x wider than the others', and under inductor its per-token
    #                        quantiser took 0.9 ms a call (H200, waterfall run 6's profile: 22.7% of the FP8
    #                        engine's GPU time) against 0.33 ms for its FP8 GEMM and 0.57 ms for bf16's. Waterfall
    #                        run 7: the FP8 detector alone 63.8 -> 68.3 img/s without it, the engine 57.9 -> 60.4.
    #                        The one-pass Triton GELU quantiser measured slower still (run 8: fc2 in FP8 cost
    #                        0.40 ms per block of a batch of 8 more than bf16; 61.7 against 68.4 img/s)
    vit_fp8_static: tuple = ()  # which of vit_fp8_linears quantise their input with ONE activation scale per layer,
    #                        calibrated at start (2 x the input's amax over the calibration sample / 448) instead of
    #                        one per token: the quantiser becomes elementwise and can fuse into the op before it
    #                        (for mlp.fc2: the GELU pass), which a per-token reduction cannot (sammie.model.fp8).
    #                        Written for an FP8 fc2 (["mlp.fc2"] with vit_fp8_linears = all four). H200, waterfall
    #                        run 16: the detector alone +5.1% (76.5 img/s), the engine 65.5 -> 72.7 img/s against fc2 in
    #                        bf16 (the engine second in its process: part of that is position). Off by default:
    #                        scales calibrated on noise only suit random-weight benchmarks. With vit_fused_gelu
    #                        and fc1 in bf16, fc2's scale is calibrated on the exact GELU but runs on the tanh one
    #                        (<= 4.7e-4 apart: negligible against 2x headroom)
    vit_fp8_calibration_images: tuple = ()  # image files (JPEG / PNG, <= 8) the FP8 gate (also without static
    #                        layers) and the static scales run on instead of the seeded noise image; give real
    #                        images of your traffic with a real checkpoint (noise-calibrated scales only suit speed
    #                        measurements). Absolute paths: relative ones resolve in the replica's working dir
    vit_fused_gelu: bool = False  # each ViT block's fc1 + GELU as one cuBLASLt GEMM with its GELU epilogue (CUDA;
    #                        sammie.model.vit.Mlp): spares the separate GELU pass (9.4 of ~117 ms per batch of 8 on
    #                        the H200), but cuBLASLt's GELU is the tanh approximation, not Meta's exact erf GELU
    #                        (<= 4.7e-4 apart: rounding level in bf16), hence off. H200: the detector alone
    #                        +5.8%, the engine +5.2-10.7% (waterfall runs 14, 12). FP8 fc1s are not fused
    stage_streams: bool = True  # cuda: the image stage and the grounding stage issue their kernels on two streams
    #                             (grounding at high priority), the grounding stage waiting on each image batch's
    #                             event, so its host syncs (scores, masks) wait for its own kernels only, not for
    #                             the image batches queued ahead of them on a shared stream. False: both on the
    #                             default stream (before 2026-12-02). H200 at 32 clients, one balanced pair
    #                             with the closed engines freed: +3.4% as the first engine of its process, +1.6%
    #                             as the second, and a lower p99 in all six pairs (streams A/B runs 1-3; runs 1-2
    #                             kept closed engines alive and showed no gain). Ignored on cpu
    null_model: bool = False  # NO MODEL: a NullDetector (one tiny device op per call, never any instance) instead of
    #                           the detector, which is then never built; measures HTTP + decode + scheduler alone

    def __post_init__(self):
        for name in ("image_buckets", "pair_buckets", "vit_fp8_linears", "vit_fp8_static",
                     "vit_fp8_calibration_images"):  # YAML gives lists
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        check_field_types(self)
        for name in ("image_buckets", "pair_buckets"):
            if not all(isinstance(b, int) and not isinstance(b, bool) for b in getattr(self, name)):
                raise ValueError(f"{name} must be a list of ints, got {getattr(self, name)!r}")
        if self.config not in PRESETS:
            raise ValueError(f"config must be one of {sorted(PRESETS)}, got {self.config!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {self.dtype!r}")
        positive = ("max_image_batch", "max_pair_batch", "max_queued", "max_prompts", "max_prompt_chars",
                    "max_image_pixels", "max_body_bytes", "decode_threads")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("image_wait_ms", "pair_wait_ms", "prompt_cache_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {self.request_timeout_s}")
        if self.kernels not in KERNEL_PREFERENCES:
            raise ValueError(f"kernels must be one of {list(KERNEL_PREFERENCES)}, got {self.kernels!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {list(COMPILE_MODES)}, got {self.compile!r}")
        if self.image_inductor_mode not in INDUCTOR_MODES:
            raise ValueError(f"image_inductor_mode must be one of {list(INDUCTOR_MODES)}, got "
                             f"{self.image_inductor_mode!r}")
        if self.image_inductor_mode != "default" and self.compile != "inductor":
            raise ValueError(f"image_inductor_mode={self.image_inductor_mode!r} needs compile='inductor', got "
                             f"compile={self.compile!r}")
        if self.null_model and self.vit_fused_gelu:
            raise ValueError("vit_fused_gelu needs the real detector; it cannot be combined with null_model")
        if self.null_model and self.vit_fp8:
            raise ValueError("vit_fp8 needs the real detector; it cannot be combined with null_model")
        from sammie.model.fp8 import MAX_CALIBRATION_IMAGES, check_linears, check_static

        check_linears(self.vit_fp8_linears)
        for name in ("vit_fp8_static", "vit_fp8_calibration_images"):
            if getattr(self, name) and not self.vit_fp8:
                raise ValueError(f"{name} needs vit_fp8: true, got {name}={list(getattr(self, name))} with vit_fp8 off")
        check_static(self.vit_fp8_static, self.vit_fp8_linears)
        if not all(isinstance(p, str) and p for p in self.vit_fp8_calibration_images):
            raise ValueError(f"vit_fp8_calibration_images must be a list of file paths, got "
                             f"{list(self.vit_fp8_calibration_images)!r}")
        if len(self.vit_fp8_calibration_images) > MAX_CALIBRATION_IMAGES:
            raise ValueError(f"vit_fp8_calibration_images: at most {MAX_CALIBRATION_IMAGES} images (one ViT batch "
                             f"at start), got {len(self.vit_fp8_calibration_images)}")
        if self.null_model and self.compile in ("graphs", "inductor"):
            raise ValueError(f"compile={self.compile!r} needs the real detector; with null_model use compile='none' "
                             "or 'auto'")
        self.scheduler_config()  # bucket lists are checked by the scheduler's StageConfig (ValueError)

    @classmethod
    def from_dict(cls, args: Mapping[str, Any] | None) -> EngineConfig:
        """Build from a plain mapping (YAML `args:`); unknown keys raise, listing the valid ones."""
        return from_args(cls, args)

    def scheduler_config(self) -> SchedulerConfig:
        # The engine admits at most max_queued requests before submit, so the scheduler's own cap never binds.
        return SchedulerConfig(
            image=StageConfig(max_batch_size=self.max_image_batch, max_wait_ms=self.image_wait_ms,
                              buckets=self.image_buckets, release_when_idle=self.release_when_idle),
            grounding=StageConfig(max_batch_size=self.max_pair_batch, max_wait_ms=self.pair_wait_ms,
                                  buckets=self.pair_buckets, release_when_idle=self.release_when_idle),
            max_queued=self.max_queued,
        )


# --------------------------------------------------------------------------------------------------------------
# Results and errors


# `BadRequest.code` values this engine raises (the server maps every one to a 4xx with that code)
BAD_REQUEST_CODES = (
    "empty_image", "invalid_image", "image_too_large", "payload_too_large", "missing_prompt", "empty_prompt",
    "prompt_too_long", "too_many_prompts", "invalid_prompt", "invalid_threshold", "invalid_max_instances",
    "invalid_timeout",
)


@dataclass(frozen=True)
class PromptResult:
    prompt: str
    instances: list[Instance]  # sorted by score, highest first; masks column-packed (Instance.mask: bool [H, W])


@dataclass(frozen=True)
class SegmentResult:
    width: int  # of the decoded image after EXIF rotation, pixels
    height: int
    prompts: list[PromptResult]  # request order
    timings_ms: dict[str, float]  # decode, queue (wait for an image batch), image, grounding, total
    random_weights: bool


class ImageJob(NamedTuple):
    """IMAGE-stage payload (`SegmentRequest.image`)."""

    rgb: torch.Tensor  # uint8 [3, H, W], CPU (pinned when the device is cuda)
    threshold: float  # score threshold for this request's instances
    max_instances: int | None


class EncodedImage(NamedTuple):
    """IMAGE-stage output per request (`GroundingInput.features` of its K pairs)."""

    features: ImageFeatures  # batch dim 1 (views into the padded batch)
    height: int
    width: int
    threshold: float
    max_instances: int | None
    ready: Any = None  # torch.cuda.Event recorded on the image stream after the batch's features (stage_streams)


# --------------------------------------------------------------------------------------------------------------
# Prompt feature cache


class PromptCache:
    """LRU map prompt string -> text features ([1, L, d], padding [1, L]) on the device.

    `gather` is called from the grounding stage's single worker thread; the lock only guards the stats readers.
    Hits and misses count distinct prompts per grounding batch (a prompt twice in one batch counts once).
    """

    def __init__(self, capacity: int, encode: Callable[[list[str]], PromptFeatures]):
        self.capacity = capacity
        self._encode = encode
        self._entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def gather(self, prompts: Sequence[str]) -> tuple[PromptFeatures, list[int]]:
        """Features of the distinct prompts ([U, L, d], [U, L]) and, per input prompt, its row."""
        unique = list(dict.fromkeys(prompts))
        rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        with self._lock:
            for p in unique:
                if p in self._entries:
                    self._entries.move_to_end(p)
                    rows[p] = self._entries[p]
        misses = [p for p in unique if p not in rows]
        if misses:
            encoded = self._encode(misses)  # one text-encoder batch for all misses
            for i, p in enumerate(misses):
                rows[p] = (encoded.features[i:i + 1].clone(), encoded.padding[i:i + 1].clone())
        with self._lock:
            self.hits += len(unique) - len(misses)
            self.misses += len(misses)
            for p in misses if self.capacity else ():
                self._entries[p] = rows[p]
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        row_of = {p: i for i, p in enumerate(unique)}
        features = PromptFeatures(torch.cat([rows[p][0] for p in unique]), torch.cat([rows[p][1] for p in unique]))
        return features, [row_of[p] for p in prompts]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"size": len(self._entries), "capacity": self.capacity, "hits": self.hits, "misses": self.misses}


# --------------------------------------------------------------------------------------------------------------
# Runner: the two model calls the scheduler batches


def _cat_features(images: list[ImageFeatures]) -> ImageFeatures:
    if len(images) == 1:
        return images[0]
    return ImageFeatures([torch.cat(level) for level in zip(*(im.fpn for im in images))], images[0].pos,
                         torch.cat([im.geometry for im in images]))


def _wait_for_images(stream, images: list[EncodedImage]) -> None:
    """Order `stream` after the image batches that computed `images` (one wait per distinct event) and mark their
    feature tensors as in use on it, so their memory is not reused before its kernels have read them."""
    events = {id(im.ready): im.ready for im in images if im.ready is not None}
    for event in events.values():
        stream.wait_event(event)
    for im in images:
        for t in (*im.features.fpn, *im.features.pos, im.features.geometry):
            t.record_stream(stream)


class _Runner:
    """Blocking `Runner` (engine_core.batch_loop): each stage runs on its own worker thread of `AsyncBatchLoop`.

    Streams (cuda, `EngineConfig.stage_streams`): each stage issues its kernels on its own stream, the grounding
    stage's at high priority. An image batch records an event after its features; a grounding batch makes its
    stream wait on the events of the images it reads (device-side: no host wait) and marks their tensors as used
    on its stream (`record_stream`: the allocator may not hand their memory to the image stream again before the
    grounding kernels that read it are done). The grounding stage's two host syncs (`postprocess_batch`) then wait
    for its own kernels only. On one shared stream they also waited for every image batch queued ahead (~63 ms of
    ViT each at batch 8; waterfall run 11: ~150 ms per grounding batch of ~7.7 pairs, ~21 ms of it the ground
    graph). H200 at 32 clients (streams A/B run 3, one balanced pair, closed engines freed): +3.4% as the first
    engine of its process, +1.6% as the second; p99 lower in all six pairs of runs 1-3 (runs 1-2 kept the closed
    engines alive: +3.6% first, -4.5% second); run 14: the GPU ran kernels 99.7% of the time with it. Without
    stage_streams both threads use the default stream, whose order alone keeps features before their readers.
    """

    def __init__(self, engine: SammieEngine):
        self.engine = engine
        self.streams: dict[Stage, Any] = {}
        if engine.device.type == "cuda" and engine.cfg.stage_streams:
            low, high = torch.cuda.Stream.priority_range()  # (0, -5) on Hopper: lower number = higher priority
            self.streams = {Stage.IMAGE: torch.cuda.Stream(engine.device, priority=low),
                            Stage.GROUNDING: torch.cuda.Stream(engine.device, priority=high)}
            for stream in self.streams.values():  # after everything start-up queued (weights, graph buffers)
                stream.wait_stream(torch.cuda.current_stream(engine.device))

    def run(self, stage: Stage, batch: Batch) -> list[Any]:
        stream = self.streams.get(stage)
        with torch.inference_mode(), torch.profiler.record_function(f"sammie.{stage.value}"), \
                (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            return self._images(batch) if stage is Stage.IMAGE else self._grounding(batch)

    def _images(self, batch: Batch) -> list[EncodedImage]:
        e = self.engine
        jobs: tuple[ImageJob, ...] = batch.payloads
        pixels = preprocess_batch(e.registry, [j.rgb for j in jobs], e.model_cfg, e.device, e.dtype)  # [n, 3, S, S]
        if batch.num_padding:  # pad to the bucket by repeating the last image; padded rows are never read
            pixels = torch.cat([pixels, pixels[-1:].expand(batch.num_padding, -1, -1, -1)])
        feats = e.detector.encode_images(pixels)
        ready = None
        if Stage.IMAGE in self.streams:  # the grounding stream waits on this before reading the features
            ready = torch.cuda.Event()
            ready.record(self.streams[Stage.IMAGE])
        out = []
        for i, job in enumerate(jobs):
            one = ImageFeatures([f[i:i + 1] for f in feats.fpn], feats.pos, feats.geometry[i:i + 1])
            out.append(EncodedImage(one, int(job.rgb.shape[1]), int(job.rgb.shape[2]), job.threshold,
                                    job.max_instances, ready))
        return out

    def _grounding(self, batch: Batch) -> list[list[Instance]]:
        e = self.engine
        images: list[EncodedImage] = []
        row_of: dict[int, int] = {}  # id(EncodedImage) -> row; the K pairs of a request share one EncodedImage
        image_index = []
        for pair in batch.payloads:
            key = id(pair.features)
            if key not in row_of:
                row_of[key] = len(images)
                images.append(pair.features)
            image_index.append(row_of[key])
        # prompts first: a cache miss's text encoding need not wait for the image batch
        prompt_feats, prompt_index = e.prompt_cache.gather([pair.prompt for pair in batch.payloads])
        if Stage.GROUNDING in self.streams:
            _wait_for_images(self.streams[Stage.GROUNDING], images)
        pad = batch.num_padding  # repeat the last pair up to the bucket; padded outputs are dropped below
        image_index += image_index[-1:] * pad
        prompt_index += prompt_index[-1:] * pad
        out = e.ground_pairs([im.features for im in images], prompt_feats, image_index, prompt_index)
        ims: list[EncodedImage] = [pair.features for pair in batch.payloads]
        return postprocess_batch(e.registry, out.logits, out.presence_logits, out.boxes, out.mask_logits,
                                 [(im.height, im.width) for im in ims], [im.threshold for im in ims],
                                 [im.max_instances for im in ims], e.model_cfg.mask_threshold)


# --------------------------------------------------------------------------------------------------------------
# Engine


class SammieEngine:
    """Owns the detector, tokenizer, prompt cache, CPU pool and batch loop. Construct (blocking: loads weights),
    then `await start()` on the serving event loop (starts the loop, warms up), then `await segment(...)`."""

    def __init__(self, cfg: EngineConfig):
        from sammie.build import build_detector, default_device

        self.cfg = cfg
        self.device = torch.device(cfg.device) if cfg.device else default_device()
        self.dtype = DTYPES[cfg.dtype] if cfg.dtype != "auto" else (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.compile = cfg.compile if cfg.compile != "auto" else (
            "graphs" if self.device.type == "cuda" and not cfg.null_model else "none")
        if self.compile in ("graphs", "inductor") and self.device.type != "cuda":
            raise ValueError(f"compile={self.compile!r} needs a cuda device, the engine is on {self.device}")
        self.checkpoint = cfg.checkpoint or os.environ.get("SAMMIE_CHECKPOINT") or None
        # kernels first: the fp8 gate and the warm-up already run through them
        self.kernels = resolve_kernels(cfg.kernels, self.device)
        self.registry = kernel_registry(cfg.kernels, self.device, ("kernels.fp8_linear",) if cfg.vit_fp8 else ())
        self.kernel_checks = self.registry.self_check(self.device) if cfg.kernel_self_check else None  # op -> outcome
        t0 = time.perf_counter()
        if cfg.null_model:
            from sammie.model.null import NullDetector
            from sammie.tokenizer import load_tokenizer

            self.model_cfg = PRESETS[cfg.config]()
            self.detector = NullDetector(self.model_cfg, self.device, self.dtype)  # the real one is never built
            # the real tokenizer (bundled CLIP BPE, the same vocabulary as SAM 3's): its cost on prompt-cache misses
            # belongs to the serving path being measured
            self.tokenizer = load_tokenizer(None, self.model_cfg.text.context_length)
            self.checkpoint = None
        else:
            self.detector, self.model_cfg, self.tokenizer, _ = build_detector(
                self.checkpoint, PRESETS[cfg.config](), str(self.device), self.dtype, cfg.seed)
        self.random_weights = bool(self.detector.random_weights)
        self.vit_fp8 = self._enable_vit_fp8() if cfg.vit_fp8 else None
        self.vit_fused_gelu = self._fuse_vit_gelu() if cfg.vit_fused_gelu else None
        if self.compile in ("graphs", "inductor"):
            from sammie.model.graphs import GraphedDetector

            sched = cfg.scheduler_config()
            self.detector = GraphedDetector(self.detector, image_buckets=sched.image.buckets,
                                            pair_buckets=sched.grounding.buckets,
                                            compile_mode="default" if self.compile == "inductor" else None,
                                            image_compile_mode=(cfg.image_inductor_mode if self.compile == "inductor"
                                                                else None))
        self.load_s = time.perf_counter() - t0
        self.prompt_cache = PromptCache(cfg.prompt_cache_size, self._encode_prompts)
        self.scheduler = PipelineScheduler(cfg.scheduler_config())
        self._pool = concurrent.futures.ThreadPoolExecutor(cfg.decode_threads, thread_name_prefix="sammie-cpu")
        self._batch_loop: AsyncBatchLoop | None = None
        self._admitted = 0  # requests inside segment() past validation: decoding, queued or running
        self.rejected = 0  # Overloaded answers
        self.capture_s: float | None = None
        self.warmup_s: float | None = None
        self.warmup_stats: dict[str, float] | None = None
        self._ready = False
        weights = "NULL MODEL" if cfg.null_model else "RANDOM WEIGHTS" if self.random_weights else self.checkpoint
        log.info("Sammie engine: %s on %s/%s, %s, kernels %s, compile %s, vit_fp8 %s, loaded in %.1f s",
                 cfg.config, self.device, str(self.dtype).removeprefix("torch."), weights, self.kernels, self.compile,
                 None if self.vit_fp8 is None else self.vit_fp8.enabled, self.load_s)
        if cfg.null_model:
            log.warning("NULL MODEL: this engine answers every request with no instances (serving-path ceiling)")

    def _fuse_vit_gelu(self) -> dict[str, Any]:
        """vit_fused_gelu: fc1 + GELU in one cuBLASLt GEMM in every ViT block whose fc1 is a plain bf16 linear (FP8 ones
        keep their own path); only on CUDA (elsewhere the model is left as it is, and health() says why)."""
        from sammie.model.vit import FUSED_GELU_DEVICES, set_fused_gelu

        if self.device.type not in FUSED_GELU_DEVICES:
            return {"enabled": False, "reason": f"cuBLASLt's GELU epilogue needs {FUSED_GELU_DEVICES}, not "
                                                f"{self.device.type}"}
        mlps = set_fused_gelu(self.detector, True)
        fused = sum(m.can_fuse_gelu() for m in mlps)
        log.info("vit_fused_gelu: fc1 + GELU (tanh approximation) as one cuBLASLt GEMM in %d of %d ViT MLPs",
                 fused, len(mlps))
        return {"enabled": fused > 0, "mlps": len(mlps), "fused": fused,
                "reason": "cuBLASLt GELU epilogue (tanh approximation); MLPs with an FP8 fc1, or an FP8 fc2 applying "
                          "the GELU itself, keep their own path"}

    def _enable_vit_fp8(self):
        """FP8 ViT linears, kept only if `enable_vit_fp8`'s accuracy gate passes on a sample: the images of
        `vit_fp8_calibration_images`, else a seeded uniform-noise image (no photograph is available at start; real
        images may err differently), through the real decoding and preprocessing. The static activation scales of
        `vit_fp8_static` are calibrated on the same sample. Returns its report; a refusal is logged at ERROR and
        bf16 stays."""
        from sammie.model.fp8 import enable_vit_fp8

        paths = self.cfg.vit_fp8_calibration_images
        if paths:
            rgbs = []
            for path in paths:
                try:
                    data = Path(path).read_bytes()
                except OSError as e:  # missing, a directory, no permission: the same subclass (errno), the path
                    raise OSError(e.errno, f"vit_fp8_calibration_images: cannot read {path!r} (working directory "
                                           f"{os.getcwd()!r}): {e.strerror}") from e
                try:
                    rgbs.append(decode_image(data, self.cfg.max_image_pixels))
                except InvalidImage as e:
                    raise ValueError(f"vit_fp8_calibration_images: {path!r} is not a usable image: {e}") from e
            calibration = f"{len(rgbs)} calibration image{'s' if len(rgbs) > 1 else ''}"
        else:
            side = self.model_cfg.image_size
            rgbs = [torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, side, side), dtype=np.uint8))]
            calibration = "a seeded noise image (no vit_fp8_calibration_images)"
        with torch.inference_mode():
            sample = preprocess_batch(self.registry, rgbs, self.model_cfg, self.device, self.dtype)  # [n, 3, S, S]
        # under inductor the plain-torch quantise-and-_scaled_mm path ("torch") is the fast one for qkv / proj / fc1:
        # inductor fuses their per-token quantisation into the LayerNorm / attention output before them, which an
        # opaque Triton quantiser prevents (a separate pass costs more than the FP8 GEMM saves: RESULTS.md, stage
        # profile). An FP8 fc2 (not a default vit_fp8_linears) follows the same preference: inductor's fusion of its
        # GELU + quantiser (0.91 ms a call, waterfall run 6) beat the one-pass Triton kernel inside the engine (run 8);
        # alone, the kernel's two-tile version is now faster (quant_probe run 1: 0.85-0.89 against 1.05 ms), not yet
        # compared inside the engine
        preference = "torch" if self.compile == "inductor" and self.kernels != "reference" else "auto"
        report = enable_vit_fp8(self.detector, sample, registry=self.registry,  # its op's choice shows in health()
                                preference=preference, linears=self.cfg.vit_fp8_linears,
                                static=self.cfg.vit_fp8_static, calibration=calibration)
        if report.enabled:
            log.info("vit_fp8: FP8 ViT linears enabled: %s", report.as_dict())
        else:
            log.error("vit_fp8 REQUESTED BUT NOT ENABLED (accuracy gate or hardware); serving %s: %s",
                      str(self.dtype).removeprefix("torch."), report.as_dict())
        return report

    # ---- lifecycle

    async def start(self) -> None:
        """Start the batch loop on the running event loop and, if configured, warm up; then report ready."""
        if self.compile in ("graphs", "inductor") and self.capture_s is None:  # before any traffic, warm-up included
            t0 = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(self._pool, self.detector.capture)
            self.capture_s = time.perf_counter() - t0
            log.info("CUDA graphs captured in %.2f s: %s", self.capture_s, self.detector.stats())
        if self._batch_loop is None:
            self._batch_loop = AsyncBatchLoop(self.scheduler, _Runner(self))
            self._batch_loop.start()
        if self.cfg.warmup and self.warmup_s is None:
            await self.warmup()
        self._ready = True

    async def aclose(self) -> None:
        """Stop admitting, answer what was admitted, stop the loop and the pool."""
        self._ready = False
        if self._batch_loop is not None:
            await self._batch_loop.aclose(drain=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        return self._ready and self.alive

    @property
    def alive(self) -> bool:
        """False once the batch loop task has died (a scheduler bug): the replica should be restarted."""
        return self._batch_loop is not None and self._batch_loop.running

    async def warmup(self) -> float:
        """Run each image bucket and each pair bucket once (so a compiled model sees every shape before traffic),
        then forget the warm-up's cache entries and batch statistics. Returns seconds taken."""
        t0 = time.perf_counter()
        side = self.model_cfg.image_size
        rgb = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, side, side), dtype=np.uint8))

        async def one(k: int, tag: str) -> None:
            job = ImageJob(self._to_host(rgb), self.model_cfg.score_threshold, 1)
            await self._infer(job, tuple(f"warmup {tag} {j}" for j in range(k)), None)

        for b in self.cfg.scheduler_config().image.buckets:  # b requests at once -> one image batch of b
            await asyncio.gather(*(one(1, f"i{b}") for _ in range(b)))
        for p in self.cfg.scheduler_config().grounding.buckets:  # p pairs at once -> one grounding batch of p
            k = min(p, self.cfg.max_prompts)
            n = math.ceil(p / k)
            if n <= self.cfg.max_image_batch:
                await asyncio.gather(*(one(min(k, p - i * k), f"p{p}") for i in range(n)))
        self.warmup_s = time.perf_counter() - t0
        self.warmup_stats = self.scheduler.stats.snapshot()
        self.scheduler.stats = SchedulerStats(on_batch=self.scheduler.stats.on_batch)
        self.prompt_cache.clear()
        log.info("warm-up done in %.2f s", self.warmup_s)
        return self.warmup_s

    # ---- requests

    async def segment(self, image_bytes: bytes, prompts: Sequence[str], threshold: float | None = None,
                      max_instances: int | None = None, timeout_s: float | None = None) -> SegmentResult:
        """Segment one encoded image with K prompts. Raises BadRequest, NotReady, Overloaded, DeadlineExceeded,
        RunFailed, or Cancelled (the scheduler cancelled it, e.g. `aclose`). Cancelling the awaiting task (a client
        disconnect) raises CancelledError here and drops the request's queued work; outputs of its running work are
        discarded."""
        clock = self.scheduler.clock
        t0 = clock.now()
        if not self.ready:
            raise NotReady("the engine is not ready (loading, warming up or shutting down)")
        prompts = self._check_prompts(prompts)
        threshold = self._check_threshold(threshold)
        max_instances = self._check_max_instances(max_instances)
        timeout_s = client_timeout(timeout_s, self.cfg.request_timeout_s)
        if not isinstance(image_bytes, (bytes, bytearray, memoryview)):
            raise BadRequest("invalid_image", f"the image must be bytes, got {type(image_bytes).__name__}")
        if len(image_bytes) > self.cfg.max_body_bytes:
            raise BadRequest("payload_too_large",
                             f"the image is {len(image_bytes)} bytes; the limit is {self.cfg.max_body_bytes}")
        self.check_admission()  # before decoding: rejecting must stay cheap under overload
        deadline_s = None if timeout_s is None else t0 + timeout_s
        self._admitted += 1
        try:
            rgb = await asyncio.get_running_loop().run_in_executor(self._pool, self._decode, bytes(image_bytes))
            t_decoded = clock.now()
            answer = await self._infer(ImageJob(rgb, threshold, max_instances), prompts, deadline_s)
        finally:
            self._admitted -= 1
        t = answer.timings
        timings = {
            "decode": t_decoded - t0,
            "queue": t.image_started_s - t.arrival_s,
            "image": t.image_done_s - t.image_started_s,
            "grounding": t.answered_s - t.image_done_s,
            "total": clock.now() - t0,
        }
        return SegmentResult(
            width=int(rgb.shape[2]), height=int(rgb.shape[1]),
            prompts=[PromptResult(p, list(out)) for p, out in zip(prompts, answer.outputs)],
            timings_ms={k: round(v * 1000.0, 3) for k, v in timings.items()},
            random_weights=self.random_weights,
        )

    def check_admission(self) -> None:
        """Raise NotReady or Overloaded if a request arriving now would be refused; `segment` calls it too, a
        server may call it first to refuse before reading the request body."""
        if not self.ready:
            raise NotReady("the engine is not ready (loading, warming up or shutting down)")
        if self._admitted >= self.cfg.max_queued:
            self.rejected += 1
            raise Overloaded(self.scheduler.retry_after_s(), self._admitted, self.cfg.max_queued)

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a CPU-bound function (body parsing, mask encoding) on the engine's pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def ping(self) -> float:
        """A tiny op on the model's device, synchronised (blocking: call through `offload`). A wedged GPU hangs or
        raises here, which fails the replica's health check."""
        return float(torch.ones(1, device=self.device).add_(1).item())

    def health(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "ready": self.ready,
            "alive": self.alive,
            "random_weights": self.random_weights,
            "null_model": self.cfg.null_model,  # True: NO MODEL, answers never have instances
            "checkpoint": self.checkpoint,
            "config": self.cfg.config,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),  # CPU results depend on it (GEMM summation order)
            "kernels_preference": self.kernels,  # cfg.kernels as applied (auto on cpu = reference)
            "kernels": self.registry.choices(),  # per op: chosen implementation, calls, fallback, self-check
            "compile": {"mode": self.compile,
                        "capture_s": None if self.capture_s is None else round(self.capture_s, 3),
                        "stats": self.detector.stats() if self.compile in ("graphs", "inductor") else None},
            "vit_fp8": None if self.vit_fp8 is None else self.vit_fp8.as_dict(),
            "vit_fused_gelu": self.vit_fused_gelu,
            # a CUDA stream per stage (EngineConfig.stage_streams; cuda only): the batch loop's once start() built it,
            # before that what it will build
            "stage_streams": (bool(self._batch_loop.runner.streams) if self._batch_loop is not None
                              else self.device.type == "cuda" and self.cfg.stage_streams),
            "load_s": round(self.load_s, 3),
            "warmup_s": None if self.warmup_s is None else round(self.warmup_s, 3),
            "queue": {"admitted": self._admitted, "unanswered": s.num_unfinished,
                      "image_queued": s.num_queued(Stage.IMAGE), "pairs_queued": s.num_queued(Stage.GROUNDING),
                      "max_queued": self.cfg.max_queued},
            "rejected": self.rejected,
            "prompt_cache": self.prompt_cache.stats(),
            "stats": s.stats.snapshot(),
        }

    # ---- internals

    async def _infer(self, job: ImageJob, prompts: tuple[str, ...], deadline_s: float | None) -> Answer:
        if self._batch_loop is None:
            raise NotReady("the engine was not started (await engine.start())")
        return await self._batch_loop.infer(SegmentRequest(job, prompts, deadline_s))

    def _to_host(self, rgb: torch.Tensor) -> torch.Tensor:
        # pinned memory lets the IMAGE stage's host->device copy run asynchronously (non_blocking in preprocess_batch)
        return rgb.pin_memory() if self.device.type == "cuda" else rgb

    def _decode(self, data: bytes) -> torch.Tensor:
        try:
            return self._to_host(decode_image(data, self.cfg.max_image_pixels))
        except InvalidImage as exc:
            raise BadRequest(exc.code, str(exc)) from None

    def _encode_prompts(self, prompts: list[str]) -> PromptFeatures:
        return self.detector.encode_prompts(self.tokenizer(prompts).to(self.device))

    def ground_pairs(self, images: list[ImageFeatures], prompts: PromptFeatures, image_index: list[int],
                     prompt_index: list[int]) -> Grounding:
        """The grounding stage's model call for P pairs: pair i grounds `prompts` row prompt_index[i] in `images`
        [image_index[i]] (I distinct single-image features; host lists of P ints).

        The GraphedDetector (compile graphs / inductor) takes the images as they are with host indices and copies
        each run of adjacent image rows straight into its static buffers (one copy per neck level for a whole image
        batch); the eager detector takes one concatenated ImageFeatures and device indices (`index_select`).
        Benchmarks call this too, so that they time the gather the server runs (at one pair the `index_select`
        form's kernels took 0.2 ms in waterfall run 25; the copies, ~0.03 ms by pair_gather run 1's 8-pair timing)."""
        if self.compile != "none":
            return self.detector.ground(images, prompts, image_index, prompt_index)
        return self.detector.ground(_cat_features(images), prompts, torch.tensor(image_index, device=self.device),
                                    torch.tensor(prompt_index, device=self.device))

    def _check_prompts(self, prompts: Any) -> tuple[str, ...]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is None or len(prompts) == 0:
            raise BadRequest("missing_prompt", "no prompt: send at least one text prompt")
        if len(prompts) > self.cfg.max_prompts:
            raise BadRequest("too_many_prompts", f"{len(prompts)} prompts; the limit is {self.cfg.max_prompts}")
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise BadRequest("invalid_prompt", f"prompt {i} must be a string, got {type(p).__name__}")
            if not p.strip():
                raise BadRequest("empty_prompt", f"prompt {i} is empty")
            if len(p) > self.cfg.max_prompt_chars:
                raise BadRequest("prompt_too_long",
                                 f"prompt {i} has {len(p)} characters; the limit is {self.cfg.max_prompt_chars}")
        return tuple(prompts)

    def _check_threshold(self, threshold: Any) -> float:
        if threshold is None:
            return self.model_cfg.score_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise BadRequest("invalid_threshold", f"threshold must be a number in [0, 1], got {threshold!r}")
        return float(threshold)

    def _check_max_instances(self, max_instances: Any) -> int | None:
        if max_instances is None:
            return None
        if isinstance(max_instances, bool) or not isinstance(max_instances, int) or max_instances < 1:
            raise BadRequest("invalid_max_instances", f"max_instances must be an integer >= 1, got {max_instances!r}")
        return max_instances

