"""The row runners of benchmarks/waterfall.py (see its docstring): Meta per image and batched, Sammie engine rows,
the best bf16 engine's model-only / latency / extra-prompt rows, the HTTP row read from Locust files, and the
torch.profiler breakdown. Imported by waterfall.py, which puts the repository and benchmarks/ on sys.path first.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import statistics
import time
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from waterfall_bench import (Bench, MemoryWindow, Skipped, decode_pil, oracle_columns, summarise, sync, tf32,
                             timed_loop)

if TYPE_CHECKING:
    from waterfall import Row  # the row table lives in the entry point

META_FP32_MAX_REQUESTS = 24  # Meta fp32 per image runs ~9 img/s; 24 requests are enough for p50 and save the budget
# bf16 engines for the last rows
BEST_CANDIDATES = ("ours_bf16_inductor", "ours_bf16_triton", "ours_bf16_graphs", "ours_bf16_batched")


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


async def drive(engine, b: Bench, clients: int, seconds: float, min_requests: int = 0,
                max_instances: int | None = None) -> dict:
    """Closed loop: `clients` tasks each send the next (JPEG, prompt) case when their last answer arrives, each with
    its case's threshold and, if given, `max_instances` (the request option: the highest-scoring instances kept)."""
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
            res = await engine.segment(b.jpeg[photo], [prompt], threshold=b.thresholds[(photo, prompt)],
                                       max_instances=max_instances)
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
    """Stop `engine` (its loop and threads). Its memory goes with its last reference: callers drop theirs, then
    call `free_device_memory()`."""
    with contextlib.suppress(Exception):
        await engine.aclose()


def free_device_memory() -> None:
    """Collect what the dropped engines left (reference cycles) and hand the allocator's cached blocks back."""
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
        try:
            await engine.start()  # a failed warm-up or capture must not leave the loop's threads running
            start_s = time.perf_counter() - t0
            gate = getattr(engine, "vit_fp8", None)  # the engine's FP8 accuracy gate report (None: not requested)
            if row.engine.get("vit_fp8") and not getattr(gate, "enabled", False):
                raise RuntimeError(f"FP8 gate did not pass, the engine serves bf16: "
                                   f"{gate.as_dict() if hasattr(gate, 'as_dict') else gate}")
            # untimed: caches, allocator, first batches; --warmup-s (0 before 2026-12-02: one round of requests)
            await drive(engine, b, clients, b.args.warmup_s, min_requests=clients)
            stats = await drive(engine, b, clients, b.args.seconds)
            outputs = await engine_outputs(engine, b)
        except BaseException:  # closed here; its memory goes once the caller's exception is gone (run_rows frees it)
            await close_engine(engine)
            raise
    result = {**stats, "img_per_s": stats["rate"], "peak_gb": mem.peak_gb(), "tf32": False, "clients": clients,
              "warmup_s": b.args.warmup_s,
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


async def run_latency(b: Bench, name: str, engine, release_when_idle: bool | None = None, clients: int = 1,
                      max_instances: int | None = None) -> dict:
    """One client at a time (or `clients` in a closed loop) through `engine` as configured (`release_when_idle`
    None), or with its scheduler's stages' `release_when_idle` set to the given value for this row (restored after):
    the same engine, so rows differ only there. `max_instances`: every request's cap (None: none)."""
    import dataclasses

    mem = MemoryWindow(b.dev)
    sched = engine.scheduler
    saved = sched.config
    if release_when_idle is not None:
        sched.config = dataclasses.replace(
            saved, image=dataclasses.replace(saved.image, release_when_idle=release_when_idle),
            grounding=dataclasses.replace(saved.grounding, release_when_idle=release_when_idle))
    try:
        with tf32(False):
            stats = await drive(engine, b, clients, b.args.seconds,
                                min_requests=b.args.latency_requests if clients == 1 else 0,
                                max_instances=max_instances)
    finally:
        sched.config = saved
    return {**stats, "img_per_s": stats["rate"], "peak_gb": mem.peak_gb(_detector_bytes(engine)),
            "engine_row": name, "image_wait_ms": engine.cfg.image_wait_ms, "pair_wait_ms": engine.cfg.pair_wait_ms,
            "release_when_idle": saved.image.release_when_idle if release_when_idle is None else release_when_idle,
            "clients": clients, "max_instances": max_instances}


def _postprocess_one(engine, out, height: int, width: int, threshold: float, max_instances: int | None = None):
    """The engine's own post-processing for one pair (at most `max_instances` kept): the batched serving path when
    this tree has it, else the per-pair reference."""
    from sammie import segmenter

    if hasattr(segmenter, "postprocess_batch") and hasattr(engine, "registry"):
        return segmenter.postprocess_batch(engine.registry, out.logits, out.presence_logits, out.boxes,
                                           out.mask_logits, [(height, width)], [threshold], [max_instances],
                                           engine.model_cfg.mask_threshold)[0]
    return segmenter.postprocess_pair(out.logits[0], out.presence_logits[0], out.boxes[0], out.mask_logits[0],
                                      height, width, threshold, max_instances)


def run_extra_prompt(b: Bench, name: str, engine) -> dict:
    from sammie.decode import decode_image
    from sammie.preprocess import Preprocessor

    det, dev = engine.detector, b.dev
    photos = list(b.second_prompt)
    mem = MemoryWindow(dev)
    with tf32(False), torch.inference_mode():
        cached = {}  # photo -> (image features, (H, W)); the "cached image"
        for p in photos:
            rgb = decode_image(b.jpeg[p], 10**8)
            pixels = Preprocessor(b.cfg).batch([rgb], dev).to(engine.dtype)
            cached[p] = (det.encode_images(pixels), (int(rgb.shape[1]), int(rgb.shape[2])))
        text = {p: det.encode_prompts(engine.tokenizer([b.second_prompt[p]]).to(dev)) for p in photos}

        def ground(p, with_text: bool = False):  # alone: the model's share of the row (timed_loop synchronises)
            prompt = det.encode_prompts(engine.tokenizer([b.second_prompt[p]]).to(dev)) if with_text else text[p]
            # the engine's own call, so the row times the gather the server runs (every run up to 25 passed a device
            # index, which made a graphed detector `index_select` the image's neck levels: 0.2 ms of ground's 3.74 in
            # run 25's profile, where the server copies them)
            return engine.ground_pairs([cached[p][0]], prompt, [0], [0])

        def pair(p, with_text: bool, max_instances: int | None = None):
            h, w = cached[p][1]
            return _postprocess_one(engine, ground(p, with_text), h, w, b.thresholds[(p, b.second_prompt[p])],
                                    max_instances)

        for p in photos:  # warm-up
            pair(p, True)
        sync(dev)
        p0 = photos[0]
        lat = timed_loop(lambda i: pair(p0, False), b.args.seconds / 2, min_iters=10, dev=dev)
        lat_text = timed_loop(lambda i: pair(p0, True), b.args.seconds / 2, min_iters=10, dev=dev)
        # the split (2026-12-02): ground alone, and the answer capped at 9 instances (a real model's few; random
        # weights' near-threshold scores keep dozens, whose masks the post-processing upsamples and copies)
        lat_ground = timed_loop(lambda i: ground(p0), b.args.seconds / 4, min_iters=10, dev=dev)
        lat_capped = timed_loop(lambda i: pair(p0, False, 9), b.args.seconds / 4, min_iters=10, dev=dev)
        # --profile-extra-prompt: where ground's time goes at one pair (the kernels of ground_only's call)
        ground_profile = profile_calls(lambda: ground(p0), 50, dev) if b.args.profile_extra_prompt else None
        outputs = {(p, b.second_prompt[p]): pair(p, False) for p in photos}
        kept = len(outputs[(p0, b.second_prompt[p0])])
    stats = summarise(lat, len(lat), sum(lat) / 1e3)

    def brief(lat_ms: list[float]) -> dict:
        s = summarise(lat_ms, len(lat_ms), sum(lat_ms) / 1e3)
        return {"p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"], "n": s["n"]}

    return {**stats, "img_per_s": None, "pairs_per_s": stats["rate"], "peak_gb": mem.peak_gb(_detector_bytes(engine)),
            "engine_row": name, "photo": p0, "prompt": b.second_prompt[p0], "instances": kept,
            "uncached": brief(lat_text), "ground_only": brief(lat_ground),
            "capped": {**brief(lat_capped), "max_instances": 9, "instances": min(kept, 9)},
            **({"ground_profile": ground_profile} if ground_profile is not None else {}),
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


async def profile_engine(b: Bench, name: str, engine, clients: int = 0, max_instances: int | None = None) -> dict:
    """torch.profiler over ~3 s of `clients` (0: --clients) requests in flight through `engine`, each answer capped
    at `max_instances` (None: none; a capped row's post-processing load). The kernels are
    captured whatever thread launched them (CUPTI); the CPU ops and `record_function` ranges of the engine's stage
    worker threads are NOT (the profiler's callbacks are per thread, enabled in this one: pytorch/kineto#443), so
    `stages` stays empty for an engine."""
    from torch.profiler import ProfilerActivity, profile

    cuda = b.dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with tf32(False), profile(activities=activities) as prof:
        stats = await drive(engine, b, clients or b.args.clients, min(3.0, b.args.seconds), max_instances=max_instances)
    events = prof.key_averages()

    def dev_total(e):
        return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0)

    top, total = _top_events(events, cuda, 15)
    stages = {e.key: {"calls": e.count, "cpu_total_ms": e.cpu_time_total / 1e3, "device_total_ms": dev_total(e) / 1e3}
              for e in events if e.key.startswith("sammie.")}
    return {"engine_row": name, "clients": clients or b.args.clients, "max_instances": max_instances,
            "instances_per_request": stats.get("instances_per_request"), "seconds": stats["elapsed_s"],
            "requests": stats["n"], "img_per_s": stats["rate"],
            "top_kernels": top, "device_time_total_ms": total / 1e3, "stages": stages,
            "device_busy": device_busy(prof.events()) if cuda else None,
            "engine_stage_ms_mean": stats["engine_stage_ms_mean"]}


def _dev_self(e) -> float:
    """An event's own device time (us), under either of torch's attribute names."""
    return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0)


def _on_device(e) -> bool:
    """A profiler event that ran on the GPU (kernel, memcpy, memset)."""
    return "CUDA" in str(getattr(e, "device_type", ""))


def _device_events(events) -> list:
    """The averaged events with device time of their own (`prof.key_averages()`): what the kernel tables rank."""
    return [e for e in events if _on_device(e) and _dev_self(e) > 0]


def _top_events(events, cuda: bool, top: int) -> tuple[list[dict], float]:
    """The `top` kernels by device time (on the CPU: ops by self CPU time) of `prof.key_averages()`, each with its ms,
    share and calls, and the total (us) the shares are of."""
    if cuda:
        kernels = sorted(_device_events(events), key=_dev_self, reverse=True)
        total = sum(_dev_self(e) for e in kernels) or 1.0
        return [{"kernel": e.key[:160], "self_ms": _dev_self(e) / 1e3, "share_pct": 100 * _dev_self(e) / total,
                 "calls": e.count} for e in kernels[:top]], total
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in cpu) or 1.0
    return [{"op": e.key[:160], "self_ms": e.self_cpu_time_total / 1e3,
             "share_pct": 100 * e.self_cpu_time_total / total, "calls": e.count} for e in cpu[:top]], total


def profile_calls(fn, calls: int, dev: torch.device, top: int = 30) -> dict:
    """torch.profiler over `calls` calls of `fn` on this thread, each waited for before the next (as a timed call
    is: the latency's kernels and gaps, not a pipelined stream), after one untimed call. Returns the device events
    (kernels, memcpys, memsets) per call, `ms_per_call` (device time on CUDA; on the CPU, the ops' self CPU time),
    the `top` kernels (ops on the CPU) per call and, on CUDA, the GPU's busy share (`device_busy`). For a stage timed
    alone (extra_prompt's ground)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    fn()
    sync(dev)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            fn()
            sync(dev)
    events = prof.key_averages()
    ranked, total = _top_events(events, cuda, top)
    count = sum(e.count for e in _device_events(events)) if cuda else 0
    return {"calls": calls, "timed": "device" if cuda else "cpu self", "ms_per_call": total / 1e3 / calls,
            "device_events_per_call": count / calls if cuda else None,
            "top": [{**k, "self_ms": k["self_ms"] / calls, "calls": k["calls"] / calls} for k in ranked],
            "device_busy": device_busy(prof.events()) if cuda else None}


def device_busy(events) -> dict:
    """How much of the profiled window the GPU ran any kernel: the union of the kernels' [start, end) intervals (ms),
    against the window from the first kernel's start to the last one's end. The kernels' summed time exceeds the union
    where two streams overlapped."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if _on_device(e) and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    busy, (cur_start, cur_end) = 0.0, spans[0]
    gaps = []  # idle stretches (us) between busy ones: launch bubbles are short, a host-only phase long
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append(start - cur_end)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    window = max(end for _, end in spans) - spans[0][0]
    summed = sum(end - start for start, end in spans)
    short = [g for g in gaps if g < 100]
    return {"window_ms": window / 1e3, "busy_ms": busy / 1e3, "busy_pct": 100 * busy / window if window else 0.0,
            "kernels_summed_ms": summed / 1e3,
            # idle time in gaps under 0.1 ms (launch bubbles) and at or over it (host phases: decode, post-processing)
            "idle_short_ms": sum(short) / 1e3, "idle_short_gaps": len(short),
            "idle_long_ms": (sum(gaps) - sum(short)) / 1e3, "idle_long_gaps": len(gaps) - len(short)}
